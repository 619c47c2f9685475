"""The fake-CUDA ring case shared by the tests that run the GPU path without a GPU
(``tests/unit/kernels/test_fake_cuda.py``, ``test_fake_cuda_harness.py``,
``tests/unit/strategies/test_fake_cuda_strategies.py``): the ``env`` fixture (fake CUDA installed for a
module), :func:`ring_case` (layers of ``ring_attention`` on every rank, forward and backward, under the
sync watcher) and :func:`check_clean` (no host sync, the kernel's own ops ran). See
``tests/support/cuda/fake_cuda_support.py`` for what is patched and how."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

import cp_attention as cpa
from cp_attention.kernels import cuda_flash_attn
from tests.support.core.strides import restride
from tests.support.cuda import flash_attn_standin
from tests.support.cuda.fake_cuda_checks import register_flash_attn_fakes
from tests.support.cuda.fake_cuda_support import FakeCuda, SyncWatch, cuda_guard_problem, phase, summarize, tape

# Which aten ops each kernel's forward / backward must reach (a kernel that fell back to another ran
# somewhere else). flash_attn's calls are counted on the stand-in.
OPS = {"flash": ("_flash_attention_forward", "_flash_attention_backward"),
       "efficient": ("_efficient_attention_forward", "_efficient_attention_backward"),
       "cudnn": ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward"),
       "flash_attn": ("_flash_attn_forward", "_flash_attn_backward")}


@pytest.fixture(scope="module")
def env():
    problem = cuda_guard_problem()
    if problem is not None:
        pytest.skip(f"fake CUDA needs a no-op CUDA device guard: {problem}")
    fake = FakeCuda()
    with pytest.MonkeyPatch.context() as mp:
        # flash-attn 2.8's calling convention (custom ops that write dq/dk/dv in place), with fake
        # kernels as the package registers them; test_flash_attn_2_6 runs 2.6's stand-in itself
        undo = register_flash_attn_fakes(flash_attn_standin.install(mp, "2.8.3"), fake.aten.calls)
        cuda_flash_attn._import_interface.cache_clear()
        cuda_flash_attn._split_for.cache_clear()
        fake.install(mp)
        try:
            yield fake
        finally:
            undo()
            fake.close()
    cuda_flash_attn._import_interface.cache_clear()
    cuda_flash_attn._split_for.cache_clear()


def lengths(world: int, n: int) -> list[int]:
    """Documents of odd lengths (one of a single token) filling ``world * n`` tokens."""
    base = [1, 50, 7, 70] if world == 2 else [1, 120, 7, 128]
    scale = world * n // sum(base)
    out = [x * scale for x in base]
    out[0] = 1
    out[-1] += world * n - sum(out)
    return out


def ring_case(env: FakeCuda, world: int, kernel: str, layout: str = "zigzag", dtype=torch.bfloat16, h=8, hkv=2,
              d=64, dv=None, n=64, b=2, causal=True, lengths=None, cu_on_cuda=False, window=(-1, -1),
              sinks=False, softcap=0.0, use_lse=False, layers=2, implicit=False, stride_form=None,
              ahead=False) -> dict:
    """``layers`` ring_attention calls on every rank with one plan (``implicit``: no plan, the plan's
    arguments given to every call), then their backwards in reverse order; returns the problems found
    and the watcher's events per rank, and the fused-op calls. ``stride_form``: q, k, v and dout in that
    memory form of :mod:`tests.support.core.strides` (a last dim whose stride is not 1). ``ahead``: each rank's
    plan is built by ``cpa.plan_ahead`` on the host (real tensors, as a loader worker would), pickled,
    and bound to the group and the device in the plan phase."""
    form = (lambda t: restride(t, stride_form)) if stride_form else (lambda t: t)  # noqa: E731
    dv = dv or d
    if lengths is not None:
        b = 1
        assert sum(lengths) == n * world
        cu = [0]
        for x in lengths:
            cu.append(cu[-1] + x)
        cu_real = torch.tensor(cu, dtype=torch.int32)

    def rank_fn(rank, watch: SyncWatch):
        problems = []
        with phase(watch, "plan"):
            cu_arg = None
            if lengths is not None:
                cu_arg = env.cuda_holding(cu_real) if cu_on_cuda else cu_real
            if ahead:
                with unset_fake_temporarily():
                    built = cpa.plan_ahead(layout, rank.rank, world, causal, cu if lengths is not None else None,
                                           window, local_len=n, kernel=kernel, device="cuda", dtype=dtype,
                                           head_dim=d, v_head_dim=dv, softcap=bool(softcap))
                    built = pickle.loads(pickle.dumps(built))
                plan, given = built.bind(rank, "cuda"), {}
            elif implicit:
                plan, given = None, dict(group=rank, layout=layout, causal=causal, cu_seqlens=cu_arg,
                                         window_size=window)
            else:
                plan, given = cpa.plan(layout, rank, causal=causal, cu_seqlens=cu_arg, window_size=window), {}
            inputs = []
            for _ in range(layers):
                q = form(env.fake(b, n, h, d, dtype=dtype, requires_grad=True))
                k = form(env.fake(b, n, hkv, d, dtype=dtype, requires_grad=True))
                v = form(env.fake(b, n, hkv, dv, dtype=dtype, requires_grad=True))
                s = env.fake(h, dtype=torch.float32, requires_grad=True) if sinks else None
                inputs.append((q, k, v, s))
        results = []
        for layer, (q, k, v, s) in enumerate(inputs):
            with phase(watch, "first call" if layer == 0 else "step"):
                results.append(cpa.ring_attention(q, k, v, plan=plan, kernel=kernel, sinks=s, softcap=softcap,
                                                  return_lse=True, **given))
        entries = list(tape())
        assert len(entries) == layers
        with phase(watch, "step"):
            for (ctx, (q, k, v, s)), (out, lse) in reversed(list(zip(entries, results))):
                if tuple(out.shape) != (b, n, h, dv) or out.dtype != dtype or out.device.type != "cuda":
                    problems.append(f"out {tuple(out.shape)} {out.dtype} {out.device}")
                if tuple(lse.shape) != (b, h, n) or lse.dtype != torch.float32 or lse.device.type != "cuda":
                    problems.append(f"lse {tuple(lse.shape)} {lse.dtype} {lse.device}")
                dout = form(env.fake(*out.shape, dtype=out.dtype))
                dlse = env.fake(*lse.shape, dtype=lse.dtype) if use_lse else None
                grads = env.ring_function.backward(ctx, dout, dlse)
                if len(grads) != 5 or grads[3] is not None:
                    problems.append(f"backward returned {len(grads)} values, plan's gradient {grads[3:4]}")
                # what the autograd engine's validate_outputs checks
                for name, t, g in (("q", q, grads[0]), ("k", k, grads[1]), ("v", v, grads[2]), ("sinks", s, grads[4])):
                    if t is None:
                        if g is not None:
                            problems.append(f"d{name} for no input")
                        continue
                    if g is None or tuple(g.shape) != tuple(t.shape) or g.dtype != t.dtype or g.device != t.device:
                        problems.append(f"d{name} {None if g is None else (tuple(g.shape), g.dtype, str(g.device))} "
                                        f"for {name} {tuple(t.shape), t.dtype, str(t.device)}")
        return problems, watch.events

    before = dict(env.aten.calls)
    per_rank = env.run(world, rank_fn)
    calls = {op: n - before.get(op, 0) for op, n in env.aten.calls.items() if n != before.get(op, 0)}
    return {"problems": sorted({p for probs, _ in per_rank for p in probs}),
            "events": [e for _, events in per_rank for e in events], "calls": calls}


def check_clean(res: dict, kernel: str | None, cu_on_cuda: bool = False, ahead: bool = False) -> None:
    """No wrong shape, no host sync anywhere, no blocking H2D copy after the plan, no upload after the
    first call (``ahead``: none in the first call either, the plan was built before); the named kernel's
    own ops ran, forward and backward."""
    events = res["events"]
    assert not res["problems"], res["problems"]
    bad = summarize(events, kinds=("d2h",), phases=("first call", "step"))
    bad += summarize(events, kinds=("h2d_blocking",), phases=("first call", "step"))
    bad += summarize(events, kinds=("h2d_async",), phases=("first call", "step") if ahead else ("step",))
    plan_reads = [e for e in events if e[0] == "plan" and e[1] == "d2h"]
    if not cu_on_cuda:
        bad += summarize(plan_reads, kinds=("d2h",))
    assert not bad, "host syncs / copies in the per-layer calls:\n  " + "\n  ".join(bad)
    if kernel is not None:
        fwd, bwd = OPS[kernel]
        assert res["calls"].get(fwd) and res["calls"].get(bwd), f"{kernel}'s ops did not run: {res['calls']}"
