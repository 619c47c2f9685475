"""Ulysses' all-to-all over a transport: sequence shards become head shards and back, differentiably.

Built on the transport's one primitive, the P2P ``exchange``: an all-to-all of A ranks is A - 1
exchanges posted together (hop h sends the chunk for rank r + h and receives rank r - h's), so it runs
on every transport (gloo, NCCL, the in-process loopback) alike.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..transport.base import Transport

__all__ = ["all_to_all", "seq_to_heads", "heads_to_seq"]


def all_to_all(comm: Transport, chunks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Send ``chunks[d]`` to rank ``d`` of ``comm``; return what every rank sent this one, in rank
    order. Every rank's chunk ``d`` must have the shape and dtype of every other rank's chunk for it."""
    a, r = comm.world_size, comm.rank
    got: list["torch.Tensor | None"] = [None] * a
    got[r] = chunks[r]
    pending = []
    for hop in range(1, a):
        src = (r - hop) % a
        # Every rank's chunk for rank r has the shape this rank's chunk for itself has.
        got[src] = torch.empty_like(chunks[r])
        pending.append(comm.exchange([chunks[(r + hop) % a].contiguous()], [got[src]], hop))
    for p in pending:
        p.wait()
    return got


def _split_heads(x: torch.Tensor, comm: Transport) -> torch.Tensor:
    heads = x.shape[2] // comm.world_size
    parts = all_to_all(comm, [x[:, :, d * heads:(d + 1) * heads].contiguous() for d in range(comm.world_size)])
    return torch.cat(parts, dim=1)


def _split_seq(x: torch.Tensor, comm: Transport) -> torch.Tensor:
    n = x.shape[1] // comm.world_size
    parts = all_to_all(comm, [x[:, d * n:(d + 1) * n].contiguous() for d in range(comm.world_size)])
    return torch.cat(parts, dim=2)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Transport) -> torch.Tensor:
        ctx.comm = comm
        return _split_heads(x, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _split_seq(grad, ctx.comm), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Transport) -> torch.Tensor:
        ctx.comm = comm
        return _split_seq(x, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _split_heads(grad, ctx.comm), None


def seq_to_heads(x: torch.Tensor, comm: Transport) -> torch.Tensor:
    """``[B, n, H, D]`` sequence shard -> ``[B, A*n, H/A, D]``: every rank's n tokens (in rank order) for
    this rank's H/A heads (heads ``[r*H/A, (r+1)*H/A)``); A = ``comm.world_size`` must divide H.
    Differentiable (the backward is :func:`heads_to_seq`)."""
    return x if comm.world_size == 1 else _SeqToHeads.apply(x, comm)


def heads_to_seq(x: torch.Tensor, comm: Transport) -> torch.Tensor:
    """The inverse of :func:`seq_to_heads`: ``[B, A*n, h, D]`` -> ``[B, n, A*h, D]``. Differentiable."""
    return x if comm.world_size == 1 else _HeadsToSeq.apply(x, comm)
