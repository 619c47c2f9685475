"""Needs-only (cp_attention/schedules/needs.py, engine/needs_index.py, the ring and the all-gather):
each rank receives exactly the K/V rows some query of its own can see, every task reads only rows it
received, the bytes on the wire are those rows and nothing else, and the results stay exact.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cp_attention as cpa
from cp_attention.engine.plan import AttentionPlan
from cp_attention.layouts.documents import cu_seqlens_from_lengths, document_ids
from cp_attention.schedules.derived import block_schedules
from cp_attention.schedules.needs import rank_needs, traffic_model
from cp_attention.schedules.windows import normalize_window
from cp_attention.strategies.dispatch import _Seat
from cp_attention.transport.loopback import LoopbackGroup
from tests.support.core.loopback_cases import loopback_errors

LAYOUTS = ("contiguous", "zigzag", "interleaved", "balanced")


def _lengths(draw_lengths: list[int], world_size: int) -> list[int]:
    """Document lengths padded (last document) so the layouts can split them."""
    total = sum(draw_lengths)
    draw_lengths[-1] += -total % (2 * world_size)
    return draw_lengths


def _oracle_rows(layout, causal, world_size, total, cu, window, rank, source) -> list[int]:
    """Rows of ``source``'s shard some query of ``rank`` sees, by the mask itself (pair by pair)."""
    lay = cpa.get_layout(layout)
    qpos = lay.positions(total, rank, world_size, cu).tolist()
    kpos = lay.positions(total, source, world_size, cu).tolist()
    doc = document_ids(cu).tolist()
    left, right = window if window is not None else (-1, -1)

    def sees(i, j):
        return (doc[i] == doc[j] and (not causal or j <= i) and (left < 0 or j >= i - left)
                and (right < 0 or j <= i + right))
    return [b for b, j in enumerate(kpos) if any(sees(i, j) for i in qpos)]


@settings(max_examples=60, deadline=None)
@given(layout=st.sampled_from(LAYOUTS), world_size=st.integers(2, 5), causal=st.booleans(),
       lengths=st.lists(st.integers(1, 30), min_size=1, max_size=6),
       window=st.sampled_from([None, (3, -1), (0, 0), (5, 2), (-1, 4)]))
def test_needed_rows_are_what_the_mask_needs(layout, world_size, causal, lengths, window):
    lengths = _lengths(lengths, world_size)
    total, cu = sum(lengths), cu_seqlens_from_lengths(lengths)
    norm = normalize_window(window, causal, total, cu)
    steps = world_size
    for rank in range(world_size):
        needs = rank_needs(layout, causal, world_size, total, cu, norm, rank, steps)
        for s in range(1, steps):
            src, dst = (rank - s) % world_size, (rank + s) % world_size
            assert needs[s].recv.tolist() == _oracle_rows(layout, causal, world_size, total, cu, norm, rank, src)
            assert needs[s].send.tolist() == _oracle_rows(layout, causal, world_size, total, cu, norm, dst, rank)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("window", [None, (6, -1)])
@pytest.mark.parametrize("causal", [True, False])
def test_every_block_reads_only_received_rows(layout, window, causal):
    # The held buffer has only the needed rows filled: a block reading any other row would read stale
    # values. Every rank's document blocks (what the lowering turns into tasks) stay within them.
    world_size = 4
    lengths = _lengths([1, 37, 3, 9, 60, 2, 14], world_size)
    total, cu = sum(lengths), cu_seqlens_from_lengths(lengths)
    norm = normalize_window(window, causal, total, cu)
    every = block_schedules(cpa.get_layout(layout), causal, world_size, total, cu, norm)
    for rank, steps in enumerate(every):
        needs = rank_needs(layout, causal, world_size, total, cu, norm, rank, len(steps))
        for s in range(1, len(steps)):
            needed = set(needs[s].recv.tolist())
            read = {b for blk in steps[s] for b in range(blk.kv_start, blk.kv_stop)}
            assert read <= needed, (rank, s, sorted(read - needed))
            assert read == needed  # and nothing is sent that no block reads


@settings(max_examples=40, deadline=None)
@given(layout=st.sampled_from(LAYOUTS), world_size=st.integers(2, 6), causal=st.booleans(),
       lengths=st.lists(st.integers(1, 40), min_size=1, max_size=8))
def test_the_model_counts_what_the_engine_receives(layout, world_size, causal, lengths):
    # traffic_model counts per (document, rank) without a window; the engine's needs are per key
    lengths = _lengths(lengths, world_size)
    total, cu = sum(lengths), cu_seqlens_from_lengths(lengths)
    model = traffic_model(layout, causal, total, world_size, cu)
    for rank in range(world_size):
        needs = rank_needs(layout, causal, world_size, total, cu, None, rank, world_size)
        assert model[rank] == [0] + [r.recv.numel() for r in needs[1:]]


def test_unpacked_rules_match_the_model():
    # zigzag's rule: an earlier rank's first half, a later rank's whole shard; contiguous: nothing from
    # later ranks; interleaved: all but the last row of later ranks.
    n = 6
    assert traffic_model("zigzag", True, 4 * n, 4)[1] == [0, n // 2, n, n]
    assert traffic_model("contiguous", True, 4 * n, 4)[1] == [0, n, 0, 0]
    assert traffic_model("interleaved", True, 4 * n, 4)[1] == [0, n, n - 1, n - 1]
    assert traffic_model("zigzag", False, 4 * n, 4)[1] == [0, n, n, n]
    assert traffic_model("zigzag", True, 4 * n, 4, needs_only=False)[1] == [0, n, n, n]


class _Wire:
    """A loopback rank that records the K/V and dK/dV payloads it sends (4-D tensors; the agreements'
    small vectors are left out)."""

    def __init__(self, rank) -> None:
        self._rank, self.sent, self.bytes = rank, [], 0

    def __getattr__(self, name):
        return getattr(self._rank, name)

    def exchange(self, send, recv, hop=1):
        self.sent += [(hop, tuple(t.shape), t.dtype) for t in send if t.dim() == 4]
        self.bytes += sum(t.numel() * t.element_size() for t in send)  # every payload, agreements too
        return self._rank.exchange(send, recv, hop)


@pytest.mark.parametrize("cp_comm_type", ["p2p", "all_gather"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_wire_carries_exactly_the_needed_rows(layout, cp_comm_type):
    world_size, heads, kv_heads, d = 4, 4, 2, 8
    lengths = _lengths([1, 37, 3, 9, 60, 2, 14, 50], world_size)
    total, cu = sum(lengths), cu_seqlens_from_lengths(lengths)
    lay = cpa.get_layout(layout)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, total, h, d, generator=g, dtype=torch.float64) for h in (heads, kv_heads, kv_heads))
    model = traffic_model(layout, True, total, world_size, cu)

    def body(rank):
        wire = _Wire(rank)
        ql, kl, vl = (lay.shard(t, 1, rank.rank, world_size, cu).requires_grad_() for t in (q, k, v))
        plan = cpa.plan(lay, wire, causal=True, cu_seqlens=cu)
        before, wire.bytes = rank.sent_bytes, 0
        out = cpa.ring_attention(ql, kl, vl, plan=plan, cp_comm_type=cp_comm_type)
        out.sum().backward()
        return wire.sent, rank.sent_bytes - before, wire.bytes

    for r, (sent, counted, on_wire) in enumerate(LoopbackGroup(world_size).run(body)):
        # rows this rank sent at step s: what rank r + s received from it
        to = {s: model[(r + s) % world_size][s] for s in range(1, world_size)}
        back = {s: model[r][s] for s in range(1, world_size)}  # dK/dV partials of what it held
        expected = sorted([(s, (1, to[s], kv_heads, d)) for s in to if to[s]] * 2  # forward K, V
                          # backward's K/V again: the ring kept its last step's shard, the all-gather none
                          + [(s, (1, to[s], kv_heads, d)) for s in to
                             if to[s] and (cp_comm_type == "all_gather" or s < world_size - 1)] * 2
                          + [(-s, (1, back[s], kv_heads, d)) for s in back if back[s]] * 2)
        assert sorted((hop, shape) for hop, shape, _ in sent) == expected
        assert counted == on_wire  # the transport's counter: exactly the bytes handed to it


def test_a_step_with_nothing_needed_sends_nothing():
    # contiguous, documents that never cross a shard boundary: no K/V travel at all
    world_size = 4
    lengths = [8, 8, 4, 12, 16, 16]
    total, cu = sum(lengths), cu_seqlens_from_lengths(lengths)
    assert traffic_model("contiguous", True, total, world_size, cu) == [[0] * 4] * 4
    lay = cpa.get_layout("contiguous")
    x = torch.randn(1, total, 2, 8, dtype=torch.float64)

    def body(rank):
        wire = _Wire(rank)
        xl = lay.shard(x, 1, rank.rank, world_size, cu).requires_grad_()
        cpa.ring_attention(xl, xl, xl, group=wire, layout=lay, cu_seqlens=cu).sum().backward()
        return wire.sent
    assert LoopbackGroup(world_size).run(body) == [[]] * world_size


def test_whole_shards_when_needs_only_is_off():
    world_size, n = 3, 6
    x = torch.randn(1, n * world_size, 2, 8, dtype=torch.float64)
    lay = cpa.get_layout("contiguous")

    def body(rank):
        wire = _Wire(rank)
        plan = cpa.plan(lay, wire)
        plan.needs_only = False
        cpa.ring_attention(lay.shard(x, 1, rank.rank, world_size), lay.shard(x, 1, rank.rank, world_size),
                           lay.shard(x, 1, rank.rank, world_size), plan=plan)
        return [shape[1] for _, shape, _ in wire.sent]
    assert LoopbackGroup(world_size).run(body) == [[n] * 4] * world_size


def test_plan_needs_index_is_built_once_and_skips_world_size_1():
    plan = AttentionPlan("zigzag", _Seat(1, 4), True, (0, 5, 16), (-1, -1), agreed=True)
    first = plan.needs_index(4, torch.device("cpu"), 4)
    assert plan.needs_index(4, torch.device("cpu"), 4) is first and len(first) == 4 and first[0] is None
    assert AttentionPlan("zigzag", _Seat(0, 1), True, None, (-1, -1)).needs_index(4, torch.device("cpu"), 1) == ()


def _assert_exact(errors: dict) -> None:
    bad = {k: v for k, v in errors.items() if v > 0}
    assert not bad, f"beyond tolerance: {bad}"


def _exact_cases():
    rng = random.Random(35)
    cases = []
    for world_size in (2, 3, 5, 8):
        for i, layout in enumerate(LAYOUTS):
            local = 12
            total = local * world_size
            giant = total // 2 + 3  # a document longer than T/2, ones of 1 token, and a mix
            room, rest = total - giant - 2, []
            while room > 6:
                rest.append(rng.randint(1, 5))
                room -= rest[-1]
            lengths = [1, giant, 1] + rest + ([room] if room else [])
            comm = ("p2p", "all_gather")[(i + world_size) % 2]
            window = ((-1, -1), (7, -1))[i % 2]
            cases.append((world_size, layout, comm, lengths, window, i % 2 == 0))
    return cases


@pytest.mark.parametrize("world_size,layout,cp_comm_type,lengths,window,sinks", _exact_cases())
def test_needs_only_is_exact(world_size, layout, cp_comm_type, lengths, window, sinks):
    # fp64 within 1e-10: out, LSE, dq, dk, dv and the sinks' gradient, GQA (4 query heads on 2 K/V heads)
    _assert_exact(loopback_errors(world_size, layout=layout, causal=True, local_len=12, lengths=lengths,
                                  window=window, cp_comm_type=cp_comm_type, sinks=sinks, kernel="math",
                                  lse_grad=True))


@pytest.mark.parametrize("cp_comm_type,world_size,mesh", [("a2a", 2, None), ("a2a+p2p", 4, (2, 2))])
def test_the_all_to_all_strategies_stay_exact_with_balanced(cp_comm_type, world_size, mesh):
    _assert_exact(loopback_errors(world_size, layout="balanced", causal=True, local_len=12,
                                  lengths=[1, 6 * world_size + 1, 2, 6 * world_size - 4], cp_comm_type=cp_comm_type,
                                  mesh_shape=mesh, kernel="math", sinks=True))
