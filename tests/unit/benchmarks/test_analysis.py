"""The analysis module's arithmetic: closed forms of the work model, the metrics, the communication
bytes and the cluster projection (by hand)."""

from __future__ import annotations

from fractions import Fraction

import pytest

import cp_attention as cpa
from benchmarks.layout_comparison.analysis import (
    AttentionShape, ClusterSpec, comm_bytes_per_rank, flops_per_pair, imbalance, kv_bytes_per_hop, pair_owners,
    project, split_problem, step_sync_efficiency, summarize,
)


def contiguous_imbalance(seq_len: int, n_ranks: int) -> Fraction:
    """Closed form: causal contiguous rank r computes r·n² + n(n+1)/2 score pairs."""
    n = seq_len // n_ranks
    per_rank = [r * n * n + n * (n + 1) // 2 for r in range(n_ranks)]
    return Fraction(max(per_rank) * n_ranks, sum(per_rank))


# ---------------------------------------------------------------- analysis: closed forms

@pytest.mark.parametrize("n_ranks", (1, 2, 3, 8, 32, 128))
def test_contiguous_matches_the_closed_form(n_ranks):
    seq = 1024 * n_ranks
    work = cpa.work_model("contiguous", True, seq, n_ranks)
    n = seq // n_ranks
    assert [sum(row) for row in work] == [r * n * n + n * (n + 1) // 2 for r in range(n_ranks)]
    assert imbalance(work) == pytest.approx(float(contiguous_imbalance(seq, n_ranks)), rel=1e-12)
    assert imbalance(work) == pytest.approx((2 * n_ranks - 1) / n_ranks, rel=1e-3)  # long sequences
    # Each step costs a full block on the last rank, the diagonal step a triangle: N/(2N-1) in the limit.
    assert step_sync_efficiency(work) == pytest.approx(n_ranks / (2 * n_ranks - 1), rel=1e-3)


@pytest.mark.parametrize("n_ranks", (1, 2, 3, 8, 128))
def test_zigzag_is_balanced_at_every_step(n_ranks):
    work = cpa.work_model("zigzag", True, 4 * n_ranks * 7, n_ranks)
    assert all(len(set(col)) == 1 for col in zip(*work))
    assert imbalance(work) == 1.0 and step_sync_efficiency(work) == 1.0


@pytest.mark.parametrize("n_ranks,seq", ((2, 16), (4, 64), (8, 1024), (128, 1 << 14)))
def test_interleaved_efficiency_closed_form(n_ranks, seq):
    n = seq // n_ranks
    work = cpa.work_model("interleaved", True, seq, n_ranks)
    assert step_sync_efficiency(work) == pytest.approx((n_ranks * n + 1) / (n_ranks * (n + 1)), rel=1e-12)


@pytest.mark.parametrize("layout", cpa.LAYOUT_NAMES)
@pytest.mark.parametrize("causal", (True, False))
def test_no_redundant_pairs_and_non_causal_is_balanced(layout, causal):
    seq, n_ranks = 96, 4
    s = summarize(cpa.work_model(layout, causal, seq, n_ranks), seq, causal)
    assert s.redundant_fraction == 0 and s.total_pairs == s.min_pairs
    if not causal:
        assert s.imbalance == 1.0 and s.step_sync_efficiency == 1.0 and s.idle_fraction == 0


def test_metrics_on_a_hand_matrix():
    work = [[1, 0], [1, 2]]  # ideal 2 per rank; the steps cost 1 + 2
    assert imbalance(work) == pytest.approx(1.5)
    assert step_sync_efficiency(work) == pytest.approx(2 / 3)
    s = summarize([[3, 0], [3, 4]], 4, True)
    assert s.idle_fraction == pytest.approx((2 * 7 - 10) / 10)
    for bad in ([], [[]], [[1, 2], [3]]):
        with pytest.raises(ValueError, match="rank x step matrix"):
            imbalance(bad)
    with pytest.raises(ValueError, match="zero total work"):
        step_sync_efficiency([[0, 0], [0, 0]])


@pytest.mark.parametrize("layout", cpa.LAYOUT_NAMES)
@pytest.mark.parametrize("causal", (True, False))
def test_pair_owners_cover_the_mask_once(layout, causal):
    seq, n_ranks = 24, 3 if layout != "zigzag" else 2
    pairs = pair_owners(layout, causal, seq, n_ranks)
    got = sorted((q, k) for q, k, _, _ in pairs)
    assert got == sorted((q, k) for q in range(seq) for k in range(seq) if k <= q or not causal)
    pos = [cpa.get_layout(layout).positions(seq, r, n_ranks).tolist() for r in range(n_ranks)]
    assert all(q in pos[r] and k in pos[(r - s) % n_ranks] for q, k, r, s in pairs)


def test_split_problem_names_the_divisor():
    assert split_problem("zigzag", 16, 4) is None
    assert "divisible by 2*world_size=6" in split_problem("zigzag", 16, 3)


# ---------------------------------------------------------------- analysis: communication and projection

def test_comm_bytes_follow_the_engine():
    shape = AttentionShape(batch=2, heads=8, kv_heads=2, head_dim=64, v_head_dim=32, elem_bytes=2)
    hop = 2 * 256 * 2 * (64 + 32) * 2
    assert kv_bytes_per_hop(1024, 4, shape) == hop
    # Backward: K/V N-2 hops (it starts with the shard the forward held last), dK/dV in fp32 N-1 hops
    # (a rank's own contribution stays home).
    assert comm_bytes_per_rank(1024, 4, shape) == (3 * hop, 2 * hop + 3 * 2 * hop)
    assert comm_bytes_per_rank(1024, 1, shape) == (0, 0)
    # A ring cut short by a window (L of N steps): L-1 hops of K/V forward, L-2 back, L-1 of dK/dV.
    assert comm_bytes_per_rank(1024, 4, shape, ring_steps=2) == (hop, 2 * hop)
    assert comm_bytes_per_rank(1024, 4, shape, ring_steps=3) == (2 * hop, hop + 2 * 2 * hop)
    assert comm_bytes_per_rank(1024, 4, shape, ring_steps=1) == (0, 0)
    d128 = AttentionShape(head_dim=128)
    assert flops_per_pair(d128, True) == 2.5 * flops_per_pair(d128, False)


def test_projection_by_hand():
    # S=4 over N=2, contiguous: work [[3, 0], [3, 4]]. Every number is chosen so a pair or a hop takes 1 s:
    # 16-byte hops over 16 B/s, forward 4 flops per pair at 4 flop/s, backward 10 flops per pair.
    shape = AttentionShape(batch=1, heads=1, kv_heads=1, head_dim=1, elem_bytes=4)
    cluster = ClusterSpec("toy", link_gbytes_per_s=16e-9, link_latency_us=0.0, attention_tflops=4e-12)
    work = cpa.work_model("contiguous", True, 4, 2)
    assert work == [[3, 0], [3, 4]]
    p = project(work, 4, shape, cluster)
    assert (p.fwd_overlap_s, p.fwd_serial_s) == pytest.approx((3 + 4, 3 + 1 + 4))
    # Backward runs step 1 first (no K/V hop: the forward's last shard is kept); its accumulator goes
    # home while step 0 computes, and step 0's dK/dV stay home.
    assert (p.bwd_overlap_s, p.bwd_serial_s) == pytest.approx((10 + 7.5, 10 + 8.5))
    assert (p.ideal_fwd_s, p.ideal_bwd_s) == pytest.approx((5, 12.5))
    assert p.slowest_fwd_step_s == pytest.approx(4) and p.comm_bound_steps == 0
    assert p.efficiency_overlap == pytest.approx(17.5 / 24.5)


def test_projection_regimes():
    shape = AttentionShape(heads=32, kv_heads=8, head_dim=128, elem_bytes=2)
    cluster = ClusterSpec()
    seq, n = 1 << 20, 128
    zig = project(cpa.work_model("zigzag", True, seq, n), seq, shape, cluster)
    con = project(cpa.work_model("contiguous", True, seq, n), seq, shape, cluster)
    assert zig.comm_bound_steps == 0 and zig.efficiency_overlap > 0.99  # long sequence: compute hides the hops
    assert con.efficiency_overlap == pytest.approx(n / (2 * n - 1), rel=0.01)
    assert zig.efficiency_serial < zig.efficiency_overlap
    short = project(cpa.work_model("zigzag", True, 1 << 15, n), 1 << 15, shape, cluster)
    assert short.comm_bound_steps == n - 1  # short sequence: every hop outlasts its step's compute
    with pytest.raises(ValueError, match="positive bandwidth"):
        ClusterSpec(link_gbytes_per_s=0)


def test_projection_counts_only_the_ring_steps_that_run():
    # S=8 over N=4, contiguous, W=2 (HF's sliding_window=2: left=1): rank r needs only rank r-1's last key.
    shape = AttentionShape(batch=1, heads=1, kv_heads=1, head_dim=1, elem_bytes=4)
    cluster = ClusterSpec("toy", link_gbytes_per_s=16e-9, link_latency_us=0.0, attention_tflops=4e-12)
    work = cpa.work_model("contiguous", True, 8, 4, window_size=(1, 0))
    steps = cpa.ring_length("contiguous", True, 8, 4, (1, 0))
    assert steps == 2 and work == [[3, 0, 0, 0], [3, 1, 0, 0], [3, 1, 0, 0], [3, 1, 0, 0]]
    p = project(work, 8, shape, cluster, ring_steps=steps)  # 16-byte hops over 16 B/s: 1 s each
    assert (p.fwd_overlap_s, p.fwd_serial_s) == pytest.approx((3 + 1, 3 + 1 + 1))  # one K/V hop, not three
    assert (p.bwd_overlap_s, p.bwd_serial_s) == pytest.approx((7.5 + 2.5, 8.5 + 2.5))  # dK/dV home during step 0
    with pytest.raises(ValueError, match="do not run"):
        project(work, 8, shape, cluster, ring_steps=1)
    full = project(cpa.work_model("contiguous", True, 8, 4), 8, shape, cluster)
    assert full.fwd_serial_s == pytest.approx(3 + 4 + 4 + 4 + 3)  # every step runs: N-1 hops
