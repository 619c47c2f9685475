"""PyTorch's memory-efficient (xFormers/CUTLASS) attention ops on CUDA:
``aten._efficient_attention_forward`` / ``_efficient_attention_backward``.

Schemas (torch 2.13's ``torch.ops.aten.<op>.default._schema``, identical in torch 2.11's
native_functions.yaml)::

    _efficient_attention_forward(Tensor query, Tensor key, Tensor value, Tensor? bias, Tensor? cu_seqlens_q,
        Tensor? cu_seqlens_k, SymInt? max_seqlen_q, SymInt? max_seqlen_k, float dropout_p, int custom_mask_type,
        bool compute_log_sumexp=False, *, float? scale=None, Tensor? seqlen_k=None, int? window_size=None)
        -> (Tensor output, Tensor logsumexp, Tensor philox_seed, Tensor philox_offset, SymInt, SymInt)
    _efficient_attention_backward(Tensor grad_out_, Tensor query, Tensor key, Tensor value, Tensor? bias,
        Tensor out, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k,
        Tensor logsumexp, float dropout_p, Tensor philox_seed, Tensor philox_offset, int custom_mask_type,
        bool bias_requires_grad, *, float? scale=None, ...) -> (Tensor, Tensor, Tensor, Tensor)

bshd, fp16/bf16/fp32, any head dim; the v head dim may differ from q/k's. No GQA: q, k and v must
have the same number of heads, so K/V heads are repeated and their gradients summed back. The CUTLASS
kernels want 16-byte aligned rows (bf16 has no unaligned variant), so head dims are padded to a
multiple of 8. ``custom_mask_type`` 1 is ``CausalFromTopLeft`` (2 is bottom-right; enum in
``mem_eff_attention/kernel_backward.h``, and SDPA's own backward passes 1 for ``is_causal``), so
causal blocks of any shape run as one call. The forward's LSE is padded along the sequence to a
multiple of 32 with +inf (sliced to Sq here); the backward reads that padding ("avoids a few bound
checks", ``kernel_forward.h``) and checks the LSE's batch and head strides are multiples of 8, so the
final LSE is copied into such a buffer, +inf past Sq. ``out`` must be contiguous: the backward takes
its row stride to be ``H * Kv`` (``o_strideM()``). Verified in torch 2.11's shipped headers.
Masks run as an additive bias ``[B, H, Sq, Sk]`` of q's dtype whose row stride is padded to 16, as
SDPA pads it.
"""

from __future__ import annotations

import torch

from ._cuda import FusedKernel, fold_heads, pad_head, repeat_heads, round_up
from .base import MaskCache

__all__ = ["EfficientKernel"]

_aten = torch.ops.aten  # looked up at call time (tests substitute stand-ins to check the plumbing on CPU)
_NO_MASK, _CAUSAL_TOP_LEFT = 0, 1

def _padded_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``mask [B or 1, Sq, Sk]`` as an additive ``[B or 1, 1, Sq, Sk]`` view of a buffer whose rows are
    padded to a multiple of 16, so every stride stays 16-aligned."""
    mb, sq, sk = mask.shape
    buf = torch.zeros(mb, 1, sq, round_up(sk, 16), dtype=dtype, device=mask.device)
    buf[..., :sk].masked_fill_(~mask[:, None], float("-inf"))
    return buf[..., :sk]


_BIASES = MaskCache(_padded_bias)


def _bias(mask: torch.Tensor | None, dtype: torch.dtype, batch: int, heads: int) -> torch.Tensor | None:
    """``mask [B or 1, Sq, Sk]`` (True = may attend) as an additive bias ``[batch, heads, Sq, Sk]``
    (converted once per mask and dtype)."""
    bias = _BIASES.get(mask, dtype)
    return None if bias is None else bias.expand(batch, heads, *bias.shape[2:])


class EfficientKernel(FusedKernel):
    """Memory-efficient attention: fp32 as well as fp16/bf16, any head dim, additive masks."""

    name = "efficient"
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    top_left_native = True
    supports_mask = True
    min_capability = None  # CUTLASS kernels from sm50 on

    def _fwd(self, q, k, v, causal, scale, mask: torch.Tensor | None = None):
        b, sq, h, dqk = q.shape
        d, e = round_up(dqk, 8), round_up(v.shape[-1], 8)
        res = _aten._efficient_attention_forward(
            pad_head(q, d), repeat_heads(pad_head(k, d), h), repeat_heads(pad_head(v, e), h),
            _bias(mask, q.dtype, b, h), None, None, None, None, 0.0, _CAUSAL_TOP_LEFT if causal else _NO_MASK, True,
            scale=scale)
        return res[0][..., :v.shape[-1]], res[1][:, :, :sq]

    def _bwd(self, dout, q, k, v, out, lse, causal, scale, mask: torch.Tensor | None = None):
        b, sq, h, dqk = q.shape
        sk, hkv, dvd = k.shape[1], k.shape[2], v.shape[-1]
        d, e = round_up(dqk, 8), round_up(dvd, 8)
        lse_buf = torch.full((b, h, round_up(sq, 32)), float("inf"), dtype=torch.float32, device=q.device)
        lse_buf[:, :, :sq] = lse
        seed = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: never read
        dq, dk, dv, _ = _aten._efficient_attention_backward(
            pad_head(dout.to(q.dtype), e).contiguous(), pad_head(q, d), repeat_heads(pad_head(k, d), h),
            repeat_heads(pad_head(v, e), h), _bias(mask, q.dtype, b, h), pad_head(out.to(q.dtype), e).contiguous(),
            None, None, sq, sk, lse_buf, 0.0, seed, seed, _CAUSAL_TOP_LEFT if causal else _NO_MASK, False,
            scale=scale)
        return dq[..., :dqk], fold_heads(dk[..., :dqk], hkv), fold_heads(dv[..., :dvd], hkv)
