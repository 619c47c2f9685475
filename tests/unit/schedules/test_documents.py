"""The packed-document schedule against a mask oracle: every (query, key) pair of the same document
(and causal where asked) is computed exactly once over all ranks and steps, nothing else; the same
for the plain-task split, the work model and the engine's batches."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cp_attention as cpa
from cp_attention.layouts.documents import cu_seqlens_from_lengths, document_ids, pad_cu_seqlens
from cp_attention.schedules import (
    BatchSpec,
    BlockTask,
    DocBlock,
    block_schedules,
    doc_block_pairs,
    lower_steps,
    source_rank,
    split_doc_block,
    task_pairs,
)
from cp_attention.schedules.lowering import SMALL_BLOCK


def _doc_steps(layout, causal, rank, n, cu):
    """One rank's document blocks per step (built with every rank's)."""
    cu = tuple(cu)
    return block_schedules(cpa.get_layout(layout), causal, n, cu[-1], cu, None)[rank]


def _cu(lengths, layout, n):
    return pad_cu_seqlens(cu_seqlens_from_lengths(lengths), cpa.get_layout(layout).divisor(n))[0]


def _block_mask(b: DocBlock) -> torch.Tensor:
    i = torch.arange(b.q_len)[:, None]
    c = torch.arange(b.kv_len)[None, :]
    return torch.ones(b.q_len, b.kv_len, dtype=torch.bool) if b.diag is None else c <= i + b.diag


def _task_mask(t: BlockTask) -> torch.Tensor:
    a, w = t.q_stop - t.q_start, t.kv_stop - t.kv_start
    return torch.ones(a, w, dtype=torch.bool).tril() if t.causal else torch.ones(a, w, dtype=torch.bool)


def _count(counts, q_pos, k_pos, q0, k0, keep):
    qg = q_pos[q0: q0 + keep.shape[0]][:, None].expand_as(keep)[keep]
    kg = k_pos[k0: k0 + keep.shape[1]][None, :].expand_as(keep)[keep]
    counts.index_put_((qg, kg), torch.ones_like(qg), accumulate=True)


def coverage(layout: str, causal: bool, n: int, cu) -> tuple[torch.Tensor, torch.Tensor]:
    """How often each global pair is computed: by the DocBlocks, and by their plain-task split."""
    lay = cpa.get_layout(layout)
    total = cu[-1]
    pos = [lay.positions(total, r, n, cu_seqlens=cu) for r in range(n)]
    blocks = torch.zeros(total, total, dtype=torch.int64)
    tasks = torch.zeros_like(blocks)
    for r in range(n):
        for s, step in enumerate(_doc_steps(layout, causal, r, n, cu)):
            j = source_rank(r, n, s)
            for b in step:
                keep = _block_mask(b)
                assert keep[0].any() and keep[-1, -1], f"a trimmed block's first row and last key are used: {b}"
                assert int(keep.sum()) == doc_block_pairs(b)
                _count(blocks, pos[r], pos[j], b.q_start, b.kv_start, keep)
                split = split_doc_block(b)
                assert len(split) <= 2 and sum(task_pairs(t) for t in split) == doc_block_pairs(b)
                for t in split:
                    _count(tasks, pos[r], pos[j], t.q_start, t.kv_start, _task_mask(t))
    return blocks, tasks


def allowed(cu, causal: bool) -> torch.Tensor:
    doc = document_ids(cu)
    same = (doc[:, None] == doc[None, :]).long()
    return same.tril() if causal else same


DOCS = st.one_of(st.lists(st.integers(1, 3), min_size=1, max_size=30), st.lists(st.integers(1, 40), max_size=6,
                                                                                  min_size=1))


@settings(max_examples=150, deadline=None)
@given(layout=st.sampled_from(cpa.LAYOUT_NAMES), causal=st.booleans(), n=st.integers(1, 6), lengths=DOCS)
def test_every_allowed_pair_exactly_once(layout, causal, n, lengths):
    cu = _cu(lengths, layout, n)
    blocks, tasks = coverage(layout, causal, n, cu)
    want = allowed(cu, causal)
    assert torch.equal(blocks, want)
    assert torch.equal(tasks, want)


@pytest.mark.parametrize("layout", cpa.LAYOUT_NAMES)
def test_work_model_counts_document_pairs(layout):
    cu = _cu([1, 7, 30, 2, 90, 5], layout, 4)
    work = cpa.work_model(layout, True, cu[-1], 4, cu_seqlens=cu)
    assert sum(map(sum, work)) == int(allowed(cu, True).sum())
    assert cpa.work_model(layout, True, 64, 4, cu_seqlens=[0, 64]) == cpa.work_model(layout, True, 64, 4)


def test_zigzag_balances_every_document_at_every_step():
    """Per document, zigzag gives each rank the same causal work up to the remainder tokens."""
    cu = _cu([1000, 37, 512, 3, 129], "zigzag", 4)
    work = torch.tensor(cpa.work_model("zigzag", True, cu[-1], 4, cu_seqlens=cu), dtype=torch.float64)
    totals = work.sum(1)
    assert float(totals.max() / totals.mean()) < 1.01, totals


@pytest.mark.parametrize("layout", cpa.LAYOUT_NAMES)
def test_engine_batches_cover_each_block_once(layout):
    """lower_steps: short blocks in padded batches, a short document's step-0 block folded into its
    first later block when that one is short too, long ones as plain tasks; nothing lost or doubled."""
    cu = _cu([1, 3, 600, 17, 2, 64, 300, 5], layout, 3)
    key = lambda b: (b.q_start, b.kv_start)  # noqa: E731
    folds = 0
    for r in range(3):
        blocks = _doc_steps(layout, True, r, 3, cu)
        steps = lower_steps(blocks, batched=True, tiled=True, local_len=cu[-1] // 3)
        ran = [[] for _ in blocks]  # per step, the blocks the tasks compute
        for s, tasks in enumerate(steps):
            batches = [t for t in tasks if isinstance(t, BatchSpec)]
            assert len(batches) + sum(isinstance(t, BlockTask) for t in tasks) == len(tasks)
            plain = [t for t in tasks if isinstance(t, BlockTask)]
            big = [b for b in blocks[s] if max(b.q_len, b.kv_len) > SMALL_BLOCK]
            assert plain == [t for b in big for t in split_doc_block(b)]
            ran[s] += big
            for t in batches:
                assert t.first == (s == 0 or bool(t.folds)), "step 0 and folds write their rows; the rest merge"
                ran[s] += t.blocks
                for home, later in t.folds:
                    ran[0].append(home)
                    ran[s].append(later)
                    assert home.q_start <= later.q_start and later.q_stop <= home.q_stop, "the same document"
                    assert not any(b.q_start < home.q_stop and home.q_start < b.q_stop
                                   for step in blocks[1:s] for b in step), \
                        "a fold is the document's first block after step 0"
                    folds += 1
                assert all(max(b.q_len, b.kv_len) <= SMALL_BLOCK for b in (*t.blocks, *(x for f in t.folds for x in f)))
        for s in range(len(blocks)):
            assert sorted(ran[s], key=key) == sorted(blocks[s], key=key)
    assert folds > 0 or layout in ("contiguous", "balanced")  # these keep short documents whole
