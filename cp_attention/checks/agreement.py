"""What the group has already agreed on, so that repeated ``ring_attention`` calls skip the collective.

Validation (:mod:`cp_attention.checks.validation`) all-gathers every rank's call signature once per
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
from collections import OrderedDict
from typing import Any, Iterator

import torch

from ..transport.process_group import group_token
from .doubling import agree_by_doubling

__all__ = ["Verdicts", "VERDICTS", "group_token", "agreed_forward", "AgreedScope", "in_agreed_forward", "digests_agree",
           "cache_enabled"]

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
        self._keys: OrderedDict[tuple, None] = OrderedDict()

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

_local = threading.local()


@contextlib.contextmanager
def agreed_forward(group: Any) -> Iterator[None]:
    """Mark the calls on ``group`` made inside as agreed: the caller has checked across the group, in
    one collective, that every rank runs the same computation on inputs of the same shapes (an
    adapter's per-forward check). Nested marks are fine."""
    stack = getattr(_local, "groups", None)
    if stack is None:
        stack = _local.groups = []
    stack.append(group_token(group))
    try:
        yield
    finally:
        stack.pop()


class AgreedScope:
    """:func:`agreed_forward` held across hooks: an adapter's forward pre-hook enters it once the
    forward's inputs are agreed, and its post-hook (which runs even if the forward raised) leaves it.
    Entering again first leaves the previous scope, so a missed post-hook cannot leave it open."""

    def __init__(self) -> None:
        self._scope: contextlib.AbstractContextManager | None = None

    def enter(self, group: Any) -> None:
        self.leave()
        self._scope = agreed_forward(group)
        self._scope.__enter__()

    def leave(self) -> None:
        scope, self._scope = self._scope, None
        if scope is not None:
            scope.__exit__(None, None, None)


def in_agreed_forward(group: Any) -> bool:
    """Whether this thread is inside :func:`agreed_forward` for ``group`` (a process group, ``None``
    for the default one, or a transport)."""
    stack = getattr(_local, "groups", ())
    if not stack:
        return False
    token = group_token(group)
    return any(g is token for g in stack)


def digests_agree(transport: Any, digest: int) -> bool:
    """Whether every rank of ``transport`` (a gloo group's or the loopback's) passed the same
    ``digest``, by recursive doubling of the min and max over P2P. Every rank gets the same answer."""
    span = torch.tensor([digest, digest], dtype=torch.int64)
    span = agree_by_doubling(transport, span, lambda a, b: torch.stack((torch.minimum(a[0], b[0]),
                                                                         torch.maximum(a[1], b[1]))))
    return bool(span[0] == span[1])
