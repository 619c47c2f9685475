"""Ring schedules for packed documents (``cu_seqlens``): one rule for every layout.

A token attends only within its document, so at ring step ``s`` rank ``r``'s work is, for every
document present both in its queries and in the K/V shard of rank ``j = (r - s) mod N``, one
(document piece x document piece) :class:`DocBlock`: full, banded-causal, or skipped. The blocks are
derived from the layouts' global positions, so any layout whose packed positions increase on every
rank gets an exact schedule; ``tests/unit/schedules/test_documents.py`` proves every allowed pair is computed
exactly once. One rank's steps are computed together, as columns (:class:`BlockTable`): a few
tensor operations over (step, document) and (step, query row), whatever the number of documents.
Pure index math, no torch.distributed.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .blocks import DocBlock, source_rank
from .table import UNBOUNDED, BlockTable

__all__ = ["doc_schedules", "rank_doc_blocks"]


def rank_doc_blocks(positions: Sequence[torch.Tensor], doc_of: torch.Tensor, causal: bool, layout_name: str,
                    rank: int) -> BlockTable:
    """Rank ``rank``'s blocks at every ring step, from every rank's increasing packed-stream
    ``positions`` (``[n]`` each) and the document of every token ``doc_of [T]``.

    Raises ``NotImplementedError`` for a layout whose blocks are neither full nor causal bands.
    """
    world = len(positions)
    qpos = positions[rank]
    n = qpos.numel()
    sources = [positions[source_rank(rank, world, s)] for s in range(world)]
    if any(p.numel() != n for p in sources):
        raise RuntimeError(f"internal error: layout {layout_name!r} gives ranks different local lengths "
                           f"{[p.numel() for p in positions]}")
    kpos = torch.stack(sources)  # [S, n]: the K/V rows held at each step
    docs = int(doc_of[-1]) + 1
    qdoc, kdoc = doc_of[qpos], doc_of[kpos]
    # Each document's rows: counted (positions increase, so a document's rows are consecutive).
    q_count = torch.bincount(qdoc, minlength=docs)
    q_hi = torch.cumsum(q_count, 0)
    q_lo = q_hi - q_count  # [D]
    k_count = torch.bincount((kdoc + torch.arange(world)[:, None] * docs).flatten(), minlength=world * docs)
    k_count = k_count.view(world, docs)
    k_hi = torch.cumsum(k_count, 1)
    k_lo = k_hi - k_count  # [S, D]
    present = (q_hi > q_lo) & (k_hi > k_lo)
    if not causal:
        keep = present
        qa, first = q_lo.expand(world, docs), None
        last = k_hi - k_lo
    else:
        row_doc = qdoc.expand(world, n)
        # visible[s, i]: how many of its document's keys held at step s query row i sees (keys at
        # positions <= its own), from a prefix count over the stream (a binary search per row costs
        # ~6x more).
        held = torch.zeros(world, doc_of.numel(), dtype=torch.int32).scatter_(1, kpos, 1)
        seen = torch.cumsum(held, 1, dtype=torch.int32)[:, qpos].long()
        visible = (seen - k_lo.gather(1, row_doc)).clamp_(min=0)
        visible = torch.minimum(visible, (k_hi - k_lo).gather(1, row_doc))
        blind = torch.zeros(world, docs, dtype=torch.long).scatter_add_(1, row_doc, (visible == 0).long())
        qa = q_lo + blind  # rows that see nothing come first (positions increase): trim them
        last = torch.where(q_hi > q_lo, visible[:, (q_hi - 1).clamp(min=0)], 0)
        keep = present & (qa < q_hi) & (last > 0)
        first = visible.gather(1, qa.clamp(max=n - 1))
        # Exactness guard: within a kept block, row i must see min(i - qa + first, last) keys (a band).
        row_qa = qa.gather(1, row_doc)
        rel = torch.arange(n) - row_qa
        kept_row = keep.gather(1, row_doc) & (rel >= 0)
        expected = torch.minimum(rel + first.gather(1, row_doc), last.gather(1, row_doc))
        if bool(((visible != expected) & kept_row).any()):
            raise NotImplementedError(
                f"layout {layout_name!r} places packed documents so that a block is neither full nor a causal "
                "band; packed sequences need every document's tokens in increasing order on each rank")
    flat = torch.nonzero(keep.flatten()).flatten()  # (step, document) in step order, then document order
    step, doc = flat // docs, flat % docs
    k0 = k_lo.flatten()[flat]
    kn = last.flatten()[flat]
    if first is None:
        diag = torch.full_like(flat, UNBOUNDED)
    else:
        f = first.flatten()[flat]
        diag = torch.where(f == kn, UNBOUNDED, f - 1)
    rows = torch.stack([step, qa.reshape(-1)[flat], q_hi[doc], k0, k0 + kn, diag, torch.full_like(flat, -UNBOUNDED)], 1)
    return BlockTable(rows, world)


def doc_schedules(positions: Sequence[torch.Tensor], doc_of: torch.Tensor, causal: bool, layout_name: str
              ) -> tuple[tuple[tuple[DocBlock, ...], ...], ...]:
    """Every rank's blocks per ring step for packed documents: ``steps[rank][step]``, from every
    rank's increasing packed-stream ``positions`` and the document of every token ``doc_of``.
    Raises ``NotImplementedError`` for a layout whose blocks are neither full nor causal bands."""
    return tuple(tuple(rank_doc_blocks(positions, doc_of, causal, layout_name, r)) for r in range(len(positions)))
