"""The work model: how many (query, key) score pairs each rank computes at each ring step."""

from __future__ import annotations

from ..layouts.base import Layout
from ..layouts.documents import check_cu_seqlens
from ..layouts.registry import get_layout
from .blocks import doc_block_pairs, task_pairs
from .causal import get_schedule, rank_steps
from .derived import block_schedules
from .windows import normalize_window

__all__ = ["work_model"]


def work_model(layout: str | Layout, causal: bool, seq_len: int, world_size: int, cu_seqlens=None,
               window_size=None) -> list[list[int]]:
    """Score pairs per rank and step: ``work[rank][step]``. With ``cu_seqlens`` (packed documents
    ``[0, l1, ..., seq_len]``) only pairs within a document count; with ``window_size=(left, right)``
    (flash-attn's sliding window, -1 unbounded) only pairs inside the window. Steps the ring does not
    run (see :func:`~cp_attention.schedules.derived.ring_length`) count 0.

    Raises ``ValueError`` if the layout cannot split ``seq_len`` over ``world_size`` ranks, for bad
    ``cu_seqlens`` or a bad ``window_size``.
    """
    lay = get_layout(layout)
    lay.check(seq_len, world_size)
    cu = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, total=seq_len)
    window = normalize_window(window_size, causal, seq_len, cu)
    if cu is None and window is None and get_schedule(lay) is not None:
        n = seq_len // world_size
        return [[sum(task_pairs(t) for t in tasks) for tasks in rank_steps(lay, causal, r, world_size, n)]
                for r in range(world_size)]
    every = block_schedules(lay, bool(causal), world_size, seq_len, cu, window)
    return [[sum(doc_block_pairs(b) for b in blocks) for blocks in steps] + [0] * (world_size - len(steps))
            for steps in every]
