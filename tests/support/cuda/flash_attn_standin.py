"""A stand-in for the flash-attn package (2.6, 2.7, 2.8), to test the ``flash_attn`` kernel's argument
plumbing without a GPU: ``flash_attn.flash_attn_interface._flash_attn_forward`` and
``_flash_attn_backward`` (and the varlen ``_flash_attn_varlen_forward`` / ``_backward``, packed sequences
``[total, H, D]`` with int32 ``cu_seqlens``, LSE ``[H, total_q]``, as ring-flash-attention calls them)
with the exact signatures and return values of each version (2.7+ as
``torch.library`` custom ops whose backward writes dq/dk/dv in place, as the real ones), computed with
plain torch in fp64 on any device, with flash-attn's conventions and checks: bshd, causal mask and
windows aligned BOTTOM-RIGHT, ``seqlen_q == 1`` turns causal off, softcap on the scaled scores, GQA, LSE
``[B, H, Sq]`` fp32 natural log (read contiguous by the backward), equal head dims at most 256 (2.7+:
a multiple of 8). :func:`install` puts it into ``sys.modules``. Also home of the fp64 attention math
the aten stand-ins (``tests/support/cuda/aten_standins.py``) share.
"""

from __future__ import annotations

import sys
import types

import torch

__all__ = ["attend", "attend_grads", "band", "install", "VERSIONS"]

VERSIONS = ("2.6.3", "2.7.4", "2.8.3")


def band(sq: int, sk: int, left: int, right: int, device=None) -> torch.Tensor | None:
    """``[Sq, Sk]`` bool, flash's window aligned bottom-right: query i sees key j iff
    i + Sk - Sq - left <= j <= i + Sk - Sq + right (-1 = unbounded); None if both are unbounded."""
    if left < 0 and right < 0:
        return None
    off = (torch.arange(sk, device=device)[None, :] - torch.arange(sq, device=device)[:, None]) - (sk - sq)
    ok = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if left >= 0:
        ok &= off >= -left
    if right >= 0:
        ok &= off <= right
    return ok


def _scores(q, k, scale, allowed, softcap):
    """fp64 scores ``[B, H, Sq, Sk]`` (query head h reads K/V head h // (H // Hkv)), capped and masked,
    and the cap's derivative."""
    rep = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(rep, 2)) * scale
    slope = None
    if softcap:
        t = torch.tanh(s / softcap)
        s, slope = softcap * t, 1 - t * t
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    return s, slope


def attend(q, k, v, scale: float, allowed=None, softcap: float = 0.0):
    """``out [B, Sq, H, Dv]`` (fp64) and ``lse [B, H, Sq]`` (fp64); ``allowed`` broadcasts to ``[B, H, Sq, Sk]``."""
    s, _ = _scores(q, k, scale, allowed, softcap)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None])
    rep = q.shape[2] // k.shape[2]
    return torch.einsum("bhqk,bkhd->bqhd", p, v.double().repeat_interleave(rep, 2)), lse


def attend_grads(dout, q, k, v, out, lse, scale: float, allowed=None, softcap: float = 0.0):
    """``dq, dk, dv`` (fp64, dk/dv with K/V's own heads) given the final ``out``/``lse``."""
    rep = q.shape[2] // k.shape[2]
    kr, vr = k.double().repeat_interleave(rep, 2), v.double().repeat_interleave(rep, 2)
    s, slope = _scores(q, k, scale, allowed, softcap)
    p = torch.exp(s - lse.double()[..., None])
    do = dout.double()
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
    dp = torch.einsum("bqhd,bkhd->bhqk", do, vr)
    delta = (do * out.double()).sum(-1).transpose(1, 2)[..., None]
    ds = p * (dp - delta) * scale
    if slope is not None:
        ds = ds * slope
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kr)
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.double())

    def fold(x):
        return x.reshape(*x.shape[:2], k.shape[2], rep, x.shape[-1]).sum(3)
    return dq, fold(dk), fold(dv)


def _check_inputs(q, k, v, split: bool) -> None:
    if not (q.dtype == k.dtype == v.dtype):
        raise RuntimeError("query and key/value must have the same dtype")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        raise RuntimeError("Input tensor must have contiguous last dimension")
    d = q.shape[-1]
    if k.shape[-1] != d or v.shape[-1] != d or k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0]:
        raise RuntimeError("k and v must have shape (batch_size, seqlen_k, num_heads_k, head_size) like q's head_size")
    if d > 256 or (split and d % 8):
        raise RuntimeError("head_size must be a multiple of 8 and at most 256")
    if q.shape[2] % k.shape[2]:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")


def _mask(sq, sk, causal, left, right, device, forward: bool):
    # flash_api.cpp: windows >= seqlen_k are unbounded; the forward turns causal off for one query row;
    # causal is the window (-1, 0), bottom-right aligned.
    left, right = (-1 if left >= sk else left), (-1 if right >= sk else right)
    if forward and sq == 1:
        causal = False
    if causal:
        right = 0
    return band(sq, sk, left, right, device)


def _forward(q, k, v, dropout_p, softmax_scale, causal, left, right, softcap, alibi_slopes, split):
    _check_inputs(q, k, v, split)
    if dropout_p or alibi_slopes is not None:
        raise RuntimeError("the stand-in models dropout 0 and no ALiBi only")
    out, lse = attend(q, k, v, softmax_scale, _mask(q.shape[1], k.shape[1], causal, left, right, q.device, True),
                      softcap)
    return out.to(q.dtype), lse.float()


def _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, left, right, softcap,
              alibi_slopes, split):
    _check_inputs(q, k, v, split)
    b, sq, h, _ = q.shape
    if out.shape != q.shape or dout.shape != q.shape or out.dtype != q.dtype or dout.dtype != q.dtype:
        raise RuntimeError("out and dout must have q's shape and dtype")
    if softmax_lse.shape != (b, h, sq) or softmax_lse.dtype != torch.float32 or not softmax_lse.is_contiguous():
        raise RuntimeError("softmax_lse: the kernel reads a contiguous fp32 [batch, heads, seqlen_q] buffer")
    grads = attend_grads(dout, q, k, v, out, softmax_lse, softmax_scale,
                         _mask(sq, k.shape[1], causal, left, right, q.device, False), softcap)
    made = []
    for given, like, g in zip((dq, dk, dv), (q, k, v), grads):
        buf = torch.empty_like(like) if given is None else given
        if buf.shape != like.shape or buf.dtype != like.dtype or buf.stride(-1) != 1:
            raise RuntimeError("dq/dk/dv must have the shape and dtype of q/k/v and a contiguous last dimension")
        buf.copy_(g)
        made.append(buf)
    softmax_d = (dout.double() * out.double()).sum(-1).transpose(1, 2).float()
    return made, softmax_d


def _varlen_mask(q, k, cu_q, cu_k, max_q, max_k, causal, left, right, forward: bool):
    """``[Tq, Tk]`` bool for flash-attn's varlen kernels: a query sees keys of its own sequence only, in
    that sequence's window aligned bottom-right; rows past ``cu_q[-1]`` see nothing. As flash_api.cpp's
    ``mha_varlen_fwd``/``_bwd``: windows >= ``max_seqlen_k`` are unbounded, the forward turns causal off
    when ``max_seqlen_q == 1``, causal is the window's right edge 0."""
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or not cu.is_contiguous():
            raise RuntimeError(f"{name} must have dtype int32 (a contiguous 1-D tensor)")
    if cu_q.numel() != cu_k.numel() or cu_q.numel() < 2:
        raise RuntimeError("cu_seqlens_q and cu_seqlens_k must have shape (batch_size + 1), batch size positive")
    if q.dim() != 3 or k.dim() != 3:
        raise RuntimeError("varlen q, k, v must be (total, num_heads, head_size)")
    cq, ck = cu_q.long().cpu(), cu_k.long().cpu()
    lq, lk = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
    if (lq < 0).any() or (lk < 0).any() or int(cq[-1]) > q.shape[0] or int(ck[-1]) > k.shape[0]:
        raise RuntimeError("cu_seqlens must increase and end within the tensors' total length")
    if int(lq.max()) > max_q or int(lk.max()) > max_k:
        # the kernel's grid covers max_seqlen rows: longer sequences would be cut, not refused
        raise RuntimeError(f"a sequence is longer than max_seqlen_q={max_q} / max_seqlen_k={max_k}")
    left, right = (-1 if left >= max_k else left), (-1 if right >= max_k else right)
    if forward and max_q == 1:
        causal = False
    if causal:
        right = 0
    iq, ik = torch.arange(q.shape[0]), torch.arange(k.shape[0])
    bq = torch.searchsorted(cq, iq, right=True) - 1
    bk = torch.searchsorted(ck, ik, right=True) - 1
    bq = torch.where(iq < cq[-1], bq, -1)
    bk = torch.where(ik < ck[-1], bk, -2)
    ok = bq[:, None] == bk[None, :]
    bq0, bk0 = bq.clamp(min=0), bk.clamp(min=0)
    # offset of key j from query i's diagonal, bottom-right aligned within their sequence
    off = ((ik - ck[bk0])[None, :] - (iq - cq[bq0])[:, None]) - (lk[bq0] - lq[bq0])[:, None]
    if left >= 0:
        ok &= off >= -left
    if right >= 0:
        ok &= off <= right
    return ok.to(q.device)


def _varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal, left, right, softcap,
                    alibi_slopes, extras):
    if dropout_p or alibi_slopes is not None or any(x is not None for x in extras):
        raise RuntimeError("the stand-in models dropout 0, no ALiBi, no block_table/leftpad_k/seqused_k only")
    if not (q.dtype == k.dtype == v.dtype) or any(t.stride(-1) != 1 for t in (q, k, v)):
        raise RuntimeError("q, k, v must have one dtype and a contiguous last dimension")
    if q.shape[-1] > 256 or q.shape[1] % k.shape[1]:
        raise RuntimeError("head_size at most 256; number of heads in key/value must divide those in query")
    allowed = _varlen_mask(q, k, cu_q, cu_k, max_q, max_k, causal, left, right, True)
    out, lse = attend(q[None], k[None], v[None], softmax_scale, allowed[None, None], softcap)
    # flash-attn's kernel: a row that sees no key gets out 0 and LSE +inf
    empty = ~allowed.any(1)
    out, lse = out[0].masked_fill(empty[:, None, None], 0.0), lse[0].masked_fill(empty[None, :], float("inf"))
    return out.to(q.dtype), lse.float()


def _varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, dropout_p,
                     softmax_scale, causal, left, right, softcap, alibi_slopes):
    if dropout_p or alibi_slopes is not None:
        raise RuntimeError("the stand-in models dropout 0 and no ALiBi only")
    if q.shape[-1] % 8 or q.shape[-1] > 256:
        raise RuntimeError("head_size should be a multiple of 8, at most 256")
    if out.shape != q.shape or dout.shape != q.shape or out.dtype != q.dtype or dout.dtype != q.dtype:
        raise RuntimeError("out and dout must have q's shape and dtype")
    if softmax_lse.shape != (q.shape[1], q.shape[0]) or softmax_lse.dtype != torch.float32 \
            or not softmax_lse.is_contiguous():
        raise RuntimeError("softmax_lse: the kernel reads a contiguous fp32 [num_heads, total_q] buffer")
    allowed = _varlen_mask(q, k, cu_q, cu_k, max_q, max_k, causal, left, right, False)
    grads = attend_grads(dout[None], q[None], k[None], v[None], out[None], softmax_lse[None], softmax_scale,
                         allowed[None, None], softcap)
    for given, like, g in zip((dq, dk, dv), (q, k, v), grads):
        if given is not None:
            if given.shape != like.shape or given.dtype != like.dtype or given.stride(-1) != 1:
                raise RuntimeError("dq/dk/dv must have the shape and dtype of q/k/v and a contiguous last dimension")
            given.copy_(g[0])
    # softmax_d [H, total_q + 128 * batch]: sequence i's rows start at cu_seqlens_q[i] + 128 * i
    batch = cu_q.numel() - 1
    delta = (dout.double() * out.double()).sum(-1).t().float()
    softmax_d = torch.zeros(q.shape[1], q.shape[0] + 128 * batch, dtype=torch.float32, device=q.device)
    cq = cu_q.long().cpu()
    rows = torch.arange(int(cq[-1]))
    seq = torch.searchsorted(cq, rows, right=True) - 1
    softmax_d[:, (rows + 128 * seq).to(q.device)] = delta[:, :int(cq[-1])]
    return softmax_d


def _v26():
    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                            return_softmax):
        out, lse = _forward(q, k, v, dropout_p, softmax_scale, causal, *window_size, softcap, alibi_slopes, False)
        return out, q, k, v, out, lse, None, torch.empty(2, dtype=torch.int64)

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                             window_size, softcap, alibi_slopes, deterministic, rng_state=None):
        (dq, dk, dv), softmax_d = _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
                                            causal, *window_size, softcap, alibi_slopes, False)
        return dq, dk, dv, softmax_d
    return _flash_attn_forward, _flash_attn_backward


def _v26_varlen():
    def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                   softmax_scale, causal, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                   return_softmax=False, block_table=None, leftpad_k=None, seqused_k=None):
        out, lse = _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                   softmax_scale, causal, *window_size, softcap, alibi_slopes,
                                   (block_table, leftpad_k, seqused_k))
        return out, q, k, v, out, lse, None, torch.empty(2, dtype=torch.int64)

    def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                    max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                    softcap, alibi_slopes, deterministic, rng_state=None):
        made = [torch.empty_like(t) if g is None else g for g, t in ((dq, q), (dk, k), (dv, v))]
        softmax_d = _varlen_backward(dout, q, k, v, out, softmax_lse, *made, cu_seqlens_q, cu_seqlens_k,
                                     max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, *window_size,
                                     softcap, alibi_slopes)
        return (*made, softmax_d)
    return _flash_attn_varlen_forward, _flash_attn_varlen_backward


_CUSTOM_OPS: dict[str, tuple] = {}


def _v27_varlen(tag: str):
    """flash-attn 2.7 / 2.8's ``_flash_attn_varlen_forward`` / ``_backward`` (flash_attn_interface.py at
    v2.8.x): custom ops, ``window_size_left/right`` split, LSE ``[H, total_q]`` fp32."""
    key = f"varlen_{tag}"
    if key in _CUSTOM_OPS:
        return _CUSTOM_OPS[key]
    ns = f"cp_flash_attn_standin_{tag}"

    @torch.library.custom_op(f"{ns}::_flash_attn_varlen_forward", mutates_args=())
    def _flash_attn_varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                   cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                                   dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int = -1,
                                   window_size_right: int = -1, softcap: float = 0.0,
                                   alibi_slopes: torch.Tensor | None = None, return_softmax: bool = False,
                                   block_table: torch.Tensor | None = None,
                                   leftpad_k: torch.Tensor | None = None,
                                   seqused_k: torch.Tensor | None = None,
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        out, lse = _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                   softmax_scale, causal, window_size_left, window_size_right, softcap,
                                   alibi_slopes, (block_table, leftpad_k, seqused_k))
        return out, lse, torch.empty(0, dtype=q.dtype, device=q.device), torch.empty(2, dtype=torch.int64)

    @torch.library.custom_op(f"{ns}::_flash_attn_varlen_backward", mutates_args=("dq", "dk", "dv"))
    def _flash_attn_varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                    out: torch.Tensor, softmax_lse: torch.Tensor, dq: torch.Tensor | None,
                                    dk: torch.Tensor | None, dv: torch.Tensor | None,
                                    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                                    max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool,
                                    window_size_left: int, window_size_right: int, softcap: float,
                                    alibi_slopes: torch.Tensor | None, deterministic: bool,
                                    rng_state: torch.Tensor | None = None) -> torch.Tensor:
        # as the real op: gradients land only in the given buffers
        return _varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left,
                                window_size_right, softcap, alibi_slopes)

    _CUSTOM_OPS[key] = (_flash_attn_varlen_forward, _flash_attn_varlen_backward)
    return _CUSTOM_OPS[key]


def _v27(tag: str):
    # One registration per process and tag: torch.library ops cannot be defined twice.
    if tag in _CUSTOM_OPS:
        return _CUSTOM_OPS[tag]
    ns = f"cp_flash_attn_standin_{tag}"

    @torch.library.custom_op(f"{ns}::_flash_attn_forward", mutates_args=())
    def _flash_attn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, softmax_scale: float,
                            causal: bool, window_size_left: int, window_size_right: int, softcap: float,
                            alibi_slopes: torch.Tensor | None, return_softmax: bool
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        out, lse = _forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                            alibi_slopes, True)
        return out, lse, torch.empty(0, dtype=q.dtype, device=q.device), torch.empty(2, dtype=torch.int64)

    @torch.library.custom_op(f"{ns}::_flash_attn_backward", mutates_args=("dq", "dk", "dv"))
    def _flash_attn_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                             softmax_lse: torch.Tensor, dq: torch.Tensor | None, dk: torch.Tensor | None,
                             dv: torch.Tensor | None, dropout_p: float, softmax_scale: float, causal: bool,
                             window_size_left: int, window_size_right: int, softcap: float,
                             alibi_slopes: torch.Tensor | None, deterministic: bool,
                             rng_state: torch.Tensor | None = None) -> torch.Tensor:
        # as the real op: gradients land only in the given buffers; one allocated here is lost
        return _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         window_size_left, window_size_right, softcap, alibi_slopes, True)[1]

    _CUSTOM_OPS[tag] = (_flash_attn_forward, _flash_attn_backward)
    return _CUSTOM_OPS[tag]


def install(monkeypatch, version: str, hide_signature: bool = False) -> types.ModuleType:
    """Put a stand-in of flash-attn ``version`` into ``sys.modules`` (undone by ``monkeypatch``) and
    return its ``flash_attn_interface``. As in the real package, 2.6's functions are plain functions
    and 2.7+'s are ``CustomOpDef`` s; ``hide_signature`` wraps them as ``(*args, **kwargs)`` so only
    ``flash_attn.__version__`` tells the calling convention."""
    fwd, bwd = _v26() if version.startswith("2.6") else _v27(version.replace(".", "_"))
    if hide_signature:
        fwd, bwd = (lambda f: lambda *a, **kw: f(*a, **kw))(fwd), (lambda f: lambda *a, **kw: f(*a, **kw))(bwd)
    iface = types.ModuleType("flash_attn.flash_attn_interface")
    iface._flash_attn_forward, iface._flash_attn_backward = fwd, bwd
    iface._flash_attn_varlen_forward, iface._flash_attn_varlen_backward = (
        _v26_varlen() if version.startswith("2.6") else _v27_varlen(version.replace(".", "_")))
    pkg = types.ModuleType("flash_attn")
    pkg.__version__ = version
    pkg.flash_attn_interface = iface
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", iface)
    return iface
