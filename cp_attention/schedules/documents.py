"""Ring schedules for packed documents (``cu_seqlens``): one rule for every layout.

A token attends only within its document, so at ring step ``s`` rank ``r``'s work is, for every
document present both in its queries and in the K/V shard of rank ``j = (r - s) mod N``, one
(document piece x document piece) :class:`DocBlock`: full, banded-causal, or skipped. The blocks are
derived from the layouts' global positions, so any layout whose packed positions increase on every
rank gets an exact schedule; ``tests/test_doc_schedule.py`` proves every allowed pair is computed
exactly once. Pure index math, no torch.distributed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from .documents import CuSeqlens, check_cu_seqlens, document_ids
from .layout import Layout, get_layout
from .schedule import BlockTask, source_rank

__all__ = ["DocBlock", "doc_plan", "doc_block_pairs", "split_doc_block"]


@dataclass(frozen=True)
class DocBlock:
    """Local query rows ``q_start:q_stop`` of one document against that document's K/V rows
    ``kv_start:kv_stop`` of the shard held at this step.

    ``diag`` None: no upper bound. Otherwise query ``i`` of the block (counted from ``q_start``) sees
    key ``b`` (from ``kv_start``) only if ``b <= i + diag``: a causal band whose diagonal is shifted by
    ``diag`` (0 is the top-left triangle). ``lo`` (sliding windows only; None: no lower bound) also
    requires ``b >= i + lo``. Every query row sees at least one key, and every key is seen.
    """

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int
    diag: Optional[int]
    lo: Optional[int] = None

    @property
    def q_len(self) -> int:
        return self.q_stop - self.q_start

    @property
    def kv_len(self) -> int:
        return self.kv_stop - self.kv_start


def _ranges(sorted_ids: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.arange(count)
    return torch.searchsorted(sorted_ids, ids), torch.searchsorted(sorted_ids, ids, right=True)


def _step_blocks(qpos: torch.Tensor, kpos: torch.Tensor, doc_of: torch.Tensor, causal: bool,
                 layout_name: str) -> tuple[DocBlock, ...]:
    """The blocks of one step, vectorised over documents: ``qpos``/``kpos`` are the increasing
    packed-stream indices of the query rows and of the held K/V rows."""
    docs = int(doc_of[-1]) + 1
    qdoc, kdoc = doc_of[qpos], doc_of[kpos]
    q_lo, q_hi = _ranges(qdoc, docs)
    k_lo, k_hi = _ranges(kdoc, docs)
    present = (q_hi > q_lo) & (k_hi > k_lo)
    if not causal:
        sel = torch.nonzero(present).flatten()
        rows = torch.stack([q_lo[sel], q_hi[sel], k_lo[sel], k_hi[sel]], 1).tolist()
        return tuple(DocBlock(a, b, c, d, None) for a, b, c, d in rows)
    width = (k_hi - k_lo)[qdoc]
    # visible[i]: how many of its document's held keys query row i sees (keys at positions <= its own).
    visible = (torch.searchsorted(kpos, qpos, right=True) - k_lo[qdoc]).clamp(min=0)
    visible = torch.minimum(visible, width)
    blind = torch.bincount(qdoc, weights=(visible == 0).double(), minlength=docs).long()
    qa = q_lo + blind  # rows that see nothing come first (positions increase): trim them
    last = torch.where(q_hi > q_lo, visible[(q_hi - 1).clamp(min=0)], torch.zeros_like(q_hi))
    keep = present & (qa < q_hi) & (last > 0)
    sel = torch.nonzero(keep).flatten()
    if sel.numel() == 0:
        return ()
    first = visible[qa[sel]]
    # Exactness guard: within a kept block, row i must see min(i + first, last) keys (a band).
    kept_row = keep[qdoc] & (torch.arange(qpos.numel()) >= qa[qdoc])
    rel = torch.arange(qpos.numel()) - qa[qdoc]
    firsts = torch.zeros(docs, dtype=torch.long)
    firsts[sel] = first
    expected = torch.minimum(rel + firsts[qdoc], last[qdoc])
    if not torch.equal(visible[kept_row], expected[kept_row]):
        raise NotImplementedError(
            f"layout {layout_name!r} places packed documents so that a block is neither full nor a causal band; "
            "packed sequences need every document's tokens in increasing order on each rank")
    full = first == last[sel]
    rows = torch.stack([qa[sel], q_hi[sel], k_lo[sel], k_lo[sel] + last[sel], first - 1, full.long()], 1).tolist()
    return tuple(DocBlock(a, b, c, d, None if f else g) for a, b, c, d, g, f in rows)


@functools.lru_cache(maxsize=64)
def _cached_plan(layout: Layout, causal: bool, rank: int, world_size: int, cu: tuple[int, ...]
                 ) -> tuple[tuple[DocBlock, ...], ...]:
    total = cu[-1]
    doc_of = document_ids(cu)
    qpos = layout.positions(total, rank, world_size, cu)
    if qpos.numel() > 1 and not bool((qpos[1:] > qpos[:-1]).all()):
        raise NotImplementedError(f"layout {layout.name!r} does not hold packed tokens in increasing order, "
                                  "which the packed-sequence schedule needs")
    steps = []
    for s in range(world_size):
        j = source_rank(rank, world_size, s)
        kpos = qpos if j == rank else layout.positions(total, j, world_size, cu)
        steps.append(_step_blocks(qpos, kpos, doc_of, causal, layout.name))
    return tuple(steps)


def doc_plan(layout: "str | Layout", causal: bool, rank: int, world_size: int, cu_seqlens: CuSeqlens
             ) -> tuple[tuple[DocBlock, ...], ...]:
    """All ring steps of one rank for packed documents: ``plan[step]`` is the tuple of
    :class:`DocBlock` (one per document with work at that step). Cached per arguments.

    Raises ``ValueError`` for bad ``cu_seqlens`` or a total the layout cannot split, and
    ``NotImplementedError`` for a layout that cannot split packed documents.
    """
    lay = get_layout(layout)
    cu = check_cu_seqlens(cu_seqlens)
    lay.check(cu[-1], world_size)
    return _cached_plan(lay, bool(causal), rank, world_size, cu)


def doc_block_pairs(block: DocBlock) -> int:
    """Number of (query, key) score pairs a block computes."""
    a, w = block.q_len, block.kv_len
    if block.lo is not None:
        i = torch.arange(a)
        last = i + block.diag if block.diag is not None else torch.full_like(i, w - 1)
        return int((last.clamp(max=w - 1) - (i + block.lo).clamp(min=0) + 1).clamp(min=0).sum())
    if block.diag is None:
        return a * w
    # Row i sees min(i + diag + 1, w) keys: a ramp until the band reaches the last key, then full rows.
    ramp = max(0, min(a, w - block.diag - 1))
    first = block.diag + 1
    return ramp * first + ramp * (ramp - 1) // 2 + (a - ramp) * w


def split_doc_block(block: DocBlock) -> tuple[BlockTask, ...]:
    """The same pairs as at most two plain :class:`BlockTask` (a full block and a top-left causal one),
    for kernels that run blocks one by one; a sliding-window block as tiles along its band."""
    qa, qb, ka, kb, d = block.q_start, block.q_stop, block.kv_start, block.kv_stop, block.diag
    if block.lo is not None:
        return _band_tiles(block)
    if d is None:
        return (BlockTask(qa, qb, ka, kb, False),)
    # Row i sees key b iff b <= i + d: the first d keys are seen by every row, and past them row i
    # sees key d + c iff c <= i, the top-left triangle.
    split = ka + d
    tasks = (BlockTask(qa, qb, ka, split, False),) if d > 0 else ()
    return tasks + (BlockTask(qa, qb, split, kb, True),)


# Rows per tile along a sliding-window band, at least: a kernel call must amortise its overhead
# (S=16K, 8 heads x 64, CPU flash op, windows S/64 and S/8: 256 beat 64, 128 and 512 by 5-30%).
BAND_TILE = 256


def _band_tiles(block: DocBlock) -> tuple[BlockTask, ...]:
    """A sliding-window block as row tiles, each against only the keys its rows can see, so the work
    follows the band instead of the whole rectangle. A tile's keys split into the part bounded below
    (masked), the part every row sees (full) and the part bounded above (causal), so only a small
    corner needs a mask; a tile taller than the band is one masked task."""
    rows, cols, lo, hi = block.q_len, block.kv_len, block.lo, block.diag
    top = cols - 1 if hi is None else hi
    step = max(BAND_TILE, (top - lo + 1) // 4)
    tasks = []
    for i0 in range(0, rows, step):
        i1 = min(rows, i0 + step)
        k0, k1 = max(0, i0 + lo), min(cols, i1 + top)
        r, c = i1 - i0, k1 - k0
        t_lo, t_hi = lo + i0 - k0, top + i0 - k0  # row i of the tile sees key b iff t_lo <= b - i <= t_hi
        q0, kv0 = block.q_start + i0, block.kv_start + k0
        m0 = min(c, max(0, r - 1 + t_lo))  # keys before m0: some rows are past them
        m1 = min(c, t_hi) if hi is not None else c  # keys from m1: some rows have not reached them
        if m0 > m1:
            tasks.append(BlockTask(q0, q0 + r, kv0, kv0 + c, False, (t_lo, t_hi)))
            continue
        if m0 > 0:  # seen only by its first rows (row i sees key b < m0 iff b >= i + t_lo)
            tasks.append(BlockTask(q0, q0 + min(r, m0 - t_lo), kv0, kv0 + m0, False, (t_lo, t_hi)))
        if m1 > m0:
            tasks.append(BlockTask(q0, q0 + r, kv0 + m0, kv0 + m1, False))
        if c > m1:
            # Row i sees key m1 + b iff b <= i + t_hi - m1 = i (m1 == t_hi here): top-left causal.
            tasks.append(BlockTask(q0, q0 + r, kv0 + m1, kv0 + c, True))
    return tuple(tasks)
