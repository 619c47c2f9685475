"""Packed documents in the engine: a ring step's document blocks as a few kernel calls.

Thousands of short documents must not become thousands of Python-level kernel calls. A step's small
:class:`~cp_attention.doc_schedule.DocBlock` s are gathered into padded batches, one per size bucket,
and each batch is one kernel call: causal for documents' diagonal blocks, else masked with the
blocks' own band, so the result is exact. Padding rows are discarded in forward and get an LSE of
+inf (probabilities exactly 0) in backward. Larger blocks run on their own as plain
:class:`~cp_attention.schedule.BlockTask` s, as do all blocks for a kernel that takes no mask.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch

from .doc_schedule import DocBlock, split_doc_block
from .layout import Layout
from .schedule import BlockTask
from .window_schedule import Window, plan_blocks, window_plan

__all__ = ["DocBatch", "packed_steps", "window_steps", "SMALL_BLOCK"]

# A block whose longer side is at most this joins a padded batch; longer ones run alone, where
# per-call overhead is small against their work and gathering and padding would cost more than they
# save (scripts/benchmark_packed.py: 64 beat 128 by ~15% and tied with 32 at 1,000 documents in 64K).
SMALL_BLOCK = 64
# Padded sizes, per side. The CPU flash op runs some lengths much faster than their neighbours
# (fwd+bwd per block at 8 heads x 64: 24 -> 153 us, 32 -> 217, 40 -> 377, 48 -> 330, 64 -> 599,
# 80 -> 1038, 96 -> 1041); these are the efficient ones.
_SIZES = (8, 12, 16, 20, 24, 32, 48, 64)


def _size(n: int) -> int:
    return next(b for b in _SIZES if b >= n)


def _bucket(block: DocBlock) -> tuple[int, int, bool]:
    """(padded query rows, padded keys, causal square?) of a small block. A causal square (the
    diagonal of a document) needs no mask: padded keys come after every real query, so the top-left
    triangle hides them."""
    square = block.diag == 0 and block.lo is None and block.q_len == block.kv_len
    return _size(block.q_len), _size(block.kv_len), square


@dataclass(frozen=True)
class _Bucket:
    q_idx: torch.Tensor  # [E, Lq] local query rows; padding repeats the block's first row
    q_valid: torch.Tensor  # [E, Lq] bool
    kv_idx: torch.Tensor  # [E, Lk] held K/V rows; padding repeats the block's first key
    kv_valid: torch.Tensor  # [E, Lk] bool
    mask: "torch.Tensor | None"  # [E, Lq, Lk] bool, True where a query may see a key; None: causal square
    no_lse: torch.Tensor  # [E, 1, Lq]: +inf on padding rows, 0 elsewhere
    # The real entries, precomputed so no call pays for a boolean index (nonzero + gather):
    q_rows: torch.Tensor  # [R] local query rows, = q_idx[q_valid]
    q_sel: torch.Tensor  # [R] their positions in the flattened [E * Lq]
    kv_rows: torch.Tensor  # [Rk] held K/V rows, = kv_idx[kv_valid]
    kv_sel: torch.Tensor  # [Rk] their positions in the flattened [E * Lk]


def _make_bucket(blocks: Sequence[DocBlock], lq: int, lk: int, square: bool) -> _Bucket:
    aq, ak = torch.arange(lq), torch.arange(lk)
    q0 = torch.tensor([b.q_start for b in blocks])[:, None]
    k0 = torch.tensor([b.kv_start for b in blocks])[:, None]
    q_valid = aq[None, :] < torch.tensor([b.q_len for b in blocks])[:, None]
    kv_valid = ak[None, :] < torch.tensor([b.kv_len for b in blocks])[:, None]
    mask = None
    if not square:
        diag = torch.tensor([lk if b.diag is None else b.diag for b in blocks])[:, None, None]
        lo = torch.tensor([-lq if b.lo is None else b.lo for b in blocks])[:, None, None]
        offset = ak[None, None, :] - aq[None, :, None]
        mask = kv_valid[:, None, :] & (offset <= diag) & (offset >= lo)
        mask[..., 0] |= ~q_valid  # padding rows see a key, so no kernel meets an empty row
    # Backward gives padding rows an LSE of +inf: their probabilities are exactly 0, whatever they see.
    no_lse = torch.zeros(q_valid.shape, dtype=torch.float64).masked_fill_(~q_valid, float("inf"))[:, None, :]
    q_idx, kv_idx = torch.where(q_valid, q0 + aq, q0), torch.where(kv_valid, k0 + ak, k0)
    return _Bucket(q_idx, q_valid, kv_idx, kv_valid, mask, no_lse, q_idx[q_valid],
                   torch.nonzero(q_valid.flatten()).flatten(), kv_idx[kv_valid], torch.nonzero(kv_valid.flatten()).flatten())


def _valid(x: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """``x [E, L, ...]`` at the flat positions ``sel`` -> ``[1, R, ...]``."""
    return x.flatten(0, 1).index_select(0, sel)[None]


def _rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x [1, n, ...]`` at rows ``idx [E, L]`` -> ``[E, L, ...]`` (index_select: ~2.5x faster than indexing)."""
    return x[0].index_select(0, idx.flatten()).view(*idx.shape, *x.shape[2:])


class DocBatch:
    """Small document blocks of one ring step, run as one padded kernel call per size bucket (masked,
    or causal without a mask for documents' diagonal blocks).

    The blocks' query rows must be disjoint (:func:`packed_steps` groups them so), so results merge
    back without conflicts; key rows may repeat (their gradients are summed).
    """

    def __init__(self, blocks: Sequence[DocBlock], device: torch.device) -> None:
        groups: dict[tuple[int, int, bool], list[DocBlock]] = {}
        for b in blocks:
            groups.setdefault(_bucket(b), []).append(b)
        self.buckets = [_Bucket(*(None if t is None else t.to(device) for t in vars(_make_bucket(groups[key], *key))
                                  .values()))
                        for key in sorted(groups)]
        self.blocks = tuple(blocks)

    def forward(self, kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, kwargs: dict
                ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``q [1, n, H, D]`` and the held ``k``/``v`` -> per bucket ``(rows, out [1, R, H, Dv],
        lse [1, H, R])`` for its R query rows ``rows`` (a LongTensor)."""
        results = []
        for b in self.buckets:
            extra = {} if b.mask is None else {"mask": b.mask}
            o, lse = kernel.forward(_rows(q, b.q_idx), _rows(k, b.kv_idx), _rows(v, b.kv_idx), b.mask is None, scale,
                                    **extra, **kwargs)
            results.append((b.q_rows, _valid(o, b.q_sel), _valid(lse.transpose(1, 2), b.q_sel).transpose(1, 2)))
        return results

    def backward(self, kernel, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, scale: float, kwargs: dict):
        """Gradients of every bucket given the final ``out``/``lse``: per bucket ``(q_rows,
        dq [1, R, H, D], kv_rows, dk [1, Rk, Hkv, D], dv [1, Rk, Hkv, Dv])``."""
        results = []
        for b in self.buckets:
            extra = {} if b.mask is None else {"mask": b.mask}
            dout_b = _rows(dout, b.q_idx).masked_fill_(~b.q_valid[..., None, None], 0)
            lse_b = lse[0].index_select(1, b.q_idx.flatten()).view(-1, *b.q_idx.shape).transpose(0, 1)
            lse_b = lse_b + b.no_lse.to(lse.dtype)
            dq, dk, dv = kernel.backward(dout_b, _rows(q, b.q_idx), _rows(k, b.kv_idx), _rows(v, b.kv_idx),
                                         _rows(out, b.q_idx), lse_b, b.mask is None, scale, **extra, **kwargs)
            results.append((b.q_rows, _valid(dq, b.q_sel), b.kv_rows, _valid(dk, b.kv_sel), _valid(dv, b.kv_sel)))
        return results


@functools.lru_cache(maxsize=32)
def packed_steps(layout: Layout, causal: bool, rank: int, world_size: int, cu_seqlens: tuple[int, ...],
                 batched: bool, device: torch.device, window: "Window | None" = None
                 ) -> tuple[tuple["BlockTask | DocBatch", ...], ...]:
    """The engine's tasks for every ring step of packed documents (under a sliding ``window`` if
    given). With ``batched`` (a kernel that takes a mask) small blocks join one :class:`DocBatch` per
    step; the rest run as plain tasks. Cached, so the layers of one model forward build it once."""
    steps = []
    plan = plan_blocks(layout, causal, rank, world_size, cu_seqlens[-1], cu_seqlens, window)
    for blocks in plan:
        small, tasks = [], ()
        for b in blocks:
            if batched and max(b.q_len, b.kv_len) <= SMALL_BLOCK:
                small.append(b)
            else:
                tasks += split_doc_block(b)
        steps.append(tuple(DocBatch(group, device) for group in _disjoint_rows(small)) + tasks)
    if window is None:
        _check_first_step(plan[0], cu_seqlens[-1] // world_size)
    return tuple(steps)


def _disjoint_rows(blocks: Sequence[DocBlock]) -> list[list[DocBlock]]:
    """The blocks in as few groups as possible whose query rows do not overlap within a group (a
    batch's results merge by row without conflicts). Without a window every document has one block per
    step, so this is one group; a window can give a document's rows several blocks."""
    groups: list[list[DocBlock]] = []
    ends: list[int] = []
    for b in sorted(blocks, key=lambda b: b.q_start):
        g = next((i for i, end in enumerate(ends) if end <= b.q_start), len(ends))
        if g == len(ends):
            groups.append([])
            ends.append(0)
        groups[g].append(b)
        ends[g] = b.q_stop
    return groups


def window_steps(layout: Layout, causal: bool, rank: int, world_size: int, total: int, window: Window
                 ) -> tuple[tuple[BlockTask, ...], ...]:
    """The engine's tasks for every ring step of unpacked sequences of ``total`` tokens under a sliding
    ``window``: banded, full or causal blocks, one call each."""
    return tuple(tuple(t for b in blocks for t in split_doc_block(b))
                 for blocks in window_plan(layout, causal, rank, world_size, total, window))


def _check_first_step(blocks: Sequence[DocBlock], local_len: int) -> None:
    """The engine writes step 0's results instead of merging them, which is exact only if its tasks
    cover every query row and every key row exactly once: each document's whole block with itself,
    full or causal (one task each)."""
    spans = sorted((b.q_start, b.q_stop) for b in blocks)
    whole = all((b.q_start, b.q_stop) == (b.kv_start, b.kv_stop) and b.diag in (None, 0) for b in blocks)
    tiled = bool(spans) and spans[0][0] == 0 and spans[-1][1] == local_len and all(
        x[1] == y[0] for x, y in zip(spans, spans[1:]))
    if not (whole and tiled):
        raise RuntimeError("internal error: a packed plan's first step does not cover each row exactly once; "
                           "please report it with the layout and cu_seqlens")
