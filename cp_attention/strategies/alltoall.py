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


def all_to_all(transport: Transport, chunks: Sequence[Sequence[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """Send ``chunks[d]`` (a list of tensors) to rank ``d`` of ``transport``; return what every rank sent this
    one, in rank order. One exchange per peer carries all the tensors. Every rank's chunks for rank
    ``d`` have the shapes and dtypes of every other rank's chunks for it."""
    a, r = transport.world_size, transport.rank
    got: list[list[torch.Tensor]] = [[] for _ in range(a)]
    got[r] = list(chunks[r])
    pending = []
    for hop in range(1, a):
        src = (r - hop) % a
        # Every rank's chunks for rank r have the shapes of this rank's chunks for itself.
        got[src] = [torch.empty_like(t) for t in chunks[r]]
        pending.append(transport.exchange([t.contiguous() for t in chunks[(r + hop) % a]], got[src], hop))
    for p in pending:
        p.wait()
    return got


def _split_heads(xs: Sequence[torch.Tensor], transport: Transport) -> tuple[torch.Tensor, ...]:
    a = transport.world_size
    parts = all_to_all(transport, [[x[:, :, d * (x.shape[2] // a):(d + 1) * (x.shape[2] // a)].contiguous() for x in xs]
                              for d in range(a)])
    return tuple(torch.cat([p[i] for p in parts], dim=1) for i in range(len(xs)))


def _split_seq(xs: Sequence[torch.Tensor], transport: Transport) -> tuple[torch.Tensor, ...]:
    a = transport.world_size
    parts = all_to_all(transport, [[x[:, d * (x.shape[1] // a):(d + 1) * (x.shape[1] // a)].contiguous() for x in xs]
                              for d in range(a)])
    return tuple(torch.cat([p[i] for p in parts], dim=2) for i in range(len(xs)))


class _Swap(torch.autograd.Function):
    """One of the two swaps forward, the other backward. Gradients are materialised (autograd's
    default): an unused output sends zeros, so every rank posts the same exchanges."""

    @staticmethod
    def forward(ctx, transport: Transport, to_heads: bool, *xs: torch.Tensor):
        ctx.transport, ctx.to_heads = transport, to_heads
        return (_split_heads if to_heads else _split_seq)(xs, transport)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        back = _split_seq if ctx.to_heads else _split_heads
        return (None, None, *back([g.contiguous() for g in grads], ctx.transport))


def seq_to_heads(transport: Transport, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each ``[B, n, H, D]`` sequence shard -> ``[B, A*n, H/A, D]``: every rank's n tokens (in rank order)
    for this rank's H/A heads (heads ``[r*H/A, (r+1)*H/A)``); A = ``transport.world_size`` must divide each
    H. All tensors travel in one exchange per peer. Differentiable (the backward is
    :func:`heads_to_seq`)."""
    return tuple(xs) if transport.world_size == 1 else _Swap.apply(transport, True, *xs)


def heads_to_seq(transport: Transport, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The inverse of :func:`seq_to_heads`: each ``[B, A*n, h, D]`` -> ``[B, n, A*h, D]``. Differentiable."""
    return tuple(xs) if transport.world_size == 1 else _Swap.apply(transport, False, *xs)
