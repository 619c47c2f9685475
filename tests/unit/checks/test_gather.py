"""Layout.gather on loopback ranks: the checks agree every rank's shard before the data moves (one
verdict on every rank), the layouts keep only the pure part, and the seam between them is installed."""

from __future__ import annotations

import pytest
import torch

import cp_attention as cpa
from cp_attention.checks import gather as checked
from cp_attention.layouts import gather as seam
from cp_attention.transport.loopback import LoopbackGroup


def _errors(shards, **kwargs):
    """Every rank's error (its message, or None) from gathering ``shards[rank]`` along dim 1."""
    lay = cpa.get_layout("zigzag")

    def rank_fn(group):
        before = group.sent_bytes
        try:
            lay.gather(shards[group.rank], kwargs.get("dims", (1, 1))[group.rank], group=group,
                       cu_seqlens=kwargs.get("cus", (None, None))[group.rank])
        except ValueError as e:
            return str(e), group.sent_bytes - before
        return None, group.sent_bytes - before

    return LoopbackGroup(2, timeout_s=20).run(rank_fn)


def test_gather_unshards_every_ranks_shard():
    x = torch.randn(2, 16, 3, 4, dtype=torch.float64)
    cu = (0, 4, 16)
    for lay in (cpa.get_layout("zigzag"), cpa.get_layout("contiguous")):
        got = LoopbackGroup(2).run(lambda g, lay=lay: lay.gather(lay.shard(x, 1, g.rank, 2, cu), 1, group=g,
                                                                 cu_seqlens=cu))
        assert all(torch.equal(t, x) for t in got)


@pytest.mark.parametrize("case", ["length", "dtype", "dim", "cu_seqlens"])
def test_mismatched_shards_raise_one_error_on_every_rank_before_the_data_moves(case):
    a = torch.zeros(1, 8, 2, 4)
    shards, kwargs = (a, a), {}
    if case == "length":
        shards = (a, a[:, :4])
    elif case == "dtype":
        shards = (a, a.double())
    elif case == "dim":
        kwargs["dims"] = (1, 7)
    else:
        kwargs["cus"] = ((0, 16), (0, 8, 4))  # not increasing on rank 1
    results = _errors(shards, **kwargs)
    messages = {msg for msg, _ in results}
    assert len(messages) == 1 and None not in messages, results
    (msg,) = messages
    assert msg.startswith("Layout.gather: ")
    expected = {"length": "length along dim, got rank 0: 8, rank 1: 4",
                "dtype": "shape (but along dim), dtype and device type, got rank 0: as rank 0, "
                         "rank 1: differs from rank 0",
                "dim": "dim is out of range for its 4-D shard (expected -4 <= dim < 4) (on rank 1",
                "cu_seqlens": "cu_seqlens are not document boundaries"}[case]
    assert expected in msg, msg
    row_bytes = checked.SHARD_FIELDS.size * 8
    assert all(sent <= row_bytes for _, sent in results)  # only the agreement's row, never the shard


def test_layouts_gather_runs_the_checks_and_never_gathers_unchecked(monkeypatch):
    assert seam._installed is checked.gather_shards
    monkeypatch.setattr(seam, "_installed", None)
    with pytest.raises(RuntimeError, match="no checked all-gather installed"):
        cpa.get_layout("zigzag").gather(torch.zeros(1, 4), dim=1)


def test_a_shards_description_is_pure_and_never_raises():
    x = torch.zeros(1, 8, 2, 4)
    values = seam.shard_values(x, 1, (0, 3, 16))
    assert values["problem"] == seam.GATHER_OK and (values["dim"], values["local"], values["cu_end"]) == (1, 8, 16)
    assert seam.shard_values(x, -3, None)["dim"] == 1
    assert seam.shard_problem(seam.shard_values(x, 4, None)).startswith("dim is out of range")
    assert seam.shard_problem(seam.shard_values(x, 1, "not documents")).startswith("cu_seqlens are not")
    assert seam.shard_values(x, 1, None)["others"] != seam.shard_values(x.double(), 1, None)["others"]
