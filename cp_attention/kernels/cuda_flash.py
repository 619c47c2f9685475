"""PyTorch's own FlashAttention-2 ops on CUDA: ``aten._flash_attention_forward`` / ``_backward``.

Schemas (torch 2.13's ``torch.ops.aten.<op>.default._schema``; torch 2.11's native_functions.yaml has the
same arguments, less the unused ``block_table``/``num_splits`` keywords)::

    _flash_attention_forward(Tensor query, Tensor key, Tensor value, Tensor? cum_seq_q, Tensor? cum_seq_k,
        SymInt max_q, SymInt max_k, float dropout_p, bool is_causal, bool return_debug_mask, *,
        float? scale=None, SymInt? window_size_left=None, SymInt? window_size_right=None, ...)
        -> (Tensor output, Tensor softmax_logsumexp, Tensor rng_state, Tensor unused, Tensor debug_attn_mask)
    _flash_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out,
        Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p,
        bool is_causal, Tensor rng_state, Tensor unused, *, float? scale=None, ...) -> (Tensor, Tensor, Tensor)

Dense bshd tensors (``cum_seq_q/k`` None: the backward picks its dense path by ``cum_seq_q`` being
undefined), fp16/bf16, equal q/k/v head dims that are a multiple of 8 and at most 256 (``mha_fwd``
checks both: "this is ensured by padding"), GQA native (dK/dV come back with K/V's heads), LSE
``[B, H, Sq]`` fp32 natural log; the backward reads it as a contiguous buffer. With no dropout the
backward never reads ``rng_state`` (as ``torch.nn.attention.varlen`` does, it gets zeros). Causal is
bottom-right aligned: :class:`~cp_attention.kernels._cuda.FusedKernel` only ever asks for square
causal blocks. Sliding-window bands run natively through ``window_size_left/right`` (same alignment,
each side clamped to unbounded from Sk on, in both mha_fwd and mha_bwd): ``_cuda.band_pieces`` turns a
top-left band into calls the clamp cannot break.
"""

from __future__ import annotations

import torch

from ._cuda import FusedKernel, pad_head, round_up
from .base import positive_scale
from .cuda_efficient import EfficientKernel

__all__ = ["FlashKernel"]

# The op namespace, looked up at call time (tests substitute stand-ins to check the plumbing on CPU).
_aten = torch.ops.aten


class FlashKernel(FusedKernel):
    """FlashAttention-2 as built into PyTorch (sm80+), fp16/bf16, head dim <= 256."""

    name = "flash"
    dtypes = (torch.float16, torch.bfloat16)
    wide_fallback = EfficientKernel()
    max_head_dim = 256
    # Takes variable-length batches (forward_varlen/backward_varlen) for head dims supports_shape takes.
    supports_varlen = True
    # Sliding-window bands through the op's window_size_left/right (FusedKernel._band_forward).
    supports_band = True

    def _fwd(self, q, k, v, causal, scale, window: tuple[int, int] | None = None):
        return self._op_forward(q, k, v, None, None, q.shape[1], k.shape[1], causal, scale, window)

    def _bwd(self, dout, q, k, v, out, lse, causal, scale, window: tuple[int, int] | None = None):
        return self._op_backward(dout, q, k, v, out, lse, None, None, q.shape[1], k.shape[1], causal, scale, window)

    @staticmethod
    def _window(window: tuple[int, int] | None) -> dict:
        # passed only when in use, so calls without a window stay what they were
        return {} if window is None else {"window_size_left": window[0], "window_size_right": window[1]}

    @staticmethod
    def _op_forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float,
                    window: tuple[int, int] | None = None):
        # Dense bshd (cu_q None) or varlen [T, H, D]; head dims padded to one multiple of 8.
        d = round_up(max(q.shape[-1], v.shape[-1]), 8)
        out, lse = _aten._flash_attention_forward(
            pad_head(q, d), pad_head(k, d), pad_head(v, d), cu_q, cu_k, max_q, max_k, 0.0, causal, False,
            scale=scale, **FlashKernel._window(window))[:2]
        return out[..., :v.shape[-1]], lse

    @staticmethod
    def _op_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float,
                     window: tuple[int, int] | None = None):
        dqk, dvd = q.shape[-1], v.shape[-1]
        d = round_up(max(dqk, dvd), 8)
        rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: never read
        unused = torch.empty(0, device=q.device)
        dq, dk, dv = _aten._flash_attention_backward(
            pad_head(dout.to(q.dtype), d), pad_head(q, d), pad_head(k, d), pad_head(v, d),
            pad_head(out.to(q.dtype), d), lse.float().contiguous(), cu_q, cu_k, max_q, max_k, 0.0, causal,
            rng_state, unused, scale=scale, **FlashKernel._window(window))
        return dq[..., :dqk], dk[..., :dqk], dv[..., :dvd]

    def forward_varlen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                       cu_k: torch.Tensor, max_q: int, max_k: int, causal: bool, scale: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequences packed along dim 0: ``q [Tq, H, D]``, ``k [Tk, Hkv, D]``, ``v [Tk, Hkv, Dv]``, sequence
        i at rows ``cu_q[i]:cu_q[i+1]`` / ``cu_k[i]:cu_k[i+1]`` (int32, on q's device), at most ``max_q`` /
        ``max_k`` long (host ints: no sync). ``causal`` needs every sequence square. Returns
        ``out [Tq, H, Dv]`` (q's dtype) and ``lse [H, Tq]`` (fp32, natural log)."""
        q, scale, _ = positive_scale(q, scale)
        return self._op_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)

    def backward_varlen(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int,
                        max_k: int, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients of :meth:`forward_varlen`'s sequences given the final ``out [Tq, H, Dv]`` and
        ``lse [H, Tq]``: ``dq [Tq, H, D]``, ``dk [Tk, Hkv, D]``, ``dv [Tk, Hkv, Dv]``."""
        q, scale, sign = positive_scale(q, scale)
        dq, dk, dv = self._op_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale)
        return (dq if sign > 0 else -dq), dk, dv
