"""The work model's figures the benchmarks print (benchmarks/modelled.py): closed forms of the work model,
the balance metrics and the communication bytes (by hand)."""

from __future__ import annotations

from fractions import Fraction

import pytest

import cp_attention as cpa
from benchmarks.modelled import (
    AttentionShape,
    comm_bytes_per_rank,
    flops_per_pair,
    imbalance,
    kv_bytes_per_hop,
    step_sync_efficiency,
)


def contiguous_imbalance(seq_len: int, n_ranks: int) -> Fraction:
    """Closed form: causal contiguous rank r computes r·n² + n(n+1)/2 score pairs."""
    n = seq_len // n_ranks
    per_rank = [r * n * n + n * (n + 1) // 2 for r in range(n_ranks)]
    return Fraction(max(per_rank) * n_ranks, sum(per_rank))


# ---------------------------------------------------------------- closed forms

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


def test_metrics_on_a_hand_matrix():
    work = [[1, 0], [1, 2]]  # ideal 2 per rank; the steps cost 1 + 2
    assert imbalance(work) == pytest.approx(1.5)
    assert step_sync_efficiency(work) == pytest.approx(2 / 3)
    for bad in ([], [[]], [[1, 2], [3]]):
        with pytest.raises(ValueError, match="rank x step matrix"):
            imbalance(bad)
    with pytest.raises(ValueError, match="zero total work"):
        step_sync_efficiency([[0, 0], [0, 0]])


# ---------------------------------------------------------------- communication

def test_comm_bytes_follow_the_engine():
    shape = AttentionShape(batch=2, heads=8, kv_heads=2, head_dim=64, v_head_dim=32, elem_bytes=2)
    hop = 2 * 256 * 2 * (64 + 32) * 2
    assert kv_bytes_per_hop(1024, 4, shape) == hop
    # Backward: K/V N-2 hops (it starts with the shard the forward held last), dK/dV in fp32 N-1 hops
    # (a rank's own contribution stays home).
    assert comm_bytes_per_rank(1024, 4, shape) == (3 * hop, 2 * hop + 3 * 2 * hop)
    assert comm_bytes_per_rank(1024, 1, shape) == (0, 0)
    # A ring cut short by a window (L of N steps): L-1 hops of K/V forward, L-2 back, L-1 of dK/dV.
    assert comm_bytes_per_rank(1024, 4, shape, ring_length=2) == (hop, 2 * hop)
    assert comm_bytes_per_rank(1024, 4, shape, ring_length=3) == (2 * hop, hop + 2 * 2 * hop)
    assert comm_bytes_per_rank(1024, 4, shape, ring_length=1) == (0, 0)
    d128 = AttentionShape(head_dim=128)
    assert flops_per_pair(d128, True) == 2.5 * flops_per_pair(d128, False)
