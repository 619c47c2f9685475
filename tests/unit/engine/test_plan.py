"""One plan per batch (``cp_attention.plan``): exact against the fp64 reference, built and agreed once,
reused by every call, refusing what contradicts it, and the same on every rank."""

from __future__ import annotations

import pytest
import torch

import cp_attention as cpa
from benchmarks.gpu import ReplayTransport
from cp_attention.engine import plan as plan_module
from cp_attention.transport import LoopbackGroup, ProcessGroupTransport, Transport
from tests.support.core.loopback_cases import loopback_errors


class TailFirstLayout(cpa.Layout):
    """Rank r holds chunk N-1-r of N (contiguous, ranks in reverse): registered with no schedule of
    its own, so its blocks derive from its positions, plain, packed and windowed alike."""

    name = "tail_first"

    def divisor(self, world_size: int) -> int:
        return world_size

    def _positions(self, seq_len: int, rank: int, world_size: int) -> torch.Tensor:
        n = seq_len // world_size
        return torch.arange((world_size - 1 - rank) * n, (world_size - rank) * n)

    def _packed_positions(self, cu_seqlens, rank: int, world_size: int) -> torch.Tensor:
        return self._positions(cu_seqlens[-1], rank, world_size)


cpa.register_layout(TailFirstLayout())

# Packed lengths sum to 48: every layout splits them over 2, 3 and 4 ranks.
CASES = {"plain": {}, "packed": {"lengths": [1, 13, 3, 20, 5, 6]},
         "window": {"local_len": 24, "window": (5, -1), "kernel": "math"},
         "packed_window": {"lengths": [9, 21, 10, 8], "window": (4, -1)}}


def _case(name: str, world_size: int) -> dict:
    case = dict(CASES[name])
    if "lengths" in case:
        case["local_len"] = sum(case["lengths"]) // world_size
    elif "local_len" in case:
        case["local_len"] //= world_size
    return case


def _assert_exact(errors: dict) -> None:
    bad = {k: v for k, v in errors.items() if v > 0}
    assert not bad, f"beyond tolerance: {bad}"


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("layout", [*cpa.LAYOUT_NAMES, "tail_first"])
@pytest.mark.parametrize("world_size", [3, 4])
def test_calls_with_a_plan_are_exact(world_size, layout, case):
    _assert_exact(loopback_errors(world_size, layout=layout, causal=True, use_plan=True, **_case(case, world_size)))


@pytest.mark.parametrize("case", CASES)
def test_a_layout_without_a_schedule_runs_without_a_plan_too(case):
    assert cpa.get_schedule("tail_first") is None
    _assert_exact(loopback_errors(3, layout="tail_first", causal=True, **_case(case, 3)))
    _assert_exact(loopback_errors(2, layout="tail_first", causal=False, **_case(case, 2)))


def test_the_plan_builds_steps_once_per_batch(monkeypatch):
    built = []
    original = plan_module.AttentionPlan._build_steps
    monkeypatch.setattr(plan_module.AttentionPlan, "_build_steps",
                        lambda self, *a: built.append(a) or original(self, *a))
    q = torch.randn(1, 12, 2, 8, dtype=torch.float64)
    p = cpa.plan("zigzag", None, cu_seqlens=torch.tensor([0, 5, 12]))
    outs = [cpa.ring_attention(q, q, q, plan=p) for _ in range(4)]
    assert len(built) == 1
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert torch.equal(outs[0], cpa.ring_attention(q, q, q, layout="zigzag", cu_seqlens=[0, 5, 12]))


def test_calls_with_a_plan_never_read_the_boundaries_again(monkeypatch):
    """The boundaries are read to the host once, when the plan is built (a CUDA tensor: one sync per
    batch); no layer call reads them (nor any tensor) again."""
    q = torch.randn(1, 12, 2, 8, dtype=torch.float64)
    p = cpa.plan("interleaved", None, cu_seqlens=torch.tensor([0, 5, 12]))
    cpa.ring_attention(q, q, q, plan=p)

    def refuse(*args, **kwargs):
        raise AssertionError("a layer call read a tensor to the host")

    monkeypatch.setattr(torch.Tensor, "tolist", refuse)
    monkeypatch.setattr(torch.Tensor, "item", refuse)
    monkeypatch.setattr(plan_module, "host_cu_seqlens", refuse)
    for _ in range(3):
        cpa.ring_attention(q, q, q, plan=p)


def test_arguments_the_plan_fixes_are_refused_beside_it():
    q = torch.randn(1, 8, 2, 8, dtype=torch.float64)
    p = cpa.plan("contiguous", None, causal=False)
    for kwargs in ({"layout": "zigzag"}, {"layout": "contiguous"}, {"causal": True}, {"causal": False},
                   {"cu_seqlens": [0, 8]}, {"window_size": (2, 2)}, {"group": None}):
        with pytest.raises(ValueError, match="which the plan fixes"):
            cpa.ring_attention(q, q, q, plan=p, **kwargs)
    assert torch.equal(cpa.ring_attention(q, q, q, plan=p), cpa.ring_attention(q, q, q, layout="contiguous",
                                                                                causal=False))


def test_a_bad_plan_is_refused_on_every_rank_alike():
    loop = LoopbackGroup(3)

    def rank_fn(group):
        cu = [0, 5, 5, 12] if group.rank == 1 else [0, 5, 12]  # an empty document on rank 1
        try:
            cpa.plan("zigzag", group, cu_seqlens=cu)
        except ValueError as e:
            return str(e)
        return "no error"

    messages = loop.run(rank_fn)
    assert len(set(messages)) == 1 and "on rank 1" in messages[0] and "strictly increasing" in messages[0], messages


def test_plans_that_differ_between_ranks_are_refused():
    loop = LoopbackGroup(2)

    def rank_fn(group):
        try:
            cpa.plan("zigzag", group, cu_seqlens=[0, 4 + group.rank, 8])
        except ValueError as e:
            return str(e)
        return "no error"

    messages = loop.run(rank_fn)
    assert len(set(messages)) == 1 and "document boundaries" in messages[0], messages


def test_a_packed_length_the_layout_cannot_split_is_refused():
    with pytest.raises(ValueError, match="divisible"):
        cpa.plan("zigzag", LoopbackGroup(1).rank(0), cu_seqlens=[0, 3, 7])


def test_transports_share_one_protocol():
    for transport in (ProcessGroupTransport(None), LoopbackGroup(2).rank(1), ReplayTransport(0, 4)):
        assert isinstance(transport, Transport), type(transport).__name__
    assert not isinstance(object(), Transport)


class UnlistedLayout(cpa.ContiguousLayout):
    """A Layout object its user never registered: it runs as it is, by object, not by name."""

    name = "unlisted_contiguous"


@pytest.mark.parametrize("use_plan", [False, True])
def test_a_layout_known_to_no_registry_runs_as_an_object(use_plan):
    with pytest.raises(ValueError, match="unknown layout"):
        cpa.get_layout("unlisted_contiguous")
    _assert_exact(loopback_errors(3, layout=UnlistedLayout(), causal=True, use_plan=use_plan))
    _assert_exact(loopback_errors(2, layout=UnlistedLayout(), causal=True, use_plan=use_plan,
                                  **_case("packed", 2)))


def test_ranks_passing_different_layouts_are_told_apart_by_name():
    loop = LoopbackGroup(2)
    q = torch.randn(1, 8, 2, 8, dtype=torch.float64)

    def rank_fn(group):
        layout = UnlistedLayout() if group.rank == 1 else "contiguous"
        try:
            cpa.ring_attention(q, q, q, group=group, layout=layout)
        except ValueError as e:
            return str(e)
        return "no error"

    messages = loop.run(rank_fn)
    assert len(set(messages)) == 1 and "same layout" in messages[0] and "contiguous" in messages[0], messages
