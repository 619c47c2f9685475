"""Megatron batch dicts sharded for this CP rank by any layout: plain ``[b, s]`` batches and THD
packed ones (documents of any length, sharded by our layouts, not TransformerEngine's split)."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams

import cp_attention as cpa
from cp_attention.layouts.documents import cu_seqlens_tuple, document_position_ids
from cp_attention.transport import group_rank_and_size

from .checks import agreed
from .packed import packed_documents

__all__ = ["get_batch_on_this_cp_rank", "DEFAULT_LAYOUT"]

# TransformerEngine's and megatron's own batch slicing are zigzag, so it is the default everywhere.
DEFAULT_LAYOUT = "zigzag"


# Entries of one row that broadcast over the batch (megatron builds them so when they are shared).
_BROADCAST = ("attention_mask", "position_ids")

# megatron's THD batch entries (get_thd_batch_on_this_cp_rank): boundaries, not tokens; never sharded.
_PACKED_ENTRIES = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen")


def _batch_boundaries(batch: Mapping[str, Any], key: str) -> Any:
    value = batch.get(key)
    if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[0] == 1:
        value = value[0]  # a collated [1, n]
    return value


def _packed_seq_params_from_batch(batch: Mapping[str, Any]) -> PackedSeqParams:
    """THD ``PackedSeqParams`` from megatron's batch entries ``cu_seqlens`` [, ``cu_seqlens_padded``,
    ``max_seqlen``] (``max_seqlen`` defaults to the longest padded document)."""
    cu, padded = _batch_boundaries(batch, "cu_seqlens"), _batch_boundaries(batch, "cu_seqlens_padded")
    bounds = cu_seqlens_tuple(cu if padded is None else padded)
    needed = max((b - a for a, b in zip(bounds, bounds[1:])), default=0)
    longest = batch.get("max_seqlen")
    if longest is None:
        longest = needed
    else:
        longest = _max_seqlen(longest, needed)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded,
                           cu_seqlens_kv_padded=padded, max_seqlen_q=longest, max_seqlen_kv=longest)


def _max_seqlen(value: Any, needed: int) -> int:
    """``batch['max_seqlen']`` as an int: one integer (a tensor of one element, or an int), at least the
    longest (padded) document ``needed``. Raises ``ValueError`` otherwise."""
    try:
        t = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        t = None
    if (t is None or t.numel() != 1 or t.dtype == torch.bool or t.is_floating_point() or t.is_complex()):
        raise ValueError(f"batch['max_seqlen'] must be one integer, the longest document of the packed stream "
                         f"({needed} here), got {value!r}; leave it out to have it computed")
    longest = int(t.item())
    if longest < needed:
        raise ValueError(f"batch['max_seqlen']={longest} is shorter than the longest document of the packed stream "
                         f"({needed} tokens); leave it out to have it computed")
    return longest


def _shard_packed_batch(batch: Mapping[str, Any], lay: cpa.Layout, rank: int, world_size: int,
                  packed_seq_params: PackedSeqParams) -> dict[str, Any]:
    documents = packed_documents(packed_seq_params)
    total = documents[-1]
    if batch.get("attention_mask") is not None:
        raise ValueError("a packed (THD) batch takes no attention_mask: its documents (packed_seq_params) and "
                         "the causal flag are the whole mask; drop batch['attention_mask'] or set it to None")
    try:
        lay.check(total, world_size)
    except ValueError as e:
        raise ValueError(f"packed stream of {total} tokens: {e}; append a padding document with "
                         f"cp_attention.pad_cu_seqlens(cu_seqlens, {lay.divisor(world_size)}) and pad every "
                         "token tensor to match (labels -100 / loss_mask 0)") from None
    out = dict(batch)
    out["packed_seq_params"] = packed_seq_params
    device = torch.device("cpu")
    for key, val in batch.items():
        if key in _PACKED_ENTRIES or key == "attention_mask" or not isinstance(val, torch.Tensor):
            continue
        if val.dim() < 2 or val.shape[0] != 1 or val.shape[1] != total:
            raise ValueError(f"batch[{key!r}] has shape {tuple(val.shape)}; a packed (THD) batch holds one row "
                             f"[1, {total}, ...] over the packed stream of {total} tokens the documents describe "
                             f"(cu_seqlens end at {total})")
        device = val.device
        out[key] = val if world_size == 1 else lay.shard(val, 1, rank, world_size, cu_seqlens=documents)
    if out.get("position_ids") is None:
        positions = lay.positions(total, rank, world_size, documents)
        out["position_ids"] = document_position_ids(positions, documents)[None].to(device)
    return out


def get_batch_on_this_cp_rank(batch: Mapping[str, Any], layout: str | cpa.Layout = DEFAULT_LAYOUT,
                              cp_group=None, packed_seq_params: PackedSeqParams | None = None
                              ) -> dict[str, Any]:
    """This CP rank's share of a megatron batch dict, for any layout.

    Like ``megatron.core.utils.get_batch_on_this_cp_rank``: every tensor (``tokens``, ``labels``,
    ``loss_mask``, ``position_ids``, ...) is sharded along dim 1, ``attention_mask [b, 1, s, s]``
    along dim 2 (its queries); ``None`` and non-tensor values pass through. ``position_ids`` sharded
    this way hold global positions. ``cp_group`` defaults to megatron's CP group (world size 1 if
    ``parallel_state`` is not initialised). Returns a new dict; ``batch`` is not modified.

    Packed (THD) batches, like ``megatron.core.utils.get_thd_batch_on_this_cp_rank``: pass megatron's
    ``packed_seq_params`` (``qkv_format="thd"``), or leave it None and give the batch megatron's THD
    entries ``cu_seqlens`` [, ``cu_seqlens_padded``, ``max_seqlen``] (1-D or ``[1, n]``; they pass
    through unsharded). Every token tensor is ``[1, T, ...]`` over the FULL packed stream and is
    sharded along dim 1 with ``layout.shard(..., cu_seqlens=packed_documents(params))`` (this
    package's layouts, not TransformerEngine's split, so documents may have any length). The result
    also holds ``packed_seq_params`` (the one given, or one built from the entries) to pass to the
    model, and ``position_ids``: sharded like the tokens when the batch has them, else made: each
    token's position within its document. Padding tokens need ``loss_mask`` 0 (or label -100).

    Raises ``ValueError`` if a tensor's sequence length or batch differs from the others' (a mask or
    ``position_ids`` of one row broadcast), an ``attention_mask`` is not ``[b, 1, s, s]``, or the layout
    cannot split the sequence; for packed batches also for a batch larger than one row, an
    ``attention_mask``, boundaries given twice (argument and batch entries) or malformed, a
    ``max_seqlen`` that is not one integer covering the longest document, and ``NotImplementedError``
    for unsupported packed parameters (see :func:`packed_documents`). Every refusal is agreed over
    ``cp_group`` in one small all-gather, in which every CP rank takes part: if any rank's batch is
    refused, every rank raises the same error (naming the refusing ranks), so none goes on into the
    forward alone. Any other exception a rank's batch causes is raised on every rank as a
    ``RuntimeError`` naming it.
    """
    if cp_group is None and parallel_state.model_parallel_is_initialized():
        cp_group = parallel_state.get_context_parallel_group()
    rank, world_size = group_rank_and_size(cp_group) if cp_group is not None else (0, 1)
    if world_size == 1:
        return _shard_batch(batch, layout, rank, world_size, packed_seq_params)
    # Every CP rank takes part in one small all-gather, whatever it found: a rank whose batch is fine
    # must not go on into the forward while another one refuses its own.
    return agreed(cp_group, world_size, lambda: _shard_batch(batch, layout, rank, world_size, packed_seq_params),
                  lambda out: (), 0)[0]


def _shard_batch(batch: Mapping[str, Any], layout: str | cpa.Layout, rank: int, world_size: int,
                 packed_seq_params: PackedSeqParams | None) -> dict[str, Any]:
    """:func:`get_batch_on_this_cp_rank` on this rank alone (raises on this rank only)."""
    lay = cpa.get_layout(layout)
    if batch.get("cu_seqlens") is not None:
        if packed_seq_params is not None:
            raise ValueError("the packed boundaries were given twice, as packed_seq_params and as batch['cu_seqlens']; "
                             "pass one of them")
        packed_seq_params = _packed_seq_params_from_batch(batch)
    if packed_seq_params is not None:
        return _shard_packed_batch(batch, lay, rank, world_size, packed_seq_params)
    out = dict(batch)
    if world_size == 1:
        return out
    seq_len = rows = None
    for key, val in batch.items():
        if not isinstance(val, torch.Tensor):
            continue
        dim = 2 if key == "attention_mask" else 1
        if key == "attention_mask" and (val.dim() != 4 or val.shape[2] != val.shape[3]):
            raise ValueError(f"batch['attention_mask'] has shape {tuple(val.shape)}; expected megatron's "
                             "[b, 1, s, s] (queries x keys over the full sequence), or None")
        if val.dim() <= dim:
            raise ValueError(f"batch[{key!r}] has shape {tuple(val.shape)}; expected a sequence dimension {dim}")
        # Every entry holds the same batch; a mask or position_ids of one row may broadcast.
        if not (key in _BROADCAST and val.shape[0] == 1):
            if rows is not None and val.shape[0] != rows[1]:
                raise ValueError(f"batch[{key!r}] has {val.shape[0]} rows, but batch[{rows[0]!r}] has {rows[1]}; "
                                 f"every entry must hold the same batch (or one row, for {' and '.join(_BROADCAST)})")
            rows = (key, val.shape[0])
        if seq_len is None:
            seq_len = val.shape[dim]
            lay.check(seq_len, world_size)
        elif val.shape[dim] != seq_len:
            raise ValueError(f"batch[{key!r}] has sequence length {val.shape[dim]} along dim {dim}, but other "
                             f"entries have {seq_len}; every entry must cover the same full sequence")
        out[key] = lay.shard(val, dim, rank, world_size)
    return out
