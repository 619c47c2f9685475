"""Plain-torch stand-ins of the CUDA attention ops the ``flash``, ``efficient`` and ``cudnn`` kernels
call, to test their plumbing on CPU. Every call is first bound to the REAL schema of the installed
torch (argument count, names, keyword-only, types), then checked against what the CUDA code checks
or assumes (read in aten/src/ATen/native/transformers/cuda/{attention,attention_backward}.cu,
flash_attn/flash_api.cpp, mem_eff_attention/kernel_backward.h, cudnn/MHA.cpp), and computed in fp64
with the op's own masking convention:

- flash: equal head dims, a multiple of 8, <= 256; causal aligned BOTTOM-RIGHT (off for one query
  row in the forward); backward LSE a contiguous fp32 ``[B, H, Sq]``. Varlen (``cum_seq_q/k`` given,
  mha_varlen_fwd/bwd): q/k/v ``[T, H, D]``, int32 offsets on q's device, sequences no longer than
  ``max_q``/``max_k``, causal bottom-right per sequence, LSE ``[H, Tq]`` fp32.
- efficient: no GQA, q/k head dims equal, 8-element aligned strides; mask type 1 top-left, 2
  bottom-right; LSE out padded with +inf to a multiple of 32, which the backward reads (torch 2.11's
  kernel_forward.h: "we pad logsumexp with inf ... avoids a few bound checks") and whose batch/head
  strides must be multiples of 8; ``out`` rows of exactly H * Kv (``o_strideM()``); bias of q's dtype.
- cudnn: bhsd, no GQA, equal head dims, a multiple of 8; causal only on square blocks (its
  alignment is not relied on); LSE ``[B, H, Sq, 1]``; ``out`` and ``grad_out`` with equal strides.
"""

from __future__ import annotations

import math

import torch

from .flash_attn_standin import attend, attend_grads, band

__all__ = ["AtenStandIns", "bind"]


def _type_ok(kind: str, value) -> bool:
    if kind.startswith("Optional["):
        return value is None or _type_ok(kind[9:-1], value)
    if kind == "Tensor":  # None reaches C++ as an undefined tensor (how SDPA's own backward passes cum_seq_q)
        return value is None or isinstance(value, torch.Tensor)
    if kind in ("int", "SymInt"):
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "bool":
        return isinstance(value, bool)
    raise AssertionError(f"stand-in does not model argument type {kind}")


def bind(op: str, args: tuple, kwargs: dict) -> dict:
    """``args``/``kwargs`` bound to the parameters of ``torch.ops.aten.<op>.default`` as the dispatcher
    would, with every value's type checked; raises ``TypeError`` like a mismatched call."""
    schema = getattr(torch.ops.aten, op).default._schema
    positional = [a for a in schema.arguments if not a.kwarg_only]
    if len(args) > len(positional):
        raise TypeError(f"{op}: {len(args)} positional arguments, the schema has {len(positional)}")
    bound = {a.name: v for a, v in zip(positional, args)}
    names = {a.name for a in schema.arguments}
    for name, v in kwargs.items():
        if name not in names or name in bound:
            raise TypeError(f"{op}: unexpected or repeated argument {name!r}")
        bound[name] = v
    for a in schema.arguments:
        if a.name not in bound:
            if not a.has_default_value():
                raise TypeError(f"{op}: missing argument {a.name!r}")
            bound[a.name] = a.default_value
        elif not _type_ok(str(a.type), bound[a.name]):
            raise TypeError(f"{op}: argument {a.name!r} expects {a.type}, got {type(bound[a.name]).__name__}")
    return bound


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(what)


def _mask_type(kind: int, sq: int, sk: int, device):
    """``custom_mask_type``: 0 none, 1 causal from the top left (j <= i), 2 from the bottom right."""
    if kind == 0:
        return None
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril(0 if kind == 1 else sk - sq)


def _flash_allowed(a: dict, causal: bool, sq: int, sk: int):
    """What a dense flash call lets each query see, as flash_api.cpp's mha_fwd/mha_bwd decide it: a
    window side >= Sk becomes unbounded (-1), then ``is_causal`` sets the right side to 0; bottom-right
    aligned."""
    left, right = a.get("window_size_left"), a.get("window_size_right")
    left, right = (-1 if w is None or w >= sk else w for w in (left, right))
    if causal:
        right = 0
    return band(sq, sk, left, right)


def _scale(a: dict, d: int) -> float:
    return a["scale"] if a["scale"] is not None else d ** -0.5


class AtenStandIns:
    """Drop-in for ``torch.ops.aten`` in the kernel modules (``monkeypatch.setattr(mod, "_aten", ...)``);
    ``calls`` records each op name with its bound arguments."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def _bind(self, op, args, kwargs) -> dict:
        a = bind(op, args, kwargs)
        self.calls.append((op, a))
        return a

    # ---- flash ------------------------------------------------------------------------------------
    @staticmethod
    def _flash_checks(q, k, v) -> None:
        _require(q.dim() == k.dim() == v.dim() == 4, "dense flash takes [B, S, H, D]")
        _require(all(t.stride(-1) == 1 for t in (q, k, v)), "Input tensor must have contiguous last dimension")
        d = q.shape[-1]
        _require(k.shape[-1] == d and v.shape[-1] == d, "CHECK_SHAPE: k and v must have q's head size")
        _require(d % 8 == 0, "head_size must be a multiple of 8, this is ensured by padding!")
        _require(d <= 256, "FlashAttention only supports head dimension at most 256")
        _require(q.shape[2] % k.shape[2] == 0, "Number of heads in key/value must divide number of heads in query")

    def _flash_attention_forward(self, *args, **kwargs):
        a = self._bind("_flash_attention_forward", args, kwargs)
        q, k, v = a["query"], a["key"], a["value"]
        _require(a["dropout_p"] == 0.0, "no dropout")
        if a["cum_seq_q"] is not None or a["cum_seq_k"] is not None:
            return self._flash_varlen_forward(a)
        self._flash_checks(q, k, v)
        sq, sk = q.shape[1], k.shape[1]
        causal = a["is_causal"] and sq > 1  # mha_fwd: causal is the same as non-causal for one query row
        out, lse = attend(q, k, v, _scale(a, q.shape[-1]), _flash_allowed(a, causal, sq, sk))
        return out.to(q.dtype), lse.float(), torch.zeros(2, dtype=torch.int64), torch.empty(0), torch.empty(0)

    def _flash_attention_backward(self, *args, **kwargs):
        a = self._bind("_flash_attention_backward", args, kwargs)
        q, k, v, out, dout, lse = a["query"], a["key"], a["value"], a["out"], a["grad_out"], a["logsumexp"]
        _require(isinstance(a["rng_state"], torch.Tensor) and isinstance(a["unused"], torch.Tensor), "rng tensors")
        if a["cum_seq_q"] is not None:  # a defined cum_seq_q selects the varlen backward
            return self._flash_varlen_backward(a)
        self._flash_checks(q, k, v)
        b, sq, h, _ = q.shape
        _require(out.shape == q.shape and dout.shape == q.shape, "CHECK_SHAPE out/dout")
        _require(out.dtype == q.dtype and dout.dtype == q.dtype, "out and dout must have q's dtype")
        _require(lse.shape == (b, h, sq) and lse.dtype == torch.float32 and lse.is_contiguous(),
                 "softmax_lse is read as a contiguous fp32 [B, H, Sq] buffer")
        allowed = _flash_allowed(a, a["is_causal"], sq, k.shape[1])
        grads = attend_grads(dout, q, k, v, out, lse, _scale(a, q.shape[-1]), allowed)
        return tuple(g.to(q.dtype) for g in grads)

    def _varlen_sequences(self, a: dict) -> list[tuple[slice, slice, torch.Tensor | None]]:
        """Checks of mha_varlen_fwd/bwd; each sequence's query rows, key rows and mask."""
        q, k, v, cu_q, cu_k = a["query"], a["key"], a["value"], a["cum_seq_q"], a["cum_seq_k"]
        _require(q.dim() == k.dim() == v.dim() == 3, "varlen flash takes [T, H, D]")
        _require(cu_q is not None and cu_k is not None, "cu_seqlens_q and cu_seqlens_k are both needed")
        _require(cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32, "cu_seqlens must have dtype int32")
        _require(cu_q.device == q.device and cu_k.device == q.device, "cu_seqlens must be on q's device")
        _require(cu_q.dim() == 1 and cu_q.shape == cu_k.shape and cu_q.is_contiguous(), "cu_seqlens [B + 1]")
        self._flash_checks(q[None], k[None], v[None])
        bq, bk = cu_q.tolist(), cu_k.tolist()  # a stand-in may read them; the real op does on the device
        _require(bq[0] == 0 and bk[0] == 0 and bq[-1] == q.shape[0] and bk[-1] == k.shape[0], "offsets span T")
        seqs = []
        for (q0, q1), (k0, k1) in zip(zip(bq, bq[1:]), zip(bk, bk[1:])):
            _require(0 < q1 - q0 <= a["max_q"] and 0 < k1 - k0 <= a["max_k"], "sequence longer than max_q/max_k")
            causal = a["is_causal"] and a["max_q"] > 1
            seqs.append((slice(q0, q1), slice(k0, k1), band(q1 - q0, k1 - k0, -1, 0) if causal else None))
        return seqs

    def _flash_varlen_forward(self, a: dict):
        q, k, v = a["query"], a["key"], a["value"]
        outs, lses = [], []
        for rows, keys, allowed in self._varlen_sequences(a):
            o, lse = attend(q[None, rows], k[None, keys], v[None, keys], _scale(a, q.shape[-1]), allowed)
            outs.append(o[0])
            lses.append(lse[0])
        return (torch.cat(outs).to(q.dtype), torch.cat(lses, 1).float(), torch.zeros(2, dtype=torch.int64),
                torch.empty(0), torch.empty(0))

    def _flash_varlen_backward(self, a: dict):
        q, k, v, out, dout, lse = a["query"], a["key"], a["value"], a["out"], a["grad_out"], a["logsumexp"]
        _require(out.shape == q.shape and dout.shape == q.shape, "CHECK_SHAPE out/dout")
        _require(lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32 and lse.is_contiguous(),
                 "varlen softmax_lse is a contiguous fp32 [H, Tq] buffer")
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for rows, keys, allowed in self._varlen_sequences(a):
            g = attend_grads(dout[None, rows], q[None, rows], k[None, keys], v[None, keys], out[None, rows],
                             lse[None, :, rows], _scale(a, q.shape[-1]), allowed)
            dq[rows] += g[0][0].to(q.dtype)
            dk[keys] += g[1][0].to(k.dtype)
            dv[keys] += g[2][0].to(v.dtype)
        return dq, dk, dv

    # ---- memory-efficient -------------------------------------------------------------------------
    @staticmethod
    def _efficient_checks(q, k, v, bias) -> None:
        _require(q.shape[2] == k.shape[2] == v.shape[2], "query, key and value must have the same number of heads")
        _require(q.shape[-1] == k.shape[-1], "query and key must have the same head dim")
        for t in (q, k, v):
            _require(t.stride(-1) == 1, "last dimension must be contiguous")
            _require(all(s % 8 == 0 for s in t.stride()[:3]), "not correctly aligned (strideB/M/H)")
        if bias is not None:
            _require(bias.dtype == q.dtype, "invalid dtype for bias - should match query's dtype")
            _require(bias.shape == (q.shape[0], q.shape[2], q.shape[1], k.shape[1]), "attn_bias: wrong shape")
            _require(bias.stride(3) == 1 and all(s % 8 == 0 for s in bias.stride()[:3]),
                     "attn_bias is not correctly aligned")

    def _bias_allowed(self, bias, kind, sq, sk, device):
        allowed = _mask_type(kind, sq, sk, device)
        if bias is not None:
            _require(bool(((bias == 0) | (bias == float("-inf"))).all()), "stand-in models 0/-inf biases only")
            allowed = (bias == 0) if allowed is None else (allowed & (bias == 0))
        return allowed

    def _efficient_attention_forward(self, *args, **kwargs):
        a = self._bind("_efficient_attention_forward", args, kwargs)
        q, k, v, bias = a["query"], a["key"], a["value"], a["bias"]
        _require(a["cu_seqlens_q"] is None and a["dropout_p"] == 0.0 and a["compute_log_sumexp"], "dense, with LSE")
        self._efficient_checks(q, k, v, bias)
        b, sq, h, _ = q.shape
        out, lse = attend(q, k, v, _scale(a, q.shape[-1]),
                          self._bias_allowed(bias, a["custom_mask_type"], sq, k.shape[1], q.device))
        lse_padded = torch.full((b, h, math.ceil(sq / 32) * 32), float("inf"))  # kernel_forward.h pads with inf
        lse_padded[:, :, :sq] = lse
        seed = torch.zeros((), dtype=torch.int64)
        return out.to(q.dtype), lse_padded, seed, seed, sq, k.shape[1]

    def _efficient_attention_backward(self, *args, **kwargs):
        a = self._bind("_efficient_attention_backward", args, kwargs)
        q, k, v, bias, out, dout, lse = (a[n] for n in ("query", "key", "value", "bias", "out", "grad_out_",
                                                         "logsumexp"))
        self._efficient_checks(q, k, v, bias)
        b, sq, h, _ = q.shape
        _require(dout.shape[:3] == q.shape[:3] and dout.shape[-1] == v.shape[-1], "grad_out: wrong shape")
        _require(out.shape == dout.shape and out.is_contiguous(), "out: [B, Sq, H, Kv], rows of H * Kv")
        width = math.ceil(sq / 32) * 32  # the backward reads the LSE up to here, past Sq included
        _require(lse.dtype == torch.float32 and lse.shape[:2] == (b, h) and lse.shape[2] >= width, "logsumexp shape")
        _require(bool((lse[:, :, sq:width] == float("inf")).all()), "LSE past Sq must be +inf, as the forward pads it")
        _require(lse.stride(0) % 8 == 0 and lse.stride(1) % 8 == 0, "LSE is not correctly aligned")
        _require(a["max_seqlen_q"] == sq and a["max_seqlen_k"] == k.shape[1] and not a["bias_requires_grad"],
                 "dense sizes")
        allowed = self._bias_allowed(bias, a["custom_mask_type"], sq, k.shape[1], q.device)
        grads = attend_grads(dout, q, k, v, out, lse[:, :, :sq], _scale(a, q.shape[-1]), allowed)
        return (*(g.to(q.dtype) for g in grads), torch.empty(0))

    # ---- cuDNN ------------------------------------------------------------------------------------
    @staticmethod
    def _cudnn_checks(q, k, v, causal) -> None:
        _require(q.shape[1] == k.shape[1] == v.shape[1], "no GQA relied on: equal heads")
        _require(q.shape[-1] == k.shape[-1] == v.shape[-1] and q.shape[-1] % 8 == 0, "equal head dims, multiple of 8")
        _require(all(t.stride(-1) == 1 for t in (q, k, v)), "last dimension must be contiguous")
        _require(not causal or q.shape[2] == k.shape[2], "causal alignment for Sq != Sk is not relied on")
        _require(min(q.shape[2], k.shape[2]) >= 2, "cuDNN Frontend error: s_q = s_kv = 1 is not supported "
                 "(and NaN dK/dV for Sq = 1, cudnn-frontend #1072): no one-token side")

    def _scaled_dot_product_cudnn_attention(self, *args, **kwargs):
        a = self._bind("_scaled_dot_product_cudnn_attention", args, kwargs)
        q, k, v = a["query"], a["key"], a["value"]
        _require(a["attn_bias"] is None and a["compute_log_sumexp"] and a["dropout_p"] == 0.0, "no bias, with LSE")
        self._cudnn_checks(q, k, v, a["is_causal"])
        allowed = band(q.shape[2], k.shape[2], -1, 0) if a["is_causal"] else None
        out, lse = attend(*(t.transpose(1, 2) for t in (q, k, v)), _scale(a, q.shape[-1]), allowed)
        seed = torch.zeros((), dtype=torch.int64)
        return (out.to(q.dtype).transpose(1, 2), lse.float()[..., None], None, None, q.shape[2], k.shape[2], seed,
                seed, None)

    def _scaled_dot_product_cudnn_attention_backward(self, *args, **kwargs):
        a = self._bind("_scaled_dot_product_cudnn_attention_backward", args, kwargs)
        q, k, v, out, dout, lse = (a[n] for n in ("query", "key", "value", "out", "grad_out", "logsumexp"))
        self._cudnn_checks(q, k, v, a["is_causal"])
        b, h, sq, _ = q.shape
        _require(a["attn_bias"] is None and a["cum_seq_q"] is None and a["cum_seq_k"] is None, "dense, no bias")
        _require(out.shape == dout.shape == q.shape and out.stride() == dout.stride(), "out/grad_out strides differ")
        _require(lse.shape == (b, h, sq, 1) and lse.dtype == torch.float32, "Stats: [B, H, Sq, 1] fp32")
        _require(all(isinstance(a[n], torch.Tensor) for n in ("philox_seed", "philox_offset")), "seed tensors")
        allowed = band(sq, k.shape[2], -1, 0) if a["is_causal"] else None
        t = [x.transpose(1, 2) for x in (dout, q, k, v, out)]
        grads = attend_grads(*t, lse[..., 0], _scale(a, q.shape[-1]), allowed)
        return tuple(g.to(q.dtype).transpose(1, 2) for g in grads)
