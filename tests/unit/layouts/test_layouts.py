"""Layouts against an independent ownership oracle, with hypothesis."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cp_attention as cpa


def owner(layout: str, t: int, seq_len: int, n: int) -> int:
    """Which rank holds global token t, written from docs/design.md's table, not from the library."""
    if layout == "contiguous":
        return t // (seq_len // n)
    if layout in ("zigzag", "balanced"):  # balanced is zigzag without packed documents
        chunk = t // (seq_len // (2 * n))
        return chunk if chunk < n else 2 * n - 1 - chunk
    return t % n


def layout_and_len():
    return st.tuples(st.sampled_from(cpa.LAYOUT_NAMES), st.integers(1, 9), st.integers(1, 6)).map(
        lambda p: (p[0], p[1], p[2] * cpa.get_layout(p[0]).divisor(p[1])))


@settings(max_examples=200, deadline=None)
@given(layout_and_len())
def test_positions_match_ownership_oracle(case):
    layout, n, seq_len = case
    lay = cpa.get_layout(layout)
    for r in range(n):
        # Every layout keeps its tokens in ascending global order.
        expected = [t for t in range(seq_len) if owner(layout, t, seq_len, n) == r]
        assert lay.positions(seq_len, r, n).tolist() == expected


@settings(max_examples=100, deadline=None)
@given(layout_and_len(), st.integers(0, 2), st.integers(1, 3))
def test_unshard_inverts_shard_and_positions_agree(case, dim, batch):
    layout, n, seq_len = case
    lay = cpa.get_layout(layout)
    shape = [batch, 2, 3]
    shape.insert(dim, seq_len)
    x = torch.randn(*shape)
    shards = [lay.shard(x, dim, r, n) for r in range(n)]
    assert torch.equal(lay.unshard(shards, dim), x)
    arange = torch.arange(seq_len)
    for r in range(n):
        assert torch.equal(lay.shard(arange, 0, r, n), lay.positions(seq_len, r, n))
    # negative dims address the same axis
    assert torch.equal(lay.shard(x, dim - x.dim(), 0, n), shards[0])


def test_aliases_and_case():
    assert cpa.get_layout("DualChunkSwap").name == "zigzag"
    assert cpa.get_layout("head_tail").name == "zigzag"
    assert cpa.get_layout("striped").name == "interleaved"
    assert cpa.get_layout("modulo").name == "interleaved"
    lay = cpa.get_layout("contiguous")
    assert cpa.get_layout(lay) is lay


def test_errors_say_what_and_how():
    with pytest.raises(ValueError, match=r"zigzag layout needs seq_len divisible by 2\*world_size=8, got 1004"
                                         r".*use layout='contiguous'"):
        cpa.get_layout("zigzag").check(1004, 4)
    with pytest.raises(ValueError, match="contiguous layout needs seq_len divisible by world_size=3, got 10"):
        cpa.get_layout("contiguous").shard(torch.zeros(10), 0, 0, 3)
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size=2\), got 2"):
        cpa.get_layout("interleaved").positions(8, 2, 2)
    with pytest.raises(ValueError, match="unknown layout 'zigzog'.*zigzag"):
        cpa.get_layout("zigzog")
    with pytest.raises(ValueError, match="equal shard lengths"):
        cpa.get_layout("contiguous").unshard([torch.zeros(2), torch.zeros(3)], 0)


def test_gather_without_process_group_is_identity():
    x = torch.randn(2, 8)
    assert cpa.get_layout("zigzag").gather(x, dim=1) is x
