"""The causal-LM loss of a (CP-patched) HuggingFace model without its full logits: :func:`lm_loss`.

``causal_lm_loss(model(**model_inputs(local)).logits, ...)`` holds ``[tokens, vocab]`` logits, their fp32
copy and their gradients at once: at 128k vocab and 32k tokens per GPU that is tens of GiB, more than the
whole decoder's activations. :func:`lm_loss` runs the model with ``logits_to_keep`` two positions (the head
computes two rows per sequence), takes the decoder's last hidden state from a forward hook, and runs the head and
the cross-entropy over chunks of ``chunk_tokens`` tokens in a custom autograd function whose forward keeps
no logits and whose backward recomputes each chunk's and turns it into its gradient in place. At any
time at most one chunk's logits exist: ``chunk_tokens x vocab`` of them in the head's dtype plus one
fp32 copy (the softmax, then the gradient), and the cross-entropy's own ``[chunk, vocab]`` workspace in
forward. The value and the gradients are those of ``causal_lm_loss`` (up to the order of the sums).

The head is applied exactly as the model's own forward applies it: its output embedding (an
``nn.Linear``, tied or not, with its bias if any), then the family's transform (:data:`HEAD_TRANSFORMS`:
Gemma2/3's final logit softcapping, Granite's ``logits_scaling``, Cohere's ``logit_scale``). A class
whose forward lm_loss has not read is refused by name, and so is a head with forward, pre-forward or
backward hooks, or a ``forward`` replaced on the instance (lm_loss calls no module, so it could not run
them). The rows the model computed itself, each sequence's last and one drawn at random from the others
(anew on every call, from lm_loss's own generator), are compared with lm_loss's head on every call: what
the checks find travels in the loss's one all-reduce, the verdict is the call's one host sync, and a
refusal is raised on every rank alike.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping, Sequence, cast

import torch
import torch.nn.functional as F

from cp_attention.transport import mesh_group, transport_for

from .batch import IGNORE_INDEX, model_inputs

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["lm_loss", "HEAD_TRANSFORMS"]

# transformers' causal-LM classes whose forward is ``outputs = self.model(...)``, ``hidden_states =
# outputs.last_hidden_state``, the ``logits_to_keep`` rows kept (``slice_logits_to_keep``, or inline before
# it existed), ``logits = self.lm_head(...)`` of them and then the transform named by the key
# (tests/adapters/hf/test_lm_loss.py reads each class's source to check).
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


def head_kind(model: torch.nn.Module) -> str:
    """The key of :data:`HEAD_TRANSFORMS` for the class of ``model`` (unwrapped from DDP or torch.compile;
    an FSDP2 subclass counts as its base), decided from the class alone: every rank decides alike.

    Raises ``NotImplementedError`` naming the class if its forward is not one lm_loss knows (an unlisted
    class, or a subclass that overrides ``forward``), or its output embedding is not a plain ``nn.Linear``."""
    inner = _unwrap(model)
    cls = type(inner)
    known = next((c for c in cls.__mro__ if issubclass(c, torch.nn.Module) and c.__name__ in _KIND
                  and c.__module__.startswith("transformers.")), None)
    if known is None or cls.forward is not known.forward:
        what = f"its forward overrides {known.__name__}'s" if known is not None else "it is not a class lm_loss knows"
        raise NotImplementedError(
            f"lm_loss cannot apply the LM head of {cls.__name__} exactly as its forward does ({what}; known: "
            f"{', '.join(sorted(_KIND))}); compute the loss from the full logits instead: "
            "causal_lm_loss(model(**model_inputs(local)).logits, local['shift_labels'], group=...)")
    head = cast("PreTrainedModel", inner).get_output_embeddings()  # one of transformers' causal LMs (above)
    if type(head).forward is not torch.nn.Linear.forward or not isinstance(head, torch.nn.Linear):
        raise NotImplementedError(
            f"lm_loss needs {cls.__name__}'s output embedding to be a plain torch.nn.Linear, got "
            f"{type(head).__name__}; compute the loss with causal_lm_loss on the full logits instead")
    return _KIND[known.__name__]


class _Transform:
    """What the model's forward does to ``logits = self.lm_head(hidden_states)``, op for op (``__call__``),
    and its backward as autograd computes it (:meth:`backward`)."""

    def __init__(self, inner: PreTrainedModel, kind: str) -> None:
        self.kind = kind
        self.const: float = 1.0  # the family's constant (kind "none" reads none)
        if kind == "final_logit_softcapping":
            cap = inner.config.final_logit_softcapping
            if cap is None:  # no softcapping configured: the plain logits
                self.kind = "none"
            else:
                self.const = cap
        elif kind == "divide_by_logits_scaling":
            self.const = inner.config.logits_scaling
        elif kind == "times_logit_scale":
            self.const = cast(float, inner.logit_scale)  # a plain float attribute (Cohere's config.logit_scale)

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        if self.kind == "final_logit_softcapping":
            z = z / self.const
            z = torch.tanh(z)
            return z * self.const
        if self.kind == "divide_by_logits_scaling":
            return z / self.const
        if self.kind == "times_logit_scale":
            return z * self.const
        return z

    def backward(self, z: torch.Tensor | None, grad: torch.Tensor) -> torch.Tensor:
        """The gradient at the head's output ``z`` (read by the softcap only) from ``grad`` at the
        transform's (in place)."""
        if self.kind == "final_logit_softcapping":  # MulBackward, TanhBackward (1 - tanh**2), DivBackward
            if z is None:
                raise RuntimeError("the softcap's backward needs the head's output z (_wide_logits(keep=True))")
            slope = (z / self.const).tanh_()
            slope = slope.mul_(slope).neg_().add_(1)
            return grad.mul_(self.const).mul_(slope).div_(self.const)
        if self.kind == "divide_by_logits_scaling":
            return grad.div_(self.const)
        if self.kind == "times_logit_scale":
            return grad.mul_(self.const)
        return grad


def _linear(h: torch.Tensor, params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The output embedding's ``nn.Linear.forward`` on ``h``: ``params`` are (weight, [bias])."""
    return F.linear(h, params[0], params[1] if len(params) > 1 else None)


def _wide(logits: torch.Tensor) -> torch.Tensor:
    """At least fp32, as :func:`.attention.causal_lm_loss` (bf16/fp16 upcast, fp32/fp64 kept)."""
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def _wide_logits(h: torch.Tensor, params: Sequence[torch.Tensor], transform: _Transform, keep: bool = False
                 ) -> tuple[torch.Tensor | None, torch.Tensor, torch.dtype]:
    """One chunk's logits as :func:`.attention.causal_lm_loss` reads them, at least fp32 (bf16/fp16 upcast,
    fp32/fp64 kept), in a tensor of their own to work on in place; with the head's output ``z`` if ``keep``
    and the transform's backward reads it (else None, freed), and ``z``'s dtype."""
    z = _linear(h, params)
    wide = _wide(transform(z))  # z itself for fp32/fp64 without a transform
    return (z if keep and transform.kind == "final_logit_softcapping" else None), wide, z.dtype


def _chunk_sum(h: torch.Tensor, params: Sequence[torch.Tensor], transform: _Transform,
               labels: torch.Tensor) -> torch.Tensor:
    """The cross-entropy SUM of one chunk ``h [c, H]``, ``labels [c]`` (``IGNORE_INDEX`` rows count 0):
    ``logsumexp - target`` with the logits' one wide copy turned into ``exp(x - max)`` in place (F.cross_entropy
    would hold a second ``[c, V]`` fp32 tensor, its log-softmax)."""
    _, p, _ = _wide_logits(h, params, transform)
    valid = labels != IGNORE_INDEX
    target = p.gather(1, labels.masked_fill(~valid, 0)[:, None])  # other negative labels: out of range
    top = p.amax(-1, keepdim=True)
    lse = p.sub_(top).exp_().sum(-1, keepdim=True).log_().add_(top)
    return torch.where(valid, (lse - target).squeeze(1), 0).sum()


def _chunk_grad(h: torch.Tensor, params: Sequence[torch.Tensor], transform: _Transform, labels: torch.Tensor,
                scale: torch.Tensor) -> torch.Tensor:
    """``scale * d(chunk sum)/dz`` for the head's output ``z`` of one chunk, in ``z``'s dtype: ``softmax -
    onehot`` on labelled rows, 0 on the others, made in place in the logits' one wide copy (autograd's
    log-softmax and nll backward would hold two more ``[c, V]`` fp32 tensors)."""
    z, p, dtype = _wide_logits(h, params, transform, keep=True)
    ignored = labels == IGNORE_INDEX
    p.sub_(p.amax(-1, keepdim=True)).exp_()
    p.div_(p.sum(-1, keepdim=True))
    p.scatter_add_(1, labels.masked_fill(ignored, 0)[:, None], p.new_full((p.shape[0], 1), -1.0))
    p.mul_(scale.to(p.dtype)).masked_fill_(ignored[:, None], 0)
    grad = p.to(dtype)
    del p  # (unless it is grad itself) before the softcap's backward makes its [c, V] slope
    return transform.backward(z, grad)


class _ChunkedHeadLoss(torch.autograd.Function):
    """``sum_t CE(transform(linear(hidden[t])), labels[t])`` over chunks of ``chunk`` rows, keeping no logits.

    Inputs: ``hidden [T, H]``, ``labels [T]``, ``chunk``, ``transform``, ``kept`` (the model's own
    logits: their gradient is None, but their backward hooks run, FSDP2's and DDP's among them) and the
    head's parameters (inputs, so autograd, DDP and FSDP2 see their gradients).

    Backward, per chunk: the head's output ``z`` again, its gradient ``dz`` (:func:`_chunk_grad`), then
    what ``nn.Linear``'s backward computes: ``dz @ W`` for the chunk's hidden rows, ``dz.T @ h`` (summed
    into one tensor of the weight's dtype with ``addmm_``, no ``[V, H]`` temporary per chunk) and ``dz.sum(0)``."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, labels: torch.Tensor, chunk: int, transform: _Transform,
                kept: torch.Tensor | None, *params: torch.Tensor) -> torch.Tensor:
        device = hidden.device.type
        # The backward recomputes under the forward's autocast state, so its logits are the forward's.
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.chunk, ctx.transform = chunk, transform
        ctx.save_for_backward(hidden, labels, *params)
        total = None
        for start in range(0, hidden.shape[0], chunk):
            part = _chunk_sum(hidden[start:start + chunk], params, transform, labels[start:start + chunk])
            total = part if total is None else total + part
        if total is None:
            raise ValueError(f"lm_loss needs at least one token, got hidden states of shape {tuple(hidden.shape)}")
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        hidden, labels, *params = ctx.saved_tensors
        want_h = ctx.needs_input_grad[0]
        want = [ctx.needs_input_grad[5 + i] for i in range(len(params))]
        grad_hidden = torch.empty_like(hidden) if want_h else None
        acc: list[torch.Tensor | None] = [None] * len(params)
        device, enabled, dtype = ctx.autocast
        weight = None  # the weight the linear multiplied by (autocast casts it), made once
        if want_h or any(want):
            for start in range(0, hidden.shape[0], ctx.chunk):
                h = hidden[start:start + ctx.chunk]
                with torch.autocast(device, dtype=dtype, enabled=enabled):
                    dz = _chunk_grad(h, params, ctx.transform, labels[start:start + ctx.chunk], grad_total)
                if grad_hidden is not None:  # want_h
                    weight = params[0].to(dz.dtype) if weight is None else weight
                    grad_hidden[start:start + ctx.chunk] = torch.mm(dz, weight)
                _accumulate(acc, want, dz, h.to(dz.dtype), params)  # h as the linear took it (autocast casts)
        grad_params = [None if a is None else a.to(p.dtype) for a, p in zip(acc, params)]
        return (grad_hidden, None, None, None, None, *grad_params)


def _accumulate(acc: list, want: list, dz: torch.Tensor, h: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
    """Add one chunk's weight (``dz.T @ h``) and bias (``dz.sum(0)``) gradients into ``acc``, in the
    parameters' dtypes."""
    if want[0]:
        if acc[0] is None:
            acc[0] = torch.mm(dz.t(), h).to(params[0].dtype)
        elif dz.dtype == acc[0].dtype:
            acc[0].addmm_(dz.t(), h)
        else:  # autocast: computed in its dtype, summed in the weight's
            acc[0].add_(torch.mm(dz.t(), h))
    if len(params) > 1 and want[1]:
        part = dz.sum(0)
        acc[1] = part.to(params[1].dtype) if acc[1] is None else acc[1].add_(part)


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
    if isinstance(n, torch.Tensor):  # its value: checked in the one all-reduce (no host sync on a GPU)
        if n.numel() != 1 or n.dtype == torch.bool or n.is_complex():
            raise ValueError(f"num_items_in_batch must be a number or a one-element real tensor, got a tensor of "
                             f"shape {tuple(n.shape)} ({n.dtype})")
    elif isinstance(n, bool) or not isinstance(n, (int, float)) or not (n > 0 and math.isfinite(n)):
        raise ValueError(f"num_items_in_batch must be a positive number (the batch's label tokens, finite) or None, "
                         f"got {n!r}")


def _bad_count(n: Any, like: torch.Tensor) -> torch.Tensor:
    """1 if ``n`` is a tensor holding a zero, negative or non-finite count, else 0, 0-d like ``like``, with
    no host sync (a CPU tensor is read on the host; a device tensor is compared there, never copied out)."""
    zero = like.new_zeros(())
    if not isinstance(n, torch.Tensor):
        return zero
    bad = ~((n > 0) & n.isfinite()).reshape(())
    return zero + bool(bad) if bad.device.type == "cpu" else bad.to(zero)


def _hooks(module: torch.nn.Module) -> list[str]:
    """What runs when ``module`` is called besides ``type(module).forward``: its forward, pre-forward and
    backward hooks (FSDP2's own, which only gather and free the parameters, excepted) and a ``forward``
    set on the instance (accelerate's hooks), each named."""
    own = vars(module).get("forward")
    found = [f"a forward replaced on the instance ({getattr(own, '__qualname__', own)!r})"] if own else []
    for kind, hooks in (("forward pre-hook", module._forward_pre_hooks), ("forward hook", module._forward_hooks),
                        ("backward pre-hook", module._backward_pre_hooks), ("backward hook", module._backward_hooks)):
        for hook in hooks.values():
            if not (getattr(hook, "__module__", None) or "").startswith("torch.distributed.fsdp."):
                found.append(f"{kind} {getattr(hook, '__qualname__', None) or hook!r}")
    return found


_row_generators: dict = {}  # device -> lm_loss's own generator: the caller's random streams stay untouched


def _rows_to_check(seq: int, device: torch.device) -> torch.Tensor:
    """``logits_to_keep`` for the model: the last position and one drawn from the others, on ``device``
    (no host sync), by lm_loss's own generator, seeded alike on every rank: every rank draws alike."""
    last = torch.full((1,), seq - 1, dtype=torch.long, device=device)
    if seq < 2:
        return last
    gen = _row_generators.get(device)
    if gen is None:
        try:
            gen = torch.Generator(device=device)
        except RuntimeError:  # a device without generators of its own: draw on the host
            gen = torch.Generator()
        _row_generators[device] = gen.manual_seed(20240521)
    other = torch.randint(0, seq - 1, (1,), generator=gen, device=gen.device)
    return torch.cat([other.to(device), last])


def _run_model(model: torch.nn.Module, decoder: torch.nn.Module, local: Mapping[str, Any], rows: torch.Tensor):
    """``model(**model_inputs(local), logits_to_keep=rows)`` and the decoder's last hidden state ``[B, S, H]``."""
    captured: list[torch.Tensor] = []

    def capture(module, args, output):
        captured.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

    inputs = model_inputs(local)
    inputs.setdefault("use_cache", False)  # no KV cache: it would only hold memory in training
    handle = decoder.register_forward_hook(capture)
    try:
        out = model(**inputs, logits_to_keep=rows)  # the head computes these rows of each sequence only
    finally:
        handle.remove()
    if len(captured) != 1:
        raise RuntimeError(f"lm_loss expected the decoder {type(decoder).__name__} to run once in the model's "
                           f"forward, it ran {len(captured)} times")
    logits = out.logits if hasattr(out, "logits") else out[0]
    return captured[0], logits


def lm_loss(model: torch.nn.Module, local: dict[str, Any], group=None, chunk_tokens: int = 1024,
            num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
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
    whose parameters are still sharded (an FSDP-wrapped head) and, after the one all-reduce, for a head
    with hooks on any rank (named where they are); ``ValueError`` for a tensor ``num_items_in_batch``
    that is not positive and finite on any rank; ``RuntimeError`` if the head lm_loss applies differs
    from the model's own logits on any rank.
    """
    _check_arguments(local, chunk_tokens, num_items_in_batch)
    inner = cast("PreTrainedModel", _unwrap(model))  # head_kind refuses any class but transformers' causal LMs
    kind = head_kind(inner)
    head_module = inner.get_output_embeddings()
    hooks = _hooks(head_module)  # refused after the all-reduce: another rank may have none, and must raise too
    rows = _rows_to_check(local["shift_labels"].shape[1], head_module.weight.device)
    hidden, kept = _run_model(model, inner.get_decoder(), local, rows)
    params = [p for p in (head_module.weight, head_module.bias) if p is not None]
    if any(type(p).__name__ == "DTensor" for p in params):
        raise NotImplementedError(
            f"{type(inner).__name__}'s output embedding is still sharded after the forward (fully_shard applied "
            "to it with reshard_after_forward=True?); lm_loss needs its full weight: leave it to the root "
            "module, as parallelize does")
    transform = _Transform(inner, kind)
    with torch.no_grad():  # the same rows, the same shapes: the model's own logits, bit for bit
        mine = transform(_linear(hidden[:, rows.to(hidden.device)], params))
        if mine.shape != kept.shape:
            raise RuntimeError(f"{type(inner).__name__} returned logits of shape {tuple(kept.shape)} for "
                               f"logits_to_keep={rows.numel()} positions, expected {tuple(mine.shape)}")
        differ = ((mine != kept) & ~(mine.isnan() & kept.isnan())).any()
    labels = local["shift_labels"].to(hidden.device)
    local_sum = _ChunkedHeadLoss.apply(hidden.flatten(0, 1), labels.flatten(), chunk_tokens, transform, kept,
                                      *params)
    count = (labels != IGNORE_INDEX).sum().double()
    stats = torch.stack([local_sum.detach().double(), count, differ.double(), count.new_zeros(()) + bool(hooks),
                         _bad_count(num_items_in_batch, count)])
    # one collective: [sum, count, ranks whose rows differ, ranks with hooks on the head, ranks with a bad n]
    transport_for(mesh_group(group)).all_reduce_sum_(stats)
    mismatches, hooked, bad = (int(x) for x in stats[2:].tolist())  # the call's one host sync: a verdict alike
    if hooked:
        raise NotImplementedError(
            f"lm_loss cannot run the hooks on {type(inner).__name__}'s output embedding "
            f"({type(head_module).__name__}) on {hooked} rank(s)" + (f", here: {'; '.join(hooks)}" if hooks else "")
            + ": it applies the head itself over chunks of tokens, so what they do to the logits or their "
            "gradients would be lost. Remove them (handle.remove()), or compute the loss with "
            "causal_lm_loss(model(**model_inputs(local)).logits, local['shift_labels'], group=...)")
    if bad:
        raise ValueError(
            f"num_items_in_batch must be positive and finite (the number of label tokens the loss's sum is divided "
            f"by), got {num_items_in_batch!r} here, and a zero, negative or non-finite count on {bad} rank(s); "
            "pass the batch's count of labels other than -100, or None for the mean")
    if mismatches:  # every rank holds the same sums, so every rank raises alike
        raise RuntimeError(
            f"lm_loss's LM head differs from {type(inner).__name__}'s own logits (on {mismatches} rank(s)); "
            "its forward does something to the logits lm_loss does not: compute the loss with "
            "causal_lm_loss(model(**model_inputs(local)).logits, ...) and report it to cp_attention")
    total = stats[0].to(local_sum.dtype)
    denominator: torch.Tensor | float
    if num_items_in_batch is None:
        denominator = stats[1].clamp_min(1).to(local_sum.dtype)
    elif isinstance(num_items_in_batch, torch.Tensor):
        denominator = num_items_in_batch.to(device=local_sum.device, dtype=local_sum.dtype).reshape(())
    else:
        denominator = num_items_in_batch
    # The value is exactly the reduced total on every rank (x - x == 0); the gradient is this rank's share.
    return (total + (local_sum - local_sum.detach())) / denominator
