"""The one codec of the rows ranks compare: fields by name, widths, trusted keys, text, and the
verdicts every rank reaches alike."""

from __future__ import annotations

import pytest

from cp_attention.checks.codec import Codec, Field, agree_rows, decode_text, encode_text, raise_differing, raise_first
from cp_attention.checks.validation import CALL_FIELDS, PLAN_FIELDS, plan_codes, tensor_codes, trusted_plan_key
from cp_attention.transport.loopback import LoopbackGroup

ROW = Codec(Field("a"), Field("pair", 2, label="pair of ints"), Field("fingerprint", trusted=None),
            Field("count", trusted=lambda n: min(n, 1)))


def test_rows_decode_by_name():
    values = {"a": 7, "pair": (-1, 3), "fingerprint": 1 << 62, "count": 5}
    row = ROW.encode(values)
    assert row == [7, -1, 3, 1 << 62, 5] and ROW.size == 5
    assert ROW.decode(row) == values
    assert ROW.decode(row + [99]) == values  # what follows a row is not its business
    assert ROW.trusted_key(values) == (7, (-1, 3), 1)  # no fingerprint, the count as packed-or-not


def test_codecs_concatenate_and_refuse_bugs():
    both = ROW + Codec(Field("b"))
    assert both.size == 6 and both.decode([1, 2, 3, 4, 5, 6])["b"] == 6
    with pytest.raises(ValueError, match="distinct"):
        ROW + Codec(Field("a"))
    with pytest.raises(KeyError):
        ROW.encode({"a": 1})
    with pytest.raises(ValueError, match="takes 2 ints, got 3"):
        ROW.encode({"a": 1, "pair": (1, 2, 3), "fingerprint": 0, "count": 0})


@pytest.mark.parametrize("text", ["", "plain", "ünïcødé ✓", "x" * 100])
def test_text_round_trips_and_is_cut_to_its_width(text):
    words = encode_text(text, 4)
    assert len(words) == 4
    assert decode_text(words) == text.encode()[:32].decode(errors="replace")


def test_the_call_signature_is_one_row_read_by_name():
    import torch

    q = torch.zeros(1, 8, 4, 16)
    row = CALL_FIELDS.decode(tensor_codes(q, q, q, None, "auto") + plan_codes("zigzag", True, [0, 5, 16], (3, 0)))
    assert row["q"] == (4, 1, 8, 4, 16) and row["causal"] == 1 and row["window"] == (3, 0)
    assert row["documents"] == 2 and row["packed_len"] == 16
    # a new batch's boundaries keep an agreed plan's trusted key
    assert trusted_plan_key(plan_codes("zigzag", True, [0, 5, 16])) == \
        trusted_plan_key(plan_codes("zigzag", True, [0, 9, 11, 16]))
    assert trusted_plan_key(plan_codes("zigzag", True, [0, 16])) != trusted_plan_key(plan_codes("zigzag", True))
    assert PLAN_FIELDS.size == 16  # 8 ints of fields, 8 of the refused argument's text


def test_agree_rows_gives_every_rank_every_row_and_one_verdict():
    def rank_fn(group):
        rows = agree_rows(group, ROW, {"a": 1, "pair": (group.rank, 0), "fingerprint": 0, "count": 0})
        try:
            raise_first("demo", [None if r["pair"][0] == 0 else f"bad pair {r['pair']}" for r in rows])
        except ValueError as e:
            first = str(e)
        try:
            raise_differing("demo", rows, {"a": "a", "pair": ROW.field("pair").label})
        except ValueError as e:
            return rows, first, str(e)

    results = LoopbackGroup(3).run(rank_fn)
    assert all(rows == results[0][0] for rows, _, _ in results)
    assert [r["pair"] for r in results[0][0]] == [(0, 0), (1, 0), (2, 0)]
    assert {first for _, first, _ in results} == {"demo: bad pair (1, 0) (on rank 1; ranks with bad input: [1, 2])"}
    assert {msg for _, _, msg in results} == {
        "demo: every rank of the group must pass the same pair of ints, got rank 0: (0, 0), rank 1: (1, 0), "
        "rank 2: (2, 0); shard every tensor with the same layout and call with the same arguments on all ranks"}
