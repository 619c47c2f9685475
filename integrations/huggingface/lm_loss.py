"""The causal-LM loss of a (CP-patched) HuggingFace model without its full logits: :func:`lm_loss`.

``causal_lm_loss(model(**model_inputs(local)).logits, ...)`` holds ``[tokens, vocab]`` logits, their fp32
copy and their gradient at once: at 128k vocab and 32k tokens per GPU that is tens of GiB, more than the
whole decoder's activations. :func:`lm_loss` runs the model with ``logits_to_keep=1`` (the head computes
one row per sequence), takes the decoder's last hidden state from a forward hook, and runs the head and
the cross-entropy over chunks of ``chunk_tokens`` tokens in a custom autograd function whose forward keeps
no logits and whose backward recomputes each chunk's. The value and the gradients are those of
``causal_lm_loss`` (up to the order of the sums).

The head is applied exactly as the model's own forward applies it: its output embedding (an
``nn.Linear``, tied or not, with its bias if any), then the family's transform (:data:`HEAD_TRANSFORMS`:
Gemma2/3's final logit softcapping, Granite's ``logits_scaling``, Cohere's ``logit_scale``). A class
whose forward lm_loss has not read is refused by name; the rows the model computed itself are compared
with lm_loss's head on every call, and a difference is raised on every rank alike.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F

from cp_attention.transport import mesh_group, transport_for

from .batch import IGNORE_INDEX, model_inputs

__all__ = ["lm_loss", "HEAD_TRANSFORMS"]

# transformers' causal-LM classes whose forward is ``outputs = self.model(...)``, ``hidden_states =
# outputs.last_hidden_state``, ``slice_logits_to_keep``, ``logits = self.lm_head(hidden_states)`` and then
# the transform named by the key (tests/adapters/hf/test_lm_loss.py reads each class's source to check).
HEAD_TRANSFORMS: dict[str, tuple[str, ...]] = {
    "none": ("LlamaForCausalLM", "MistralForCausalLM", "Ministral3ForCausalLM", "MixtralForCausalLM",
             "Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
             "GptOssForCausalLM", "Phi3ForCausalLM", "PhimoeForCausalLM", "GemmaForCausalLM", "OlmoForCausalLM",
             "Olmo2ForCausalLM", "Olmo3ForCausalLM", "Starcoder2ForCausalLM", "SmolLM3ForCausalLM",
             "Glm4ForCausalLM", "DeepseekV3ForCausalLM"),
    # logits / cap, tanh, * cap (config.final_logit_softcapping; None: no transform)
    "final_logit_softcapping": ("Gemma2ForCausalLM", "Gemma3ForCausalLM"),
    "divide_by_logits_scaling": ("GraniteForCausalLM", "GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM"),
    "times_logit_scale": ("CohereForCausalLM", "Cohere2ForCausalLM"),
}
_KIND = {name: kind for kind, names in HEAD_TRANSFORMS.items() for name in names}


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model inside DDP / DataParallel (``.module``) or ``torch.compile`` (``._orig_mod``)."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    while True:
        if isinstance(model, (DistributedDataParallel, DataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):
            model = model._orig_mod
        else:
            return model


def head_kind(inner: torch.nn.Module) -> str:
    """The key of :data:`HEAD_TRANSFORMS` for ``inner``'s class (an FSDP2 subclass counts as its base).

    Raises ``NotImplementedError`` naming the class if its forward is not one lm_loss knows (an unlisted
    class, or a subclass that overrides ``forward``), or its output embedding is not a plain ``nn.Linear``."""
    cls = type(inner)
    known = next((c for c in cls.__mro__ if c.__name__ in _KIND and c.__module__.startswith("transformers.")), None)
    if known is None or cls.forward is not known.forward:
        what = f"its forward overrides {known.__name__}'s" if known is not None else "it is not a class lm_loss knows"
        raise NotImplementedError(
            f"lm_loss cannot apply the LM head of {cls.__name__} exactly as its forward does ({what}; known: "
            f"{', '.join(sorted(_KIND))}); compute the loss from the full logits instead: "
            "causal_lm_loss(model(**model_inputs(local)).logits, local['shift_labels'], group=...)")
    head = inner.get_output_embeddings()
    if type(head).forward is not torch.nn.Linear.forward or not isinstance(head, torch.nn.Linear):
        raise NotImplementedError(
            f"lm_loss needs {cls.__name__}'s output embedding to be a plain torch.nn.Linear, got "
            f"{type(head).__name__}; compute the loss with causal_lm_loss on the full logits instead")
    return _KIND[known.__name__]


def _head_fn(inner: torch.nn.Module, kind: str) -> Callable[[torch.Tensor, Sequence[torch.Tensor]], torch.Tensor]:
    """``f(hidden [..., H], (weight, [bias])) -> logits [..., V]``: the model's head, op for op as its forward."""
    if kind == "final_logit_softcapping":
        cap = inner.config.final_logit_softcapping
    elif kind == "divide_by_logits_scaling":
        scaling = inner.config.logits_scaling
    elif kind == "times_logit_scale":
        scale = inner.logit_scale

    def head(h: torch.Tensor, params: Sequence[torch.Tensor]) -> torch.Tensor:
        logits = F.linear(h, params[0], params[1] if len(params) > 1 else None)
        if kind == "final_logit_softcapping" and cap is not None:
            logits = logits / cap
            logits = torch.tanh(logits)
            logits = logits * cap
        elif kind == "divide_by_logits_scaling":
            logits = logits / scaling
        elif kind == "times_logit_scale":
            logits = logits * scale
        return logits

    return head


def _chunk_sum(head: Callable, h: torch.Tensor, labels: torch.Tensor, params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The cross-entropy SUM of one chunk ``h [c, H]``, ``labels [c]``, as :func:`.attention.causal_lm_loss`
    computes it: at least fp32 (bf16/fp16 logits upcast, fp64 kept), ``IGNORE_INDEX`` ignored."""
    logits = head(h, params)
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


class _ChunkedHeadLoss(torch.autograd.Function):
    """``sum_t CE(head(hidden[t]), labels[t])`` over chunks of ``chunk`` rows, no chunk's logits kept.

    Inputs: ``hidden [T, H]``, ``labels [T]``, ``chunk``, ``head``, ``kept`` (the model's own logits, which
    get a zero gradient so that hooks on the model's output, FSDP2's among them, run in backward) and the
    head's parameters (inputs, so autograd, DDP and FSDP2 see their gradients)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, labels: torch.Tensor, chunk: int, head: Callable,
                kept: Optional[torch.Tensor], *params: torch.Tensor) -> torch.Tensor:
        device = hidden.device.type
        # The backward recomputes under the forward's autocast state, so its logits are the forward's.
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.chunk, ctx.head = chunk, head
        ctx.kept = None if kept is None else (kept.shape, kept.dtype, kept.device)
        ctx.save_for_backward(hidden, labels, *params)
        total = None
        for start in range(0, hidden.shape[0], chunk):
            part = _chunk_sum(head, hidden[start:start + chunk], labels[start:start + chunk], params)
            total = part if total is None else total + part
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        hidden, labels, *params = ctx.saved_tensors
        want_h = ctx.needs_input_grad[0]
        want = [ctx.needs_input_grad[5 + i] for i in range(len(params))]
        # Fresh leaves (sharing storage) so each chunk's graph ends here and autograd.grad returns their grads.
        leaves = [p.detach().requires_grad_(w) for p, w in zip(params, want)]
        grad_hidden = torch.empty_like(hidden) if want_h else None
        # bf16/fp16 parameter gradients are summed over the chunks in fp32, rounded once at the end
        acc: list[Optional[torch.Tensor]] = [None] * len(params)
        device, enabled, dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            for start in range(0, hidden.shape[0], ctx.chunk):
                h = hidden[start:start + ctx.chunk].detach().requires_grad_(want_h)
                loss = _chunk_sum(ctx.head, h, labels[start:start + ctx.chunk], leaves)
                inputs = ([h] if want_h else []) + [w for w in leaves if w.requires_grad]
                if not inputs:
                    break
                grads = list(torch.autograd.grad(loss, inputs, grad_outputs=grad_total))
                del loss
                if want_h:
                    grad_hidden[start:start + ctx.chunk] = grads.pop(0)
                for i, w in enumerate(leaves):
                    if w.requires_grad:
                        g = grads.pop(0)
                        if acc[i] is None:
                            acc[i] = g.float() if g.dtype in (torch.float16, torch.bfloat16) else g
                        else:
                            acc[i].add_(g)
        grad_params = [None if a is None else a.to(p.dtype) for a, p in zip(acc, params)]
        grad_kept = None
        if ctx.kept is not None and ctx.needs_input_grad[4]:
            shape, kdtype, kdevice = ctx.kept
            grad_kept = torch.zeros(shape, dtype=kdtype, device=kdevice)
        return (grad_hidden, None, None, None, grad_kept, *grad_params)


def _check_arguments(local: Any, chunk_tokens: Any, num_items_in_batch: Any) -> None:
    """Raise ``ValueError`` for arguments :func:`lm_loss` cannot take (pure: every rank decides alike)."""
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive int (the most tokens whose logits exist at once), "
                         f"got {chunk_tokens!r}")
    if not isinstance(local, Mapping):
        raise ValueError(f"local must be the dict shard_batch returns, got {type(local).__name__}")
    labels = local.get("shift_labels")
    if not isinstance(labels, torch.Tensor) or labels.dim() != 2:
        raise ValueError("local must hold 'shift_labels', a [batch, local_seq] tensor (what shard_batch adds), got "
                         + ("none" if labels is None else repr(getattr(labels, "shape", type(labels).__name__)))
                         + f" among keys {sorted(local)}; pass the batch through shard_batch(batch, group=...)")
    tokens = local.get("input_ids", local.get("inputs_embeds"))
    if isinstance(tokens, torch.Tensor) and tuple(tokens.shape[:2]) != tuple(labels.shape):
        raise ValueError(f"shift_labels {tuple(labels.shape)} do not fit the inputs {tuple(tokens.shape[:2])}: "
                         "both must be this rank's [batch, local_seq] from shard_batch")
    if "logits_to_keep" in local:
        raise ValueError("local holds 'logits_to_keep': lm_loss sets it itself (the head runs over chunks); "
                         "remove it")
    n = num_items_in_batch
    if n is None:
        return
    if isinstance(n, torch.Tensor):
        if n.numel() != 1 or n.dtype == torch.bool or n.is_complex():
            raise ValueError(f"num_items_in_batch must be a number or a one-element real tensor, got a tensor of "
                             f"shape {tuple(n.shape)} ({n.dtype})")
    elif isinstance(n, bool) or not isinstance(n, (int, float)) or not n > 0:
        raise ValueError(f"num_items_in_batch must be a positive number (the batch's label tokens) or None, "
                         f"got {n!r}")


def _run_model(model: torch.nn.Module, decoder: torch.nn.Module, local: Mapping[str, Any]):
    """``model(**model_inputs(local), logits_to_keep=1)`` and the decoder's last hidden state ``[B, S, H]``."""
    captured: list[torch.Tensor] = []

    def capture(module, args, output):
        captured.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

    inputs = model_inputs(local)
    inputs.setdefault("use_cache", False)  # no KV cache: it would only hold memory in training
    handle = decoder.register_forward_hook(capture)
    try:
        out = model(**inputs, logits_to_keep=1)  # the head computes the last row of each sequence only
    finally:
        handle.remove()
    if len(captured) != 1:
        raise RuntimeError(f"lm_loss expected the decoder {type(decoder).__name__} to run once in the model's "
                           f"forward, it ran {len(captured)} times")
    logits = out.logits if hasattr(out, "logits") else out[0]
    return captured[0], logits


def lm_loss(model: torch.nn.Module, local: dict[str, Any], group=None, chunk_tokens: int = 1024,
            num_items_in_batch: "torch.Tensor | int | None" = None) -> torch.Tensor:
    """``causal_lm_loss(model(**model_inputs(local)).logits, local["shift_labels"], group=group)`` without
    the full logits: the LM head and cross-entropy run over chunks of at most ``chunk_tokens`` of the
    ``batch * local_seq`` tokens, in forward and (recomputed) in backward.

    ``model``: a HF causal LM (patched by ``apply_context_parallel`` or ``parallelize``, or not; inside DDP
    is fine), called itself so its hooks run. ``local``: this rank's batch from ``shard_batch``.
    ``group`` as in ``causal_lm_loss`` (a process group, None, a loopback rank, or parallelize's
    (dp, cp) mesh: the mean then spans every rank of the mesh). Returns a 0-d tensor (fp32, or fp64 for
    an fp64 model): the global mean on every rank, with this rank's share of the gradient; with
    ``num_items_in_batch=n`` the group's cross-entropy sum over ``n``.

    Raises, before any communication: ``ValueError`` for bad arguments; ``NotImplementedError`` naming
    the model's class when lm_loss does not know how its forward applies the head (see
    :data:`HEAD_TRANSFORMS`). After the forward, on every rank alike: ``NotImplementedError`` for a head
    whose parameters are still sharded (an FSDP-wrapped head), ``RuntimeError`` if the head lm_loss
    applies differs from the model's own logits.
    """
    _check_arguments(local, chunk_tokens, num_items_in_batch)
    inner = _unwrap(model)
    kind = head_kind(inner)
    head_module = inner.get_output_embeddings()
    hidden, kept = _run_model(model, inner.get_decoder(), local)
    params = [p for p in (head_module.weight, head_module.bias) if p is not None]
    if any(type(p).__name__ == "DTensor" for p in params):
        raise NotImplementedError(
            f"{type(inner).__name__}'s output embedding is still sharded after the forward (fully_shard applied "
            "to it with reshard_after_forward=True?); lm_loss needs its full weight: leave it to the root "
            "module, as parallelize does")
    head = _head_fn(inner, kind)
    with torch.no_grad():  # the same rows, the same shapes: the model's own logits, bit for bit
        mine = head(hidden[:, -1:], params)
        if mine.shape != kept.shape:
            raise RuntimeError(f"{type(inner).__name__} returned logits of shape {tuple(kept.shape)} for "
                               f"logits_to_keep=1, expected {tuple(mine.shape)}")
        differ = ((mine != kept) & ~(mine.isnan() & kept.isnan())).any()
    labels = local["shift_labels"].to(hidden.device)
    local_sum = _ChunkedHeadLoss.apply(hidden.flatten(0, 1), labels.flatten(), chunk_tokens, head, kept, *params)
    count = (labels != IGNORE_INDEX).sum().double()
    stats = torch.stack([local_sum.detach().double(), count, differ.double()])
    transport_for(mesh_group(group)).all_reduce_sum_(stats)  # one collective: [sum, count, mismatches]
    if bool(stats[2] > 0):  # every rank holds the same sum, so every rank raises alike
        raise RuntimeError(
            f"lm_loss's LM head differs from {type(inner).__name__}'s own logits (on {int(stats[2])} rank(s)); "
            "its forward does something to the logits lm_loss does not: compute the loss with "
            "causal_lm_loss(model(**model_inputs(local)).logits, ...) and report it to cp_attention")
    total = stats[0].to(local_sum.dtype)
    if num_items_in_batch is None:
        denominator = stats[1].clamp_min(1).to(local_sum.dtype)
    elif isinstance(num_items_in_batch, torch.Tensor):
        denominator = num_items_in_batch.to(device=local_sum.device, dtype=local_sum.dtype).reshape(())
    else:
        denominator = num_items_in_batch
    # The value is exactly the reduced total on every rank (x - x == 0); the gradient is this rank's share.
    return (total + (local_sum - local_sum.detach())) / denominator
