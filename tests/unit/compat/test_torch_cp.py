"""PyTorch's ``context_parallel`` on cp_attention (``cp_attention.compat.torch_cp``): buffers sharded in place
by the layout (torch's head-tail placement = zigzag) and restored, SDPA calls inside run on the ring and
equal full attention (loopback ranks, threads in this process), the patch undone and confined to the
thread, the refusals by name; on gloo ranks a tiny HF Llama trained under it equals one process
(tests/support/hf/torch_cp_cases.py)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

import cp_attention as cpa
from cp_attention.compat import torch_cp
from cp_attention.compat.torch_cp import context_parallel, context_parallel_unshard
from cp_attention.transport.loopback import LoopbackGroup
from tests.support.hf import torch_cp_cases

SDPA = F.scaled_dot_product_attention  # torch's own, taken before any context patches it
FP64 = 1e-12
LAYOUTS = ("zigzag", "contiguous", "interleaved", "balanced")
DOCS = (0, 5, 16, 23, 32)  # packed documents of a 32-token sequence, none a multiple of 2 * world_size


def _qkv(seq: int = 32, heads: int = 4, kv_heads: int = 2, batch: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, h, seq, 8, generator=g, dtype=torch.float64) for h in (heads, kv_heads, kv_heads))


def _reference(q, k, v, causal: bool, scale, cu=None):
    """torch's SDPA on the full sequence (per document when packed), with its gradients."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    bounds = [(0, q.shape[2])] if cu is None else list(zip(cu, cu[1:]))
    out = torch.cat([SDPA(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=causal, scale=scale, enable_gqa=True)
                     for a, b in bounds], dim=2)
    out.backward(torch.ones_like(out))
    return out.detach(), [t.grad for t in (q, k, v)]


def test_default_placement_is_torchs_head_tail():
    balancer = pytest.importorskip("torch.distributed.tensor.experimental._context_parallel._load_balancer")
    zigzag = cpa.get_layout("zigzag")
    for n in (2, 3, 4):
        torch_order = balancer._HeadTailLoadBalancer(8 * n, n, "cpu")._generate_indices()[0]
        assert torch.equal(torch_order, torch.cat([zigzag.positions(8 * n, r, n) for r in range(n)]))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_inside_equals_full_attention_with_gradients(layout, causal):
    """Outputs (unsharded) and the gradients of the sharded q, k, v buffers equal torch's SDPA on the full
    sequence; GQA through enable_gqa, a non-default scale; packed documents with ``balanced``."""
    world, scale = 4, 0.3
    cu = DOCS if layout == "balanced" else None
    q, k, v = _qkv(batch=1 if cu else 2)
    want, want_grads = _reference(q, k, v, causal, scale, cu)

    def rank(group):
        qq, kk, vv = q.clone(), k.clone(), v.clone()
        # they come to require grad inside, which in-place restoring cannot undo (as in torch's): not restored
        with context_parallel(group, buffers=[qq, kk, vv], buffer_seq_dims=[2, 2, 2], no_restore_buffers={qq, kk, vv},
                              layout=layout, cu_seqlens=cu):
            local = [t.requires_grad_() for t in (qq, kk, vv)]
            out = F.scaled_dot_product_attention(*local, is_causal=causal, scale=scale, enable_gqa=True)
            out.backward(torch.ones_like(out))
            full, *grads = context_parallel_unshard(group, [out.detach()] + [t.grad for t in local], [2] * 4,
                                                    layout=layout, cu_seqlens=cu)
        return (full - want).abs().max().item(), max((g - w).abs().max().item() for g, w in zip(grads, want_grads))

    for out_err, grad_err in LoopbackGroup(world, timeout_s=60).run(rank):
        assert out_err <= FP64 and grad_err <= FP64, (layout, causal, out_err, grad_err)
    assert F.scaled_dot_product_attention is SDPA


@pytest.mark.parametrize("layout", LAYOUTS)
def test_buffers_sharded_in_place_and_restored(layout):
    world = 2
    cu = DOCS if layout == "balanced" else None
    ids = torch.arange(64).reshape(2, 32) if cu is None else torch.arange(32)[None]
    pos = torch.arange(32)
    lay = cpa.get_layout(layout)

    def rank(group):
        a, b, kept = ids.clone(), pos.clone(), ids.clone() * 10
        with context_parallel(group, buffers=[a, b, kept], buffer_seq_dims=[1, 0, -1], no_restore_buffers={kept},
                              layout=layout, cu_seqlens=cu):
            assert torch.equal(a, lay.shard(ids, 1, group.rank, world, cu_seqlens=cu))
            assert torch.equal(b, lay.shard(pos, 0, group.rank, world, cu_seqlens=cu))
            assert a.shape[1] == b.shape[0] == 16
        assert torch.equal(a, ids) and torch.equal(b, pos)  # restored, in the same tensor objects
        assert torch.equal(kept, lay.shard(ids * 10, 1, group.rank, world, cu_seqlens=cu))  # left sharded

    LoopbackGroup(world, timeout_s=60).run(rank)


def test_buffers_restored_and_patch_undone_after_an_exception():
    ids = torch.arange(8)[None].repeat(2, 1)
    with pytest.raises(KeyError, match="boom"):
        with context_parallel(None, buffers=[ids], buffer_seq_dims=[1]):
            assert F.scaled_dot_product_attention is not SDPA
            ids.zero_()
            raise KeyError("boom")
    assert F.scaled_dot_product_attention is SDPA
    assert torch.equal(ids, torch.arange(8)[None].repeat(2, 1))
    assert getattr(torch_cp._STATE, "active", None) is None
    with context_parallel(None):  # usable again: nothing left active in this thread
        pass


def test_patch_is_confined_to_the_thread_inside():
    """Another thread's SDPA, while this one is inside, is torch's own on its full inputs (the ring on a
    world of one would give the same numbers, so the caller's length check tells them apart)."""
    q, k, v = _qkv(seq=8)
    inside, done, seen = threading.Event(), threading.Event(), {}

    def other():
        inside.wait(10)
        seen["out"] = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # 8 tokens; the context holds 4
        done.set()

    t = threading.Thread(target=other)
    t.start()
    buf = torch.zeros(1, 4)
    with context_parallel(None, buffers=[buf], buffer_seq_dims=[1]):
        inside.set()
        done.wait(10)
        with pytest.raises(ValueError, match="local length 8"):
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    t.join()
    assert torch.equal(seen["out"], SDPA(q, k, v, enable_gqa=True))
    assert F.scaled_dot_product_attention is SDPA


def test_sdpa_calls_refused_by_name():
    q, k, v = _qkv(seq=8)
    with context_parallel(None, buffers=[torch.zeros(1, 8)], buffer_seq_dims=[1]):
        for kwargs, error, pattern in [
            (dict(attn_mask=torch.ones(8, 8, dtype=torch.bool), enable_gqa=True), NotImplementedError,
             "attn_mask is not supported"),
            (dict(dropout_p=0.1, enable_gqa=True), NotImplementedError, "dropout_p must be 0"),
            (dict(is_causal=1, enable_gqa=True), ValueError, "is_causal must be a bool"),
            ({}, ValueError, "pass enable_gqa=True"),  # 4 query heads, 2 KV heads, as SDPA refuses
        ]:
            with pytest.raises(error, match=pattern):
                F.scaled_dot_product_attention(q, k, v, **kwargs)
        with pytest.raises(ValueError, match="divisible by key/value heads"):
            F.scaled_dot_product_attention(q[:, :3], k, v, enable_gqa=True)
        with pytest.raises(ValueError, match="sharded alike"):
            F.scaled_dot_product_attention(q, k[:, :, :4], v[:, :, :4], enable_gqa=True)
        with pytest.raises(ValueError, match="4-D tensor"):
            F.scaled_dot_product_attention(q[0], k[0], v[0], enable_gqa=True)
        with pytest.raises(RuntimeError, match="already active in this thread"):
            with context_parallel(None):
                pass
        # a refused call changes nothing: the context still runs a good one
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.allclose(out, SDPA(q, k, v, is_causal=True, enable_gqa=True), atol=FP64, rtol=0)


@pytest.mark.parametrize("case,pattern", [
    ("dims", "one sequence dim per buffer"),
    ("lengths", "same length along its sequence dim"),
    ("twice", "listed twice"),
    ("view", "shares storage"),
    ("parameter", "parameter or requires grad"),
    ("no_restore", "must be a subset of buffers"),
    ("indivisible", "zigzag layout needs seq_len divisible by 2\\*world_size=4"),
    ("packed_batch", "batch 1"),
])
def test_context_refusals_leave_buffers_and_sdpa_untouched(case, pattern):
    a, b = torch.arange(12.0).reshape(2, 6), torch.arange(12.0).reshape(2, 6) + 100
    kwargs = dict(buffers=[a, b], buffer_seq_dims=[1, 1])
    if case == "dims":
        kwargs["buffer_seq_dims"] = [1]
    elif case == "lengths":
        kwargs["buffers"] = [a, torch.zeros(2, 8)]
    elif case == "twice":
        kwargs["buffers"] = [a, a]
    elif case == "view":
        kwargs["buffers"] = [a, a[:1]]
    elif case == "parameter":
        kwargs["buffers"] = [a, torch.nn.Parameter(b.clone())]
    elif case == "no_restore":
        kwargs["no_restore_buffers"] = {a.clone()}
    elif case == "packed_batch":
        kwargs.update(layout="balanced", cu_seqlens=[0, 2, 6])
    # 6 tokens on 2 ranks: zigzag needs a multiple of 4; refused before the group is used
    group = LoopbackGroup(2, timeout_s=5).rank(0) if case == "indivisible" else None
    with pytest.raises(ValueError, match=pattern):
        with context_parallel(group, **kwargs):
            pass
    assert torch.equal(a, torch.arange(12.0).reshape(2, 6)) and torch.equal(b, torch.arange(12.0).reshape(2, 6) + 100)
    assert F.scaled_dot_product_attention is SDPA


def test_unshard_inverts_the_in_place_shard():
    x = torch.randn(2, 3, 24, dtype=torch.float64)

    def rank(group):
        y = x.clone()
        with context_parallel(group, buffers=[y], buffer_seq_dims=[2], no_restore_buffers={y}):
            pass
        return context_parallel_unshard(group, [y], [-1])[0]

    for full in LoopbackGroup(3, timeout_s=60).run(rank):
        assert torch.equal(full, x)


@pytest.mark.slow
@pytest.mark.parametrize("layout,packed", [("zigzag", False), ("balanced", True)])
def test_hf_llama_training_on_loopback_ranks_equals_one_process(layout, packed):
    pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
    _assert_training(torch_cp_cases.loopback_training(2, layout=layout, packed=packed), f"loopback {layout}")


def _assert_training(results, what):
    for rank, r in enumerate(results):
        assert r["moved"] >= 5e-5, f"{what}: training did not move the weights ({r['moved']:.2e})"
        assert r["grads"] <= 1e-7, f"{what}: rank {rank} gradients differ by {r['grads']:.2e}"
        assert max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"])) <= 1e-6, (what, rank, r)
        assert r["params"] <= 1e-6, f"{what}: rank {rank} parameters differ by {r['params']:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("world_size,layout,packed", [(2, "zigzag", False), (4, "zigzag", False),
                                                      (2, "balanced", True), (4, "balanced", True)])
def test_hf_llama_training_on_gloo_equals_one_process(pools, world_size, layout, packed):
    """3 AdamW steps of a tiny fp32 Llama (sdpa, GQA) under context_parallel on a ("cp",) DeviceMesh."""
    pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
    results = pools(world_size).run(torch_cp_cases.gloo_training, layout=layout, packed=packed, timeout=300)
    _assert_training(results, f"gloo cp={world_size} {layout}")


@pytest.mark.slow
def test_torchs_own_context_parallel_on_cpu(pools):
    """torch's ``context_parallel`` cannot run SDPA on CPU (no DTensor rule for the CPU flash op, and its
    ring handles only the CUDA ops); where it can, it must equal ours."""
    pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
    for r in pools(2).run(torch_cp_cases.torch_cp_on_cpu, timeout=300):
        if r["error"]:
            assert "_scaled_dot_product_flash_attention_for_cpu" in r["error"], r["error"]
            continue
        assert max(abs(a - b) for a, b in zip(r["torch"]["losses"], r["ours"]["losses"])) <= 1e-6, r
        assert abs(r["torch"]["params"] - r["ours"]["params"]) <= 1e-6, r
