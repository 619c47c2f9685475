"""Packed documents in the engine: a ring step's document blocks as a few kernel calls.

Thousands of short documents must not become thousands of Python-level kernel calls. A step's small
:class:`~cp_attention.doc_schedule.DocBlock` s are gathered into padded batches, one per size bucket,
and each batch is one masked kernel call (the mask is the blocks' own band, so the result is exact).
Large blocks run on their own as plain :class:`~cp_attention.schedule.BlockTask` s, as do all blocks
for a kernel that takes no mask.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch

from .doc_schedule import DocBlock, doc_plan, split_doc_block
from .layout import Layout
from .schedule import BlockTask

__all__ = ["DocBatch", "packed_steps", "SMALL_BLOCK"]

# A block whose longer side is at most this joins a padded batch; longer ones run alone. Padding
# costs at most 2x per side inside a bucket, which short blocks pay gladly for one call per bucket.
SMALL_BLOCK = 256
_MIN_BUCKET = 16


def _bucket(block: DocBlock) -> int:
    side = max(block.q_len, block.kv_len, _MIN_BUCKET)
    return 1 << (side - 1).bit_length()


@dataclass(frozen=True)
class _Bucket:
    q_idx: torch.Tensor  # [E, L] local query rows; padding repeats the block's first row
    q_valid: torch.Tensor  # [E, L] bool
    kv_idx: torch.Tensor  # [E, L] held K/V rows; padding repeats the block's first key
    kv_valid: torch.Tensor  # [E, L] bool
    mask: torch.Tensor  # [E, L, L] bool, True where a query may see a key


def _make_bucket(blocks: Sequence[DocBlock], size: int) -> _Bucket:
    ar = torch.arange(size)
    q0 = torch.tensor([b.q_start for b in blocks])[:, None]
    k0 = torch.tensor([b.kv_start for b in blocks])[:, None]
    q_valid = ar[None, :] < torch.tensor([b.q_len for b in blocks])[:, None]
    kv_valid = ar[None, :] < torch.tensor([b.kv_len for b in blocks])[:, None]
    diag = torch.tensor([size if b.diag is None else b.diag for b in blocks])[:, None, None]
    mask = kv_valid[:, None, :] & (ar[None, None, :] <= ar[None, :, None] + diag)
    # A padding row repeats its block's first query and sees only the first key, which that query
    # sees too: its probabilities stay <= 1 under the real row's LSE, and its zero dout adds nothing.
    mask[~q_valid] = False
    mask[..., 0] |= ~q_valid
    return _Bucket(torch.where(q_valid, q0 + ar, q0), q_valid, torch.where(kv_valid, k0 + ar, k0), kv_valid, mask)


class DocBatch:
    """Small document blocks of one ring step, run as one padded, masked kernel call per size bucket.

    The blocks' query rows are disjoint (one block per document per step), and so are their key rows,
    so results scatter back without conflicts.
    """

    def __init__(self, blocks: Sequence[DocBlock], device: torch.device) -> None:
        groups: dict[int, list[DocBlock]] = {}
        for b in blocks:
            groups.setdefault(_bucket(b), []).append(b)
        self.buckets = []
        for size in sorted(groups):
            bk = _make_bucket(groups[size], size)
            self.buckets.append(_Bucket(*(t.to(device) for t in (bk.q_idx, bk.q_valid, bk.kv_idx, bk.kv_valid,
                                                                   bk.mask))))
        self.q_rows = torch.cat([b.q_idx[b.q_valid] for b in self.buckets])
        self.kv_rows = torch.cat([b.kv_idx[b.kv_valid] for b in self.buckets])
        self.blocks = tuple(blocks)

    def forward(self, kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, kwargs: dict
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q [1, n, H, D]`` and the held ``k``/``v`` -> ``(rows, out [1, R, H, Dv], lse [1, H, R])`` for
        the R query rows ``rows`` (a LongTensor) of every block."""
        outs, lses = [], []
        for b in self.buckets:
            o, lse = kernel.forward(q[0][b.q_idx], k[0][b.kv_idx], v[0][b.kv_idx], False, scale, mask=b.mask,
                                    **kwargs)
            outs.append(o[b.q_valid])
            lses.append(lse.transpose(1, 2)[b.q_valid])
        return self.q_rows, torch.cat(outs)[None], torch.cat(lses).t()[None]

    def backward(self, kernel, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, scale: float, kwargs: dict):
        """Gradients of every block given the final ``out``/``lse``: ``(q_rows, dq [1, R, H, D],
        kv_rows, dk [1, Rk, Hkv, D], dv [1, Rk, Hkv, Dv])``."""
        dqs, dks, dvs = [], [], []
        for b in self.buckets:
            dout_b = dout[0][b.q_idx] * b.q_valid[..., None, None].to(dout.dtype)
            lse_b = lse[0][:, b.q_idx].transpose(0, 1)
            dq, dk, dv = kernel.backward(dout_b, q[0][b.q_idx], k[0][b.kv_idx], v[0][b.kv_idx], out[0][b.q_idx],
                                         lse_b, False, scale, mask=b.mask, **kwargs)
            dqs.append(dq[b.q_valid])
            dks.append(dk[b.kv_valid])
            dvs.append(dv[b.kv_valid])
        return self.q_rows, torch.cat(dqs)[None], self.kv_rows, torch.cat(dks)[None], torch.cat(dvs)[None]


@functools.lru_cache(maxsize=32)
def packed_steps(layout: Layout, causal: bool, rank: int, world_size: int, cu_seqlens: tuple[int, ...],
                 batched: bool, device: torch.device) -> tuple[tuple["BlockTask | DocBatch", ...], ...]:
    """The engine's tasks for every ring step of packed documents. With ``batched`` (a kernel that
    takes a mask) small blocks join one :class:`DocBatch` per step; the rest run as plain tasks.
    Cached, so the layers of one model forward build it once."""
    steps = []
    for blocks in doc_plan(layout, causal, rank, world_size, cu_seqlens):
        small = [b for b in blocks if batched and max(b.q_len, b.kv_len) <= SMALL_BLOCK]
        tasks: tuple = tuple(t for b in blocks if b not in small for t in split_doc_block(b))
        if small:
            tasks = (DocBatch(small, device),) + tasks
        steps.append(tasks)
    return tuple(steps)
