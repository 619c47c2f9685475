"""The P2P agreement: every rank's small state folded over the group in ceil(log2 N) rounds of
exchanges, with no collective (so no device sync on gloo). Fault containment
(:mod:`cp_attention.engine.fault`) agrees the lowest failed rank with it, and the verdict cache
(:func:`~cp_attention.checks.agreement.digests_agree`) compares the ranks' fingerprints."""

from __future__ import annotations

from typing import Callable

import torch

from ..transport.base import Transport

__all__ = ["agree_by_doubling"]


def agree_by_doubling(transport: Transport, state: torch.Tensor,
                      combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Fold every rank's ``state`` (a small CPU int64 tensor) with ``combine``, an associative and
    commutative operation, in ceil(log2 N) rounds of P2P (recursive doubling: after round k each rank
    has folded in the 2^k ranks before it). Every rank gets the same result; no collective is used,
    so it costs no device sync on gloo."""
    hop = 1
    while hop < transport.world_size:
        got = torch.empty_like(state)
        transport.exchange((state,), (got,), hop).wait()
        state = combine(state, got)
        hop *= 2
    return state
