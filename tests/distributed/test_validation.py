"""Bad input raises one clear error, the same on every rank, and never leaves a rank hanging."""

from __future__ import annotations

import re

import pytest
import torch

import cp_attention as cpa
from tests.support.core import dist_cases

CASES = {
    # name: (kwargs for every rank, per-rank overrides, expected message fragment)
    "zigzag_odd_local_len": (dict(local_len=3), None,
                             r"local sequence length 3 x world_size 3 = 9 tokens: zigzag layout needs seq_len "
                             r"divisible by 2\*world_size=6, got 9; pad the sequence to a multiple of 6 \(12 tokens; "
                             r"packed "
                             r"documents: cp_attention\.pad_cu_seqlens\(cu_seqlens, 6\)\) or use layout='contiguous'"),
    "head_ratio": (dict(heads=3, kv_heads=2), None, "multiple of the K/V heads"),
    "one_rank_other_head_dim": (dict(), {1: dict(head_dim=6, v_dim=6)}, "same tensor shapes"),
    "3d_input": (dict(ndim=3), None, r"must be 4-D \[batch, seq, heads, head_dim\]"),
    "unknown_layout": (dict(layout="diagonal"), None, "unknown layout"),
    "unknown_kernel": (dict(kernel="nope"), None, "unknown kernel"),
    "cuda_kernel_on_cpu": (dict(kernel="flash"), None, "kernel 'flash' does not support device cpu"),
    "bad_scale": (dict(softmax_scale=float("nan")), None, "softmax_scale must be a finite non-zero float"),
    "one_rank_other_shape": (dict(), {1: dict(local_len=6)}, "same tensor shapes"),
    "one_rank_other_layout": (dict(), {2: dict(layout="interleaved")}, "same layout"),
    "one_rank_other_dtype": (dict(), {0: dict(dtype="float64")},  # named, not by index
                             r"same dtype, got rank 0: torch\.float64, rank 1: torch\.float32, "
                             r"rank 2: torch\.float32;"),
    "one_rank_other_comm_type": (dict(), {1: dict(cp_comm_type="all_gather")},
                                 r"same cp_comm_type, got rank 0: 'p2p', rank 1: 'all_gather', rank 2: 'p2p';"),
    "causal_not_a_bool": (dict(causal="no"), None, r"causal must be a bool \(True or False\)"),
    "one_rank_other_sink_values": (dict(sinks=4), {1: dict(sink_value=0.5)}, "same sinks values"),
    "one_rank_other_causal": (dict(), {2: dict(causal=False)}, "same causal"),
    "one_rank_bad_kernel": (dict(), {1: dict(kernel="nope")},
                            r"unknown kernel.*\(on rank 1; ranks with bad input: \[1\]\)"),
    "one_rank_no_grad": (dict(), {0: dict(requires_grad=False)}, "same requires_grad"),
    "sinks_wrong_length": (dict(sinks=3), None,
                           r"sinks must hold one logit per query head: expected shape \[4\], got \[3\]"),
    "one_rank_without_sinks": (dict(sinks=4), {1: dict(sinks=None)}, "same sinks"),
    "softcap_on_a_kernel_without_it": (dict(softcap=30.0, kernel="sdpa"), None,
                                       r"kernel 'sdpa' cannot apply softcap; use kernel='math'"),
    "negative_softcap": (dict(softcap=-1.0), None, r"softcap must be a finite float >= 0"),
    "one_rank_other_softcap": (dict(softcap=30.0), {0: dict(softcap=20.0)}, "same softcap"),
}


@pytest.mark.parametrize("name", CASES)
def test_same_error_on_every_rank(pools, name):
    common, per_rank, fragment = CASES[name]
    results = pools(3).run(dist_cases.call_and_capture, per_rank=per_rank, timeout=60, **common)
    kinds = {kind for kind, _ in results}
    messages = {msg for _, msg in results}
    assert kinds == {"ValueError"}, results
    assert len(messages) == 1, f"ranks disagree: {results}"
    message = messages.pop()
    assert message.startswith("ring_attention: ")
    if fragment:
        assert re.search(fragment, message), message


def test_valid_call_passes(pools):
    """The harness itself: a good call raises nothing (so the cases above can tell the difference)."""
    assert pools(3).run(dist_cases.call_and_capture, local_len=6) == [("", "")] * 3


def test_rank_outside_group(pools):
    results = pools(3).run(dist_cases.call_and_capture, subgroup=[0, 1], layout="contiguous", timeout=60)
    assert results[0] == results[1] == ("", "")
    assert results[2][0] == "ValueError" and "not a member of the given group" in results[2][1]


def test_single_process_errors_are_raised_before_work():
    q = torch.randn(1, 5, 2, 4)
    with pytest.raises(ValueError, match="zigzag layout needs seq_len divisible by 2"):
        cpa.ring_attention(q, q, q, layout="zigzag")
    with pytest.raises(ValueError, match="share one floating dtype"):
        cpa.ring_attention(q, q.double(), q, layout="contiguous")
    with pytest.raises(ValueError, match="share one floating dtype"):
        cpa.ring_attention(q.long(), q.long(), q.long(), layout="contiguous")
    with pytest.raises(ValueError, match="must be on the same device"):
        cpa.ring_attention(q, q.to("meta"), q, layout="contiguous")
    with pytest.raises(ValueError, match="q and k must have the same head_dim, got 4 and 6"):
        cpa.ring_attention(q, torch.randn(1, 5, 2, 6), q, layout="contiguous")
    with pytest.raises(ValueError, match=r"sinks must be a non-empty 1-D floating tensor \[heads\]"):
        cpa.ring_attention(q, q, q, layout="contiguous", sinks=torch.zeros(1, 2))


@pytest.mark.parametrize("bad", ["no", "", 2, 1.0, None, torch.tensor(True)], ids=repr)
def test_causal_must_be_a_bool(bad):
    """``causal="no"`` is truthy: it ran as causal. Refused, also after a causal call on the same group
    made the plan a call without one finds."""
    q = torch.randn(1, 4, 2, 8)
    cpa.ring_attention(q, q, q, layout="contiguous", causal=True)
    with pytest.raises(ValueError, match=r"causal must be a bool \(True or False\)"):
        cpa.ring_attention(q, q, q, layout="contiguous", causal=bad)
    with pytest.raises(ValueError, match=r"causal must be a bool \(True or False\)"):
        cpa.plan("contiguous", causal=bad)
