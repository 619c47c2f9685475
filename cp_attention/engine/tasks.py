"""A rank's block tasks at one step, the kernel settings they run with, and the accumulators they
fold into: shared by the ring and by the other strategies (:mod:`cp_attention.strategies`), which run
the same tasks with K/V from elsewhere."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from ..kernels.base import AttentionKernel, band_mask
from ..schedules.blocks import BlockTask
from .merge import merge_at, merge_block

__all__ = ["KernelSettings", "add_rows", "set_rows", "merge_rows", "band_mask", "task_forward", "task_backward"]


@dataclass(frozen=True)
class KernelSettings:
    """How one call runs its blocks: the kernel, the softmax scale, the softcap, and whether K/V
    that travel are kept head-major for it (see :meth:`of`)."""

    kernel: AttentionKernel
    scale: float
    softcap: float = 0.0  # 0: none; else flash-attn's softcap on the scaled scores
    # Keep travelling K/V shards in [B, H, n, D] memory, for a kernel that runs faster on it.
    head_major: bool = False

    @classmethod
    def of(cls, kernel: AttentionKernel, scale: float, softcap: float = 0.0, packed: bool = False
           ) -> KernelSettings:
        """The settings of a call: head-major K/V when the kernel prefers them (``head_major_kv``),
        except for ``packed`` documents, whose K/V rows are gathered, so kept token-major."""
        return cls(kernel, scale, float(softcap), head_major=not packed and kernel.head_major_kv)

    @property
    def kernel_kwargs(self) -> dict:
        """Optional kernel arguments: only what is in use, so kernels without them keep working."""
        return {"softcap": self.softcap} if self.softcap else {}


def _covers(rows: slice, length: int) -> bool:
    return rows.start == 0 and rows.stop == length


def add_rows(acc: torch.Tensor | None, rows: slice | torch.Tensor, block: torch.Tensor, length: int,
              dtype: torch.dtype, buffer: torch.Tensor | None = None) -> torch.Tensor:
    """``acc[:, rows] += block`` for a slice or a LongTensor of distinct rows. A missing accumulator
    starts as the block itself when the block covers every row (every schedule's step 0 does without
    packed documents), saving a zero fill and a read-modify-write. ``buffer`` (``[B, length, ...]`` of
    ``dtype``, contiguous): where a missing accumulator starts, instead of new memory (a buffer made
    once per call and reused at every step)."""
    if acc is None:
        covers = isinstance(rows, slice) and _covers(rows, length)
        if buffer is not None:
            acc = buffer.copy_(block) if covers else buffer.zero_()
            if covers:
                return acc
        elif covers:
            return block.to(dtype).contiguous()
        else:
            acc = block.new_zeros((block.shape[0], length, *block.shape[2:]), dtype=dtype)
    if isinstance(rows, slice):
        acc[:, rows] += block
    else:
        acc.index_add_(1, rows, block.to(dtype))
    return acc


def set_rows(acc: torch.Tensor | None, rows: slice | torch.Tensor, block: torch.Tensor, length: int,
              dtype: torch.dtype) -> torch.Tensor:
    """``acc[:, rows] = block``, allocating ``acc`` uninitialised: for a step whose tasks cover every row once."""
    if acc is None:
        acc = block.new_empty((block.shape[0], length, *block.shape[2:]), dtype=dtype)
    if isinstance(rows, slice):
        acc[:, rows] = block
    else:
        acc.index_copy_(1, rows, block.to(dtype))
    return acc


def merge_rows(out: torch.Tensor | None, lse: torch.Tensor | None, rows: slice | torch.Tensor,
                o_blk: torch.Tensor, lse_blk: torch.Tensor, length: int, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """LSE-merge a block into (out, lse) at a slice or LongTensor of rows; like :func:`add_rows`, a
    full first block is taken as is."""
    if out is None:
        if isinstance(rows, slice) and _covers(rows, length):
            return o_blk.to(dtype).contiguous(), lse_blk.to(dtype).contiguous()
        b, _, h, dv = o_blk.shape
        out = o_blk.new_zeros((b, length, h, dv), dtype=dtype)
        lse = o_blk.new_full((b, h, length), float("-inf"), dtype=dtype)
    lse = cast(torch.Tensor, lse)  # None only together with out
    if isinstance(rows, slice):
        merge_block(out, lse, o_blk, lse_blk, rows)
    else:
        merge_at(out, lse, o_blk, lse_blk, rows)
    return out, lse


def _block_kwargs(settings: KernelSettings, t: BlockTask, q: torch.Tensor) -> dict:
    if t.band is None:
        return settings.kernel_kwargs
    if settings.kernel.supports_band:  # the kernel's own window: no mask in memory
        return {**settings.kernel_kwargs, "band": t.band}
    mask = band_mask(t.q_stop - t.q_start, t.kv_stop - t.kv_start, *t.band, q.device)
    return {**settings.kernel_kwargs, "mask": mask}


def task_forward(settings: KernelSettings, t, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_own: torch.Tensor, v_own: torch.Tensor, tiles: bool = False):
    """A task's results: (whether they are the first for their rows, a list of ``(rows, out, lse)``).
    ``k``/``v``: the shard held now; ``k_own``/``v_own``: this rank's own. ``tiles``: the step's plain
    blocks cover every row once, so theirs are first (a document batch says so for itself)."""
    if not isinstance(t, BlockTask):  # a batch of document blocks (DocBatch, VarlenBatch)
        return t.first, t.forward(settings.kernel, q, k, v, k_own, v_own, settings.scale, settings.kernel_kwargs)
    o_blk, lse_blk = settings.kernel.forward(q[:, t.q], k[:, t.kv], v[:, t.kv], t.causal, settings.scale,
                                             **_block_kwargs(settings, t, q))
    return tiles, [(t.q, o_blk, lse_blk)]


def task_backward(settings: KernelSettings, t, dout, q, k, v, k_own, v_own, out, lse, tiles: bool = False):
    """A task's gradients: (whether they are the first for their rows, a list of ``(q_rows, dq, keys)``
    with ``keys`` a list of ``(own, kv_rows, dk, dv)``; ``own`` rows index this rank's own shard, the
    others the shard held now). ``tiles`` as for :func:`task_forward`."""
    if not isinstance(t, BlockTask):
        return t.first, t.backward(settings.kernel, dout, q, k, v, k_own, v_own, out, lse, settings.scale,
                                   settings.kernel_kwargs)
    dq, dk, dv = settings.kernel.backward(dout[:, t.q], q[:, t.q], k[:, t.kv], v[:, t.kv], out[:, t.q],
                                          lse[:, :, t.q], t.causal, settings.scale, **_block_kwargs(settings, t, q))
    return tiles, [(t.q, dq, [(False, t.kv, dk, dv)])]
