"""What the group has already agreed on, so that repeated ``ring_attention`` calls skip the collective.

Validation (:mod:`cp_attention.validation`) all-gathers every rank's call signature once per
*distinct* signature: :class:`Verdicts` remembers the signatures the whole group passed together.
Every rank inserts the same key after the same successful all-gather and looks keys up in the same
order, so as long as the ranks make the same calls, their caches agree and they all skip (or all
run) the collective.

Two things keep a program whose ranks do *not* make the same calls from hanging or going wrong:

- on gloo, :func:`digests_agree` compares a fingerprint of every rank's signature in ceil(log2 N)
  rounds of 8-byte P2P exchanges (no collective, and on CPU no device sync); if any rank differs,
  every rank falls back to the full all-gather, which names the difference;
- an adapter that has agreed a model forward's inputs across the group (one collective per
  forward) marks the forward with :func:`agreed_forward`; inside it every rank calls with the same
  signatures, so a call is judged locally and never needs the collective.

On NCCL the fingerprint is not compared (it would be a host sync per call): a cached call trusts
that every rank makes the same sequence of calls, which SPMD training and the adapters' per-forward
checks guarantee. ``CP_ATTENTION_VALIDATE=always`` turns the cache off (one all-gather per call).
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections import OrderedDict
from typing import Any, Iterator

import torch

__all__ = ["Verdicts", "VERDICTS", "group_token", "agreed_forward", "AgreedScope", "in_agreed_forward", "digests_agree", "cache_enabled"]

_MAX_ENTRIES = 1024


def cache_enabled() -> bool:
    """False when ``CP_ATTENTION_VALIDATE=always`` asks for one agreement per call (debugging)."""
    return os.environ.get("CP_ATTENTION_VALIDATE", "cache") != "always"


class Verdicts:
    """An LRU set of call keys the group agreed on. Keys name the group by :func:`group_token`, so a
    destroyed group's entries can never be mistaken for a new group's, and the cache never keeps a
    group alive."""

    def __init__(self, max_entries: int = _MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._keys: "OrderedDict[tuple, None]" = OrderedDict()

    def __contains__(self, key: tuple) -> bool:
        if key in self._keys:
            self._keys.move_to_end(key)
            return True
        return False

    def add(self, key: tuple) -> None:
        """Remember ``key``; the least recently used key goes when the cache is full (the same one on
        every rank, since every rank sees the same sequence of keys)."""
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self.max_entries:
            self._keys.popitem(last=False)

    def clear(self) -> None:
        self._keys.clear()

    def __len__(self) -> int:
        return len(self._keys)


VERDICTS = Verdicts()

_TOKENS: "weakref.WeakKeyDictionary[Any, object]" = weakref.WeakKeyDictionary()
_TOKENS_LOCK = threading.Lock()


def group_token(group: Any) -> object:
    """A stand-in for ``group`` in cache keys: one unique object per group, which does not keep the
    group alive. (A gloo group that a cache held past ``destroy_process_group`` is freed at
    interpreter exit, where its threads can abort the process: "terminate called without an active
    exception".) ``None`` stands for the default group. Raises ``TypeError`` for an object that
    cannot be weakly referenced."""
    if group is None:
        import torch.distributed as dist

        group = dist.group.WORLD
    with _TOKENS_LOCK:
        token = _TOKENS.get(group)
        if token is None:
            token = _TOKENS[group] = object()
        return token

_local = threading.local()


@contextlib.contextmanager
def agreed_forward(group: Any) -> Iterator[None]:
    """Mark the calls on ``group`` made inside as agreed: the caller has checked across the group, in
    one collective, that every rank runs the same computation on inputs of the same shapes (an
    adapter's per-forward check). Nested marks are fine."""
    stack = getattr(_local, "groups", None)
    if stack is None:
        stack = _local.groups = []
    stack.append(group)
    try:
        yield
    finally:
        stack.pop()


class AgreedScope:
    """:func:`agreed_forward` held across hooks: an adapter's forward pre-hook enters it once the
    forward's inputs are agreed, and its post-hook (which runs even if the forward raised) leaves it.
    Entering again first leaves the previous scope, so a missed post-hook cannot leave it open."""

    def __init__(self) -> None:
        self._scope: "contextlib.AbstractContextManager | None" = None

    def enter(self, group: Any) -> None:
        self.leave()
        self._scope = agreed_forward(group)
        self._scope.__enter__()

    def leave(self) -> None:
        scope, self._scope = self._scope, None
        if scope is not None:
            scope.__exit__(None, None, None)


def in_agreed_forward(group: Any) -> bool:
    """Whether this thread is inside :func:`agreed_forward` for ``group``."""
    return any(g is group for g in getattr(_local, "groups", ()))


def digests_agree(comm: Any, digest: int) -> bool:
    """Whether every rank of ``comm`` (a :class:`~cp_attention.comm.RingComm` over a gloo group) passed
    the same ``digest``, in ceil(log2 N) rounds of P2P (recursive doubling of the min and max: after
    round k each rank has seen the 2^k ranks before it). Every rank gets the same answer."""
    span = torch.tensor([digest, digest], dtype=torch.int64)
    hop = 1
    while hop < comm.world_size:
        got = torch.empty_like(span)
        comm.exchange((span,), (got,), hop).wait()
        span = torch.stack((torch.minimum(span[0], got[0]), torch.maximum(span[1], got[1])))
        hop *= 2
    return bool(span[0] == span[1])
