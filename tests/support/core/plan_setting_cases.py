"""Cases for tests/distributed/test_plan_settings.py, run inside the gloo worker processes:
``fn(rank, world_size, ...)``. A plan setting that changes what travels (``needs_only``), set on one
rank only or alike, with a plan built in the step or ahead of it and bound."""

from __future__ import annotations

import torch

import cp_attention as cpa

from .reference import reference_attention

_LOCAL, _HEADS, _DIM = 8, 2, 8


def _inputs(world_size: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(44 + world_size)  # the same full tensors on every rank
    return tuple(torch.randn(1, _LOCAL * world_size, _HEADS, _DIM, generator=g, dtype=torch.float64)
                 for _ in range(3))


def _plan(rank: int, world_size: int, build: str, needs_only: bool = True):
    given = {} if needs_only else {"needs_only": False}  # the default as a plan of any version builds it
    if build == "plan":
        return cpa.plan("zigzag", None, **given)
    return cpa.plan_ahead("zigzag", rank, world_size, local_len=_LOCAL, kernel="math", device="cpu",
                          dtype=torch.float64, head_dim=_DIM, **given).bind(None)


def needs_only_on_one_rank(rank: int, world_size: int, *, build: str, assign: bool,
                           calls_before: int = 0) -> tuple[str, str]:
    """The last rank's plan sends whole shards, the others' only the needed rows: assigned after the plan
    was built (``assign``), or passed to plan()/plan_ahead(). ``(exception type, message)`` this rank got."""
    lay = cpa.get_layout("zigzag")
    q, k, v = (lay.shard(t, 1, rank, world_size) for t in _inputs(world_size))
    odd = rank == world_size - 1
    try:
        plan = _plan(rank, world_size, build, needs_only=assign or not odd)
        for _ in range(calls_before):
            cpa.ring_attention(q, k, v, plan=plan, kernel="math")
        if assign and odd:
            plan.needs_only = False
        cpa.ring_attention(q, k, v, plan=plan, kernel="math")
    except Exception as e:  # noqa: BLE001 - the case reports what was raised
        return type(e).__name__, str(e)
    return "", ""


def whole_shards_error(rank: int, world_size: int, *, build: str) -> float:
    """Max |out - fp64 reference| and of the gradients' of this rank's rows, every rank sending whole
    shards (needs_only=False on every rank)."""
    lay = cpa.get_layout("zigzag")
    full = _inputs(world_size)
    shards = [lay.shard(t, 1, rank, world_size).requires_grad_() for t in full]
    out = cpa.ring_attention(*shards, plan=_plan(rank, world_size, build, needs_only=False), kernel="math")
    out.square().sum().backward()
    ref = [t.clone().requires_grad_() for t in full]
    ref_out, _ = reference_attention(*ref, True, _DIM ** -0.5)
    ref_out.square().sum().backward()
    pairs = [(out, ref_out.detach())] + [(s.grad, t.grad) for s, t in zip(shards, ref)]
    return max((got - lay.shard(want, 1, rank, world_size)).abs().max().item() for got, want in pairs)
