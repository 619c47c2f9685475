"""The transport over a ``torch.distributed`` process group (gloo on CPU, NCCL on GPU).

The ring exchange is batched P2P (send to rank r+hop, receive from r-hop); the small blocking
all-gather of integers that the checks use runs on the device the backend needs. With no initialised
process group the group has one member and nothing is ever sent.

Every function and operation here that may touch the group is ``eager_only``: under ``torch.compile`` a
graph break, never traced (Dynamo cannot trace a process group's C++ object; see :mod:`.eager`).
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
import weakref
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from .base import payload_bytes
from .eager import eager_only
from .mesh import cp_group, mesh_levels

__all__ = ["ProcessGroupTransport", "group_rank_and_size", "group_token", "transport_for", "two_level_transport"]


@eager_only
def group_rank_and_size(group=None) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size; (0, 1) without torch.distributed.

    ``group`` may be a process group, ``None`` (the default group), a :class:`~.base.Transport` or a
    ``DeviceMesh`` (its ``"cp"`` dim: :func:`.mesh.cp_group`). Raises ``ValueError`` if this process is
    not a member of ``group``, or for a mesh without a ``"cp"`` dim.
    """
    group = cp_group(group)
    if _is_transport(group):
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


def _is_transport(group: Any) -> bool:
    # Duck-typed rather than isinstance(Transport): a Protocol check would test every member.
    return hasattr(group, "exchange") and hasattr(group, "all_gather_ints")


_RELEASE_POLL_S = 1e-4
_RELEASE_TIMEOUT_S = 10.0


@contextlib.contextmanager
def _released_by_gloo(tensors: Sequence[torch.Tensor], gloo: bool) -> Iterator[None]:
    """Run one blocking collective on ``tensors`` inside; on gloo, leave only once gloo's worker thread
    has let go of them.

    A blocking gloo collective returns as soon as its work is done, but gloo's worker thread frees the
    work (which holds the tensors) a moment later, and dropping a tensor with a Python object takes
    the GIL there. If the user's script ends right after (its last collective was this one), the
    interpreter is finalising by then: CPython ends the worker inside gloo's ``noexcept`` loop and the
    process aborts after a successful run ("terminate called without an active exception"), with or
    without ``destroy_process_group``. Waiting here, with the GIL released, until the tensors' C++
    reference counts are back where they were lets the worker finish first. Warns if it has not
    within ``_RELEASE_TIMEOUT_S``; the result is right either way.
    """
    if not gloo:
        yield
        return
    before = [t._use_count() for t in tensors]  # type: ignore[attr-defined]  # private, not in torch's stubs
    yield
    deadline = time.monotonic() + _RELEASE_TIMEOUT_S
    while any(t._use_count() > n for t, n in zip(tensors, before)):  # type: ignore[attr-defined]  # as above
        if time.monotonic() > deadline:
            warnings.warn(f"gloo's worker still holds a finished collective's tensors after {_RELEASE_TIMEOUT_S} s; "
                          "if the script ends now, the process may abort at exit", RuntimeWarning, stacklevel=3)
            return
        time.sleep(_RELEASE_POLL_S)


class _Pending:
    def __init__(self, works: list) -> None:
        self._works = works

    def wait(self) -> None:
        for w in self._works:
            w.wait()


class ProcessGroupTransport:
    """One rank's handle on a process group (``None``: the default group).

    Holds the group only weakly where it can, so a cache or an autograd graph that keeps this object
    does not keep the group alive past the user's ``destroy_process_group``.
    """

    def __init__(self, group=None) -> None:
        group = cp_group(group)
        self.rank, self.world_size = group_rank_and_size(group)
        self._group = None if group is None else weakref.ref(group)
        self.backend = dist.get_backend(group) if self.world_size > 1 else None
        self.host_agreement = self.world_size > 1 and self.backend == "gloo"
        if self.world_size > 1:
            pg = group if group is not None else dist.group.WORLD
            self.next_rank, self.prev_rank = self.peer(1), self.peer(-1)
            self._token = group_token(pg)
        else:
            self._token = None
        self.levels: tuple[ProcessGroupTransport, ProcessGroupTransport] | None = None
        self.sent_bytes = 0  # see Transport: what this rank sent, for the benchmarks' traffic figures

    @property
    def group(self):
        """The process group (``None``: the default group). Raises ``RuntimeError`` once it was destroyed."""
        if self._group is None:
            return None
        group = self._group()
        if group is None:
            raise RuntimeError("the process group of this context-parallel call was destroyed; build a new plan "
                               "(or patch the model again) with a live group")
        return group

    @property
    def token(self) -> Any:
        return self._token

    def peer(self, offset: int) -> int:
        """The global rank ``offset`` places on along the ring (P2P ops address peers globally)."""
        pg = self.group if self._group is not None else dist.group.WORLD
        if pg is None:
            raise RuntimeError("the default process group is gone (destroy_process_group?); call "
                               "torch.distributed.init_process_group before a context-parallel call")
        return dist.get_global_rank(pg, (self.rank + offset) % self.world_size)

    @eager_only
    def exchange(self, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor], hop: int = 1) -> _Pending:
        """See :meth:`~.base.Transport.exchange`: ``send`` must not be written nor ``recv`` read until
        ``wait()`` on the returned handle."""
        to, frm = (self.next_rank, self.prev_rank) if hop == 1 else (self.peer(hop), self.peer(-hop))
        group = self.group
        self.sent_bytes += payload_bytes(send)
        ops = [dist.P2POp(dist.isend, t, to, group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, frm, group) for t in recv]
        return _Pending(dist.batch_isend_irecv(ops))

    @eager_only
    def all_gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's ``values`` in rank order: one all-gather on the CPU (gloo) or the current CUDA
        device (NCCL), the one device rule of every agreement in the library."""
        if self.world_size == 1:
            return [list(values)]
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        mine = torch.tensor(list(values), dtype=torch.int64, device=device)
        parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        with _released_by_gloo([mine, *parts], self.backend == "gloo"):
            dist.all_gather(parts, mine, group=self.group)
        return torch.stack(parts).tolist()

    @eager_only
    def all_gather_tensor(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's contiguous ``tensor``, in rank order (one all-gather)."""
        if self.world_size == 1:
            return [tensor]
        tensor = tensor.contiguous()
        self.sent_bytes += payload_bytes((tensor,), self.world_size - 1)
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        with _released_by_gloo([tensor, *parts], self.backend == "gloo"):
            dist.all_gather(parts, tensor, group=self.group)
        return parts

    @eager_only
    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the group in place, wherever it lives (a no-op alone): the reduction runs
        on the device the backend needs (this rank's CUDA device for NCCL, the CPU for gloo), with a
        copy only when the tensor lives elsewhere."""
        if self.world_size == 1:
            return tensor
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        on = tensor.to(device)
        self.sent_bytes += payload_bytes((on,), self.world_size - 1)
        with _released_by_gloo([on], self.backend == "gloo"):
            dist.all_reduce(on, group=self.group)
        return tensor if on is tensor else tensor.copy_(on)


_TOKENS: weakref.WeakKeyDictionary[Any, object] = weakref.WeakKeyDictionary()


_TOKENS_LOCK = threading.Lock()


@eager_only
def group_token(group: Any) -> object:
    """A stand-in for ``group`` in cache keys: one unique object per group, which does not keep the
    group alive (a gloo group kept past ``destroy_process_group`` is freed at interpreter exit, where
    its threads can abort the process: "terminate called without an active exception"). ``None``
    stands for the default group; a transport gives its own token. Raises ``TypeError`` for an object
    that cannot be weakly referenced. A ``DeviceMesh`` stands for its ``"cp"`` group; a two-level one for
    its (whole, outer, inner) groups, as its transport does."""
    levels = mesh_levels(group)
    if levels is not None:
        return _two_level_token(group_token(cp_group(group)), *(group_token(g) for g in levels))
    group = cp_group(group)
    if _is_transport(group):
        return group.token
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return None  # no group: a world of one
    pg = dist.group.WORLD if group is None else group
    with _TOKENS_LOCK:
        token = _TOKENS.get(pg)
        if token is None:
            token = _TOKENS[pg] = object()
        return token


@eager_only
def transport_for(group=None):
    """The :class:`~.base.Transport` for ``group``: a transport (the loopback's ranks, a replay) is
    returned as it is; a process group, ``None`` or a ``DeviceMesh`` (its ``"cp"`` dim) gets a
    :class:`ProcessGroupTransport`. A two-level mesh (:func:`.mesh.is_two_level`) gets one over all its
    ranks whose ``levels`` are the transports of its (outer, inner) dims."""
    levels = mesh_levels(group)
    group = cp_group(group)
    if _is_transport(group):
        return group
    if levels is not None:
        return two_level_transport(group, *levels)
    return ProcessGroupTransport(group)


@eager_only
def two_level_transport(whole, outer, inner) -> ProcessGroupTransport:
    """The transport of a two-level CP group: ``whole`` (every rank; rank = outer rank x inner size +
    inner rank) with ``levels`` = the transports of this rank's ``outer`` group (the ring of
    ``cp_comm_type="a2a+p2p"``) and ``inner`` group (its all-to-all)."""
    transport = ProcessGroupTransport(whole)
    transport.levels = (ProcessGroupTransport(outer), ProcessGroupTransport(inner))
    # A plan made on the whole group alone must not serve this one (it has no levels).
    transport._token = _two_level_token(transport._token, *(t.token for t in transport.levels))
    return transport


_LEVEL_TOKENS: dict = {}


def _two_level_token(*tokens: object) -> object:
    """One token per (whole, outer, inner) groups: compared by identity, like every group token."""
    with _TOKENS_LOCK:
        return _LEVEL_TOKENS.setdefault(tokens, object())
