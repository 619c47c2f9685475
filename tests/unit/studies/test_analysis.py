"""The layout comparison's arithmetic (studies/layout_comparison/analysis.py): the summaries against the
work model's closed forms, the mask pictures' pair owners, the split problems and the cluster projection
(by hand)."""

from __future__ import annotations

import pytest

import cp_attention as cpa
from benchmarks.modelled import AttentionShape
from studies.layout_comparison.analysis import ClusterSpec, pair_owners, project, split_problem, summarize

# ---------------------------------------------------------------- summaries and splits

@pytest.mark.parametrize("layout", cpa.LAYOUT_NAMES)
@pytest.mark.parametrize("causal", (True, False))
def test_no_redundant_pairs_and_non_causal_is_balanced(layout, causal):
    seq, n_ranks = 96, 4
    s = summarize(cpa.work_model(layout, causal, seq, n_ranks), seq, causal)
    assert s.redundant_fraction == 0 and s.total_pairs == s.min_pairs
    if not causal:
        assert s.imbalance == 1.0 and s.step_sync_efficiency == 1.0 and s.idle_fraction == 0


def test_summary_idle_fraction_on_a_hand_matrix():
    s = summarize([[3, 0], [3, 4]], 4, True)
    assert s.idle_fraction == pytest.approx((2 * 7 - 10) / 10)


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


# ---------------------------------------------------------------- projection

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
    p = project(work, 8, shape, cluster, ring_length=steps)  # 16-byte hops over 16 B/s: 1 s each
    assert (p.fwd_overlap_s, p.fwd_serial_s) == pytest.approx((3 + 1, 3 + 1 + 1))  # one K/V hop, not three
    assert (p.bwd_overlap_s, p.bwd_serial_s) == pytest.approx((7.5 + 2.5, 8.5 + 2.5))  # dK/dV home during step 0
    with pytest.raises(ValueError, match="do not run"):
        project(work, 8, shape, cluster, ring_length=1)
    full = project(cpa.work_model("contiguous", True, 8, 4), 8, shape, cluster)
    assert full.fwd_serial_s == pytest.approx(3 + 4 + 4 + 4 + 3)  # every step runs: N-1 hops
