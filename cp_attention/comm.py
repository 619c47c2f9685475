"""Ring exchange over a process group: send to rank r+1, receive from rank r-1 (batched P2P).

Works the same on gloo (CPU) and NCCL. With no initialised process group the ring has one member
and no exchange ever happens.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["RingComm", "group_rank_and_size"]


def group_rank_and_size(group=None) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size; (0, 1) without torch.distributed.

    Raises ``ValueError`` if this process is not a member of ``group``.
    """
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
        if self.world_size > 1:
            # P2P ops address peers by global rank.
            pg = group if group is not None else dist.group.WORLD
            self.next_rank = dist.get_global_rank(pg, (self.rank + 1) % self.world_size)
            self.prev_rank = dist.get_global_rank(pg, (self.rank - 1) % self.world_size)

    def exchange(self, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor]) -> _Pending:
        """Start sending ``send`` to the next rank and receiving into ``recv`` from the previous one.

        All tensors must be contiguous; ``send`` must not be written and ``recv`` not read until
        ``wait()`` on the returned handle. Every rank must post the same sequence of exchanges.
        """
        ops = [dist.P2POp(dist.isend, t, self.next_rank, self.group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, self.prev_rank, self.group) for t in recv]
        return _Pending(dist.batch_isend_irecv(ops))
