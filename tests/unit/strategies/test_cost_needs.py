"""The cost model's needs and exact packed work (strategies/batch_model.py): its needs against the
engine's (schedules.needs.rank_needs, per key), its pairs per rank against the work model, a hand-worked
batch, and the ring time it keeps where there is nothing to save. (That the bytes are what the
execution sends is test_cost.py's test_bytes_follow_the_execution.)"""

from __future__ import annotations

import random

import pytest

from cp_attention.schedules.needs import rank_needs
from cp_attention.schedules.windows import normalize_window
from cp_attention.schedules.work import work_model
from cp_attention.strategies import batch_model, cost
from cp_attention.strategies.cost import HARDWARE, Workload, estimate


def _batches(seed: int, count: int):
    rng = random.Random(seed)
    for _ in range(count):
        world = rng.choice([2, 3, 4])
        total = 2 * world * rng.choice([3, 7])
        cuts = sorted(rng.sample(range(1, total), rng.randint(0, min(6, total - 1))))
        cu = tuple([0, *cuts, total]) if rng.random() < 0.8 else None
        window = rng.choice([(5, 0), (3, 7), (-1, 4)]) if rng.random() < 0.25 else (-1, -1)  # windows: slow to model
        yield world, total, cu, rng.random() < 0.7, window


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "interleaved", "balanced"])
def test_rows_and_pairs_match_the_schedules(layout):
    """step_needs (per document and rank without a window) equals the rows the engine receives (per
    key, every step); rank_pair_totals (per query) equals the work model's blocks summed over the steps."""
    for world, total, cu, causal, window in _batches(sum(map(ord, layout)), 10):
        rows = batch_model.step_needs(layout, causal, window, total, world, cu)
        norm = normalize_window(window, causal, total, cu)
        engine = [[0] + [r.recv.numel() for r in rank_needs(layout, causal, world, total, cu, norm, rank, world)[1:]]
                  for rank in range(world)]
        assert [list(r) for r in rows] == engine
        work = work_model(layout, causal, total, world, cu_seqlens=cu, window_size=window)
        assert list(batch_model.rank_pair_totals(layout, causal, window, total, world, cu)) == [sum(r) for r in work]


def test_a_hand_worked_batch():
    """T = 16, N = 2, documents [0, 8) and [8, 16), causal. Zigzag cuts each document into 4 chunks:
    rank 0 holds 0-1, 6-7, 8-9, 14-15; rank 1 2-5, 10-13. Rank 0 needs all 8 of rank 1's rows (its
    queries 6-7 and 14-15 follow them); rank 1 needs 0-1 and 8-9, not 6-7 or 14-15: 4 of 8. So rank 0
    sends 4 K/V rows and 8 dK/dV partials home, rank 1 8 and 4. Contiguous keeps both documents
    whole: nothing travels."""
    hw = HARDWARE["h100"]
    kv, acc = 2 * (16 + 8) * 2, 2 * (16 + 8) * 4  # a row: 2 K/V heads, D = 16, Dv = 8, bf16; fp32 partials
    for backward in (False, True):
        w = Workload(2, 1, 16, 4, 2, 16, 8, 2, True, (-1, -1), (0, 8, 16), "zigzag", 1, backward)
        ring = estimate(w, "p2p", hw)
        want = (4 * kv + 8 * acc, 8 * kv + 4 * acc) if backward else (4 * kv, 8 * kv)  # N = 2: no K/V resent
        assert ring.extra["rank_bytes"] == want and ring.comm_bytes == max(want)
        critical = 8 * kv + 8 * acc * backward  # step 1: rank 0 receives 8 rows, rank 1 8 partials
        assert ring.extra["critical_bytes"] == critical
        assert ring.comm_s == pytest.approx(critical / hw.intra_bw + (2 if backward else 1) * hw.latency_s)
        gathered = estimate(w, "all_gather", hw).extra["rank_bytes"]  # backward gathers again
        assert gathered == ((8 * kv + 8 * acc, 16 * kv + 4 * acc) if backward else want)
        alone = estimate(Workload(2, 1, 16, 4, 2, 16, 8, 2, True, (-1, -1), (0, 8, 16), "contiguous", 1, backward),
                         "p2p", hw)
        assert alone.comm_bytes == 0 and alone.comm_s == 0 and alone.exposed_comm_s == 0
        whole = estimate(w, "p2p", hw, needs_only=False)  # the plan's needs_only off: 8 rows each way
        assert whole.comm_bytes == 8 * kv + 8 * acc * backward and not whole.extra["needs_only"]


def test_one_sequence_keeps_the_ring_time():
    """Causal zigzag on one sequence: some rank needs a whole shard at every step, so the ring's
    critical bytes (and time) are the whole shards' of before, while the ranks send less."""
    w = Workload(8, 1, 8 * 1024, 32, 8, 128, 128, 2)
    est = estimate(w, "p2p", HARDWARE["h100"])
    own = 1024 * 8 * 256 * 2
    assert est.extra["critical_bytes"] == 7 * own + 6 * own + 7 * 2 * own
    assert est.comm_bytes < est.extra["critical_bytes"]  # the busiest rank sends less than whole shards


def test_packed_work_is_exact_for_every_layout():
    """With documents the busiest rank's share comes from the positions, for zigzag and interleaved
    too (before: counted as balanced, 1/N)."""
    cu = (0, 3, 40, 41, 96)
    for layout in ("zigzag", "interleaved", "balanced", "contiguous"):
        w = Workload(4, 1, 96, 4, 2, 8, 8, 4, True, (-1, -1), cu, layout)
        work = work_model(layout, True, 96, 4, cu_seqlens=cu)
        assert cost._busiest_share(w, 4) == pytest.approx(max(map(sum, work)) / sum(map(sum, work)), abs=1e-12)


def test_needs_only_hops_inside_a_node_use_its_links():
    """N = 16 on 8-rank nodes, contiguous, documents that never cross the node boundary (rank 7 ends at
    token 16): every needed row moves between ranks of one node, so the ring's time is at NVLink's
    bandwidth; whole shards cross nodes at every step, at InfiniBand's."""
    hw = HARDWARE["h100"]
    w = Workload(16, 1, 32, 4, 2, 16, 8, 2, True, (-1, -1), (0, 3, 16, 32), "contiguous", 1, False)
    est = estimate(w, "p2p", hw)
    steps_with_rows = sum(1 for s in range(1, 16) if any(r[s] for r in batch_model.step_needs(
        "contiguous", True, (-1, -1), 32, 16, (0, 3, 16, 32))))
    assert est.comm_s == pytest.approx(est.extra["critical_bytes"] / hw.intra_bw + steps_with_rows * hw.latency_s)
    whole = estimate(w, "p2p", hw, needs_only=False)
    assert whole.comm_s == pytest.approx(15 * 2 * 2 * 24 * 2 / hw.inter_bw + 15 * hw.latency_s)
