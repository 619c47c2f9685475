"""Log-sum-exp merge of partial attention results, in the stable sigmoid form."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["merge_block", "merge_at"]


def merge_block(out_acc: torch.Tensor, lse_acc: torch.Tensor, out_blk: torch.Tensor, lse_blk: torch.Tensor,
                rows: slice) -> None:
    """Fold one block's result into the accumulators, in place, for query ``rows``.

    ``out_acc [B, S, H, Dv]`` and ``lse_acc [B, H, S]`` are the running fp32 (or fp64) results;
    ``out_blk [B, R, H, Dv]`` and ``lse_blk [B, H, R]`` are the block's, for the R rows in ``rows``.
    A row whose accumulator is still empty (lse = -inf) takes the block's values exactly. Block rows
    must be non-empty (finite LSE); schedules guarantee it.
    """
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
    ``out_blk [B, R, H, Dv]`` and ``lse_blk [B, H, R]`` hold the block's results for those rows."""
    o = out_acc.index_select(1, rows)
    lse = lse_acc.index_select(2, rows)
    merge_block(o, lse, out_blk, lse_blk, slice(None))
    out_acc.index_copy_(1, rows, o)
    lse_acc.index_copy_(2, rows, lse)
