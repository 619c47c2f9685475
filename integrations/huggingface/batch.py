"""The HuggingFace adapter's batches: :func:`shard_batch` turns a batch of full sequences (plain, packed
or padded) into this rank's share, agreed across the group, and :func:`model_inputs` picks what the
patched model takes from it. Re-exported by :mod:`cp_attention.integrations.huggingface`.
"""

from __future__ import annotations

import zlib
from typing import Any, Mapping

import torch

import cp_attention as cpa
from cp_attention.checks.verdicts import SHAPE_DIMS, agree, documents_header, shape_header, show_shape
from cp_attention.layouts.documents import (
    cu_seqlens_from_position_ids,
    document_position_ids,
    longest_document,
    pad_cu_seqlens,
)
from cp_attention.transport import group_rank_and_size

from .checks import documents

__all__ = ["shard_batch", "model_inputs", "IGNORE_INDEX"]

IGNORE_INDEX = -100  # the label cross-entropy ignores (padding, the last token of each document)


def shard_batch(batch: Mapping[str, torch.Tensor], group=None, layout: str | cpa.Layout = "zigzag"
                ) -> dict[str, Any]:
    """This rank's share of a batch of full ``[batch, seq]`` tensors.

    Plain batches: every ``[batch, seq, ...]`` entry sharded along the sequence, plus ``position_ids``
    (the GLOBAL positions, so RoPE is right) and ``shift_labels`` (``labels``, or ``input_ids`` if
    absent, shifted left by one on the FULL sequence, -100 at the end, then sharded).

    Packed batches (``position_ids`` restarting at 0 at every document, any number of rows, or HF's
    flattening-collator ``cu_seq_lens_q/k`` over one row) and padded batches (``attention_mask`` with
    zeros, left or right: each row's real tokens are one document) become ONE packed row of documents:
    padding tokens are dropped, the stream is padded up to the layout's divisor with one padding
    document (label -100), and every token entry comes back ``[1, T/N, ...]``. ``position_ids`` are then
    positions within documents, ``shift_labels`` shift within documents (-100 at each document's end),
    and ``cu_seq_lens_q/k`` (the stream's document boundaries; pass them to the model, which hands them
    to the attention) and ``max_length_q/k`` are added; ``attention_mask`` is dropped.

    A plain batch whose length the layout cannot split (``seq`` not a multiple of its divisor) is
    packed too, each row one document, so no length is refused.

    A packed or padded batch is sharded with its stream's documents (``layout.shard(..., cu_seqlens=cu)``),
    so a per-batch layout such as ``"balanced"`` places each batch's documents anew; gather its outputs
    with the same boundaries (``gather_sequence(..., cu_seqlens=local["cu_seq_lens_q"])``). Without
    documents ``"balanced"`` is zigzag.

    Raises ``ValueError`` for ``input_ids`` that are not
    ``[batch, seq]``, ``labels``, ``attention_mask`` (0/1 values) or ``position_ids`` that do not fit
    them, for non-contiguous padding, for packed ``position_ids`` that do not count 0, 1, 2, ... within
    each document, or for bad ``cu_seq_lens_q/k``; ``NotImplementedError`` for a padded row whose
    position ids restart at 0 inside its real tokens (padded and packed). A padded batch may carry
    position ids that count 0, 1, 2, ... over each row's real tokens (``attention_mask.cumsum(-1) - 1``,
    whatever the padding's own positions), or the plain ``arange``.
    """
    lay = cpa.get_layout(layout)
    rank, world_size = group_rank_and_size(group)
    if world_size == 1:
        return _shard_batch(batch, lay, rank, world_size)
    # A refusal depends on this rank's own batch: agree on it (and on the shard's shape and documents)
    # in one small all-gather, so every rank raises alike instead of one going on alone.
    try:
        local, problem, cause = _shard_batch(batch, lay, rank, world_size), None, None
    except _BATCH_ERRORS as e:
        local, problem, cause = None, (_BATCH_ERRORS.index(type(e)) if type(e) in _BATCH_ERRORS else 0, str(e)), e
    cu = local.get("cu_seq_lens_q") if local is not None else None
    header = shape_header(None if local is None else local["input_ids"]) + documents_header(
        None if cu is None else tuple(cu.tolist())) + batch_fingerprint(batch)
    headers = agree(group, world_size, problem, _BATCH_ERRORS, "(on rank {first}; ranks refused: {bad})", header,
                    cause)
    if len(set(headers)) > 1:
        shapes = ", ".join(f"{show_shape(h[:SHAPE_DIMS + 1])} on rank {r}" for r, h in enumerate(headers))
        raise ValueError(f"shard_batch got different batches on the ranks of the group (local input_ids {shapes}, "
                         "or other document boundaries or token values); every rank of a CP group must pass the "
                         "same full batch (with FSDP over dp x cp: the same batch within each dp rank's CP group)")
    if local is None:  # agree() raised this rank's refusal on every rank
        raise RuntimeError("shard_batch: this rank refused its batch, but the group's agreement did not raise it"
                           ) from cause
    return local


_BATCH_ERRORS = (ValueError, NotImplementedError, TypeError)

# Weights of the batch fingerprint: an LCG's multiplier and increment (any odd constants would do).
_MUL, _ADD = 6364136223846793005, 1442695040888963407


def batch_fingerprint(batch: Mapping[str, Any]) -> list[int]:
    """Three integers that differ, but for a ~2**-64 chance, between batches with other entries, shapes or
    values (order-sensitive): the names and shapes' CRC and two position-weighted sums of every tensor
    entry's bits, computed on the entries' device with wrapping int64 arithmetic and read at once."""
    names, sums = [], []
    for key in sorted(k for k, v in batch.items() if isinstance(v, torch.Tensor)):
        t = batch[key].detach().reshape(-1)
        names.append(f"{key}{tuple(batch[key].shape)}{t.dtype}")
        if t.numel() == 0:
            continue
        bits = t.double().view(torch.int64) if t.is_floating_point() else t.to(torch.int64)
        index = torch.arange(1, t.numel() + 1, device=t.device, dtype=torch.int64)
        weight = index * _MUL + _ADD
        sums.append(torch.stack([(bits * weight).sum(), ((bits + index) * (weight * _MUL + _ADD)).sum()]))
    total = torch.stack(sums).sum(0).tolist() if sums else [0, 0]
    return [zlib.crc32(";".join(names).encode()), *total]


def _shard_batch(batch: Mapping[str, torch.Tensor], lay: cpa.Layout, rank: int, world_size: int
                 ) -> dict[str, Any]:
    """:func:`shard_batch` on this rank alone (its refusals not yet agreed)."""
    batch = {key: val for key, val in batch.items() if val is not None}  # None entries: as if absent
    if "input_ids" not in batch:
        raise ValueError(f"shard_batch needs 'input_ids' in the batch, got keys {sorted(batch)}")
    ids = batch["input_ids"]
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError(f"input_ids must be a [batch, seq] tensor of the full sequences, got {_describe(ids)}")
    b, s = ids.shape
    _check_entries(batch, b, s)
    rows = _document_rows(batch, b, s)
    if rows is None and s % lay.divisor(world_size):
        rows = [(r, 0, s, (0, s)) for r in range(b)]  # each row a document, packed and padded to the divisor
    if rows is not None:
        return _shard_packed(batch, rows, lay, rank, world_size)
    positions = torch.arange(s, device=ids.device).expand(b, s)
    labels = batch.get("labels", ids)
    shifted = torch.cat([labels[:, 1:], labels.new_full((b, 1), IGNORE_INDEX)], dim=1)
    out = {key: lay.shard(t, 1, rank, world_size) for key, t in batch.items()
           if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[:2] == (b, s)}
    out["position_ids"] = lay.shard(positions, 1, rank, world_size)
    out["shift_labels"] = lay.shard(shifted, 1, rank, world_size)
    return out


def _describe(x: Any) -> str:
    return f"a tensor of shape {tuple(x.shape)} ({x.dtype})" if isinstance(x, torch.Tensor) else type(x).__name__


def _is_int(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return x.numel() == 1 and not (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool)
    return isinstance(x, int) and not isinstance(x, bool)


def _check_entries(batch: Mapping[str, Any], b: int, s: int) -> None:
    """Refuse entries :func:`shard_batch` reads that do not fit ``input_ids [b, s]`` (``ValueError``), so
    they can neither fail obscurely nor be sharded into silently wrong tokens."""
    labels = batch.get("labels")
    if labels is not None and (not isinstance(labels, torch.Tensor) or tuple(labels.shape) != (b, s)):
        raise ValueError(f"labels must be a [batch, seq] tensor of input_ids' shape {(b, s)}, got {_describe(labels)}")
    mask = batch.get("attention_mask")
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (b, s):
            raise ValueError(f"attention_mask must be a [batch, seq] padding mask of input_ids' shape {(b, s)} "
                             f"(1: real token, 0: padding), got {_describe(mask)}; a 4-D mask cannot be sharded by "
                             "rows of tokens")
        if mask.is_complex() or not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("attention_mask must hold 1 (real token) and 0 (padding) only, got other values; an "
                             "additive mask (0 and -inf) is not a padding mask")
    pos = batch.get("position_ids")
    if pos is not None:
        if not (isinstance(pos, torch.Tensor) and pos.dim() in (1, 2) and pos.shape[-1] == s
                and (pos.dim() == 1 or pos.shape[0] in (1, b))):
            raise ValueError(f"position_ids must be [seq], [1, seq] or [batch, seq] for input_ids of shape {(b, s)}, "
                             f"got {_describe(pos)}")
        if pos.is_complex() or pos.dtype == torch.bool or (pos.is_floating_point()
                                                           and not torch.equal(pos, pos.round())):
            raise ValueError(f"position_ids must hold integers, got {pos.dtype} values that are not")
    for name in ("max_length_q", "max_length_k"):
        if batch.get(name) is not None and not _is_int(batch[name]):
            raise ValueError(f"{name} must be an int (the longest document), got {_describe(batch[name])}")


def model_inputs(local: Mapping[str, Any]) -> dict[str, Any]:
    """What the patched model takes from a :func:`shard_batch` result: everything but the labels, so
    ``model(**model_inputs(local))`` computes no second (local, wrong) loss on the side. Compute the
    loss with :func:`causal_lm_loss` and ``local["shift_labels"]``."""
    return {key: val for key, val in local.items() if key not in ("labels", "shift_labels")}


def _document_rows(batch: Mapping[str, torch.Tensor], b: int, s: int
                   ) -> list[tuple[int, int, int, tuple[int, ...]]] | None:
    """For a packed or padded batch, ``(row, start, stop, row_cu)`` per row: the real tokens
    ``start:stop`` of the row and their document boundaries (relative to ``start``). None if plain."""
    mask = batch.get("attention_mask")
    given = batch.get("position_ids")
    cu_q, cu_k = batch.get("cu_seq_lens_q"), batch.get("cu_seq_lens_k")
    padded = mask is not None and not bool(mask.all())
    arange = torch.arange(s, device=batch["input_ids"].device)
    restarting = given is not None and not torch.equal(given, arange.expand_as(given))
    if cu_q is not None or cu_k is not None:
        cu = documents(cu_q, cu_k, batch.get("max_length_q"), batch.get("max_length_k"), s)
        if cu is None:  # documents() returns the boundaries whenever cu_seq_lens_q/k are given
            raise RuntimeError("cu_seq_lens_q/k were given, but documents() found no boundaries in them")
        if b != 1 or padded:
            raise ValueError(f"cu_seq_lens_q/k describe one packed row without padding, got {b} rows"
                             + (" and an attention_mask with zeros" if padded else ""))
        if given is not None:
            doc_pos = document_position_ids(arange, cu)
            if not torch.equal(given, doc_pos.expand_as(given)):
                raise ValueError("position_ids disagree with cu_seq_lens_q: they must restart at 0 at every document")
        return [(0, 0, s, cu)]
    if given is not None and restarting and not padded:
        return [(r, 0, s, cu_seqlens_from_position_ids(given.expand(b, s)[r])) for r in range(b)]
    if mask is not None and padded:
        out: list[tuple[int, int, int, tuple[int, ...]]] = []
        for r in range(b):
            real = torch.nonzero(mask[r]).flatten()
            if real.numel() == 0:
                continue  # an all-padding row contributes nothing
            start, stop = int(real[0]), int(real[-1]) + 1
            if stop - start != real.numel():
                raise ValueError(f"attention_mask row {r} has padding between real tokens; only left or right "
                                 "padding (one contiguous run of ones per row) is supported")
            if given is not None and restarting:
                _check_padded_row_positions(given.expand(b, s)[r], r, start, stop)
            out.append((r, start, stop, (0, stop - start)))
        if not out:
            raise ValueError("attention_mask is all zeros: the batch holds no real token")
        return out
    return None


def _check_padded_row_positions(row: torch.Tensor, r: int, start: int, stop: int) -> None:
    """Accept the position ids of padded row ``r`` (real tokens ``start:stop``) if its real tokens are one
    document: positions 0, 1, 2, ... over them (``attention_mask.cumsum(-1) - 1``, as HF's ``generate``
    and many collators make; the padding's own positions, -1, 1 or anything, are never used), or
    ``start, start + 1, ...`` (``arange`` over the row). Raise ``NotImplementedError`` if they restart at 0
    inside the real tokens (padded AND packed), else ``ValueError``."""
    real = row[start:stop].to("cpu", torch.int64)
    count = torch.arange(stop - start)
    if torch.equal(real, count) or torch.equal(real, count + start):
        return
    if int(real[0]) == 0 and int((real == 0).sum()) > 1:
        restart = int(torch.nonzero(real == 0).flatten()[1]) + start
        raise NotImplementedError(
            f"row {r} of the batch is both padded (attention_mask with zeros) and packed (its position_ids restart "
            f"at 0 at token {restart}, inside its real tokens {start}:{stop}): not supported, as without CP the "
            "model would attend across those documents through the padding mask. Pack without padding "
            "(position_ids restarting at 0, no attention_mask), or pad one document per row")
    bad = int(torch.nonzero((real != count) & (real != count + start)).flatten()[0])
    raise ValueError(
        f"position_ids of padded row {r} must count 0, 1, 2, ... over its real tokens {start}:{stop} "
        f"(attention_mask.cumsum(-1) - 1) or continue the row's arange, got {int(real[bad])} at token "
        f"{start + bad}; pass such position_ids, or none")


def _shard_packed(batch: Mapping[str, torch.Tensor], rows, lay: cpa.Layout, rank: int, world_size: int
                  ) -> dict[str, Any]:
    """One packed row of every row's documents, padded to the layout's divisor, sharded by documents."""
    ids = batch["input_ids"]
    b, s = ids.shape
    bounds = [0]
    for _, _start, _, row_cu in rows:
        bounds += [bounds[-1] + c for c in row_cu[1:]]
    cu, pad = pad_cu_seqlens(bounds, lay.divisor(world_size))

    def stream(t: torch.Tensor, fill) -> torch.Tensor:
        parts = [t[r, start:stop] for r, start, stop, _ in rows]
        if pad:
            parts.append(t.new_full((pad, *t.shape[2:]), fill))
        return torch.cat(parts)[None]

    labels = stream(batch.get("labels", ids), IGNORE_INDEX)[0]
    # The next token of a document's last token is not in the document: -100 there.
    last = torch.tensor(cu[1:], device=labels.device) - 1
    shifted = torch.cat([labels[1:], labels.new_full((1,), IGNORE_INDEX)])
    shifted[last] = IGNORE_INDEX
    out: dict[str, Any]  # tensors, and the ints max_length_q/k
    out = {key: lay.shard(stream(t, IGNORE_INDEX if key == "labels" else 0), 1, rank, world_size, cu)
           for key, t in batch.items()
           if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[:2] == (b, s)
           and key not in ("attention_mask", "position_ids")}
    positions = lay.positions(cu[-1], rank, world_size, cu)
    out["position_ids"] = document_position_ids(positions, cu).to(ids.device)[None]
    out["shift_labels"] = shifted[positions.to(shifted.device)][None]
    out["cu_seq_lens_q"] = out["cu_seq_lens_k"] = torch.tensor(cu, dtype=torch.int32)
    out["max_length_q"] = out["max_length_k"] = longest_document(cu, cu[-1])
    return out
