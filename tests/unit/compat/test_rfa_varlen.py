"""ring-flash-attention 0.1.8's varlen API on cp_attention (``cp_attention.compat.rfa_varlen`` / ``rfa_llama3``):
the original's signatures, its shard placements, ``llama3_flash_attn_prepare_cu_seqlens`` equal to the
original's, the refusals, the flash-attn varlen stand-in the comparisons run on, and on gloo ranks (world sizes
2, 3, 4) the outputs and LSE of ring-flash-attention's own functions on the same shards and the outputs and
gradients of one process's attention over the packed documents (tests/support/core/rfa_varlen_cases.py)."""

from __future__ import annotations

import random

import pytest
import torch

import cp_attention
import cp_attention.compat.ring_flash_attn as ours
from cp_attention.compat import rfa_varlen
from tests.support.core import rfa_cases
from tests.support.core import rfa_varlen_cases as vc
from tests.support.cuda import flash_attn_standin

WORLD_SIZES = (2, 3, 4)
VARLEN_NAMES = [vc.function_name(kind, p) for kind in vc.KINDS for p in vc.PACKINGS]
ALL_NAMES = VARLEN_NAMES + ["llama3_flash_attn_prepare_cu_seqlens"]
LAYOUT_OF = {"ring": rfa_varlen.RING_VARLEN_LAYOUT, "zigzag": cp_attention.get_layout("zigzag"),
             "llama3": cp_attention.get_layout("contiguous")}


def _skip_without_original():
    reason = rfa_cases.rfa_missing()
    if reason:
        pytest.skip(reason)


def _args(name: str, cu, causal: bool = True, heads: int = 4, kv_heads: int = 2, dtype=torch.float64,
          view: str = "ours"):
    """Positional arguments of ``name`` on one process (world size 1: local = global), and q, k, v unpacked."""
    total = cu[-1]
    g = torch.Generator().manual_seed(5)
    if "qkvpacked" in name:
        kv_heads = heads
    q, k, v = (torch.randn(total, h, 8, generator=g, dtype=dtype) for h in (heads, kv_heads, kv_heads))
    tensors = ((torch.stack([q, k, v], dim=1),) if "qkvpacked" in name
               else (q, torch.stack([k, v], dim=1)) if "kvpacked" in name else (q, k, v))
    cu32 = torch.tensor(cu, dtype=torch.int32)
    if name.startswith("llama3"):
        p = ours.llama3_flash_attn_prepare_cu_seqlens(cu32, causal, 0, 1)
        if view == "copy":
            p = (p[0].clone(), p[1].clone(), *p[2:])
        meta = (*p[:4], 1, p[4])
    else:
        meta = (cu32, max(b - a for a, b in zip(cu, cu[1:])))
    return (*tensors, *meta), (q, k, v)


def test_every_varlen_function_is_exported():
    assert sorted(rfa_varlen.__all__) == sorted(ALL_NAMES)
    assert all(name in ours.__all__ and callable(getattr(ours, name)) for name in ALL_NAMES)


@pytest.mark.parametrize("name", ALL_NAMES)
def test_signature_is_the_originals(name):
    rfa_cases.assert_same_signature(name, ours, vc.VARLEN_MODULES)


@pytest.mark.parametrize("kind", vc.KINDS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_original_placement_is_a_layouts_shard(kind, world_size):
    """The shards the original's callers make are those of the layout each function runs on."""
    cu = [0]
    for n in vc.doc_lengths(kind, world_size):
        cu.append(cu[-1] + n)
    x = torch.arange(cu[-1] * 3).reshape(cu[-1], 3)
    for rank in range(world_size):
        assert torch.equal(vc.varlen_place(x, kind, cu, rank, world_size),
                           LAYOUT_OF[kind].shard(x, 0, rank, world_size, cu_seqlens=cu))


def test_ring_varlen_layout_refuses_a_document_it_cannot_cut():
    with pytest.raises(ValueError, match="document 1 of 5 tokens"):
        rfa_varlen.RING_VARLEN_LAYOUT.positions(12, 0, 2, cu_seqlens=[0, 4, 9, 12])


def _random_cu(rng: random.Random, world_size: int) -> list[int]:
    """Boundaries of 1-7 documents (empty ones too, not the first), padded to a multiple of ``world_size``."""
    lengths = [rng.choice([0, 1, 2, 3, 5, 8, 13]) for _ in range(rng.randint(1, 7))]
    lengths[0] = max(1, lengths[0])
    lengths[-1] += -sum(lengths) % world_size
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def test_prepare_cu_seqlens_equals_the_originals():
    """Pure index math: on many batches (empty documents too), every rank and world size, causal or not,
    int32 and int64, the same tensors (values, dtype), maxima and slice as the original's."""
    _skip_without_original()
    rng = random.Random(0)
    with rfa_cases.original(("llama3_flash_attn_varlen",)) as ref:
        checked = 0
        for trial in range(120):
            world_size = rng.randint(1, 8)
            cu = _random_cu(rng, world_size)
            dtype = (torch.int32, torch.int64)[trial % 2]
            for rank in range(world_size):
                for causal in (True, False):
                    t = torch.tensor(cu, dtype=dtype)
                    mine = ours.llama3_flash_attn_prepare_cu_seqlens(t, causal, rank, world_size)
                    theirs = ref.llama3_flash_attn_prepare_cu_seqlens(t, causal, rank, world_size)
                    for a, b in zip(mine[:2], theirs[:2]):
                        assert a.dtype == b.dtype and torch.equal(a, b), (cu, rank, world_size, causal)
                    assert mine[2:] == theirs[2:] and all(type(x) is int for x in mine[2:4]), (cu, rank, causal)
                    checked += 1
    assert checked > 400


def test_prepare_cu_seqlens_refusals():
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    with pytest.raises(ValueError, match="packed length 7 must be divisible by world_size=2"):
        ours.llama3_flash_attn_prepare_cu_seqlens(cu, True, 0, 2)
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size=2\), got 2"):
        ours.llama3_flash_attn_prepare_cu_seqlens(torch.tensor([0, 3, 8]), True, 2, 2)


@pytest.mark.parametrize("name", VARLEN_NAMES)
@pytest.mark.parametrize("argument,value", [("dropout_p", 0.1), ("alibi_slopes", torch.ones(4))])
def test_refuses_dropout_and_alibi_before_communication(name, argument, value):
    args, _ = _args(name, [0, 4, 10])
    with pytest.raises(NotImplementedError, match=f"{name}: {argument}"):
        getattr(ours, name)(*args, **{argument: value}, group=rfa_cases.Untouchable())


@pytest.mark.parametrize("name", [n for n in VARLEN_NAMES if "packed" in n])
def test_refuses_a_wrongly_packed_tensor(name):
    args, (q, k, v) = _args(name, [0, 4, 10])
    bad = (torch.stack([q, k], dim=1),) if "qkvpacked" in name else (q, torch.stack([k, v, v], dim=1))
    n_tensors = 1 if "qkvpacked" in name else 2
    with pytest.raises(ValueError, match=r"must be \[total, [23], heads, head_dim\], got"):
        getattr(ours, name)(*bad, *args[n_tensors:], group=rfa_cases.Untouchable())


@pytest.mark.parametrize("name", [n for n in VARLEN_NAMES if not n.startswith("llama3")])
def test_refuses_local_cu_seqlens_the_placement_cannot_hold(name):
    args, _ = _args(name, [0, 4, 10])
    n_tensors = 1 if "qkvpacked" in name else 2 if "kvpacked" in name else 3
    short = torch.tensor([0, 4, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="ending at the local length 10"):
        getattr(ours, name)(*args[:n_tensors], short, 6, causal=True)
    if name.startswith("zigzag"):
        odd = torch.tensor([0, 3, 10], dtype=torch.int32)
        with pytest.raises(ValueError, match="sequence 0 has odd local length 3"):
            getattr(ours, name)(*args[:n_tensors], odd, 7, causal=True)


@pytest.mark.parametrize("name", [n for n in VARLEN_NAMES if n.startswith("llama3")])
def test_llama3_refuses_a_view_prepared_for_another_call(name):
    args, _ = _args(name, [0, 4, 10], causal=True)
    with pytest.raises(ValueError, match="prepared with causal=True.*called with causal=False"):
        getattr(ours, name)(*args, causal=False)
    bad_stride = list(args)
    bad_stride[-2] = 3
    with pytest.raises(ValueError, match="heads_k_stride must be a positive int dividing the"):
        getattr(ours, name)(*bad_stride, causal=True)


@pytest.mark.parametrize("name", VARLEN_NAMES)
@pytest.mark.parametrize("causal", (True, False))
def test_without_a_process_group_is_plain_attention(name, causal):
    """No torch.distributed: one process's attention over the packed documents, every option honoured, and the
    original's return structure (out, fp32 [H, T] LSE, None); llama3 from its remembered and its checked view."""
    cu = [0, 4, 10, 16]
    window, scale = (3, 1), 0.3
    for view in ("ours", "copy"):
        args, (q, k, v) = _args(name, cu, causal=causal, view=view)
        out, lse, none = getattr(ours, name)(*args, causal=causal, window_size=window, softmax_scale=scale,
                                             deterministic=True, return_attn_probs=True)
        out_ref, lse_ref = vc.packed_reference(q, k, v, cu, causal, scale, window)
        assert none is None and lse.dtype == torch.float32 and lse.shape == lse_ref.shape
        torch.testing.assert_close(out, out_ref.to(out.dtype), atol=1e-10, rtol=0)
        torch.testing.assert_close(lse, lse_ref.float(), atol=1e-5, rtol=0)
        plain = getattr(ours, name)(*args, causal=causal, window_size=list(window), softmax_scale=scale)
        assert isinstance(plain, torch.Tensor)
        torch.testing.assert_close(plain, out_ref.to(out.dtype), atol=1e-10, rtol=0)


# --- the flash-attn varlen stand-in the original runs on ----------------------------------------------------------


@pytest.mark.parametrize("version", flash_attn_standin.VERSIONS)
def test_standin_varlen_is_per_sequence_bottom_right_attention(monkeypatch, version):
    """Sequences of other lengths in q than in k (the original's key slices), GQA, windows, a row that sees no
    key (flash-attn: out 0, LSE +inf): forward and backward against per-sequence fp64 attention."""
    iface = flash_attn_standin.install(monkeypatch, version)
    fwd, bwd = iface._flash_attn_varlen_forward, iface._flash_attn_varlen_backward
    new = not version.startswith("2.6")
    cq, ck = [0, 3, 4, 9], [0, 5, 7, 9]
    g = torch.Generator().manual_seed(1)
    q, dout = (torch.randn(9, 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(9, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    i32 = lambda c: torch.tensor(c, dtype=torch.int32)  # noqa: E731
    for causal, window in ((True, (-1, -1)), (False, (-1, -1)), (True, (1, -1)), (False, (0, 0))):
        win = dict(window_size_left=window[0], window_size_right=window[1]) if new else dict(window_size=window)
        res = fwd(q, k, v, i32(cq), i32(ck), 5, 5, 0.0, 0.5, causal, **win)
        out, lse = (res[0], res[1]) if new else (res[0], res[5])
        assert lse.shape == (4, 9) and lse.dtype == torch.float32
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        outs, lses = [], []
        for (a, b), (c, d) in zip(zip(cq, cq[1:]), zip(ck, ck[1:])):
            left, right = window[0], 0 if causal else window[1]
            allowed = flash_attn_standin.band(b - a, d - c, left, right)
            empty = ~allowed.any(1) if allowed is not None else torch.zeros(b - a, dtype=torch.bool)
            if allowed is not None:  # a row that sees nothing: computed over every key, then replaced
                allowed = allowed | empty[:, None]
            o, l_ = flash_attn_standin.attend(qr[None, a:b], kr[None, c:d], vr[None, c:d], 0.5, allowed)
            outs.append(torch.where(empty[:, None, None], 0.0, o[0]))
            lses.append(torch.where(empty[None, :], float("inf"), l_[0]))
        out_ref, lse_ref = torch.cat(outs), torch.cat(lses, 1)
        torch.testing.assert_close(out, out_ref.detach(), atol=1e-12, rtol=0)
        torch.testing.assert_close(lse, lse_ref.detach().float(), atol=1e-6, rtol=0)
        if window == (0, 0):
            assert torch.isinf(lse).any() and (out[torch.isinf(lse[0])] == 0).all()
        grads = torch.autograd.grad(out_ref, (qr, kr, vr), dout)
        dq, dk, dv = (torch.full_like(t, 7.0) for t in (q, k, v))
        wb = (window[0], window[1]) if new else (window,)
        bwd(dout, q, k, v, out, lse.contiguous(), dq, dk, dv, i32(cq), i32(ck), 5, 5, 0.0, 0.5, causal, *wb,
            0.0, None, False)
        for mine, ref in zip((dq, dk, dv), grads):
            torch.testing.assert_close(mine, ref, atol=1e-5, rtol=0)  # the fp32 LSE bounds the precision
    with pytest.raises(RuntimeError, match="cu_seqlens_q must have dtype int32"):
        fwd(q, k, v, torch.tensor(cq), i32(ck), 5, 5, 0.0, 0.5, True)
    with pytest.raises(RuntimeError, match="longer than max_seqlen_q=4"):
        fwd(q, k, v, i32(cq), i32(ck), 4, 5, 0.0, 0.5, True)


# --- on gloo ranks: one pool run per world size, shared by the two comparisons below ------------------------------


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"N{n}")
def varlen_results(request, pools):
    """(cases, per-rank results) of :func:`rfa_varlen_cases.varlen_matrix` on ``N`` gloo ranks."""
    cases = vc.varlen_matrix(request.param)
    return cases, pools(request.param).run(rfa_cases.run_cases, cases, modules=vc.VARLEN_MODULES, timeout=600)


def _failures(results, keys: tuple) -> tuple[list[str], int]:
    return rfa_cases.failures(results, keys, vc.case_label)


@pytest.mark.dist
@pytest.mark.slow
def test_varlen_functions_equal_one_process(varlen_results):
    """Outputs, LSE and gradients of every varlen function and option equal one process's attention over the
    packed documents (fp32 1e-5, fp64 1e-10)."""
    bad, checked = _failures(varlen_results, ("structure_ok", "out_ok", "lse_ok", "out", "lse", "dq", "dk", "dv"))
    assert checked == sum("kind" in kwargs for _, kwargs in varlen_results[0]) * len(varlen_results[1])
    assert not bad, "\n".join(bad)


@pytest.mark.dist
@pytest.mark.slow
def test_llama3_refuses_a_bad_view_on_every_rank_alike(varlen_results):
    """A view that one rank prepared for another ``causal``: the gathered check raises the same error on every
    rank, naming that rank (none hangs in the ring)."""
    bad, checked = _failures(varlen_results, ("refused_ok",))
    assert checked == len(varlen_results[1]) and not bad, bad


@pytest.mark.dist
@pytest.mark.slow
def test_varlen_functions_equal_ring_flash_attention(varlen_results):
    """Outputs and LSE (value, shape, dtype, return structure) equal ring-flash-attention's own on the same shards,
    wherever the original is exact (zigzag causal only; windows only for llama3 causal). Its backward is no
    reference on gloo."""
    _skip_without_original()
    bad, checked = _failures(varlen_results, ("orig_like", "orig_out", "orig_lse"))
    cases, per_rank = varlen_results
    assert checked == sum(kwargs.get("against_original", False) for _, kwargs in cases) * len(per_rank) > 0
    assert not bad, "\n".join(bad)
