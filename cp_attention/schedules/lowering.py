"""Lowering: one rank's document blocks per ring step as the engine's tasks.

A block runs as plain :class:`~cp_attention.schedules.blocks.BlockTask` s (at most a full and a
causal one; a sliding-window band as tiles along it), or, when small and the kernel takes a mask,
joins a :class:`BatchSpec`: the engine runs each as one padded kernel call per size bucket
(:class:`~cp_attention.engine.doc_batch.DocBatch`), so thousands of short documents do not become
thousands of Python-level kernel calls.

Folding: a small document's block with its own keys (step 0) waits for the document's first block at
a later step and runs with it as one masked call over both key sets (the rank's own K/V, which it
always holds, and the shard held then). The CPU kernels' cost grows with query rows far more than
with keys (8 heads x 64: 16 queries x 16 keys causal 43 us, x 32 keys masked 47 us), so one call
over both costs little more than either alone, and the document's rows need no merge: they are
written once, like step 0's. Pure Python, no tensors.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple, Sequence

from .blocks import BlockTask, DocBlock

__all__ = ["BatchSpec", "VarlenSpec", "lower_steps", "split_doc_block", "square_pieces", "SMALL_BLOCK", "BAND_TILE"]

# A block whose longer side is at most this joins a padded batch; longer ones run alone, where
# per-call overhead is small against their work and gathering and padding would cost more than they
# save (scripts/benchmark_packed.py: 64 beat 128 by ~15% and tied with 32 at 1,000 documents in 64K).
SMALL_BLOCK = 64


class BatchSpec(NamedTuple):
    """Small document blocks of one ring step that run as padded batched kernel calls.

    ``blocks`` run against the shard held at the step; each ``(home, later)`` of ``folds`` runs as one
    entry against this rank's own keys (home's) and the held shard's (later's). ``first``: the batch
    is the first to write its query rows and its own-key rows, so results are written, not merged.
    The entries' query rows are disjoint; key rows may repeat.
    """

    blocks: tuple[DocBlock, ...]
    folds: tuple[tuple[DocBlock, DocBlock], ...]
    first: bool


class VarlenSpec(NamedTuple):
    """Blocks of one ring step that run as ONE variable-length kernel call (flash's ``cum_seq_q/k``):
    each piece is a full block or a square causal one (so the op's bottom-right causal alignment is
    our top-left), all of one kind (``causal``), with disjoint query rows. ``first`` as in
    :class:`BatchSpec`."""

    pieces: tuple[BlockTask, ...]
    causal: bool
    first: bool


def square_pieces(task: BlockTask) -> tuple[BlockTask, ...]:
    """A block task as full and square causal tasks only: a top-left causal block with fewer rows than
    keys sees only its first ``rows`` keys (a square); with more rows, its first ``keys`` rows are a
    square and the rest see every key."""
    rows, cols = task.q_stop - task.q_start, task.kv_stop - task.kv_start
    if not task.causal or rows == cols:
        return (task,)
    if rows < cols:
        return (BlockTask(task.q_start, task.q_stop, task.kv_start, task.kv_start + rows, True),)
    return (BlockTask(task.q_start, task.q_start + cols, task.kv_start, task.kv_stop, True),
            BlockTask(task.q_start + cols, task.q_stop, task.kv_start, task.kv_stop, False))


def _varlen_step(blocks: Sequence[DocBlock], first: bool) -> tuple[VarlenSpec, ...]:
    pieces = [p for b in blocks for t in split_doc_block(b) for p in square_pieces(t)]
    specs = []
    for causal in (True, False):
        kind = [p for p in pieces if p.causal == causal]
        specs += [VarlenSpec(tuple(group), causal, first) for group in _disjoint_rows(kind)]
    return tuple(specs)


def lower_steps(plan: Sequence[Sequence[DocBlock]], batched: bool, tiled: bool, local_len: int,
                varlen: bool = False) -> tuple[tuple["BlockTask | BatchSpec | VarlenSpec", ...], ...]:
    """The engine's tasks for every ring step of one rank's block ``plan``.

    ``varlen`` (a kernel that takes variable-length batches; blocks without a window band): each step
    is a few :class:`VarlenSpec` (one per mask kind, more only where query rows overlap), whatever
    the number of documents. Else ``batched`` (a kernel that takes a mask): small blocks join one
    :class:`BatchSpec` per step (or a few, so query rows never overlap within one); with ``tiled``, a
    small document's step-0 block is folded into its first later small block. The rest run as plain
    tasks. ``tiled``: step 0 covers every query and key row of the ``local_len`` exactly once (packed
    documents without a window).

    Raises ``RuntimeError`` if ``tiled`` is claimed for a plan whose step 0 does not tile the rows.
    """
    if tiled:
        _check_first_step(plan[0], local_len)
    if varlen:
        if any(b.lo is not None for blocks in plan for b in blocks):
            raise RuntimeError("internal error: sliding-window bands cannot run as variable-length batches")
        return tuple(_varlen_step(blocks, tiled and s == 0) for s, blocks in enumerate(plan))
    small = [[i for i, b in enumerate(blocks) if batched and max(b.q_len, b.kv_len) <= SMALL_BLOCK]
             for blocks in plan]
    folds = _folds(plan, small) if tiled else [[] for _ in plan]
    folded = {ix for pairs in folds for pair in pairs for ix in pair}
    steps = []
    for s, blocks in enumerate(plan):
        batched_here = [blocks[i] for i in small[s] if (s, i) not in folded]
        is_small = set(small[s])
        tasks = tuple(t for i, b in enumerate(blocks) if i not in is_small for t in split_doc_block(b))
        batches = [BatchSpec(tuple(group), (), tiled and s == 0) for group in _disjoint_rows(batched_here)]
        if folds[s]:
            batches.append(BatchSpec((), tuple((plan[0][h], plan[s][i]) for (_, h), (_, i) in folds[s]), True))
        steps.append(tuple(batches) + tasks)
    return tuple(steps)


def _folds(plan: Sequence[Sequence[DocBlock]], small: Sequence[Sequence[int]]
           ) -> list[list[tuple[tuple[int, int], tuple[int, int]]]]:
    """Per step, the ``((0, home), (step, later))`` block indices to fold: a small step-0 block (a
    document's rows against its own keys, all of its rows here) with the document's first block at a
    later step, if that one is small too (its rows lie within the home block's). Until then no task
    touches the document's rows, so the folded entry writes them first."""
    homes = sorted(small[0], key=lambda i: plan[0][i].q_start)
    starts = [plan[0][i].q_start for i in homes]
    unseen = [True] * len(homes)
    folds: list[list] = [[] for _ in plan]
    for s in range(1, len(plan)):
        is_small = set(small[s])
        for i, b in enumerate(plan[s]):
            j = bisect.bisect_right(starts, b.q_start) - 1
            if j >= 0 and unseen[j] and b.q_stop <= plan[0][homes[j]].q_stop:
                unseen[j] = False
                if i in is_small:
                    folds[s].append(((0, homes[j]), (s, i)))
    return folds


def _disjoint_rows(blocks: Sequence["DocBlock | BlockTask"]) -> list[list["DocBlock | BlockTask"]]:
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
