"""Validation runs its all-gather once per distinct call signature (cp_attention/checks/agreement.py)."""

from __future__ import annotations

import pytest

from cp_attention.checks.agreement import Verdicts, agreed_forward, in_agreed_forward
from tests.support.core import agreement_cases as cases


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("backward", [False, True])
def test_repeated_call_adds_no_collective(pools, world_size, backward):
    results = pools(world_size).run(cases.repeated_call_counts, backward=backward)
    ring = cases.ring_p2p_batches(world_size, backward)
    for counts in results:
        first, second, third, new = counts
        assert first["collectives"] == 1  # the one all-gather that agrees the signature
        assert second["collectives"] == third["collectives"] == 0
        assert second["p2p_batches"] == third["p2p_batches"] == ring  # nothing beyond the ring's own P2P
        assert new["collectives"] == 1  # a new signature (causal=False) is agreed again


@pytest.mark.parametrize("cached", [True, False])
def test_ranks_calling_differently_all_raise(pools, cached):
    results = pools(3).run(cases.diverging_calls, cached=cached, timeout=60)
    kinds = {kind for kind, _ in results}
    assert kinds == {"ValueError"}
    assert len({msg for _, msg in results}) == 1
    assert "every rank of the group must pass the same causal" in results[0][1]


def test_cache_off_agrees_every_call(pools):
    assert pools(2).run(cases.uncached_counts) == [[1, 1], [1, 1]]


def test_agreed_forward_needs_no_collective(pools):
    assert pools(2).run(cases.agreed_forward_calls) == [(0, "")] * 2


def test_agreed_forward_errors_on_every_rank(pools):
    results = pools(2).run(cases.agreed_forward_calls, bad_heads=True, timeout=60)
    assert results[0][1] == results[1][1] and "multiple of the K/V heads" in results[0][1]
    assert all(n == 0 for n, _ in results)


def test_cached_call_is_exact(pools):
    assert pools(3).run(cases.cached_call_is_exact) == [0.0] * 3


def test_verdicts_evict_least_recently_used():
    cache = Verdicts(max_entries=2)
    cache.add(("a",))
    cache.add(("b",))
    assert ("a",) in cache  # touches a: b is now the oldest
    cache.add(("c",))
    assert ("b",) not in cache and ("a",) in cache and ("c",) in cache and len(cache) == 2


class _Group:
    """A stand-in group: any object that can be weakly referenced, as process groups can."""


def test_agreed_forward_nests_per_group():
    g1, g2 = _Group(), _Group()
    with agreed_forward(g1):
        assert in_agreed_forward(g1) and not in_agreed_forward(g2)
        with agreed_forward(g2):
            assert in_agreed_forward(g1) and in_agreed_forward(g2)
        assert not in_agreed_forward(g2)
    assert not in_agreed_forward(g1)


def test_verdicts_do_not_keep_a_destroyed_group_alive(pools):
    assert pools(2).run(cases.destroyed_group_is_freed) == [(False, 1)] * 2
