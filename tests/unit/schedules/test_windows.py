"""Sliding windows (``window_size``): the schedule against a mask oracle (every allowed pair computed
exactly once, nothing else, and the ring cut short only where no rank needs the farther shards), and
the ring on real gloo ranks against the fp64 reference, forward and backward, with GQA, sinks,
softcap and packed documents."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cp_attention as cpa
from cp_attention.layouts.documents import cu_seqlens_from_lengths, document_ids, pad_cu_seqlens
from cp_attention.schedules import (
    BlockTask,
    DocBlock,
    block_schedules,
    doc_block_pairs,
    lowering,
    normalize_window,
    ring_length,
    source_rank,
    split_doc_block,
    task_pairs,
)
from tests.support.core import dist_cases
from tests.support.core.reference import tolerance


def _allowed(total: int, cu, causal: bool, window) -> torch.Tensor:
    """The oracle: which global (query, key) pairs may attend, from the definition."""
    i = torch.arange(total)[:, None]
    j = torch.arange(total)[None, :]
    ok = torch.ones(total, total, dtype=torch.bool)
    if cu is not None:
        doc = document_ids(cu)
        ok &= doc[:, None] == doc[None, :]
        start = torch.tensor(cu[:-1])[doc]
        i, j = i - start[:, None], j - start[None, :]  # positions within documents
    if causal:
        ok &= j <= i
    left, right = window
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


def _doc_mask(b: DocBlock) -> torch.Tensor:
    off = torch.arange(b.kv_len)[None, :] - torch.arange(b.q_len)[:, None]
    keep = torch.ones(b.q_len, b.kv_len, dtype=torch.bool)
    if b.diag is not None:
        keep &= off <= b.diag
    if b.lo is not None:
        keep &= off >= b.lo
    return keep


def _task_mask(t: BlockTask) -> torch.Tensor:
    a, w = t.q_stop - t.q_start, t.kv_stop - t.kv_start
    off = torch.arange(w)[None, :] - torch.arange(a)[:, None]
    if t.band is not None:
        return (off >= t.band[0]) & (off <= t.band[1])
    return off <= 0 if t.causal else torch.ones(a, w, dtype=torch.bool)


def _count(counts, q_pos, k_pos, q0, k0, keep):
    qg = q_pos[q0: q0 + keep.shape[0]][:, None].expand_as(keep)[keep]
    kg = k_pos[k0: k0 + keep.shape[1]][None, :].expand_as(keep)[keep]
    counts.index_put_((qg, kg), torch.ones_like(qg), accumulate=True)


def _coverage(layout: str, causal: bool, n: int, total: int, cu, window):
    lay = cpa.get_layout(layout)
    pos = [lay.positions(total, r, n, cu_seqlens=cu) if cu is not None else lay.positions(total, r, n)
           for r in range(n)]
    blocks = torch.zeros(total, total, dtype=torch.int64)
    tasks = torch.zeros_like(blocks)
    lengths = set()
    for r in range(n):
        steps = block_schedules(lay, causal, n, total, None if cu is None else tuple(cu), window)[r]
        lengths.add(len(steps))
        for s, step in enumerate(steps):
            j = source_rank(r, n, s)
            for b in step:
                keep = _doc_mask(b)
                assert keep.any(1).all() and keep.any(0).all(), f"trimmed: every row and key is used: {b}"
                assert int(keep.sum()) == doc_block_pairs(b)
                _count(blocks, pos[r], pos[j], b.q_start, b.kv_start, keep)
                for t in split_doc_block(b):
                    mask = _task_mask(t)
                    assert mask.any(1).all() and int(mask.sum()) == task_pairs(t)
                    _count(tasks, pos[r], pos[j], t.q_start, t.kv_start, mask)
    assert len(lengths) == 1, "every rank runs the same number of ring steps"
    return blocks, tasks, lengths.pop()


WINDOWS = st.tuples(st.integers(-1, 40), st.integers(-1, 40))


@settings(max_examples=150, deadline=None)
@given(layout=st.sampled_from(cpa.LAYOUT_NAMES), n=st.integers(1, 5), causal=st.booleans(), window=WINDOWS,
       local=st.integers(1, 8), lengths=st.one_of(st.none(), st.lists(st.integers(1, 17), min_size=1, max_size=6)),
       tile=st.sampled_from((1, 3, 64)))
def test_every_pair_in_the_window_is_computed_exactly_once(layout, n, causal, window, local, lengths, tile):
    saved, lowering.BAND_TILE = lowering.BAND_TILE, tile  # small tiles split the bands
    try:
        _check_window_steps(layout, n, causal, window, local, lengths)
    finally:
        lowering.BAND_TILE = saved


def _check_window_steps(layout, n, causal, window, local, lengths):
    lay = cpa.get_layout(layout)
    cu = None
    if lengths is None:
        total = local * lay.divisor(n)
    else:
        cu, _ = pad_cu_seqlens(cu_seqlens_from_lengths(lengths), lay.divisor(n))
        total = cu[-1]
    win = normalize_window(window, causal, total, cu)
    if win is None:
        return  # no window: the unwindowed schedules, proven elsewhere
    blocks, tasks, length = _coverage(layout, causal, n, total, cu, win)
    expected = _allowed(total, cu, causal, window).long()
    assert torch.equal(blocks, expected)
    assert torch.equal(tasks, expected)
    work = cpa.work_model(layout, causal, total, n, cu_seqlens=cu, window_size=window)
    assert sum(map(sum, work)) == int(expected.sum())
    assert all(w == 0 for row in work for w in row[length:])
    # Cut short only where nothing is lost (coverage above), and never by a step some rank needs.
    assert length == 1 + max(s for row in work for s, w in enumerate(row) if w)


def test_normalize_window():
    assert normalize_window((-1, -1), True, 100) is None
    assert normalize_window((99, 5), True, 100) is None  # left spans the sequence, right is causal
    assert normalize_window((98, 5), True, 100) == (98, -1)
    assert normalize_window((3, 7), False, 100) == (3, 7)
    assert normalize_window((-1, 99), False, 100) is None
    assert normalize_window((9, -1), True, 100, [0, 10, 100]) == (9, -1)  # the longest document counts
    assert normalize_window((89, -1), True, 100, [0, 10, 100]) is None
    for bad in ((-2, 0), (1.5, 0), (True, 0), 3, (1, 2, 3), "ab"):
        with pytest.raises(ValueError, match="window_size must be"):
            normalize_window(bad, True, 100)


def test_contiguous_window_of_an_eighth_needs_two_of_eight_blocks():
    """Target: with a window of S/8 at N=8 a contiguous-layout rank computes and receives at most
    2 of the 8 blocks (its own and its predecessor's)."""
    s, n = 8 * 64, 8
    for window in ((s // 8, -1), (s // 8 - 1, -1)):  # flash-attn's left = W, and HF's left = W - 1
        assert ring_length("contiguous", True, s, n, normalize_window(window, True, s)) == 2
        work = cpa.work_model("contiguous", True, s, n, window_size=window)
        assert all(sum(w > 0 for w in row) <= 2 for row in work)
        assert sum(map(sum, work)) == int(_allowed(s, None, True, window).sum())
    # zigzag and interleaved hold a piece of every region of the sequence: the ring runs in full,
    # but their blocks shrink to the band.
    for layout in ("zigzag", "interleaved"):
        assert ring_length(layout, True, s, n, (s // 8, -1)) == n
        assert sum(map(sum, cpa.work_model(layout, True, s, n, window_size=(s // 8, -1)))) == sum(
            map(sum, cpa.work_model("contiguous", True, s, n, window_size=(s // 8, -1))))


def _assert_within(errors, what):
    for rank, e in enumerate(errors):
        for key, val in e.items():
            ok = val is True or (not isinstance(val, bool) and val <= 0.0)
            assert ok, f"{what}: rank {rank} {key}: {val}"


# (left, right): smaller than a chunk, spanning several ranks, left-only, two-sided, right-only, self only.
WINDOW_CASES = [((2, -1), True), ((9, -1), True), ((17, -1), True), ((3, 2), False), ((-1, 4), False),
                ((0, 0), False), ((5, 11), False)]


@pytest.mark.parametrize("world_size", (1, 2, 3, 4))
@pytest.mark.parametrize("layout", cpa.LAYOUT_NAMES)
def test_windowed_ring_matches_reference(pools, world_size, layout):
    for (window, causal) in WINDOW_CASES:
        for kernel in ("math", "sdpa"):
            errors = pools(world_size).run(
                dist_cases.attention_errors, layout=layout, causal=causal, dtype="float64", kernel=kernel,
                heads=4, kv_heads=2, local_len=8, window=window, seed=world_size, timeout=120,
                **tolerance(torch.float64, True))
            _assert_within(errors, f"{layout} N={world_size} window={window} causal={causal} {kernel}")


@pytest.mark.parametrize("world_size", (2, 3))
def test_long_bands_run_as_tiles(pools, world_size):
    """Shards longer than a band tile (256 rows): each block's band runs as several tiles."""
    for layout in cpa.LAYOUT_NAMES:
        for window, causal in (((20, -1), True), ((10, 30), False)):
            errors = pools(world_size).run(
                dist_cases.attention_errors, layout=layout, causal=causal, dtype="float64", kernel="sdpa",
                heads=2, kv_heads=1, batch=1, local_len=300, window=window, timeout=120,
                **tolerance(torch.float64, True))
            _assert_within(errors, f"{layout} N={world_size} window={window} causal={causal} tiles")


@pytest.mark.parametrize("world_size", (2, 4))
def test_window_with_sinks_softcap_and_lse_gradient(pools, world_size):
    for layout in cpa.LAYOUT_NAMES:
        errors = pools(world_size).run(
            dist_cases.attention_errors, layout=layout, causal=True, dtype="float64", kernel="math",
            heads=4, kv_heads=1, local_len=6, window=(5, -1), sinks=True, softcap=0.7, lse_grad=True,
            timeout=120, **tolerance(torch.float64, True))
        _assert_within(errors, f"{layout} N={world_size} window+sinks+softcap+lse_grad")


@pytest.mark.parametrize("world_size", (2, 3))
@pytest.mark.parametrize("layout", cpa.LAYOUT_NAMES)
def test_window_within_packed_documents(pools, world_size, layout):
    lengths = [1, 30, 7, 3, 70, 2, 11]
    _, pad = pad_cu_seqlens(cu_seqlens_from_lengths(lengths), cpa.get_layout(layout).divisor(world_size))
    lengths += [pad] if pad else []
    for window, causal in (((4, -1), True), ((20, -1), True), ((3, 6), False)):
        for kernel in ("math", "sdpa"):
            errors = pools(world_size).run(dist_cases.packed_attention_errors, layout=layout, causal=causal,
                                           lengths=lengths, kernel=kernel, window=window, sinks=True, timeout=120)
            _assert_within(errors, f"{layout} N={world_size} packed window={window} causal={causal} {kernel}")


@pytest.mark.parametrize("world_size", (3, 4))
def test_steps_outside_the_window_are_neither_computed_nor_sent(pools, world_size):
    """A contiguous ring whose window reaches only the previous shard exchanges K/V once in forward and
    dK/dV once in backward (which starts with the shard the forward held last). Without a window a rank
    exchanges at every step where it sends or receives a needed row (contiguous causal: from earlier
    ranks only): in forward, again in backward but the last step's, and once per step for dK/dV. Exact."""
    result = pools(world_size).run(dist_cases.window_exchanges, timeout=120)
    n = 8 * world_size
    rows = cpa.traffic_model("contiguous", True, n, world_size)
    for rank, r in enumerate(result):
        active = [s for s in range(1, world_size) if rows[rank][s] or rows[(rank + s) % world_size][s]]
        assert r["windowed"] == (1, 1), f"rank {rank}: forward/backward exchanges {r['windowed']}"
        expected = (len(active), len(active) + len([s for s in active if s < world_size - 1]))
        assert r["full"] == expected, f"rank {rank}: {r['full']}"
        assert r["err"] < 1e-10, f"rank {rank}: {r['err']}"


@pytest.mark.parametrize("world_size", (1, 2))
def test_bad_window_is_refused_on_every_rank(pools, world_size):
    results = pools(world_size).run(dist_cases.window_refusal, timeout=60)
    for kind, message in results:
        assert kind == "ValueError" and "window_size must be" in message, message
