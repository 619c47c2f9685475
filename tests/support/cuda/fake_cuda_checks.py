"""The fused ops under ``tests/support/cuda/fake_cuda_support.py``: P7, each aten fused-op call bound to the real op's
schema and checked against what the CUDA code checks or assumes (metadata only; flash_api.cpp,
mem_eff_attention, cudnn/MHA.cpp), then run (the real op's fake kernel); and fake kernels for the
flash-attn 2.7+ stand-in's custom ops."""

from __future__ import annotations

import os
import traceback
from collections import Counter
from typing import Callable

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .aten_standins import bind

aten = torch.ops.aten
_LIB_DIR = os.sep + "cp_attention" + os.sep
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

__all__ = ["CheckedAten", "PreconditionError", "register_flash_attn_fakes", "round_up", "where_in_library"]


def where_in_library() -> str:
    """``path:line (function)`` of the innermost cp_attention frame on the stack."""
    frames = [f for f in traceback.extract_stack() if _LIB_DIR in f.filename]
    if not frames:
        return "?"
    f = frames[-1]
    return f"{os.path.relpath(f.filename, _REPO)}:{f.lineno} ({f.name})"




# --------------------------------------------------------------------------- P7 precondition checks
def round_up(n, m):
    return -(-n // m) * m


HALF = (torch.float16, torch.bfloat16)


def _varlen_checks(a, q, k, cu_q_name, cu_k_name, max_q_name, max_k_name, values):
    """flash_api.cpp mha_varlen_fwd / mha_varlen_bwd on the offsets: int32, contiguous, on the device,
    one sequence count; with their values known (uploaded by the plan), well formed, the max lengths
    at least the longest sequence, causal sequences square (the op's causal mask is bottom-right)."""
    cu_q, cu_k = a[cu_q_name], a[cu_k_name]
    yield cu_q is not None and cu_k is not None, "cum_seq_q and cum_seq_k both given"
    if cu_q is None or cu_k is None:
        return
    yield all(c.dtype == torch.int32 and c.dim() == 1 and c.is_contiguous() and c.device.type == "cuda"
              for c in (cu_q, cu_k)), "cu_seqlens int32, 1-D, contiguous, on the device"
    yield cu_q.numel() == cu_k.numel() >= 2, f"one batch size: {cu_q.numel()} vs {cu_k.numel()} offsets"
    yield q.dim() == 3 and k.dim() == 3, "varlen q/k/v are [total, H, D]"
    yield isinstance(a[max_q_name], int) and isinstance(a[max_k_name], int), "max lengths are host ints"
    vq, vk = values.get(id(cu_q)), values.get(id(cu_k))
    if vq is None or vk is None:
        yield False, "cu_seqlens values unknown (not uploaded from the host by the plan)"
        return
    dq, dk = (vq[1:] - vq[:-1]).tolist(), (vk[1:] - vk[:-1]).tolist()
    yield int(vq[0]) == 0 and int(vk[0]) == 0 and min(dq) >= 0 and min(dk) >= 0, "offsets from 0, nondecreasing"
    yield int(vq[-1]) == q.shape[0] and int(vk[-1]) == k.shape[0], \
        f"offsets end at the totals: {int(vq[-1])}/{q.shape[0]}, {int(vk[-1])}/{k.shape[0]}"
    yield a[max_q_name] >= max(dq) and a[max_k_name] >= max(dk), \
        f"max_q/max_k {a[max_q_name]}/{a[max_k_name]} cover the longest sequences {max(dq)}/{max(dk)}"
    if a["is_causal"]:
        yield dq == dk, "causal varlen sequences square (top-left == bottom-right only there)"


def _window_checks(a, k):
    # a window only with is_causal False (mha_fwd/bwd then set the right side to 0), each side -1 or a
    # size the op does not clamp to "unbounded" (>= Sk): band_pieces never relies on the clamp
    left, right = a["window_size_left"], a["window_size_right"]
    if left is None and right is None:
        return
    yield not a["is_causal"] and left is not None and right is not None, "a window: both sides, not causal"
    sk = k.shape[-3]
    yield all(w == -1 or 0 <= w < sk for w in (left, right)), f"window ({left}, {right}) within Sk={sk} or -1"


def _flash_fwd_checks(a, values):
    # flash_api.cpp mha_fwd / mha_varlen_fwd
    q, k, v = a["query"], a["key"], a["value"]
    yield q.dtype in HALF and k.dtype == q.dtype and v.dtype == q.dtype, "fp16/bf16 and equal dtypes"
    yield all(t.device.type == "cuda" for t in (q, k, v)), "cuda tensors"
    yield all(t.stride(-1) == 1 for t in (q, k, v)), "contiguous last dim"
    yield a["dropout_p"] == 0.0 and (a["scale"] is None or a["scale"] > 0), "no dropout, positive scale"
    d, h = q.shape[-1], q.shape[-2]
    yield d % 8 == 0 and d <= 256, f"head_size {d} multiple of 8 and <= 256"
    yield h % k.shape[-2] == 0, "H % Hkv == 0"
    yield k.shape[-1] == d and tuple(v.shape) == tuple(k.shape), \
        f"CHECK_SHAPE k/v == (..., Hkv, {d}): k {tuple(k.shape)} v {tuple(v.shape)}"
    yield from _window_checks(a, k)
    if a["cum_seq_q"] is None and a["cum_seq_k"] is None:
        yield all(t.dim() == 4 for t in (q, k, v)) and q.shape[0] == k.shape[0], "dense: 4-D, one batch"
        yield a["max_q"] == q.shape[1] and a["max_k"] == k.shape[1], "max_q/max_k are the dense lengths"
    else:
        yield from _varlen_checks(a, q, k, "cum_seq_q", "cum_seq_k", "max_q", "max_k", values)


def _flash_bwd_checks(a, values):
    # flash_api.cpp mha_bwd / mha_varlen_bwd; attention_backward.cu makes grad_out and out contiguous first
    q, k, v, o, do, lse = a["query"], a["key"], a["value"], a["out"], a["grad_out"], a["logsumexp"]
    yield q.dtype in HALF and all(t.dtype == q.dtype for t in (k, v, o, do)), "q,k,v,out,dout one fp16/bf16 dtype"
    yield all(t.device.type == "cuda" for t in (q, k, v, o, do, lse)), "cuda tensors"
    yield all(t.stride(-1) == 1 for t in (q, k, v)), "q,k,v contiguous last dim"
    yield a["dropout_p"] == 0.0 and (a["scale"] is None or a["scale"] > 0), "no dropout, positive scale"
    hs, hs_og = q.shape[-1], do.shape[-1]
    yield hs % 8 == 0 and hs_og % 8 == 0 and hs <= 256 and hs == round_up(hs_og, 8), f"head sizes {hs}/{hs_og}"
    h, hkv = q.shape[-2], k.shape[-2]
    yield h % hkv == 0 and k.shape[-1] == hs and tuple(v.shape) == tuple(k.shape), "k/v shapes"
    yield tuple(o.shape) == tuple(q.shape) and tuple(do.shape) == tuple(q.shape[:-1]) + (hs_og,), \
        f"out {tuple(o.shape)} / dout {tuple(do.shape)} like q {tuple(q.shape)}"
    rows = (q.shape[0], h, q.shape[1]) if q.dim() == 4 else (h, q.shape[0])
    yield lse.dtype == torch.float32 and tuple(lse.shape) == rows, \
        f"lse fp32 {list(rows)} ([B,H,Sq] dense, [H,Tq] varlen), got {tuple(lse.shape)}"
    yield lse.is_contiguous(), "lse read as a contiguous buffer (raw pointer)"
    yield a["rng_state"].device.type == "cuda" and a["rng_state"].numel() == 2, "rng_state: 2 values on the device"
    yield from _window_checks(a, k)
    if a["cum_seq_q"] is None and a["cum_seq_k"] is None:
        yield q.dim() == 4 and a["max_q"] == q.shape[1] and a["max_k"] == k.shape[1], "dense: 4-D, dense lengths"
    else:
        yield from _varlen_checks(a, q, k, "cum_seq_q", "cum_seq_k", "max_q", "max_k", values)


def _eff_common(q, k, v, bias, sq, sk):
    yield all(t.dim() == 4 for t in (q, k, v)), "4-D"
    yield all(t.device.type == "cuda" for t in (q, k, v)), "cuda tensors"
    yield q.dtype == k.dtype == v.dtype, "one dtype"
    yield q.shape[0] == k.shape[0] == v.shape[0] and k.shape[1] == v.shape[1], "batch / key length"
    yield q.shape[2] == k.shape[2] == v.shape[2], f"heads q,k,v equal (no GQA): {q.shape[2]},{k.shape[2]},{v.shape[2]}"
    yield q.shape[3] == k.shape[3], "q/k head dim equal"
    yield all(t.stride(-1) == 1 for t in (q, k, v)), "last dim contiguous"
    if q.dtype in HALF:
        yield all(s % 8 == 0 for t in (q, k, v) for s in t.stride()[:3]), \
            "strides B/M/H multiple of 8 (16-byte aligned kernels)"
    if bias is not None:
        yield bias.dtype == q.dtype, "bias dtype == q dtype"
        yield tuple(bias.shape) == (q.shape[0], q.shape[2], sq, sk), f"bias shape {tuple(bias.shape)}"
        yield bias.stride(3) == 1 and all(s % 8 == 0 for s in bias.stride()[:3]), f"bias strides {bias.stride()}"


def _eff_fwd_checks(a, values):
    q, k, v, bias = a["query"], a["key"], a["value"], a["bias"]
    yield from _eff_common(q, k, v, bias, q.shape[1], k.shape[1])
    yield a["cu_seqlens_q"] is None and a["compute_log_sumexp"] and a["dropout_p"] == 0.0, "dense, LSE, no dropout"
    yield a["custom_mask_type"] in (0, 1), "mask type none or top-left causal"


def _eff_bwd_checks(a, values):
    # attention_backward.cu _efficient_attention_backward
    q, k, v, bias, o, do, lse = (a[n] for n in ("query", "key", "value", "bias", "out", "grad_out_", "logsumexp"))
    yield from _eff_common(q, k, v, bias, q.shape[1], k.shape[1])
    b, sq, h, _ = q.shape
    yield do.dim() == 4 and do.shape[:3] == q.shape[:3] and do.shape[3] == v.shape[3], "grad_out [B,Sq,H,Kv]"
    yield tuple(o.shape) == tuple(do.shape) and o.is_contiguous(), "out [B,Sq,H,Kv] contiguous (o_strideM derived)"
    yield (lse.dtype == torch.float32 and tuple(lse.shape[:2]) == (b, h) and lse.shape[2] >= round_up(sq, 32)), \
        f"lse fp32 [B,H,>=round32(Sq)], got {tuple(lse.shape)}"
    yield lse.stride(0) % 8 == 0 and lse.stride(1) % 8 == 0, "lse batch/head strides multiple of 8"
    yield a["max_seqlen_q"] == sq and a["max_seqlen_k"] == k.shape[1] and not a["bias_requires_grad"], "dense sizes"
    yield a["custom_mask_type"] in (0, 1), "mask type none or top-left causal"


def _cudnn_common(q, k, v, causal):
    # the conventions tests/support/cuda/aten_standins.py models for cuDNN's MHA
    yield all(t.device.type == "cuda" for t in (q, k, v)), "cuda tensors"
    yield q.dtype in HALF and k.dtype == q.dtype and v.dtype == q.dtype, "fp16/bf16, one dtype"
    yield all(t.dim() == 4 and t.stride(-1) == 1 for t in (q, k, v)), "bhsd, contiguous last dim"
    yield q.shape[1] == k.shape[1] == v.shape[1], "equal heads (no GQA relied on)"
    yield q.shape[-1] == k.shape[-1] == v.shape[-1] and q.shape[-1] % 8 == 0 and q.shape[-1] <= 128, \
        f"equal head dims, multiple of 8, <= 128: {q.shape[-1]},{k.shape[-1]},{v.shape[-1]}"
    yield not causal or q.shape[2] == k.shape[2], "causal only on square blocks"
    # "cuDNN Frontend error: s_q = s_kv = 1 is not supported" (an H200), and NaN dK/dV for Sq = 1 in the
    # backward (cudnn-frontend #1072): no one-token side ever reaches it
    yield min(q.shape[2], k.shape[2]) >= 2, f"no one-token block side: Sq={q.shape[2]}, Sk={k.shape[2]}"


def _cudnn_fwd_checks(a, values):
    yield from _cudnn_common(a["query"], a["key"], a["value"], a["is_causal"])
    yield a["attn_bias"] is None and a["compute_log_sumexp"] and a["dropout_p"] == 0.0, "no bias, LSE, no dropout"


def _cudnn_bwd_checks(a, values):
    q, o, do, lse = a["query"], a["out"], a["grad_out"], a["logsumexp"]
    yield from _cudnn_common(q, a["key"], a["value"], a["is_causal"])
    b, h, sq, _ = q.shape
    yield tuple(lse.shape) == (b, h, sq, 1) and lse.dtype == torch.float32, f"lse [B,H,Sq,1] fp32: {tuple(lse.shape)}"
    same = all(x == y for x, y, n in zip(o.stride(), do.stride(), o.shape) if n > 1)  # size-1 dims: any stride
    yield tuple(o.shape) == tuple(do.shape) and same, \
        f"out and grad_out equal strides (cuDNN < 9.5.1): {o.stride()} {do.stride()}"
    yield a["max_q"] == sq and a["max_k"] == a["key"].shape[2], "max_q/max_k"
    yield all(t.device.type == "cuda" and t.dtype == torch.int64 for t in (a["philox_seed"], a["philox_offset"])), \
        "philox seed/offset int64 on the device"


CHECKS: dict[str, Callable] = {
    "_flash_attention_forward": _flash_fwd_checks, "_flash_attention_backward": _flash_bwd_checks,
    "_efficient_attention_forward": _eff_fwd_checks, "_efficient_attention_backward": _eff_bwd_checks,
    "_scaled_dot_product_cudnn_attention": _cudnn_fwd_checks,
    "_scaled_dot_product_cudnn_attention_backward": _cudnn_bwd_checks}


class PreconditionError(RuntimeError):
    """A fused-op call that the op's CUDA code would reject (or silently mis-handle)."""


class CheckedAten:
    """Stands in for ``torch.ops.aten`` in the kernel modules: binds, checks and counts each fused-op
    call, then runs the real op (its fake kernel)."""

    def __init__(self, values: dict[int, torch.Tensor] | None = None) -> None:
        self.calls: Counter = Counter()
        self.values = {} if values is None else values  # fake device tensor id -> its real host values

    def __getattr__(self, name):
        op = getattr(aten, name)
        check = CHECKS.get(name)
        if check is None:
            return op

        def call(*args, **kwargs):
            self.calls[name] += 1
            bound = bind(name, args, kwargs)
            with unset_fake_temporarily():  # metadata, and host values: real tensors
                bad = [msg for ok, msg in check(bound, self.values) if not ok]
            if bad:
                raise PreconditionError(f"{name}: " + "; ".join(bad) + f" (called at {where_in_library()})")
            return op(*args, **kwargs)
        return call


# ------------------------------------------------------------------ flash-attn 2.7+ fake kernels
def register_flash_attn_fakes(iface, calls: Counter) -> Callable[[], None]:
    """Fake kernels for the flash-attn 2.7+ stand-in's custom ops (``tests/support/cuda/flash_attn_standin.py``),
    as flash-attn itself registers them (``register_fake`` in ``flash_attn_interface.py``: ``out``
    like q, ``softmax_lse [B, H, Sq]`` fp32, ``rng_state [2]`` int64; the backward writes the given
    dq/dk/dv), after the stand-in's own argument checks (the package's ``CHECK``s). Returns the undo."""
    from . import flash_attn_standin as standin
    fwd, bwd = iface._flash_attn_forward, iface._flash_attn_backward

    def forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                alibi_slopes, return_softmax):
        calls["_flash_attn_forward"] += 1
        standin._check_inputs(q, k, v, True)
        if dropout_p or alibi_slopes is not None or return_softmax:
            raise RuntimeError("the fake models dropout 0, no ALiBi, no softmax return only")
        b, sq, h, _ = q.shape
        return (torch.empty_like(q), torch.empty((b, h, sq), dtype=torch.float32, device=q.device),
                torch.empty((0,), dtype=q.dtype, device=q.device),
                torch.empty((2,), dtype=torch.int64, device=q.device))

    def backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size_left,
                 window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
        calls["_flash_attn_backward"] += 1
        standin._check_inputs(q, k, v, True)
        b, sq, h, _ = q.shape
        if out.shape != q.shape or dout.shape != q.shape or out.dtype != q.dtype or dout.dtype != q.dtype:
            raise RuntimeError("out and dout must have q's shape and dtype")
        lse = softmax_lse
        if tuple(lse.shape) != (b, h, sq) or lse.dtype != torch.float32 or not lse.is_contiguous():
            raise RuntimeError("softmax_lse: the kernel reads a contiguous fp32 [batch, heads, seqlen_q] buffer")
        for given, like in ((dq, q), (dk, k), (dv, v)):
            if given is not None and (given.shape != like.shape or given.dtype != like.dtype or given.stride(-1) != 1):
                raise RuntimeError("dq/dk/dv must have the shape and dtype of q/k/v and a contiguous last dimension")
        return torch.empty((b, h, round_up(sq, 128)), dtype=torch.float32, device=q.device)

    saved = (fwd._abstract_fn, bwd._abstract_fn)
    fwd.register_fake(forward)
    bwd.register_fake(backward)

    def undo():
        fwd._abstract_fn, bwd._abstract_fn = saved
    return undo
