"""Megatron-core THD packed sequences for the ring: document boundaries from ``PackedSeqParams``
(TransformerEngine's padded convention included) and packed batches sharded by our layouts."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams

import cp_attention as cpa
from cp_attention.documents import check_cu_seqlens, cu_seqlens_tuple, document_position_ids

__all__ = ["packed_documents", "packed_seq_params_from_batch", "shard_packed_batch", "PACKED_ENTRIES"]


def _show(cu: Optional[tuple[int, ...]]) -> str:
    if cu is None:
        return "None"
    return f"[{', '.join(map(str, cu[:8]))}{', ...' if len(cu) > 8 else ''}]"


def _boundaries(packed_seq_params: Any, field: str) -> Optional[tuple[int, ...]]:
    value = getattr(packed_seq_params, field, None)
    if value is None:
        return None
    try:
        return check_cu_seqlens(value)
    except ValueError as e:
        raise ValueError(f"packed_seq_params.{field}: {e}") from None


def packed_documents(packed_seq_params: PackedSeqParams) -> tuple[int, ...]:
    """The document boundaries ring attention attends within, for megatron's THD ``packed_seq_params``.

    ``cu_seqlens_q`` are flash-attn's (and megatron's) boundaries ``[0, l1, l1+l2, ..., T]`` of the
    FULL packed stream, the same on every CP rank. With ``cu_seqlens_q_padded`` (TransformerEngine's
    convention: ``cu_seqlens_q`` then counts real tokens only, and document i holds its ``l_i``
    real tokens from ``cu_seqlens_q_padded[i]`` on, then padding up to ``cu_seqlens_q_padded[i+1]``),
    every run of padding becomes a document of its own: real tokens attend only to real tokens of
    their document, causal or not, exactly as without the padding, and padding tokens only among
    themselves (finite outputs; give them ``loss_mask`` 0). Without padding the result is
    ``cu_seqlens_q``. ``cu_seqlens_kv`` (and ``cu_seqlens_kv_padded``) must be the query's or ``None``.

    These are the ``cu_seqlens`` of every layout call: :func:`get_batch_on_this_cp_rank` shards with
    ``layout.shard(x, 1, rank, cp_size, cu_seqlens=packed_documents(p))``; gather outputs with
    ``layout.gather(x, 1, group, cu_seqlens=packed_documents(p))``.

    Raises:
        ValueError: no ``cu_seqlens_q``, malformed boundaries, or padded boundaries that do not hold
            the real documents.
        NotImplementedError: ``qkv_format`` other than ``"thd"``, or key/value boundaries other than
            the query's (cross-document attention).
    """
    fmt = getattr(packed_seq_params, "qkv_format", None)
    if fmt != "thd":
        raise NotImplementedError(
            f"packed_seq_params.qkv_format={fmt!r} is not supported by ring attention; only 'thd' packed "
            "sequences are (one packed stream of [t, heads, dim] tokens with cu_seqlens_q over the full stream)")
    real_q = _boundaries(packed_seq_params, "cu_seqlens_q")
    if real_q is None:
        raise ValueError("packed_seq_params.cu_seqlens_q is None; THD packed sequences need the document "
                         "boundaries [0, l1, l1+l2, ..., T] of the full packed stream")
    real_kv = _boundaries(packed_seq_params, "cu_seqlens_kv")
    padded_q = _boundaries(packed_seq_params, "cu_seqlens_q_padded")
    padded_kv = _boundaries(packed_seq_params, "cu_seqlens_kv_padded")
    real_kv = real_q if real_kv is None else real_kv
    if (real_q, padded_q or real_q) != (real_kv, padded_kv or real_kv):
        raise NotImplementedError(
            f"packed_seq_params: the key/value boundaries (cu_seqlens_kv={_show(real_kv)}, cu_seqlens_kv_padded="
            f"{_show(padded_kv)}) differ from the query's (cu_seqlens_q={_show(real_q)}, cu_seqlens_q_padded="
            f"{_show(padded_q)}); ring attention is self-attention within the documents of one packed stream: "
            "pass the query's boundaries (or None) for the keys and values")
    if padded_q is None or padded_q == real_q:
        return real_q
    if len(padded_q) != len(real_q):
        raise ValueError(f"packed_seq_params.cu_seqlens_q_padded has {len(padded_q) - 1} documents but "
                         f"cu_seqlens_q has {len(real_q) - 1}; they must describe the same documents")
    documents = [0]
    for i in range(len(real_q) - 1):
        real, slots = real_q[i + 1] - real_q[i], padded_q[i + 1] - padded_q[i]
        if real > slots:
            raise ValueError(f"packed_seq_params: document {i} has {real} real tokens (cu_seqlens_q) but only "
                             f"{slots} padded slots (cu_seqlens_q_padded); a padded document must hold its "
                             "real tokens")
        documents.append(padded_q[i] + real)
        if slots > real:
            documents.append(padded_q[i + 1])  # the padding run, a document of its own
    return tuple(documents)


# megatron's THD batch entries (get_thd_batch_on_this_cp_rank): boundaries, not tokens; never sharded.
PACKED_ENTRIES = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen")


def _batch_boundaries(batch: Mapping[str, Any], key: str) -> Any:
    value = batch.get(key)
    if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[0] == 1:
        value = value[0]  # a collated [1, n]
    return value


def packed_seq_params_from_batch(batch: Mapping[str, Any]) -> PackedSeqParams:
    """THD ``PackedSeqParams`` from megatron's batch entries ``cu_seqlens`` [, ``cu_seqlens_padded``,
    ``max_seqlen``] (``max_seqlen`` defaults to the longest padded document)."""
    cu, padded = _batch_boundaries(batch, "cu_seqlens"), _batch_boundaries(batch, "cu_seqlens_padded")
    longest = batch.get("max_seqlen")
    if longest is None:
        bounds = cu_seqlens_tuple(cu if padded is None else padded)
        longest = max((b - a for a, b in zip(bounds, bounds[1:])), default=0)
    else:
        longest = int(torch.as_tensor(longest).flatten()[0])
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded,
                           cu_seqlens_kv_padded=padded, max_seqlen_q=longest, max_seqlen_kv=longest)


def shard_packed_batch(batch: Mapping[str, Any], lay: cpa.Layout, rank: int, world_size: int,
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
        if key in PACKED_ENTRIES or key == "attention_mask" or not isinstance(val, torch.Tensor):
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
