"""Schedules derived from positions: packed documents, sliding windows, and layouts without a causal
schedule of their own. Every rank's positions are computed once; the blocks of every rank with them
(the ring's length under a window is the most any rank needs), or of one rank only."""

from __future__ import annotations

from typing import overload

from ..layouts.base import Layout
from ..layouts.documents import check_cu_seqlens, document_ids
from ..layouts.registry import get_layout
from .blocks import DocBlock, increasing_positions
from .packed import doc_schedules, rank_doc_blocks
from .table import BlockTable
from .windows import Window, normalize_window, window_schedules

__all__ = ["block_schedules", "ring_length"]


@overload
def block_schedules(layout: Layout, causal: bool, world_size: int, total: int, cu_seqlens: tuple[int, ...] | None,
                    window: Window | None, rank: None = None) -> tuple[tuple[tuple[DocBlock, ...], ...], ...]: ...


@overload
def block_schedules(layout: Layout, causal: bool, world_size: int, total: int, cu_seqlens: tuple[int, ...] | None,
                    window: Window | None, rank: int) -> BlockTable: ...


def block_schedules(layout: Layout, causal: bool, world_size: int, total: int, cu_seqlens: tuple[int, ...] | None,
                    window: Window | None, rank: int | None = None
                    ) -> tuple[tuple[tuple[DocBlock, ...], ...], ...] | BlockTable:
    """``steps[rank][step]``: every rank's document blocks over ``total`` tokens, packed as the checked
    ``cu_seqlens`` (None: one sequence), under the normalised ``window`` (None: none). Without a window
    each rank has ``world_size`` steps; with one, as many as the farthest rank needs.

    With ``rank``, only that rank's steps, as a :class:`~cp_attention.schedules.table.BlockTable`
    (which reads like ``steps[rank]``): without a window only its own ``world_size`` steps are
    computed, not every rank's.

    Raises ``NotImplementedError`` for a layout whose positions do not increase on a rank.
    """
    bounds = cu_seqlens if cu_seqlens is not None else (0, total)
    doc_of = document_ids(bounds)
    what = "sliding-window schedules" if window is not None else "schedules derived from positions"
    positions = [increasing_positions(layout, total, r, world_size, cu_seqlens, what) for r in range(world_size)]
    if window is not None:
        steps = window_schedules(positions, doc_of, len(bounds) - 1, causal, window)
        return steps if rank is None else BlockTable.from_blocks(steps[rank])
    if rank is not None:
        return rank_doc_blocks(positions, doc_of, causal, layout.name, rank)
    return doc_schedules(positions, doc_of, causal, layout.name)


def ring_length(layout: str | Layout, causal: bool, total: int, world_size: int, window_size=None,
                cu_seqlens=None) -> int:
    """How many ring steps run for ``total`` tokens (packed as ``cu_seqlens`` if given) under
    ``window_size`` (flash-attn's ``(left, right)``, or None): ``world_size`` without a window, fewer
    when no rank's window reaches the farther shards. Each rank receives one K/V shard fewer than that.

    Raises ``ValueError`` for a bad window, bad ``cu_seqlens`` or a total the layout cannot split, and
    ``NotImplementedError`` for a layout whose positions do not increase on a rank.
    """
    lay = get_layout(layout)
    lay.check(total, world_size)
    cu = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, total=total)
    window = normalize_window(window_size, causal, total, cu)
    if window is None:
        return world_size
    return len(block_schedules(lay, bool(causal), world_size, total, cu, window)[0])
