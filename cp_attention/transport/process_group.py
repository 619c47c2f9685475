"""Ring exchange over a process group: send to rank r+1, receive from rank r-1 (batched P2P).

Works the same on gloo (CPU) and NCCL, and on a :class:`~cp_attention.loopback.LoopbackRank` (all
ranks in one process). With no initialised process group the ring has one member and no exchange
ever happens.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from .loopback import LoopbackRank

__all__ = ["RingComm", "group_rank_and_size"]


def group_rank_and_size(group=None) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size; (0, 1) without torch.distributed.

    Raises ``ValueError`` if this process is not a member of ``group``.
    """
    if isinstance(group, LoopbackRank):
        return group.rank, group.world_size
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of the given group; "
            "call ring_attention only on the ranks of the group"
        )
    return rank, dist.get_world_size(group)


class _Pending:
    def __init__(self, works: list) -> None:
        self._works = works

    def wait(self) -> None:
        for w in self._works:
            w.wait()


class RingComm:
    """One ring over ``group``: posts non-blocking sends to the next rank and receives from the previous."""

    def __init__(self, group=None) -> None:
        self.group = group
        self.rank, self.world_size = group_rank_and_size(group)
        self.loopback = isinstance(group, LoopbackRank)
        # Whether a status can be read on the host without a device sync (gloo and loopback): the
        # fault agreement and the signature fingerprints run only there.
        self.host_agreement = self.world_size > 1 and (self.loopback or dist.get_backend(group) == "gloo")
        if self.world_size > 1 and not self.loopback:
            self._pg = group if group is not None else dist.group.WORLD
            self.next_rank = self.peer(1)
            self.prev_rank = self.peer(-1)

    def peer(self, offset: int) -> int:
        """The global rank ``offset`` places on along the ring (P2P ops address peers globally)."""
        if self.loopback:
            return (self.rank + offset) % self.world_size
        return dist.get_global_rank(self._pg, (self.rank + offset) % self.world_size)

    def exchange(self, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor], hop: int = 1) -> _Pending:
        """Start sending ``send`` to the rank ``hop`` places on (the next one by default) and
        receiving into ``recv`` from the rank ``hop`` places back.

        All tensors must be contiguous; ``send`` must not be written and ``recv`` not read until
        ``wait()`` on the returned handle. Every rank must post the same sequence of exchanges.
        """
        if self.loopback:
            return self.group.exchange(send, recv, self.peer(hop), self.peer(-hop))
        to, frm = (self.next_rank, self.prev_rank) if hop == 1 else (self.peer(hop), self.peer(-hop))
        ops = [dist.P2POp(dist.isend, t, to, self.group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, frm, self.group) for t in recv]
        return _Pending(dist.batch_isend_irecv(ops))
