"""Issue 23, the GPU path proven without a GPU: the CUDA kernels (``flash``, ``efficient``, ``cudnn``, and
``flash_attn`` through ``tests/support/cuda/flash_attn_standin.py``: 2.8's custom ops with fake kernels as the package
registers them, and 2.6's stand-in computing) run through the ring on the in-process loopback
transport, forward and backward, on fake CUDA tensors (torch's FakeTensorMode: the real aten ops'
fake kernels, so real output shapes, dtypes and strides, no data). See ``tests/support/cuda/fake_cuda_support.py``
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

import pytest
import torch

from cp_attention.kernels import cuda_flash_attn, get_kernel
from tests.support.core.strides import STRIDE_FORMS
from tests.support.cuda import flash_attn_standin
from tests.support.cuda.fake_cuda_cases import check_clean, env, lengths, ring_case  # noqa: F401 - env: the fixture

# pad_head reads data_ptr(): a fake tensor's is its storage offset in bytes (a real one's is 256-aligned)
pytestmark = pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")

LAYOUTS = ("contiguous", "zigzag", "interleaved")
KERNELS = ("flash", "efficient", "cudnn", "flash_attn")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
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


def refusal(kernel: str, kw: dict) -> str | None:
    """The ValueError a named kernel must raise for these features (a regex), or None if it runs them."""
    if kw.get("softcap") and kernel != "flash_attn":
        return rf"kernel '{kernel}' cannot apply softcap; use kernel='flash_attn'"
    if kw.get("window") and kernel not in ("efficient", "flash"):  # flash: its own window_size_left/right
        return rf"kernel '{kernel}' cannot apply sliding windows \(masks\); use kernel='flash'"
    if kernel == "cudnn" and kw.get("lengths"):  # one-token documents (or pieces) would reach it
        return r"kernel 'cudnn' cannot run packed documents.*use kernel='auto'"
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
        kw["lengths"] = lengths(world, n)
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


AUTO = [  # (label, kwargs, the kernel auto must pick on an sm90 GPU, with the flash-attn stand-in installed)
    ("plain", {}, "cudnn"),
    ("softcap 30", dict(softcap=30.0, use_lse=True), "flash_attn"),
    ("window (16,16) non-causal", dict(window=(16, 16), causal=False), "flash"),
    ("packed", dict(lengths="odd"), "flash"),
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
    choice = get_kernel("auto", "cuda", dtype, softcap=bool(kw.get("softcap")), mask=masked, head_dim=d, v_head_dim=dv)
    kind = ("masked" if masked else "varlen") if "lengths" in kw else "window" if masked else "causal"
    assert choice.picks[kind] == picks, choice.picks
    res = ring_case(env, world, "auto", "interleaved" if dname == "fp16" else "zigzag", dtype, **kw)
    check_clean(res, picks)


@pytest.mark.parametrize("kernel", ["flash", "efficient"])
def test_calls_without_a_plan(env, kernel):
    """ring_attention without plan=: with CPU cu_seqlens as clean as with a plan; with CUDA cu_seqlens
    one host read per call, as documented (``host_cu_seqlens``), and nothing else."""
    kw = dict(lengths=lengths(2, 64), layers=2, implicit=True)
    check_clean(ring_case(env, 2, kernel, "zigzag", torch.bfloat16, **kw), kernel)
    res = ring_case(env, 2, kernel, "interleaved", torch.float16, cu_on_cuda=True, **kw)
    reads = [e for e in res["events"] if e[1] == "d2h"]
    assert len(reads) == 2 * 2 and all("(host_cu_seqlens)" in e[3] and e[0] != "plan" for e in reads), reads
    check_clean({**res, "events": [e for e in res["events"] if e not in reads]}, kernel)


# ------------------------------------------------------------------- fused-op calls per ring step
def _rank0_calls_per_step(env, **case) -> tuple[dict, dict, dict]:
    """``ring_case(env, **case)`` counting the fused-op calls rank 0 makes at each ring step: (forward
    calls per step, backward calls per step, the case's result)."""
    from cp_attention.engine.ring import RingSource
    fwd_steps, bwd_steps = {}, {}

    def counting(fn, steps):
        def wrapped(source, s, *args):
            before = sum(env.aten.calls.values())
            try:  # a step's tasks (forward yields each task's results: all run here)
                return list(fn(source, s, *args))
            finally:  # ranks run one at a time, and never wait for a message inside a task
                if source.transport.rank == 0:
                    steps[s] = steps.get(s, 0) + sum(env.aten.calls.values()) - before
        return wrapped
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RingSource, "_step_forward", counting(RingSource._step_forward, fwd_steps))
        mp.setattr(RingSource, "_step_backward", counting(RingSource._step_backward, bwd_steps))
        res = ring_case(env, **case)
    return fwd_steps, bwd_steps, res


def _calls_per_step(env, kernel: str, docs: int) -> tuple[int, int]:
    """The most fused-op calls rank 0 makes at one ring step (forward, backward), for ``docs``
    documents of 16 tokens at N=2 (zigzag: every document has rows on both ranks)."""
    fwd_steps, bwd_steps, res = _rank0_calls_per_step(env, world=2, kernel=kernel, layout="zigzag",
                                                      dtype=torch.bfloat16, n=docs * 16 // 2, lengths=[16] * docs,
                                                      layers=1)
    check_clean(res, "flash" if kernel == "auto" else kernel)
    print(f"\n[issue 23] {kernel}: {docs} documents x 16 tokens, N=2: fused-op calls per ring step on rank 0: "
          f"forward {dict(sorted(fwd_steps.items()))}, backward {dict(sorted(bwd_steps.items()))}; "
          f"all ranks: {res['calls']}")
    return max(fwd_steps.values()), max(bwd_steps.values())


@pytest.mark.parametrize("kernel, few, many", [
    ("efficient", 16, 64),  # masked padded batches (DocBatch): one call per size bucket
    ("flash", 16, 64),  # variable-length batches (VarlenBatch, cum_seq_q/k): one call per mask kind
    ("auto", 16, 64),  # packed blocks go to flash's variable-length op (cudnn refuses packed documents by name)
])
def test_packed_calls_per_step_do_not_grow_with_documents(env, kernel, few, many):
    at_few, at_many = _calls_per_step(env, kernel, few), _calls_per_step(env, kernel, many)
    assert at_many <= at_few, (f"{kernel}: fused-op calls per ring step (forward, backward) grew from {at_few} "
                               f"({few} documents) to {at_many} ({many} documents)")


# ------------------------------------------------------------------ one-token blocks (issue 41)
@pytest.mark.parametrize("layout, n, mixed", [("contiguous", 1, False), ("zigzag", 2, True)])
def test_one_token_blocks_never_reach_cudnn(env, layout, n, mixed):
    """A one-token shard (or zigzag half): naming cudnn is refused on every rank before any exchange,
    naming a kernel that can; auto runs those blocks on flash (CheckedAten fails any cuDNN call with a
    one-token side), with no host sync. zigzag's 2x2 causal diagonal still runs on cuDNN."""
    with pytest.raises(ValueError, match=r"kernel 'cudnn' cannot run a 1x\d block.*use kernel='auto'"):
        ring_case(env, 2, "cudnn", layout, torch.bfloat16, n=n, layers=1)
    res = ring_case(env, 2, "auto", layout, torch.bfloat16, n=n, layers=1)
    check_clean(res, "flash")
    assert any(op.startswith("_scaled_dot_product_cudnn") for op in res["calls"]) == mixed, res["calls"]


def test_auto_runs_cudnn_and_flash_blocks_in_one_call(env):
    """zigzag at 6 tokens per rank: 3x3 halves go to cuDNN; none is refused, so flash never runs."""
    res = ring_case(env, 2, "auto", "zigzag", torch.bfloat16, n=6, layers=1)
    check_clean(res, "cudnn")
    assert not any(op.startswith("_flash") for op in res["calls"]), res["calls"]


@pytest.mark.parametrize("layout", ["zigzag", "interleaved", "contiguous"])
def test_a_dense_ring_step_is_one_kernel_call(env, layout):
    """Dense causal, N=4 on sm90: every ring step's blocks are ONE fused call forward and one backward
    on rank 0 (zigzag's halves included: its schedule gives one block per step, and each is square or
    full, so cuDNN takes it whole), and those calls are cuDNN's."""
    fwd_steps, bwd_steps, res = _rank0_calls_per_step(env, world=4, kernel="auto", layout=layout,
                                                      dtype=torch.bfloat16, n=32, layers=1)
    check_clean(res, "cudnn")
    skipped = {1, 2, 3} if layout == "contiguous" else set()  # rank 0 of contiguous sees no later shard
    assert fwd_steps == {s: int(s not in skipped) for s in range(4)}, fwd_steps
    assert bwd_steps == {s: int(s not in skipped) for s in range(4)}, bwd_steps
    assert not any(op.startswith("_flash") for op in res["calls"]), res["calls"]
