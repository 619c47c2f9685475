"""PyTorch's fused CPU flash-attention ops (``aten._scaled_dot_product_flash_attention_for_cpu``).

The op takes bhsd views of our bshd tensors, broadcasts GQA heads itself, returns a natural-log
LSE ``[B, H, S]`` (fp32, fp64 for fp64 inputs) with non-contiguous strides, and masks causal
blocks top-left. It needs equal q/k and v head dims, so a differing v head dim (MLA) is zero-padded,
which leaves every dot product, and hence the result, unchanged.

Registered as ``cpu_flash``; ``sdpa`` is its old name, still accepted as an alias.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..dtypes import FLOAT_DTYPES
from .base import MaskCache

__all__ = ["CpuFlashKernel"]


def _pad_last(x: torch.Tensor, size: int) -> torch.Tensor:
    return x if x.shape[-1] == size else F.pad(x, (0, size - x.shape[-1]))


def _to_additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # The op wants an additive mask of the query's dtype, broadcast over heads: [B, 1, Sq, Sk].
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))[:, None]


_additive = MaskCache(_to_additive).get


class CpuFlashKernel:
    """Fused flash attention on CPU, forward and backward."""

    name = "cpu_flash"
    # The op reads K/V head by head; head-major memory makes it 4-11% faster (scripts/benchmark.py).
    head_major_kv = True
    supports_mask = True

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        return torch.device(device).type == "cpu" and dtype in FLOAT_DTYPES

    def forward(self, q, k, v, causal, scale, mask: "torch.Tensor | None" = None):
        if scale < 0:  # the op returns NaN for a negative scale; (-q) . k * |scale| is the same score
            q, scale = -q, -scale
        d = max(q.shape[-1], v.shape[-1])
        dv = v.shape[-1]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _pad_last(q, d).transpose(1, 2), _pad_last(k, d).transpose(1, 2), _pad_last(v, d).transpose(1, 2),
            0.0, causal, attn_mask=_additive(mask, q.dtype), scale=scale,
        )
        return out.transpose(1, 2)[..., :dv], lse

    def backward(self, dout, q, k, v, out, lse, causal, scale, mask: "torch.Tensor | None" = None):
        sign = 1.0
        if scale < 0:  # as in forward; the chain rule flips dq back
            q, scale, sign = -q, -scale, -1.0
        dqk, dvd = q.shape[-1], v.shape[-1]
        d = max(dqk, dvd)
        t = lambda x: _pad_last(x, d).transpose(1, 2)  # noqa: E731
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            t(dout.to(q.dtype)), t(q), t(k), t(v), t(out.to(q.dtype)), lse, 0.0, causal,
            attn_mask=_additive(mask, q.dtype), scale=scale,
        )
        dq = dq.transpose(1, 2)[..., :dqk]
        return (dq if sign > 0 else -dq), dk.transpose(1, 2)[..., :dqk], dv.transpose(1, 2)[..., :dvd]
