"""A plan setting that changes what travels (``needs_only``) set on one rank only raises the same clear
error on every gloo rank, before any K/V moves (it crashed in the transport at 2 ranks and hung at 3);
set alike, it is exact against an fp64 reference (cp_attention issue 44)."""

from __future__ import annotations

import pytest

from tests.support.core import plan_setting_cases as cases


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("build", ["plan", "plan_ahead+bind"])
@pytest.mark.parametrize("assign,calls_before", [(True, 0), (True, 1), (False, 0)])
def test_needs_only_on_one_rank_raises_alike(pools, world_size, build, assign, calls_before):
    results = pools(world_size).run(cases.needs_only_on_one_rank, build=build, assign=assign,
                                    calls_before=calls_before, timeout=60)
    assert {kind for kind, _ in results} == {"ValueError"}, results
    assert len({msg for _, msg in results}) == 1, f"ranks disagree: {results}"
    message = results[0][1]
    # refused by the plan's own agreement when given to plan()/plan_ahead(), by the call's when assigned
    assert message.startswith("ring_attention: " if assign else "cp_attention.plan: "), message
    assert "every rank of the group must pass the same plan needs_only" in message
    assert f"rank {world_size - 1}: False" in message and "rank 0: True" in message


@pytest.mark.parametrize("build", ["plan", "plan_ahead+bind"])
def test_whole_shards_alike_are_exact(pools, build):
    errors = pools(3).run(cases.whole_shards_error, build=build)
    assert max(errors) <= 1e-10, errors
