"""Local kernels and the LSE merge against the naive fp64 reference (single process)."""

from __future__ import annotations

import pytest
import torch

import cp_attention as cpa
from cp_attention.engine.merge import merge_block
from cp_attention.kernels import get_kernel
from cp_attention.kernels import reference as math_kernel
from tests.support.core.reference import reference_attention


def naive_block(q, k, v, causal, scale):
    """Reference for a possibly non-square block with a top-left causal mask."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        s = s.masked_fill(torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril().logical_not(), -torch.inf)
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v), s.logsumexp(-1)


SHAPES = [  # (Sq, Sk, H, Hkv, D, Dv, causal)
    (8, 8, 4, 4, 8, 8, True), (7, 5, 4, 2, 8, 12, True), (5, 7, 2, 1, 16, 8, True),
    (6, 6, 4, 1, 8, 8, False), (1, 9, 2, 2, 4, 4, True), (9, 1, 2, 2, 4, 4, True),
    # causal squares the CPU flash kernel runs as 4 and 6 row chunks
    (160, 160, 2, 1, 8, 12, True), (500, 500, 2, 2, 4, 4, True),
]


@pytest.mark.parametrize("name", ["math", "cpu_flash"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_forward_backward_fp64(name, shape):
    sq, sk, h, hkv, d, dv, causal = shape
    g = torch.Generator().manual_seed(sq * 100 + sk)
    # strided inputs: slices along the sequence of a longer tensor, as the ring hands them over
    q = torch.randn(2, sq + 3, h, d, dtype=torch.float64, generator=g)[:, 2:2 + sq].requires_grad_()
    k = torch.randn(2, sk, hkv, d, dtype=torch.float64, generator=g).requires_grad_()
    v = torch.randn(2, sk, hkv, dv, dtype=torch.float64, generator=g).requires_grad_()
    out, lse = naive_block(q, k, v, causal, 0.3)
    dout = torch.randn_like(out)
    out.backward(dout)
    kern = get_kernel(name, "cpu", torch.float64)
    o2, l2 = kern.forward(q.detach(), k.detach(), v.detach(), causal, 0.3)
    torch.testing.assert_close(o2.double(), out, atol=1e-12, rtol=0)
    torch.testing.assert_close(l2.double(), lse, atol=1e-12, rtol=0)
    grads = kern.backward(dout, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), causal, 0.3)
    for got, ref in zip(grads, (q.grad, k.grad, v.grad)):
        assert got.shape == ref.shape
        torch.testing.assert_close(got.double(), ref, atol=1e-12, rtol=0)


@pytest.mark.parametrize("side", [159, 160, 447, 448, 767, 768])
def test_cpu_flash_row_chunks_match_one_call(side):
    """Causal squares of 160-767 rows run as row chunks; the result equals the op's single call, also
    for a negative scale."""
    from cp_attention.kernels import cpu_flash

    g = torch.Generator().manual_seed(side)
    q, k, v, dout = (torch.randn(1, side, 2, 8, dtype=torch.float64, generator=g) for _ in range(4))
    kern = get_kernel("cpu_flash", "cpu", torch.float64)
    assert cpu_flash._chunked(q, k, True, None) == (160 <= side < 768)
    assert not cpu_flash._chunked(q, k, False, None) and not cpu_flash._chunked(q[:, 1:], k, True, None)
    for scale in (0.3, -0.3):
        out, lse = kern.forward(q, k, v, True, scale)
        o1, l1 = kern._forward(q, k, v, True, scale, None)
        torch.testing.assert_close(out, o1, atol=1e-13, rtol=0)
        torch.testing.assert_close(lse, l1, atol=1e-13, rtol=0)
        for got, want in zip(kern.backward(dout, q, k, v, out, lse, True, scale),
                             kern._backward(dout, q, k, v, o1, l1, True, scale, None)):
            torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_math_kernel_chunks_rows(monkeypatch):
    """With a tiny score budget the math kernel works in many row chunks and stays exact."""
    monkeypatch.setattr(math_kernel, "_SCORE_BUDGET", 16)
    kern = get_kernel("math", "cpu", torch.float64)
    assert len(kern._chunks(torch.empty(1, 10, 2, 4), 8)) == 10
    q, k, v = (torch.randn(1, 10, 2, 4, dtype=torch.float64) for _ in range(3))
    out, lse = naive_block(q, k, v, True, 0.5)
    o2, l2 = kern.forward(q, k, v, True, 0.5)
    torch.testing.assert_close(o2, out, atol=1e-12, rtol=0)
    dout = torch.randn_like(out)
    ref = torch.autograd.grad(naive_block(*(t.requires_grad_() for t in (q, k, v)), True, 0.5)[0], (q, k, v), dout)
    for got, want in zip(kern.backward(dout, q.detach(), k.detach(), v.detach(), out, lse, True, 0.5), ref):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_flash_low_precision_lse_is_fp32(dtype):
    q = torch.randn(1, 6, 2, 8).to(dtype)
    out, lse = get_kernel("cpu_flash", "cpu", dtype).forward(q, q, q, True, 0.35)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (1, 2, 6)
    _, ref_lse = naive_block(q.double(), q.double(), q.double(), True, 0.35)
    torch.testing.assert_close(lse.double(), ref_lse, atol=5e-2, rtol=0)


def test_kernel_registry():
    assert get_kernel("auto", "cpu", torch.float32).picks['causal'] == "cpu_flash"
    assert get_kernel("auto", "meta", torch.float32).picks['causal'] == "math"  # no fused op there
    with pytest.raises(ValueError, match="unknown kernel 'nope'"):
        get_kernel("nope", "cpu", torch.float32)
    with pytest.raises(ValueError, match="kernel 'flash' does not support device cpu"):
        get_kernel("flash", "cpu", torch.float32)
    with pytest.raises(ValueError, match="kernel 'sdpa' does not support device cuda"):
        get_kernel("sdpa", "cuda", torch.float32)


def test_merge_of_key_halves_equals_full_attention():
    q, k, v = (torch.randn(2, 5, 3, 4, dtype=torch.float64) for _ in range(3))
    ref_out, ref_lse = naive_block(q, k, v, False, 0.5)
    out = torch.zeros(2, 5, 3, 4, dtype=torch.float64)
    lse = torch.full((2, 3, 5), -torch.inf, dtype=torch.float64)
    for part in (slice(0, 2), slice(2, 5)):
        merge_block(out, lse, *naive_block(q, k[:, part], v[:, part], False, 0.5), slice(0, 5))
    torch.testing.assert_close(out, ref_out, atol=1e-14, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-14, rtol=0)


def test_merge_rows_and_extreme_lse():
    """Only the named rows change; an empty accumulator takes the block exactly; no overflow."""
    out = torch.zeros(1, 4, 1, 2)
    lse = torch.full((1, 1, 4), -torch.inf)
    blk = torch.tensor([[[[1.0, 2.0]], [[3.0, 4.0]]]])
    merge_block(out, lse, blk, torch.tensor([[[900.0, -900.0]]]), slice(1, 3))
    assert torch.equal(out[0, 1:3, 0], blk[0, :, 0]) and torch.equal(lse[0, 0, 1:3], torch.tensor([900.0, -900.0]))
    assert torch.isinf(lse[0, 0, [0, 3]]).all() and (out[0, [0, 3]] == 0).all()
    merge_block(out, lse, torch.zeros(1, 2, 1, 2), torch.tensor([[[-900.0, 900.0]]]), slice(1, 3))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0, 1:3, 0], torch.tensor([[1.0, 2.0], [0.0, 0.0]]))
    torch.testing.assert_close(lse[0, 0, 1:3], torch.tensor([900.0, 900.0]))


def test_world_size_one_without_process_group():
    """No torch.distributed: ring_attention is plain attention, with gradients and LSE."""
    q, k, v = (torch.randn(2, 9, 4, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out, lse = cpa.ring_attention(q, k, v, layout="contiguous", causal=True, return_lse=True)
    ref_out, ref_lse = reference_attention(q, k, v, True, 8 ** -0.5)
    torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=0)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref_out, (q, k, v), dout)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
