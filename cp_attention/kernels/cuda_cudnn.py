"""PyTorch's cuDNN attention ops on CUDA: ``aten._scaled_dot_product_cudnn_attention`` / ``_backward``.

Schemas (torch 2.13's ``torch.ops.aten.<op>.default._schema``, identical in torch 2.11's
native_functions.yaml)::

    _scaled_dot_product_cudnn_attention(Tensor query, Tensor key, Tensor value, Tensor? attn_bias,
        bool compute_log_sumexp, float dropout_p=0., bool is_causal=False, bool return_debug_mask=False, *,
        float? scale=None) -> (Tensor output, Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k,
        SymInt max_q, SymInt max_k, Tensor philox_seed, Tensor philox_offset, Tensor debug_attn_mask)
    _scaled_dot_product_cudnn_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value,
        Tensor out, Tensor logsumexp, Tensor philox_seed, Tensor philox_offset, Tensor attn_bias,
        Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, bool is_causal, *,
        float? scale=None) -> (Tensor, Tensor, Tensor)

bhsd views (our bshd tensors transposed), fp16/bf16, LSE ``[B, H, Sq, 1]`` fp32. To stay within
what every cuDNN 9 build takes, K/V heads are repeated (no GQA), head dims are made equal and a
multiple of 8, head dim is capped at 128, and causal blocks are square (the op's causal mask is
cuDNN's ``set_causal_mask``; its alignment for Sq != Sk is not relied on). ``out`` and ``grad_out``
get identical strides (cuDNN < 9.5.1 assumes it). The backward's ``attn_bias``/``cum_seq_q/k`` are
None (undefined: the dense path) and the dropout seed/offset valid int64 zeros (read only with dropout).

Refusals (:meth:`~cp_attention.kernels._cuda.FusedKernel.block_refusal`, ``min_block = 2``): cuDNN
rejects one-token blocks (``cuDNN Frontend error: s_q = s_kv = 1 is not supported``, seen on an H200 in
``tests/unit/kernels/test_cuda.py``), and its backward gives NaN dK/dV for Sq = 1 with a very negative
LSE (cudnn-frontend #1072); so a call with a one-token side (a 1-token shard, a zigzag half of one
token, decode-sized queries) never reaches it: ``auto`` gives such a block to the next kernel of its
table, and a call that names ``cudnn`` for it is refused before any communication. No mask ever
reaches it (pytorch #196678: NaN in dQ with an explicit mask when the length is 64 mod 128).

``auto`` prefers it for dense blocks from sm90 on (``kernels.choice``): 0.88-0.98x SDPA forward on
an H200, against 0.47-0.57x for ``flash``.
"""

from __future__ import annotations

import torch

from ._cuda import FusedKernel, fold_heads, pad_head, repeat_heads, round_up
from .cuda_efficient import EfficientKernel

__all__ = ["CudnnKernel"]

_aten = torch.ops.aten  # looked up at call time (tests substitute stand-ins to check the plumbing on CPU)


class CudnnKernel(FusedKernel):
    """cuDNN fused attention (SDPA's cuDNN backend), fp16/bf16, head dim <= 128."""

    name = "cudnn"
    dtypes = (torch.float16, torch.bfloat16)
    wide_fallback = EfficientKernel()
    max_head_dim = 128
    min_block = 2  # no one-token query or key side (see the module docstring)

    def _fwd(self, q, k, v, causal, scale):
        b, sq, h, _ = q.shape
        d = round_up(max(q.shape[-1], v.shape[-1]), 8)
        t = lambda x: repeat_heads(pad_head(x, d), h).transpose(1, 2)  # noqa: E731
        res = _aten._scaled_dot_product_cudnn_attention(t(q), t(k), t(v), None, True, 0.0, causal, False, scale=scale)
        return res[0].transpose(1, 2)[..., :v.shape[-1]], res[1].reshape(b, h, sq)

    def _bwd(self, dout, q, k, v, out, lse, causal, scale):
        b, sq, h, dqk = q.shape
        sk, hkv, dvd = k.shape[1], k.shape[2], v.shape[-1]
        d = round_up(max(dqk, dvd), 8)
        t = lambda x: repeat_heads(pad_head(x, d), h).transpose(1, 2)  # noqa: E731
        # out and grad_out: both contiguous bshd seen as bhsd, hence the same strides
        o, do = (pad_head(x.to(q.dtype), d).contiguous().transpose(1, 2) for x in (out, dout))
        zero = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv = _aten._scaled_dot_product_cudnn_attention_backward(
            do, t(q), t(k), t(v), o, lse.float().contiguous().reshape(b, h, sq, 1), zero, zero, None, None, None,
            sq, sk, 0.0, causal, scale=scale)
        dq, dk, dv = (x.transpose(1, 2) for x in (dq, dk, dv))
        return dq[..., :dqk], fold_heads(dk[..., :dqk], hkv), fold_heads(dv[..., :dvd], hkv)
