"""The checked all-gather behind :meth:`Layout.gather <cp_attention.layouts.base.Layout.gather>`: one
agreement on what every rank passes (an all-gather of mismatched shards would abort or hang the
processes), then the shards' all-gather and the layout's unshard. The layouts hold only the pure part
(:mod:`cp_attention.layouts.gather`); importing this module installs :func:`gather_shards` there."""

from __future__ import annotations

import torch

from ..layouts.args import check_dim
from ..layouts.gather import install_gather, shard_problem, shard_values
from ..transport.process_group import transport_for
from .codec import Codec, Field, agree_rows, raise_differing, raise_first

__all__ = ["SHARD_FIELDS", "check_gather", "gather_shards"]

# A shard as :func:`~cp_attention.layouts.gather.shard_values` describes it, as a row every rank compares.
SHARD_FIELDS = Codec(Field("problem"), Field("ndim", label="number of dimensions"),
                     Field("dim", label="dim to gather along"), Field("local", label="length along dim"),
                     Field("others", label="shape (but along dim), dtype and device type"),
                     Field("cu_end", label="cu_seqlens"), Field("cu_hash", label="cu_seqlens"))
_FINGERPRINTS = ("others", "cu_end", "cu_hash")  # shown as which ranks differ, not as values


def check_gather(rows: list[dict], layout) -> None:
    """One verdict on every rank's decoded :data:`SHARD_FIELDS` row: ``ValueError`` if any is bad or they differ."""
    world_size = len(rows)
    raise_first("Layout.gather", [shard_problem(r) for r in rows])
    firsts = {name: rows[0][name] for name in _FINGERPRINTS}
    raise_differing("Layout.gather", rows, {f.name: f.label for f in SHARD_FIELDS.fields[1:]},
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
    check_gather(agree_rows(transport, SHARD_FIELDS, shard_values(x_local, dim, cu_seqlens)), layout)
    dim = check_dim(dim, x_local.dim(), "gather")
    return layout.unshard(transport.all_gather_tensor(x_local.contiguous()), dim, cu_seqlens)


install_gather(gather_shards)
