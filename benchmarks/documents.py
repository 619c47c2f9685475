"""Document-length generators the benchmarks and studies share (a leaf: it imports no benchmark)."""

from __future__ import annotations

import math
import random

from cp_attention.layouts.documents import cu_seqlens_from_lengths

__all__ = ["fit_lengths", "lognormal_lengths"]


def lognormal_lengths(total_tokens: int, mean_doc_len: float, sigma: float, seed: int, min_doc_len: int = 1,
                      max_doc_len: int | None = None) -> list[int]:
    """Document lengths drawn until they cover ``total_tokens``; the last one overshoots (or ends exactly).

    Each length is ``round(X)`` for ``X ~ lognormal(mu, sigma)`` with ``mu = ln(mean_doc_len) - sigma²/2``
    (so the mean before rounding and clipping is ``mean_doc_len``), clipped to ``[min_doc_len,
    max_doc_len]``. Python's ``random.Random(seed)``: the same seed gives the same documents everywhere.
    """
    if total_tokens < 1 or mean_doc_len <= 0 or sigma < 0 or min_doc_len < 1:
        raise ValueError("need total_tokens >= 1, mean_doc_len > 0, sigma >= 0 and min_doc_len >= 1")
    rng = random.Random(seed)
    mu = math.log(mean_doc_len) - sigma * sigma / 2
    hi = max_doc_len or total_tokens
    lengths, total = [], 0
    while total < total_tokens:
        n = min(max(min_doc_len, round(rng.lognormvariate(mu, sigma))), hi)
        lengths.append(n)
        total += n
    return lengths


def fit_lengths(lengths: list[int], total: int) -> tuple[int, ...]:
    """``lengths`` trimmed so they sum to ``total`` exactly (the last crossing document cut)."""
    out, used = [], 0
    for x in lengths:
        if used >= total:
            break
        out.append(min(x, total - used))
        used += out[-1]
    return cu_seqlens_from_lengths(out)
