"""Masked ring schedules: which (query rows, key rows) block each rank computes at each ring step.

Pure Python, no torch.distributed. At ring step ``s`` rank ``r`` holds the K/V shard of rank
``j = (r - s) mod N``. A schedule maps (causal, rank, world_size, step, local_len) to a tuple of
:class:`BlockTask`. The rules are in DESIGN.md; ``tests/test_schedule.py`` proves against a mask
oracle that every allowed (query, key) pair is computed exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .layout import Layout, get_layout, register_layout

__all__ = [
    "BlockTask",
    "ScheduleFn",
    "get_schedule",
    "register_schedule",
    "schedule_names",
    "rank_plan",
    "task_pairs",
    "work_model",
    "source_rank",
]


@dataclass(frozen=True)
class BlockTask:
    """One local attention block: rows ``q_start:q_stop`` of the local queries against rows
    ``kv_start:kv_stop`` of the K/V shard held at this step.

    ``causal`` means the top-left-aligned lower triangle of the sliced block: query ``i`` of the
    slice sees key ``k`` of the slice iff ``k <= i``. ``band = (lo, hi)`` (sliding windows; then
    ``causal`` is False) means query ``i`` sees key ``k`` iff ``lo <= k - i <= hi``. Tasks are never
    empty, and every query row of a task sees at least one key.
    """

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int
    causal: bool
    band: "tuple[int, int] | None" = None

    @property
    def q(self) -> slice:
        return slice(self.q_start, self.q_stop)

    @property
    def kv(self) -> slice:
        return slice(self.kv_start, self.kv_stop)


ScheduleFn = Callable[[bool, int, int, int, int], "tuple[BlockTask, ...]"]


def source_rank(rank: int, world_size: int, step: int) -> int:
    """The rank whose K/V shard ``rank`` holds at ring ``step``: ``(rank - step) mod world_size``."""
    return (rank - step) % world_size


def _task(q0: int, q1: int, k0: int, k1: int, causal: bool) -> tuple[BlockTask, ...]:
    # Empty blocks are dropped here so no kernel ever sees one (the CPU flash op crashes on them).
    if q1 <= q0 or k1 <= k0:
        return ()
    return (BlockTask(q0, q1, k0, k1, causal),)


def _ring_schedule(name: str, earlier: Callable[[int], "tuple[BlockTask, ...]"],
                   later: Callable[[int], "tuple[BlockTask, ...]"], doc: str) -> ScheduleFn:
    """A layout's schedule from its two causal rules: the block for K/V from an earlier rank
    (j < r) and from a later one (j > r), each a function of the local length n. What every layout
    shares is here: non-causal is one full block, and the diagonal (j == r) is causal."""

    def schedule(causal: bool, rank: int, world_size: int, step: int, n: int) -> tuple[BlockTask, ...]:
        j = source_rank(rank, world_size, step)
        if not causal:
            return _task(0, n, 0, n, False)
        if j == rank:
            return _task(0, n, 0, n, True)
        return earlier(n) if j < rank else later(n)

    schedule.__name__ = schedule.__qualname__ = f"{name}_schedule"
    schedule.__doc__ = doc
    return schedule


contiguous_schedule = _ring_schedule(
    "contiguous", earlier=lambda n: _task(0, n, 0, n, False), later=lambda n: (),
    doc="Contiguous: diagonal block causal, earlier ranks full, later ranks skipped.")

zigzag_schedule = _ring_schedule(
    "zigzag", earlier=lambda n: _task(0, n, 0, n // 2, False), later=lambda n: _task(n // 2, n, 0, n, False),
    doc="Zigzag: for j < r all queries see the head chunk of kv; for j > r the tail queries see all kv.")

# Local index i holds token i*N + r, so token i*N + r sees key k*N + j iff k <= i (j < r: a causal
# block) or k <= i - 1 (j > r: the causal block shifted by one).
interleaved_schedule = _ring_schedule(
    "interleaved", earlier=lambda n: _task(0, n, 0, n, True), later=lambda n: _task(1, n, 0, n - 1, True),
    doc="Interleaved: causal blocks; for j > r shifted by one (q[1:] x kv[:-1]).")


_SCHEDULES: dict[str, ScheduleFn] = {
    "contiguous": contiguous_schedule,
    "zigzag": zigzag_schedule,
    "interleaved": interleaved_schedule,
}


def schedule_names() -> tuple[str, ...]:
    """Names of the layouts that have a registered schedule, in registration order."""
    return tuple(_SCHEDULES)


def register_schedule(layout: "str | Layout", fn: ScheduleFn) -> None:
    """Register the schedule ``fn`` for a layout: a :class:`Layout` instance (also registered with
    :func:`~cp_attention.layout.register_layout`, so its name resolves everywhere) or a layout's name.

    A user-defined layout then works end to end: ``ring_attention``, ``work_model`` and the layout
    comparison. ``tests/test_schedule.py`` shows how to prove a schedule against the mask oracle.
    Raises what :func:`~cp_attention.layout.register_layout` raises.
    """
    if isinstance(layout, Layout):
        register_layout(layout)
        layout = layout.name
    _SCHEDULES[layout] = fn


def get_schedule(layout: "str | Layout") -> ScheduleFn:
    """The dispatcher: the masked ring schedule that matches ``layout``.

    Raises ``ValueError`` for an unknown layout or one with no registered schedule.
    """
    lay = get_layout(layout)
    try:
        return _SCHEDULES[lay.name]
    except KeyError:
        raise ValueError(
            f"no ring schedule registered for layout {lay.name!r}; "
            f"call cp_attention.schedule.register_schedule({lay.name!r}, fn)"
        ) from None


def rank_plan(layout: "str | Layout", causal: bool, rank: int, world_size: int, local_len: int
              ) -> list[tuple[BlockTask, ...]]:
    """All ring steps for one rank: ``plan[step]`` is the tuple of tasks at that step."""
    fn = get_schedule(layout)
    return [fn(causal, rank, world_size, s, local_len) for s in range(world_size)]


def task_pairs(task: BlockTask) -> int:
    """Number of (query, key) score pairs the task computes."""
    a = task.q_stop - task.q_start
    b = task.kv_stop - task.kv_start
    if task.band is not None:
        lo, hi = task.band
        return sum(max(0, min(b - 1, i + hi) - max(0, i + lo) + 1) for i in range(a))
    if not task.causal:
        return a * b
    # Top-left triangle: row i sees min(i + 1, b) keys.
    full_rows = max(0, a - b)
    tri_rows = a - full_rows
    return tri_rows * (tri_rows + 1) // 2 + full_rows * b


def work_model(layout: "str | Layout", causal: bool, seq_len: int, world_size: int, cu_seqlens=None,
               window_size=None) -> list[list[int]]:
    """Score pairs per rank and step: ``work[rank][step]``. With ``cu_seqlens`` (packed documents
    ``[0, l1, ..., seq_len]``) only pairs within a document count; with ``window_size=(left, right)``
    (flash-attn's sliding window, -1 unbounded) only pairs inside the window. Steps the ring does not
    run (see :func:`~cp_attention.window_schedule.ring_length`) count 0.

    Raises ``ValueError`` if the layout cannot split ``seq_len`` over ``world_size`` ranks, for bad
    ``cu_seqlens`` or a bad ``window_size``.
    """
    lay = get_layout(layout)
    lay.check(seq_len, world_size)
    cu = None
    if cu_seqlens is not None:
        from .documents import check_cu_seqlens

        cu = check_cu_seqlens(cu_seqlens, total=seq_len)
    if cu is not None or window_size is not None:
        from .doc_schedule import doc_block_pairs  # built on this module
        from .window_schedule import normalize_window, plan_blocks

        window = normalize_window(window_size, causal, seq_len, cu)
        if cu is not None or window is not None:
            plans = [plan_blocks(lay, causal, r, world_size, seq_len, cu, window) for r in range(world_size)]
            return [[sum(doc_block_pairs(b) for b in blocks) for blocks in plan] + [0] * (world_size - len(plan))
                    for plan in plans]
    n = seq_len // world_size
    return [
        [sum(task_pairs(t) for t in tasks) for tasks in rank_plan(lay, causal, r, world_size, n)]
        for r in range(world_size)
    ]
