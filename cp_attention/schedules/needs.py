"""Needs: which K/V rows each rank needs from each other rank, derived from positions (what needs-only
sends).

At ring step ``s`` rank ``r`` computes against the K/V shard of rank ``j = (r - s) mod N``. It needs
only the rows of that shard some query of its own can see: same document, inside the window, not in
the future when causal. Both sides know the rows from the layout's positions and the mask alone, so
the sender sends exactly them (rank ``j`` to rank ``j + s``, ``hop = s``) and the receiver knows how
many arrive: no size handshake, no host sync, and a step where nothing is needed sends nothing. A
document wholly on one rank never travels. dK/dV partials go home the same way, row for row.

Everything here is vectorised index math on positions (no blocks are needed), the same on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._deprecated import deprecated_names
from ..layouts.base import Layout
from ..layouts.documents import _as_tensor, check_cu_seqlens
from ..layouts.registry import get_layout
from .derived import ring_length
from .windows import Window, normalize_window

__all__ = ["StepNeeds", "needed_keys", "rank_needs", "traffic_model"]

# Deprecated names (one release): the module answers them with a DeprecationWarning.
__getattr__ = deprecated_names(__name__, {"rank_traffic": "rank_needs"}, globals())


def _key_bounds(kpos: torch.Tensor, cu: torch.Tensor, causal: bool, window: Window | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per key at ``kpos``, the positions ``[lower, upper]`` a query must lie in to see it."""
    doc = torch.searchsorted(cu, kpos, right=True) - 1
    lower, upper = cu[doc], cu[doc + 1] - 1
    left, right = window if window is not None else (-1, -1)
    if causal:
        lower = torch.maximum(lower, kpos)
    elif right >= 0:
        lower = torch.maximum(lower, kpos - right)
    if left >= 0:
        upper = torch.minimum(upper, kpos + left)
    return lower, upper


def _seen(queries: torch.Tensor, bounds: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Which keys of ``bounds`` some query of the increasing ``queries`` sees."""
    lower, upper = bounds
    if queries.numel() == 0:
        return torch.zeros(lower.numel(), dtype=torch.bool)
    first = torch.searchsorted(queries, lower)
    return (first < queries.numel()) & (queries[first.clamp(max=queries.numel() - 1)] <= upper)


def needed_keys(qpos: torch.Tensor, kpos: torch.Tensor, cu: torch.Tensor, causal: bool,
                window: Window | None) -> torch.Tensor:
    """``[len(kpos)]`` bool: which keys at packed-stream positions ``kpos`` (any order) some query at
    positions ``qpos`` (any order) sees, for documents ``cu`` (a LongTensor ``[0, ..., T]``), ``causal`` and the
    normalised ``window`` (None: unbounded; else flash-attn's ``(left, right)``, -1 unbounded).

    Query ``i`` sees key ``k`` iff both lie in one document, ``i - left <= k <= i + right`` and, when
    causal, ``k <= i``: so key ``k`` is needed iff some query lies in a range of positions per key.
    """
    return _seen(torch.sort(qpos).values, _key_bounds(kpos, cu, causal, window))


@dataclass(frozen=True)
class StepNeeds:
    """One rank's needs at one ring step ``s >= 1``: ``recv`` the rows of the held shard (rank
    ``r - s``'s) it needs, ``send`` the rows of its own shard rank ``r + s`` needs; both increasing
    LongTensors of local row indices (host)."""

    recv: torch.Tensor
    send: torch.Tensor


def _tables(layout: Layout, world_size: int, total: int, cu_seqlens: tuple[int, ...] | None, causal: bool,
            window: Window | None) -> tuple[list, list, torch.Tensor]:
    """Every rank's sorted queries and its keys' bounds, and the boundaries as a tensor. Positions may
    come in any order (a layout with a schedule of its own may hold its tokens out of order)."""
    pos = [layout.positions(total, r, world_size, cu_seqlens) for r in range(world_size)]
    cu = _as_tensor(cu_seqlens if cu_seqlens is not None else (0, total))
    return [torch.sort(p).values for p in pos], [_key_bounds(p, cu, causal, window) for p in pos], cu


def rank_needs(layout: str | Layout, causal: bool, world_size: int, total: int,
               cu_seqlens: tuple[int, ...] | None, window: Window | None, rank: int, steps: int
               ) -> tuple[StepNeeds | None, ...]:
    """``needs[s]`` for ``s < steps``: this ``rank``'s :class:`StepNeeds` at each ring step (None at
    step 0, where the own shard is used). ``cu_seqlens`` checked (None: one sequence), ``window``
    normalised."""
    queries, bounds, _ = _tables(get_layout(layout), world_size, total, cu_seqlens, causal, window)
    needs: list[StepNeeds | None] = [None]
    for s in range(1, steps):
        src, dst = (rank - s) % world_size, (rank + s) % world_size
        recv = torch.nonzero(_seen(queries[rank], bounds[src])).flatten()
        send = torch.nonzero(_seen(queries[dst], bounds[rank])).flatten()
        needs.append(StepNeeds(recv, send))
    return tuple(needs)


def _counts_per_document(queries: list, cu: torch.Tensor, causal: bool) -> torch.Tensor:
    """``count[j, r]``: the rows of rank ``j`` rank ``r`` needs, without a window. Key ``k`` of document
    ``d`` is needed by ``r`` iff ``r`` holds a query of ``d`` at or after ``k`` (causal) or any query of
    ``d``: one bound per (rank, document), then one ``searchsorted`` per source rank over all of them,
    O(T log T + N^2 D) where comparing keys with queries pair by pair costs N^2 searches."""
    world, docs = len(queries), cu.numel() - 1
    bound = torch.full((world, docs), -1, dtype=torch.int64)  # the last key of d rank r needs (-1: none)
    for r, q in enumerate(queries):
        if q.numel():
            doc = torch.searchsorted(cu, q, right=True) - 1
            bound[r].scatter_reduce_(0, doc, q if causal else cu[doc + 1] - 1, reduce="amax")
    count = torch.empty((world, world), dtype=torch.int64)
    for j, keys in enumerate(queries):  # a rank's keys are its queries' positions
        first = torch.searchsorted(keys, cu[:-1])  # rank j's first row in each document
        count[j] = (torch.searchsorted(keys, bound, right=True) - first).clamp(min=0).sum(1)
    return count


def traffic_model(layout: str | Layout, causal: bool, seq_len: int, world_size: int, cu_seqlens=None,
                  window_size=None, needs_only: bool = True) -> list[list[int]]:
    """K/V rows each rank receives per ring step, ``rows[rank][step]`` (step 0: 0, the own shard; 0 at
    the steps a window leaves out of the ring), as the engine sends them: only the needed rows
    (``needs_only``), or whole shards (every step the ring runs). Multiply by the bytes of a K and a V
    row for the forward's K/V bytes; the backward receives the same rows again but the last step's
    (kept from the forward) and sends as many dK/dV rows (in the accumulator's dtype) home.

    Raises ``ValueError`` if the layout cannot split ``seq_len`` over ``world_size`` ranks, for bad
    ``cu_seqlens`` or ``window_size``.
    """
    lay = get_layout(layout)
    lay.check(seq_len, world_size)
    cu = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, total=seq_len)
    window = normalize_window(window_size, causal, seq_len, cu)
    if not needs_only:
        steps = ring_length(lay, causal, seq_len, world_size, window_size, cu)
        n = seq_len // world_size
        return [[0] + [n] * (steps - 1) + [0] * (world_size - steps) for _ in range(world_size)]
    queries, bounds, cut = _tables(lay, world_size, seq_len, cu, bool(causal), window)
    if window is None:
        count = _counts_per_document(queries, cut, bool(causal))
        return [[0] + [int(count[(r - s) % world_size, r]) for s in range(1, world_size)] for r in range(world_size)]
    # Under a window every step is counted: a step the ring leaves out needs no row.
    return [[0] + [int(_seen(queries[r], bounds[(r - s) % world_size]).sum()) for s in range(1, world_size)]
            for r in range(world_size)]
