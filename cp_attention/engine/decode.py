"""Decoding from a sharded KV cache (pass-Q): each rank attends one new query to its own share of the
keys, and the ranks' partial results are merged by their log-sum-exp.

The merge needs one small all-gather per call, of ``[B, H, Dv + 1]`` values: its bytes do not grow with
the sequence. Every rank merges the same gathered parts in rank order, so every rank gets the same
bits (what sampling the same token on every rank needs).
"""

from __future__ import annotations

import torch

from ..kernels.base import accumulation_dtype
from ..transport.base import Transport

__all__ = ["local_decode_attention", "merge_partials", "decode_attention"]


def local_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float,
                           softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per row against this rank's keys: ``q [B, H, D]``, ``k [B, Hkv, L, D]``, ``v [B, Hkv, L, Dv]``
    (a KV cache's layout), ``visible [B, L]`` bool. Returns ``out [B, H, Dv]`` and ``lse [B, H]`` in the
    accumulation dtype (fp32, fp64 for fp64); a row that sees no key gets ``out`` 0 and ``lse`` -inf."""
    acc = accumulation_dtype(q.dtype)
    b, h, d = q.shape
    hkv = k.shape[1]
    scores = torch.einsum("bkgd,bkld->bkgl", q.reshape(b, hkv, h // hkv, d).to(acc), k.to(acc)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, g]
    seen = torch.isfinite(lse)
    probs = torch.exp(scores - torch.where(seen, lse, torch.zeros_like(lse))[..., None])
    out = torch.einsum("bkgl,bkld->bkgd", probs, v.to(acc))
    return out.reshape(b, h, -1), lse.reshape(b, h)


def merge_partials(outs: torch.Tensor, lses: torch.Tensor, sinks: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge every rank's partial ``outs [N, B, H, Dv]`` and ``lses [N, B, H]`` (rank order) into the
    result over all keys, with one extra logit per head ``sinks [H]`` in every denominator."""
    total = torch.logsumexp(lses, dim=0)
    if sinks is not None:
        total = torch.logaddexp(total, sinks.to(total.dtype)[None, :])
    weights = torch.exp(lses - total[None])  # 0 for a rank that saw nothing
    return (weights[..., None] * outs).sum(0), total


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, transport: Transport,
                     scale: float, softcap: float = 0.0, sinks: torch.Tensor | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of one new query per row over keys sharded across ``transport``'s ranks: each rank
    passes its own ``k``/``v``/``visible`` (as :func:`local_decode_attention`), every rank gets the whole
    result ``out [B, H, Dv]`` in q's dtype and ``lse [B, H]`` (accumulation dtype). One all-gather of
    ``[B, H, Dv + 1]`` per call. Not differentiable (decoding)."""
    out, lse = local_decode_attention(q, k, v, visible, scale, softcap)
    if transport.world_size > 1:
        parts = torch.stack(transport.all_gather_tensor(torch.cat([out, lse[..., None]], dim=-1)))
        out, lse = parts[..., :-1], parts[..., -1]
    else:
        out, lse = out[None], lse[None]
    out, lse = merge_partials(out, lse, sinks)
    return out.to(q.dtype), lse
