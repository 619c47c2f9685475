"""HuggingFace transformers glue: run a causal LM's attention as ring attention over a CP group.

Uses the public extension points only: ``transformers.AttentionInterface`` for the attention call
and ``transformers.masking_utils.AttentionMaskInterface`` for the mask, so that transformers never
silently drops a padding mask for an unknown implementation. The CP configuration lives on the
patched model's modules, so models with different groups or layouts coexist in one process.

Logit softcapping (Gemma2) and learned attention sinks (GPT-OSS) are honoured. Features the ring
cannot honour exactly are refused with an error naming them: padding masks, custom 4D masks,
sliding windows shorter than the sequence, attention dropout, KV-cache generation, position ids
that are not the layout's global positions, and any attention argument it does not implement.
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
from cp_attention.kernels import check_kernel_name

__all__ = ["apply_context_parallel", "shard_batch", "causal_lm_loss", "gather_sequence", "ATTN_IMPLEMENTATION"]

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


# Model-level switches that transformers forwards to every attention function and that cannot change
# the attention values (what a layer returns besides them, or whether a cache object exists).
# output_attentions is not one of them: the ring never holds the weights, so True is refused.
_OUTPUT_FLAGS = frozenset({"use_cache", "output_hidden_states", "output_router_logits", "return_dict"})


def _ring_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                            scaling: Optional[float] = None, sliding_window: Optional[int] = None,
                            softcap: Optional[float] = None, position_ids: Optional[torch.Tensor] = None,
                            is_causal: Optional[bool] = None, s_aux: Optional[torch.Tensor] = None,
                            **others: Any) -> tuple[torch.Tensor, None]:
    """``AttentionInterface`` entry: q ``[B, H, n, D]``, k/v ``[B, Hkv, n, D]`` -> ``([B, n, H, Dv], None)``.

    ``s_aux`` (GPT-OSS's learned attention sinks, ``[H]``) joins every softmax denominator.
    Takes only what it implements. Any other argument that is not None (packed-sequence
    ``cu_seq_lens_*``, anything a future model adds) raises ``NotImplementedError``
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
    if key.shape[2] != local:
        raise NotImplementedError(
            f"context-parallel attention got {local} queries but {key.shape[2]} keys: generation with a KV "
            "cache is not supported on a CP-patched model; generate with an unpatched copy of the model")
    if attention_mask is not None:
        raise NotImplementedError("context-parallel attention does not support custom 4D attention masks; "
                                  "pass no attention_mask (padding is not supported either)")
    if sliding_window is not None and sliding_window < total:
        raise NotImplementedError(
            f"sliding-window attention (window {sliding_window} < global sequence {total}) is not supported "
            "by ring attention yet; use sequences no longer than the window or config.sliding_window=None")
    if dropout:
        raise NotImplementedError(f"attention dropout ({dropout}) is not supported by ring attention; "
                                  "set config.attention_dropout=0.0")
    if position_ids is not None:
        expected = state.layout.positions(total, state.rank, state.world_size).to(position_ids.device)
        if not torch.equal(position_ids, expected.expand_as(position_ids)):
            raise ValueError(
                f"position_ids must be this rank's GLOBAL positions under the {state.layout.name} layout "
                f"(expected {expected[:4].tolist()}..., got {position_ids[0, :4].tolist()}...), or RoPE is wrong; "
                "pass position_ids from cp_attention.integrations.huggingface.shard_batch "
                "(packed sequences with restarting positions are not supported yet)")
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    out = cpa.ring_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                             group=state.group, layout=state.layout, causal=causal, softmax_scale=scaling,
                             kernel=state.kernel, sinks=s_aux, softcap=softcap or 0.0)
    return out, None


def _ring_mask(batch_size: int, q_length: int, kv_length: int, *args,
               attention_mask: Optional[torch.Tensor] = None, **kwargs) -> None:
    """``AttentionMaskInterface`` entry: the ring applies the causal mask itself, so no mask is built.
    A padding mask with zeros cannot be honoured and is refused rather than dropped."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise NotImplementedError("padding (attention_mask with zeros) is not supported by context-parallel "
                                  "attention yet; pack or trim the batch so that every token is real")
    return None


def _register() -> None:
    tf = _transformers()
    from transformers.masking_utils import AttentionMaskInterface

    tf.AttentionInterface.register(ATTN_IMPLEMENTATION, _ring_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _ring_mask)


def _refuse_generate(*args, **kwargs):
    raise NotImplementedError("generate() is not supported on a context-parallel model (its KV cache would hold "
                              "only this rank's shard); generate with an unpatched copy of the model")


def apply_context_parallel(model: torch.nn.Module, group=None, layout: Union[str, cpa.Layout] = "zigzag",
                           kernel: str = "auto") -> torch.nn.Module:
    """Patch ``model`` in place so its attention runs ring attention over ``group``; returns ``model``.

    Feed it this rank's shard of every sequence (see :func:`shard_batch`) with global position ids.
    With a group of world size 1 the model is returned untouched (an exact no-op).

    Raises ``ValueError`` for an unknown layout or kernel. A feature the ring cannot honour is
    refused by name when the model first runs (see the module docstring).
    """
    lay = cpa.get_layout(layout)
    check_kernel_name(kernel)
    rank, world_size = group_rank_and_size(group)
    if world_size == 1:
        return model
    _register()
    state = _CPState(group, lay, kernel, rank, world_size)
    for m in model.modules():
        m._cp_attention = state
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    model.generate = _refuse_generate
    return model


def shard_batch(batch: Mapping[str, torch.Tensor], group=None, layout: Union[str, cpa.Layout] = "zigzag"
                ) -> dict[str, torch.Tensor]:
    """This rank's share of a batch of full ``[batch, seq]`` tensors.

    Returns every ``[batch, seq, ...]`` entry sharded along the sequence, plus ``position_ids`` (the
    GLOBAL positions, so RoPE is right) and ``shift_labels`` (``labels``, or ``input_ids`` if absent,
    shifted left by one on the FULL sequence, -100 at the end, then sharded).

    Raises ``ValueError`` if the layout cannot split the sequence, and ``NotImplementedError`` for
    padding (an ``attention_mask`` with zeros) or packed ``position_ids``.
    """
    lay = cpa.get_layout(layout)
    rank, world_size = group_rank_and_size(group)
    if "input_ids" not in batch:
        raise ValueError(f"shard_batch needs 'input_ids' in the batch, got keys {sorted(batch)}")
    ids = batch["input_ids"]
    b, s = ids.shape
    lay.check(s, world_size)
    mask = batch.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise NotImplementedError("padding (attention_mask with zeros) is not supported by context-parallel "
                                  "attention yet; pack or trim the batch so that every token is real")
    positions = torch.arange(s, device=ids.device).expand(b, s)
    given = batch.get("position_ids")
    if given is not None and not torch.equal(given, positions.expand_as(given)):
        raise NotImplementedError("packed sequences (position_ids other than 0..seq-1) are not supported by "
                                  "context-parallel attention yet")
    labels = batch.get("labels", ids)
    shifted = torch.cat([labels[:, 1:], labels.new_full((b, 1), IGNORE_INDEX)], dim=1)
    out = {key: lay.shard(t, 1, rank, world_size) for key, t in batch.items()
           if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[:2] == (b, s)}
    out["position_ids"] = lay.shard(positions, 1, rank, world_size)
    out["shift_labels"] = lay.shard(shifted, 1, rank, world_size)
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
    stats = torch.stack([local_sum.detach().double(), (shift_labels != IGNORE_INDEX).sum().double()])
    _, world_size = group_rank_and_size(group)
    if world_size > 1:
        dist.all_reduce(stats, group=group)
    total, count = stats[0].to(local_sum.dtype), stats[1].clamp_min(1).to(local_sum.dtype)
    return (local_sum + (total - local_sum.detach())) / count


def gather_sequence(x: torch.Tensor, group=None, layout: Union[str, cpa.Layout] = "zigzag",
                    dim: int = 1) -> torch.Tensor:
    """All-gather every rank's shard of ``x`` along ``dim`` and unshard it (for evaluation; no gradient)."""
    return cpa.get_layout(layout).gather(x, dim=dim, group=group)
