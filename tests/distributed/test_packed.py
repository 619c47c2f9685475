"""Packed documents (cu_seqlens) on real gloo ranks against a per-document fp64 reference, and the
layouts' document split."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cp_attention as cpa
from cp_attention.layouts.documents import (
    cu_seqlens_from_lengths,
    cu_seqlens_from_position_ids,
    document_ids,
    document_position_ids,
    pad_cu_seqlens,
    zigzag_chunks,
)
from tests.support.core import dist_cases
from tests.support.core.reference import tolerance

WORLD_SIZES = (1, 2, 3, 4)


def _cu(lengths):
    return list(cu_seqlens_from_lengths(lengths))


def _padded(lengths, layout, world_size):
    """Append one document so the total splits (the documents themselves are never padded)."""
    _, pad = pad_cu_seqlens(_cu(lengths), cpa.get_layout(layout).divisor(world_size))
    return list(lengths) + ([pad] if pad else [])


def _assert_within(errors, what):
    for rank, e in enumerate(errors):
        for key, val in e.items():
            assert val <= 0.0, f"{what}: rank {rank} {key} exceeds tolerance by {val:.3e}"


# Document lengths: 1-token documents, documents shorter than N, a single document, many documents.
LENGTHS = st.one_of(
    st.lists(st.integers(1, 3), min_size=1, max_size=40),
    st.lists(st.integers(1, 24), min_size=1, max_size=8),
    st.integers(1, 40).map(lambda n: [n]),
    st.lists(st.sampled_from([1, 2, 5, 9]), min_size=150, max_size=300),
)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=st.sampled_from(cpa.LAYOUT_NAMES), causal=st.booleans(), lengths=LENGTHS,
       kernel=st.sampled_from(("math", "sdpa")))
def test_packed_matches_per_document_reference(pools, world_size, layout, causal, lengths, kernel):
    lengths = _padded(lengths, layout, world_size)
    errors = pools(world_size).run(dist_cases.packed_attention_errors, layout=layout, causal=causal,
                                   lengths=lengths, kernel=kernel, seed=len(lengths), timeout=120)
    _assert_within(errors, f"{layout} causal={causal} {kernel} N={world_size} lengths={lengths}")


# Blocks longer than the batching limit run on their own; short ones are batched: both in one call.
MIXED = [300, 1, 7, 64, 2, 130, 17, 3]


@pytest.mark.parametrize("world_size", (2, 3))
@pytest.mark.parametrize("layout", cpa.LAYOUT_NAMES)
@pytest.mark.parametrize("kernel", ("math", "sdpa"))
def test_long_and_short_documents_with_sinks_and_lse_gradient(pools, world_size, layout, kernel):
    lengths = _padded(MIXED, layout, world_size)
    errors = pools(world_size).run(dist_cases.packed_attention_errors, layout=layout, causal=True, lengths=lengths,
                                   kernel=kernel, heads=6, kv_heads=2, sinks=True, lse_grad=True, timeout=120)
    _assert_within(errors, f"{layout} {kernel} N={world_size} with sinks and an LSE gradient")


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
@pytest.mark.parametrize("layout", cpa.LAYOUT_NAMES)
def test_packed_low_precision(pools, dtype, layout):
    lengths = _padded([5, 40, 1, 22, 9], layout, 2)
    tol = tolerance(getattr(torch, dtype), gqa=True)
    errors = pools(2).run(dist_cases.packed_attention_errors, layout=layout, causal=True, lengths=lengths,
                          kernel="sdpa", dtype=dtype, **tol, timeout=120)
    _assert_within(errors, f"{layout} {dtype}")


def test_single_document_equals_the_unpacked_layout():
    for layout in cpa.LAYOUT_NAMES:
        lay = cpa.get_layout(layout)
        for n in (1, 2, 3, 4):
            seq = 6 * lay.divisor(n)
            for r in range(n):
                assert torch.equal(lay.positions(seq, r, n, cu_seqlens=[0, seq]), lay.positions(seq, r, n))


@settings(max_examples=200, deadline=None)
@given(layout=st.sampled_from(cpa.LAYOUT_NAMES), n=st.integers(1, 6),
       lengths=st.lists(st.integers(1, 30), min_size=1, max_size=12))
def test_layouts_split_documents_as_specified(layout, n, lengths):
    lengths = _padded(lengths, layout, n)
    cu = _cu(lengths)
    lay = cpa.get_layout(layout)
    pos = [lay.positions(cu[-1], r, n, cu_seqlens=cu) for r in range(n)]
    assert all(p.numel() == cu[-1] // n for p in pos), "every rank holds exactly T/N tokens"
    assert sorted(torch.cat(pos).tolist()) == list(range(cu[-1])), "a permutation of the stream"
    assert all(bool((p[1:] > p[:-1]).all()) for p in pos), "local order is increasing"
    x = torch.randn(2, cu[-1], 3)
    assert torch.equal(lay.unshard([lay.shard(x, 1, r, n, cu_seqlens=cu) for r in range(n)], 1, cu_seqlens=cu), x)
    if layout == "zigzag":
        doc = document_ids(cu)
        starts, sizes = zigzag_chunks(cu, n)
        assert int((sizes.max(1).values - sizes.min(1).values).max()) <= 1, "chunk sizes differ by at most one"
        assert torch.equal(sizes.sum(1), torch.tensor(lengths))
        for r in range(n):
            for d in range(len(lengths)):  # rank r holds chunks r and 2N-1-r of every document
                want = [starts[d, c] + i for c in (r, 2 * n - 1 - r) for i in range(int(sizes[d, c]))]
                assert pos[r][doc[pos[r]] == d].tolist() == [int(w) for w in want]
    elif layout == "interleaved":
        assert all(torch.equal(p, torch.arange(r, cu[-1], n)) for r, p in enumerate(pos))
    elif layout == "contiguous":
        t = cu[-1] // n
        assert all(torch.equal(p, torch.arange(r * t, (r + 1) * t)) for r, p in enumerate(pos))
    # balanced: its placement is the solver's (tests/unit/layouts/test_balanced.py); the checks above hold


def test_document_helpers():
    cu = [0, 3, 4, 9]
    assert document_position_ids(torch.arange(9), cu).tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 4]
    assert cu_seqlens_from_position_ids(torch.tensor([0, 1, 2, 0, 0, 1, 2, 3, 4])) == tuple(cu)
    assert pad_cu_seqlens(cu, 4) == ((0, 3, 4, 9, 12), 3)
    assert pad_cu_seqlens(cu, 3) == (tuple(cu), 0)
    with pytest.raises(ValueError, match="count 0, 1, 2"):
        cu_seqlens_from_position_ids(torch.tensor([0, 1, 3]))
    with pytest.raises(ValueError, match="strictly increase"):
        document_ids([0, 2, 2, 5])
    with pytest.raises(ValueError, match="must end at the packed length 8"):
        cpa.get_layout("zigzag").positions(8, 0, 2, cu_seqlens=[0, 3, 7])


def test_custom_layout_without_packing_is_refused_by_name():
    from tests.support.core.custom_layouts import ReversedZigzagLayout  # noqa: F401 - registers it

    with pytest.raises(NotImplementedError, match="does not support packed documents"):
        cpa.get_layout("reversed_zigzag").positions(8, 0, 2, cu_seqlens=[0, 3, 8])


@pytest.mark.parametrize("case,message", [
    ("batch", "need batch size 1"),
    ("wrong_end", "must end at the packed length T = local length 4 x world_size 3 = 12, got 14"),
    ("not_increasing", "strictly increasing"),
    ("differs", "every rank of the group must pass the same cu_seqlens"),
])
def test_bad_packed_calls_raise_on_every_rank(pools, case, message):
    results = pools(3).run(dist_cases.packed_refusal, case=case, timeout=60)
    assert len({r for r in results}) == 1, f"ranks disagree: {results}"
    kind, text = results[0]
    assert kind == "ValueError" and message in text, results[0]
