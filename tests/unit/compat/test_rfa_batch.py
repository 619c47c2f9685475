"""ring-flash-attention 0.1.8's batch API on cp_attention (``cp_attention.compat.ring_flash_attn``): the same
signatures as the original, the original's shard placements, its refusals, and on gloo ranks (world sizes
2, 3, 4) the outputs and LSE of ring-flash-attention's own functions on the same shards and the outputs and
gradients of one process's attention (tests/support/core/rfa_cases.py)."""

from __future__ import annotations

import pytest
import torch

import cp_attention
import cp_attention.compat.ring_flash_attn as ours
from cp_attention.compat import rfa_batch
from tests.support.core import rfa_cases
from tests.support.core.reference import reference_attention

WORLD_SIZES = (2, 3, 4)
BATCH_NAMES = [rfa_cases.function_name(p, k) for p in rfa_cases.PLACEMENTS for k in rfa_cases.PACKINGS]
LAYOUT_OF = {"contiguous": "contiguous", "zigzag": "zigzag", "stripe": "interleaved"}


def _inputs(name: str, heads: int = 4, kv_heads: int = 2, seq: int = 12, dtype=torch.float64):
    """Positional inputs of ``name`` (packed as it takes them) and the unpacked q, k, v."""
    g = torch.Generator().manual_seed(3)
    if "qkvpacked" in name:
        kv_heads = heads
    q, k, v = (torch.randn(2, seq, h, 8, generator=g, dtype=dtype) for h in (heads, kv_heads, kv_heads))
    if "qkvpacked" in name:
        return (torch.stack([q, k, v], dim=2),), (q, k, v)
    if "kvpacked" in name:
        return (q, torch.stack([k, v], dim=2)), (q, k, v)
    return (q, k, v), (q, k, v)


def test_every_batch_function_is_exported():
    assert sorted(rfa_batch.__all__) == sorted(BATCH_NAMES)
    assert all(name in ours.__all__ and callable(getattr(ours, name)) for name in BATCH_NAMES)


@pytest.mark.parametrize("name", BATCH_NAMES)
def test_signature_is_the_originals(name):
    rfa_cases.assert_same_signature(name, ours)


@pytest.mark.parametrize("placement", rfa_cases.PLACEMENTS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_original_placement_is_our_layouts_shard(placement, world_size):
    """The shards callers already make (ring-flash-attention's extract_local) are our layouts' shards."""
    x = torch.arange(2 * 4 * world_size * 3).reshape(2, 4 * world_size, 3)
    layout = cp_attention.get_layout(LAYOUT_OF[placement])
    for rank in range(world_size):
        assert torch.equal(rfa_cases.place(x, placement, rank, world_size),
                           layout.shard(x, dim=1, rank=rank, world_size=world_size))


@pytest.mark.parametrize("name", BATCH_NAMES)
@pytest.mark.parametrize("argument,value", [("dropout_p", 0.1), ("alibi_slopes", torch.ones(4))])
def test_refuses_dropout_and_alibi_before_communication(name, argument, value):
    args, _ = _inputs(name)
    with pytest.raises(NotImplementedError, match=f"{name}: {argument}"):
        getattr(ours, name)(*args, **{argument: value}, group=rfa_cases.Untouchable())


@pytest.mark.parametrize("name", [n for n in BATCH_NAMES if "packed" in n])
def test_refuses_a_wrongly_packed_tensor(name):
    args, (q, k, v) = _inputs(name)
    bad = (torch.stack([q, k], dim=2),) if "qkvpacked" in name else (q, torch.stack([k, v, v], dim=2))
    with pytest.raises(ValueError, match=r"must be \[batch, seq, [23], heads, head_dim\], got shape"):
        getattr(ours, name)(*bad, group=rfa_cases.Untouchable())


@pytest.mark.parametrize("name", BATCH_NAMES)
@pytest.mark.parametrize("causal", (True, False))
def test_without_a_process_group_is_plain_attention(name, causal):
    """group=None and no torch.distributed: one process's attention, every option honoured, and the original's
    return structure (out, fp32 [B, H, S] LSE, None)."""
    args, (q, k, v) = _inputs(name)
    window, scale = (3, 1), 0.3
    out, lse, none = getattr(ours, name)(*args, causal=causal, window_size=window, softmax_scale=scale,
                                         deterministic=True, return_attn_probs=True)
    out_ref, lse_ref = reference_attention(q, k, v, causal, scale, window=window)
    assert none is None and lse.dtype == torch.float32 and lse.shape == lse_ref.shape
    torch.testing.assert_close(out, out_ref.to(out.dtype), atol=1e-10, rtol=0)
    torch.testing.assert_close(lse, lse_ref.float(), atol=1e-5, rtol=0)
    plain = getattr(ours, name)(*args, causal=causal, window_size=list(window), softmax_scale=scale)
    assert isinstance(plain, torch.Tensor)
    torch.testing.assert_close(plain, out_ref.to(out.dtype), atol=1e-10, rtol=0)


# --- on gloo ranks: one pool run per world size, shared by the two comparisons below ---------------------------


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"N{n}")
def batch_results(request, pools):
    """(cases, per-rank results) of :func:`rfa_cases.batch_matrix` on ``N`` gloo ranks."""
    cases = rfa_cases.batch_matrix(request.param)
    return cases, pools(request.param).run(rfa_cases.run_cases, cases, timeout=600)


def _failures(batch_results, keys: tuple) -> tuple[list[str], int]:
    return rfa_cases.failures(batch_results, keys, rfa_cases.case_label)


@pytest.mark.dist
@pytest.mark.slow
def test_batch_functions_equal_one_process(batch_results):
    """Outputs, LSE and gradients of every function and option equal full attention (fp32 1e-5, fp64 1e-10)."""
    bad, checked = _failures(batch_results, ("structure_ok", "out_ok", "lse_ok", "out", "lse", "dq", "dk", "dv"))
    assert checked == len(batch_results[0]) * len(batch_results[1])
    assert not bad, "\n".join(bad)


@pytest.mark.dist
@pytest.mark.slow
def test_batch_functions_equal_ring_flash_attention(batch_results):
    """Outputs and LSE (value, shape, dtype, return structure) equal ring-flash-attention's own on the same shards,
    wherever the original is exact (no window; zigzag and stripe causal). Its backward is no reference on gloo."""
    reason = rfa_cases.rfa_missing()
    if reason:
        pytest.skip(reason)
    bad, checked = _failures(batch_results, ("orig_like", "orig_out", "orig_lse"))
    cases, per_rank = batch_results
    assert checked == sum(kwargs["against_original"] for _, kwargs in cases) * len(per_rank) > 0
    assert not bad, "\n".join(bad)
