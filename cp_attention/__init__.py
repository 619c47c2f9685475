"""cp_attention: exact context-parallel (ring) attention for PyTorch.

Each rank of a process group holds 1/N of every sequence, sharded by a :class:`Layout`;
:func:`ring_attention` computes exact attention over the whole sequence, forward and backward.
"""

from __future__ import annotations

from typing import Union

import torch

from .comm import RingComm
from .documents import cu_seqlens_tuple, document_position_ids, pad_cu_seqlens
from .kernels import KERNEL_NAMES, get_kernel
from .layout import LAYOUT_NAMES, ContiguousLayout, InterleavedLayout, Layout, ZigzagLayout, get_layout
from .ring import RingAttentionFunction, RingPlan
from .schedule import BlockTask, get_schedule, rank_plan, work_model
from .validation import validate_call
from .varlen import packed_steps, window_steps
from .window_schedule import normalize_window, ring_length

__version__ = "0.1.0"

__all__ = [
    "ring_attention",
    "get_layout",
    "Layout",
    "ContiguousLayout",
    "ZigzagLayout",
    "InterleavedLayout",
    "LAYOUT_NAMES",
    "KERNEL_NAMES",
    "BlockTask",
    "get_schedule",
    "rank_plan",
    "work_model",
    "ring_length",
    "get_kernel",
    "document_position_ids",
    "pad_cu_seqlens",
]


def _host_cu_seqlens(cu_seqlens) -> "tuple[int, ...] | object":
    # Read once on the host; validation judges (on every rank alike) whatever this cannot parse.
    try:
        return cu_seqlens_tuple(cu_seqlens)
    except ValueError:
        return cu_seqlens


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group=None,
    layout: Union[str, Layout] = "zigzag",
    causal: bool = True,
    softmax_scale: "float | None" = None,
    kernel: str = "auto",
    return_lse: bool = False,
    sinks: "torch.Tensor | None" = None,
    softcap: float = 0.0,
    cu_seqlens: "torch.Tensor | None" = None,
    window_size: "tuple[int, int]" = (-1, -1),
):
    """Exact attention over a sequence sharded across the ranks of ``group``.

    Args:
        q: ``[batch, local_seq, heads, head_dim]``, this rank's query shard.
        k, v: ``[batch, local_seq, kv_heads, head_dim]`` / ``[..., v_head_dim]``; ``heads`` must be a
            multiple of ``kv_heads`` (GQA/MQA). K/V travel with their own heads.
        group: process group; ``None`` is the default group, and without torch.distributed (or with
            world size 1) this is plain attention.
        layout: name or :class:`Layout` the caller used to shard q, k and v.
        causal: causal mask over GLOBAL positions.
        softmax_scale: defaults to ``head_dim ** -0.5``.
        kernel: ``"auto"`` (the fastest kernel for the device, dtype and head dim), ``"cpu_flash"`` (alias
            ``"sdpa"``), ``"flash"``, ``"flash_attn"``, ``"efficient"``, ``"cudnn"`` or ``"math"``.
        return_lse: also return the log-sum-exp, which is differentiable like ``out``.
        sinks: ``[heads]``, one learned logit per query head added to every softmax denominator
            (attention sinks: GPT-OSS ``s_aux``; a zero tensor is the "off-by-one" softmax). It is
            differentiable; each rank's gradient is its own queries' share, so summing it over the
            group (as for every other parameter) gives the gradient without CP.
        softcap: flash-attn's logit softcapping (Gemma2's ``attn_logit_softcapping``): scaled scores
            become ``softcap * tanh(scores / softcap)``; 0 disables it. ``kernel="auto"`` picks a
            kernel that supports it; a named kernel that cannot raises, naming one that can.
        cu_seqlens: packed documents, flash-attn's ``[0, l1, l1+l2, ..., T]`` over the full packed
            sequence (the same on every rank; an int tensor or sequence, read on the host). A token
            then attends only within its document (causal or not). q, k, v are ``[1, T/N, ...]``,
            sharded with ``layout.shard(..., cu_seqlens=cu_seqlens)``; only T must split, never a document.
        window_size: ``(left, right)`` sliding window, flash-attn's convention: a query at global
            position i sees key j iff ``i - left <= j <= i + right`` (and ``j <= i`` when causal); -1
            is unbounded. Positions are within documents when packed. Blocks and ring steps wholly
            outside the window are skipped: the ring stops after the last shard any rank needs.

    Returns:
        ``out [batch, local_seq, heads, v_head_dim]`` in q's dtype, differentiable in q, k, v (and sinks); with
        ``return_lse``, also ``lse [batch, heads, local_seq]`` (natural log; fp32, or fp64 for fp64 inputs;
        the sinks included).

    Raises:
        ValueError: bad shapes, dtypes, devices, head ratio, a length the layout cannot split,
            an unknown layout or kernel, sinks of the wrong shape, a negative softcap or a kernel that
            cannot apply it, bad ``cu_seqlens`` or a batch larger than 1 with them, a bad ``window_size``,
            or arguments that differ between ranks. Raised on every rank of the group alike, before any ring communication.
    """
    comm = RingComm(group)
    cu = cu_seqlens if cu_seqlens is None else _host_cu_seqlens(cu_seqlens)
    validate_call(q, k, v, layout, causal, softmax_scale, kernel, group, comm.world_size, sinks, softcap, cu,
                  window_size, comm=comm)
    lay = get_layout(layout)
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    total = q.shape[1] * comm.world_size
    window = normalize_window(window_size, causal, total, cu)
    kern = get_kernel(kernel, q.device, q.dtype, softcap=softcap > 0, mask=window is not None, head_dim=q.shape[-1],
                      v_head_dim=v.shape[-1])
    if cu is not None:
        steps = packed_steps(lay, bool(causal), comm.rank, comm.world_size, cu,
                             getattr(kern, "supports_mask", False), q.device, window)
    elif window is not None:
        steps = window_steps(lay, bool(causal), comm.rank, comm.world_size, total, window)
    else:
        steps = rank_plan(lay, causal, comm.rank, comm.world_size, q.shape[1])
    plan = RingPlan(comm, steps, kern, scale, float(softcap), packed=cu is not None,
                    first_step_tiles=cu is not None and window is None)
    out, lse = RingAttentionFunction.apply(q, k, v, plan, sinks)
    return (out, lse) if return_lse else out
