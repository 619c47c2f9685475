"""Arguments as callers pass them, and messages that name what was given and suggest a fix that works
(cp_attention issue 44): numpy integer ``cu_seqlens``, ``softcap=None``, and the layouts' divisibility
messages."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import cp_attention as cpa
from cp_attention.layouts.documents import check_cu_seqlens, cu_seqlens_tuple
from cp_attention.transport.loopback import LoopbackGroup
from tests.support.core.reference import reference_attention

CU = [0, 5, 9, 16]
INTEGER_FORMS = {
    "numpy int64": np.array(CU), "numpy int32": np.array(CU, dtype=np.int32),
    "numpy uint16": np.array(CU, dtype=np.uint16), "list of numpy ints": [np.int64(x) for x in CU],
    "list of 0-d int tensors": [torch.tensor(x) for x in CU], "range-like tuple": tuple(range(0, 17, 4)),
}


@pytest.mark.parametrize("form", INTEGER_FORMS)
def test_integer_cu_seqlens_of_any_form_are_read_as_ints(form):
    cu = INTEGER_FORMS[form]
    want = tuple(int(x) for x in cu)
    got = cu_seqlens_tuple(cu)
    assert got == want and all(type(x) is int for x in got)
    assert check_cu_seqlens(cu) == want


def test_a_numpy_cu_seqlens_plans_and_runs_exactly_like_a_list():
    world_size, cu = 2, np.array(CU)
    lay = cpa.get_layout("zigzag")
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 16, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))

    def rank_fn(rank):
        shards = [lay.shard(t, 1, rank.rank, world_size, cu) for t in (q, k, v)]
        plan = cpa.plan(lay, rank, cu_seqlens=cu)
        assert plan.cu_seqlens == tuple(CU) and plan.codes == cpa.plan(lay, rank, cu_seqlens=CU).codes
        return cpa.ring_attention(*shards, plan=plan, kernel="math"), \
            cpa.ring_attention(*shards, group=rank, layout=lay, cu_seqlens=cu, kernel="math")
    results = LoopbackGroup(world_size).run(rank_fn)
    ref = torch.cat([reference_attention(q[:, a:b], k[:, a:b], v[:, a:b], True, 8 ** -0.5)[0]
                     for a, b in zip(CU, CU[1:])], 1)
    for i in range(2):
        got = lay.unshard([r[i] for r in results], 1, cu_seqlens=cu)
        assert (got - ref).abs().max().item() <= 1e-10


@pytest.mark.parametrize("bad,named", [
    (np.array([0.0, 5.0, 16.0]), "float64 values"), (np.array([0, 1, 1], dtype=bool), "bool values"),
    ([0, 5.0, 16], "got 5.0 (float) at index 1"), ([0, True, 16], "got True (bool) at index 1"),
    ([np.int64(0), np.float32(5), 16], "(float32) at index 1"), ([0, torch.tensor(True)], "at index 1"),
    (np.zeros((2, 2), dtype=np.int64), "2-D ndarray"),
])
def test_cu_seqlens_of_floats_or_bools_are_refused_naming_them(bad, named):
    with pytest.raises(ValueError, match="cu_seqlens must") as info:
        cu_seqlens_tuple(bad)
    assert named in str(info.value)
    # the group's verdict names them too, on every rank alike
    with pytest.raises(ValueError, match=r"cu_seqlens must be .*, got ") as info:
        cpa.plan("zigzag", LoopbackGroup(1).rank(0), cu_seqlens=bad)
    assert ("values" in named and named in str(info.value)) or "got " in str(info.value)


def test_softcap_none_is_no_softcap():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 8, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    out = cpa.ring_attention(q, k, v, softcap=None, kernel="math")
    assert torch.equal(out, cpa.ring_attention(q, k, v, softcap=0.0, kernel="math"))
    ref, _ = reference_attention(q, k, v, True, 8 ** -0.5)
    assert (out - ref).abs().max().item() <= 1e-10


@pytest.mark.parametrize("kwargs,message", [
    (dict(softcap="soft"), "softcap must be a finite float >= 0 (0 or None disables it), got 'soft', which "
                           "float() cannot convert"),
    (dict(softcap=-1.0), "softcap must be a finite float >= 0 (0 or None disables it), got -1.0"),
    (dict(softmax_scale="x"), "softmax_scale must be a finite non-zero float or None (head_dim ** -0.5), got 'x', "
                              "which float() cannot convert"),
    (dict(kernel="fastest"), "unknown kernel 'fastest'; expected one of"),
    (dict(cp_comm_type="ring"), "unknown cp_comm_type 'ring'; expected one of"),
    (dict(causal="no"), "causal must be a bool (True or False), got 'no'"),
    (dict(layout="zigzog"), "unknown layout 'zigzog'"),
    (dict(window_size=(3,)), "window_size must be (left, right), two ints >= -1 (flash-attn's convention: -1 = "
                             "unbounded, (-1, -1) = no window), got (3,)"),
])
def test_refused_arguments_are_named_as_given(kwargs, message):
    q = torch.randn(1, 8, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError) as info:
        cpa.ring_attention(q, q, q, group=LoopbackGroup(1).rank(0), **kwargs)
    assert message in str(info.value)


def test_a_long_refused_value_is_cut_to_fit():
    q = torch.randn(1, 8, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"unknown kernel 'kkkkkkkkkk+\.\.\.; expected one of"):
        cpa.ring_attention(q, q, q, kernel="k" * 200)


LAYOUTS = ("contiguous", "zigzag", "interleaved", "balanced")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_divisibility_messages_suggest_only_what_works(layout):
    lay = cpa.get_layout(layout)
    for world_size in range(1, 6):
        for total in range(0, 4 * world_size + 3):
            try:
                lay.check(total, world_size)
                continue
            except ValueError as e:
                message = str(e)
            # the padding it names splits, and so does pad_cu_seqlens' with the divisor it names
            padded = int(re.search(r"\((\d+) tokens; packed documents", message).group(1))
            divisor = int(re.search(r"pad_cu_seqlens\(cu_seqlens, (\d+)\)", message).group(1))
            lay.check(padded, world_size)
            if total > 0:
                cu, pad = cpa.pad_cu_seqlens([0, total], divisor)
                lay.check(cu[-1], world_size)
                assert cu[-1] == padded and pad == padded - total
            # contiguous is suggested exactly when it can split the total
            suggested = "layout='contiguous'" in message
            can = total > 0 and total % world_size == 0
            assert suggested == (can and layout != "contiguous"), message
            if suggested:
                cpa.get_layout("contiguous").check(total, world_size)


def test_the_balanced_layout_does_not_suggest_contiguous_for_a_total_it_cannot_split():
    def rank_fn(rank, cu):
        try:
            cpa.plan("balanced", rank, cu_seqlens=cu)
        except ValueError as e:
            return str(e)
        return ""
    messages = set(LoopbackGroup(4).run(rank_fn, [0, 6, 13]))  # 13 tokens over 4 ranks: no layout splits it
    assert len(messages) == 1
    message = messages.pop()
    assert "cu_seqlens of 13 tokens over world_size 4: balanced layout needs seq_len divisible by 2*world_size=8, " \
           "got 13; pad the sequence to a multiple of 8 (16 tokens; packed documents: " \
           "cp_attention.pad_cu_seqlens(cu_seqlens, 8))" in message and "contiguous" not in message
    padded, _ = cpa.pad_cu_seqlens([0, 6, 13], 8)
    assert LoopbackGroup(4).run(rank_fn, padded) == [""] * 4
    # 12 tokens: contiguous splits them, and is suggested
    message = LoopbackGroup(4).run(rank_fn, [0, 6, 12])[0]
    assert message.endswith("or use layout='contiguous'")
    assert LoopbackGroup(4).run(lambda rank: cpa.plan("contiguous", rank, cu_seqlens=[0, 6, 12]).world_size) == [4] * 4
