"""The cost model behind ``cp_comm_type="auto"``: time, bytes and K/V memory per rank of each strategy.

Deliberately small and closed-form: it runs once per plan and call shape, well under a millisecond
for one document and a few milliseconds the first time it sees thousands of packed ones (each
workload's pair counts are cached; nothing loops over tokens).

- compute: attention's matmul FLOPs (:func:`matmul_flops`: ``2(D + Dv)`` per (query, key) pair and
  query head forward, ``2(3D + 2Dv)`` backward, as studies/layout_comparison/analysis.py projects
  the ring) at ``Hardware.flops``, plus ``Hardware.kernel_call_s`` per kernel call. The ring and
  all-gather are bound by the busiest rank: with packed documents exact for every layout whose
  positions increase (each rank's pairs from its positions, :mod:`.batch_model`); else exact in
  closed form for ``contiguous`` (any mask, windows) and for the causal ``zigzag``/``interleaved``
  rules; zigzag and interleaved under a window count as balanced. All-to-all splits heads, so it is
  balanced.
- communication: the bytes each strategy's execution sends (see :mod:`.composite`, :mod:`.alltoall`):
  the ring overlaps its hops with its steps' compute; all-gather and all-to-all do not. The ring and
  the all-gather send only the K/V rows a rank needs, and their dK/dV partials home
  (:mod:`cp_attention.schedules.needs`, counted from the batch's positions by :mod:`.batch_model`): a
  ring step costs its slowest exchange (a rank's rows over its pair's link: NVLink inside a node,
  InfiniBand across), and a step nobody needs anything at costs nothing; ``comm_bytes`` is the most
  one rank sends (``extra["rank_bytes"]``: every rank's). A single sequence saves bytes (causal
  zigzag: a quarter) but not ring time (some rank needs a whole shard at every step); packed
  documents and windows save both. The ring of ``"a2a+p2p"`` carries whole shards. A window
  shortens the ring (:func:`closed_ring_length`, the closed form of
  :func:`cp_attention.schedules.derived.ring_length` for the built-in layouts). A group inside one
  node (``ranks_per_node``) moves bytes at ``intra_bw``; across nodes whole shards are bound by
  ``inter_bw`` and an all-to-all or all-gather sends its off-node fraction there. ``"a2a+p2p"`` keeps
  its all-to-all inside the mesh's inner dim (a node) and rings across the outer.
- memory: the K/V bytes one rank holds at once, its input shard included (the ring: its shard and two
  in flight; all-gather: every shard of the ring's length; all-to-all: the swapped heads too).

Left out: per-document kernel calls (CUDA's varlen kernels run one call per step whatever the
documents; CPU kernels batch small documents), the kernels' efficiency on small blocks, the LSE's
bytes, and the all-to-all's transient chunks. The model ranks strategies; its absolute times are estimates.
``benchmarks/strategies.py`` measures how often its pick is within 10% of the best one.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field, replace

import torch

from ..layouts.registry import get_layout
from ..schedules.causal import get_schedule
from ..schedules.lowering import BAND_TILE
from ..schedules.work import work_model
from . import batch_model

# the ring's whole-shard bytes, shared with the studies' projections (studies/layout_comparison)
from .batch_model import accumulator_bytes, kv_bytes_per_hop, ring_bytes_per_rank  # noqa: F401
from .names import STRATEGIES

__all__ = ["Hardware", "HARDWARE", "Workload", "Estimate", "default_hardware", "set_hardware", "current_hardware",
           "infeasible", "estimate", "choose", "pairs", "matmul_flops", "rank_pairs",
           "closed_ring_length"]


@dataclass(frozen=True)
class Hardware:
    """One rank's compute and links: achieved attention FLOP/s, one-direction bytes/s within a node
    (NVLink) and across nodes (InfiniBand), ranks per node, latency per message and per kernel call."""

    name: str
    flops: float
    intra_bw: float
    inter_bw: float
    ranks_per_node: int
    latency_s: float
    kernel_call_s: float


HARDWARE: dict[str, Hardware] = {
    # H100 SXM: ~400 TFLOP/s achieved by bf16 attention kernels; NVLink 4 at 450 GB/s per direction,
    # ~300 GB/s achieved P2P; NDR InfiniBand 400 Gb/s per GPU, ~40 GB/s achieved.
    "h100": Hardware("h100", 400e12, 300e9, 40e9, 8, 10e-6, 8e-6),
    "h200": Hardware("h200", 420e12, 320e9, 40e9, 8, 10e-6, 8e-6),
    # 4 gloo ranks over loopback TCP on 2 CPU cores, fp32 (scripts/benchmark_strategies.py calibrates
    # its own): on a quiet machine ~20 GFLOP/s per rank, ~1 GB/s, ~0.3 ms per message, ~0.7 ms per
    # attention call; a busy machine halves the first two
    "cpu_gloo": Hardware("cpu_gloo", 20e9, 1e9, 1e9, 1 << 20, 300e-6, 700e-6),
}
_CHOSEN: dict[str, Hardware | None] = {"hardware": None}


def default_hardware(device_type: str) -> Hardware:
    """The preset for ``device_type``: ``"cuda"`` is the H100's, with ``LOCAL_WORLD_SIZE`` (torchrun's
    ranks per node; 8 without it) as ranks per node; anything else the CPU/gloo preset."""
    if device_type == "cuda":
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "8") or 8)
        base = HARDWARE["h100"]
        return Hardware(base.name, base.flops, base.intra_bw, base.inter_bw, per_node, base.latency_s,
                        base.kernel_call_s)
    return HARDWARE["cpu_gloo"]


def set_hardware(hardware: Hardware | str | None) -> None:
    """What ``"auto"`` models from now on in this process: a :class:`Hardware`, a preset's name, or
    None (back to :func:`default_hardware`). Set it alike on every rank. Raises ``ValueError`` for an
    unknown name."""
    if isinstance(hardware, str):
        if hardware not in HARDWARE:
            raise ValueError(f"unknown hardware preset {hardware!r}; expected one of {', '.join(HARDWARE)} or a "
                             "cp_attention.strategies.cost.Hardware")
        hardware = HARDWARE[hardware]
    if hardware is not None and not isinstance(hardware, Hardware):
        raise ValueError(f"set_hardware takes a Hardware, a preset's name or None, got {type(hardware).__name__}")
    _CHOSEN["hardware"] = hardware


def current_hardware(device_type: str) -> Hardware:
    """The profile ``"auto"`` uses for tensors on ``device_type``."""
    return _CHOSEN["hardware"] or default_hardware(device_type)


@dataclass(frozen=True)
class Workload:
    """One attention call as the cost model sees it (``seq_len`` global; ``inner`` the all-to-all degree
    of a 2-D mesh, 1 for a 1-D group; ``backward``: training, forward + backward)."""

    world_size: int
    batch: int
    seq_len: int
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype_bytes: int
    causal: bool = True
    window: tuple = (-1, -1)
    cu_seqlens: tuple | None = None
    layout: str = "zigzag"
    inner: int = 1
    backward: bool = True


@dataclass(frozen=True)
class Estimate:
    """Seconds of compute, of communication, of it not hidden behind compute, in all; bytes sent and
    K/V bytes held by one rank."""

    compute_s: float
    comm_s: float
    exposed_comm_s: float
    total_s: float
    comm_bytes: float
    peak_kv_bytes: float
    extra: dict = field(default_factory=dict, compare=False)


def matmul_flops(head_dim: int, v_head_dim: int, backward: bool) -> float:
    """Matmul FLOPs per (query, key) pair and query head: forward QKᵀ and PV, ``2(D + Dv)``; backward
    (flash style, scores recomputed: QKᵀ, dV, dP, dQ, dK) ``2(3D + 2Dv)``, 2.5x forward for D == Dv."""
    return 2.0 * (3 * head_dim + 2 * v_head_dim) if backward else 2.0 * (head_dim + v_head_dim)


def _tri(m: int) -> int:
    return m * (m + 1) // 2 if m > 0 else 0


def pairs(length: int, causal: bool, window: tuple = (-1, -1)) -> int:
    """(query, key) pairs one sequence of ``length`` tokens attends under flash-attn's ``window``."""
    left, right = window
    right = 0 if causal else right
    cut = (_tri(length - 1 - left) if left >= 0 else 0) + (_tri(length - 1 - right) if right >= 0 else 0)
    return length * length - cut


def _prefix_pairs(p: torch.Tensor, length: torch.Tensor, causal: bool, window: tuple) -> torch.Tensor:
    """Pairs of the first ``p`` queries of documents of ``length`` tokens (int64 tensors, elementwise):
    the sum over positions i < p of the keys query i sees, in closed form."""
    left, right = window
    if causal:  # query i sees min(i, left) + 1 keys
        if left < 0:
            return p * (p + 1) // 2
        w = left + 1
        return torch.where(p <= w, p * (p + 1) // 2, w * (w + 1) // 2 + (p - w) * w)
    # query i sees keys max(0, i - left) ..= min(L - 1, i + right)
    if right < 0:
        upper = p * length
    else:
        c = torch.minimum((length - right - 1).clamp(min=0), p)  # queries whose right edge is inside
        upper = c * (c - 1) // 2 + c * (right + 1) + (p - c) * length
    if left < 0:
        return upper
    m = (p - 1 - left).clamp(min=0)
    return upper - m * (m + 1) // 2


@functools.lru_cache(maxsize=16)
def _docs(seq_len: int, cu_seqlens: tuple | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(cu_seqlens, lengths, longest)``: the documents (one of ``seq_len`` without ``cu_seqlens``)."""
    cu = torch.tensor(cu_seqlens if cu_seqlens is not None else (0, seq_len), dtype=torch.int64)
    lengths = cu[1:] - cu[:-1]
    return cu, lengths, int(lengths.max())


@functools.lru_cache(maxsize=64)
def rank_pairs(seq_len: int, world_size: int, causal: bool, window: tuple = (-1, -1),
               cu_seqlens: tuple | None = None) -> tuple[int, ...]:
    """The (query, key) pairs each rank of the ``contiguous`` layout computes (rank r holds the queries
    ``[r*S/N, (r+1)*S/N)`` of the packed stream), exactly, in O(documents + N). ``seq_len`` must
    divide by ``world_size``."""
    cu, lengths, _ = _docs(seq_len, cu_seqlens)
    done = torch.cat([torch.zeros(1, dtype=torch.int64),
                      torch.cumsum(_prefix_pairs(lengths, lengths, causal, window), 0)])
    edges = torch.arange(world_size + 1, dtype=torch.int64) * (seq_len // world_size)
    doc = (torch.searchsorted(cu, edges, right=True) - 1).clamp(0, len(lengths) - 1)
    before = done[doc] + _prefix_pairs(edges - cu[doc], lengths[doc], causal, window)
    return tuple((before[1:] - before[:-1]).tolist())


@functools.lru_cache(maxsize=64)
def _total_pairs(seq_len: int, causal: bool, window: tuple, cu_seqlens: tuple | None) -> int:
    if cu_seqlens is None:
        return pairs(seq_len, causal, window)
    lengths = _docs(seq_len, cu_seqlens)[1]
    return int(_prefix_pairs(lengths, lengths, causal, window).sum())


@functools.lru_cache(maxsize=16)
def _scheduled_share(layout: str, world: int) -> float:
    """A layout with its own causal schedule: the busiest rank's share from the work model (the shares
    hardly depend on S, so a short sequence the layout can split stands for every S)."""
    lay = get_layout(layout)
    work = work_model(lay, True, 8 * lay.divisor(world), world)
    return max(map(sum, work)) / sum(map(sum, work))


def _layout(name: str):
    """The registered layout called ``name``, or None (a layout object known to no registry)."""
    try:
        return get_layout(name)
    except (KeyError, ValueError):
        return None


def _busiest_share(w: Workload, world: int) -> float:
    """The busiest rank's share of all pairs under the layout at ``world`` ranks (1/world: balanced)."""
    layout = _layout(w.layout)
    if world == 1:
        return 1.0
    if layout is None:
        return 1.0 / world
    if w.cu_seqlens is not None and world == w.world_size:  # packed: each rank's pairs from its positions
        try:
            work = batch_model.rank_pair_totals(layout.name, w.causal, tuple(w.window), w.seq_len, world, w.cu_seqlens)
            return max(work) / max(1, sum(work))
        except (ValueError, NotImplementedError):  # a layout that cannot split T, or whose positions do not increase
            pass
    if layout.name == "contiguous" and w.seq_len % world == 0:
        work = rank_pairs(w.seq_len, world, w.causal, tuple(w.window), w.cu_seqlens)
        return max(work) / max(1, sum(work))
    plain = w.causal and w.window[0] < 0 and w.cu_seqlens is None
    if not plain or w.seq_len % layout.divisor(world):
        return 1.0 / world  # zigzag, interleaved: every document and window spread over every rank
    if layout.name == "zigzag":
        return 1.0 / world  # chunks r and 2N-1-r: every rank n(n+1)/2 + (N-1) n^2/2 pairs
    if layout.name == "interleaved":  # rank r: N n(n-1)/2 + n(r+1) pairs, the last rank the most
        n = w.seq_len // world
        return (world * n * (n - 1) / 2 + n * world) / (w.seq_len * (w.seq_len + 1) / 2)
    if get_schedule(layout) is not None and world <= 64:
        return _scheduled_share(layout.name, world)
    return 1.0 / world


def _normal(w: Workload) -> Workload:
    """``w`` with its window and documents as tuples of ints (the caches key on them)."""
    cu = w.cu_seqlens
    if type(w.window) is tuple and (cu is None or type(cu) is tuple):
        return w
    return replace(w, window=tuple(int(x) for x in w.window),
                   cu_seqlens=None if cu is None else tuple(int(x) for x in cu))


def closed_ring_length(w: Workload) -> int:
    """The ring's length for ``w`` on ``w.world_size`` ranks, the steps that run: N, fewer when a window
    keeps every query away from the farther shards. The closed form of
    :func:`cp_attention.schedules.derived.ring_length` for the built-in layouts (N for others)."""
    w = _normal(w)
    world, left, right = w.world_size, w.window[0], w.window[1]
    if left < 0 and (w.causal or right < 0):
        return world
    longest = _docs(w.seq_len, w.cu_seqlens)[2]
    ahead = 0 if w.causal else (longest - 1 if right < 0 else min(right, longest - 1))
    if ahead > 0:  # keys on later shards: the ring must come all the way round
        return world
    reach = min(left if left >= 0 else w.seq_len, longest - 1)
    layout = _layout(w.layout)
    name = None if layout is None else layout.name
    if reach <= 0:
        return 1
    if name == "contiguous":
        return min(world, 1 + math.ceil(reach * world / w.seq_len))
    if name == "interleaved":
        return min(world, 1 + reach)
    return world  # zigzag: chunk 2N-1-r needs chunk 2N-2-r, one rank on, so every step runs


def _calls(w: Workload, rows: float, steps: int) -> float:
    """Kernel calls per pass for ``rows`` query rows met over ``steps`` ring steps: one block per step,
    or under a window the band's row tiles (``schedules.lowering``: tiles of max(256, band/4) rows,
    up to 3 calls each: masked corner, full middle, causal end) and one boundary block per step."""
    left, right = w.window
    if left < 0:
        return steps
    band = left + 1 + (0 if w.causal or right < 0 else right)
    return 3 * math.ceil(rows / max(BAND_TILE, band // 4)) + steps - 1


def _step_needs(w: Workload) -> tuple[tuple[int, ...], ...] | None:
    """The K/V rows each rank needs at each ring step (:func:`.batch_model.step_needs`), or None where
    whole shards travel: one rank, a layout no registry knows, one that cannot split T or whose
    positions do not increase."""
    layout = _layout(w.layout)
    if layout is None or w.world_size == 1:
        return None
    try:
        return batch_model.step_needs(layout.name, w.causal, tuple(w.window), w.seq_len, w.world_size, w.cu_seqlens)
    except (ValueError, NotImplementedError):
        return None


def _link(hw: Hardware, span: int) -> float:
    return hw.intra_bw if span <= hw.ranks_per_node else hw.inter_bw


def _spread(hw: Hardware, world: int, nbytes: float) -> float:
    """Seconds to send ``nbytes`` spread evenly over ``world - 1`` peers (all-to-all, all-gather)."""
    if world <= hw.ranks_per_node:
        return nbytes / hw.intra_bw
    off = (world - hw.ranks_per_node) / (world - 1)
    return max(nbytes * (1 - off) / hw.intra_bw, nbytes * off / hw.inter_bw)


def infeasible(w: Workload, cp_comm_type: str) -> str | None:
    """Why ``cp_comm_type`` cannot run ``w`` (None: it can)."""
    if cp_comm_type not in STRATEGIES:
        return f"unknown strategy {cp_comm_type!r}"
    if cp_comm_type == "a2a" and w.heads % w.world_size:
        return f"a2a needs heads divisible by {w.world_size}, got {w.heads}"
    if cp_comm_type == "a2a+p2p":
        if w.inner <= 1 or w.world_size % w.inner:
            return "a2a+p2p needs a 2-D mesh (inner dim > 1)"
        if w.heads % w.inner:
            return f"a2a+p2p needs heads divisible by the inner dim {w.inner}, got {w.heads}"
    return None


def estimate(w: Workload, cp_comm_type: str, hw: Hardware, needs_only: bool = True) -> Estimate:
    """The modelled cost of running ``w`` with ``cp_comm_type`` on ``hw``; ``needs_only=False``: the
    ring and all-gather move whole shards (the plan's ``needs_only`` off, as before needs-only
    traffic). Raises ``ValueError`` if :func:`infeasible`."""
    problem = infeasible(w, cp_comm_type)
    if problem is not None:
        raise ValueError(problem)
    w = _normal(w)
    n, world, bwd = w.seq_len / w.world_size, w.world_size, w.backward
    flop = w.heads * (matmul_flops(w.head_dim, w.v_head_dim, False)
                      + (matmul_flops(w.head_dim, w.v_head_dim, True) if bwd else 0.0))
    work = _total_pairs(w.seq_len, w.causal, tuple(w.window), w.cu_seqlens) * w.batch * flop / hw.flops
    passes = 2 if bwd else 1  # kernel calls: one per block forward, one backward
    acc = 8 if w.dtype_bytes == 8 else 4  # dK/dV accumulate in fp32, fp64 for fp64

    def shard(tokens: float, kv_heads: int, size: int = w.dtype_bytes) -> float:
        return w.batch * tokens * kv_heads * (w.head_dim + w.v_head_dim) * size

    steps = closed_ring_length(w)
    own = shard(n, w.kv_heads)
    if cp_comm_type in ("p2p", "all_gather"):
        compute = work * _busiest_share(w, world) + _calls(w, n, steps) * passes * hw.kernel_call_s
        rows = _step_needs(w) if needs_only else None
        if rows is not None:  # only the needed rows travel (the engine's default)
            kv_row, acc_row = shard(1, w.kv_heads), shard(1, w.kv_heads, acc)
            critical, per_rank, hops = batch_model.needs_only_bytes(rows, steps, kv_row, acc_row, bwd,
                                                                    cp_comm_type == "all_gather")
            sent, extra = max(per_rank), {"needs_only": True, "rank_bytes": per_rank, "critical_bytes": critical}
            if cp_comm_type == "p2p":  # each step's slowest exchange over its own link
                comm = batch_model.ring_seconds(rows, steps, kv_row, acc_row, bwd, hw.ranks_per_node, hw.intra_bw,
                                                hw.inter_bw) + hops * hw.latency_s
                exposed = max(0.0, comm - compute * (steps - 1) / steps)
                return Estimate(compute, comm, exposed, compute + exposed, sent, 3 * own if steps > 1 else own, extra)
        else:  # whole shards: forward L-1 K/V hops; backward L-2 K/V hops and L-1 dK/dV accumulator hops
            fwd_bytes = (steps - 1) * own
            dkv_bytes = (steps - 1) * shard(n, w.kv_heads, acc) if bwd else 0.0
            hops = (steps - 1) * (3 if bwd else 1)
            # all-gather: backward gathers the shards again
            sent = fwd_bytes * (passes if cp_comm_type == "all_gather" else 1) + dkv_bytes + \
                (max(steps - 2, 0) * own if bwd and cp_comm_type == "p2p" else 0.0)
            critical, extra = sent, {"needs_only": False}
        if cp_comm_type == "p2p":
            comm = critical / _link(hw, world) + hops * hw.latency_s
            exposed = max(0.0, comm - compute * (steps - 1) / steps)
            return Estimate(compute, comm, exposed, compute + exposed, sent, 3 * own if steps > 1 else own, extra)
        comm = _spread(hw, world, critical) + hops * hw.latency_s
        return Estimate(compute, comm, comm, compute + comm, sent, steps * own, extra)
    inner = world if cp_comm_type == "a2a" else w.inner
    outer = world // inner
    kv_heads = math.lcm(w.kv_heads, inner)  # repeated so the all-to-all can split them
    moved = w.batch * n * w.heads * (w.head_dim + w.v_head_dim) * w.dtype_bytes + shard(n, kv_heads)
    a2a_bytes = (inner - 1) / inner * moved * passes  # q, k, v in and out back; backward dout in, dq, dk, dv back
    a2a = _spread(hw, inner, a2a_bytes) + 2 * (inner - 1) * passes * hw.latency_s
    swapped = shard(n * inner, kv_heads // inner)
    if outer == 1:  # the whole sequence in order, attended as one rank would
        compute = work / world + _calls(w, w.seq_len, 1) * passes * hw.kernel_call_s
        return Estimate(compute, a2a, a2a, compute + a2a, a2a_bytes, own + swapped)
    # virtual rank a of process p meets a' of process p - s at ring step (s*A + a - a') mod N
    outer_steps = min(outer, 1 + math.ceil((steps - 1) / inner))
    compute = work * _busiest_share(w, outer) / inner + inner * _calls(w, n, steps) * passes * hw.kernel_call_s
    ring_bytes = (outer_steps - 1) * (swapped * passes + (shard(n * inner, kv_heads // inner, acc) if bwd else 0.0))
    ring = ring_bytes / _link(hw, world) + (outer_steps - 1) * (3 if bwd else 1) * hw.latency_s
    exposed = a2a + max(0.0, ring - compute * (outer_steps - 1) / outer_steps)
    peak = own + swapped * (3 if outer_steps > 1 else 1)
    return Estimate(compute, a2a + ring, exposed, compute + exposed, a2a_bytes + ring_bytes, peak)


def choose(w: Workload, hw: Hardware, needs_only: bool = True) -> str:
    """The feasible strategy with the least modelled time (ties: the order of ``STRATEGIES``);
    ``needs_only`` as for :func:`estimate`."""
    best = min((estimate(w, s, hw, needs_only).total_s, i, s) for i, s in enumerate(STRATEGIES)
               if infeasible(w, s) is None)
    return best[2]
