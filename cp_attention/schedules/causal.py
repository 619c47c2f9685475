"""Masked ring schedules: which (query rows, key rows) block each rank computes at each ring step.

Pure Python, no torch.distributed. At ring step ``s`` rank ``r`` holds the K/V shard of rank
``j = (r - s) mod N``. A schedule maps (causal, rank, world_size, step, local_len) to a tuple of
:class:`BlockTask`. The rules are in docs/design.md; ``tests/unit/schedules/test_causal.py`` proves against a mask
oracle that every allowed (query, key) pair is computed exactly once.
"""

from __future__ import annotations

from typing import Callable

from .._deprecated import deprecated_names
from ..layouts.base import Layout
from ..layouts.registry import get_layout, layout_schedule, register_layout
from .blocks import BlockTask, source_rank

__all__ = ["ScheduleFn", "get_schedule", "register_schedule", "rank_steps", "contiguous_schedule",
           "zigzag_schedule", "interleaved_schedule"]

# Deprecated names (one release): the module answers them with a DeprecationWarning.
__getattr__ = deprecated_names(__name__, {"rank_plan": "rank_steps"}, globals())


ScheduleFn = Callable[[bool, int, int, int, int], "tuple[BlockTask, ...]"]


def _task(q0: int, q1: int, k0: int, k1: int, causal: bool) -> tuple[BlockTask, ...]:
    # Empty blocks are dropped here so no kernel ever sees one (the CPU flash op crashes on them).
    if q1 <= q0 or k1 <= k0:
        return ()
    return (BlockTask(q0, q1, k0, k1, causal),)


def _ring_schedule(name: str, earlier: Callable[[int], tuple[BlockTask, ...]],
                   later: Callable[[int], tuple[BlockTask, ...]], doc: str) -> ScheduleFn:
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


def register_schedule(layout: str | Layout, fn: ScheduleFn) -> None:
    """Register the causal ring schedule ``fn`` for a layout: a :class:`Layout` instance (registered
    too, so its name resolves everywhere) or a registered layout's name.

    A layout with no schedule of its own still runs: its blocks derive from its positions. A schedule
    of its own skips that derivation. ``tests/unit/schedules/test_causal.py`` shows how to prove one against the
    mask oracle. Raises ``ValueError`` for an unknown name and what
    :func:`~cp_attention.layouts.registry.register_layout` raises.
    """
    register_layout(get_layout(layout), schedule=fn)


def get_schedule(layout: str | Layout) -> ScheduleFn | None:
    """The dispatcher: the causal ring schedule registered for ``layout``, or None when its blocks
    derive from its positions. Raises ``ValueError`` for an unknown layout."""
    return layout_schedule(layout)


def rank_steps(layout: str | Layout, causal: bool, rank: int, world_size: int, local_len: int
               ) -> list[tuple[BlockTask, ...]]:
    """All ring steps for one rank without packed documents or windows: ``steps[step]`` is the tuple of
    tasks at that step. Raises ``ValueError`` for an unknown layout or one without a schedule of its
    own (:func:`~cp_attention.schedules.derived.block_schedules` derives its blocks from its positions)."""
    fn = get_schedule(layout)
    if fn is None:
        name = get_layout(layout).name
        raise ValueError(f"layout {name!r} has no ring schedule of its own; its blocks derive from its positions "
                         f"(cp_attention.schedules.block_schedules; ring_attention does this itself), "
                         f"or register one with "
                         f"register_schedule({name!r}, fn)")
    return [fn(causal, rank, world_size, s, local_len) for s in range(world_size)]


for _name, _fn in (("contiguous", contiguous_schedule), ("zigzag", zigzag_schedule),
                   ("interleaved", interleaved_schedule), ("balanced", zigzag_schedule)):
    register_layout(get_layout(_name), schedule=_fn)
