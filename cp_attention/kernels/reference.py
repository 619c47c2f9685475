"""Pure-PyTorch reference kernel: any float dtype, any device, computed in fp32 (fp64 for fp64).

Queries are processed in row chunks so a block never materialises more than
``chunk x Sk`` scores per head: memory stays linear in the local sequence length.
"""

from __future__ import annotations

import torch

from .base import KernelBase, accumulation_dtype

__all__ = ["MathKernel"]

# Scores held at once per chunk, over all batch and head entries (64 MiB in fp32).
_SCORE_BUDGET = 1 << 24


class MathKernel(KernelBase):
    """Reference attention in plain PyTorch ops; the fp64 ground truth for every other kernel."""

    name = "math"
    supports_softcap = True
    supports_mask = True

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        return dtype.is_floating_point

    @staticmethod
    def _grouped(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        # [B, Sq, H, D] -> [B, Sq, Hkv, G, D]: query heads grouped by the K/V head they share.
        b, s, h, d = q.shape
        return q.reshape(b, s, k.shape[2], h // k.shape[2], d)

    def _chunks(self, q: torch.Tensor, sk: int):
        b, sq, h, _ = q.shape
        step = max(1, _SCORE_BUDGET // max(1, b * h * sk))
        return [(a, min(a + step, sq)) for a in range(0, sq, step)]

    @staticmethod
    def _scores(qc: torch.Tensor, k: torch.Tensor, row0: int, causal: bool, scale: float, softcap: float,
                mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Scores of a query chunk, softcapped if asked (flash-attn's order: scale, then cap, then
        mask), and the cap's derivative ``1 - tanh^2`` for backward (None without a cap)."""
        s = torch.einsum("bqhgd,bkhd->bhgqk", qc, k) * scale
        slope = None
        if softcap:
            t = torch.tanh(s / softcap)
            s, slope = t * softcap, 1 - t * t
        if causal:
            rows = torch.arange(row0, row0 + qc.shape[1], device=s.device)[:, None]
            cols = torch.arange(k.shape[1], device=s.device)[None, :]
            s = s.masked_fill(cols > rows, float("-inf"))
        if mask is not None:
            s = s.masked_fill(~mask[:, None, None, row0:row0 + qc.shape[1]], float("-inf"))
        return s, slope

    def forward(self, q, k, v, causal, scale, softcap: float = 0.0, mask: torch.Tensor | None = None):
        acc = accumulation_dtype(q.dtype)
        qg, k, v = self._grouped(q, k).to(acc), k.to(acc), v.to(acc)
        b, sq, h, _ = q.shape
        out = q.new_empty(b, sq, h, v.shape[-1], dtype=acc)
        lse = q.new_empty(b, h, sq, dtype=acc)
        for a, z in self._chunks(q, k.shape[1]):
            s, _ = self._scores(qg[:, a:z], k, a, causal, scale, softcap, mask)
            m = torch.logsumexp(s, dim=-1)  # [B, Hkv, G, c]
            p = torch.exp(s - m.unsqueeze(-1))
            out[:, a:z] = torch.einsum("bhgqk,bkhd->bqhgd", p, v).reshape(b, z - a, h, -1)
            lse[:, :, a:z] = m.reshape(b, h, z - a)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, causal, scale, softcap: float = 0.0,
                 mask: torch.Tensor | None = None):
        acc = accumulation_dtype(q.dtype)
        b, sq, h, _ = q.shape
        hkv = k.shape[2]
        qg, kf, vf = self._grouped(q, k).to(acc), k.to(acc), v.to(acc)
        dog = self._grouped(dout, k).to(acc)
        # delta = rowsum(dO * O): the softmax-Jacobian correction, per query row and head.
        delta = (dout.to(acc) * out.to(acc)).sum(-1).reshape(b, sq, hkv, h // hkv).permute(0, 2, 3, 1)
        lse_g = lse.to(acc).reshape(b, hkv, h // hkv, sq)
        dq = torch.empty_like(qg)
        dk = torch.zeros_like(kf)
        dv = torch.zeros_like(vf)
        for a, z in self._chunks(q, k.shape[1]):
            s, slope = self._scores(qg[:, a:z], kf, a, causal, scale, softcap, mask)
            p = torch.exp(s - lse_g[..., a:z].unsqueeze(-1))
            dv += torch.einsum("bhgqk,bqhgd->bkhd", p, dog[:, a:z])
            dp = torch.einsum("bqhgd,bkhd->bhgqk", dog[:, a:z], vf)
            ds = p * (dp - delta[..., a:z].unsqueeze(-1)) * scale
            if slope is not None:
                ds = ds * slope
            dq[:, a:z] = torch.einsum("bhgqk,bkhd->bqhgd", ds, kf)
            dk += torch.einsum("bhgqk,bqhgd->bkhd", ds, qg[:, a:z])
        return dq.reshape(b, sq, h, -1), dk, dv
