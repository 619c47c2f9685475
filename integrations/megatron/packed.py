"""Megatron-core THD packed sequences for the ring: the document boundaries of ``PackedSeqParams``
(TransformerEngine's padded convention included) and the verdict on a packed attention call."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams

from cp_attention.layouts.documents import check_cu_seqlens

__all__ = ["packed_documents", "packed_verdict", "packed_config_verdict", "packed_stream_verdict",
           "check_stream_length", "packed_local_tokens", "group_ranks"]


def _show(cu: tuple[int, ...] | None) -> str:
    if cu is None:
        return "None"
    return f"[{', '.join(map(str, cu[:8]))}{', ...' if len(cu) > 8 else ''}]"


def _boundaries(packed_seq_params: Any, field: str) -> tuple[int, ...] | None:
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


def group_ranks(group) -> tuple[int, ...] | None:
    """The global ranks of ``group`` (None without a group or torch.distributed), to compare groups."""
    if group is None or not dist.is_initialized():
        return None
    return tuple(dist.get_process_group_ranks(group))


def packed_config_verdict(attention) -> None:
    """Refuse the packed features the ring core ``attention``'s configuration cannot honour
    (``NotImplementedError``): multi-latent attention, multi-token prediction, a model whose rotary
    embedding is not linked to the ring (``packed_rotary_problem``). The same on every rank."""
    config = attention.config
    if getattr(config, "multi_latent_attention", False):
        raise NotImplementedError("packed sequences (packed_seq_params) with multi-latent attention are not "
                                  "supported by ring attention: MLA rotates its own RoPE part of q and k "
                                  "per document with TransformerEngine's split; pass unpacked batches")
    if getattr(config, "mtp_num_layers", None):
        raise NotImplementedError(f"packed sequences (packed_seq_params) with multi-token prediction "
                                  f"(mtp_num_layers={config.mtp_num_layers}) are not supported by ring "
                                  "attention: megatron rolls packed labels across CP ranks assuming "
                                  "TransformerEngine's per-document split; pass unpacked batches")
    if attention.packed_rotary_problem is not None:
        raise NotImplementedError(attention.packed_rotary_problem)


def packed_stream_verdict(packed_seq_params: PackedSeqParams, attention_mask: torch.Tensor | None,
                          layout, cp_size: int, cp_group, local: int | None = None) -> tuple[int, ...]:
    """This rank's verdict on the data of a packed forward: the documents to attend within
    (:func:`packed_documents`), or ``ValueError``/``NotImplementedError`` for malformed or unsupported
    ``packed_seq_params`` (a dynamic CP group, ``local_cp_size``), an ``attention_mask`` alongside them,
    and, given this rank's ``local`` token count, a packed stream that is not ``local * cp_size`` tokens
    or that ``layout`` cannot split. Pure: the caller agrees on it across the CP group."""
    documents = packed_documents(packed_seq_params)
    local_cp = getattr(packed_seq_params, "local_cp_size", None)
    if local_cp is not None and local_cp != cp_size:
        raise NotImplementedError(f"packed_seq_params.local_cp_size={local_cp} (hybrid/dynamic context "
                                  f"parallelism) is not supported by ring attention; leave it None (the CP "
                                  f"group is the model's, of size {cp_size})")
    group = getattr(packed_seq_params, "cp_group", None)
    if group is not None and group_ranks(group) != group_ranks(cp_group):
        raise NotImplementedError(f"packed_seq_params.cp_group (ranks {group_ranks(group)}) is not the "
                                  f"model's CP group (ranks {group_ranks(cp_group)}); dynamic CP groups "
                                  "are not supported by ring attention: leave packed_seq_params.cp_group None")
    if attention_mask is not None:
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
        raise NotImplementedError(f"attention_mask {shape} with packed sequences is not "
                                  "supported by ring attention: the documents of packed_seq_params and the "
                                  "causal flag are the whole mask; pass attention_mask=None")
    if local is not None:
        check_stream_length(documents, local, layout, cp_size)
    return documents


def check_stream_length(documents: tuple[int, ...], local: int, layout, cp_size: int) -> None:
    """Raise ``ValueError`` unless the packed stream ``documents`` describe is ``local * cp_size`` tokens
    and ``layout`` can split it over ``cp_size`` ranks."""
    total = documents[-1]
    if total != local * cp_size:
        raise ValueError(f"packed_seq_params describe a packed stream of {total} tokens, but this rank holds "
                         f"{local} tokens x cp_size {cp_size} = {local * cp_size}; shard the batch "
                         f"with get_batch_on_this_cp_rank(batch, layout='{layout.name}', "
                         "packed_seq_params=...)")
    try:
        layout.check(total, cp_size)
    except ValueError as e:
        raise ValueError(f"packed stream of {total} tokens: {e}; append a padding document with "
                         f"cp_attention.pad_cu_seqlens(cu_seqlens, {layout.divisor(cp_size)})") from None


def packed_local_tokens(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> int:
    """The local token count ``t`` of packed (THD) ``[t, heads, dim]`` (or ``[t, 1, heads, dim]``) query,
    key and value; ``ValueError`` for other shapes."""
    shapes = [tuple(t.shape) for t in (query, key, value)]
    ok = (all(len(s) == 3 for s in shapes) or all(len(s) == 4 and s[1] == 1 for s in shapes))
    if not ok or len({s[0] for s in shapes}) != 1:
        raise ValueError(f"packed (THD) query, key and value must be [t, heads, dim] (or [t, 1, heads, dim]) "
                         f"with the same t, got shapes {shapes}")
    return shapes[0][0]


def packed_verdict(attention, packed_seq_params: PackedSeqParams, attention_mask: torch.Tensor | None,
                   query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[int, ...]:
    """This rank's verdict on a packed call of the ring core ``attention``: the documents to attend
    within (:func:`packed_documents`), or ``ValueError``/``NotImplementedError`` naming what it cannot
    honour. Pure: the caller agrees on the verdict across the CP group before any communication."""
    packed_config_verdict(attention)
    documents = packed_stream_verdict(packed_seq_params, attention_mask, attention.layout, attention.cp_size,
                                      attention.cp_group)
    check_stream_length(documents, packed_local_tokens(query, key, value), attention.layout, attention.cp_size)
    return documents
