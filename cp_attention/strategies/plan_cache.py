"""What the strategies derive from a batch's plan, kept here rather than on the plan: the seat plans
of their virtual ranks and the all-to-all sequence orders (:mod:`.dispatch`), and the agreed
``"auto"`` picks (:mod:`.auto`).

Each plan's entries live in a :class:`weakref.WeakKeyDictionary` keyed by the plan, so they die with
it (a plan is usually one batch's; nothing here keeps one alive: no entry refers to its plan). An
entry holds while the plan settings it derives from hold: assigning one (``plan.causal = False``)
drops what derived from the old value, as the plan drops its own caches.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..engine.plan import AttentionPlan

__all__ = ["PlanCache", "plan_cache"]


class PlanCache:
    """One plan's strategy entries. ``seats``: a seat plan per group rank or ``"alone"``; ``orders``:
    ``(order, inverse)`` per (local length, device); both derive from the layout, causal, the documents
    and the window. ``auto_picks``: the agreed strategy per call shape, which derives from
    ``needs_only`` too."""

    __slots__ = ("seat_settings", "pick_settings", "seats", "orders", "auto_picks")

    def __init__(self) -> None:
        self.seat_settings: tuple = ()  # the plan settings seats and orders derive from
        self.pick_settings: tuple = ()  # ... and those the picks derive from
        self.seats: dict[Any, AttentionPlan] = {}
        self.orders: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.auto_picks: dict[tuple, str] = {}


_CACHES: weakref.WeakKeyDictionary[AttentionPlan, PlanCache] = weakref.WeakKeyDictionary()


def _same(held: tuple, now: tuple) -> bool:
    """Whether the settings ``now`` are the objects ``held`` (a plan keeps the objects it was given and
    takes new ones when a setting is assigned): a few pointer compares per call, never a value compare
    (a ``window_size`` may be a tensor)."""
    return len(held) == len(now) and all(a is b for a, b in zip(held, now))


def plan_cache(plan: AttentionPlan) -> PlanCache:
    """``plan``'s strategy entries, emptied of those whose settings were assigned since."""
    cache = _CACHES.get(plan)
    if cache is None:
        cache = _CACHES.setdefault(plan, PlanCache())
    seat_settings = (plan.layout, plan.causal, plan.cu_seqlens, plan.window_size)
    if not _same(cache.seat_settings, seat_settings):
        cache.seat_settings, cache.seats, cache.orders = seat_settings, {}, {}
    pick_settings = (*seat_settings, plan.needs_only)
    if not _same(cache.pick_settings, pick_settings):
        cache.pick_settings, cache.auto_picks = pick_settings, {}
    return cache
