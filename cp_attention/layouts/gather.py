"""``Layout.gather``: every rank's shard all-gathered and unsharded, after one agreement on what
each rank passes (an all-gather of mismatched shards would abort or hang the processes)."""

from __future__ import annotations

import zlib

import torch

from ..transport.process_group import transport_for
from .args import check_dim
from .documents import check_cu_seqlens, cu_seqlens_tuple

__all__ = ["gather_shards"]

# The shard each rank passes to Layout.gather, as ints every rank can compare: a problem code, the
# tensor's rank, the dim, the local length, a fingerprint of everything else about the shard, and the
# packed documents' end and fingerprint.
_GATHER_OK, _GATHER_BAD_DIM, _GATHER_BAD_CU = 0, 1, 2


def _fingerprint(value) -> int:
    return zlib.crc32(repr(value).encode())


def _gather_signature(x: torch.Tensor, dim, cu_seqlens) -> list[int]:
    ndim = x.dim()
    try:
        d = check_dim(dim, ndim, "gather")
    except ValueError:
        return [_GATHER_BAD_DIM, ndim, 0, 0, 0, 0, 0]
    others = tuple(n for i, n in enumerate(x.shape) if i != d)
    sig = [_GATHER_OK, ndim, d, x.shape[d], _fingerprint((others, str(x.dtype), x.device.type)), 0, 0]
    if cu_seqlens is not None:
        try:
            cu = check_cu_seqlens(cu_seqlens_tuple(cu_seqlens))
        except ValueError:
            sig[0] = _GATHER_BAD_CU
            return sig
        sig[5:] = [min(cu[-1], 1 << 62), _fingerprint(cu)]
    return sig


def _check_gather(table: list[list[int]], layout) -> None:
    """One verdict on every rank's :func:`_gather_signature`: ``ValueError`` if any is bad or they differ."""
    world_size = len(table)
    for code in (_GATHER_BAD_DIM, _GATHER_BAD_CU):
        bad = [r for r, sig in enumerate(table) if sig[0] == code]
        if bad:
            ndim = table[bad[0]][1]
            what = (f"dim is out of range for its {ndim}-D shard (expected {-ndim} <= dim < {ndim})"
                    if code == _GATHER_BAD_DIM else
                    "cu_seqlens are not document boundaries [0, l1, l1+l2, ..., T] (1-D integers, from 0, increasing)")
            raise ValueError(f"Layout.gather: {what} on rank(s) {bad}")
    for i, label in ((1, "number of dimensions"), (2, "dim to gather along"), (3, "length along dim"),
                     (4, "shape (but along dim), dtype and device type"), (5, "cu_seqlens"), (6, "cu_seqlens")):
        values = [sig[i] for sig in table]
        if any(v != values[0] for v in values):
            shown = (", ".join(f"rank {r}: {v}" for r, v in enumerate(values)) if i < 4 else
                     f"rank(s) {[r for r, v in enumerate(values) if v != values[0]]} differ from rank 0")
            raise ValueError(f"Layout.gather: every rank must pass a shard with the same {label}, got {shown}; "
                             "gather the shards of one tensor, sharded by this layout")
    ndim, dim, local, _, end, _ = table[0][1:]
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
    _check_gather(transport.all_gather_ints(_gather_signature(x_local, dim, cu_seqlens)), layout)
    dim = check_dim(dim, x_local.dim(), "gather")
    return layout.unshard(transport.all_gather_tensor(x_local.contiguous()), dim, cu_seqlens)
