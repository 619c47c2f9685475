"""Cases for tests/distributed/test_agreement.py, run inside the gloo worker processes: ``fn(rank, world_size, ...)``.

They count what a ``ring_attention`` call sends: collectives (all-gather, all-reduce, broadcast,
barrier...) and P2P batches, by wrapping ``torch.distributed``'s functions for the duration of a call.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Iterator

import torch
import torch.distributed as dist

import cp_attention as cpa
from cp_attention.checks.agreement import VERDICTS, agreed_forward

_COLLECTIVES = ("all_gather", "all_gather_object", "all_reduce", "broadcast", "broadcast_object_list", "barrier",
                "all_to_all", "reduce_scatter", "gather", "scatter")


@contextlib.contextmanager
def counting() -> Iterator[dict]:
    """Count calls of every torch.distributed collective and of ``batch_isend_irecv`` while inside."""
    counts = {"collectives": 0, "p2p_batches": 0}
    saved = {name: getattr(dist, name) for name in (*_COLLECTIVES, "batch_isend_irecv")}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            counts["p2p_batches" if name == "batch_isend_irecv" else "collectives"] += 1
            return fn(*args, **kwargs)
        return counted

    for name, fn in saved.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _qkv(seed: int, local_len: int = 4, requires_grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, local_len, 2, 8, generator=g).requires_grad_(requires_grad) for _ in range(3))


def _call(q, k, v, **kwargs):
    kwargs.setdefault("layout", "zigzag")
    return cpa.ring_attention(q, k, v, **kwargs)


def repeated_call_counts(rank: int, world_size: int, *, backward: bool = False) -> list[dict]:
    """Counts for three identical calls (the first agrees, the others should not) and one new one."""
    VERDICTS.clear()
    q, k, v = _qkv(rank, requires_grad=backward)
    results = []
    for causal in (True, True, True, False):
        with counting() as c:
            out = _call(q, k, v, causal=causal)
            if backward:
                out.sum().backward()
        results.append(dict(c))
    dist.barrier()
    return results


def ring_p2p_batches(world_size: int, backward: bool) -> int:
    """The P2P batches the ring itself posts per call on gloo, unrolled: the fault agreement's
    ceil(log2 N) rounds per pass; N-1 K/V exchanges in forward; in backward, which starts with the
    shard the forward held last, N-2 K/V exchanges and N-1 dK/dV hops; plus the signature
    fingerprint's ceil(log2 N) rounds per call."""
    rounds = math.ceil(math.log2(world_size))
    forward = (world_size - 1) + rounds
    back = (world_size - 2) + (world_size - 1) + rounds if backward else 0
    return forward + back + rounds


def diverging_calls(rank: int, world_size: int, *, cached: bool) -> tuple[str, str]:
    """Both ranks agree on calls A (causal) and B (not causal); then rank 0 calls A while the others
    call B (both cached with ``cached``, else B is new to the group). Returns what was raised."""
    VERDICTS.clear()
    q, k, v = _qkv(0)
    _call(q, k, v, causal=True)
    if cached:
        _call(q, k, v, causal=False)
    try:
        _call(q, k, v, causal=(rank == 0))
    except ValueError as e:
        result = ("ValueError", str(e))
    else:
        result = ("", "")
    dist.barrier()
    return result


def uncached_counts(rank: int, world_size: int) -> list[int]:
    """Collectives per call for two identical calls with ``CP_ATTENTION_VALIDATE=always``."""
    VERDICTS.clear()
    os.environ["CP_ATTENTION_VALIDATE"] = "always"
    try:
        q, k, v = _qkv(rank)
        counts = []
        for _ in range(2):
            with counting() as c:
                _call(q, k, v)
            counts.append(c["collectives"])
    finally:
        del os.environ["CP_ATTENTION_VALIDATE"]
    return counts


def agreed_forward_calls(rank: int, world_size: int, *, bad_heads: bool = False) -> tuple[int, str]:
    """Inside ``agreed_forward`` a first-time call makes no collective; a bad call raises on every rank
    alike (judged locally). Returns (collectives, error message or "")."""
    VERDICTS.clear()
    q, k, v = _qkv(rank)
    if bad_heads:
        k = v = torch.randn(1, 4, 3, 8)  # 2 query heads are not a multiple of 3 K/V heads
    message = ""
    with counting() as c, agreed_forward(None):
        try:
            _call(q, k, v, causal=True)
        except ValueError as e:
            message = str(e)
    dist.barrier()
    return c["collectives"], message


def cached_call_is_exact(rank: int, world_size: int) -> float:
    """The second (cached) call returns the same output as the first (agreed) one, bit for bit."""
    VERDICTS.clear()
    q, k, v = _qkv(rank)
    first = _call(q, k, v, causal=True)
    second = _call(q, k, v, causal=True)
    return float((first - second).abs().max())


def destroyed_group_is_freed(rank: int, world_size: int) -> tuple[bool, int]:
    """A subgroup that ran an agreed call and was destroyed is freed at once: the verdict cache must
    not keep it alive (a gloo group freed at interpreter exit can abort the process). Returns
    (whether the group is still alive after destroy, verdicts cached)."""
    import gc
    import weakref

    VERDICTS.clear()
    group = dist.new_group(list(range(world_size)))
    q, k, v = _qkv(rank)
    _call(q, k, v, causal=True, group=group)
    cached = len(VERDICTS)
    alive = weakref.ref(group)
    dist.destroy_process_group(group)
    del group
    gc.collect()
    return alive() is not None, cached
