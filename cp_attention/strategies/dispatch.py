"""Running one attention call with a strategy other than the ring: all-gather, Ulysses all-to-all, or
all-to-all inside a ring (``cp_comm_type`` ``"all_gather"``, ``"a2a"``, ``"a2a+p2p"``).

The layout contract is the ring's: q, k, v are this rank's shard, the result is too. The strategies
differ only in where K/V (and, for all-to-all, the heads) travel; each runs the layout's exact tasks
(see :mod:`.composite`).
"""

from __future__ import annotations

import math

import torch

from ..engine import doc_batch
from ..engine.function import AttentionFunction
from ..engine.plan import AttentionPlan
from ..engine.tasks import KernelSettings
from ..kernels.base import AttentionKernel
from ..layouts.registry import get_layout
from ..transport.base import Seat as _Seat
from ..transport.base import Transport
from .alltoall import heads_to_seq, seq_to_heads
from .composite import CompositeSource, pair_steps
from .plan_cache import plan_cache

__all__ = ["a2a_degree", "strategy_problem", "run_strategy"]

_CONTIGUOUS = get_layout("contiguous")


def a2a_degree(transport: Transport, cp_comm_type: str) -> int:
    """How many ranks an all-to-all spans: the whole group for ``"a2a"``, the inner dim for
    ``"a2a+p2p"``, 1 otherwise."""
    if cp_comm_type == "a2a":
        return transport.world_size
    if cp_comm_type == "a2a+p2p":
        levels = getattr(transport, "levels", None)
        return levels[1].world_size if levels else 0
    return 1


def strategy_problem(transport: Transport, cp_comm_type: str, heads: int) -> str | None:
    """Why ``cp_comm_type`` cannot run ``heads`` query heads on this group, or None. Depends only on
    what every rank agreed on (the heads) and on the group's shape, so every rank answers alike."""
    if cp_comm_type == "a2a+p2p" and not getattr(transport, "levels", None):
        return ("cp_comm_type='a2a+p2p' needs a two-level group: pass a 2-D DeviceMesh as group (dim 0 the ring, "
                "dim 1 the all-to-all, e.g. init_device_mesh('cuda', (nodes, gpus_per_node))) and shard the inputs "
                "with the flattened mesh rank; or use cp_comm_type='a2a' or 'p2p'")
    degree = a2a_degree(transport, cp_comm_type)
    if degree > 1 and heads % degree:
        where = "the group" if cp_comm_type == "a2a" else "the mesh's inner dim"
        return (f"cp_comm_type={cp_comm_type!r} splits the query heads over the {degree} ranks of {where}, so it "
                f"needs heads divisible by {degree}, got {heads}; use cp_comm_type='p2p' or 'all_gather', or an "
                f"all-to-all degree that divides {heads} ('a2a+p2p' with a smaller inner dim)")
    return None


def _seat_plan(plan: AttentionPlan, rank: int, alone: bool = False) -> AttentionPlan:
    """The batch's plan as rank ``rank`` of the group sees it (a virtual rank's seat), or (``alone``)
    as one rank holding the whole sequence in order would; cached with the plan's other strategy entries
    (:func:`.plan_cache.plan_cache`)."""
    seats = plan_cache(plan).seats
    key = "alone" if alone else rank
    found = seats.get(key)
    if found is None:
        layout, seat = (_CONTIGUOUS, _Seat(0, 1)) if alone else (plan.layout, _Seat(rank, plan.world_size))
        found = seats[key] = AttentionPlan(layout, seat, plan.causal, plan.cu_seqlens, plan.window_size, agreed=True)
    return found


def _sequence_order(plan: AttentionPlan, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, inverse)`` on ``device``: the rows of every rank's shard in rank order are the sequence's
    positions ``order``; ``index_select(1, inverse)`` puts them in sequence order (cached with the plan's
    other strategy entries)."""
    cache = plan_cache(plan).orders
    found = cache.get((n, device))
    if found is None:
        total = n * plan.world_size
        order = torch.cat([plan.layout.positions(total, r, plan.world_size, plan.cu_seqlens)
                           for r in range(plan.world_size)])
        # uploaded once per batch, from pinned memory without blocking (as the plan's index tensors)
        found = cache[(n, device)] = (doc_batch.upload(order, device), doc_batch.upload(torch.argsort(order), device))
    return found


def _repeat_kv(t: torch.Tensor, degree: int) -> torch.Tensor:
    """K/V heads repeated so ``degree`` divides them (each query head keeps its own K/V head)."""
    heads = t.shape[2]
    if heads % degree == 0:
        return t
    return t.repeat_interleave(math.lcm(heads, degree) // heads, dim=2)


def run_strategy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan, cp_comm_type: str,
                 kern: AttentionKernel, scale: float, softcap: float, sinks: torch.Tensor | None,
                 return_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(out [B, n, H, Dv], lse [B, H, n])`` of a validated call with ``cp_comm_type`` in
    ``("all_gather", "a2a", "a2a+p2p")``; :func:`strategy_problem` must have passed. Without
    ``return_lse`` an all-to-all strategy does not send the LSE back (``lse`` is None)."""
    transport = plan.transport
    n, device = q.shape[1], q.device
    settings = KernelSettings.of(kern, scale, softcap, packed=plan.packed)
    if cp_comm_type == "all_gather":
        steps = plan.steps(n, kern, device, q.shape[-1], v.shape[-1])
        source = CompositeSource(settings, transport, transport, (steps,),
                                 pair_steps((len(steps),), plan.world_size, 1), 1, gather=True,
                                 needs_index=plan.needs_index(n, device, len(steps)))
        return AttentionFunction.apply(q, k, v, source, sinks)
    # levels: not in the Transport protocol, only on two-level transports (validated for a2a+p2p)
    outer, inner = transport.levels if cp_comm_type == "a2a+p2p" else (None, transport)  # type: ignore[attr-defined]
    degree = inner.world_size
    heads = q.shape[2] // degree
    qh, kh, vh = seq_to_heads(inner, q, _repeat_kv(k, degree), _repeat_kv(v, degree))
    sinks_h = None if sinks is None else sinks[inner.rank * heads:(inner.rank + 1) * heads]
    if outer is None:  # the whole sequence is here: put it in order and attend it as one rank would
        order, inverse = _sequence_order(plan, n, device)
        qh, kh, vh = (t.index_select(1, inverse) for t in (qh, kh, vh))
        whole = _seat_plan(plan, 0, alone=True)
        steps = whole.steps(n * degree, kern, device, q.shape[-1], v.shape[-1])
        source = CompositeSource(KernelSettings.of(kern, scale, softcap, packed=whole.packed), inner, transport,
                                 (steps,), pair_steps((len(steps),), 1, 1), 1, gather=False)
        out_h, lse_h = AttentionFunction.apply(qh, kh, vh, source, sinks_h)
        out_h, lse_h = out_h.index_select(1, order), lse_h.index_select(2, order)
    else:
        p = outer.rank
        virtual = tuple(_seat_plan(plan, p * degree + a).steps(n, kern, device, q.shape[-1], v.shape[-1])
                        for a in range(degree))
        pairs = pair_steps(tuple(len(s) for s in virtual), plan.world_size, degree)
        source = CompositeSource(settings, outer, transport, virtual, pairs, degree, gather=False)
        out_h, lse_h = AttentionFunction.apply(qh, kh, vh, source, sinks_h)
    if not return_lse:
        return heads_to_seq(inner, out_h)[0], None
    out, lse = heads_to_seq(inner, out_h, lse_h.transpose(1, 2).unsqueeze(-1))
    return out, lse.squeeze(-1).transpose(1, 2)
