"""``Layout.gather``: every rank's shard all-gathered and unsharded, after one agreement on what
each rank passes (an all-gather of mismatched shards would abort or hang the processes)."""

from __future__ import annotations

import zlib

import torch

from ..transport.codec import Codec, Field, agree_rows, raise_differing, raise_first
from ..transport.process_group import transport_for
from .args import check_dim
from .documents import check_cu_seqlens, cu_seqlens_tuple

__all__ = ["gather_shards"]

# The shard each rank passes to Layout.gather, as a row every rank can compare: a problem code, the
# tensor's rank, the dim, the local length, a fingerprint of everything else about the shard, and the
# packed documents' end and fingerprint.
_GATHER_OK, _GATHER_BAD_DIM, _GATHER_BAD_CU = 0, 1, 2
_SHARD = Codec(Field("problem"), Field("ndim", label="number of dimensions"), Field("dim", label="dim to gather along"),
               Field("local", label="length along dim"),
               Field("others", label="shape (but along dim), dtype and device type"),
               Field("cu_end", label="cu_seqlens"), Field("cu_hash", label="cu_seqlens"))
_FINGERPRINTS = ("others", "cu_end", "cu_hash")  # shown as which ranks differ, not as values


def _fingerprint(value) -> int:
    return zlib.crc32(repr(value).encode())


def _gather_values(x: torch.Tensor, dim, cu_seqlens) -> dict:
    ndim = x.dim()
    values = dict(problem=_GATHER_OK, ndim=ndim, dim=0, local=0, others=0, cu_end=0, cu_hash=0)
    try:
        d = check_dim(dim, ndim, "gather")
    except ValueError:
        return {**values, "problem": _GATHER_BAD_DIM}
    others = tuple(n for i, n in enumerate(x.shape) if i != d)
    values.update(dim=d, local=x.shape[d], others=_fingerprint((others, str(x.dtype), x.device.type)))
    if cu_seqlens is not None:
        try:
            cu = check_cu_seqlens(cu_seqlens_tuple(cu_seqlens))
        except ValueError:
            return {**values, "problem": _GATHER_BAD_CU}
        values.update(cu_end=min(cu[-1], 1 << 62), cu_hash=_fingerprint(cu))
    return values


def _problem(row: dict) -> "str | None":
    if row["problem"] == _GATHER_BAD_DIM:
        ndim = row["ndim"]
        return f"dim is out of range for its {ndim}-D shard (expected {-ndim} <= dim < {ndim})"
    if row["problem"] == _GATHER_BAD_CU:
        return "cu_seqlens are not document boundaries [0, l1, l1+l2, ..., T] (1-D integers, from 0, increasing)"
    return None


def _check_gather(rows: list[dict], layout) -> None:
    """One verdict on every rank's decoded :data:`_SHARD` row: ``ValueError`` if any is bad or they differ."""
    world_size = len(rows)
    raise_first("Layout.gather", [_problem(r) for r in rows])
    firsts = {name: rows[0][name] for name in _FINGERPRINTS}
    raise_differing("Layout.gather", rows, {f.name: f.label for f in _SHARD.fields[1:]},
                    lambda name, v: ("differs from rank 0" if v != firsts[name] else "as rank 0")
                    if name in _FINGERPRINTS else str(v),
                    advice="gather the shards of one tensor, sharded by this layout")
    local, end = rows[0]["local"], rows[0]["cu_end"]
    total = local * world_size
    layout.check(total, world_size)
    if end and end != total:
        raise ValueError(f"Layout.gather: cu_seqlens must end at the gathered length {local} x world_size "
                         f"{world_size} = {total}, got {end}")


def gather_shards(layout, x_local: torch.Tensor, dim: int, group=None, cu_seqlens=None) -> torch.Tensor:
    """:meth:`Layout.gather <cp_attention.layouts.base.Layout.gather>` of ``layout``: every rank's shard
    of ``x_local`` along ``dim`` all-gathered over ``group`` (a process group, ``None`` or a transport)
    and unsharded. Raises ``ValueError`` on every rank alike before the data moves (see there)."""
    if not isinstance(x_local, torch.Tensor):
        raise ValueError(f"gather needs this rank's shard as a tensor, got {type(x_local).__name__}")
    transport = transport_for(group)
    if transport.world_size == 1:
        dim = check_dim(dim, x_local.dim(), "gather")
        if cu_seqlens is not None:
            layout.positions(x_local.shape[dim], 0, 1, cu_seqlens)
        return x_local
    _check_gather(agree_rows(transport, _SHARD, _gather_values(x_local, dim, cu_seqlens)), layout)
    dim = check_dim(dim, x_local.dim(), "gather")
    return layout.unshard(transport.all_gather_tensor(x_local.contiguous()), dim, cu_seqlens)
