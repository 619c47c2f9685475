"""Every CUDA kernel against fp64 attention on the GPU: forward, LSE and backward; fp16/bf16/fp32 where
supported; GQA, MQA, v head dim != q head dim, head dims that need padding, Sq != Sk with causal
(top-left alignment asserted directly), strided inputs, masks, negative scales, and the ring at world
size 1 with a gradient on the LSE. gpu-marked; skipped without CUDA."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import cp_attention as cpa
from cp_attention.kernels import get_kernel
from tests.support.cuda.flash_attn_standin import attend, attend_grads

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
KERNELS = {"flash": (BF16, FP16), "efficient": (BF16, FP16, FP32), "cudnn": (BF16, FP16)}
if importlib.util.find_spec("flash_attn") is not None:
    KERNELS["flash_attn"] = (BF16, FP16)
CASES = [(name, dtype) for name, dtypes in KERNELS.items() for dtype in dtypes]
SHAPES = [  # (Sq, Sk, H, Hkv, D, Dv, causal)
    (128, 128, 8, 8, 64, 64, True), (128, 128, 8, 2, 64, 64, False), (96, 96, 8, 1, 128, 128, True),
    (80, 80, 4, 2, 64, 32, True), (80, 80, 4, 2, 32, 64, True), (200, 72, 4, 2, 64, 64, True),
    (72, 200, 4, 2, 64, 64, True), (1, 64, 8, 2, 64, 64, True), (64, 1, 4, 2, 64, 64, True),
    (64, 64, 4, 4, 20, 20, False), (64, 48, 4, 2, 20, 36, True), (64, 64, 2, 2, 256, 256, True),
]


def _tol(dtype: torch.dtype, gqa: bool) -> dict:
    if dtype == FP32:
        return dict(atol=1e-4, rtol=1e-4)
    return dict(atol=3.5e-2, rtol=3.5e-2) if gqa else dict(atol=2.5e-2, rtol=2.5e-2)


def _inputs(shape, dtype, seed=0):
    sq, sk, h, hkv, d, dv, _ = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda").to(dtype)  # noqa: E731
    # slices along the sequence of longer tensors, as the ring hands them over
    return r(2, sq + 3, h, d)[:, 1:1 + sq], r(2, sk + 2, hkv, d)[:, 2:], r(2, sk + 2, hkv, dv)[:, :sk]


def _top_left(sq, sk, causal, mask=None):
    allowed = torch.ones(sq, sk, dtype=torch.bool, device="cuda").tril() if causal else None
    if mask is not None:
        allowed = mask[:, None] if allowed is None else allowed & mask[:, None]
    return allowed


def _check(kernel, q, k, v, causal, scale, mask=None, softcap=0.0):
    tol = _tol(q.dtype, q.shape[2] != k.shape[2])
    kw = {} if mask is None else {"mask": mask}
    if softcap:
        kw["softcap"] = softcap
    allowed = _top_left(q.shape[1], k.shape[1], causal, mask)
    out, lse = attend(q, k, v, scale, allowed, softcap)
    o, l = kernel.forward(q, k, v, causal, scale, **kw)
    assert o.shape == out.shape and l.shape == lse.shape and l.dtype == FP32
    assert torch.isfinite(o).all() and torch.isfinite(l).all()
    torch.testing.assert_close(o.double(), out, **tol)
    torch.testing.assert_close(l.double(), lse, atol=2e-3 if q.dtype != FP32 else 1e-4, rtol=0)
    dout = torch.randn(out.shape, generator=torch.Generator(device="cuda").manual_seed(1), device="cuda").to(q.dtype)
    want = attend_grads(dout, q, k, v, out, lse, scale, allowed, softcap)
    got = kernel.backward(dout, q, k, v, out.to(q.dtype), lse.float(), causal, scale, **kw)
    for g, w, like in zip(got, want, (q, k, v)):
        assert g.shape == like.shape and torch.isfinite(g).all()
        torch.testing.assert_close(g.double(), w, **tol)


@pytest.mark.parametrize("name,dtype", CASES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_matches_fp64(name, dtype, shape):
    if name == "cudnn" and min(shape[:2]) == 1:  # refused by name, never run (s_q = s_kv = 1, NaN traps)
        with pytest.raises(ValueError, match=rf"kernel 'cudnn' cannot run a {shape[0]}x{shape[1]} block"):
            _check(get_kernel(name, "cuda", dtype), *_inputs(shape, dtype), shape[-1], shape[4] ** -0.5)
        return
    _check(get_kernel(name, "cuda", dtype), *_inputs(shape, dtype), shape[-1], shape[4] ** -0.5)


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_auto_matches_fp64_on_every_block(dtype, shape):
    """auto routes each block to a kernel that takes it: one-token sides never reach cuDNN."""
    _check(get_kernel("auto", "cuda", dtype, head_dim=shape[4], v_head_dim=shape[5]), *_inputs(shape, dtype),
           shape[-1], shape[4] ** -0.5)


@pytest.mark.parametrize("name,dtype", CASES, ids=str)
def test_causal_is_top_left_when_sq_differs_from_sk(name, dtype):
    kern = get_kernel(name, "cuda", dtype)
    for sq, sk in ((3, 64), (64, 3), (1, 50), (100, 30), (30, 100)):
        if name == "cudnn" and sq == 1:
            continue  # refused (test_kernel_matches_fp64)
        q, k, v = _inputs((sq, sk, 4, 2, 64, 64, True), dtype, seed=sq * 7 + sk)
        out, lse = kern.forward(q, k, v, True, 0.125)
        # top-left: query 0 sees key 0 only, so its output is v[0] and its LSE that one score
        # (bottom-right alignment would give it Sk - Sq + 1 keys)
        kv0 = v[:, 0].repeat_interleave(2, 1)
        torch.testing.assert_close(out[:, 0].float(), kv0.float(), atol=1e-2, rtol=1e-2)
        score = (q[:, 0].float() * k[:, 0].repeat_interleave(2, 1).float()).sum(-1) * 0.125
        torch.testing.assert_close(lse[:, :, 0], score, atol=1e-2, rtol=1e-2)
        if sq > 1 and sk > 1:  # and query 1 sees exactly keys 0 and 1
            p = torch.softmax((q[:, 1, :, None].float() * k[:, :2].repeat_interleave(2, 2).transpose(1, 2).float())
                              .sum(-1) * 0.125, -1)  # [B, H, 2]
            want = (p[..., None] * v[:, :2].repeat_interleave(2, 2).transpose(1, 2).float()).sum(2)
            torch.testing.assert_close(out[:, 1].float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("name,dtype", CASES, ids=str)
def test_negative_scale(name, dtype):
    _check(get_kernel(name, "cuda", dtype), *_inputs((64, 40, 4, 2, 64, 64, True), dtype, seed=5), True, -0.125)


@pytest.mark.parametrize("name,dtype", CASES, ids=str)
def test_head_major_views(name, dtype):
    """K/V that are [B, H, S, D] memory seen as [B, S, H, D] (non-unit head stride)."""
    q, k, v = _inputs((64, 64, 4, 2, 64, 64, True), dtype, seed=2)
    k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k, v))
    _check(get_kernel(name, "cuda", dtype), q, k, v, True, 0.125)


@pytest.mark.parametrize("dtype", [BF16, FP32])
@pytest.mark.parametrize("causal", [True, False])
def test_efficient_masks(dtype, causal):
    kern = get_kernel("efficient", "cuda", dtype, mask=True)
    q, k, v = _inputs((96, 77, 4, 2, 64, 48, causal), dtype, seed=3)
    off = torch.arange(77, device="cuda")[None, :] - torch.arange(96, device="cuda")[:, None]
    band = ((off >= -20) & (off <= 5))[None]  # [1, Sq, Sk] as the ring's band_mask
    band[..., 0] = True
    _check(kern, q, k, v, causal, 0.125, mask=band)
    rnd = torch.rand(2, 96, 77, device="cuda", generator=torch.Generator(device="cuda").manual_seed(4)) < 0.5
    rnd[..., 0] = True  # every row keeps a key (the protocol's promise)
    _check(kern, q, k, v, causal, 0.125, mask=rnd)


@pytest.mark.skipif("flash_attn" not in KERNELS, reason="flash-attn is not installed")
def test_flash_attn_softcap():
    _check(get_kernel("flash_attn", "cuda", BF16, softcap=True), *_inputs((100, 60, 8, 2, 64, 64, True), BF16),
           True, 0.125, softcap=5.0)


def test_auto_picks_fused_kernels_on_this_gpu():
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    assert get_kernel("auto", "cuda", BF16).picks['causal'] == ("cudnn" if hopper else "flash")
    assert get_kernel("auto", torch.device("cuda", 0), FP32).picks['causal'] == "efficient"
    assert get_kernel("auto", "cuda", BF16, mask=True).picks['window'] == "flash"


@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_ring_world_size_one_with_lse_gradient(dtype, head_dim):
    """ring_attention on CUDA with kernel 'auto': the LSE's gradient rides an extra v column, which at
    head dim 256 is beyond flash (the kernel falls back to the memory-efficient op)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 96, 8, head_dim, generator=g, device="cuda").to(dtype).requires_grad_()
    k = torch.randn(2, 96, 2, head_dim, generator=g, device="cuda").to(dtype).requires_grad_()
    v = torch.randn(2, 96, 2, head_dim, generator=g, device="cuda").to(dtype).requires_grad_()
    out, lse = cpa.ring_attention(q, k, v, layout="contiguous", causal=True, return_lse=True)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = attend(qd, kd, vd, head_dim ** -0.5, _top_left(96, 96, True))
    dout = torch.randn(out.shape, generator=g, device="cuda").to(dtype)
    dlse = torch.randn(lse.shape, generator=g, device="cuda")
    got = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    want = torch.autograd.grad((ref_out, ref_lse), (qd, kd, vd), (dout.double(), dlse.double()))
    tol = _tol(dtype, True)
    torch.testing.assert_close(out.double(), ref_out, **tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-3, rtol=0)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, **tol)
