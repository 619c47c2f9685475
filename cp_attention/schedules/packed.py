"""Ring schedules for packed documents (``cu_seqlens``): one rule for every layout.

A token attends only within its document, so at ring step ``s`` rank ``r``'s work is, for every
document present both in its queries and in the K/V shard of rank ``j = (r - s) mod N``, one
(document piece x document piece) :class:`DocBlock`: full, banded-causal, or skipped. The blocks are
derived from the layouts' global positions, so any layout whose packed positions increase on every
rank gets an exact schedule; ``tests/unit/schedules/test_documents.py`` proves every allowed pair is computed
exactly once. Pure index math, no torch.distributed.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .blocks import DocBlock, source_rank

__all__ = ["doc_schedules"]


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


def doc_schedules(positions: Sequence[torch.Tensor], doc_of: torch.Tensor, causal: bool, layout_name: str
              ) -> tuple[tuple[tuple[DocBlock, ...], ...], ...]:
    """Every rank's blocks per ring step for packed documents: ``plans[rank][step]``, from every
    rank's increasing packed-stream ``positions`` and the document of every token ``doc_of``.
    Raises ``NotImplementedError`` for a layout whose blocks are neither full nor causal bands."""
    world_size = len(positions)
    return tuple(tuple(_step_blocks(positions[r], positions[source_rank(r, world_size, s)], doc_of, causal, layout_name)
                       for s in range(world_size)) for r in range(world_size))
