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
written once, like step 0's.

The blocks arrive as a :class:`~cp_attention.schedules.table.BlockTable` (columns) and batches keep
theirs as ``[E, 6]`` tensors, so the work per step is a few vectorised operations, not one per
block; only blocks that run alone become Python objects. Index math on host tensors.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from .blocks import BlockTask, DocBlock
from .table import DIAG, KV_START, KV_STOP, LO, Q_START, Q_STOP, STEP, UNBOUNDED, BlockTable, doc_blocks

__all__ = ["BatchGroup", "BatchSpec", "VarlenSpec", "lower_steps", "split_doc_block", "square_pieces", "SMALL_BLOCK",
           "BAND_TILE"]

# A block whose longer side is at most this joins a padded batch; longer ones run alone, where
# per-call overhead is small against their work and gathering and padding would cost more than they
# save (scripts/benchmark_packed.py: 64 beat 128 by ~15% and tied with 32 at 1,000 documents in 64K).
SMALL_BLOCK = 64

_EMPTY = torch.zeros(0, 6, dtype=torch.long)


class BatchGroup:
    """The batch specs of one rank's lowered steps, so the engine builds all their index tensors at once
    (:func:`cp_attention.engine.doc_index.build_buckets`); ``built`` keeps them per device."""

    __slots__ = ("specs", "built")

    def __init__(self) -> None:
        self.specs: list[BatchSpec] = []
        self.built: dict = {}

    def add(self, table: torch.Tensor, homes: torch.Tensor, laters: torch.Tensor, first: bool) -> BatchSpec:
        """A new :class:`BatchSpec` of this group."""
        spec = BatchSpec(table, homes, laters, first, self, len(self.specs))
        self.specs.append(spec)
        return spec


class BatchSpec(NamedTuple):
    """Small document blocks of one ring step that run as padded batched kernel calls.

    ``table [E, 6]`` (``q_start, q_stop, kv_start, kv_stop, diag, lo`` as in
    :mod:`~cp_attention.schedules.table`) run against the shard held at the step; each row pair of
    ``homes [F, 6]`` and ``laters [F, 6]`` runs as one entry against this rank's own keys (home's) and
    the held shard's (later's). ``first``: the batch is the first to write its query rows and its
    own-key rows, so results are written, not merged. The entries' query rows are disjoint; key rows
    may repeat. :attr:`blocks` and :attr:`folds` give them as :class:`DocBlock` s. ``group``: the
    lowered steps' batches (None: this one alone), of which this is number ``index``.
    """

    table: torch.Tensor
    homes: torch.Tensor
    laters: torch.Tensor
    first: bool
    group: BatchGroup | None = None
    index: int = 0  # type: ignore[assignment]  # a field, deliberately shadowing tuple.index

    @property
    def blocks(self) -> tuple[DocBlock, ...]:
        return doc_blocks(self.table)

    @property
    def folds(self) -> tuple[tuple[DocBlock, DocBlock], ...]:
        return tuple(zip(doc_blocks(self.homes), doc_blocks(self.laters)))


class VarlenSpec(NamedTuple):
    """Blocks of one ring step that run as ONE variable-length kernel call (flash's ``cum_seq_q/k``):
    each piece (a row ``q_start, q_stop, kv_start, kv_stop`` of ``table [P, 4]``) is a full block or a
    square causal one (so the op's bottom-right causal alignment is our top-left), all of one kind
    (``causal``), with disjoint query rows. ``first`` as in :class:`BatchSpec`. :attr:`pieces` gives
    them as :class:`BlockTask` s."""

    table: torch.Tensor
    causal: bool
    first: bool

    @property
    def pieces(self) -> tuple[BlockTask, ...]:
        return tuple(BlockTask(a, b, c, d, self.causal) for a, b, c, d in self.table.tolist())


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


def lower_steps(steps: BlockTable | Sequence[Sequence[DocBlock]], batched: bool, tiled: bool, local_len: int,
                varlen: bool = False) -> tuple[tuple[BlockTask | BatchSpec | VarlenSpec, ...], ...]:
    """The engine's tasks for every ring step of one rank's blocks ``steps`` (a :class:`BlockTable`, or
    per-step :class:`DocBlock` s).

    ``varlen`` (a kernel that takes variable-length batches; blocks without a window band): each step
    is a few :class:`VarlenSpec` (one per mask kind, more only where query rows overlap), whatever
    the number of documents. Else ``batched`` (a kernel that takes a mask): small blocks join one
    :class:`BatchSpec` per step (or a few, so query rows never overlap within one); with ``tiled``, a
    small document's step-0 block is folded into its first later small block. The rest run as plain
    tasks. ``tiled``: step 0 covers every query and key row of the ``local_len`` exactly once (packed
    documents without a window).

    Raises ``RuntimeError`` if ``tiled`` is claimed for steps whose step 0 does not tile the rows.
    """
    table = steps if isinstance(steps, BlockTable) else BlockTable.from_blocks(steps)
    if tiled:
        _check_first_step(table.step(0), local_len)
    if varlen:
        if bool((table.rows[:, LO] > -UNBOUNDED).any()):
            raise RuntimeError("internal error: sliding-window bands cannot run as variable-length batches")
        return _varlen_steps(table, tiled)
    rows, bounds = table.rows, table.bounds()
    longest = torch.maximum(rows[:, Q_STOP] - rows[:, Q_START], rows[:, KV_STOP] - rows[:, KV_START])
    small = longest <= SMALL_BLOCK if batched else torch.zeros(rows.shape[0], dtype=torch.bool)
    folded = torch.zeros(rows.shape[0], dtype=torch.bool)
    homes = laters = torch.zeros(0, dtype=torch.long)
    if tiled and batched:
        homes, laters = _folds(rows, small, bounds[1])
        folded[homes] = True
        folded[laters] = True
    later_step = rows[laters, STEP]
    group = BatchGroup()
    lowered: list[tuple[BlockTask | BatchSpec | VarlenSpec, ...]] = []
    for s in range(table.steps):
        here = rows[bounds[s]:bounds[s + 1], 1:]
        batched_here = here[small[bounds[s]:bounds[s + 1]] & ~folded[bounds[s]:bounds[s + 1]]]
        big = doc_blocks(here[~small[bounds[s]:bounds[s + 1]]])
        tasks = tuple(t for b in big for t in split_doc_block(b))
        batches = [group.add(g, _EMPTY, _EMPTY, tiled and s == 0) for g in _disjoint_rows(batched_here)]
        at = later_step == s
        if s > 0 and bool(at.any()):
            batches.append(group.add(_EMPTY, rows[homes[at], 1:], rows[laters[at], 1:], True))
        lowered.append(tuple(batches) + tasks)
    return tuple(lowered)


def _folds(rows: torch.Tensor, small: torch.Tensor, step0_end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices ``(homes, laters)`` of the blocks to fold: a small step-0 block (a document's rows
    against its own keys, all of its rows here) with the document's first block at a later step, if
    that one is small too (its rows lie within the home block's). Until then no task touches the
    document's rows, so the folded entry writes them first."""
    candidates = torch.nonzero(small[:step0_end]).flatten()
    if candidates.numel() == 0:
        return candidates, candidates
    order = torch.sort(rows[candidates, Q_START], stable=True)
    home_rows, starts = candidates[order.indices], order.values
    stops = rows[home_rows, Q_STOP]
    later = torch.arange(step0_end, rows.shape[0])
    j = torch.searchsorted(starts, rows[later, Q_START], right=True) - 1
    inside = (j >= 0) & (rows[later, Q_STOP] <= stops[j.clamp(min=0)])
    j, later = j[inside], later[inside]
    # Rows are in (step, query row) order, so the document's first later block has the lowest index.
    first = torch.full((home_rows.numel(),), rows.shape[0], dtype=torch.long).scatter_reduce_(0, j, later, "amin")
    fold = (first[j] == later) & small[later]
    return home_rows[j[fold]], later[fold]


def _disjoint_rows(blocks: torch.Tensor) -> list[torch.Tensor]:
    """Rows of ``blocks [B, >=2]`` (``q_start, q_stop`` first) in as few groups as possible whose query
    rows do not overlap within a group (a batch's results merge by row without conflicts), each in
    query-row order. Without a window every document has one block per step, so this is one group; a
    window can give a document's rows several blocks (then first fit, in query-row order)."""
    if blocks.shape[0] == 0:
        return []
    ordered = blocks[torch.sort(blocks[:, 0], stable=True).indices]
    if bool((ordered[1:, 0] >= ordered[:-1, 1]).all()):
        return [ordered]
    groups: list[list[int]] = []
    ends: list[int] = []
    for i, (start, stop) in enumerate(ordered[:, :2].tolist()):
        g = next((k for k, end in enumerate(ends) if end <= start), len(ends))
        if g == len(ends):
            groups.append([])
            ends.append(0)
        groups[g].append(i)
        ends[g] = stop
    return [ordered[torch.tensor(g)] for g in groups]


def _varlen_steps(table: BlockTable, tiled: bool) -> tuple[tuple[VarlenSpec, ...], ...]:
    """Each block as full and square causal pieces (:func:`split_doc_block`, then :func:`square_pieces`,
    vectorised), grouped per step and mask kind into calls with disjoint query rows."""
    rows, bounds = table.rows, table.bounds()
    qa, qb, ka, kb, d = (rows[:, c] for c in (Q_START, Q_STOP, KV_START, KV_STOP, DIAG))
    banded = d < UNBOUNDED
    split = torch.where(banded, ka + d, kb)  # keys before it are seen by every row
    r, c = qb - qa, kb - split  # the causal part's rows and keys
    square = torch.minimum(r, c)
    causal = torch.stack([qa, qa + square, split, split + square], 1)  # one per banded block
    full = torch.stack([qa, qb, ka, split], 1)  # the full part, if any
    rest = torch.stack([qa + c, qb, split, kb], 1)  # rows past the causal square see every key
    has_full, has_rest = split > ka, banded & (r > c)
    # Plain pieces in block order, a block's full part before its rest (query rows overlap there).
    plain = torch.stack([full, rest], 1).reshape(-1, 4)
    plain_on = torch.stack([has_full, has_rest], 1).reshape(-1)
    second = torch.stack([torch.zeros_like(has_rest), has_rest & has_full], 1).reshape(-1)
    specs = []
    for s in range(table.steps):
        a, b = bounds[s], bounds[s + 1]
        first = tiled and s == 0
        mine = banded[a:b]
        groups = [(True, g) for g in _disjoint_rows(causal[a:b][mine])]
        on = plain_on[2 * a:2 * b]
        pieces, late = plain[2 * a:2 * b][on], second[2 * a:2 * b][on]
        if _blocks_disjoint(rows[a:b]):
            # Blocks' query rows do not overlap, so first fit puts exactly the rests of blocks with a
            # full part in a second group.
            groups += [(False, g) for part in (pieces[~late], pieces[late]) for g in _disjoint_rows(part)]
        else:
            groups += [(False, g) for g in _disjoint_rows(pieces)]
        specs.append(tuple(VarlenSpec(g, kind, first) for kind, g in groups))
    return tuple(specs)


def _blocks_disjoint(rows: torch.Tensor) -> bool:
    """Whether the query rows of blocks ``rows [B, 7]`` never overlap."""
    if rows.shape[0] < 2:
        return True
    ordered = rows[torch.sort(rows[:, Q_START], stable=True).indices]
    return bool((ordered[1:, Q_START] >= ordered[:-1, Q_STOP]).all())


def _check_first_step(rows: torch.Tensor, local_len: int) -> None:
    """The engine writes step 0's results instead of merging them, which is exact only if its tasks
    cover every query row and every key row exactly once: each document's whole block with itself,
    full or causal (one task each)."""
    spans = rows[torch.sort(rows[:, Q_START], stable=True).indices]
    whole = bool(((rows[:, Q_START] == rows[:, KV_START]) & (rows[:, Q_STOP] == rows[:, KV_STOP])
                  & ((rows[:, DIAG] == 0) | (rows[:, DIAG] >= UNBOUNDED))).all())
    tiled = spans.shape[0] > 0 and int(spans[0, Q_START]) == 0 and int(spans[-1, Q_STOP]) == local_len and bool(
        (spans[1:, Q_START] == spans[:-1, Q_STOP]).all())
    if not (whole and tiled):
        raise RuntimeError("internal error: a rank's first packed step does not cover each row exactly once; "
                           "please report it with the layout and cu_seqlens")


def split_doc_block(block: DocBlock) -> tuple[BlockTask, ...]:
    """The same pairs as at most two plain :class:`BlockTask` (a full block and a top-left causal one),
    for kernels that run blocks one by one; a sliding-window block as tiles along its band."""
    qa, qb, ka, kb, d = block.q_start, block.q_stop, block.kv_start, block.kv_stop, block.diag
    if block.lo is not None:
        return _band_tiles(block, block.lo)
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


def _band_tiles(block: DocBlock, lo: int) -> tuple[BlockTask, ...]:
    """A sliding-window block as row tiles, each against only the keys its rows can see, so the work
    follows the band instead of the whole rectangle. A tile's keys split into the part bounded below
    (masked), the part every row sees (full) and the part bounded above (causal), so only a small
    corner needs a mask; a tile taller than the band is one masked task. ``lo``: ``block.lo``, set."""
    rows, cols, hi = block.q_len, block.kv_len, block.diag
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
