"""Every plan setting that changes what travels is agreed across the group, or refused alike on every
rank, before any communication (cp_attention issue 44): ``needs_only`` (built in, or assigned after),
the settings a plan is built from when assigned on one rank only, and ``return_lse`` per call. Ranks
run as loopback threads with a short timeout, so a regression fails instead of hanging."""

from __future__ import annotations

import pytest
import torch

import cp_attention as cpa
from cp_attention.transport.loopback import LoopbackGroup
from tests.support.core.reference import reference_attention

TIMEOUT_S = 10.0  # the loopback's wait for a message: what a hang becomes here
LOCAL = 8


def _inputs(world_size: int, heads: int = 2, d: int = 8):
    g = torch.Generator().manual_seed(world_size)
    return tuple(torch.randn(1, LOCAL * world_size, heads, d, generator=g, dtype=torch.float64) for _ in range(3))


def _run(world_size: int, body) -> list:
    """``body(rank, q, k, v)`` on every rank (its shards of zigzag-sharded fp64 inputs): per rank, its
    output, or ``(type name, message)`` of what it raised."""
    q, k, v = _inputs(world_size)
    lay = cpa.get_layout("zigzag")

    def rank_fn(rank):
        shards = [lay.shard(t, 1, rank.rank, world_size) for t in (q, k, v)]
        try:
            return body(rank, *shards)
        except Exception as e:  # noqa: BLE001 - the test compares what every rank raised
            return type(e).__name__, str(e)
    return LoopbackGroup(world_size, timeout_s=TIMEOUT_S).run(rank_fn)


def _one_error(results: list, *fragments: str) -> str:
    """The one ``ValueError`` message every rank raised (asserted), holding every fragment."""
    assert all(isinstance(r, tuple) for r in results), results
    assert {kind for kind, _ in results} == {"ValueError"}, results
    messages = {msg for _, msg in results}
    assert len(messages) == 1, f"ranks disagree: {results}"
    message = messages.pop()
    for fragment in fragments:
        assert fragment in message, message
    return message


def _exact(world_size: int, outs: list, causal: bool = True) -> None:
    q, k, v = _inputs(world_size)
    ref, _ = reference_attention(q, k, v, causal, q.shape[-1] ** -0.5)
    got = cpa.get_layout("zigzag").unshard(list(outs), 1)
    assert (got - ref).abs().max().item() <= 1e-10


def _ahead(rank, needs_only: bool = True):
    """Rank ``rank``'s plan built ahead (no group), bound to its group."""
    return cpa.plan_ahead("zigzag", rank.rank, rank.world_size, local_len=LOCAL, kernel="math", device="cpu",
                          dtype=torch.float64, head_dim=8, needs_only=needs_only).bind(rank)


BUILDS = {"plan": lambda rank: cpa.plan("zigzag", rank), "plan_ahead+bind": _ahead}


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("world_size", [2, 3])  # 2: a crash in the transport, 3: a hang, before the fix
@pytest.mark.parametrize("calls_before", [0, 1])  # assigned before the first call, or after one was agreed
def test_needs_only_assigned_on_one_rank_is_refused_on_every_rank(world_size, build, calls_before):
    def body(rank, q, k, v):
        plan = BUILDS[build](rank)
        for _ in range(calls_before):
            cpa.ring_attention(q, k, v, plan=plan, kernel="math")
        if rank.rank == world_size - 1:
            plan.needs_only = False
        return cpa.ring_attention(q, k, v, plan=plan, kernel="math")
    message = _one_error(_run(world_size, body), "ring_attention: every rank of the group must pass the same plan "
                                                 "needs_only", "set alike on every rank")
    assert f"rank {world_size - 1}: False" in message and "rank 0: True" in message


@pytest.mark.parametrize("world_size", [2, 3])
def test_needs_only_given_on_one_rank_is_refused_when_the_plan_is_built_or_bound(world_size):
    odd = world_size - 1
    plain = _run(world_size, lambda rank, *_: cpa.plan("zigzag", rank, needs_only=rank.rank != odd))
    _one_error(plain, "cp_attention.plan: every rank of the group must pass the same plan needs_only")
    bound = _run(world_size, lambda rank, *_: _ahead(rank, needs_only=rank.rank != odd))
    _one_error(bound, "cp_attention.plan: every rank of the group must pass the same plan needs_only")


@pytest.mark.parametrize("how", ["plan", "plan_ahead+bind", "assigned after a call"])
def test_whole_shards_set_alike_are_exact_and_send_whole_shards(how):
    world_size = 3
    wire = LOCAL * world_size  # rows of K/V on the wire per call, whole shards: every other shard once

    def body(rank, q, k, v):
        if how == "plan":
            plan = cpa.plan("zigzag", rank, needs_only=False)
        elif how == "plan_ahead+bind":
            plan = _ahead(rank, needs_only=False)
        else:
            plan = cpa.plan("zigzag", rank)
            cpa.ring_attention(q, k, v, plan=plan, kernel="math")
            plan.needs_only = False
        assert plan.needs_only is False
        before = rank.sent_bytes
        out = cpa.ring_attention(q, k, v, plan=plan, kernel="math")
        rows = (rank.sent_bytes - before) // (2 * 2 * 8 * 8)  # K and V rows of 2 heads x 8 dims in fp64
        return out, rows
    results = _run(world_size, body)
    assert all(not isinstance(r[0], str) for r in results), results
    _exact(world_size, [out for out, _ in results])
    # whole shards: each rank sends its shard to both others (needs-only would send fewer)
    assert [rows for _, rows in results] == [wire - LOCAL] * world_size


def test_needs_only_must_be_a_bool_on_every_rank():
    results = _run(2, lambda rank, *_: cpa.plan("zigzag", rank, needs_only="no" if rank.rank else True))
    _one_error(results, "needs_only must be a bool", "(on rank 1; ranks with bad input: [1])")


def test_a_setting_assigned_on_one_rank_is_refused_on_every_rank():
    def body(rank, q, k, v):
        plan = cpa.plan("zigzag", rank)
        cpa.ring_attention(q, k, v, plan=plan, kernel="math")
        if rank.rank == 1:
            plan.causal = False
        return cpa.ring_attention(q, k, v, plan=plan, kernel="math")
    _one_error(_run(3, body), "every rank of the group must pass the same causal, got rank 0: True, rank 1: False")


def test_a_setting_assigned_alike_re_derives_the_plan_exactly():
    def body(rank, q, k, v):
        plan = cpa.plan("zigzag", rank)
        cpa.ring_attention(q, k, v, plan=plan, kernel="math")  # builds causal steps and rows
        plan.causal = False
        assert not plan.agreed and "causal=False" in repr(plan)
        return cpa.ring_attention(q, k, v, plan=plan, kernel="math")
    _exact(3, _run(3, body), causal=False)


def test_a_plans_group_is_not_assigned():
    plan = cpa.plan("zigzag", LoopbackGroup(1).rank(0))
    with pytest.raises(AttributeError, match=r"plan\.bind\(group\)"):
        plan.transport = LoopbackGroup(1).rank(0)


def test_return_lse_on_one_rank_is_refused_on_every_rank():
    # a2a sends the LSE back only when asked: one rank asking would post other exchanges than the rest
    def body(rank, q, k, v):
        return cpa.ring_attention(q, k, v, group=rank, kernel="math", cp_comm_type="a2a",
                                  return_lse=rank.rank == 0)
    _one_error(_run(2, body), "every rank of the group must pass the same return_lse", "rank 0: True, rank 1: False")


def test_return_lse_must_be_a_bool_and_the_message_names_it():
    def body(rank, q, k, v):
        return cpa.ring_attention(q, k, v, group=rank, kernel="math", return_lse="yes")
    _one_error(_run(2, body), "return_lse must be a bool (True or False), got 'yes'")


@pytest.mark.parametrize("differ", [dict(needs_only=False), dict(causal=False)])
def test_a_plan_one_rank_builds_differently_after_an_agreed_one_is_refused_alike(differ):
    # the group agreed these plan fields before: a rank holding them must not skip the all-gather that
    # the rank building other fields waits in (it did: a hang)
    loop = LoopbackGroup(3, timeout_s=TIMEOUT_S)

    def rank_fn(rank, odd: bool):
        try:
            cpa.plan("zigzag", rank, **(differ if odd and rank.rank == 2 else {}))
        except Exception as e:  # noqa: BLE001 - the test compares what every rank raised
            return type(e).__name__, str(e)
        return "", ""
    assert loop.run(rank_fn, False) == [("", "")] * 3
    _one_error(loop.run(rank_fn, True), "cp_attention.plan: every rank of the group must pass the same",
               f"{next(iter(differ))}")
