"""The index tensors of the padded document batches of a rank's lowered steps
(:class:`~cp_attention.engine.doc_batch.DocBatch`), built for every batch of them at once.

An entry (a small block, or a folded pair) is padded to a size bucket per side; entries of one
bucket run as one kernel call. Every index tensor of every bucket of every batch is computed in one
pass over flat arrays (each entry owns consecutive slots, buckets are consecutive runs of entries),
the host reads the bucket table once, the flat arrays reach the device in three copies, and each
bucket's tensors are views of them. Masks are computed once per bucket shape, for all the steps'
buckets of that shape. Index math on host tensors.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from ..schedules.lowering import BatchSpec
from ..schedules.table import UNBOUNDED

__all__ = ["Bucket", "BucketKeys", "build_buckets", "upload", "SIZES"]


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host index tensor on ``device``: on CUDA copied from pinned memory without blocking the host
    (the copy is ordered on the current stream before the kernels that read it); on the CPU as is."""
    device = torch.device(device)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


# Padded sizes, per side. The CPU flash op runs some lengths much faster than their neighbours
# (fwd+bwd per block at 8 heads x 64: 24 -> 153 us, 32 -> 217, 40 -> 377, 48 -> 330, 64 -> 599,
# 80 -> 1038, 96 -> 1041); these are the efficient ones.
SIZES = (8, 12, 16, 20, 24, 32, 48, 64)
_SIZES_T = torch.tensor(SIZES)
_CODES = 1024  # bucket codes: ((q size * 2 + folded) * 8 + first span's size) * 8 + (second's size or square)


@dataclass(frozen=True)
class BucketKeys:
    """A bucket's keys from one source."""

    own: bool  # True: this rank's own K/V shard; False: the shard held at the step
    idx: torch.Tensor  # [E, Lk] key rows; padding repeats the span's first key
    rows: torch.Tensor  # [Rk] the real (unpadded) key rows (precomputed: no boolean index per call)
    sel: torch.Tensor  # [Rk] their positions in the flattened [E * Lk]


@dataclass(frozen=True)
class Bucket:
    """One padded kernel call: ``E`` entries of ``Lq`` query rows against their key spans."""

    q_idx: torch.Tensor  # [E, Lq] local query rows; padding repeats the entry's first row
    q_valid: torch.Tensor  # [E, Lq] bool
    keys: tuple[BucketKeys, ...]  # concatenated along the key axis
    mask: torch.Tensor | None  # [E, Lq, sum Lk] bool, True where a query may see a key; None: causal square
    no_lse: torch.Tensor  # [E, 1, Lq]: +inf on padding rows, 0 elsewhere
    q_rows: torch.Tensor  # [R] local query rows, = q_idx[q_valid]
    q_sel: torch.Tensor  # [R] their positions in the flattened [E * Lq]


class _Padded(NamedTuple):
    """One side (queries, or one key span) of every entry, padded and flattened in bucket order:
    entry ``e`` owns ``L_e`` consecutive slots."""

    entry: torch.Tensor  # [sum L_e] each slot's entry
    off: torch.Tensor  # [sum L_e] each slot's position within its entry
    idx: torch.Tensor  # [sum L_e] rows; a padding slot repeats the entry's first row
    valid: torch.Tensor  # [sum L_e] bool
    rows: torch.Tensor  # [sum n_e] idx[valid]
    sel: torch.Tensor  # [sum n_e] the valid slots' positions within their bucket's flattened [E_b * L_b]


def _padded(start: torch.Tensor, length: torch.Tensor, size: torch.Tensor, bucket_start: torch.Tensor,
            total: int) -> _Padded:
    """Entries' rows ``start:start+length`` padded to ``size`` slots each (``total`` slots in all);
    ``bucket_start``: each entry's bucket's first slot. (``index_select``: ~3x faster than indexing.)"""
    entry = torch.repeat_interleave(torch.arange(start.numel()), size, output_size=total)
    slot = torch.arange(total)
    off = slot - (torch.cumsum(size, 0) - size).index_select(0, entry)
    valid = off < length.index_select(0, entry)
    idx = start.index_select(0, entry) + off * valid
    real = torch.nonzero(valid).flatten()
    sel = real - bucket_start.index_select(0, entry.index_select(0, real))
    return _Padded(entry, off, idx, valid, idx.index_select(0, real), sel)


def _bounds(q: _Padded, q_off: torch.Tensor | None, q_len: torch.Tensor, kv_len: torch.Tensor, diag: torch.Tensor,
            lo: torch.Tensor | None, empty: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Per query slot, the keys ``[a, b)`` of one span it sees (``a`` None: 0 everywhere): the span's
    rows ``q_off:q_off+q_len`` of the entry (``q_off`` None: all of them) see key ``c`` iff
    ``lo <= c - row <= diag`` and ``c < kv_len`` (``lo`` None: no lower bound anywhere). Slots outside
    the span's rows see none; padding slots see keys ``[0, empty)``."""
    entry = q.entry
    outside: torch.Tensor | int
    if q_off is None:  # the entry's own rows: inside the span exactly where they are real
        row, inside, outside = q.off, q.valid, empty
    else:
        row = q.off - q_off.index_select(0, entry)
        inside = (row >= 0) & (row < q_len.index_select(0, entry))
        outside = torch.where(q.valid, 0, empty)
    b = torch.where(inside, torch.minimum(kv_len.index_select(0, entry), row + diag.index_select(0, entry) + 1),
                    outside)
    if lo is None:
        return None, b
    return torch.where(inside, torch.clamp(row + lo.index_select(0, entry), min=0), 0), b


@functools.cache
def _interval_rows(width: int) -> torch.Tensor:
    """``[(width + 1) ** 2, width]`` bool: row ``a * (width + 1) + b`` is True at keys ``[a, b)``, so a
    mask is one row lookup per query slot (an ``index_select``: ~3-10x faster than comparing)."""
    ak = torch.arange(width)
    ends = torch.arange(width + 1)
    return ((ak >= ends[:, None, None]) & (ak < ends[None, :, None])).reshape(-1, width)


def _size_index(n: torch.Tensor) -> torch.Tensor:
    """Index into :data:`SIZES` of the padded size of lengths ``n`` (at most the largest)."""
    return torch.searchsorted(_SIZES_T, n)


def _cumulative(xs: list[int]) -> list[int]:
    """``[0, x0, x0 + x1, ...]``."""
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return out


def _upload_all(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """1-D ``tensors`` of one dtype on ``device`` in one copy, as views of one buffer."""
    if device.type == "cpu" or not tensors:
        return tensors
    return list(upload(torch.cat(tensors), device).split([t.numel() for t in tensors]))


def build_buckets(specs: Sequence[BatchSpec], device: torch.device) -> list[list[Bucket]]:
    """Per batch spec, its buckets in the order of their keys (padded queries, per key span (own?,
    padded keys), causal square?), with their index tensors on ``device``.

    Raises ``ValueError`` for a block longer than the largest bucket (the lowering batches only small ones).
    """
    device = torch.device(device)
    counts = [n for s in specs for n in (s.table.shape[0], s.homes.shape[0])]
    ent = torch.cat([t for s in specs for t in (s.table, s.homes)])  # queries and first span: block or home
    m = ent.shape[0]
    if m == 0:
        return [[] for _ in specs]
    batch = torch.repeat_interleave(torch.arange(len(specs)).repeat_interleave(2), torch.tensor(counts), output_size=m)
    fold = torch.repeat_interleave(torch.tensor([0, 1] * len(specs), dtype=torch.bool), torch.tensor(counts),
                                   output_size=m)
    # A folded entry's second key span (the later block): (its rows' offset within the home's, rows,
    # kv_start, kv_stop, diag, lo); zero for the others, a span no row sees.
    later = torch.zeros(m, 6, dtype=torch.long)
    laters = torch.cat([s.laters for s in specs])
    later[fold] = laters
    later[fold, 1] -= laters[:, 0]
    later[fold, 0] -= ent[fold, 0]
    qn, an, bn = ent[:, 1] - ent[:, 0], ent[:, 3] - ent[:, 2], later[:, 3] - later[:, 2]
    # A causal square (a document's diagonal) needs no mask: padded keys come after every real query.
    square = ~fold & (ent[:, 4] == 0) & (ent[:, 5] <= -UNBOUNDED) & (an == qn)
    code = ((_size_index(qn) * 2 + fold) * 8 + _size_index(an)) * 8 + torch.where(fold, _size_index(bn), square.long())
    # Buckets by code, then batch: a code's buckets are consecutive (one mask computation each).
    key, order = torch.sort(code * len(specs) + batch, stable=True)
    ukey, sizes = torch.unique_consecutive(key, return_counts=True)
    nb = ukey.numel()
    bucket = torch.repeat_interleave(torch.arange(nb), sizes, output_size=m)
    ent, later = ent.index_select(0, order), later.index_select(0, order)
    lens = torch.stack([qn, an, bn]).index_select(1, order)
    qn, an, bn, fold = lens[0], lens[1], lens[2], fold[order]
    valid_rows = torch.zeros(3, nb, dtype=torch.long).index_add_(1, bucket, lens)
    host = torch.cat([ukey, sizes, valid_rows.flatten(), lens.max().view(1)]).tolist()  # the one host read
    if host[-1] > SIZES[-1]:
        raise ValueError(f"a batched document block has {host[-1]} rows or keys, more than the largest bucket "
                         f"({SIZES[-1]}); run it as plain tasks")
    keys, sizes = host[:nb], host[nb:2 * nb]
    sums = [host[(2 + i) * nb:(3 + i) * nb] for i in range(3)]
    codes = [k // len(specs) for k in keys]
    parts = [(c // 128, c // 64 % 2, c // 8 % 8, c % 8) for c in codes]  # q size, folded, A size, B size/square
    lq = [SIZES[p[0]] for p in parts]
    lk = [[SIZES[p[2]]] + ([SIZES[p[3]]] if p[1] else []) for p in parts]
    slots = [[n * x for n, x in zip(sizes, side)] for side in (lq, [x[0] for x in lk], [sum(x[1:]) for x in lk])]
    first = [_cumulative(x) for x in slots]  # each bucket's first slot, per side
    per_entry = torch.tensor([[x[0] for x in lk], [sum(x[1:]) for x in lk], first[0][:-1], first[1][:-1],
                              first[2][:-1], lq])[:, bucket]
    q = _padded(ent[:, 0], qn, per_entry[5], per_entry[2], first[0][-1])
    a = _padded(ent[:, 2], an, per_entry[0], per_entry[3], first[1][-1])
    folds = torch.nonzero(fold).flatten()
    b = _padded(later[folds, 2], bn[folds], per_entry[1, folds], per_entry[4, folds], first[2][-1])
    masks = _masks(q, ent, later, an, bn, parts, codes, sizes, first[0], lq, lk)
    no_lse = torch.where(q.valid, 0.0, float("inf")).to(torch.float64)
    # Three copies to the device: the index tensors, the booleans (validity and masks), the padding LSE.
    longs = _upload_all([t for p in (q, a, b) for t in (p.idx, p.rows, p.sel)], device)
    bools = _upload_all([q.valid] + [x.flatten() for x in masks.values()], device)
    (no_lse,) = _upload_all([no_lse], device)
    q, a, b = (p._replace(idx=longs[3 * i], rows=longs[3 * i + 1], sel=longs[3 * i + 2])
               for i, p in enumerate((q, a, b)))
    q = q._replace(valid=bools[0])
    masks = {c: x.view(masks[c].shape) for c, x in zip(masks, bools[1:])}
    # Each bucket's views, one split per flat array (a split is one call for all buckets).
    q_idx, q_valid, no_lse = (t.split(slots[0]) for t in (q.idx, q.valid, no_lse))
    q_rows, q_sel = q.rows.split(sums[0]), q.sel.split(sums[0])
    sides = [(pad.idx.split(slots[j]), pad.rows.split(sums[j]), pad.sel.split(sums[j])) for j, pad in ((1, a), (2, b))]
    out: list[list[Bucket]] = [[] for _ in specs]
    mask_row: dict[int, int] = {}
    for i, (key, p) in enumerate(zip(keys, parts)):
        e = sizes[i]
        mask = masks.get(codes[i])
        if mask is not None:
            at = mask_row.get(codes[i], 0)
            mask_row[codes[i]] = at + e
            mask = mask[at:at + e]
        spans = tuple(BucketKeys(own, idx[i].view(e, -1), rows[i], sel[i])
                      for own, (idx, rows, sel) in zip((bool(p[1]), False), sides[:1 + p[1]]))
        out[key % len(specs)].append(Bucket(q_idx[i].view(e, lq[i]), q_valid[i].view(e, lq[i]), spans, mask,
                                            no_lse[i].view(e, 1, lq[i]), q_rows[i], q_sel[i]))
    return out


def _masks(q: _Padded, ent: torch.Tensor, later: torch.Tensor, an: torch.Tensor, bn: torch.Tensor, parts: list,
           codes: list[int], sizes: list[int], q_first: list[int], lq: list[int], lk: list[list[int]]
           ) -> dict[int, torch.Tensor]:
    """Per bucket code that needs one (all but causal squares), ``[E, Lq, sum Lk]`` bool over all
    its buckets' entries: each query slot's keys, one interval per span, looked up as rows of
    :func:`_interval_rows` (padding rows see key 0, so no kernel meets an empty row)."""
    masked = [i for i, p in enumerate(parts) if p[1] or p[3] == 0]
    if not masked:
        return {}
    runs: dict[int, list[int]] = {}  # code -> [first slot, last slot, entries, index of a bucket]
    for i in masked:
        run = runs.setdefault(codes[i], [q_first[i], q_first[i], 0, i])
        run[1], run[2] = q_first[i + 1], run[2] + sizes[i]
    bounded = bool((ent[:, 5] > -UNBOUNDED).any() | (later[:, 5] > -UNBOUNDED).any())
    qn = ent[:, 1] - ent[:, 0]
    spans = [_bounds(q, None, qn, an, ent[:, 4], ent[:, 5] if bounded else None, 1)]
    if any(parts[i][1] for i in masked):
        spans.append(_bounds(q, later[:, 0], later[:, 1], bn, later[:, 4], later[:, 5] if bounded else None, 0))
    out = {}
    for code, (s0, s1, e, i) in runs.items():
        looked = []
        for (a, b), width in zip(spans, lk[i]):
            # Row a * (width + 1) + b of the table holds keys [a, b) (clamped: an empty span stays empty).
            at = b[s0:s1].clamp(0, width)
            if a is not None:
                at = at + (width + 1) * a[s0:s1].clamp(0, width)
            looked.append(_interval_rows(width).index_select(0, at))
        out[code] = (looked[0] if len(looked) == 1 else torch.cat(looked, 1)).view(e, lq[i], sum(lk[i]))
    return out
