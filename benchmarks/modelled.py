"""What the work model and the cost model say a measurement should show: the pairs and FLOPs of
attention, how evenly the ranks share them, and the bytes a ring sends.

Pure Python on top of :mod:`cp_attention.schedules` and the library's one performance model,
:mod:`cp_attention.strategies.cost` (``pairs``, ``matmul_flops``, ``kv_bytes_per_hop``,
``ring_bytes_per_rank``), so it runs for world sizes far beyond one machine. A work matrix is what
:func:`cp_attention.work_model` returns: ``work[rank][step]`` = score pairs that rank computes at that
ring step. The benchmarks print these figures beside what they measure; the layout comparison
(``studies/layout_comparison/analysis.py``) builds its summaries and cluster projection on them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from cp_attention.strategies import batch_model
from cp_attention.strategies.cost import accumulator_bytes, matmul_flops, pairs, ring_bytes_per_rank
from cp_attention.strategies.cost import kv_bytes_per_hop as _shard_bytes

__all__ = [
    "Work",
    "AttentionShape",
    "check_work",
    "min_pairs",
    "imbalance",
    "step_sync_efficiency",
    "kv_bytes_per_hop",
    "comm_bytes_per_rank",
    "flops_per_pair",
    "training_bytes",
    "model_bytes",
    "one_thread",
]

Work = Sequence[Sequence[float]]  # work[rank][step]; pairs (modelled) or seconds (measured)


def check_work(work: Work) -> None:
    """Raise ``ValueError`` unless ``work`` is a non-empty rank x step matrix with equal-length rows."""
    if not work or not work[0] or any(len(row) != len(work[0]) for row in work):
        raise ValueError("work must be a non-empty rank x step matrix with equal-length rows")


def min_pairs(seq_len: int, causal: bool) -> int:
    """The (query, key) pairs full attention must compute: S(S+1)/2 causal, S² otherwise (the cost
    model's :func:`cp_attention.strategies.cost.pairs`)."""
    return pairs(seq_len, causal)


def imbalance(work: Work) -> float:
    """Total imbalance: the busiest rank's work over the mean rank's work (1.0 = balanced).

    ``work[rank][step]``. Raises ``ValueError`` for an empty or ragged matrix or zero total work.
    """
    check_work(work)
    totals = [sum(row) for row in work]
    mean = sum(totals) / len(totals)
    if mean <= 0:
        raise ValueError("imbalance is undefined for zero total work")
    return max(totals) / mean


def step_sync_efficiency(work: Work) -> float:
    """Ideal time over step-synchronous time: ``(total / N) / sum_s max_r work[r][s]``.

    A ring step waits for its slowest member, so each step costs its busiest rank's work; the
    ideal spreads the total evenly over N ranks with no waiting. 1.0 = no rank ever waits.
    Raises ``ValueError`` for an empty or ragged matrix or zero total work.
    """
    check_work(work)
    steps = len(work[0])
    slowest = sum(max(row[s] for row in work) for s in range(steps))
    if slowest <= 0:
        raise ValueError("efficiency is undefined for zero total work")
    return sum(map(sum, work)) / len(work) / slowest


@dataclass(frozen=True)
class AttentionShape:
    """What one attention call moves and computes besides the sequence: sizes and element bytes."""

    batch: int = 1
    heads: int = 8
    kv_heads: int = 8
    head_dim: int = 64
    v_head_dim: int | None = None  # None: head_dim
    elem_bytes: int = 4  # q/k/v element size (2 for bf16/fp16, 4 fp32, 8 fp64)

    @property
    def dv(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def acc_bytes(self) -> int:
        """The engine accumulates dK/dV in fp32, or fp64 for fp64 inputs."""
        return accumulator_bytes(self.elem_bytes)


def kv_bytes_per_hop(seq_len: int, world_size: int, shape: AttentionShape, elem_bytes: int | None = None) -> int:
    """Bytes of one K/V shard (what one ring hop sends): ``B * (S/N) * Hkv * (D + Dv) * elem``
    (:func:`cp_attention.strategies.cost.kv_bytes_per_hop`)."""
    elem = shape.elem_bytes if elem_bytes is None else elem_bytes
    return _shard_bytes(shape.batch, seq_len // world_size, shape.kv_heads, shape.head_dim, shape.dv, elem)


def comm_bytes_per_rank(seq_len: int, world_size: int, shape: AttentionShape, ring_length: int | None = None
                        ) -> tuple[int, int]:
    """Bytes each rank sends: ``(forward, backward)``, the same for every layout.

    Mirrors the engine for a ring of ``ring_length`` steps (default ``world_size``; fewer under a
    sliding window, see :func:`cp_attention.ring_length`): the cost model's
    :func:`cp_attention.strategies.cost.ring_bytes_per_rank`.
    """
    steps = world_size if ring_length is None else ring_length
    if world_size == 1:
        return 0, 0
    return ring_bytes_per_rank(kv_bytes_per_hop(seq_len, world_size, shape),
                               kv_bytes_per_hop(seq_len, world_size, shape, shape.acc_bytes), steps)


def flops_per_pair(shape: AttentionShape, backward: bool) -> float:
    """Matmul flops per (query, key) pair and query head.

    Forward: QKᵀ and PV, ``2(D + Dv)``. Backward (flash style, scores recomputed): QKᵀ, dV, dP,
    dQ and dK, ``2(3D + 2Dv)`` (2.5x forward for D == Dv): the cost model's
    :func:`cp_attention.strategies.cost.matmul_flops`, so the two agree.
    """
    return matmul_flops(shape.head_dim, shape.dv, backward)


def training_bytes(rows: Sequence[Sequence[int]], shape: AttentionShape) -> int:
    """K/V and dK/dV bytes all ranks send in one training step (forward + backward) when rank ``r``
    receives ``rows[r][s]`` K/V rows at ring step ``s`` (every step running): the forward's K/V, the
    backward's again but the last step's (kept from the forward), and the rows' dK/dV partials (in the
    accumulator dtype) home. Whole shards: ``rows[r][s] = T / N`` for ``s >= 1``."""
    kv = shape.batch * shape.kv_heads * (shape.head_dim + shape.dv)
    steps = len(rows[0])
    _, per_rank, _ = batch_model.needs_only_bytes(tuple(map(tuple, rows)), steps, kv * shape.elem_bytes,
                                                  kv * shape.acc_bytes, True, False)
    return round(sum(per_rank))


def model_bytes(layout: str, total: int, world_size: int, shape: AttentionShape, cu_seqlens=None,
                causal: bool = True) -> tuple[int, int]:
    """``(needs_only, whole)``: K/V + dK/dV bytes of one forward + backward call over ``world_size``
    ranks, all ranks (:func:`training_bytes`), what the engine sends and what whole shards would.
    Raises ``ValueError`` if the layout cannot split ``total`` over ``world_size`` ranks."""
    if world_size == 1:
        return 0, 0
    needs = batch_model.step_needs(layout, causal, (-1, -1), total, world_size,
                                   None if cu_seqlens is None else tuple(int(x) for x in cu_seqlens))
    n = total // world_size
    return training_bytes(needs, shape), training_bytes([[0] + [n] * (world_size - 1)] * world_size, shape)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one intra-op thread for the work model's index math: its tensors are small, so extra
    threads only add synchronisation (2-3x slower on 2 cores, 10x and more on a loaded machine)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
