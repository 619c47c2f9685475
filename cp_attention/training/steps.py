"""What every training loop here shares: the CP/DP gradient convention and one optimizer step.

Each CP rank computes its share of a loss that is the mean over ALL the replica's tokens
(:func:`cp_attention.integrations.huggingface.causal_lm_loss` does this), so the gradients summed
over the CP group are exactly the gradients without CP; data-parallel replicas are then averaged.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..transport import group_rank_and_size
from .device import all_reduce_

__all__ = ["reduce_gradients", "train_step", "progress_line"]


def _group_size(group) -> int:
    return group_rank_and_size(group)[1]


def reduce_gradients(model: torch.nn.Module | Iterable[torch.nn.Parameter], cp_group=None, dp_group=None) -> None:
    """Sum the gradients over ``cp_group`` and average them over ``dp_group``, in place.

    ``cp_group=None`` is the default group, as in ``ring_attention``; ``dp_group=None`` means no data
    parallelism. Gradients travel as one flattened bucket per dtype and device, so each group costs
    one collective per bucket, on the device the group's backend needs (CUDA for NCCL, CPU for gloo).
    Parameters without a gradient are left alone. Either group may be a transport (the loopback's ranks).
    """
    params = model.parameters() if isinstance(model, torch.nn.Module) else model
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None and _is_dtensor(p.grad):
            raise ValueError("reduce_gradients got sharded (DTensor) gradients: a model sharded by FSDP "
                             "(cphf.parallelize) already has its gradients summed over dp x cp after backward; "
                             "do not call reduce_gradients on it")
        if p.grad is not None:
            buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    cp_size, dp_size = _group_size(cp_group), (_group_size(dp_group) if dp_group is not None else 1)
    if cp_size == dp_size == 1:
        return
    for grads in buckets.values():
        flat = _flatten_dense_tensors(grads)
        if cp_size > 1:
            all_reduce_(flat, group=cp_group)
        if dp_size > 1:
            all_reduce_(flat, group=dp_group)
            flat.div_(dp_size)
        for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Sequence[Any],
               loss_fn: Callable[[Any], tuple[torch.Tensor, torch.Tensor]], *, cp_group=None, dp_group=None,
               scheduler: Any | None = None, grad_clip: float | None = None,
               sharded: bool = False) -> torch.Tensor:
    """One optimizer step over ``micro_batches`` (gradient accumulation); returns the mean loss value.

    ``loss_fn(batch)`` returns ``(objective, value)``: this rank's share of the batch's global mean
    loss, to back-propagate, and the value to report (detached). Gradients are reduced with
    :func:`reduce_gradients` (not with ``sharded``: FSDP reduced them in backward), clipped to
    ``grad_clip`` if given, then the optimizer and ``scheduler``
    step and the gradients are cleared. The result is an fp64 tensor, so nothing here syncs the host.
    """
    total = torch.zeros((), dtype=torch.float64)
    for batch in micro_batches:
        objective, value = loss_fn(batch)
        (objective / len(micro_batches)).backward()
        total = total.to(value.device) + value.detach().double() / len(micro_batches)
    if not sharded:
        reduce_gradients(model, cp_group, dp_group)
    if grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def progress_line(step: int, loss: float, tokens_per_s: float) -> str:
    """The examples' log line: ``step    3  loss 5.1234  12,345 tokens/s``."""
    return f"step {step:4d}  loss {loss:.4f}  {tokens_per_s:,.0f} tokens/s"
