"""One rank's vectorised packed steps (its blocks as columns, their lowering, the batches' index tensors)
against the former per-block implementations (``reference_steps``): the same blocks, tasks, batches
and index tensors, in the same order, for every layout, causal or not, with and without a window."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cp_attention as cpa
from cp_attention.engine.doc_batch import DocBatch
from cp_attention.engine.varlen_batch import VarlenBatch
from cp_attention.layouts.documents import cu_seqlens_from_lengths, document_ids, pad_cu_seqlens
from cp_attention.schedules import BatchSpec, BlockTask, VarlenSpec, block_schedules, normalize_window
from tests.unit.schedules import reference_steps as ref

LENGTHS = st.one_of(st.lists(st.integers(1, 12), min_size=1, max_size=40),
                    st.lists(st.integers(1, 200), min_size=1, max_size=8))


def _cu(lengths, layout, n):
    return pad_cu_seqlens(cu_seqlens_from_lengths(lengths), cpa.get_layout(layout).divisor(n))[0]


def _comparable(task):
    """A lowered task as the reference's record."""
    if isinstance(task, BatchSpec):
        return ref.Batch(task.blocks, task.folds, task.first)
    if isinstance(task, VarlenSpec):
        return ref.Varlen(task.pieces, task.causal, task.first)
    assert isinstance(task, BlockTask)
    return task


@settings(max_examples=40, deadline=None)
@given(layout=st.sampled_from(cpa.LAYOUT_NAMES), causal=st.booleans(), n=st.integers(1, 6), lengths=LENGTHS)
def test_one_ranks_blocks_match_the_per_step_reference(layout, causal, n, lengths):
    cu = _cu(lengths, layout, n)
    lay = cpa.get_layout(layout)
    positions = [lay.positions(cu[-1], r, n, cu) for r in range(n)]
    every = block_schedules(lay, causal, n, cu[-1], cu, None)
    for r in range(n):
        want = ref.rank_blocks(positions, document_ids(cu), causal, r)
        table = block_schedules(lay, causal, n, cu[-1], cu, None, rank=r)
        assert len(table) == n and tuple(table) == want
        assert every[r] == want


@settings(max_examples=30, deadline=None)
@given(layout=st.sampled_from(cpa.LAYOUT_NAMES), n=st.integers(1, 5), rank=st.integers(0, 4), lengths=LENGTHS,
       window=st.sampled_from([None, None, (3, -1), (16, 0), (40, 5)]), causal=st.booleans())
def test_lowering_and_index_tensors_match_the_reference(layout, n, rank, lengths, window, causal):
    cu = _cu(lengths, layout, n)
    lay = cpa.get_layout(layout)
    win = normalize_window(window, causal, cu[-1], cu)
    tiled = win is None
    for r in (rank % n,):
        table = block_schedules(lay, causal, n, cu[-1], cu, win, rank=r)
        step_blocks = tuple(table)
        modes = [(True, False), (False, False)] + ([(False, True)] if tiled else [])
        for batched, varlen in modes:
            got = cpa.schedules.lower_steps(table, batched=batched, tiled=tiled, local_len=cu[-1] // n, varlen=varlen)
            want = ref.lower_steps(step_blocks, batched=batched, tiled=tiled, varlen=varlen)
            assert tuple(tuple(_comparable(t) for t in step) for step in got) == want
            for step in got:
                for task in step:
                    if isinstance(task, BatchSpec):
                        _same_buckets(DocBatch(task, torch.device("cpu")).buckets, ref.buckets(task.blocks, task.folds))
                    elif isinstance(task, VarlenSpec):
                        _same_varlen(VarlenBatch(task, torch.device("cpu")), ref.varlen_tensors(task.pieces))


def _same_buckets(got, want) -> None:
    assert len(got) == len(want)
    for b, w in zip(got, want):
        for name in ("q_idx", "q_valid", "no_lse", "q_rows", "q_sel"):
            assert torch.equal(getattr(b, name), w[name]), name
        assert (b.mask is None) == (w["mask"] is None)
        assert b.mask is None or torch.equal(b.mask, w["mask"])
        assert len(b.keys) == len(w["keys"])
        for k, (own, idx, rows, sel) in zip(b.keys, w["keys"]):
            assert k.own == own and torch.equal(k.idx, idx) and torch.equal(k.rows, rows) and torch.equal(k.sel, sel)


def _same_varlen(got: VarlenBatch, want: dict) -> None:
    for name in ("q_rows", "k_rows", "cu_q", "cu_k"):
        assert torch.equal(getattr(got, name), want[name]), name
    assert (got.max_q, got.max_k) == (want["max_q"], want["max_k"])


def test_lowered_steps_batches_share_one_build():
    """The first batch of a rank's lowered steps builds every batch's index tensors; the others reuse them."""
    cu = _cu([3, 1, 7, 2, 30, 5, 2, 9, 40, 4, 11], "zigzag", 3)
    table = block_schedules(cpa.get_layout("zigzag"), True, 3, cu[-1], cu, None, rank=1)
    specs = [t for step in cpa.schedules.lower_steps(table, True, True, cu[-1] // 3) for t in step
             if isinstance(t, BatchSpec)]
    assert len(specs) > 1 and len({id(s.group) for s in specs}) == 1
    batches = [DocBatch(s, torch.device("cpu")) for s in specs]
    again = DocBatch(specs[-1], torch.device("cpu"))
    assert again.buckets is batches[-1].buckets
    for s, b in zip(specs, batches):
        _same_buckets(b.buckets, ref.buckets(s.blocks, s.folds))


def test_varlen_pieces_whose_rows_overlap_go_to_separate_calls():
    """A block with a full part and rows past its causal square gives two full pieces over the same rows:
    they run in two calls, as the per-block reference groups them; so do overlapping blocks."""
    from cp_attention.schedules import DocBlock
    disjoint = ((DocBlock(0, 6, 0, 5, 2), DocBlock(6, 9, 5, 12, None), DocBlock(9, 12, 12, 14, 0)),)
    overlapping = ((DocBlock(0, 6, 0, 5, 2), DocBlock(3, 9, 5, 12, None), DocBlock(1, 4, 12, 14, 0)),)
    for step_blocks in (disjoint, overlapping):
        got = cpa.schedules.lower_steps(step_blocks, batched=False, tiled=False, local_len=12, varlen=True)
        want = ref.lower_steps(step_blocks, batched=False, tiled=False, varlen=True)
        assert tuple(tuple(_comparable(t) for t in step) for step in got) == want
        assert sum(not spec.causal for spec in got[0]) >= 2


def test_boundaries_checked_once_are_still_checked_for_their_total_and_positions_are_copies():
    """The plan's build checks one tuple of boundaries and asks for every rank's positions of it once per
    rank: the shortcuts it takes (layouts.documents, layouts.builtin) change no answer."""
    import pytest

    from cp_attention.layouts.documents import check_cu_seqlens
    cu = (0, 3, 4, 16)
    assert check_cu_seqlens(cu, total=16) is cu
    with pytest.raises(ValueError, match="must end at the packed length 12"):
        check_cu_seqlens(cu, total=12)
    lay = cpa.get_layout("zigzag")
    first = [lay.positions(16, r, 2, cu) for r in range(2)]
    first[0].fill_(-1)  # a caller may write into its positions
    again = [lay.positions(16, r, 2, list(cu)) for r in range(2)]
    assert torch.equal(torch.sort(torch.cat(again)).values, torch.arange(16))
    assert [p.tolist() for p in again] == [p.tolist() for p in (lay.positions(16, r, 2, cu) for r in range(2))]
