"""The needs on the device: per ring step, which own K/V rows this rank sends and which rows of the
held shard it receives (:mod:`cp_attention.schedules.needs` says which), ready to index with.

A shard held at a step is a full-length buffer (so the lowered tasks index it as they always did) in
which only the needed rows are filled; the rest keep what an earlier step left there, or zeros, and
no task reads them. Sizes come from the plan on both sides: no handshake, no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union, cast

import torch

from ..schedules.needs import StepNeeds
from .doc_batch import upload

__all__ = ["Rows", "StepIndex", "step_indices", "select_rows", "place_rows", "direct_view", "post_rows", "row_count",
           "shaped", "wire_rows"]

# Local rows along the sequence dim: None (all of them), a contiguous range, or an index tensor.
Rows = Union[None, slice, torch.Tensor]  # noqa: UP007 - a runtime alias: `None | slice` fails on Python 3.10


@dataclass(frozen=True)
class StepIndex:
    """One ring step's needs as device indices: ``send`` (own rows for rank r + s, ``send_count`` of them) and
    ``recv`` (rows of rank r - s's shard, ``recv_count`` of them)."""

    send: Rows
    recv: Rows
    send_count: int
    recv_count: int


def _rows(idx: torch.Tensor, n: int, device: torch.device) -> Rows:
    count = idx.numel()
    if count == n:
        return None
    if count == 0 or int(idx[-1]) - int(idx[0]) + 1 == count:
        start = int(idx[0]) if count else 0
        return slice(start, start + count)
    return upload(idx, device)


def step_indices(needs: Sequence[StepNeeds | None], n: int, device: torch.device) -> tuple[StepIndex | None, ...]:
    """The plan's per-step :class:`~cp_attention.schedules.needs.StepNeeds` (None at step 0) as
    :class:`StepIndex` on ``device`` for a shard of ``n`` rows."""
    return tuple(None if r is None else StepIndex(_rows(r.send, n, device), _rows(r.recv, n, device),
                                                  r.send.numel(), r.recv.numel()) for r in needs)


def select_rows(t: torch.Tensor, rows: Rows) -> torch.Tensor:
    """``t [B, n, ...]``'s ``rows`` along dim 1, contiguous (what goes on the wire)."""
    if rows is None:
        return t.contiguous()
    if isinstance(rows, slice):
        return t[:, rows].contiguous()
    return t.index_select(1, rows)


def place_rows(buf: torch.Tensor, rows: Rows, got: torch.Tensor, add: bool = False) -> None:
    """Write (``add``: add) the received compact rows ``got [B, m, ...]`` into rows ``rows`` of
    ``buf [B, n, ...]``."""
    if rows is None:
        buf.add_(got) if add else buf.copy_(got)
    elif isinstance(rows, slice):
        buf[:, rows].add_(got) if add else buf[:, rows].copy_(got)
    else:
        buf.index_add_(1, rows, got) if add else buf.index_copy_(1, rows, got)


def direct_view(buf: torch.Tensor, rows: Rows) -> torch.Tensor | None:
    """A contiguous view of ``buf``'s ``rows`` to receive into directly, or None when a copy is needed."""
    view = buf if rows is None else buf[:, rows] if isinstance(rows, slice) else None
    return view if view is not None and view.is_contiguous() else None


def post_rows(transport, tensors: Sequence[torch.Tensor], rows: Rows, count: int, recv_count: int, hop: int,
              recv: Sequence[torch.Tensor] | None = None) -> tuple:
    """Post one exchange of needed rows: rows ``rows`` (``count`` of them) of ``tensors`` to the rank
    ``hop`` on, and ``recv_count`` rows from the rank ``hop`` back into ``recv`` (default: new compact
    tensors like ``tensors``). Nothing is posted when neither side has a row. Returns ``(handle or
    None, recv, send)``; keep ``send`` alive until the handle is waited on."""
    send = tuple(select_rows(t, rows) for t in tensors) if count else ()
    if recv is None:
        recv = tuple(t.new_empty(t.shape[0], recv_count, *t.shape[2:]) for t in tensors) if recv_count else ()
    return (transport.exchange(send, recv, hop) if send or recv else None), tuple(recv), send


def row_count(rows: Rows, n: int) -> int:
    """How many of a shard's ``n`` rows ``rows`` names."""
    return n if rows is None else rows.stop - rows.start if isinstance(rows, slice) else rows.numel()


def shaped(flat: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """The first elements of the 1-D ``flat`` as a contiguous tensor of ``shape`` (a view: scratch
    allocated once per call, used at every step)."""
    size = 1
    for x in shape:
        size *= x
    return flat[:size].view(*shape)


def wire_rows(t: torch.Tensor, rows: Rows, scratch: torch.Tensor | None) -> torch.Tensor:
    """``t [B, n, ...]``'s ``rows`` along dim 1 as one contiguous tensor to send: a view of ``t`` when
    they are one already, else gathered into the 1-D ``scratch`` (one launch, no allocation)."""
    view = direct_view(t, rows)
    if view is not None:
        return view
    # callers size ``scratch`` for every send that is not one contiguous range already
    out = shaped(cast(torch.Tensor, scratch), (t.shape[0], row_count(rows, t.shape[1]), *t.shape[2:]))
    if isinstance(rows, torch.Tensor):
        return torch.index_select(t, 1, rows, out=out)
    return out.copy_(t if rows is None else t[:, rows])
