"""The strategies' entries of a plan (seat plans, all-to-all sequence orders, "auto" picks) are theirs,
not the plan's: kept per plan, dropped when a setting they derive from is assigned, and gone with the plan."""

from __future__ import annotations

import gc
import weakref

import torch

from cp_attention.engine.plan import AttentionPlan
from cp_attention.strategies import plan_cache as caches
from cp_attention.strategies.dispatch import _seat_plan, _sequence_order
from cp_attention.transport.base import Seat

CPU = torch.device("cpu")


def _plan(**kwargs) -> AttentionPlan:
    return AttentionPlan("zigzag", Seat(0, 2), **{"causal": True, **kwargs})


def test_a_plan_holds_no_strategy_entries():
    plan = _plan()
    _seat_plan(plan, 1)
    _sequence_order(plan, 8, CPU)
    assert not {"_seats", "_orders", "_auto_picks"} & set(vars(plan))
    cache = caches.plan_cache(plan)
    assert set(cache.seats) == {1} and set(cache.orders) == {(8, CPU)}


def test_entries_are_per_plan_and_reused():
    a, b = _plan(), _plan()
    seat = _seat_plan(a, 1)
    assert _seat_plan(a, 1) is seat and _seat_plan(b, 1) is not seat
    assert (seat.rank, seat.world_size, seat.causal, seat.agreed) == (1, 2, True, True)
    alone = _seat_plan(a, 0, alone=True)
    assert (alone.layout.name, alone.world_size) == ("contiguous", 1) and _seat_plan(a, 0) is not alone
    order, inverse = _sequence_order(a, 8, CPU)
    assert _sequence_order(a, 8, CPU)[0] is order
    assert torch.equal(order, torch.cat([a.layout.positions(16, r, 2) for r in range(2)]))
    assert torch.equal(order[inverse], torch.arange(16))


def test_assigning_a_setting_drops_what_derives_from_it():
    plan = _plan()
    seat, (order, _) = _seat_plan(plan, 1), _sequence_order(plan, 8, CPU)
    caches.plan_cache(plan).auto_picks["shape"] = "a2a"
    plan.needs_only = False  # the seats and orders do not depend on it; the picks do
    assert _seat_plan(plan, 1) is seat and _sequence_order(plan, 8, CPU)[0] is order
    assert caches.plan_cache(plan).auto_picks == {}
    caches.plan_cache(plan).auto_picks["shape"] = "a2a"
    plan.causal = False
    fresh = _seat_plan(plan, 1)
    assert fresh is not seat and fresh.causal is False and caches.plan_cache(plan).auto_picks == {}
    plan.layout = "contiguous"
    assert not torch.equal(_sequence_order(plan, 8, CPU)[0], order)  # the contiguous order, not zigzag's
    assert torch.equal(_sequence_order(plan, 8, CPU)[0], torch.arange(16))


def test_settings_are_compared_by_identity_never_by_value():
    """A window given as a tensor is fine: assigning a new one drops the entries without comparing values
    (a tensor's ``==`` is elementwise, and on CUDA a host sync)."""
    plan = _plan(window_size=torch.tensor([2, 0]))
    seat = _seat_plan(plan, 1)
    assert _seat_plan(plan, 1) is seat
    plan.window_size = torch.tensor([2, 0])
    fresh = _seat_plan(plan, 1)
    assert fresh is not seat and fresh.window_size is plan.window_size


def test_a_plans_entries_die_with_it():
    plan = _plan()
    _seat_plan(plan, 1)
    _sequence_order(plan, 8, CPU)
    caches.plan_cache(plan).auto_picks["shape"] = "p2p"
    entries = len(caches._CACHES)
    alive = weakref.ref(plan)
    del plan
    gc.collect()
    assert alive() is None  # no entry keeps its plan alive
    assert len(caches._CACHES) == entries - 1
