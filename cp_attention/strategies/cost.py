"""The cost model behind ``cp_comm_type="auto"``: time, bytes and K/V memory per rank of each strategy.

Deliberately small and closed-form (it runs once per plan and call shape, in well under a millisecond):

- compute: attention's matmul FLOPs, ``4 * pairs * head_dim`` per head forward (QK^T and PV) and 2.5x
  that backward, at ``Hardware.flops``, plus ``Hardware.kernel_call_s`` per kernel call. The ring and
  all-gather are bound by the busiest rank (the layout's causal imbalance: the exact work model
  without documents or a window, else a closed-form bound); all-to-all splits heads, so it is balanced.
- communication: the bytes each strategy's execution sends (see :mod:`.composite`, :mod:`.alltoall`):
  the ring overlaps its hops with its steps' compute; all-gather and all-to-all do not. A group inside
  one node (``ranks_per_node``) moves them at ``intra_bw``; across nodes the ring is bound by
  ``inter_bw`` and an all-to-all or all-gather sends its off-node fraction there. ``"a2a+p2p"`` keeps
  its all-to-all inside the mesh's inner dim (a node) and rings across the outer.
- memory: the K/V bytes one rank holds at once (the ring: its shard and two in flight; all-gather: every
  shard of the ring's length).

The model ranks strategies; its absolute times are estimates. ``scripts/benchmark_strategies.py``
measures how often its pick is within 10% of the best measured one.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from typing import Optional, Union

from ..layouts.registry import get_layout
from ..schedules.causal import get_schedule
from ..schedules.work import work_model
from .names import STRATEGIES

__all__ = ["Hardware", "HARDWARE", "Workload", "Estimate", "default_hardware", "set_hardware", "current_hardware",
           "infeasible", "estimate", "choose", "pairs"]


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
    # gloo over loopback TCP on a few CPU cores (scripts/benchmark_strategies.py calibrates its own)
    "cpu_gloo": Hardware("cpu_gloo", 20e9, 1.5e9, 1.5e9, 1 << 20, 150e-6, 40e-6),
}
_CHOSEN: dict[str, Optional[Hardware]] = {"hardware": None}


def default_hardware(device_type: str) -> Hardware:
    """The preset for ``device_type``: ``"cuda"`` is the H100's, with ``LOCAL_WORLD_SIZE`` (torchrun's
    ranks per node; 8 without it) as ranks per node; anything else the CPU/gloo preset."""
    if device_type == "cuda":
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "8") or 8)
        base = HARDWARE["h100"]
        return Hardware(base.name, base.flops, base.intra_bw, base.inter_bw, per_node, base.latency_s,
                        base.kernel_call_s)
    return HARDWARE["cpu_gloo"]


def set_hardware(hardware: "Union[Hardware, str, None]") -> None:
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
    cu_seqlens: Optional[tuple] = None
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


def _tri(m: int) -> int:
    return m * (m + 1) // 2 if m > 0 else 0


def pairs(length: int, causal: bool, window: tuple = (-1, -1)) -> int:
    """(query, key) pairs one sequence of ``length`` tokens attends under flash-attn's ``window``."""
    left, right = window
    right = 0 if causal else right
    cut = (_tri(length - 1 - left) if left >= 0 else 0) + (_tri(length - 1 - right) if right >= 0 else 0)
    return length * length - cut


def _lengths(w: Workload) -> list[int]:
    cu = w.cu_seqlens or (0, w.seq_len)
    return [b - a for a, b in zip(cu, cu[1:])]


def _busiest_share(w: Workload, world: int) -> float:
    """The busiest rank's share of all pairs under the layout, at ``world`` ranks (1/world: balanced)."""
    if not w.causal or world == 1:
        return 1.0 / world
    unbounded = w.window[0] < 0 and w.cu_seqlens is None
    layout = get_layout(w.layout)
    if unbounded and get_schedule(layout) is not None and w.seq_len % layout.divisor(world) == 0 and world <= 512:
        return _causal_share(layout.name, world)
    if layout.name != "contiguous":
        return 1.0 / world
    # contiguous: a query sees up to `reach` tokens back, so ranks differ by at most that share
    reach = min(w.window[0] if w.window[0] >= 0 else w.seq_len, max(_lengths(w)))
    return (1.0 + (world - 1) * min(1.0, reach / w.seq_len)) / world


@functools.lru_cache(maxsize=64)
def _causal_share(layout: str, world: int) -> float:
    """The busiest rank's share of a causal sequence's pairs (exact, from the work model; the shares
    hardly depend on S, so a short sequence the layout can split stands for every S)."""
    lay = get_layout(layout)
    work = work_model(lay, True, 8 * lay.divisor(world), world)
    return max(map(sum, work)) / sum(map(sum, work))


def _ring_length(w: Workload, world: int, shard: float) -> int:
    """Steps of a ring of ``world`` ranks over shards of ``shard`` tokens (a window ends it early)."""
    if w.window[0] < 0 or not w.causal or get_layout(w.layout).name != "contiguous":
        return world  # zigzag and interleaved spread every rank's tokens over the whole sequence
    return min(world, 1 + math.ceil(w.window[0] / shard) + 1)


def _link(hw: Hardware, span: int) -> float:
    return hw.intra_bw if span <= hw.ranks_per_node else hw.inter_bw


def _spread(hw: Hardware, world: int, nbytes: float) -> float:
    """Seconds to send ``nbytes`` spread evenly over ``world - 1`` peers (all-to-all, all-gather)."""
    if world <= hw.ranks_per_node:
        return nbytes / hw.intra_bw
    off = (world - hw.ranks_per_node) / (world - 1)
    return max(nbytes * (1 - off) / hw.intra_bw, nbytes * off / hw.inter_bw)


def infeasible(w: Workload, cp_comm_type: str) -> Optional[str]:
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


def estimate(w: Workload, cp_comm_type: str, hw: Hardware) -> Estimate:
    """The modelled cost of running ``w`` with ``cp_comm_type`` on ``hw``. Raises ``ValueError`` if
    :func:`infeasible`."""
    problem = infeasible(w, cp_comm_type)
    if problem is not None:
        raise ValueError(problem)
    n, world = w.seq_len / w.world_size, w.world_size
    passes = 3.5 if w.backward else 1.0  # backward ~2.5x forward
    total_pairs = sum(pairs(length, w.causal, w.window) for length in _lengths(w)) * w.batch
    flop = 2.0 * (w.head_dim + w.v_head_dim) * w.heads * passes
    acc = 8 if w.dtype_bytes == 8 else 4
    shard = lambda tokens, kv_heads, size=w.dtype_bytes: w.batch * tokens * kv_heads * (w.head_dim + w.v_head_dim) * size  # noqa: E731
    if cp_comm_type in ("p2p", "all_gather"):
        steps = _ring_length(w, world, n)
        compute = total_pairs * _busiest_share(w, world) * flop / hw.flops + 2 * steps * passes * hw.kernel_call_s
        kv, dkv = shard(n, w.kv_heads), shard(n, w.kv_heads, acc)
        fwd_bytes = (steps - 1) * kv
        bwd_bytes = (max(steps - 2, 0) * kv + (steps - 1) * dkv) if w.backward else 0.0
        sent = fwd_bytes + bwd_bytes
        hops = (steps - 1) * (3 if w.backward else 1)
        if cp_comm_type == "p2p":
            comm = sent / _link(hw, world) + hops * hw.latency_s
            exposed = max(0.0, comm - compute * (steps - 1) / steps)
            peak = 3 * kv
        else:
            gathered = fwd_bytes * (2 if w.backward else 1) + (steps - 1) * dkv * w.backward
            comm = _spread(hw, world, gathered) + hops * hw.latency_s
            exposed, sent, peak = comm, gathered, steps * kv
        return Estimate(compute, comm, exposed, compute + exposed, sent, peak)
    inner = world if cp_comm_type == "a2a" else w.inner
    outer = world // inner
    kv_heads = math.lcm(w.kv_heads, inner) if w.kv_heads % inner else w.kv_heads
    local_q = w.batch * n * w.heads * w.head_dim * w.dtype_bytes
    local_o = w.batch * n * w.heads * w.v_head_dim * w.dtype_bytes
    moved = local_q + shard(n, kv_heads) + local_o
    a2a_bytes = (inner - 1) / inner * moved * (2 if w.backward else 1)
    a2a = _spread(hw, inner, a2a_bytes) + 2 * (inner - 1) * (2 if w.backward else 1) * hw.latency_s
    calls = 2 * passes if outer == 1 else 1.5 * inner * inner * _ring_length(w, outer, n * inner) * passes
    share = 1.0 / world if outer == 1 else _busiest_share(w, outer) / inner
    compute = total_pairs * share * flop / hw.flops + calls * hw.kernel_call_s
    if outer == 1:
        return Estimate(compute, a2a, a2a, compute + a2a, a2a_bytes, shard(n * inner, kv_heads // inner))
    steps = _ring_length(w, outer, n * inner)
    kv = shard(n * inner, kv_heads // inner)
    ring_bytes = (steps - 1) * kv * ((2 + acc / w.dtype_bytes) if w.backward else 1)
    ring = ring_bytes / _link(hw, world) + (steps - 1) * (3 if w.backward else 1) * hw.latency_s
    exposed = a2a + max(0.0, ring - compute * (steps - 1) / steps)
    return Estimate(compute, a2a + ring, exposed, compute + exposed, a2a_bytes + ring_bytes, 3 * kv)


def choose(w: Workload, hw: Hardware) -> str:
    """The feasible strategy with the least modelled time (ties: the order of ``STRATEGIES``)."""
    best = min((estimate(w, s, hw).total_s, i, s) for i, s in enumerate(STRATEGIES) if infeasible(w, s) is None)
    return best[2]
