"""Schedules against a mask oracle: every allowed (query, key) pair exactly once, nothing else."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cp_attention as cpa
from cp_attention.schedules import BlockTask, source_rank, task_pairs


def coverage(layout: str, causal: bool, seq_len: int, n: int) -> torch.Tensor:
    """How often each global (query, key) pair is computed by the union of all ranks' tasks."""
    lay = cpa.get_layout(layout)
    local = seq_len // n
    pos = [lay.positions(seq_len, r, n) for r in range(n)]
    counts = torch.zeros(seq_len, seq_len, dtype=torch.int64)
    for r in range(n):
        for s, tasks in enumerate(cpa.rank_steps(layout, causal, r, n, local)):
            j = source_rank(r, n, s)
            for t in tasks:
                assert t.q_stop > t.q_start and t.kv_stop > t.kv_start, f"empty task {t}"
                qi = torch.arange(t.q_start, t.q_stop)[:, None]
                ki = torch.arange(t.kv_start, t.kv_stop)[None, :]
                # top-left triangle of the sliced block
                keep = (ki - t.kv_start <= qi - t.q_start) if t.causal else torch.ones_like(qi * ki, dtype=bool)
                qg = pos[r][qi.expand_as(keep)][keep]
                kg = pos[j][ki.expand_as(keep)][keep]
                counts.index_put_((qg, kg), torch.ones_like(qg), accumulate=True)
    return counts


def allowed(seq_len: int, causal: bool) -> torch.Tensor:
    if not causal:
        return torch.ones(seq_len, seq_len, dtype=torch.int64)
    return torch.ones(seq_len, seq_len, dtype=torch.int64).tril()


@pytest.mark.parametrize("layout", cpa.LAYOUT_NAMES)
@pytest.mark.parametrize("causal", (True, False))
@pytest.mark.parametrize("n", range(1, 9))
@pytest.mark.parametrize("multiple", (1, 2, 3, 5))
def test_every_allowed_pair_exactly_once(layout, causal, n, multiple):
    seq_len = multiple * cpa.get_layout(layout).divisor(n)
    assert torch.equal(coverage(layout, causal, seq_len, n), allowed(seq_len, causal))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(cpa.LAYOUT_NAMES), st.booleans(), st.integers(1, 24), st.integers(1, 4))
def test_every_allowed_pair_exactly_once_hypothesis(layout, causal, n, multiple):
    seq_len = multiple * cpa.get_layout(layout).divisor(n)
    assert torch.equal(coverage(layout, causal, seq_len, n), allowed(seq_len, causal))


def test_task_pairs_counts_the_top_left_triangle():
    for a in range(1, 7):
        for b in range(1, 7):
            mask = torch.ones(a, b).tril()
            assert task_pairs(BlockTask(0, a, 0, b, True)) == int(mask.sum())
            assert task_pairs(BlockTask(0, a, 0, b, False)) == a * b


@pytest.mark.parametrize("n", (2, 3, 4, 8, 16, 128))
def test_work_model_closed_forms(n):
    local = 64
    seq = n * local
    total = seq * (seq + 1) // 2
    for layout in cpa.LAYOUT_NAMES:
        work = cpa.work_model(layout, True, seq, n)
        assert sum(map(sum, work)) == total
        assert all(len(row) == n for row in work)
    # contiguous: rank r computes r full blocks plus its diagonal triangle
    contiguous = [sum(row) for row in cpa.work_model("contiguous", True, seq, n)]
    assert contiguous == [r * local * local + local * (local + 1) // 2 for r in range(n)]
    imbalance = max(contiguous) / (sum(contiguous) / n)
    assert imbalance == pytest.approx((2 * n - 1) / n, rel=2 / local)
    # zigzag: perfectly balanced
    zigzag = [sum(row) for row in cpa.work_model("zigzag", True, seq, n)]
    assert max(zigzag) == min(zigzag)
    # interleaved: r + 1 causal triangles (j <= r) and N - 1 - r shifted ones (j > r)
    inter = [sum(row) for row in cpa.work_model("interleaved", True, seq, n)]
    assert inter == [(r + 1) * local * (local + 1) // 2 + (n - 1 - r) * local * (local - 1) // 2
                     for r in range(n)]
    assert max(inter) / (sum(inter) / n) == pytest.approx(1.0, abs=n / local)
    # non-causal: every rank, every step, a full block
    assert cpa.work_model("interleaved", False, seq, n) == [[local * local] * n] * n


def test_dispatcher():
    from cp_attention.schedules.causal import contiguous_schedule, interleaved_schedule, zigzag_schedule
    assert cpa.get_schedule("striped") is interleaved_schedule
    assert cpa.get_schedule("dualchunkswap") is zigzag_schedule
    assert cpa.get_schedule(cpa.ContiguousLayout()) is contiguous_schedule
    with pytest.raises(ValueError, match="unknown layout"):
        cpa.get_schedule("diagonal")
    with pytest.raises(ValueError, match="divisible"):
        cpa.work_model("zigzag", True, 12, 4)
