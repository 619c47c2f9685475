"""``cp_comm_type="auto"``: the cost model's pick for a call, made once per plan and call shape and
agreed across the group (group rank 0's pick counts), so ranks whose hardware profiles differ
(``set_hardware``, ``LOCAL_WORLD_SIZE`` by node) still run the same collectives."""

from __future__ import annotations

import torch

from ..checks.codec import Codec, Field, agree_rows
from ..engine.plan import AttentionPlan
from .cost import Workload, choose, current_hardware
from .names import CP_COMM_TYPES
from .plan_cache import plan_cache

__all__ = ["auto_comm_type"]

_PICK = Codec(Field("pick", label="cp_comm_type='auto' pick"))  # an index into CP_COMM_TYPES


def auto_comm_type(plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """The strategy the cost model (:mod:`.cost`) predicts fastest for this validated call on this group,
    as group rank 0 predicts it with its hardware profile (:func:`.cost.set_hardware`).

    Each rank predicts with its own profile, then the group takes rank 0's pick in one all-gather of
    one int, made once per plan and call shape: the key holds only what the group agreed on (shapes,
    dtype, plan), so every rank reaches it at the same call. A profile set after a plan's first pick
    applies to later plans (a plan is usually one batch's).
    """
    b, n, heads, head_dim = q.shape
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    key = (tuple(q.shape), k.shape[2], v.shape[-1], q.dtype, q.device.type, needs_grad)
    picks = plan_cache(plan).auto_picks
    found = picks.get(key)
    if found is None:
        levels = getattr(plan.transport, "levels", None)
        work = Workload(world_size=plan.world_size, batch=b, seq_len=n * plan.world_size, heads=heads,
                        kv_heads=k.shape[2], head_dim=head_dim, v_head_dim=v.shape[-1],
                        dtype_bytes=q.element_size(), causal=bool(plan.causal), window=tuple(plan.window_size),
                        cu_seqlens=plan.cu_seqlens, layout=plan.layout.name,
                        inner=levels[1].world_size if levels else 1, backward=needs_grad)
        # the plan's traffic: only the needed rows (the default), or whole shards
        mine = CP_COMM_TYPES.index(choose(work, current_hardware(q.device.type), getattr(plan, "needs_only", True)))
        found = picks[key] = CP_COMM_TYPES[agree_rows(plan.transport, _PICK, {"pick": mine})[0]["pick"]]
    return found
