"""The names issue 43 renamed ("one word per idea") still work for one release: each old name gives the
new object with a ``DeprecationWarning`` that names the replacement (cp_attention/_deprecated.py), and
the old names are gone from every ``__all__``."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch

import cp_attention as cpa
from cp_attention.engine.fault import RingFault
from cp_attention.engine.function import AttentionFunction
from cp_attention.engine.plan import AttentionPlan
from cp_attention.engine.ring import RingSource
from cp_attention.engine.tasks import KernelSettings
from cp_attention.kernels import MathKernel
from cp_attention.schedules import rank_steps
from cp_attention.strategies.composite import CompositeSource
from cp_attention.transport.base import Seat
from tests.support.core.reference import reference_attention

# (module, old name, new name): every module-level alias
MODULE_ALIASES = [
    ("cp_attention", "rank_plan", "rank_steps"),
    ("cp_attention.schedules", "rank_plan", "rank_steps"),
    ("cp_attention.schedules.causal", "rank_plan", "rank_steps"),
    ("cp_attention.schedules", "rank_traffic", "rank_needs"),
    ("cp_attention.schedules.needs", "rank_traffic", "rank_needs"),
    ("cp_attention.engine", "RingSchedule", "RingSource"),
    ("cp_attention.engine.ring", "RingSchedule", "RingSource"),
    ("cp_attention.strategies.composite", "CompositeSchedule", "CompositeSource"),
    ("cp_attention.strategies.batch_model", "step_rows", "step_needs"),
]


@pytest.mark.parametrize("module,old,new", MODULE_ALIASES, ids=[f"{m}.{o}" for m, o, _ in MODULE_ALIASES])
def test_an_old_module_name_warns_and_is_the_new_object(module, old, new):
    mod = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=rf"{module}\.{old} is deprecated .*use {module}\.{new}"):
        got = getattr(mod, old)
    assert got is getattr(mod, new)
    assert old not in getattr(mod, "__all__", ()) and new in mod.__all__


def test_from_import_of_an_old_name_warns_too():
    """``from cp_attention.schedules import rank_plan``, as the benchmarks wrote it."""
    namespace: dict = {}
    with pytest.warns(DeprecationWarning, match="rank_plan is deprecated"):
        exec("from cp_attention.schedules import rank_plan", namespace)
    assert namespace["rank_plan"] is rank_steps


@pytest.mark.parametrize("module", sorted({m for m, _, _ in MODULE_ALIASES}))
def test_unknown_names_still_raise_attribute_error(module):
    mod = importlib.import_module(module)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no warning on the way
        assert not hasattr(mod, "no_such_name")
        with pytest.raises(AttributeError, match=f"module '{module}' has no attribute 'no_such_name'"):
            mod.no_such_name  # noqa: B018 - the attribute access is the test


def _sources():
    settings = KernelSettings.of(MathKernel(), 0.5)
    seat, whole = Seat(0, 2), Seat(1, 2)
    index = (None, "needs")
    ring = RingSource(seat, ((),), settings, needs_index=index)
    composite = CompositeSource(settings, seat, whole, ((),), ((),), 1, gather=True, needs_index=index)
    return ring, composite, seat, whole, index


@pytest.mark.parametrize("old,new", [("comm", "transport"), ("fault_comm", "fault_transport"),
                                     ("traffic", "needs_index")])
def test_the_sources_old_attributes_warn_and_read_the_new(old, new):
    ring, composite, *_ = _sources()
    for source in (ring, composite):
        name = type(source).__name__
        with pytest.warns(DeprecationWarning, match=rf"{name}\.{old} is deprecated .*use {name}\.{new}"):
            got = getattr(source, old)
        assert got is getattr(source, new)
    assert composite.fault_transport is not composite.transport  # each old name reads its own field


def test_ring_fault_comm_warns_and_is_its_transport():
    seat = Seat(0, 1)
    fault = RingFault(seat)
    with pytest.warns(DeprecationWarning, match=r"RingFault\.comm is deprecated .*use RingFault\.transport"):
        assert fault.comm is seat is fault.transport


def test_plan_traffic_warns_and_is_the_needs_index():
    plan = AttentionPlan("zigzag", Seat(1, 4), True, (0, 5, 16), (-1, -1), agreed=True)
    with pytest.warns(DeprecationWarning, match=r"AttentionPlan\.traffic is deprecated .*use .*\.needs_index"):
        got = plan.traffic(4, torch.device("cpu"), 4)
    assert got is plan.needs_index(4, torch.device("cpu"), 4) and len(got) == 4 and got[0] is None


class _Legacy:
    """A K/V source written before the rename: its failure group is ``fault_comm``."""

    def __init__(self, inner: RingSource) -> None:
        self.inner, self.fault_comm = inner, inner.transport

    def forward(self, *args):
        return self.inner.forward(*args)

    def backward(self, *args):
        return self.inner.backward(*args)


def test_a_kv_source_with_only_fault_comm_still_runs_exactly_and_warns():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, 2, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    source = RingSource(Seat(0, 1), tuple(rank_steps("zigzag", True, 0, 1, 8)), KernelSettings.of(MathKernel(), 0.5))
    with pytest.warns(DeprecationWarning, match=r"_Legacy\.fault_comm \(a KVSource's\) is deprecated"):
        out, _ = AttentionFunction.apply(q, k, v, _Legacy(source))
    want, _ = reference_attention(q, k, v, True, 0.5)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)
    with pytest.warns(DeprecationWarning, match="fault_comm"):
        out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_a_source_with_neither_name_fails_as_before():
    class Nameless:
        pass

    q = torch.zeros(1, 2, 1, 4)
    with pytest.raises(AttributeError, match="fault_comm"):
        AttentionFunction.apply(q, q, q, Nameless())


def test_the_new_names_are_exported():
    assert "rank_steps" in cpa.__all__ and cpa.rank_steps is rank_steps
    assert importlib.import_module("cp_attention.engine").RingSource is RingSource
