"""Packed documents on a kernel that takes variable-length batches (flash's ``cum_seq_q/k``): a ring
step's blocks of one mask kind as ONE kernel call, whatever the number of documents.

The pieces' query rows and key rows are gathered into ``[T, H, D]`` streams (one sequence per piece),
the call returns per-row results, and the engine merges them by row like any batch's. Index tensors
and offsets reach the device once, with the plan; the longest piece is a host int from the plan, so
no call reads the device.
"""

from __future__ import annotations

import copy

import torch

from ..schedules.lowering import VarlenSpec
from .doc_batch import compact_index, upload

__all__ = ["VarlenBatch", "concat_ranges"]


def concat_ranges(starts: torch.Tensor, lengths: torch.Tensor, total: int) -> torch.Tensor:
    """``cat([arange(a, a + n) for a, n in zip(starts, lengths)])`` (``total`` its length), without
    a Python loop."""
    offsets = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(starts - offsets, lengths, output_size=total) + torch.arange(total)


class VarlenBatch:
    """A :class:`~cp_attention.schedules.lowering.VarlenSpec` ready to run on ``device``."""

    def __init__(self, spec: VarlenSpec, device: torch.device) -> None:
        table = spec.table
        q_len, k_len = table[:, 1] - table[:, 0], table[:, 3] - table[:, 2]
        lens = torch.stack([q_len, k_len])
        cu = torch.zeros(2, table.shape[0] + 1, dtype=torch.long)
        torch.cumsum(lens, 1, out=cu[:, 1:])
        total_q, total_k, self.max_q, self.max_k = torch.cat([cu[:, -1], lens.max(1).values]).tolist()
        rows = torch.cat([concat_ranges(table[:, 0], q_len, total_q), concat_ranges(table[:, 2], k_len, total_k)])
        # The rows in one upload; the offsets as the op wants them (int32), each its own tensor.
        rows = upload(rows, device)
        self.q_rows, self.k_rows = rows[:total_q], rows[total_q:]
        cu = cu.to(torch.int32)
        self.cu_q, self.cu_k = upload(cu[0], device), upload(cu[1], device)
        self.causal = spec.causal
        self.first = spec.first
        self.spec = spec
        # (recv, this batch reading a compact held shard of the rows recv)
        self._compacted: tuple[torch.Tensor, VarlenBatch] | None = None

    def compact(self, recv: torch.Tensor) -> VarlenBatch:
        """This batch reading the held shard from a compact tensor of only its rows ``recv`` (see
        :meth:`DocBatch.compact <cp_attention.engine.doc_batch.DocBatch.compact>`)."""
        found = getattr(self, "_compacted", None)
        if found is not None and found[0] is recv:
            return found[1]
        out = copy.copy(self)
        out._compacted = None
        out.k_rows = compact_index(recv, self.k_rows)
        self._compacted = (recv, out)
        return out

    def _streams(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return q[0].index_select(0, self.q_rows), k[0].index_select(0, self.k_rows), v[0].index_select(0, self.k_rows)

    def _bounds(self) -> tuple:
        return self.cu_q, self.cu_k, self.max_q, self.max_k, self.causal

    def forward(self, kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_own: torch.Tensor,
                v_own: torch.Tensor, scale: float,
                kwargs: dict) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``q [1, n, H, D]`` and the held ``k``/``v`` -> ``[(rows, out [1, R, H, Dv], lse [1, H, R])]``
        for the R query rows ``rows`` (``k_own``/``v_own`` are not used: pieces never fold)."""
        out, lse = kernel.forward_varlen(*self._streams(q, k, v), *self._bounds(), scale, **kwargs)
        return [(self.q_rows, out[None], lse[None])]

    def backward(self, kernel, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_own: torch.Tensor, v_own: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, scale: float,
                 kwargs: dict):
        """Gradients given the final ``out``/``lse``: ``[(q_rows, dq [1, R, H, D], [(False, kv_rows,
        dk [1, Rk, Hkv, D], dv [1, Rk, Hkv, Dv])])]``, the key rows indexing the held shard."""
        rows = self.q_rows
        dq, dk, dv = kernel.backward_varlen(dout[0].index_select(0, rows), *self._streams(q, k, v),
                                            out[0].index_select(0, rows), lse[0].index_select(1, rows),
                                            *self._bounds(), scale, **kwargs)
        return [(rows, dq[None], [(False, self.k_rows, dk[None], dv[None])])]
