"""The CUDA kernels' plumbing, on CPU: each kernel runs against plain-torch stand-ins of the ops it
calls (``tests/support/cuda/aten_standins.py``: bound to the installed torch's real schemas, with the CUDA code's
checks and masking conventions; ``tests/support/cuda/flash_attn_standin.py``: flash-attn 2.6 / 2.7 / 2.8 with
their exact signatures), and must match fp64 top-left-causal attention, forward, LSE and backward.
The ``flash`` and ``cudnn`` kernels also run on meta tensors through the real ops' schemas."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from cp_attention.kernels import cuda_cudnn, cuda_efficient, cuda_flash, cuda_flash_attn, get_kernel
from cp_attention.kernels.cuda_flash_attn import FlashAttnKernel, split_window_api
from tests.support.cuda import flash_attn_standin
from tests.support.cuda.aten_standins import AtenStandIns, bind
from tests.support.cuda.flash_attn_standin import attend

SHAPES = [  # (Sq, Sk, H, Hkv, D, Dv, causal): GQA, MQA, v head dim != q's, Sq != Sk both ways
    (8, 8, 4, 4, 8, 8, True), (7, 5, 4, 2, 8, 12, True), (5, 7, 2, 1, 16, 8, True), (6, 6, 4, 1, 8, 8, False),
    (1, 9, 2, 2, 4, 4, True), (9, 1, 2, 2, 4, 4, True), (20, 7, 4, 2, 12, 20, True), (3, 11, 4, 1, 20, 6, True),
]
ATEN_KERNELS = {"flash": cuda_flash, "efficient": cuda_efficient, "cudnn": cuda_cudnn}
TOL = dict(atol=2e-5, rtol=1e-5)  # fp32 inputs and LSE against an fp64 reference


@pytest.fixture
def aten(monkeypatch):
    """The stand-in ops, patched into every aten-based kernel module."""
    ops = AtenStandIns()
    for mod in ATEN_KERNELS.values():
        monkeypatch.setattr(mod, "_aten", ops)
    return ops


def _inputs(shape, seed=0, dtype=torch.float32):
    sq, sk, h, hkv, d, dv, _ = shape
    g = torch.Generator().manual_seed(seed)
    # slices along the sequence of longer tensors, as the ring hands them over
    q = torch.randn(2, sq + 3, h, d, generator=g, dtype=dtype)[:, 1:1 + sq]
    k = torch.randn(2, sk + 2, hkv, d, generator=g, dtype=dtype)[:, 2:]
    v = torch.randn(2, sk + 2, hkv, dv, generator=g, dtype=dtype)[:, :sk]
    return q, k, v


def _reference(q, k, v, causal, scale, mask=None, softcap=0.0):
    """fp64 out, lse and the autograd gradients for a fixed dout, top-left causal."""
    allowed = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril() if causal else None
    if mask is not None:
        allowed = mask[:, None] if allowed is None else allowed & mask[:, None]
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lse = attend(qd, kd, vd, scale, allowed, softcap)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    grads = torch.autograd.grad(out, (qd, kd, vd), dout)
    return out.detach(), lse.detach(), dout, grads


def _check(kernel, q, k, v, causal, scale, **kw):
    mask, softcap = kw.get("mask"), kw.get("softcap", 0.0)
    out, lse, dout, grads = _reference(q, k, v, causal, scale, mask, softcap)
    o, l = kernel.forward(q, k, v, causal, scale, **kw)
    assert o.shape == out.shape and l.shape == lse.shape and l.dtype == torch.float32
    torch.testing.assert_close(o.double(), out, **TOL)
    torch.testing.assert_close(l.double(), lse, **TOL)
    got = kernel.backward(dout.to(q.dtype), q, k, v, out.to(q.dtype), lse.float(), causal, scale, **kw)
    for g, want, like in zip(got, grads, (q, k, v)):
        assert g.shape == like.shape
        torch.testing.assert_close(g.double(), want, **TOL)


@pytest.mark.parametrize("name", sorted(ATEN_KERNELS))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_aten_kernels_match_top_left_reference(aten, name, shape):
    if name == "cudnn" and min(shape[:2]) == 1:  # cuDNN takes no one-token side: refused, never run
        with pytest.raises(ValueError, match=rf"kernel 'cudnn' cannot run a {shape[0]}x{shape[1]} block"):
            _check(get_kernel(name, "cuda", torch.float16), *_inputs(shape), shape[-1], 0.3)
        assert not aten.calls
        return
    _check(get_kernel(name, "cuda", torch.float16), *_inputs(shape), shape[-1], 0.3)
    assert aten.calls and all(op.startswith(("_flash", "_efficient", "_scaled_dot_product_cudnn"))
                              for op, _ in aten.calls)


@pytest.mark.parametrize("name", sorted(ATEN_KERNELS))
def test_aten_kernels_negative_scale(aten, name):
    shape = (7, 5, 4, 2, 8, 12, True)
    _check(get_kernel(name, "cuda", torch.float16), *_inputs(shape, seed=3), True, -0.4)
    assert all(a.get("scale", 1.0) > 0 for _, a in aten.calls)  # the op always sees a positive scale


def test_flash_never_asks_for_a_non_square_causal_block(aten):
    for shape in SHAPES:
        _check(get_kernel("flash", "cuda", torch.bfloat16), *_inputs(shape), shape[-1], 0.3)
    for _, a in aten.calls:
        assert not a["is_causal"] or a["query"].shape[1] == a["key"].shape[1]


def test_efficient_runs_causal_blocks_as_one_top_left_call(aten):
    _check(get_kernel("efficient", "cuda", torch.float32), *_inputs((20, 7, 4, 2, 12, 20, True)), True, 0.3)
    assert [a["custom_mask_type"] for op, a in aten.calls] == [1, 1]
    q_, k_, v_ = (aten.calls[0][1][n] for n in ("query", "key", "value"))
    assert q_.shape[2] == k_.shape[2] == 4 and q_.shape[-1] == 16 and v_.shape[-1] == 24  # heads repeated, padded


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("per_batch", [True, False])
def test_efficient_masks(aten, causal, per_batch):
    shape = (9, 13, 4, 2, 8, 8, causal)
    q, k, v = _inputs(shape, seed=5)
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(2 if per_batch else 1, 9, 13, generator=g) < 0.6
    mask[..., 0] = True  # every row keeps a key (the protocol's promise)
    _check(get_kernel("efficient", "cuda", torch.float32, mask=True), q, k, v, causal, 0.3, mask=mask)
    bias = aten.calls[0][1]["bias"]
    assert bias.dtype == torch.float32 and bias.stride(2) % 16 == 0


def test_head_dim_beyond_flash_falls_back_to_efficient(aten):
    # backward's extra LSE-gradient column makes a 256 v head dim 257: flash cannot, efficient can
    shape = (4, 4, 2, 2, 256, 257, True)
    _check(get_kernel("flash", "cuda", torch.bfloat16), *_inputs(shape), True, 0.1)
    assert {op for op, _ in aten.calls} == {"_efficient_attention_forward", "_efficient_attention_backward"}


def test_schema_binding_catches_bad_calls():
    q = torch.empty(1, 2, 1, 8)
    good = (q, q, q, None, None, 2, 2, 0.0, True, False)
    assert bind("_flash_attention_forward", good, {"scale": 0.5})["scale"] == 0.5
    with pytest.raises(TypeError, match="positional"):
        bind("_flash_attention_forward", good + (None,), {})
    with pytest.raises(TypeError, match="unexpected"):
        bind("_flash_attention_forward", good, {"softmax_scale": 0.5})
    with pytest.raises(TypeError, match="expects bool"):
        bind("_flash_attention_forward", good[:8] + (1, False), {})


@pytest.mark.parametrize("name", ["flash", "cudnn"])
def test_real_schemas_on_meta_tensors(name):
    """The real ops' meta kernels accept exactly the calls these kernels make."""
    kern = get_kernel(name, "cuda", torch.bfloat16)
    q = torch.empty(2, 6, 4, 24, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, 6, 2, 24, device="meta", dtype=torch.bfloat16)
    v = torch.empty(2, 6, 2, 16, device="meta", dtype=torch.bfloat16)
    out, lse = kern.forward(q, k, v, True, 0.3)
    assert out.shape == (2, 6, 4, 16) and lse.shape == (2, 4, 6)
    dq, dk, dv = kern.backward(out, q, k, v, out, lse, True, 0.3)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_efficient_forward_schema_on_meta_tensors():
    q = torch.empty(2, 6, 4, 24, device="meta")
    out, lse = get_kernel("efficient", "cuda", torch.float32).forward(q, q[:, :, :2], q[:, :, :2, :16], True, 0.3)
    assert out.shape == (2, 6, 4, 16) and lse.shape == (2, 4, 6)


# ---- flash-attn ----------------------------------------------------------------------------------
@pytest.mark.parametrize("hide_signature", [False, True])
@pytest.mark.parametrize("version", flash_attn_standin.VERSIONS)
def test_flash_attn_calling_convention_by_version(monkeypatch, version, hide_signature):
    iface = flash_attn_standin.install(monkeypatch, version, hide_signature)
    assert split_window_api(iface) == (not version.startswith("2.6"))


def test_flash_attn_before_2_6_is_not_used(monkeypatch):
    iface = flash_attn_standin.install(monkeypatch, "2.5.9", hide_signature=True)
    assert split_window_api(iface) is None and not FlashAttnKernel().supports("cuda", torch.bfloat16)

    def forward_2_5(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax):
        raise AssertionError("not to be called")
    monkeypatch.setattr(iface, "_flash_attn_forward", forward_2_5)
    assert split_window_api(iface) is None
    assert get_kernel("auto", "cuda", torch.bfloat16, softcap=True).picks['causal'] == "math"
    with pytest.raises(ImportError, match="flash-attn package"):
        FlashAttnKernel().forward(*_inputs(SHAPES[0]), True, 0.3)


@pytest.mark.parametrize("version", flash_attn_standin.VERSIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_flash_attn_plumbing(monkeypatch, version, shape):
    flash_attn_standin.install(monkeypatch, version)
    _check(FlashAttnKernel(), *_inputs(shape), shape[-1], 0.3)


@pytest.mark.parametrize("version", flash_attn_standin.VERSIONS)
def test_flash_attn_softcap_and_negative_scale(monkeypatch, version):
    flash_attn_standin.install(monkeypatch, version, hide_signature=True)
    kern = get_kernel("auto", "cuda", torch.bfloat16, softcap=True)
    assert kern.picks["causal"] == "flash_attn"
    _check(kern, *_inputs((20, 7, 4, 2, 12, 20, True), seed=9), True, -0.7, softcap=1.3)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed here")
def test_flash_attn_absent(monkeypatch):
    for name in ("flash_attn", "flash_attn.flash_attn_interface"):
        monkeypatch.delitem(cuda_flash_attn.sys.modules, name, raising=False)
    assert not FlashAttnKernel().supports("cuda", torch.bfloat16)
    assert get_kernel("auto", "cuda", torch.bfloat16, softcap=True).picks['causal'] == "math"
    with pytest.raises(ImportError, match=r"pip install 'cp_attention\[gpu\]'"):
        FlashAttnKernel().forward(*_inputs(SHAPES[0]), True, 0.3)
