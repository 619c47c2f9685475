"""``cp_comm_type="auto"``: the cost model's pick for a call, made once per plan and call shape."""

from __future__ import annotations

import torch

from ..engine.plan import AttentionPlan
from .cost import Workload, choose, current_hardware

__all__ = ["auto_comm_type"]


def auto_comm_type(plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """The strategy the cost model (:mod:`.cost`) predicts fastest for this validated call on this group
    with the process's hardware profile (:func:`.cost.set_hardware`). Every rank picks alike: the
    inputs are what the group agreed on (shapes, dtype, plan) and the group's shape."""
    b, n, heads, head_dim = q.shape
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    levels = getattr(plan.transport, "levels", None)
    hardware = current_hardware(q.device.type)
    key = (tuple(q.shape), k.shape[2], v.shape[-1], q.dtype, q.device.type, needs_grad, hardware)
    picks = plan.__dict__.setdefault("_auto", {})
    found = picks.get(key)
    if found is None:
        work = Workload(world_size=plan.world_size, batch=b, seq_len=n * plan.world_size, heads=heads,
                        kv_heads=k.shape[2], head_dim=head_dim, v_head_dim=v.shape[-1],
                        dtype_bytes=q.element_size(), causal=bool(plan.causal), window=tuple(plan.window_size),
                        cu_seqlens=plan.cu_seqlens, layout=plan.layout.name,
                        inner=levels[1].world_size if levels else 1, backward=needs_grad)
        found = picks[key] = choose(work, hardware)
    return found
