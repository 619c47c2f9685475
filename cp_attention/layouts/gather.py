"""What :meth:`Layout.gather <cp_attention.layouts.base.Layout.gather>` knows about a shard on its own,
and the seam to the checked all-gather behind it.

An all-gather of mismatched shards would abort or hang the processes, so ``Layout.gather`` first
agrees with the group on what every rank passes. That agreement is a check: its row, its one
all-gather and its verdict live above this room, in :mod:`cp_attention.checks.gather`, which installs
itself here (:func:`install_gather`) when the checks are imported (importing any part of
``cp_attention`` imports them). This module keeps the pure part: a shard's description
(:func:`shard_values`) and what is wrong with one (:func:`shard_problem`).
"""

from __future__ import annotations

import zlib
from typing import Any, Callable

import torch

from .args import check_dim
from .documents import check_cu_seqlens, cu_seqlens_tuple

__all__ = ["GATHER_BAD_CU", "GATHER_BAD_DIM", "GATHER_OK", "gather_shards", "install_gather", "shard_problem",
           "shard_values"]

# What is wrong with a shard, as the problem code its description carries.
GATHER_OK, GATHER_BAD_DIM, GATHER_BAD_CU = 0, 1, 2

# (layout, x_local, dim, group, cu_seqlens) -> the gathered tensor
Gather = Callable[[Any, torch.Tensor, Any, Any, Any], torch.Tensor]
_installed: Gather | None = None


def install_gather(gather: Gather) -> None:
    """Make ``gather`` (:func:`cp_attention.checks.gather.gather_shards`) what :meth:`Layout.gather` runs."""
    global _installed
    _installed = gather


def gather_shards(layout, x_local: torch.Tensor, dim: int, group=None, cu_seqlens=None) -> torch.Tensor:
    """:meth:`Layout.gather <cp_attention.layouts.base.Layout.gather>` of ``layout``, by the checked
    all-gather the checks installed. Raises as that does (``ValueError`` on every rank alike)."""
    if _installed is None:  # never unchecked: an all-gather of mismatched shards hangs
        raise RuntimeError("cp_attention internal error: Layout.gather has no checked all-gather installed "
                           "(cp_attention.checks.gather installs it on import); import cp_attention first")
    return _installed(layout, x_local, dim, group, cu_seqlens)


def _fingerprint(value: Any) -> int:
    return zlib.crc32(repr(value).encode())


def shard_values(x: torch.Tensor, dim: Any, cu_seqlens: Any) -> dict:
    """The shard ``x`` this rank passes to ``Layout.gather`` as the ints every rank can compare: a
    problem code, its number of dims, the dim, its length along it, a fingerprint of everything else
    about it (the other dims, dtype, device type), and the packed documents' end and fingerprint
    (zeros without ``cu_seqlens``). Never raises for bad input: that is encoded as the problem code."""
    ndim = x.dim()
    values = dict(problem=GATHER_OK, ndim=ndim, dim=0, local=0, others=0, cu_end=0, cu_hash=0)
    try:
        d = check_dim(dim, ndim, "gather")
    except ValueError:
        return {**values, "problem": GATHER_BAD_DIM}
    others = tuple(n for i, n in enumerate(x.shape) if i != d)
    values.update(dim=d, local=x.shape[d], others=_fingerprint((others, str(x.dtype), x.device.type)))
    if cu_seqlens is not None:
        try:
            cu = check_cu_seqlens(cu_seqlens_tuple(cu_seqlens))
        except ValueError:
            return {**values, "problem": GATHER_BAD_CU}
        values.update(cu_end=min(cu[-1], 1 << 62), cu_hash=_fingerprint(cu))
    return values


def shard_problem(values: dict) -> str | None:
    """What is wrong with the shard a :func:`shard_values` describes, or None."""
    if values["problem"] == GATHER_BAD_DIM:
        ndim = values["ndim"]
        return f"dim is out of range for its {ndim}-D shard (expected {-ndim} <= dim < {ndim})"
    if values["problem"] == GATHER_BAD_CU:
        return "cu_seqlens are not document boundaries [0, l1, l1+l2, ..., T] (1-D integers, from 0, increasing)"
    return None
