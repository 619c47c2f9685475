"""The layout comparison's per-batch figures (studies/layout_comparison/traffic.py, balance.py):
needs-only bytes of a hand-worked batch, whole shards against the analysis' per-rank closed form,
kernel calls of a hand-worked plan, the batches' packing, and "balanced" in the tables."""

from __future__ import annotations

import pytest

from benchmarks.modelled import AttentionShape, comm_bytes_per_rank
from studies.layout_comparison import balance
from studies.layout_comparison.traffic import (
    Batch,
    batch_figures,
    corpus_batches,
    giant_batch,
    kernel_calls,
    lognormal_batch,
    model_bytes,
    stdlib_lengths,
    training_bytes,
)

SHAPE = AttentionShape(batch=1, heads=4, kv_heads=2, head_dim=16, v_head_dim=8, elem_bytes=2)
ROW, ACC = 2 * 24 * 2, 2 * 24 * 4  # a K/V row (2 heads, D + Dv = 24, bf16) and its fp32 dK/dV partial


def test_needs_only_bytes_of_a_hand_worked_batch():
    """T = 16, N = 2, documents [0, 8) and [8, 16), causal. Zigzag cuts each document into 4 chunks of 2:
    rank 0 holds 0-1, 6-7, 8-9, 14-15 and needs all of rank 1's 2-5, 10-13; rank 1 needs 0-1 and 8-9
    only. 12 rows travel forward and 12 partials go home (N = 2: backward resends no K/V); whole
    shards would move 16 of each. Contiguous holds each document on one rank: nothing travels."""
    assert model_bytes("zigzag", 16, 2, SHAPE, (0, 8, 16)) == (12 * ROW + 12 * ACC, 16 * ROW + 16 * ACC)
    assert model_bytes("contiguous", 16, 2, SHAPE, (0, 8, 16))[0] == 0
    # N = 3 by hand: rank r receives rows[r][s]; backward resends all but the last step's K/V
    rows = [[0, 2, 1], [0, 0, 3], [0, 4, 0]]
    assert training_bytes(rows, SHAPE) == (10 + 6) * ROW + 10 * ACC


@pytest.mark.parametrize("world", [2, 3, 5])
def test_whole_shards_match_the_engines_per_rank_bytes(world):
    """Whole shards: N times the analysis' per-rank (forward, backward) bytes of the same ring."""
    total = 6 * world
    fwd, bwd = comm_bytes_per_rank(total, world, SHAPE)
    assert model_bytes("zigzag", total, world, SHAPE)[1] == world * (fwd + bwd)


def test_kernel_calls_of_a_hand_worked_plan():
    """Contiguous, documents [0, 8) and [8, 16) at N = 2: each rank runs its own document at step 0 (one
    varlen call) and nothing at step 1: 2 calls over 2 ranks x 2 steps."""
    calls = kernel_calls("contiguous", (0, 8, 16), 2)
    assert calls["varlen"] == (0.5, 1)
    zig = kernel_calls("zigzag", (0, 8, 16), 2)["varlen"]
    assert zig[0] >= 1  # every step of every rank meets both documents


def test_batches_pack_every_token():
    lengths = [5, 3, 9, 2]
    found = corpus_batches(lengths, 4, 10, seed=1)
    assert len(found) == 4 and all(b.tokens == 4 for b in found)  # 19 tokens: 4 whole batches, the rest dropped
    pieces = [b - a for batch in found for a, b in zip(batch.cu_seqlens, batch.cu_seqlens[1:])]
    assert sum(pieces) == 16 and max(pieces) <= 4
    g = giant_batch(4096, 0)
    assert g.tokens == 4096 and g.longest == round(0.6 * 4096)
    assert lognormal_batch(4096, 3).tokens == 4096
    what, corpus = stdlib_lengths()
    assert len(corpus) > 100 and min(corpus) >= 1 and "py" in what


def test_balanced_is_in_the_tables():
    """Every layout's record, balanced included, at N = 2; its bytes never above whole shards."""
    b = Batch("hand", "0", (0, 8, 16, 20, 64))
    rows = [batch_figures(lay, b, 2, SHAPE) for lay in balance.LAYOUTS]
    assert [r["layout"] for r in rows] == list(balance.LAYOUTS)
    assert all(r["bytes_needs"] <= r["bytes_whole"] and r["imbalance"] >= 1.0 for r in rows)
    table = balance.summary_rows(rows, balance.LAYOUTS)
    assert [r[2] for r in table] == list(balance.LAYOUTS)
    assert "balanced" in balance.markdown(rows, balance.LAYOUTS, "hand")


def test_packed_bytes_section_shares():
    """The report's bytes table: needs-only over whole shards and over zigzag's, per N and layout."""
    rows = [{"seed": 0, "layout": lay, "world_size": 2, "kv_dkv_bytes_needs_only": needs, "kv_dkv_bytes_whole": 100}
            for lay, needs in (("zigzag", 75), ("balanced", 15))]
    text = balance.packed_bytes_section(rows, ["zigzag", "balanced"])
    assert "| 2 | 75% / 100% | 15% / 20% |" in text
