"""Ring schedules for sliding windows: one rule for every layout, packed or not.

With ``window_size=(left, right)`` (flash-attn's convention, -1 unbounded) a query at global
position i sees key j iff ``i - left <= j <= i + right`` (and ``j <= i`` when causal), positions
counted within documents when packed. The blocks are derived from the layouts' global positions:
each rank's tokens split into runs, maximal stretches of one document whose positions step by the
layout's stride (1 for contiguous and zigzag, N for interleaved). A query run against a key run of
the same stride sees a band of the block: query ``i`` sees key ``b`` iff ``lo <= b - i <= hi``. Every
block is trimmed to the rows and keys that see something, so blocks and ring steps wholly outside
the window are skipped, and the ring stops after the last step any rank needs.
``tests/unit/schedules/test_windows.py`` proves against a mask oracle that every allowed pair is computed exactly once.
Pure index math, no torch.distributed.
"""

from __future__ import annotations

import operator
from typing import Sequence

import torch

from ..layouts.documents import longest_document
from .blocks import DocBlock, source_rank

__all__ = ["Window", "check_window_size", "normalize_window", "window_schedules"]

# (left, right) after normalisation: -1 = unbounded on that side.
Window = tuple[int, int]


def check_window_size(window_size) -> Window:
    """``window_size`` as a checked ``(left, right)`` of ints.

    Raises ``ValueError`` unless it is a pair of ints (not bools) each ``>= -1``.
    """
    try:
        left, right = (operator.index(x) for x in window_size)
        ok = not any(isinstance(x, bool) for x in window_size) and left >= -1 and right >= -1
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"window_size must be (left, right), two ints >= -1 (flash-attn's convention, -1 = "
                         f"unbounded), got {window_size!r}")
    return left, right


def normalize_window(window_size, causal: bool, total: int, cu_seqlens: tuple[int, ...] | None = None
                     ) -> Window | None:
    """``window_size`` as ``(left, right)`` with sides that cannot matter made unbounded (-1): a side
    at least as long as the longest sequence of ``total`` tokens (or document of the checked
    ``cu_seqlens``) minus one, and the right side when causal. None when no side restricts anything.

    Raises what :func:`check_window_size` raises.
    """
    if window_size is None:
        return None
    left, right = check_window_size(window_size)
    longest = longest_document(cu_seqlens, total)
    left = -1 if left >= longest - 1 else left
    right = -1 if causal or right >= longest - 1 else right
    return None if left == right == -1 else (left, right)


def _runs(pos: torch.Tensor, doc_of: torch.Tensor, stride: int) -> tuple[torch.Tensor, ...]:
    """Maximal runs of ``pos`` (increasing) within one document stepping by ``stride``: their first
    local index, length, first position and document."""
    breaks = torch.ones(pos.numel(), dtype=torch.bool)
    if pos.numel() > 1:
        breaks[1:] = (pos[1:] - pos[:-1] != stride) | (doc_of[pos[1:]] != doc_of[pos[:-1]])
    start = torch.nonzero(breaks).flatten()
    length = torch.diff(start, append=torch.tensor([pos.numel()]))
    return start, length, pos[start], doc_of[pos[start]]


def _floordiv(a: torch.Tensor, s: int) -> torch.Tensor:
    return torch.div(a, s, rounding_mode="floor")


def _step_blocks(qruns, kruns, docs: int, stride: int, causal: bool, window: Window) -> tuple[DocBlock, ...]:
    """The blocks of one step, vectorised over (query run, key run) pairs of the same document."""
    qs, ql, qp, qd = qruns
    ks, kl, kp, kd = kruns
    # Key runs of each document form one contiguous range of the (document-sorted) run table.
    k_first = torch.searchsorted(kd, torch.arange(docs))
    k_count = torch.bincount(kd, minlength=docs)
    per_q = k_count[qd]
    qi = torch.repeat_interleave(torch.arange(qs.numel()), per_q)
    ki = k_first[qd][qi] + (torch.arange(qi.numel()) - torch.repeat_interleave(torch.cumsum(per_q, 0) - per_q, per_q))
    if qi.numel() == 0:
        return ()
    lq, lk = ql[qi], kl[ki]
    # Query i (position qp + s*i) sees key b (position kp + s*b) iff -right <= delta + s*(i - b) <= left.
    delta = qp[qi] - kp[ki]
    left, right = window
    big = torch.full_like(delta, 1 << 40)
    lo = -_floordiv(left - delta, stride) if left >= 0 else -big  # ceil((delta - left) / s)
    right_eff = 0 if causal else right
    hi = _floordiv(right_eff + delta, stride) if right_eff >= 0 else big
    # Rows that see a key: i in [max(0, -hi), min(lq - 1, lk - 1 - lo)]; the keys they see.
    i0 = torch.clamp(-hi, min=0)
    i1 = torch.minimum(lq - 1, lk - 1 - lo)
    keep = (i0 <= i1) & (lo <= hi)
    i0, i1, lo, hi, lq, lk = (t[keep] for t in (i0, i1, lo, hi, lq, lk))
    qa, ka = qs[qi[keep]], ks[ki[keep]]
    b0 = torch.clamp(i0 + lo, min=0)
    b1 = torch.minimum(lk - 1, i1 + hi)
    lo, hi = lo - b0 + i0, hi - b0 + i0  # relative to the trimmed block's corner
    rows, cols = i1 - i0 + 1, b1 - b0 + 1
    no_lo = lo <= -(rows - 1)
    no_hi = hi >= cols - 1
    table = torch.stack([qa + i0, qa + i1 + 1, ka + b0, ka + b1 + 1, hi, lo, no_hi.long(), no_lo.long()], 1)
    return tuple(DocBlock(a, b, c, d, None if nh else h, None if nl else lw)
                 for a, b, c, d, h, lw, nh, nl in table.tolist())


def window_schedules(positions: Sequence[torch.Tensor], doc_of: torch.Tensor, docs: int, causal: bool, window: Window
                 ) -> tuple[tuple[tuple[DocBlock, ...], ...], ...]:
    """Every rank's blocks per ring step under a (normalised, see :func:`normalize_window`) window:
    ``steps[rank][step]``, from every rank's increasing ``positions`` and the document of every token.
    The steps stop after the last step any rank computes, the same length on every rank: later K/V
    are neither used nor sent."""
    world_size = len(positions)
    diffs = [p[1:] - p[:-1] for p in positions if p.numel() > 1]
    stride = int(torch.cat(diffs).min()) if diffs else 1
    runs = [_runs(p, doc_of, stride) for p in positions]
    every = [[_step_blocks(runs[r], runs[source_rank(r, world_size, s)], docs, stride, bool(causal), window)
              for s in range(world_size)] for r in range(world_size)]
    length = 1 + max((s for steps in every for s, blocks in enumerate(steps) if blocks), default=0)
    return tuple(tuple(steps[:length]) for steps in every)
