"""The strategies beyond the ring on the GPU path, proven without a GPU (see tests/unit/kernels/test_fake_cuda.py for
the harness): all-gather, Ulysses all-to-all and all-to-all inside a ring, on fake CUDA tensors through
the real CUDA attention ops' shape rules, forward and backward, with no host sync and no upload once the
batch's plan is built, in every layer's call and in the all-to-all's own backward.
"""

from __future__ import annotations

import pytest
import torch

import cp_attention as cpa
from cp_attention.engine.function import AttentionFunction
from cp_attention.strategies import alltoall, dispatch
from tests.support.core.strides import restride
from tests.support.cuda.fake_cuda_cases import check_clean, env  # noqa: F401 - env: the fixture
from tests.support.cuda.fake_cuda_support import ManualRingFunction, phase, tape

pytestmark = pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")

CASES = [  # (cp_comm_type, world, mesh shape, kernel, ring_case-like options)
    ("all_gather", 4, None, "flash", dict(layout="zigzag")),
    ("all_gather", 2, None, "efficient", dict(layout="interleaved", lengths=(1, 70, 57), window=(20, -1))),
    ("a2a", 4, None, "flash", dict(layout="zigzag", hkv=2, sinks=True)),
    # a 1-token document: auto runs the packed batch on flash's varlen op (cudnn named is refused below)
    ("a2a", 2, None, "auto", dict(layout="contiguous", lengths=(1, 70, 57))),
    ("a2a+p2p", 4, (2, 2), "flash", dict(layout="interleaved", hkv=1)),
    ("a2a+p2p", 4, (2, 2), "efficient", dict(layout="zigzag", window=(24, -1))),
]


def strategy_case(env, comm: str, world: int, mesh, kernel: str, layout: str, h: int = 8, hkv: int = 2, d: int = 64,
                  n: int = 64, b: int = 1, lengths=None, window=(-1, -1), sinks: bool = False,
                  stride_form: str | None = None) -> dict:
    """Two layers' calls with one plan, then their backwards (the composite's and the all-to-all's) in
    reverse; the problems and the watcher's events of every rank. ``stride_form``: q, k, v and dout in
    that memory form of :mod:`tests.support.core.strides` (a last dim whose stride is not 1)."""
    form = (lambda t: restride(t, stride_form)) if stride_form else (lambda t: t)  # noqa: E731
    cu = None
    if lengths is not None:
        total = n * world
        cu = torch.tensor([0, *(sum(lengths[:i + 1]) for i in range(len(lengths) - 1)), total], dtype=torch.int32)

    def rank_fn(rank, watch):
        problems = []
        with phase(watch, "plan"):
            plan = cpa.plan(layout, rank, causal=True, cu_seqlens=cu, window_size=window)
            layers = [tuple(form(env.fake(b, n, hh, d, requires_grad=True)) for hh in (h, hkv, hkv)) for _ in range(2)]
            s = env.fake(h, dtype=torch.float32, requires_grad=True) if sinks else None
        outs = []
        for i, (q, k, v) in enumerate(layers):
            with phase(watch, "first call" if i == 0 else "step"):
                outs.append(cpa.ring_attention(q, k, v, plan=plan, kernel=kernel, sinks=s, cp_comm_type=comm,
                                               return_lse=True))
        inner = rank.levels[1] if comm == "a2a+p2p" else rank
        with phase(watch, "step"):
            for (ctx, (_qh, kh, vh, _)), (q, k, v), (out, lse) in reversed(list(zip(tape(), layers, outs))):
                if tuple(out.shape) != (b, n, h, d) or tuple(lse.shape) != (b, h, n):
                    problems.append(f"out {tuple(out.shape)}, lse {tuple(lse.shape)}")
                saved_out = ctx.saved_tensors[3]
                dq, dk, dv, _, dsinks = env.ring_function.backward(ctx, form(torch.empty_like(saved_out)),
                                                                   env.fake(*saved_out.shape[:1], saved_out.shape[2],
                                                                            saved_out.shape[1], dtype=torch.float32))
                if (comm != "all_gather") and dk.shape[2] != kh.shape[2]:
                    problems.append(f"dk heads {dk.shape[2]} for k heads {kh.shape[2]}")
                grads = (dq, dk, dv) if comm == "all_gather" else alltoall._split_seq([dq, dk, dv], inner)
                for name, t, g in zip("qkv", (q, k, v) if comm == "all_gather" else (q, kh, vh), grads):
                    want = (b, n, t.shape[2], d) if comm != "all_gather" and name != "q" else tuple(t.shape)
                    if comm != "all_gather" and name != "q":
                        want = (b, n, t.shape[2] * inner.world_size, d)
                    if tuple(g.shape) != want or g.dtype != t.dtype or g.device.type != "cuda":
                        problems.append(f"d{name} {tuple(g.shape)} {g.dtype} for {want}")
                if sinks and (dsinks is None or tuple(dsinks.shape) != (h // inner.world_size,)):
                    problems.append(f"dsinks {None if dsinks is None else tuple(dsinks.shape)}")
        return problems, watch.events

    per_rank = env.run(world, rank_fn, mesh_shape=mesh)
    return {"problems": sorted({p for probs, _ in per_rank for p in probs}),
            "events": [e for _, events in per_rank for e in events], "calls": dict(env.aten.calls)}


@pytest.mark.parametrize("comm, world, mesh, kernel, kw", CASES,
                         ids=[f"{c[0]}-N{c[1]}-{c[3]}-{c[4]['layout']}{'-packed' if 'lengths' in c[4] else ''}"
                              f"{'-window' if 'window' in c[4] else ''}" for c in CASES])
def test_strategies_on_fake_cuda(env, monkeypatch, comm, world, mesh, kernel, kw):  # noqa: F811 - the fixture
    function = ManualRingFunction(AttentionFunction)
    monkeypatch.setattr(dispatch, "AttentionFunction", function)
    monkeypatch.setattr(env, "ring_function", function)
    res = strategy_case(env, comm, world, mesh, kernel, **kw)
    check_clean(res, "flash" if kernel == "auto" else kernel)


def test_cudnn_named_for_packed_documents_is_refused_before_any_exchange(env, monkeypatch):  # noqa: F811
    function = ManualRingFunction(AttentionFunction)
    monkeypatch.setattr(dispatch, "AttentionFunction", function)
    monkeypatch.setattr(env, "ring_function", function)
    with pytest.raises(ValueError, match=r"kernel 'cudnn' cannot run packed documents.*kernel='auto'"):
        strategy_case(env, "a2a", 2, None, "cudnn", layout="contiguous", lengths=(1, 70, 57))


@pytest.mark.parametrize("comm, world, mesh", [("all_gather", 2, None), ("a2a", 2, None), ("a2a+p2p", 4, (2, 2))])
def test_strategies_take_strided_inputs_on_fake_cuda(env, monkeypatch, comm, world, mesh):  # noqa: F811
    """q, k, v and dout whose last dim is not contiguous reach the CUDA kernels with a unit last-dim
    stride on every strategy (the ops' own checks in CheckedAten refuse anything else)."""
    function = ManualRingFunction(AttentionFunction)
    monkeypatch.setattr(dispatch, "AttentionFunction", function)
    monkeypatch.setattr(env, "ring_function", function)
    check_clean(strategy_case(env, comm, world, mesh, "flash", layout="zigzag", stride_form="transposed"), "flash")


@pytest.mark.parametrize("world", [2, 4])
def test_decode_attention_on_fake_cuda(env, world):  # noqa: F811 - the fixture
    """Generation's pass-Q step (a sharded cache's keys, one query per row, the LSE merge over the
    group): fake CUDA tensors in and out, bf16 in, no host sync."""
    from cp_attention.engine.decode import decode_attention

    def rank_fn(rank, watch):
        with phase(watch, "step"):
            q = env.fake(3, 8, 64)
            k, v = env.fake(3, 2, 37, 64), env.fake(3, 2, 37, 64)
            positions = torch.empty(3, 37, dtype=torch.long, device="cuda")
            visible = (positions >= 0) & (positions >= 90 - 15)
            sinks = env.fake(8, dtype=torch.float32)
            out, lse = decode_attention(q, k, v, visible, rank, 0.125, 30.0, sinks)
        ok = (tuple(out.shape), out.dtype, out.device.type, tuple(lse.shape)) == ((3, 8, 64), torch.bfloat16, "cuda",
                                                                                 (3, 8))
        problems = [] if ok else [f"out {tuple(out.shape)} {out.dtype} {out.device}, lse {tuple(lse.shape)}"]
        return problems, watch.events

    per_rank = env.run(world, rank_fn)
    check_clean({"problems": [p for probs, _ in per_rank for p in probs],
                 "events": [e for _, events in per_rank for e in events], "calls": {}}, None)
