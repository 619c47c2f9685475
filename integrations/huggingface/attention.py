"""HuggingFace transformers glue: run a causal LM's attention as ring attention over a CP group
(:func:`apply_context_parallel`, re-exported by :mod:`cp_attention.integrations.huggingface`).

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
collator) and padded batches (``attention_mask`` with zeros, left or right) are exact: :func:`.batch.shard_batch`
turns both into one packed stream of documents, and the document boundaries reach the attention as
transformers' ``cu_seq_lens_q/k`` attention kwargs (a window then counts within documents).
``config.is_causal=False`` (bidirectional masks and non-causal attention calls) is honoured too.
Every ``cp_comm_type`` (the ring, all-gather, all-to-all, both on a 2-D mesh, ``"auto"``) keeps all of
this exact: :func:`apply_context_parallel` passes the model's to every attention call.
Features the ring cannot honour exactly are refused with an error naming them: padding masks given to
the model itself, custom 4D masks, masks the model overlays with its own mask functions, chunked
attention, and wherever transformers' own backends disagree: a mask whose causality differs from its
layer's, a bidirectional sliding window, a sliding mask and ``sliding_window`` argument that differ;
also attention dropout, KV-cache generation, position ids that are not the layout's positions, and
any attention argument it does not implement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F

import cp_attention as cpa
from cp_attention._extras import require_extra
from cp_attention.kernels import check_kernel_name
from cp_attention.layouts.documents import longest_document
from cp_attention.transport import cp_group, group_rank_and_size, mesh_group, transport_for
from cp_attention.transport.eager import eager_only
from cp_attention.transport.mesh import is_two_level
from cp_attention.versions import require_version

from .batch import IGNORE_INDEX
from .checks import ForwardChecks, check_positions, documents
from .gen_state import active_generation
from .loss import model_loss
from .masks import RingMask, layer_window, ring_mask

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["apply_context_parallel", "causal_lm_loss", "gather_sequence", "ATTN_IMPLEMENTATION"]

ATTN_IMPLEMENTATION = "cp_ring"


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
    cp_comm_type: str = "p2p"  # how K/V travel: "p2p" (the ring), "all_gather", "a2a", "a2a+p2p", "auto"


# Model-level switches that transformers forwards to every attention function and that cannot change
# the attention values (what a layer returns besides them, or whether a cache object exists).
# output_attentions is not one of them: the ring never holds the weights, so True is refused.
_OUTPUT_FLAGS = frozenset({"use_cache", "output_hidden_states", "output_router_logits", "return_dict"})
# The loss's own arguments, which transformers hands down to every layer with the rest of a forward's
# kwargs (Trainer passes num_items_in_batch, a CP batch shift_labels); its own attention backends ignore
# them, and so does the ring: they cannot change attention.
_LOSS_ONLY = frozenset({"num_items_in_batch", "shift_labels", "ignore_index"})


@eager_only
def _ring_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: RingMask | None, dropout: float = 0.0,
                            scaling: float | None = None, sliding_window: int | None = None,
                            softcap: float | None = None, position_ids: torch.Tensor | None = None,
                            is_causal: bool | None = None, s_aux: torch.Tensor | None = None,
                            cu_seq_lens_q: torch.Tensor | None = None, cu_seq_lens_k: torch.Tensor | None = None,
                            max_length_q: int | None = None, max_length_k: int | None = None,
                            **others: Any) -> tuple[torch.Tensor, None]:
    """``AttentionInterface`` entry: q ``[B, H, n, D]``, k/v ``[B, Hkv, n, D]`` -> ``([B, n, H, Dv], None)``.

    ``attention_mask`` is what :func:`.masks.ring_mask` returned for this layer (None: plain causal).
    ``sliding_window`` W (transformers' size: query i sees keys ``i - W < j <= i``) becomes the ring's
    ``window_size=(W - 1, -1)``, or ``(W - 1, W - 1)`` in a non-causal layer; see :func:`.masks.layer_window`.
    ``s_aux`` (GPT-OSS's learned attention sinks, ``[H]``) joins every softmax denominator.
    ``cu_seq_lens_q/k`` (equal; GLOBAL document boundaries of the packed stream, as
    :func:`.batch.shard_batch` returns them) keep attention within documents (windows count within them);
    ``max_length_q/k`` must agree.
    Takes only what it implements. Any other argument that is not None (anything a future model
    adds) raises ``NotImplementedError``
    naming it, on every rank alike (they run the same model) and before any communication, instead of
    being dropped. Only :data:`_OUTPUT_FLAGS`, the loss's :data:`_LOSS_ONLY` (and
    ``output_attentions=False``) are accepted without effect.
    """
    unknown = sorted(name for name, val in others.items()
                     if val is not None and name not in _OUTPUT_FLAGS and name not in _LOSS_ONLY
                     and not (name == "output_attentions" and not val))
    if unknown:
        raise NotImplementedError(
            f"context-parallel attention got argument(s) it does not implement: {', '.join(unknown)}; "
            "refusing rather than ignoring them (that would give a silently wrong result). "
            "Use the model without CP, or ask for support in cp_attention")
    state: _CPState | None = getattr(module, "_cp_attention", None)
    if state is None:
        raise RuntimeError(f"attn_implementation={ATTN_IMPLEMENTATION!r} is set on a model that was not patched; "
                           "call cp_attention.integrations.huggingface.apply_context_parallel(model, group=...)")
    gen = active_generation(state)
    if gen is not None and gen.prefilled:  # a decoding step of generate(): pass-Q over the sharded cache
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        if not causal:
            raise NotImplementedError("generate needs causal attention layers; this layer is not causal")
        return gen.attend(module, query, key, value, layer_window(attention_mask, sliding_window, causal), scaling,
                          softcap, s_aux)
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
    longest = longest_document(cu, total)
    # A window covering every sequence (or document) is no window: the call stays the plain one.
    extra: dict[str, Any] = {} if window is None or window >= longest else {
        "window_size": (window - 1, -1 if causal else window - 1)}
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        # Under autocast RoPE leaves q and k in fp32 while v comes out of its projection in the autocast
        # dtype; run attention in the autocast dtype, as transformers' flash-attention integration does.
        # Autocast casts fp32 only: an fp64 model stays fp64 (its projections are not cast either).
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = (t.to(dtype) if t.dtype == torch.float32 else t for t in (query, key, value))
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    common: dict[str, Any] = dict(softmax_scale=scaling, kernel=state.kernel, sinks=s_aux, softcap=softcap or 0.0,
                                  cp_comm_type=state.cp_comm_type)
    plan = state.checks.plan_for(cu_seq_lens_q, causal, extra.get("window_size", (-1, -1)))
    if plan is not None:  # the forward's plan, built once in its pre-hook
        return cpa.ring_attention(q, k, v, plan=plan, **common), None
    out = cpa.ring_attention(q, k, v, group=state.group, layout=state.layout, causal=causal, cu_seqlens=cu,
                             **extra, **common)
    return out, None


# Under torch.compile the mask check reads the padding mask on the host: eager, as the attention is.
_EAGER_RING_MASK = eager_only(ring_mask)


def _register() -> None:
    tf = _transformers()
    from transformers.masking_utils import AttentionMaskInterface

    tf.AttentionInterface.register(ATTN_IMPLEMENTATION, _ring_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _EAGER_RING_MASK)


def _eager_hook(hook):
    """``hook`` (the forward checks, which agree over the group on the host) as a plain function that
    runs eagerly under torch.compile: a graph break, named in a ``fullgraph=True`` error."""

    @eager_only
    def context_parallel_forward_checks(*args: Any, **kwargs: Any) -> Any:
        return hook(*args, **kwargs)

    return context_parallel_forward_checks


def _refuse_generate(*args, **kwargs):
    raise NotImplementedError("model.generate() on a context-parallel model would run every rank's shard as a "
                              "whole prompt; call cp_attention.integrations.huggingface.generate(model, input_ids, "
                              "group=..., layout=..., attention_mask=..., **generate_kwargs), which shards the prompt "
                              "and the KV cache and returns what model.generate returns without CP")


def apply_context_parallel(model: torch.nn.Module, group=None, layout: str | cpa.Layout = "zigzag",
                           kernel: str = "auto", cp_comm_type: str = "p2p") -> torch.nn.Module:
    """Patch ``model`` in place so its attention runs ring attention over ``group``; returns ``model``.

    Feed it this rank's shard of every sequence (see :func:`.batch.shard_batch`) with global position ids.
    With a group of world size 1 the model is returned untouched (an exact no-op).

    ``cp_comm_type`` picks how K/V travel, as in ``ring_attention``: ``"p2p"`` (the ring), ``"all_gather"``,
    ``"a2a"`` (Ulysses; heads divisible by the group's size), ``"a2a+p2p"`` (``group`` a 2-D DeviceMesh:
    all-to-all inside dim 1, the ring across dim 0; shard with the flattened mesh rank) or ``"auto"``.

    Raises ``RuntimeError`` for a transformers older than ``cp_attention.versions.FLOORS`` (first, before any
    communication), ``ValueError`` for an unknown layout, kernel or ``cp_comm_type``. A feature the ring
    cannot honour is refused by name when the model first runs (see the module docstring). What depends on a rank's own
    data (its position ids, padding, document boundaries) is checked once per forward, before any layer,
    and agreed across the group in one small collective: every rank raises the same error.
    """
    require_version("transformers", "cp_attention's HuggingFace adapter (apply_context_parallel)")
    given = group  # a (dp, cp) mesh: the model's loss cannot tell which mean it should be (see .loss)
    group = group if is_two_level(group) else cp_group(group)  # a DeviceMesh: its "cp" dim, or both levels
    lay = cpa.get_layout(layout)
    check_kernel_name(kernel)
    cp_comm_type = cpa.check_comm_type_name(cp_comm_type)
    rank, world_size = group_rank_and_size(group)
    if world_size == 1:
        return model
    _register()
    checks = ForwardChecks(group, lay, rank, world_size)
    hf = cast("PreTrainedModel", model)  # a transformers model: its loss_function and set_attn_implementation
    # labels given to the model: the exact CP loss, or refused by name in the checks (never a per-rank mean)
    hf.loss_function = checks.loss = model_loss(model, given, group, causal_lm_loss)
    state = _CPState(group, lay, kernel, rank, world_size, checks, cp_comm_type)
    # The plain attributes below: torch's stubs type Module.__setattr__ for tensors and submodules only
    for m in model.modules():
        m._cp_attention = state  # type: ignore[assignment]
    for previous in getattr(model, "_cp_checks_hooks", ()):  # patched again: the new checks replace the old
        previous.remove()
    model._cp_checks_hooks = (  # type: ignore[assignment]
        model.register_forward_pre_hook(_eager_hook(checks), with_kwargs=True),
        model.register_forward_hook(_eager_hook(checks.post_hook), with_kwargs=True, always_call=True))
    hf.set_attn_implementation(ATTN_IMPLEMENTATION)
    model.generate = _refuse_generate  # type: ignore[assignment]
    return model


def causal_lm_loss(logits: torch.Tensor, shift_labels: torch.Tensor, group=None) -> torch.Tensor:
    """Next-token cross-entropy, the mean over every labelled token of the FULL sequences.

    ``logits [batch, local_seq, vocab]``, ``shift_labels [batch, local_seq]`` from :func:`.batch.shard_batch`.
    The value is the global mean on every rank; its gradient is this rank's share, so gradients
    summed over the CP group equal those of the model without CP. ``group``: the CP group (a process
    group, ``None`` for the default one, or a 1-D mesh), or the ``(dp, cp)`` DeviceMesh of
    :func:`parallelize`: then the mean is over every label token of ALL the mesh's ranks (the global
    batch of every dp rank), which FSDP's summed gradients need.
    """
    # At least fp32 like HF's loss, but fp64 logits stay fp64.
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    local_sum = F.cross_entropy(logits.flatten(0, 1), shift_labels.flatten().to(logits.device),
                                ignore_index=IGNORE_INDEX, reduction="sum")
    count = (shift_labels != IGNORE_INDEX).sum().double().to(local_sum.device)  # NCCL needs both on the GPU
    stats = torch.stack([local_sum.detach().double(), count])
    transport_for(mesh_group(group)).all_reduce_sum_(stats)
    total, count = stats[0].to(local_sum.dtype), stats[1].clamp_min(1).to(local_sum.dtype)
    # The value is exactly the reduced total on every rank (x - x == 0); the gradient is this rank's share.
    return (total + (local_sum - local_sum.detach())) / count


def gather_sequence(x: torch.Tensor, group=None, layout: str | cpa.Layout = "zigzag",
                    dim: int = 1, cu_seqlens=None) -> torch.Tensor:
    """All-gather every rank's shard of ``x`` along ``dim`` and unshard it (for evaluation; no gradient).
    For a packed or padded batch pass ``cu_seqlens=local["cu_seq_lens_q"]`` from :func:`.batch.shard_batch`."""
    return cpa.get_layout(layout).gather(x, dim=dim, group=group, cu_seqlens=cu_seqlens)
