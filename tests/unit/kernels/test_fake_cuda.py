"""Issue 23, the GPU path proven without a GPU: the CUDA kernels (``flash``, ``efficient``, ``cudnn``, and
``flash_attn`` through ``tests/support/flash_attn_standin.py``: 2.8's custom ops with fake kernels as the package
registers them, and 2.6's stand-in computing) run through the ring on the in-process loopback
transport, forward and backward, on fake CUDA tensors (torch's FakeTensorMode: the real aten ops'
fake kernels, so real output shapes, dtypes and strides, no data). See ``tests/support/fake_cuda_support.py``
for what is patched and how.

Every case fails on a host sync (a read of device data on the host: ``.item()``, ``.tolist()``,
``bool(t)``, ``nonzero``, a cuda->cpu copy), on a fused-op call the op's schema or its CUDA-side
checks would reject, and on any blocking host->device copy or device->host read during the per-layer
calls of a training step once the batch's plan is built. The first call of a batch builds the plan's
steps; their index tensors may be uploaded then, from pinned memory without blocking, and never again.
The matrix is pairwise: per kernel and dtype, plain causal on every layout at N=2 and 4, then one case
per feature.
"""

from __future__ import annotations

import functools
import itertools
import logging

import pytest
import torch

import cp_attention as cpa
from cp_attention.kernels import cuda_flash_attn, get_kernel

from tests.support import flash_attn_standin
from tests.support.fake_cuda_checks import PreconditionError, register_flash_attn_fakes
from tests.support.fake_cuda_support import FakeCuda, SyncWatch, cuda_guard_problem, phase, summarize, tape
from tests.support.strides import STRIDE_FORMS, restride

# pad_head reads data_ptr(): a fake tensor's is its storage offset in bytes (a real one's is 256-aligned)
pytestmark = pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")

LAYOUTS = ("contiguous", "zigzag", "interleaved")
KERNELS = ("flash", "efficient", "cudnn", "flash_attn")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
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


@pytest.fixture
def flash_attn_2_6(env, monkeypatch):
    """flash-attn 2.6's stand-in (plain functions computing in torch: they run on fake tensors as they
    are), its calls counted."""
    iface = flash_attn_standin.install(monkeypatch, "2.6.3")
    for name in ("_flash_attn_forward", "_flash_attn_backward"):
        monkeypatch.setattr(iface, name, _counted(getattr(iface, name), env.aten.calls, name))
    cuda_flash_attn._split_for.cache_clear()
    yield iface
    cuda_flash_attn._split_for.cache_clear()


def _counted(fn, calls, name):
    @functools.wraps(fn)  # keeps the signature, which tells the calling convention
    def call(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)
    return call


# ------------------------------------------------------------------------------------- one case
def _lengths(world: int, n: int) -> list[int]:
    """Documents of odd lengths (one of a single token) filling ``world * n`` tokens."""
    base = [1, 50, 7, 70] if world == 2 else [1, 120, 7, 128]
    scale = world * n // sum(base)
    out = [x * scale for x in base]
    out[0] = 1
    out[-1] += world * n - sum(out)
    return out


def ring_case(env: FakeCuda, world: int, kernel: str, layout: str = "zigzag", dtype=torch.bfloat16, h=8, hkv=2,
              d=64, dv=None, n=64, b=2, causal=True, lengths=None, cu_on_cuda=False, window=(-1, -1),
              sinks=False, softcap=0.0, use_lse=False, layers=2, implicit=False, stride_form=None) -> dict:
    """``layers`` ring_attention calls on every rank with one plan (``implicit``: no plan, the plan's
    arguments given to every call), then their backwards in reverse order; returns the problems found
    and the watcher's events per rank, and the fused-op calls. ``stride_form``: q, k, v and dout in that
    memory form of :mod:`tests.support.strides` (a last dim whose stride is not 1)."""
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
            if implicit:
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


def check_clean(res: dict, kernel: "str | None", cu_on_cuda: bool = False) -> None:
    """No wrong shape, no host sync anywhere, no blocking H2D copy after the plan, no upload after the
    first call; the named kernel's own ops ran, forward and backward."""
    events = res["events"]
    assert not res["problems"], res["problems"]
    bad = summarize(events, kinds=("d2h",), phases=("first call", "step"))
    bad += summarize(events, kinds=("h2d_blocking",), phases=("first call", "step"))
    bad += summarize(events, kinds=("h2d_async",), phases=("step",))
    plan_reads = [e for e in events if e[0] == "plan" and e[1] == "d2h"]
    if not cu_on_cuda:
        bad += summarize(plan_reads, kinds=("d2h",))
    assert not bad, "host syncs / copies in the per-layer calls:\n  " + "\n  ".join(bad)
    if kernel is not None:
        fwd, bwd = OPS[kernel]
        assert res["calls"].get(fwd) and res["calls"].get(bwd), f"{kernel}'s ops did not run: {res['calls']}"


# ---------------------------------------------------------------------------------------- matrix
FEATURES = [  # (label, ring_case kwargs)
    ("MHA 4:4 d=128", dict(h=4, hkv=4, d=128)),
    ("MQA 8:1", dict(hkv=1)),
    ("MLA d=128 dv=64", dict(d=128, dv=64)),
    ("MLA d=192 dv=128", dict(d=192, dv=128)),
    ("head dim 256 + dlse", dict(d=256, use_lse=True)),
    ("return_lse + dlse", dict(use_lse=True)),
    ("sinks + dlse", dict(sinks=True, use_lse=True)),
    ("non-causal", dict(causal=False)),
    ("packed, cu_seqlens on CPU", dict(lengths="odd")),
    # the device cu_seqlens only changes how the plan is built: N=2, one layer
    ("packed, cu_seqlens on CUDA", dict(lengths="odd", cu_on_cuda=True, world=2, layers=1)),
    ("window (24,-1)", dict(window=(24, -1))),
    ("packed + window (20,-1)", dict(lengths="odd", window=(20, -1))),
    ("softcap 30", dict(softcap=30.0)),
    ("softcap 30 + MQA + dlse", dict(softcap=30.0, hkv=1, use_lse=True)),
]


def refusal(kernel: str, kw: dict) -> "str | None":
    """The ValueError a named kernel must raise for these features (a regex), or None if it runs them."""
    if kw.get("softcap") and kernel != "flash_attn":
        return rf"kernel '{kernel}' cannot apply softcap; use kernel='flash_attn'"
    if kw.get("window") and kernel != "efficient":
        return rf"kernel '{kernel}' cannot apply sliding windows \(masks\); use kernel='efficient'"
    if kernel == "cudnn" and max(kw.get("d", 64), kw.get("dv") or 0) > 128:
        return r"kernel 'cudnn' does not take head dim"
    return None


def _cases():
    """Per kernel: plain causal on every layout at N=2 and N=4 in both dtypes (a second layer at N=2
    zigzag); then each feature once, the dtype, N and layout rotating with the feature and the kernel,
    so every feature meets both dtypes, both Ns and every layout across the kernels."""
    cases = []
    names = list(DTYPES)
    for ki, kernel in enumerate(KERNELS):
        for dname, world, layout in itertools.product(names, (2, 4), LAYOUTS):
            layers = 2 if (world, layout) == (2, "zigzag") else 1
            cases.append(pytest.param(kernel, DTYPES[dname], world, layout, "plain causal GQA 8:2", {"layers": layers},
                                      id=f"{kernel}-{dname}-N{world}-{layout}-plain"))
        for i, (label, kw) in enumerate(FEATURES):
            dname = names[(i + ki) % 2]
            kw = dict(kw)
            world = kw.pop("world", (2, 4)[(i // 2 + ki) % 2])
            layout = LAYOUTS[(i + 2 * ki) % 3]
            # a second layer where the plan holds device state (packed batches' indices, band masks)
            kw = {"layers": 2 if ("lengths" in kw or "window" in kw) else 1, **kw}
            cases.append(pytest.param(kernel, DTYPES[dname], world, layout, label, kw,
                                      id=f"{kernel}-{dname}-N{world}-{layout}-{label.replace(' ', '_')}"))
    return cases


def _kwargs(kw: dict, world: int, n: int = 64) -> dict:
    kw = dict(kw)
    if kw.get("lengths") == "odd":
        kw["lengths"] = _lengths(world, n)
    return kw


@pytest.mark.parametrize("kernel, dtype, world, layout, label, kw", _cases())
def test_ring_on_fake_cuda(env, kernel, dtype, world, layout, label, kw):
    kw = _kwargs(kw, world)
    expected = refusal(kernel, kw)
    if expected is not None:
        with pytest.raises(ValueError, match=expected):
            ring_case(env, world, kernel, layout, dtype, **{**kw, "layers": 1})
        return
    res = ring_case(env, world, kernel, layout, dtype, **kw)
    # flash's head dim 256 backward carries one more column (the LSE's gradient): 257 runs on efficient
    check_clean(res, None if (kernel == "flash_attn" or "256" in label) else kernel,
                cu_on_cuda=kw.get("cu_on_cuda", False))
    if kernel == "flash_attn":
        assert res["calls"].get("_flash_attn_forward"), res["calls"]
        assert res["calls"].get("_flash_attn_backward" if "256" not in label else "_efficient_attention_backward"), \
            res["calls"]


@pytest.mark.parametrize("form", list(STRIDE_FORMS))
@pytest.mark.parametrize("kernel", KERNELS)
def test_strided_inputs_on_fake_cuda(env, kernel, form):
    """q, k, v and dout whose last dim is not contiguous reach every CUDA kernel with a unit last-dim
    stride (each op's own check, in CheckedAten and the flash-attn stand-in, refuses anything else)."""
    res = ring_case(env, 2, kernel, "zigzag", torch.bfloat16, layers=1, stride_form=form,
                    **({"softcap": 30.0} if kernel == "flash_attn" else {}))
    check_clean(res, None if kernel == "flash_attn" else kernel)


@pytest.mark.parametrize("world, layout, kw", [
    (2, "zigzag", {"layers": 2}),
    (4, "contiguous", dict(softcap=30.0, hkv=1, use_lse=True)),
    (2, "interleaved", dict(d=128, dv=64, softcap=30.0, lengths="odd")),
], ids=["N2-zigzag-plain", "N4-contiguous-softcap_MQA_dlse", "N2-interleaved-MLA_softcap_packed"])
def test_flash_attn_2_6(env, flash_attn_2_6, world, layout, kw):
    """flash-attn 2.6's calling convention (window as a pair, results in a longer tuple), its stand-in
    computing on the fake tensors."""
    assert cuda_flash_attn.split_window_api(flash_attn_2_6) is False
    res = ring_case(env, world, "flash_attn", layout, torch.float16, **_kwargs(kw, world))
    check_clean(res, "flash_attn")


AUTO = [  # (label, kwargs, the kernel auto must pick, with the flash-attn stand-in installed)
    ("plain", {}, "flash"),
    ("softcap 30", dict(softcap=30.0, use_lse=True), "flash_attn"),
    ("window (16,16) non-causal", dict(window=(16, 16), causal=False), "efficient"),
    ("packed + window (20,-1)", dict(lengths="odd", window=(20, -1)), "efficient"),
    ("head dim 320", dict(d=320), "efficient"),
]


@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("label, kw, picks", AUTO, ids=[a[0].replace(" ", "_") for a in AUTO])
def test_auto_picks_a_capable_kernel(env, dname, label, kw, picks):
    dtype = DTYPES[dname]
    world = 2
    kw = _kwargs(kw, world)
    d, dv = kw.get("d", 64), kw.get("dv")
    masked = kw.get("window", (-1, -1)) != (-1, -1)
    assert get_kernel("auto", "cuda", dtype, softcap=bool(kw.get("softcap")), mask=masked, head_dim=d,
                      v_head_dim=dv).name == picks
    res = ring_case(env, world, "auto", "interleaved" if dname == "fp16" else "zigzag", dtype, **kw)
    check_clean(res, picks)


@pytest.mark.parametrize("kernel", ["flash", "efficient"])
def test_calls_without_a_plan(env, kernel):
    """ring_attention without plan=: with CPU cu_seqlens as clean as with a plan; with CUDA cu_seqlens
    one host read per call, as documented (``host_cu_seqlens``), and nothing else."""
    kw = dict(lengths=_lengths(2, 64), layers=2, implicit=True)
    check_clean(ring_case(env, 2, kernel, "zigzag", torch.bfloat16, **kw), kernel)
    res = ring_case(env, 2, kernel, "interleaved", torch.float16, cu_on_cuda=True, **kw)
    reads = [e for e in res["events"] if e[1] == "d2h"]
    assert len(reads) == 2 * 2 and all("(host_cu_seqlens)" in e[3] and e[0] != "plan" for e in reads), reads
    check_clean({**res, "events": [e for e in res["events"] if e not in reads]}, kernel)


# ------------------------------------------------------------------- fused-op calls per ring step
def _calls_per_step(env, kernel: str, docs: int) -> tuple[int, int]:
    """The most fused-op calls rank 0 makes at one ring step (forward, backward), for ``docs``
    documents of 16 tokens at N=2 (zigzag: every document has rows on both ranks)."""
    from cp_attention.engine.ring import RingSchedule
    fwd_steps, bwd_steps = {}, {}

    def counting(fn, steps):
        def wrapped(schedule, s, *args):
            before = sum(env.aten.calls.values())
            try:  # a step's tasks (forward yields each task's results: all run here)
                return list(fn(schedule, s, *args))
            finally:  # ranks run one at a time, and never wait for a message inside a task
                if schedule.comm.rank == 0:
                    steps[s] = steps.get(s, 0) + sum(env.aten.calls.values()) - before
        return wrapped
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RingSchedule, "_step_forward", counting(RingSchedule._step_forward, fwd_steps))
        mp.setattr(RingSchedule, "_step_backward", counting(RingSchedule._step_backward, bwd_steps))
        res = ring_case(env, 2, kernel, "zigzag", torch.bfloat16, n=docs * 16 // 2, lengths=[16] * docs, layers=1)
    check_clean(res, kernel)
    print(f"\n[issue 23] {kernel}: {docs} documents x 16 tokens, N=2: fused-op calls per ring step on rank 0: "
          f"forward {dict(sorted(fwd_steps.items()))}, backward {dict(sorted(bwd_steps.items()))}; "
          f"all ranks: {res['calls']}")
    return max(fwd_steps.values()), max(bwd_steps.values())


@pytest.mark.parametrize("kernel, few, many", [
    ("efficient", 16, 64),  # masked padded batches (DocBatch): one call per size bucket
    ("flash", 16, 64),  # variable-length batches (VarlenBatch, cum_seq_q/k): one call per mask kind
    pytest.param("cudnn", 4, 16, marks=pytest.mark.xfail(
        strict=True, reason="issue 23: cudnn (no varlen, no masks) runs one call per document block")),
])
def test_packed_calls_per_step_do_not_grow_with_documents(env, kernel, few, many):
    at_few, at_many = _calls_per_step(env, kernel, few), _calls_per_step(env, kernel, many)
    assert at_many <= at_few, (f"{kernel}: fused-op calls per ring step (forward, backward) grew from {at_few} "
                               f"({few} documents) to {at_many} ({many} documents)")


# ------------------------------------------------------------------ the harness catches what it says
def _under_watch(env, fn) -> list:
    events: list = []
    watch = SyncWatch(events)
    watch.phase = "step"
    with env.lock, env.mode, watch:
        fn()
    return events


@pytest.mark.parametrize("what, fn", [
    (".item()", lambda x: x.sum().item()),
    (".tolist()", lambda x: x.tolist()),
    ("bool(t)", lambda x: bool(x[0] > 0)),
    ("nonzero", lambda x: torch.nonzero(x > 0)),
    ("int(t)", lambda x: int(x[0])),
])
def test_watch_catches_host_reads(env, what, fn):
    def go():
        try:
            fn(torch.empty(4, device="cuda"))
        except Exception:  # noqa: BLE001 - the fake mode refuses data-dependent results: the log is what counts
            pass
    assert [e for e in _under_watch(env, go) if e[1] == "d2h"], what


def test_watch_catches_copies(env):
    def go():
        x = torch.empty(4, device="cuda")
        x.cpu()
        torch.tensor([1, 2], device="cuda")
        torch.arange(3).to("cuda", non_blocking=True)  # pageable: the host waits all the same
        torch.arange(3).pin_memory().to("cuda", non_blocking=True)
    kinds = [e[1] for e in _under_watch(env, go)]
    assert kinds == ["d2h", "h2d_blocking", "h2d_blocking", "h2d_async"], kinds


def test_checked_ops_reject_bad_calls(env):
    from cp_attention.kernels import cuda_efficient, cuda_flash
    x = lambda *s: torch.empty(*s, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    with env.lock, env.mode:
        with pytest.raises(PreconditionError, match="head_size 100"):
            cuda_flash._aten._flash_attention_forward(x(1, 8, 2, 100), x(1, 8, 2, 100), x(1, 8, 2, 100), None, None,
                                                      8, 8, 0.0, False, False)
        with pytest.raises(TypeError, match="positional"):
            cuda_flash._aten._flash_attention_forward(x(1, 8, 2, 64), x(1, 8, 2, 64), x(1, 8, 2, 64), None, None,
                                                      8, 8, 0.0, False, False, 0.1)
        with pytest.raises(TypeError, match="unexpected or repeated argument 'softmax_scale'"):
            cuda_flash._aten._flash_attention_forward(x(1, 8, 2, 64), x(1, 8, 2, 64), x(1, 8, 2, 64), None, None,
                                                      8, 8, 0.0, False, False, softmax_scale=0.1)
        with pytest.raises(PreconditionError, match="no GQA"):
            cuda_efficient._aten._efficient_attention_forward(x(1, 8, 4, 64), x(1, 8, 2, 64), x(1, 8, 2, 64), None,
                                                              None, None, None, None, 0.0, 0, True)
        lse = torch.empty(1, 2, 8, device="cuda")
        seed = torch.zeros((), dtype=torch.int64, device="cuda")
        with pytest.raises(PreconditionError, match="round32"):
            cuda_efficient._aten._efficient_attention_backward(
                x(1, 8, 2, 64), x(1, 8, 2, 64), x(1, 8, 2, 64), x(1, 8, 2, 64), None, x(1, 8, 2, 64), None, None,
                8, 8, lse, 0.0, seed, seed, 0, False)


@pytest.mark.parametrize("mutation, kind", [
    ("a scalar read of a device tensor, its error swallowed", "d2h"),
    ("a constant made with torch.tensor(..., device=...)", "h2d_blocking"),
    ("an upload from pageable memory", "h2d_blocking"),
])
def test_ring_catches_a_host_sync_in_a_kernel(env, monkeypatch, mutation, kind):
    """A flash backward that syncs or copies each call must fail the case, naming where."""
    from cp_attention.kernels.cuda_flash import FlashKernel
    orig = FlashKernel._bwd

    def mutant(self, dout, q, *args, **kwargs):
        if kind == "d2h":
            try:
                dout.sum().item()
            except Exception:  # noqa: BLE001 - swallowed: only the watcher sees it
                pass
        elif "pageable" in mutation:
            torch.arange(4).to(q.device, non_blocking=True)
        else:
            torch.tensor([1.0], device=q.device)
        return orig(self, dout, q, *args, **kwargs)
    monkeypatch.setattr(FlashKernel, "_bwd", mutant)
    res = ring_case(env, 2, "flash", "zigzag", torch.bfloat16, layers=1)
    with pytest.raises(AssertionError, match=rf"{kind}: .* at cp_attention/kernels/_cuda.py:\d+ \(backward\) \[step\]"):
        check_clean(res, "flash")


def test_wrong_lse_layout_is_caught(env, monkeypatch):
    """A mutant flash kernel whose LSE comes back [B, Sq, H] must fail the case."""
    from cp_attention.kernels.cuda_flash import FlashKernel
    # the fake mode logs the meta kernel it could not run; the failure is what counts
    monkeypatch.setattr(logging.getLogger("torch._subclasses.fake_tensor"), "disabled", True)
    orig = FlashKernel._fwd
    monkeypatch.setattr(FlashKernel, "_fwd", lambda self, *a, **k: (lambda o: (o[0], o[1].transpose(1, 2)))(
        orig(self, *a, **k)))
    with pytest.raises(Exception):  # noqa: B017 - any failure: a shape check, a merge, a precondition
        res = ring_case(env, 2, "flash", "zigzag", torch.bfloat16, h=8, hkv=2, n=16, layers=1)
        check_clean(res, "flash")
