"""HuggingFace transformers glue: run a causal LM's attention as ring attention over a CP group.

Uses the public extension points only: ``transformers.AttentionInterface`` for the attention call
and ``transformers.masking_utils.AttentionMaskInterface`` for the mask, so that transformers never
silently drops a padding mask for an unknown implementation. The CP configuration lives on the
patched model's modules, so models with different groups or layouts coexist in one process.

Logit softcapping (Gemma2), learned attention sinks (GPT-OSS) and sliding windows (Mistral, Qwen2/3,
Gemma2/3, GPT-OSS, per layer) are honoured. A window of size W is transformers' own: a query sees
itself and the W - 1 keys before it (``i - W < j <= i``), i.e. ``window_size=(W - 1, -1)`` for ring
attention, and ``(W - 1, W - 1)`` in a non-causal layer (as transformers' flash-attention path does).
It reaches the ring from the ``sliding_window`` attention argument or, for models that pass it only
through their mask (Qwen2-MoE, PhiMoE), from the sliding mask the model asks the mask interface for.
Packed batches (``position_ids`` restarting at 0, or the ``cu_seq_lens_q/k`` of HF's flattening
collator) and padded batches (``attention_mask`` with zeros, left or right) are exact: :func:`shard_batch`
turns both into one packed stream of documents, and the document boundaries reach the attention as
transformers' ``cu_seq_lens_q/k`` attention kwargs (a window then counts within documents).
``config.is_causal=False`` (bidirectional masks and non-causal attention calls) is honoured too.
Features the ring cannot honour exactly are refused with an error naming them: padding masks given to
the model itself, custom 4D masks, masks the model overlays with its own mask functions, chunked
attention, and wherever transformers' own backends disagree: a mask whose causality differs from its
layer's, a bidirectional sliding window, a sliding mask and ``sliding_window`` argument that differ;
also attention dropout, KV-cache generation, position ids that are not the layout's positions, and
any attention argument it does not implement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F

import cp_attention as cpa
from cp_attention._extras import require_extra
from cp_attention.comm import group_rank_and_size
from cp_attention.documents import cu_seqlens_from_position_ids, document_position_ids, pad_cu_seqlens
from cp_attention.kernels import check_kernel_name
from cp_attention.loopback import LoopbackRank

from ._agree import SHAPE_DIMS, agree, documents_header, shape_header, show_shape
from ._hf_checks import ForwardChecks, check_positions, documents
from ._hf_masks import RingMask, layer_window, ring_mask

__all__ = ["apply_context_parallel", "shard_batch", "model_inputs", "causal_lm_loss", "gather_sequence",
           "ATTN_IMPLEMENTATION"]

ATTN_IMPLEMENTATION = "cp_ring"
IGNORE_INDEX = -100


def _transformers():
    require_extra("hf", ("transformers",), "cp_attention.integrations.huggingface")
    import transformers

    return transformers


@dataclass(frozen=True)
class _CPState:
    """The CP configuration of one patched model, stored on each of its modules."""

    group: Any
    layout: cpa.Layout
    kernel: str
    rank: int
    world_size: int
    checks: ForwardChecks  # the model's once-per-forward data checks, and what they accepted


# Model-level switches that transformers forwards to every attention function and that cannot change
# the attention values (what a layer returns besides them, or whether a cache object exists).
# output_attentions is not one of them: the ring never holds the weights, so True is refused.
_OUTPUT_FLAGS = frozenset({"use_cache", "output_hidden_states", "output_router_logits", "return_dict"})


def _ring_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: "Optional[RingMask]", dropout: float = 0.0,
                            scaling: Optional[float] = None, sliding_window: Optional[int] = None,
                            softcap: Optional[float] = None, position_ids: Optional[torch.Tensor] = None,
                            is_causal: Optional[bool] = None, s_aux: Optional[torch.Tensor] = None,
                            cu_seq_lens_q: Optional[torch.Tensor] = None, cu_seq_lens_k: Optional[torch.Tensor] = None,
                            max_length_q: Optional[int] = None, max_length_k: Optional[int] = None,
                            **others: Any) -> tuple[torch.Tensor, None]:
    """``AttentionInterface`` entry: q ``[B, H, n, D]``, k/v ``[B, Hkv, n, D]`` -> ``([B, n, H, Dv], None)``.

    ``attention_mask`` is what :func:`._hf_masks.ring_mask` returned for this layer (None: plain causal).
    ``sliding_window`` W (transformers' size: query i sees keys ``i - W < j <= i``) becomes the ring's
    ``window_size=(W - 1, -1)``, or ``(W - 1, W - 1)`` in a non-causal layer; see :func:`._hf_masks.layer_window`.
    ``s_aux`` (GPT-OSS's learned attention sinks, ``[H]``) joins every softmax denominator.
    ``cu_seq_lens_q/k`` (equal; GLOBAL document boundaries of the packed stream, as
    :func:`shard_batch` returns them) keep attention within documents (windows count within them);
    ``max_length_q/k`` must agree.
    Takes only what it implements. Any other argument that is not None (anything a future model
    adds) raises ``NotImplementedError``
    naming it, on every rank alike (they run the same model) and before any communication, instead of
    being dropped. Only :data:`_OUTPUT_FLAGS` (and ``output_attentions=False``) are accepted without effect.
    """
    unknown = sorted(name for name, val in others.items()
                     if val is not None and name not in _OUTPUT_FLAGS and not (name == "output_attentions" and not val))
    if unknown:
        raise NotImplementedError(
            f"context-parallel attention got argument(s) it does not implement: {', '.join(unknown)}; "
            "refusing rather than ignoring them (that would give a silently wrong result). "
            "Use the model without CP, or ask for support in cp_attention")
    state: Optional[_CPState] = getattr(module, "_cp_attention", None)
    if state is None:
        raise RuntimeError(f"attn_implementation={ATTN_IMPLEMENTATION!r} is set on a model that was not patched; "
                           "call cp_attention.integrations.huggingface.apply_context_parallel(model, group=...)")
    local = query.shape[2]
    total = local * state.world_size
    # The model's forward pre-hook checked this forward's data once, agreed over the group; the tensors
    # it accepted are recognised by identity. Anything else (a layer called on its own) is checked here.
    cu, checked = state.checks.accepted_documents(cu_seq_lens_q)
    if not checked:
        cu = documents(cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, total)
    if key.shape[2] != local:
        raise NotImplementedError(
            f"context-parallel attention got {local} queries but {key.shape[2]} keys: generation with a KV "
            "cache is not supported on a CP-patched model; generate with an unpatched copy of the model")
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    window = layer_window(attention_mask, sliding_window, causal)
    if dropout:
        raise NotImplementedError(f"attention dropout ({dropout}) is not supported by ring attention; "
                                  "set config.attention_dropout=0.0")
    if position_ids is not None and not state.checks.accepted_positions(position_ids):
        check_positions(position_ids, state.layout, total, state.rank, state.world_size, cu)
    longest = total if cu is None else max(b - a for a, b in zip(cu, cu[1:]))
    # A window covering every sequence (or document) is no window: the call stays the plain one.
    extra = {} if window is None or window >= longest else {
        "window_size": (window - 1, -1 if causal else window - 1)}
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        # Under autocast RoPE leaves q and k in fp32 while v comes out of its projection in the autocast
        # dtype; run attention in the autocast dtype, as transformers' flash-attention integration does.
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = (t.to(dtype) for t in (query, key, value))
    out = cpa.ring_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                             group=state.group, layout=state.layout, causal=causal, softmax_scale=scaling,
                             kernel=state.kernel, sinks=s_aux, softcap=softcap or 0.0, cu_seqlens=cu, **extra)
    return out, None


def _register() -> None:
    tf = _transformers()
    from transformers.masking_utils import AttentionMaskInterface

    tf.AttentionInterface.register(ATTN_IMPLEMENTATION, _ring_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, ring_mask)


def _refuse_generate(*args, **kwargs):
    raise NotImplementedError("generate() is not supported on a context-parallel model (its KV cache would hold "
                              "only this rank's shard); generate with an unpatched copy of the model")


def apply_context_parallel(model: torch.nn.Module, group=None, layout: Union[str, cpa.Layout] = "zigzag",
                           kernel: str = "auto") -> torch.nn.Module:
    """Patch ``model`` in place so its attention runs ring attention over ``group``; returns ``model``.

    Feed it this rank's shard of every sequence (see :func:`shard_batch`) with global position ids.
    With a group of world size 1 the model is returned untouched (an exact no-op).

    Raises ``ValueError`` for an unknown layout or kernel. A feature the ring cannot honour is
    refused by name when the model first runs (see the module docstring). What depends on a rank's own
    data (its position ids, padding, document boundaries) is checked once per forward, before any layer,
    and agreed across the group in one small collective: every rank raises the same error.
    """
    lay = cpa.get_layout(layout)
    check_kernel_name(kernel)
    rank, world_size = group_rank_and_size(group)
    if world_size == 1:
        return model
    _register()
    checks = ForwardChecks(group, lay, rank, world_size)
    state = _CPState(group, lay, kernel, rank, world_size, checks)
    for m in model.modules():
        m._cp_attention = state
    for previous in getattr(model, "_cp_checks_hooks", ()):  # patched again: the new checks replace the old
        previous.remove()
    model._cp_checks_hooks = (model.register_forward_pre_hook(checks, with_kwargs=True),
                              model.register_forward_hook(checks.post_hook, with_kwargs=True, always_call=True))
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    model.generate = _refuse_generate
    return model


def shard_batch(batch: Mapping[str, torch.Tensor], group=None, layout: Union[str, cpa.Layout] = "zigzag"
                ) -> dict[str, torch.Tensor]:
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

    Raises ``ValueError`` if the layout cannot split the sequence, for ``input_ids`` that are not
    ``[batch, seq]``, ``labels``, ``attention_mask`` (0/1 values) or ``position_ids`` that do not fit
    them, for non-contiguous padding, for packed ``position_ids`` that do not count 0, 1, 2, ... within
    each document, or for bad ``cu_seq_lens_q/k``; ``NotImplementedError`` for padding combined with
    packed position ids.
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
        None if cu is None else tuple(cu.tolist()))
    headers = agree(group, world_size, problem, _BATCH_ERRORS, "(on rank {first}; ranks refused: {bad})", header,
                    cause)
    if len(set(headers)) > 1:
        shapes = ", ".join(f"{show_shape(h[:SHAPE_DIMS + 1])} on rank {r}" for r, h in enumerate(headers))
        raise ValueError(f"shard_batch got different batches on the ranks of the group (local input_ids {shapes}, "
                         "or other document boundaries); every rank must pass the same full batch")
    return local


_BATCH_ERRORS = (ValueError, NotImplementedError, TypeError)


def _shard_batch(batch: Mapping[str, torch.Tensor], lay: cpa.Layout, rank: int, world_size: int
                 ) -> dict[str, torch.Tensor]:
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
    if rows is not None:
        return _shard_packed(batch, rows, lay, rank, world_size)
    lay.check(s, world_size)
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
            raise ValueError(f"attention_mask must be a [batch, seq] padding mask of input_ids' shape {(b, s)} (1: real "
                             f"token, 0: padding), got {_describe(mask)}; a 4-D mask cannot be sharded by rows of tokens")
        if mask.is_complex() or not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("attention_mask must hold 1 (real token) and 0 (padding) only, got other values; an "
                             "additive mask (0 and -inf) is not a padding mask")
    pos = batch.get("position_ids")
    if pos is not None:
        if not (isinstance(pos, torch.Tensor) and pos.dim() in (1, 2) and pos.shape[-1] == s
                and (pos.dim() == 1 or pos.shape[0] in (1, b))):
            raise ValueError(f"position_ids must be [seq], [1, seq] or [batch, seq] for input_ids of shape {(b, s)}, "
                             f"got {_describe(pos)}")
        if pos.is_complex() or pos.dtype == torch.bool or (pos.is_floating_point() and not torch.equal(pos, pos.round())):
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
                   ) -> "list[tuple[int, int, int, tuple[int, ...]]] | None":
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
        if b != 1 or padded:
            raise ValueError(f"cu_seq_lens_q/k describe one packed row without padding, got {b} rows"
                             + (" and an attention_mask with zeros" if padded else ""))
        if given is not None:
            doc_pos = document_position_ids(arange, cu)
            if not torch.equal(given, doc_pos.expand_as(given)):
                raise ValueError("position_ids disagree with cu_seq_lens_q: they must restart at 0 at every document")
        return [(0, 0, s, cu)]
    if padded and restarting:
        raise NotImplementedError("a batch that is both padded (attention_mask with zeros) and packed (position_ids "
                                  "restarting at 0) is not supported; pack without padding, or pad without packing")
    if restarting:
        return [(r, 0, s, cu_seqlens_from_position_ids(given.expand(b, s)[r])) for r in range(b)]
    if padded:
        out = []
        for r in range(b):
            real = torch.nonzero(mask[r]).flatten()
            if real.numel() == 0:
                continue  # an all-padding row contributes nothing
            start, stop = int(real[0]), int(real[-1]) + 1
            if stop - start != real.numel():
                raise ValueError(f"attention_mask row {r} has padding between real tokens; only left or right "
                                 "padding (one contiguous run of ones per row) is supported")
            out.append((r, start, stop, (0, stop - start)))
        if not out:
            raise ValueError("attention_mask is all zeros: the batch holds no real token")
        return out
    return None


def _shard_packed(batch: Mapping[str, torch.Tensor], rows, lay: cpa.Layout, rank: int, world_size: int
                  ) -> dict[str, torch.Tensor]:
    """One packed row of every row's documents, padded to the layout's divisor, sharded by documents."""
    ids = batch["input_ids"]
    b, s = ids.shape
    bounds = [0]
    for _, start, _, row_cu in rows:
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
    out = {key: lay.shard(stream(t, IGNORE_INDEX if key == "labels" else 0), 1, rank, world_size, cu)
           for key, t in batch.items()
           if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[:2] == (b, s)
           and key not in ("attention_mask", "position_ids")}
    positions = lay.positions(cu[-1], rank, world_size, cu)
    out["position_ids"] = document_position_ids(positions, cu).to(ids.device)[None]
    out["shift_labels"] = shifted[positions.to(shifted.device)][None]
    out["cu_seq_lens_q"] = out["cu_seq_lens_k"] = torch.tensor(cu, dtype=torch.int32)
    out["max_length_q"] = out["max_length_k"] = max(b - a for a, b in zip(cu, cu[1:]))
    return out


def causal_lm_loss(logits: torch.Tensor, shift_labels: torch.Tensor, group=None) -> torch.Tensor:
    """Next-token cross-entropy, the mean over every labelled token of the FULL sequences.

    ``logits [batch, local_seq, vocab]``, ``shift_labels [batch, local_seq]`` from :func:`shard_batch`.
    The value is the global mean on every rank; its gradient is this rank's share, so gradients
    summed over the CP group equal those of the model without CP.
    """
    # At least fp32 like HF's loss, but fp64 logits stay fp64.
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    local_sum = F.cross_entropy(logits.flatten(0, 1), shift_labels.flatten().to(logits.device),
                                ignore_index=IGNORE_INDEX, reduction="sum")
    count = (shift_labels != IGNORE_INDEX).sum().double().to(local_sum.device)  # NCCL needs both on the GPU
    stats = torch.stack([local_sum.detach().double(), count])
    _, world_size = group_rank_and_size(group)
    if isinstance(group, LoopbackRank):
        group.all_reduce_sum_(stats)
    elif world_size > 1:
        dist.all_reduce(stats, group=group)
    total, count = stats[0].to(local_sum.dtype), stats[1].clamp_min(1).to(local_sum.dtype)
    return (local_sum + (total - local_sum.detach())) / count


def gather_sequence(x: torch.Tensor, group=None, layout: Union[str, cpa.Layout] = "zigzag",
                    dim: int = 1, cu_seqlens=None) -> torch.Tensor:
    """All-gather every rank's shard of ``x`` along ``dim`` and unshard it (for evaluation; no gradient).
    For a packed or padded batch pass ``cu_seqlens=local["cu_seq_lens_q"]`` from :func:`shard_batch`."""
    return cpa.get_layout(layout).gather(x, dim=dim, group=group, cu_seqlens=cu_seqlens)
