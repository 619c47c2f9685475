"""The varlen drop-in (``cp_attention.compat.rfa_varlen``) against ring-flash-attention's own varlen functions and
against one process's attention over the packed documents, on gloo pool workers through
:func:`tests.support.core.rfa_cases.run_cases` (``modules=VARLEN_MODULES``).

- :func:`varlen_place`: the original's shard placements of a packed stream ``[T, ...]``, written from its code
  and independently of cp_attention's layouts: ``"ring"`` (every document cut in N contiguous parts, rank r
  holds part r of each), ``"zigzag"`` (every document cut in 2N chunks, rank r holds chunks r and 2N-1-r of
  each), ``"llama3"`` (the contiguous slice r of the whole stream).
- :func:`varlen_case`: one call against both references; :func:`varlen_matrix`: every function and option for
  a world size.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from cp_attention.kernels.dtypes import dtype_from_name

from .dist_cases import make_inputs
from .reference import excess_error, reference_attention
from .rfa_cases import FP32_TOLERANCE, TOLERANCE, packed_leaves

VARLEN_MODULES = ("ring_flash_attn_varlen", "zigzag_ring_flash_attn_varlen", "llama3_flash_attn_varlen")
KINDS = {"ring": "ring_flash_attn_varlen", "zigzag": "zigzag_ring_flash_attn_varlen",
         "llama3": "llama3_flash_attn_varlen"}
PACKINGS = ("", "kvpacked", "qkvpacked")


def varlen_place(x: torch.Tensor, kind: str, cu: Sequence[int], rank: int, world_size: int, dim: int = 0
                 ) -> torch.Tensor:
    """This rank's shard of the packed ``x`` along ``dim`` in the original's placement for ``kind``."""
    if kind == "llama3":
        return x.chunk(world_size, dim=dim)[rank].contiguous()
    parts = []
    for a, b in zip(cu, cu[1:]):
        doc = x.narrow(dim, a, b - a)
        if kind == "ring":
            parts.append(doc.chunk(world_size, dim=dim)[rank])
        elif kind == "zigzag":
            chunks = doc.chunk(2 * world_size, dim=dim)
            parts += [chunks[rank], chunks[2 * world_size - 1 - rank]]
        else:
            raise ValueError(f"unknown placement {kind!r}; expected one of {sorted(KINDS)}")
    return torch.cat(parts, dim=dim).contiguous()


def packed_reference(q, k, v, cu: Sequence[int], causal: bool, scale: float, window=(-1, -1)):
    """One process's fp64 attention over packed documents ``[T, H, D]``: out ``[T, H, Dv]``, lse ``[H, T]``."""
    outs, lses = [], []
    for a, b in zip(cu, cu[1:]):
        o, lse = reference_attention(q[None, a:b], k[None, a:b], v[None, a:b], causal, scale, window=window)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def function_name(kind: str, packing: str) -> str:
    """e.g. ``("llama3", "kvpacked")`` -> ``"llama3_flash_attn_varlen_kvpacked_func"``."""
    return f"{KINDS[kind]}_{packing + '_' if packing else ''}func"


def doc_lengths(kind: str, world_size: int) -> tuple[int, ...]:
    """Uneven documents the original's placement for ``kind`` can hold on ``world_size`` ranks."""
    if kind == "ring":
        return tuple(world_size * a for a in (3, 1, 4, 2))
    if kind == "zigzag":
        return tuple(2 * world_size * a for a in (2, 1, 3))
    # llama3 cuts anywhere: lengths of no pattern, the last one pads the total to a multiple of N
    lengths = [7, 1, 12, 3, 2 * world_size + 1]
    lengths[-1] += -sum(lengths) % world_size
    return tuple(lengths)


def varlen_case(rank: int, world_size: int, ref: Any, *, kind: str, packing: str, causal: bool, dtype: str,
                heads: int = 4, kv_heads: int = 2, head_dim: int = 8, window: tuple = (-1, -1),
                scale: float | None = None, return_probs: bool = False, explicit_group: bool = False,
                against_original: bool = True, prepared: str = "ours", heads_k_stride: int = 1,
                seed: int = 0) -> dict:
    """Ours on this rank's shard in the original's placement, against one process's fp64 attention over the
    packed documents (``out``, ``dq``, ``dk``, ``dv``, ``lse``: excess errors, <= 0 passes) and, with ``ref`` and
    ``against_original``, against the original's forward on the same shards (``orig_out``, ``orig_lse``,
    ``orig_like``). llama3: ``prepared="ours"`` takes the view from our ``llama3_flash_attn_prepare_cu_seqlens``
    (no communication), ``"copy"`` from copies of it (ours then gathers every rank's view). ``*_ok`` must be True."""
    import cp_attention.compat.ring_flash_attn as ours

    dt = dtype_from_name(dtype)
    name = function_name(kind, packing)
    cu = [0]
    for n in doc_lengths(kind, world_size):
        cu.append(cu[-1] + n)
    total = cu[-1]
    q, k, v, dout = (t[0] for t in make_inputs(seed, 1, total, heads, kv_heads, head_dim, head_dim, dt))
    local = lambda t, dim=0: varlen_place(t, kind, cu, rank, world_size, dim)  # noqa: E731
    lse_in_loss = return_probs and dt != torch.float64
    sc = head_dim ** -0.5 if scale is None else scale

    qr, kr, vr = (t.double().clone().requires_grad_() for t in (q, k, v))
    out_ref, lse_ref = packed_reference(qr, kr, vr, cu, causal, sc, window)
    dlse = torch.randn(lse_ref.shape, generator=torch.Generator().manual_seed(seed + 7), dtype=torch.float64)
    ((out_ref * dout.double()).sum() + ((lse_ref * dlse).sum() if lse_in_loss else 0.0)).backward()

    ql, kl, vl = local(q), local(k), local(v)
    args, grads = packed_leaves(ql, kl, vl, packing, 1)
    cu32 = torch.tensor(cu, dtype=torch.int32)
    if kind == "llama3":
        view = ours.llama3_flash_attn_prepare_cu_seqlens(cu32, causal, rank, world_size)
        if prepared == "copy":
            view = (view[0].clone(), view[1].clone(), *view[2:])
        meta = (*view[:4], heads_k_stride, view[4])
    else:
        local_cu = torch.tensor([c // world_size for c in cu], dtype=torch.int32)
        meta = (local_cu, max(b - a for a, b in zip(local_cu.tolist(), local_cu.tolist()[1:])))
    kwargs = dict(softmax_scale=scale, causal=causal, window_size=window, return_attn_probs=return_probs)
    if explicit_group:
        kwargs["group"] = dist.group.WORLD
    result = getattr(ours, name)(*args, *meta, **kwargs)
    out, lse = (result[0], result[1]) if return_probs else (result, None)
    loss = (out * local(dout)).sum()
    if lse_in_loss:
        loss = loss + (lse * local(dlse, 1).to(lse.dtype)).sum()
    loss.backward()
    tol = TOLERANCE[dtype]
    dq, dk, dv = grads()
    n_local = total // world_size
    res = {
        "structure_ok": (isinstance(result, tuple) and len(result) == 3 and result[2] is None) if return_probs
        else isinstance(result, torch.Tensor),
        "out_ok": out.dtype == dt and tuple(out.shape) == (n_local, heads, head_dim),
        "out": excess_error(out, local(out_ref), tol, 0.0),
        "dq": excess_error(dq, local(qr.grad), tol, 0.0),
        "dk": excess_error(dk, local(kr.grad), tol, 0.0),
        "dv": excess_error(dv, local(vr.grad), tol, 0.0),
    }
    if return_probs:
        res["lse_ok"] = lse.dtype == torch.float32 and tuple(lse.shape) == (heads, n_local)
        res["lse"] = excess_error(lse, local(lse_ref, 1), FP32_TOLERANCE, 0.0)
    if ref is not None and against_original:
        if kind == "llama3":  # the original's own view, from its own prepare
            theirs_view = ref.llama3_flash_attn_prepare_cu_seqlens(cu32, causal, rank, world_size)
            meta = (*theirs_view[:4], heads_k_stride, theirs_view[4])
        with torch.no_grad():
            theirs = getattr(ref, name)(*(a.detach() for a in args), *meta, **kwargs)
        t_out = theirs[0] if return_probs else theirs
        res["orig_like"] = (type(theirs) is type(result) and t_out.dtype == out.dtype and t_out.shape == out.shape
                            and (not return_probs or (len(theirs) == 3 and theirs[2] is None
                                                      and theirs[1].dtype == lse.dtype
                                                      and theirs[1].shape == lse.shape)))
        res["orig_out"] = excess_error(out.detach(), t_out, FP32_TOLERANCE, 0.0)
        if return_probs:
            res["orig_lse"] = excess_error(lse.detach(), theirs[1], FP32_TOLERANCE, 0.0)
    return res


def llama3_bad_view_case(rank: int, world_size: int, ref: Any, *, seed: int = 0) -> dict:
    """Rank 0 passes a view prepared for ``causal=False`` (copied: ours must gather the views), the others one for
    ``causal=True``, all call with ``causal=True``: every rank must raise the same ``ValueError`` naming rank 0
    (``refused_ok``), none may hang."""
    import cp_attention.compat.ring_flash_attn as ours

    cu = torch.tensor([0, 5, 7, 6 * world_size], dtype=torch.int32)  # a document crosses rank 0's end
    view = ours.llama3_flash_attn_prepare_cu_seqlens(cu, rank != 0, rank, world_size)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(6, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    try:
        ours.llama3_flash_attn_varlen_func(q, k, v, view[0].clone(), view[1].clone(), view[2], view[3], 1, view[4],
                                           causal=True)
    except ValueError as e:
        return {"refused_ok": "rank 0's cu_seqlens_q, cu_seqlens_k and local_k_slice are not" in str(e)}
    return {"refused_ok": False}


def varlen_matrix(world_size: int) -> list[tuple[Callable[..., Any], dict]]:
    """Every varlen function (3 placements x 3 packings) in fp32 and fp64, causal and not, GQA or MQA (not for
    qkvpacked), a custom ``softmax_scale``, ``return_attn_probs``, an explicit group and llama3's gathered view
    and ``heads_k_stride`` spread over the cases, plus windows for each placement. The original is compared
    where it is a reference: zigzag causal only (it asserts ``causal``), windows only for llama3 causal (the
    others apply the window inside each ring block, llama3's non-causal one aligned to its key slice)."""
    cases = []
    j = 0
    for kind in KINDS:
        for packing in PACKINGS:
            for dtype in TOLERANCE:
                for causal in (True, False):
                    j += 1
                    heads = (4, 4) if packing == "qkvpacked" else ((4, 2) if j % 3 else (4, 1))
                    cases.append(dict(kind=kind, packing=packing, dtype=dtype, causal=causal, heads=heads[0],
                                      kv_heads=heads[1], scale=0.37 if j % 4 == 1 else None,
                                      return_probs=bin(j).count("1") % 2 == 1, explicit_group=j % 5 == 0,
                                      prepared="copy" if j % 3 == 1 else "ours",
                                      heads_k_stride=heads[1] if j % 2 else 1,
                                      against_original=kind != "zigzag" or causal))
        for dtype in TOLERANCE:
            for causal, window in ((True, (3, -1)), (True, (4, 2)), (False, (2, 5)), (False, (-1, 1))):
                j += 1
                cases.append(dict(kind=kind, packing=PACKINGS[j % 3], dtype=dtype, causal=causal, heads=4,
                                  kv_heads=4 if j % 3 == 2 else 2, window=window, return_probs=j % 2 == 0,
                                  prepared="copy" if j % 4 == 0 else "ours",
                                  against_original=kind == "llama3" and causal))
    return [(varlen_case, dict(kw, seed=100 * world_size + i)) for i, kw in enumerate(cases)] + [
        (llama3_bad_view_case, dict(seed=world_size))]


def case_label(kwargs: dict) -> str:
    """A short name of a varlen case, for failure messages."""
    keys = ("kind", "packing", "dtype", "causal", "heads", "kv_heads", "window", "scale", "return_probs",
            "explicit_group", "prepared", "heads_k_stride")
    return " ".join(f"{k}={kwargs[k]}" for k in keys if k in kwargs)
