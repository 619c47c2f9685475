"""Independent fp64 reference: naive full attention on the whole sequence, and tolerance helpers.

Deliberately shares no code with cp_attention: explicit score matrix, explicit mask over global
positions, K/V heads repeated for GQA.
"""

from __future__ import annotations

import torch

# docs/design.md tolerances (bf16 as TransformerEngine's CP tests use).
TOLERANCES = {
    torch.float64: dict(atol=1e-10, rtol=0.0),
    torch.float32: dict(atol=2e-6, rtol=0.0),
    torch.bfloat16: dict(atol=2.5e-2, rtol=2.5e-2),
}
BF16_GQA = dict(atol=3.5e-2, rtol=3.5e-2)


def tolerance(dtype: torch.dtype, gqa: bool) -> dict:
    if dtype == torch.bfloat16 and gqa:
        return BF16_GQA
    return TOLERANCES[dtype]


def reference_attention(q, k, v, causal: bool, scale: float, sinks=None, softcap: float = 0.0, window=(-1, -1)):
    """Full attention in fp64. q [B, S, H, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv] -> (out, lse).

    ``window = (left, right)``: query i sees key j only if i - left <= j <= i + right (-1: unbounded).
    ``sinks [H]``: one extra logit per head, a score column with a zero value (as GPT-OSS's eager code).
    ``softcap``: scaled scores become softcap * tanh(scores / softcap) (Gemma2's eager code).
    """
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(rep, dim=2)
    v = v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    i = torch.arange(q.shape[1])[:, None]
    j = torch.arange(k.shape[1])[None, :]
    allowed = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool)
    if causal:
        allowed &= j <= i
    if window[0] >= 0:
        allowed &= j >= i - window[0]
    if window[1] >= 0:
        allowed &= j <= i + window[1]
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink_col = sinks.double()[None, :, None, None].expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, sink_col], dim=-1)
        v = torch.cat([v, v.new_zeros(v.shape[0], 1, *v.shape[2:])], dim=1)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v)
    return out, lse


def excess_error(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> float:
    """max(|a - e| - rtol*|e|) - atol: <= 0 means within tolerance; NaN/Inf give +inf."""
    a, e = actual.double(), expected.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - e).abs() - rtol * e.abs()).max().item() - atol
