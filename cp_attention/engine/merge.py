"""Log-sum-exp merge of partial attention results, in the stable sigmoid form.

Semantics, per batch ``b``, merged row ``row`` (block row ``r``) and head ``h``, in the accumulator's
dtype: with ``la = lse_acc[b, h, row]`` and ``lb = lse_blk[b, h, r]``, the block's share of the merged
softmax mass is ``w = sigmoid(lb - la)``; ``out_acc[b, row, h] = lerp(out_acc[b, row, h], out_blk[b, r, h], w)``
and ``lse_acc[b, h, row] = logaddexp(la, lb)``. An empty accumulator row (``la = -inf``) takes the
block's values exactly; block rows must be non-empty (finite ``lb``).

Why two implementations: in torch a merge is 6-8 kernels (sigmoid, lerp, logsigmoid, copy, and a gather
and scatter for index rows), each a launch (~5-10 us on a GPU, several per ring step) and most a pass
over a temporary. On CUDA with fp32 accumulators and triton installed, :mod:`.merge_triton` does it in
ONE launch that reads and writes each row once (gather, merge and scatter included). Elsewhere (CPU,
fp64 accumulators, no triton, tensor subclasses such as fake tensors, or inputs that autograd tracks) the
torch code below runs. Neither path reads device data on the host.
"""

from __future__ import annotations

import os
from typing import Callable, Literal

import torch
import torch.nn.functional as F

__all__ = ["merge_block", "merge_at"]

# The device type whose fp32 merges go to the fused kernel (tests point it at "cpu" to run the kernel
# through triton's interpreter). CP_ATTENTION_FUSED_MERGE=0 keeps every merge on the torch code (the
# kernel has run only in triton's interpreter so far; this is the way out should a GPU's compiler differ).
_FUSED_DEVICE = "cuda" if os.environ.get("CP_ATTENTION_FUSED_MERGE", "1") != "0" else None
# merge_triton.fused_merge once imported, False when triton is missing
_fused_merge: Callable[..., bool] | Literal[False] | None = None


def _fused(out_acc: torch.Tensor, lse_acc: torch.Tensor, out_blk: torch.Tensor, lse_blk: torch.Tensor
           ) -> Callable[..., bool] | None:
    """The fused merge when it applies to these tensors (fp32 accumulators, plain tensors on the fused
    device, nothing autograd tracks, triton importable), else None. Metadata only: no host sync."""
    global _fused_merge
    tensors = (out_acc, lse_acc, out_blk, lse_blk)
    if (_FUSED_DEVICE is None or out_acc.device.type != _FUSED_DEVICE or out_acc.dtype != torch.float32
            or lse_acc.dtype != torch.float32
            or any(type(t) is not torch.Tensor or t.device.type != _FUSED_DEVICE for t in tensors)
            or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))):
        return None
    if _fused_merge is None:  # first fused-eligible merge: import triton (never at import cp_attention)
        from . import merge_triton
        _fused_merge = merge_triton.fused_merge if merge_triton.available() else False
    return _fused_merge or None


def merge_block(out_acc: torch.Tensor, lse_acc: torch.Tensor, out_blk: torch.Tensor, lse_blk: torch.Tensor,
                rows: slice) -> None:
    """Fold one block's result into the accumulators, in place, for query ``rows``.

    ``out_acc [B, S, H, Dv]`` and ``lse_acc [B, H, S]`` are the running fp32 (or fp64) results;
    ``out_blk [B, R, H, Dv]`` and ``lse_blk [B, H, R]`` are the block's, for the R rows in ``rows``.
    A row whose accumulator is still empty (lse = -inf) takes the block's values exactly. Block rows
    must be non-empty (finite LSE); schedules guarantee it. One fused launch on CUDA (module docstring).
    """
    fused = _fused(out_acc, lse_acc, out_blk, lse_blk)
    if fused is not None and fused(out_acc, lse_acc, out_blk, lse_blk, rows):
        return
    o = out_acc[:, rows]
    lse = lse_acc[:, :, rows]
    lb = lse_blk.to(lse.dtype)
    # w = e^lb / (e^lse + e^lb): the block's share of the merged softmax mass.
    w = torch.sigmoid(lb - lse)
    o.lerp_(out_blk.to(o.dtype), w.transpose(1, 2).unsqueeze(-1))
    # lb - logsigmoid(lb - lse) == logaddexp(lse, lb), and stays exact when lse == -inf.
    lse.copy_(lb - F.logsigmoid(lb - lse))


def merge_at(out_acc: torch.Tensor, lse_acc: torch.Tensor, out_blk: torch.Tensor, lse_blk: torch.Tensor,
             rows: torch.Tensor) -> None:
    """:func:`merge_block` for the query rows listed in the LongTensor ``rows`` (distinct), in place:
    ``out_blk [B, R, H, Dv]`` and ``lse_blk [B, H, R]`` hold the block's results for those rows.
    On CUDA, gather, merge and scatter are one fused launch (module docstring)."""
    fused = _fused(out_acc, lse_acc, out_blk, lse_blk)
    if (fused is not None and type(rows) is torch.Tensor and rows.dtype == torch.int64
            and rows.device == out_acc.device and fused(out_acc, lse_acc, out_blk, lse_blk, rows)):
        return
    o = out_acc.index_select(1, rows)
    lse = lse_acc.index_select(2, rows)
    merge_block(o, lse, out_blk, lse_blk, slice(None))
    out_acc.index_copy_(1, rows, o)
    lse_acc.index_copy_(2, rows, lse)
