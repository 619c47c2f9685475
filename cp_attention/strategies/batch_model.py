"""What the cost model reads from one batch's positions: the exact (query, key) pairs of every rank,
and the K/V rows each rank needs from each other one at every ring step (its needs, as
:func:`cp_attention.schedules.needs.traffic_model` counts what the engine sends).

Both come from the layout's positions alone (``layout.positions``, packed as ``cu_seqlens``), the same
on every rank, in tensor index math: no blocks, no schedule; cheap enough for ``cp_comm_type="auto"``
at every batch (a few ms at T = 65,536 and N = 8), and cached per batch.
"""

from __future__ import annotations

import functools

import torch

from .._deprecated import deprecated_names
from ..layouts.documents import _as_tensor
from ..layouts.registry import get_layout
from ..schedules.blocks import increasing_positions
from ..schedules.needs import traffic_model

__all__ = ["rank_positions", "rank_pair_totals", "step_needs", "window_or_none", "needs_only_bytes", "ring_seconds",
           "accumulator_bytes", "kv_bytes_per_hop", "ring_bytes_per_rank"]

# Deprecated names (one release): the module answers them with a DeprecationWarning.
__getattr__ = deprecated_names(__name__, {"step_rows": "step_needs"}, globals())


def window_or_none(causal: bool, window: tuple) -> tuple[int, int] | None:
    """flash-attn's ``window`` as ``(left, right)`` when it restricts anything beyond ``causal``, else None."""
    left, right = int(window[0]), int(window[1])
    if left < 0 and (causal or right < 0):
        return None
    return left, (0 if causal else right)


@functools.lru_cache(maxsize=16)
def rank_positions(layout: str, seq_len: int, world_size: int, cu_seqlens: tuple | None) -> tuple[torch.Tensor, ...]:
    """Every rank's packed-stream positions (increasing LongTensors), cached per batch.

    Raises ``ValueError`` if the layout cannot split ``seq_len`` over ``world_size`` ranks and
    ``NotImplementedError`` for a layout whose positions do not increase on a rank.
    """
    lay = get_layout(layout)
    lay.check(seq_len, world_size)
    return tuple(increasing_positions(lay, seq_len, r, world_size, cu_seqlens, "the cost model")
                 for r in range(world_size))


def _bounds(seq_len: int, cu_seqlens: tuple | None) -> torch.Tensor:
    return _as_tensor(cu_seqlens if cu_seqlens is not None else (0, seq_len))


@functools.lru_cache(maxsize=32)
def rank_pair_totals(layout: str, causal: bool, window: tuple, seq_len: int, world_size: int,
                     cu_seqlens: tuple | None) -> tuple[int, ...]:
    """The (query, key) pairs each rank computes over the whole ring, exactly: the sum over its queries
    of the keys each one sees (its document's, up to itself when causal, inside flash-attn's ``window``).

    Raises as :func:`rank_positions`.
    """
    cu = _bounds(seq_len, cu_seqlens)
    left, right = (int(window[0]), int(window[1]))
    out = []
    for pos in rank_positions(layout, seq_len, world_size, cu_seqlens):
        doc = torch.searchsorted(cu, pos, right=True) - 1
        lo, hi = cu[doc], cu[doc + 1] - 1
        if left >= 0:
            lo = torch.maximum(lo, pos - left)
        if causal:
            hi = pos
        elif right >= 0:
            hi = torch.minimum(hi, pos + right)
        out.append(int((hi - lo + 1).clamp(min=0).sum()))
    return tuple(out)


@functools.lru_cache(maxsize=32)
def step_needs(layout: str, causal: bool, window: tuple, seq_len: int, world_size: int,
               cu_seqlens: tuple | None) -> tuple[tuple[int, ...], ...]:
    """``rows[rank][step]``: how many K/V rows ``rank`` needs, so receives, at each ring step (step 0
    and the steps the ring does not run: 0), :func:`cp_attention.schedules.needs.traffic_model`'s,
    cached per batch; rank ``r`` sends ``rows[(r + s) % N][s]`` at step ``s``.

    Raises ``ValueError`` for a length the layout cannot split, bad ``cu_seqlens`` or ``window``.
    """
    return tuple(map(tuple, traffic_model(layout, causal, seq_len, world_size, cu_seqlens,
                                          window_or_none(causal, window))))


def needs_only_bytes(rows: tuple[tuple[int, ...], ...], steps: int, kv_row: float, acc_row: float,
                     backward: bool, gather: bool) -> tuple[float, tuple[float, ...], int]:
    """``(critical, per_rank, messages)`` of one call whose ring of ``steps`` steps moves the needed
    ``rows[rank][step]`` (:func:`step_needs`) of ``kv_row`` bytes (a K and a V row) forward, and with
    ``backward`` the same K/V again but the last step's (kept from the forward; all of them again when
    ``gather``: the all-gather's backward gathers anew) and the rows' dK/dV partials (``acc_row``
    bytes each) home.

    ``per_rank[r]``: the bytes rank ``r`` sends (it sends ``rows[r + s][s]`` K/V rows at step ``s`` and
    the partials of the ``rows[r][s]`` it received). ``critical``: for the ring, the sum over the
    steps of the most any rank receives at that step (a step waits for its slowest exchange); for the
    all-gather, the most any rank sends or receives in all. ``messages``: the exchanges with bytes on
    the critical path (a step where nobody needs anything sends nothing).
    """
    world = len(rows)
    live = range(1, steps)
    kv_steps = range(1, steps) if gather or not backward else range(1, steps - 1)
    passes = 2 if backward and gather else 1
    send = [[rows[(r + s) % world][s] for s in range(world)] for r in range(world)]
    dkv = acc_row if backward else 0.0

    def rank_bytes(out: list[int], back: list[int]) -> float:
        fwd = sum(out[s] for s in live) * kv_row
        again = sum(out[s] for s in kv_steps) * kv_row if backward else 0.0
        return fwd * (passes if gather else 1) + (0.0 if gather else again) + dkv * sum(back[s] for s in live)

    per_rank = tuple(rank_bytes(send[r], list(rows[r])) for r in range(world))
    most = [max(rows[r][s] for r in range(world)) for s in range(world)]
    if gather:
        received = max(rank_bytes(list(rows[r]), send[r]) for r in range(world))
        critical = max(max(per_rank), received)
        messages = sum(1 for s in live if most[s]) * (3 if backward else 1)
        return critical, per_rank, messages
    critical = kv_row * sum(most[s] for s in live) + dkv * sum(most[s] for s in live)
    critical += kv_row * sum(most[s] for s in kv_steps) if backward else 0.0
    messages = sum(1 for s in live if most[s]) * (2 if backward else 1) + \
        (sum(1 for s in kv_steps if most[s]) if backward else 0)
    return critical, per_rank, messages


def ring_seconds(rows: tuple[tuple[int, ...], ...], steps: int, kv_row: float, acc_row: float, backward: bool,
                 ranks_per_node: int, intra_bw: float, inter_bw: float) -> float:
    """Seconds the needs-only ring spends moving ``rows`` (:func:`step_needs`, bytes per row as for
    :func:`needs_only_bytes`): per step, the slowest exchange: the most any rank receives over its
    link, NVLink (``intra_bw``) from a rank of its own node (``ranks_per_node`` consecutive ranks),
    InfiniBand (``inter_bw``) across nodes; the dK/dV partials return over the same pair. Whole
    shards give ``critical_bytes / bandwidth`` of the slowest link, as before."""
    world = len(rows)
    total = 0.0
    for s in range(1, steps):
        per_row = kv_row * (1 + (backward and s < steps - 1)) + (acc_row if backward else 0.0)
        worst = max(rows[r][s] / (intra_bw if r // ranks_per_node == ((r - s) % world) // ranks_per_node
                                  else inter_bw) for r in range(world))
        total += worst * per_row
    return total


# Whole shards: the ring's bytes, shared with the studies' projections (studies/layout_comparison/
# analysis.py) through cost.py, so that the library holds the one performance model.

def accumulator_bytes(elem_bytes: int) -> int:
    """Bytes of one dK/dV accumulator element: the engine accumulates in fp32, or fp64 for fp64 inputs."""
    return 8 if elem_bytes == 8 else 4


def kv_bytes_per_hop(batch: int, tokens: int, kv_heads: int, head_dim: int, v_head_dim: int,
                     elem_bytes: int) -> int:
    """Bytes of one K/V shard of ``tokens`` tokens, what one ring hop sends: ``B * tokens * Hkv * (D + Dv) * elem``."""
    return batch * tokens * kv_heads * (head_dim + v_head_dim) * elem_bytes


def ring_bytes_per_rank(kv_bytes: int, dkv_bytes: int, steps: int) -> tuple[int, int]:
    """Bytes each rank of a ring of ``steps`` steps sends, ``(forward, backward)``, the same for every layout.

    Forward sends its K/V shard (``kv_bytes``) ``steps - 1`` times. Backward runs the steps in reverse
    from the shard the forward held last, so it sends K/V ``steps - 2`` times, plus the dK/dV
    partials (``dkv_bytes``) ``steps - 1`` times: a rank's own contribution stays home, and each
    other step's partial goes straight back to the owner."""
    if steps <= 1:
        return 0, 0
    return (steps - 1) * kv_bytes, (steps - 2) * kv_bytes + (steps - 1) * dkv_bytes
