"""A ring of N ranks inside one process: threads that exchange tensors through a mailbox.

One GPU cannot host two NCCL ranks, so the GPU tests and the GPU benchmark run all N ranks' schedules
in one process, on one device, with real kernels: each rank is a thread calling
``ring_attention(..., group=LoopbackGroup.rank(r))``: each rank handle is a
:class:`~cp_attention.transport.base.Transport`. The engine's ring exchanges become device copies
(every thread uses the same stream, so a copy is ordered after the kernels that produced its source),
and validation's all-gather becomes a table in memory. It runs on CPU too, which lets CI test it.

Messages between two ranks are matched in the order they were posted, as gloo and NCCL match them.
A posted send is copied at once, so no exchange ever waits for its receiver: only a receive waits, for
the matching send, which its peer posts before waiting on anything itself.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any, Callable, Sequence

import torch

from .base import payload_bytes
from .eager import eager_only

__all__ = ["LoopbackGroup", "LoopbackRank"]

_DEFAULT_TIMEOUT_S = 300.0


class _Posted:
    """What :meth:`LoopbackRank.exchange` returns: ``wait()`` fills the receive buffers."""

    def __init__(self, rank: LoopbackRank, recv: Sequence[torch.Tensor], keys: list[tuple[int, int, int]]):
        self._rank, self._recv, self._keys = rank, recv, keys

    def wait(self) -> None:
        for t, key in zip(self._recv, self._keys):
            t.copy_(self._rank.group._take(key))


class LoopbackGroup:
    """``world_size`` ranks in this process; :meth:`rank` gives each one's handle, :meth:`run` runs a
    function on all of them at once (one thread each)."""

    def __init__(self, world_size: int, timeout_s: float = _DEFAULT_TIMEOUT_S,
                 mesh_shape: tuple[int, int] | None = None) -> None:
        """``mesh_shape=(outer, inner)`` makes it a two-level CP group (as a 2-D ``DeviceMesh``): each
        rank's handle then has ``levels``, the (outer, inner) groups of row-major mesh rank r.
        Raises ``ValueError`` for a bad world size or a mesh shape that does not multiply to it."""
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"a loopback group needs world_size >= 1, got {world_size!r}")
        if mesh_shape is not None and (len(mesh_shape) != 2 or mesh_shape[0] * mesh_shape[1] != world_size
                                       or min(mesh_shape) < 1):
            raise ValueError(f"mesh_shape must be (outer, inner) with outer * inner = world_size={world_size}, "
                             f"got {mesh_shape!r}")
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._cv = threading.Condition()
        self._mail: dict[tuple[int, int, int], torch.Tensor] = {}
        self._sent: defaultdict[tuple[int, int], int] = defaultdict(int)
        self._received: defaultdict[tuple[int, int], int] = defaultdict(int)
        self._tables: dict[int, dict[int, Any]] = {}
        self._readers: defaultdict[int, int] = defaultdict(int)
        self._gathers = [0] * world_size
        self._ranks = [LoopbackRank(self, r) for r in range(world_size)]
        if mesh_shape is not None:
            outer, inner = mesh_shape
            for r, handle in enumerate(self._ranks):
                row, col = divmod(r, inner)
                handle.levels = (_LoopbackLevel(handle, [col + inner * i for i in range(outer)]),
                                 _LoopbackLevel(handle, [row * inner + i for i in range(inner)]))

    def rank(self, r: int) -> LoopbackRank:
        """The handle of rank ``r``: pass it as ``group`` to :func:`cp_attention.ring_attention`."""
        return self._ranks[r]

    def _post(self, src: int, dst: int, tensor: torch.Tensor) -> None:
        with self._cv:
            seq = self._sent[(src, dst)]
            self._sent[(src, dst)] = seq + 1
            self._mail[(src, dst, seq)] = tensor.clone()
            self._cv.notify_all()

    def _reserve(self, src: int, dst: int) -> tuple[int, int, int]:
        with self._cv:
            seq = self._received[(src, dst)]
            self._received[(src, dst)] = seq + 1
            return src, dst, seq

    def _wait_for(self, ready: Callable[[], bool], what: str) -> None:
        if not self._cv.wait_for(ready, timeout=self.timeout_s):
            raise RuntimeError(f"loopback ring: {what} did not arrive within {self.timeout_s} s; a rank stopped "
                               "early or the ranks posted different sequences of exchanges")

    def _take(self, key: tuple[int, int, int]) -> torch.Tensor:
        with self._cv:
            self._wait_for(lambda: key in self._mail, f"message {key[2]} from rank {key[0]} to rank {key[1]}")
            return self._mail.pop(key)

    def _all_gather(self, rank: int, value: Any) -> list[Any]:
        with self._cv:
            call = self._gathers[rank]
            self._gathers[rank] = call + 1
            table = self._tables.setdefault(call, {})
            table[rank] = value
            self._cv.notify_all()
            self._wait_for(lambda: len(table) == self.world_size, f"all-gather {call} from every rank")
            rows = [table[r] for r in range(self.world_size)]
            self._readers[call] += 1
            if self._readers[call] == self.world_size:  # the last reader frees the table
                del self._tables[call], self._readers[call]
            return rows

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """``fn(rank_handle, *args, **kwargs)`` on every rank at once, one thread each; their results in
        rank order. Re-raises the lowest rank's exception, if any raised. CUDA work is issued on the
        calling thread's current device.

        Each rank's autograd backward runs on the rank's own thread (the engine's multithreading is off
        in it): the engine would otherwise run every CUDA backward of a device on one worker thread, so
        one rank's ring backward could wait in a receive that another rank's backward, queued behind
        it on that thread, was to send; a deadlock until the timeout."""
        results: list[Any] = [None] * self.world_size
        errors: list[BaseException | None] = [None] * self.world_size
        device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

        def body(r: int) -> None:
            if device is not None:
                torch.cuda.set_device(device)
            try:
                with torch.autograd.set_multithreading_enabled(False):  # thread-local: this rank only
                    results[r] = fn(self._ranks[r], *args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                errors[r] = e

        threads = [threading.Thread(target=body, args=(r,), name=f"loopback-rank-{r}") for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for e in errors:
            if e is not None:
                raise e
        return results


class LoopbackRank:
    """One rank of a :class:`LoopbackGroup`, a :class:`~cp_attention.transport.base.Transport`: pass it
    as ``group`` wherever a process group is taken."""

    host_agreement = True  # statuses live on the host: fault containment and fingerprints run here too

    def __init__(self, group: LoopbackGroup, rank: int) -> None:
        self.group, self.rank, self.world_size = group, rank, group.world_size
        self.levels: tuple[_LoopbackLevel, _LoopbackLevel] | None = None
        self.sent_bytes = 0  # see Transport

    @property
    def token(self) -> LoopbackRank:
        # Per rank, not per group: the ranks share this process's caches, and each must keep its own
        # verdicts (a rank that saw another's verdict would skip an all-gather the others wait in).
        return self

    @eager_only
    def exchange(self, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor], hop: int = 1) -> _Posted:
        """Post ``send`` to the rank ``hop`` places on and receives from the rank ``hop`` places back;
        ``wait()`` on the result fills ``recv``."""
        to, frm = (self.rank + hop) % self.world_size, (self.rank - hop) % self.world_size
        self.sent_bytes += payload_bytes(send)
        for t in send:
            self.group._post(self.rank, to, t)
        return _Posted(self, recv, [self.group._reserve(frm, self.rank) for _ in recv])

    @eager_only
    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values``, in rank order (validation's signature table, the adapters' verdicts)."""
        return self.group._all_gather(self.rank, list(values))

    @eager_only
    def all_gather_tensor(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (a copy of each), in rank order."""
        self.sent_bytes += payload_bytes((tensor,), self.world_size - 1)
        return [t.clone() for t in self.group._all_gather(self.rank, tensor.detach().clone())]

    @eager_only
    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks in place (in rank order, so every rank gets the same bits)."""
        self.sent_bytes += payload_bytes((tensor,), self.world_size - 1)
        parts = self.group._all_gather(self.rank, tensor.detach().clone())
        total = parts[0].clone()
        for p in parts[1:]:
            total += p.to(total.device)
        return tensor.copy_(total)

    def __repr__(self) -> str:
        return f"LoopbackRank({self.rank} of {self.world_size})"


class _LoopbackLevel:
    """One dim of a two-level loopback group, seen from one rank: a transport over ``members`` (global
    loopback ranks, in this dim's order) that only exchanges; the group's checks run on the whole."""

    host_agreement = True

    def __init__(self, handle: LoopbackRank, members: list[int]) -> None:
        self._handle, self._members = handle, members
        self.rank, self.world_size = members.index(handle.rank), len(members)
        self.sent_bytes = 0  # see Transport

    @property
    def token(self) -> tuple:
        return (self._handle, tuple(self._members))

    @eager_only
    def exchange(self, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor], hop: int = 1) -> _Posted:
        """As :meth:`LoopbackRank.exchange`, with ``hop`` counted along this dim."""
        me, group = self._handle.rank, self._handle.group
        to = self._members[(self.rank + hop) % self.world_size]
        frm = self._members[(self.rank - hop) % self.world_size]
        self.sent_bytes += payload_bytes(send)
        for t in send:
            group._post(me, to, t)
        return _Posted(self._handle, recv, [group._reserve(frm, me) for _ in recv])

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        raise NotImplementedError("a loopback mesh dim only exchanges; agree over the whole group")

    def all_gather_tensor(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        raise NotImplementedError("a loopback mesh dim only exchanges; agree over the whole group")

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("a loopback mesh dim only exchanges; agree over the whole group")

    def __repr__(self) -> str:
        return f"_LoopbackLevel(rank {self.rank} of {self.world_size}, members {self._members})"
