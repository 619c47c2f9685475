"""A rank's packed steps' former per-block implementations (one Python object per block, one step at a
time), kept as slow references for the vectorised ones: blocks per step, lowering, and the padded
batches' and variable-length batches' index tensors. Not collected as tests."""

from __future__ import annotations

import bisect
from typing import NamedTuple

import torch

from cp_attention.schedules import DocBlock, source_rank, split_doc_block
from cp_attention.schedules.lowering import SMALL_BLOCK, square_pieces


# ------------------------------------------------------------------------------------------ blocks
def _ranges(sorted_ids: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.arange(count)
    return torch.searchsorted(sorted_ids, ids), torch.searchsorted(sorted_ids, ids, right=True)


def step_blocks(qpos: torch.Tensor, kpos: torch.Tensor, doc_of: torch.Tensor, causal: bool) -> tuple[DocBlock, ...]:
    """One step's blocks, as the former ``packed._step_blocks`` computed them."""
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
    visible = torch.minimum((torch.searchsorted(kpos, qpos, right=True) - k_lo[qdoc]).clamp(min=0), width)
    blind = torch.bincount(qdoc, weights=(visible == 0).double(), minlength=docs).long()
    qa = q_lo + blind
    last = torch.where(q_hi > q_lo, visible[(q_hi - 1).clamp(min=0)], torch.zeros_like(q_hi))
    keep = present & (qa < q_hi) & (last > 0)
    sel = torch.nonzero(keep).flatten()
    first = visible[qa[sel]]
    full = first == last[sel]
    rows = torch.stack([qa[sel], q_hi[sel], k_lo[sel], k_lo[sel] + last[sel], first - 1, full.long()], 1).tolist()
    return tuple(DocBlock(a, b, c, d, None if f else g) for a, b, c, d, g, f in rows)


def rank_blocks(positions, doc_of, causal: bool, rank: int) -> tuple[tuple[DocBlock, ...], ...]:
    n = len(positions)
    return tuple(step_blocks(positions[rank], positions[source_rank(rank, n, s)], doc_of, causal) for s in range(n))


# ---------------------------------------------------------------------------------------- lowering
class Batch(NamedTuple):
    blocks: tuple
    folds: tuple
    first: bool


class Varlen(NamedTuple):
    pieces: tuple
    causal: bool
    first: bool


def _disjoint_rows(blocks):
    groups, ends = [], []
    for b in sorted(blocks, key=lambda b: b.q_start):
        g = next((i for i, end in enumerate(ends) if end <= b.q_start), len(ends))
        if g == len(ends):
            groups.append([])
            ends.append(0)
        groups[g].append(b)
        ends[g] = b.q_stop
    return groups


def _folds(step_blocks, small):
    homes = sorted(small[0], key=lambda i: step_blocks[0][i].q_start)
    starts = [step_blocks[0][i].q_start for i in homes]
    unseen = [True] * len(homes)
    folds = [[] for _ in step_blocks]
    for s in range(1, len(step_blocks)):
        is_small = set(small[s])
        for i, b in enumerate(step_blocks[s]):
            j = bisect.bisect_right(starts, b.q_start) - 1
            if j >= 0 and unseen[j] and b.q_stop <= step_blocks[0][homes[j]].q_stop:
                unseen[j] = False
                if i in is_small:
                    folds[s].append(((0, homes[j]), (s, i)))
    return folds


def lower_steps(step_blocks, batched: bool, tiled: bool, varlen: bool = False):
    """The former lowering: per step, ``Batch``/``Varlen`` records and plain ``BlockTask`` s."""
    if varlen:
        out = []
        for s, blocks in enumerate(step_blocks):
            pieces = [p for b in blocks for t in split_doc_block(b) for p in square_pieces(t)]
            specs = []
            for causal in (True, False):
                kind = [p for p in pieces if p.causal == causal]
                specs += [Varlen(tuple(g), causal, tiled and s == 0) for g in _disjoint_rows(kind)]
            out.append(tuple(specs))
        return tuple(out)
    small = [[i for i, b in enumerate(blocks) if batched and max(b.q_len, b.kv_len) <= SMALL_BLOCK]
             for blocks in step_blocks]
    folds = _folds(step_blocks, small) if tiled else [[] for _ in step_blocks]
    folded = {ix for pairs in folds for pair in pairs for ix in pair}
    steps = []
    for s, blocks in enumerate(step_blocks):
        batched_here = [blocks[i] for i in small[s] if (s, i) not in folded]
        is_small = set(small[s])
        tasks = tuple(t for i, b in enumerate(blocks) if i not in is_small for t in split_doc_block(b))
        batches = [Batch(tuple(g), (), tiled and s == 0) for g in _disjoint_rows(batched_here)]
        if folds[s]:
            pairs = tuple((step_blocks[0][h], step_blocks[s][i]) for (_, h), (_, i) in folds[s])
            batches.append(Batch((), pairs, True))
        steps.append(tuple(batches) + tasks)
    return tuple(steps)


# ------------------------------------------------------------------------------- index tensors
_SIZES = (8, 12, 16, 20, 24, 32, 48, 64)


class _KeySpan(NamedTuple):
    own: bool
    kv_start: int
    kv_len: int
    q_off: int
    q_len: int
    diag: int | None
    lo: int | None


class _Spec(NamedTuple):
    q_start: int
    q_len: int
    spans: tuple


def _size(n: int) -> int:
    return next(b for b in _SIZES if b >= n)


def _plain(b):
    return _Spec(b.q_start, b.q_len, (_KeySpan(False, b.kv_start, b.kv_len, 0, b.q_len, b.diag, b.lo),))


def _folded(home, later):
    return _Spec(home.q_start, home.q_len, (
        _KeySpan(True, home.kv_start, home.kv_len, 0, home.q_len, home.diag, home.lo),
        _KeySpan(False, later.kv_start, later.kv_len, later.q_start - home.q_start, later.q_len, later.diag, later.lo)))


def _bucket(spec):
    (first, *rest) = spec.spans
    square = (not rest and first.diag == 0 and first.lo is None and first.kv_len == spec.q_len)
    return _size(spec.q_len), tuple((k.own, _size(k.kv_len)) for k in spec.spans), square


def _column(specs, attr, default=0):
    return torch.tensor([default if getattr(x, attr) is None else getattr(x, attr) for x in specs])[:, None, None]


def _make_bucket(specs, lq, key_sizes, square) -> dict:
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
        keys.append((own, kv_idx, kv_idx[kv_valid], torch.nonzero(kv_valid.flatten()).flatten()))
        if not square:
            row = aq[None, :, None] - _column(spans, "q_off")
            offset = ak[None, None, :] - row
            masks.append(kv_valid[:, None, :] & (row >= 0) & (row < _column(spans, "q_len"))
                         & (offset <= _column(spans, "diag", lq + lk)) & (offset >= _column(spans, "lo", -(lq + lk))))
    mask = None
    if not square:
        mask = torch.cat(masks, 2)
        mask[..., 0] |= ~q_valid
    no_lse = torch.zeros(q_valid.shape, dtype=torch.float64).masked_fill_(~q_valid, float("inf"))[:, None, :]
    q_idx = torch.where(q_valid, q0 + aq, q0)
    return {"q_idx": q_idx, "q_valid": q_valid, "keys": keys, "mask": mask, "no_lse": no_lse,
            "q_rows": q_idx[q_valid], "q_sel": torch.nonzero(q_valid.flatten()).flatten()}


def buckets(blocks, folds) -> list[dict]:
    """The former ``DocBatch`` buckets of a batch's blocks and folded pairs."""
    groups: dict = {}
    for entry in [_plain(b) for b in blocks] + [_folded(h, b) for h, b in folds]:
        groups.setdefault(_bucket(entry), []).append(entry)
    return [_make_bucket(groups[key], *key) for key in sorted(groups)]


def varlen_tensors(pieces) -> dict:
    """The former ``VarlenBatch`` index tensors of a spec's pieces."""
    def offsets(lengths):
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
        return cu
    q_len = [p.q_stop - p.q_start for p in pieces]
    k_len = [p.kv_stop - p.kv_start for p in pieces]
    return {"q_rows": torch.cat([torch.arange(p.q_start, p.q_stop) for p in pieces]),
            "k_rows": torch.cat([torch.arange(p.kv_start, p.kv_stop) for p in pieces]),
            "cu_q": offsets(q_len), "cu_k": offsets(k_len), "max_q": max(q_len), "max_k": max(k_len)}
