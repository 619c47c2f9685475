"""The transport seam: what the engine, the checks and the adapters need from a group of ranks.

A :class:`Transport` is one rank's handle on its group. Three implement it: the process-group ring
(:class:`~cp_attention.transport.process_group.ProcessGroupTransport`, gloo or NCCL), the in-process
loopback (:class:`~cp_attention.transport.loopback.LoopbackRank`, every rank a thread) and the GPU
benchmark's replay of one rank. Nothing above this package asks which one it holds.
"""

from __future__ import annotations

import operator
from typing import Any, Protocol, Sequence, runtime_checkable

import torch

__all__ = ["Pending", "Seat", "Transport", "payload_bytes"]


class Pending(Protocol):
    """A posted exchange: ``wait()`` returns once the receive buffers are filled and the sends done."""

    def wait(self) -> None: ...


@runtime_checkable
class Transport(Protocol):
    """One rank's view of its group.

    ``host_agreement`` is True where a status tensor can be read on the host without a device sync
    (gloo, loopback): fault containment and signature fingerprints run only there. ``token`` stands
    for the group in cache keys without keeping it alive (see :func:`~cp_attention.checks.agreement.group_token`).
    A transport of a two-level group (a 2-D ``DeviceMesh``, ``cp_comm_type="a2a+p2p"``) also has
    ``levels = (outer, inner)``: transports of its two dims that need only :meth:`exchange`; others
    have no ``levels`` or ``None``. Every transport counts in ``sent_bytes`` (an int that only grows)
    the bytes this rank put on the wire for others: each exchange's send tensors, and a collective's
    tensor once per other rank (read it before and after a step for that step's traffic).
    """

    rank: int
    world_size: int
    host_agreement: bool

    @property
    def token(self) -> Any: ...

    def exchange(self, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor], hop: int = 1) -> Pending:
        """Start sending ``send`` to the rank ``hop`` places on and receiving into ``recv`` from the rank
        ``hop`` places back. Tensors contiguous; every rank posts the same sequence of exchanges."""
        ...

    def all_gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's ``values`` (int64, the same count on every rank), in rank order. Blocking."""
        ...

    def all_gather_tensor(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape, dtype and device type everywhere), in rank order. Blocking."""
        ...

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the group in place and return it."""
        ...


class Seat:
    """A rank's place in a group of ``world_size``, with no communication: what a plan built for a rank
    ahead of time, or a strategy's virtual rank, needs (it sends nothing, so it counts nothing).

    Raises ``ValueError`` for a world size below 1 or a rank outside ``[0, world_size)``."""

    host_agreement = False
    token = None
    sent_bytes = 0

    def __init__(self, rank: int, world_size: int) -> None:
        given = f"rank={rank!r}, world_size={world_size!r}"
        try:
            ok = not isinstance(rank, bool) and not isinstance(world_size, bool)
            rank, world_size = operator.index(rank), operator.index(world_size)  # numpy and 0-d tensors too
        except TypeError:
            ok = False
        if not ok or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"a seat needs ints 0 <= rank < world_size, got {given}")
        self.rank, self.world_size = rank, world_size

    def __repr__(self) -> str:
        return f"Seat(rank={self.rank}, world_size={self.world_size})"


def payload_bytes(tensors: Sequence[torch.Tensor], copies: int = 1) -> int:
    """Bytes of ``tensors``, ``copies`` times: what a transport adds to ``sent_bytes`` for them."""
    return copies * sum(t.numel() * t.element_size() for t in tensors)
