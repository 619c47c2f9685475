"""PyTorch's fused CPU flash-attention ops (``aten._scaled_dot_product_flash_attention_for_cpu``).

The op takes bhsd views of our bshd tensors, broadcasts GQA heads itself, returns a natural-log
LSE ``[B, H, S]`` (fp32, fp64 for fp64 inputs) with non-contiguous strides, and masks causal
blocks top-left. It needs equal q/k and v head dims, so a differing v head dim (MLA) is zero-padded,
which leaves every dot product, and hence the result, unchanged.

Registered as ``cpu_flash``; ``sdpa`` is its old name, still accepted as an alias.
"""

from __future__ import annotations

import functools

import torch

from .base import KernelBase, MaskCache, pad_last, positive_scale
from .dtypes import FLOAT_DTYPES

__all__ = ["CpuFlashKernel"]


def _to_additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # The op wants an additive mask of the query's dtype, broadcast over heads: [B, 1, Sq, Sk].
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))[:, None]


_additive = MaskCache(_to_additive).get

# Causal squares of these sizes run as row chunks. Below its 512-key block the op skips no keys for
# a causal mask, so a causal square costs as much as a full one; chunk i of m (rows a:b) against
# only the keys :b, masked, costs (m + 1) / 2m of that. Measured fwd+bwd at 8 heads x 64, one
# thread: 128 rows 0.94-0.95, 192: 0.85, 256: 0.78, 384: 0.75, 512: 0.70 of the plain causal call;
# below 128 rows the extra calls cost what they save, and from 768 rows the op skips whole blocks.
_CHUNKED = (160, 768)


def _chunks(n: int) -> list[tuple[int, int]]:
    m = 6 if n >= 448 else 4
    return [(n * i // m, n * (i + 1) // m) for i in range(m)]


@functools.lru_cache(maxsize=512)
def _chunk_mask(rows: int, cols: int) -> torch.Tensor:
    """``[1, rows, cols]``: the last ``rows`` rows of a causal square of side ``cols``."""
    return torch.ones(1, rows, cols, dtype=torch.bool).tril(cols - rows)


def _chunked(q: torch.Tensor, k: torch.Tensor, causal: bool, mask) -> bool:
    return causal and mask is None and q.shape[1] == k.shape[1] and _CHUNKED[0] <= q.shape[1] < _CHUNKED[1]


class CpuFlashKernel(KernelBase):
    """Fused flash attention on CPU, forward and backward."""

    name = "cpu_flash"
    # The op reads K/V head by head; head-major memory makes it 4-11% faster (scripts/benchmark.py).
    head_major_kv = True
    supports_mask = True

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        return torch.device(device).type == "cpu" and dtype in FLOAT_DTYPES

    def forward(self, q, k, v, causal, scale, mask: torch.Tensor | None = None):
        if _chunked(q, k, causal, mask):
            parts = [self._forward(q[:, a:b], k[:, :b], v[:, :b], a == 0, scale,
                                   None if a == 0 else _chunk_mask(b - a, b))
                     for a, b in _chunks(q.shape[1])]
            return torch.cat([o for o, _ in parts], 1), torch.cat([lse for _, lse in parts], 2)
        return self._forward(q, k, v, causal, scale, mask)

    def backward(self, dout, q, k, v, out, lse, causal, scale, mask: torch.Tensor | None = None):
        if not _chunked(q, k, causal, mask):
            return self._backward(dout, q, k, v, out, lse, causal, scale, mask)
        dqs, dk, dv = [], None, None
        for a, b in reversed(_chunks(q.shape[1])):  # the last chunk sees every key: it starts dk, dv
            dq_c, dk_c, dv_c = self._backward(dout[:, a:b], q[:, a:b], k[:, :b], v[:, :b], out[:, a:b], lse[..., a:b],
                                              a == 0, scale, None if a == 0 else _chunk_mask(b - a, b))
            dqs.append(dq_c)
            if dk is None or dv is None:  # both or neither
                dk, dv = dk_c, dv_c
            else:
                dk[:, :b] += dk_c
                dv[:, :b] += dv_c
        return torch.cat(dqs[::-1], 1), dk, dv

    def _forward(self, q, k, v, causal, scale, mask):
        q, scale, _ = positive_scale(q, scale)
        d = max(q.shape[-1], v.shape[-1])
        dv = v.shape[-1]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            pad_last(q, d).transpose(1, 2), pad_last(k, d).transpose(1, 2), pad_last(v, d).transpose(1, 2),
            0.0, causal, attn_mask=_additive(mask, q.dtype), scale=scale,
        )
        return out.transpose(1, 2)[..., :dv], lse

    def _backward(self, dout, q, k, v, out, lse, causal, scale, mask):
        q, scale, sign = positive_scale(q, scale)
        dqk, dvd = q.shape[-1], v.shape[-1]
        d = max(dqk, dvd)
        t = lambda x: pad_last(x, d).transpose(1, 2)  # noqa: E731
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            t(dout.to(q.dtype)), t(q), t(k), t(v), t(out.to(q.dtype)), lse, 0.0, causal,
            attn_mask=_additive(mask, q.dtype), scale=scale,
        )
        dq = dq.transpose(1, 2)[..., :dqk]
        return (dq if sign > 0 else -dq), dk.transpose(1, 2)[..., :dqk], dv.transpose(1, 2)[..., :dvd]
