"""Ring attention on real gloo processes against the fp64 full-attention reference."""

from __future__ import annotations

import itertools

import pytest
import torch

import cp_attention as cpa
from cp_attention.kernels.dtypes import dtype_from_name
from tests.support.core import dist_cases
from tests.support.core.reference import tolerance

WORLD_SIZES = (1, 2, 3, 4)
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}
TESTED_DTYPES = ("float64", "float32", "bfloat16")


def _assert_within(errors: list[dict], what: str) -> None:
    for rank, e in enumerate(errors):
        assert e["out_dtype_ok"] and e["grad_dtypes_ok"], f"rank {rank}: wrong output/grad dtype or shape"
        for key in ("out", "lse", "dq", "dk", "dv"):
            assert e[key] <= 0.0, f"{what}: rank {rank} {key} exceeds tolerance by {e[key]:.3e}"


# Without documents "balanced" is zigzag (tests/unit/layouts/test_balanced.py): every test here is
# unpacked, so it runs once (test_balanced_without_documents), not in every matrix.
LAYOUTS = tuple(name for name in cpa.LAYOUT_NAMES if name != "balanced")
MATRIX = list(itertools.product(WORLD_SIZES, LAYOUTS, (True, False), HEADS, TESTED_DTYPES, ("math", "sdpa")))


@pytest.mark.parametrize("world_size,layout,causal,heads,dtype,kernel", MATRIX,
                         ids=["-".join(map(str, p)).replace("True", "causal").replace("False", "full")
                              for p in MATRIX])
def test_matches_reference(pools, world_size, layout, causal, heads, dtype, kernel):
    h, hkv = HEADS[heads]
    tol = tolerance(dtype_from_name(dtype), gqa=hkv != h)
    errors = pools(world_size).run(
        dist_cases.attention_errors, layout=layout, causal=causal, dtype=dtype, kernel=kernel,
        heads=h, kv_heads=hkv, seed=world_size * 7 + h, **tol)
    _assert_within(errors, f"{layout} causal={causal} {heads} {dtype} {kernel}")


@pytest.mark.parametrize("causal", (True, False))
def test_balanced_without_documents(pools, causal):
    errors = pools(3).run(dist_cases.attention_errors, layout="balanced", causal=causal, dtype="float64",
                          kernel="sdpa", heads=4, kv_heads=2, seed=5, **tolerance(torch.float64, True))
    _assert_within(errors, f"balanced causal={causal}")


@pytest.mark.parametrize("world_size", (2, 3, 4))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kernel", ("math", "sdpa"))
def test_mla_scale_and_batch(pools, world_size, layout, kernel):
    """v head_dim != q/k head_dim, a custom softmax_scale, batch 3, GQA, fp64."""
    errors = pools(world_size).run(
        dist_cases.attention_errors, layout=layout, causal=True, dtype="float64", kernel=kernel,
        heads=6, kv_heads=2, head_dim=12, v_dim=20, batch=3, scale=0.37, **tolerance(torch.float64, True))
    _assert_within(errors, f"MLA {layout} {kernel}")


@pytest.mark.parametrize("world_size", (2, 3, 4))
@pytest.mark.parametrize("layout,local_len", [("contiguous", 1), ("interleaved", 1), ("zigzag", 2),
                                              ("interleaved", 2), ("contiguous", 3)])
def test_tiny_shards(pools, world_size, layout, local_len):
    """Shards of one or two tokens: interleaved's shifted block and zigzag's halves degenerate."""
    errors = pools(world_size).run(
        dist_cases.attention_errors, layout=layout, causal=True, dtype="float64", kernel="sdpa",
        local_len=local_len, **tolerance(torch.float64, False))
    _assert_within(errors, f"tiny {layout} n={local_len}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_long_sequence_fp32(pools, layout):
    """A longer sequence in fp32 (tolerance scaled with sqrt of the length, as docs/design.md allows)."""
    world_size, local_len = 4, 256
    atol = 2e-6 * (local_len * world_size / 64) ** 0.5
    errors = pools(world_size).run(
        dist_cases.attention_errors, layout=layout, causal=True, dtype="float32", kernel="auto",
        heads=2, kv_heads=1, head_dim=32, batch=1, local_len=local_len, atol=atol, rtol=0.0)
    _assert_within(errors, f"long fp32 {layout}")


@pytest.mark.parametrize("world_size", (2, 3, 4))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", (True, False))
def test_each_pair_computed_once(pools, world_size, layout, causal):
    """The kernel is handed exactly the allowed score pairs: masked steps are skipped, not discarded."""
    local_len = 6
    seq = local_len * world_size
    results = pools(world_size).run(dist_cases.pairs_computed, layout=layout, causal=causal,
                                    local_len=local_len)
    model = cpa.work_model(layout, causal, seq, world_size)
    for rank, res in enumerate(results):
        assert res["pairs"] == sum(model[rank]), f"rank {rank} computed {res['pairs']} pairs"
        assert res["calls"] == sum(1 for w in model[rank] if w > 0)
        assert res["max_err"] < 1e-12
    assert sum(r["pairs"] for r in results) == (seq * (seq + 1) // 2 if causal else seq * seq)


@pytest.mark.parametrize("kernel", ["math", "cpu_flash"])
def test_backward_twice_through_one_forward(pools, kernel):
    """Backward starts from the K/V shard the forward kept; at N=4 it then passes shards on, and
    must never receive into the kept one (a second backward would read a later shard)."""
    assert pools(4).run(dist_cases.repeated_backward, layout="zigzag", kernel=kernel) == [0.0] * 4


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather(pools, layout):
    assert all(pools(3).run(dist_cases.gather_roundtrip, layout=layout))


@pytest.mark.parametrize("world_size", (1, 2, 3, 4))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", (True, False))
@pytest.mark.parametrize("kernel", ("math", "sdpa"))
def test_sinks_match_the_reference(pools, world_size, layout, causal, kernel):
    """Learned attention sinks (GPT-OSS s_aux), fp64, GQA: out, LSE, dq/dk/dv and the sink gradient."""
    errors = pools(world_size).run(
        dist_cases.attention_errors, layout=layout, causal=causal, dtype="float64", kernel=kernel, heads=4,
        kv_heads=2, sinks=True, seed=world_size, **tolerance(torch.float64, True))
    _assert_within(errors, f"sinks {layout} causal={causal} {kernel}")
    for rank, e in enumerate(errors):
        assert e["dsinks_dtype_ok"] and e["dsinks"] <= 0.0, f"rank {rank}: sink gradient off by {e['dsinks']:.3e}"


def test_sinks_in_bf16_and_their_effect(pools):
    """bf16 within TE's tolerance; and the sinks change the result (the check above could not pass without them)."""
    errors = pools(2).run(dist_cases.attention_errors, layout="zigzag", causal=True, dtype="bfloat16",
                          kernel="sdpa", heads=4, kv_heads=2, sinks=True, **tolerance(torch.bfloat16, True))
    _assert_within(errors, "sinks bf16")
    q = torch.randn(1, 8, 4, 16, dtype=torch.float64)
    plain = cpa.ring_attention(q, q[:, :, :2], q[:, :, :2], layout="contiguous")
    sunk = cpa.ring_attention(q, q[:, :, :2], q[:, :, :2], layout="contiguous", sinks=torch.zeros(4, dtype=q.dtype))
    assert (plain - sunk).abs().max() > 1e-3  # the "off-by-one" softmax differs from the plain one


@pytest.mark.parametrize("world_size", (1, 2, 3, 4))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kernel,sinks", [("math", False), ("sdpa", False), ("sdpa", True)])
def test_the_lse_is_differentiable(pools, world_size, layout, kernel, sinks):
    """A loss on out and on the returned LSE: every gradient (dq, dk, dv, and the sinks') includes the LSE's share."""
    errors = pools(world_size).run(
        dist_cases.attention_errors, layout=layout, causal=True, dtype="float64", kernel=kernel, heads=4,
        kv_heads=2, v_dim=12, sinks=sinks, lse_grad=True, seed=world_size + 3, **tolerance(torch.float64, True))
    _assert_within(errors, f"lse grad {layout} {kernel} sinks={sinks}")
    if sinks:
        assert all(e["dsinks"] <= 0.0 for e in errors), errors


@pytest.mark.parametrize("world_size", (1, 2, 3, 4))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", (True, False))
def test_softcap_matches_the_reference(pools, world_size, layout, causal):
    """Gemma2-style logit softcapping, fp64, GQA, with sinks; kernel 'auto' must pick one that can cap."""
    errors = pools(world_size).run(
        dist_cases.attention_errors, layout=layout, causal=causal, dtype="float64", kernel="auto", heads=4,
        kv_heads=2, softcap=0.7, sinks=True, seed=world_size + 11, **tolerance(torch.float64, True))
    _assert_within(errors, f"softcap {layout} causal={causal}")


def test_softcap_changes_the_result_and_auto_picks_a_kernel_that_can():
    from cp_attention.kernels import get_kernel

    assert get_kernel("auto", "cpu", torch.float32, softcap=True).picks['causal'] == "math"
    assert get_kernel("auto", "cpu", torch.float32).picks['causal'] == "cpu_flash"
    with pytest.raises(ValueError, match="kernel 'sdpa' cannot apply softcap; use kernel='math'"):  # the old name
        get_kernel("sdpa", "cpu", torch.float32, softcap=True)
    q = torch.randn(1, 8, 2, 16, dtype=torch.float64) * 3
    capped = cpa.ring_attention(q, q, q, layout="contiguous", softcap=0.5)
    assert (capped - cpa.ring_attention(q, q, q, layout="contiguous")).abs().max() > 1e-3
