"""Packed documents on a kernel that takes variable-length batches (flash's ``cum_seq_q/k``): a ring
step's blocks of one mask kind as ONE kernel call, whatever the number of documents.

The pieces' query rows and key rows are gathered into ``[T, H, D]`` streams (one sequence per piece),
the call returns per-row results, and the engine merges them by row like any batch's. Index tensors
and offsets reach the device once, with the plan; the longest piece is a host int from the plan, so
no call reads the device.
"""

from __future__ import annotations

import torch

from ..schedules.lowering import VarlenSpec
from .doc_batch import upload

__all__ = ["VarlenBatch"]


def _offsets(lengths: list[int]) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return cu


class VarlenBatch:
    """A :class:`~cp_attention.schedules.lowering.VarlenSpec` ready to run on ``device``."""

    def __init__(self, spec: VarlenSpec, device: torch.device) -> None:
        pieces = spec.pieces
        q_len = [p.q_stop - p.q_start for p in pieces]
        k_len = [p.kv_stop - p.kv_start for p in pieces]
        self.q_rows = upload(torch.cat([torch.arange(p.q_start, p.q_stop) for p in pieces]), device)
        self.k_rows = upload(torch.cat([torch.arange(p.kv_start, p.kv_stop) for p in pieces]), device)
        self.cu_q, self.cu_k = upload(_offsets(q_len), device), upload(_offsets(k_len), device)
        self.max_q, self.max_k = max(q_len), max(k_len)
        self.causal = spec.causal
        self.first = spec.first
        self.spec = spec

    def _streams(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return q[0].index_select(0, self.q_rows), k[0].index_select(0, self.k_rows), v[0].index_select(0, self.k_rows)

    def _bounds(self) -> tuple:
        return self.cu_q, self.cu_k, self.max_q, self.max_k, self.causal

    def forward(self, kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_own: torch.Tensor,
                v_own: torch.Tensor, scale: float, kwargs: dict) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
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
