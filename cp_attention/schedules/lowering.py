"""Packed documents in the engine: a ring step's document blocks as a few kernel calls.

Thousands of short documents must not become thousands of Python-level kernel calls. A step's small
:class:`~cp_attention.doc_schedule.DocBlock` s are gathered into padded batches, one per size bucket,
and each batch is one kernel call: causal for documents' diagonal blocks, else masked with the
blocks' own band, so the result is exact. Padding rows are discarded in forward and get an LSE of
+inf (probabilities exactly 0) in backward. Larger blocks run on their own as plain
:class:`~cp_attention.schedule.BlockTask` s, as do all blocks for a kernel that takes no mask.

Folding: a small document's block with its own keys (step 0) waits for the document's first block at
a later step and runs with it as one masked call over both key sets (the rank's own K/V, which it
always holds, and the shard held then). The CPU kernels' cost grows with query rows far more than
with keys (8 heads x 64: 16 queries x 16 keys causal 43 us, x 32 keys masked 47 us), so one call
over both costs little more than either alone, and the document's rows need no merge: they are
written once, like step 0's.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass, fields
from typing import NamedTuple, Optional, Sequence

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


class _KeySpan(NamedTuple):
    """Keys ``kv_start:kv_start+kv_len`` of one source, seen by the block's query rows
    ``q_off:q_off+q_len`` through a band (``diag``/``lo`` as in :class:`DocBlock`)."""

    own: bool  # True: this rank's own K/V shard; False: the shard held at the step
    kv_start: int
    kv_len: int
    q_off: int
    q_len: int
    diag: Optional[int]
    lo: Optional[int]


class _Spec(NamedTuple):
    """One entry of a padded batch: query rows ``q_start:q_start+q_len`` and the key spans they see."""

    q_start: int
    q_len: int
    spans: tuple[_KeySpan, ...]


def _plain(b: DocBlock) -> _Spec:
    return _Spec(b.q_start, b.q_len, (_KeySpan(False, b.kv_start, b.kv_len, 0, b.q_len, b.diag, b.lo),))


def _folded(home: DocBlock, later: DocBlock) -> _Spec:
    """``home`` (a document's block with this rank's own keys, covering all its rows here) and a later
    step's block of the same document, whose rows are among home's."""
    return _Spec(home.q_start, home.q_len, (
        _KeySpan(True, home.kv_start, home.kv_len, 0, home.q_len, home.diag, home.lo),
        _KeySpan(False, later.kv_start, later.kv_len, later.q_start - home.q_start, later.q_len, later.diag, later.lo)))


def _bucket(spec: _Spec) -> tuple:
    """(padded query rows, per key span (own?, padded keys), causal square?) of an entry. A causal
    square (the diagonal of a document) needs no mask: padded keys come after every real query, so
    the top-left triangle hides them."""
    (first, *rest) = spec.spans
    square = (not rest and first.diag == 0 and first.lo is None and first.kv_len == spec.q_len)
    return _size(spec.q_len), tuple((k.own, _size(k.kv_len)) for k in spec.spans), square


@dataclass(frozen=True)
class _Keys:
    """A bucket's keys from one source."""

    own: bool
    idx: torch.Tensor  # [E, Lk] key rows; padding repeats the span's first key
    rows: torch.Tensor  # [Rk] the real (unpadded) key rows (precomputed: no boolean index per call)
    sel: torch.Tensor  # [Rk] their positions in the flattened [E * Lk]


@dataclass(frozen=True)
class _Bucket:
    q_idx: torch.Tensor  # [E, Lq] local query rows; padding repeats the entry's first row
    q_valid: torch.Tensor  # [E, Lq] bool
    keys: tuple[_Keys, ...]  # concatenated along the key axis
    mask: "torch.Tensor | None"  # [E, Lq, sum Lk] bool, True where a query may see a key; None: causal square
    no_lse: torch.Tensor  # [E, 1, Lq]: +inf on padding rows, 0 elsewhere
    q_rows: torch.Tensor  # [R] local query rows, = q_idx[q_valid]
    q_sel: torch.Tensor  # [R] their positions in the flattened [E * Lq]

    def to(self, device: torch.device) -> "_Bucket":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        keys = tuple(_Keys(k.own, move(k.idx), move(k.rows), move(k.sel)) for k in self.keys)
        return _Bucket(**{f.name: keys if f.name == "keys" else move(getattr(self, f.name)) for f in fields(self)})


def _column(specs: Sequence, attr: str, default: int = 0) -> torch.Tensor:
    """``[E, 1, 1]`` of an int attribute (``default`` for None)."""
    return torch.tensor([default if getattr(x, attr) is None else getattr(x, attr) for x in specs])[:, None, None]


def _make_bucket(specs: Sequence[_Spec], lq: int, key_sizes: tuple[tuple[bool, int], ...], square: bool) -> _Bucket:
    aq = torch.arange(lq)
    q0 = torch.tensor([s.q_start for s in specs])[:, None]
    q_valid = aq[None, :] < torch.tensor([s.q_len for s in specs])[:, None]
    keys, masks = [], []
    for j, (own, lk) in enumerate(key_sizes):
        spans = [s.spans[j] for s in specs]
        ak = torch.arange(lk)
        k0 = torch.tensor([k.kv_start for k in spans])[:, None]
        kv_valid = ak[None, :] < torch.tensor([k.kv_len for k in spans])[:, None]
        kv_idx = torch.where(kv_valid, k0 + ak, k0)
        keys.append(_Keys(own, kv_idx, kv_idx[kv_valid], torch.nonzero(kv_valid.flatten()).flatten()))
        if not square:
            row = aq[None, :, None] - _column(spans, "q_off")  # the query's row within the span's rows
            offset = ak[None, None, :] - row
            masks.append(kv_valid[:, None, :] & (row >= 0) & (row < _column(spans, "q_len"))
                         & (offset <= _column(spans, "diag", lq + lk)) & (offset >= _column(spans, "lo", -(lq + lk))))
    mask = None
    if not square:
        mask = torch.cat(masks, 2)
        mask[..., 0] |= ~q_valid  # padding rows see a key, so no kernel meets an empty row
    # Backward gives padding rows an LSE of +inf: their probabilities are exactly 0, whatever they see.
    no_lse = torch.zeros(q_valid.shape, dtype=torch.float64).masked_fill_(~q_valid, float("inf"))[:, None, :]
    q_idx = torch.where(q_valid, q0 + aq, q0)
    return _Bucket(q_idx, q_valid, tuple(keys), mask, no_lse, q_idx[q_valid], torch.nonzero(q_valid.flatten()).flatten())


def _valid(x: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """``x [E, L, ...]`` at the flat positions ``sel`` -> ``[1, R, ...]``."""
    return x.flatten(0, 1).index_select(0, sel)[None]


def _rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x [1, n, ...]`` at rows ``idx [E, L]`` -> ``[E, L, ...]`` (index_select: ~2.5x faster than indexing)."""
    return x[0].index_select(0, idx.flatten()).view(*idx.shape, *x.shape[2:])


def _gather_keys(b: _Bucket, held: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    parts = [_rows(own if k.own else held, k.idx) for k in b.keys]
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


class DocBatch:
    """Small document blocks of one ring step, run as one padded kernel call per size bucket (masked,
    or causal without a mask for documents' diagonal blocks).

    ``blocks`` run against the shard held at the step; each ``(home, later)`` of ``folds`` runs as
    one entry against this rank's own keys (home's) and the held shard's (later's). ``first``: this
    batch is the first to write its query rows and its own-key rows (step 0 of a plan whose step 0
    tiles the rows, or folds), so results are written, not merged.

    The entries' query rows must be disjoint (:func:`packed_steps` groups them so), so results merge
    back without conflicts; key rows may repeat (their gradients are summed).
    """

    def __init__(self, blocks: Sequence[DocBlock], device: torch.device, first: bool = False,
                 folds: Sequence[tuple[DocBlock, DocBlock]] = ()) -> None:
        groups: dict[tuple, list[_Spec]] = {}
        for spec in [_plain(b) for b in blocks] + [_folded(h, b) for h, b in folds]:
            groups.setdefault(_bucket(spec), []).append(spec)
        self.buckets = [_make_bucket(groups[key], *key).to(device) for key in sorted(groups)]
        self.blocks = tuple(blocks)
        self.folds = tuple(folds)
        self.first = first

    def forward(self, kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_own: torch.Tensor,
                v_own: torch.Tensor, scale: float, kwargs: dict) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``q [1, n, H, D]``, the held ``k``/``v`` and this rank's own ``k_own``/``v_own`` -> per
        bucket ``(rows, out [1, R, H, Dv], lse [1, H, R])`` for its R query rows ``rows`` (a LongTensor)."""
        results = []
        for b in self.buckets:
            extra = {} if b.mask is None else {"mask": b.mask}
            o, lse = kernel.forward(_rows(q, b.q_idx), _gather_keys(b, k, k_own), _gather_keys(b, v, v_own),
                                    b.mask is None, scale, **extra, **kwargs)
            results.append((b.q_rows, _valid(o, b.q_sel), _valid(lse.transpose(1, 2), b.q_sel).transpose(1, 2)))
        return results

    def backward(self, kernel, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_own: torch.Tensor, v_own: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, scale: float,
                 kwargs: dict):
        """Gradients of every bucket given the final ``out``/``lse``: per bucket ``(q_rows,
        dq [1, R, H, D], keys)`` with ``keys`` a list of ``(own, kv_rows, dk [1, Rk, Hkv, D],
        dv [1, Rk, Hkv, Dv])``: ``own`` rows index this rank's own shard, the others the held one."""
        results = []
        for b in self.buckets:
            extra = {} if b.mask is None else {"mask": b.mask}
            dout_b = _rows(dout, b.q_idx).masked_fill_(~b.q_valid[..., None, None], 0)
            lse_b = lse[0].index_select(1, b.q_idx.flatten()).view(-1, *b.q_idx.shape).transpose(0, 1)
            lse_b = lse_b + b.no_lse.to(lse.dtype)
            dq, dk, dv = kernel.backward(dout_b, _rows(q, b.q_idx), _gather_keys(b, k, k_own), _gather_keys(b, v, v_own),
                                         _rows(out, b.q_idx), lse_b, b.mask is None, scale, **extra, **kwargs)
            sizes = [key.idx.shape[1] for key in b.keys]
            keys = [(key.own, key.rows, _valid(dk_k, key.sel), _valid(dv_k, key.sel))
                    for key, dk_k, dv_k in zip(b.keys, dk.split(sizes, 1), dv.split(sizes, 1))]
            results.append((b.q_rows, _valid(dq, b.q_sel), keys))
        return results


@functools.lru_cache(maxsize=32)
def packed_steps(layout: Layout, causal: bool, rank: int, world_size: int, cu_seqlens: tuple[int, ...],
                 batched: bool, device: torch.device, window: "Window | None" = None
                 ) -> tuple[tuple["BlockTask | DocBatch", ...], ...]:
    """The engine's tasks for every ring step of packed documents (under a sliding ``window`` if
    given). With ``batched`` (a kernel that takes a mask) small blocks join one :class:`DocBatch` per
    step, and without a window a small document's step-0 block is folded into its first later small
    block; the rest run as plain tasks. Cached, so the layers of one model forward build it once."""
    plan = plan_blocks(layout, causal, rank, world_size, cu_seqlens[-1], cu_seqlens, window)
    tiled = window is None  # step 0 then covers every query and key row exactly once
    if tiled:
        _check_first_step(plan[0], cu_seqlens[-1] // world_size)
    small = [[i for i, b in enumerate(blocks) if batched and max(b.q_len, b.kv_len) <= SMALL_BLOCK]
             for blocks in plan]
    folds = _folds(plan, small) if tiled else [[] for _ in plan]
    folded = {ix for pairs in folds for pair in pairs for ix in pair}
    steps = []
    for s, blocks in enumerate(plan):
        batched_here = [blocks[i] for i in small[s] if (s, i) not in folded]
        is_small = set(small[s])
        tasks = tuple(t for i, b in enumerate(blocks) if i not in is_small for t in split_doc_block(b))
        batches = [DocBatch(group, device, first=tiled and s == 0) for group in _disjoint_rows(batched_here)]
        if folds[s]:
            batches.append(DocBatch((), device, first=True,
                                    folds=[(plan[0][h], plan[s][i]) for (_, h), (_, i) in folds[s]]))
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
