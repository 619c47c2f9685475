"""The layout comparison's arithmetic on top of the work model: splits, padding, summaries, the
cluster projection.

Pure Python on top of :mod:`cp_attention.schedules` (no torch.distributed, no plotting), so it runs
for world sizes far beyond one machine. A work matrix is what :func:`cp_attention.work_model`
returns: ``work[rank][step]`` = score pairs that rank computes at that ring step.

The projection is a deliberately small model (see :func:`project`); its assumptions are listed in
``studies/layout_comparison/report.py``'s report and in the docstrings here. Its pair, flop, balance and
byte counts are those the benchmarks print too, :mod:`benchmarks.modelled` (on the library's one
performance model, :mod:`cp_attention.strategies.cost`); this module adds what only the comparison
needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.modelled import (
    AttentionShape,
    check_work,
    flops_per_pair,
    imbalance,
    kv_bytes_per_hop,
    min_pairs,
    step_sync_efficiency,
)
from cp_attention.layouts import Layout, get_layout
from cp_attention.schedules import rank_steps, source_rank

__all__ = [
    "WorkSummary",
    "ClusterSpec",
    "Projection",
    "split_problem",
    "summarize",
    "pair_owners",
    "project",
    "document_pairs",
    "PaddingCost",
    "document_padding",
]


def split_problem(layout: str | Layout, seq_len: int, world_size: int) -> str | None:
    """Why ``layout`` cannot split ``seq_len`` over ``world_size`` ranks, or None if it can."""
    try:
        get_layout(layout).check(seq_len, world_size)
    except ValueError as e:
        return str(e)
    return None


def document_pairs(lengths: Sequence[int], causal: bool) -> int:
    """The (query, key) pairs attention within each document needs: ``sum_d min_pairs(L_d)``."""
    return sum(min_pairs(n, causal) for n in lengths)


@dataclass(frozen=True)
class PaddingCost:
    """What padding every document up to a multiple of ``multiple`` adds to a packed batch.

    TransformerEngine's THD context parallelism and ring-flash-attention's varlen zigzag need every
    document's length to be a multiple of 2N (``multiple = 2 * world_size``), so each document gets
    ``-L % 2N`` padding tokens. Pairs count the padded documents as if their padding were attended
    (their causal triangles): an upper bound for a kernel that skips padded rows and keys.
    """

    multiple: int
    documents: int
    tokens: int  # real tokens: sum of the document lengths
    pad_tokens: int  # sum over documents of -L % multiple
    pairs: int  # pairs the unpadded documents need
    padded_pairs: int  # pairs of the padded documents

    @property
    def padded_tokens(self) -> int:
        return self.tokens + self.pad_tokens

    @property
    def extra_pairs(self) -> int:
        return self.padded_pairs - self.pairs


def document_padding(lengths: Sequence[int], multiple: int, causal: bool) -> PaddingCost:
    """Tokens and pairs of padding each document of ``lengths`` up to a multiple of ``multiple``.

    Raises ``ValueError`` for ``multiple < 1`` or a document length below 1.
    """
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    if any(n < 1 for n in lengths):
        raise ValueError("every document length must be >= 1")
    pads = [-n % multiple for n in lengths]
    return PaddingCost(multiple, len(lengths), sum(lengths), sum(pads), document_pairs(lengths, causal),
                       document_pairs([n + p for n, p in zip(lengths, pads)], causal))


@dataclass(frozen=True)
class WorkSummary:
    """Balance metrics of one (layout, causal, S, N) work matrix. Pair counts are exact integers."""

    world_size: int
    per_rank: tuple[int, ...]  # score pairs per rank, summed over steps
    total_pairs: int
    min_pairs: int
    imbalance: float
    step_sync_efficiency: float
    redundant_fraction: float  # (computed - minimum) / minimum: pairs computed more than needed
    idle_fraction: float  # rank-time spent waiting at step barriers, relative to the minimum work


def summarize(work: Sequence[Sequence[int]], seq_len: int, causal: bool) -> WorkSummary:
    """All balance metrics for a modelled work matrix ``work[rank][step]`` (score pairs).

    Raises ``ValueError`` for an empty or ragged matrix or zero total work.
    """
    eff = step_sync_efficiency(work)
    n = len(work)
    total = sum(map(sum, work))
    need = min_pairs(seq_len, causal)
    slowest = sum(max(row[s] for row in work) for s in range(len(work[0])))
    return WorkSummary(
        world_size=n,
        per_rank=tuple(sum(row) for row in work),
        total_pairs=total,
        min_pairs=need,
        imbalance=imbalance(work),
        step_sync_efficiency=eff,
        redundant_fraction=(total - need) / need,
        idle_fraction=(n * slowest - total) / need,
    )


def pair_owners(layout: str | Layout, causal: bool, seq_len: int, world_size: int
                ) -> list[tuple[int, int, int, int]]:
    """Every computed (query, key) pair in GLOBAL token positions: ``(q, k, rank, step)``.

    For mask pictures at small sizes (it lists S² pairs at most). Raises ``ValueError`` if the
    layout cannot split ``seq_len`` over ``world_size``.
    """
    lay = get_layout(layout)
    lay.check(seq_len, world_size)
    n = seq_len // world_size
    pos = [lay.positions(seq_len, r, world_size).tolist() for r in range(world_size)]
    out = []
    for r in range(world_size):
        for s, tasks in enumerate(rank_steps(lay, causal, r, world_size, n)):
            j = source_rank(r, world_size, s)
            for t in tasks:
                for i in range(t.q_stop - t.q_start):
                    keys = min(i + 1, t.kv_stop - t.kv_start) if t.causal else t.kv_stop - t.kv_start
                    for c in range(keys):
                        out.append((pos[r][t.q_start + i], pos[j][t.kv_start + c], r, s))
    return out


@dataclass(frozen=True)
class ClusterSpec:
    """A cluster for the projection: one ring link and one device's attention throughput."""

    name: str = "cluster"
    link_gbytes_per_s: float = 50.0  # per direction, per link (GB/s = 1e9 bytes/s)
    link_latency_us: float = 10.0  # per ring hop
    attention_tflops: float = 400.0  # sustained attention-kernel throughput per device (1e12 flop/s)

    def __post_init__(self) -> None:
        if self.link_gbytes_per_s <= 0 or self.attention_tflops <= 0 or self.link_latency_us < 0:
            raise ValueError(f"cluster needs positive bandwidth and throughput and latency >= 0, got {self}")


@dataclass(frozen=True)
class Projection:
    """Projected attention time (seconds) of one call, forward and backward, with and without
    overlap of communication and compute, and the ideal (balanced, free communication)."""

    fwd_overlap_s: float
    fwd_serial_s: float
    bwd_overlap_s: float
    bwd_serial_s: float
    ideal_fwd_s: float
    ideal_bwd_s: float
    slowest_fwd_step_s: float  # the longest forward step with overlap
    comm_bound_steps: int  # forward steps (with overlap) where the hop takes longer than the compute

    @property
    def efficiency_overlap(self) -> float:
        """Ideal forward+backward time over the projected time with overlap."""
        return (self.ideal_fwd_s + self.ideal_bwd_s) / (self.fwd_overlap_s + self.bwd_overlap_s)

    @property
    def efficiency_serial(self) -> float:
        """Ideal forward+backward time over the projected time without overlap."""
        return (self.ideal_fwd_s + self.ideal_bwd_s) / (self.fwd_serial_s + self.bwd_serial_s)


def project(work: Sequence[Sequence[int]], seq_len: int, shape: AttentionShape, cluster: ClusterSpec,
            ring_length: int | None = None) -> Projection:
    """Project one attention call on ``cluster`` from a modelled work matrix ``work[rank][step]``.

    Model, per ring step s of the L = ``ring_length`` steps that run (default N; fewer under a sliding
    window, whose later steps do not run at all), in the engine's order:
      compute_s = max_r work[r][s] * B * H * flops_per_pair / throughput   (a step waits for its slowest rank)
      forward   comm_s = K/V bytes / bandwidth + latency for s < L-1 (no hop after the last step)
      backward  the steps in reverse, from the shard the forward held last:
                comm_s = (K/V bytes [s >= 2] + dK/dV bytes [s < L-1]) / bandwidth + latency: the
                K/V for step s-1 and the accumulator filled at step s+1 travel while step s computes;
                a rank's own contribution stays home, and no hop follows step 0
      step_s    = max(compute_s, comm_s) with overlap, compute_s + comm_s without.
    Throughput is the same for every block size; links are full duplex and every hop runs at once.
    Raises ``ValueError`` for an empty or ragged matrix or ``ring_length`` outside ``1..N``.
    """
    check_work(work)
    n = len(work)
    steps = n if ring_length is None else ring_length
    if not 1 <= steps <= len(work[0]):
        raise ValueError(f"ring_length must be in 1..{len(work[0])}, got {ring_length}")
    if any(row[s] for row in work for s in range(steps, len(row))):
        raise ValueError(f"work after ring step {steps} must be 0: those steps do not run")
    bh = shape.batch * shape.heads
    tput = cluster.attention_tflops * 1e12
    bw = cluster.link_gbytes_per_s * 1e9
    lat = cluster.link_latency_us * 1e-6
    kv = kv_bytes_per_hop(seq_len, n, shape) if n > 1 else 0
    dkv = kv_bytes_per_hop(seq_len, n, shape, shape.acc_bytes) if n > 1 else 0
    fwd_pair, bwd_pair = flops_per_pair(shape, False) * bh / tput, flops_per_pair(shape, True) * bh / tput
    slowest = [max(row[s] for row in work) for s in range(steps)]
    total = sum(map(sum, work))

    def hop(nbytes: int) -> float:
        return nbytes / bw + lat if nbytes else 0.0

    fwd_o = fwd_s = bwd_o = bwd_s = worst = 0.0
    comm_bound = 0
    for s, pairs in enumerate(slowest):
        last = s == steps - 1
        c, m = pairs * fwd_pair, hop(0 if last else kv)
        fwd_o += max(c, m)
        fwd_s += c + m
        worst = max(worst, max(c, m))
        comm_bound += m > c
        c, m = pairs * bwd_pair, hop((kv if s >= 2 else 0) + (0 if last else dkv))
        bwd_o += max(c, m)
        bwd_s += c + m
    return Projection(fwd_o, fwd_s, bwd_o, bwd_s, total * fwd_pair / n, total * bwd_pair / n, worst, comm_bound)
