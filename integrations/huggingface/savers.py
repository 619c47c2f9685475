"""Memory savers on a HuggingFace causal LM: :func:`save_memory` (re-exported by
:mod:`cp_attention.integrations.huggingface`).

Three savers, for the activations that grow with the sequence (see ``cp_attention.memory``):

- ``checkpoint=True``: transformers' activation checkpointing (non-reentrant) on every decoder layer: a
  layer keeps only its input (``S x hidden``) and runs again in backward;
- ``checkpoint="offload"``: the same, and that input waits in (pinned) host memory between the forward
  and the backward, copied out on a side stream with no host sync (``memory.offload_checkpoint``);
- ``mlp_chunks=n``: ALST's TiledMLP: each decoder layer's MLP, and its RMSNorms, run over ``n`` chunks of the
  sequence, and only their input is kept for the backward, which recomputes them chunk by chunk
  (``memory.tiled_apply``). HF's RMSNorms upcast to fp32 and save that; their backward makes several more
  fp32 copies of the whole local sequence: with the other savers on, the largest block of a layer's backward.
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, cast

import torch

from cp_attention.memory import offload_checkpoint, tiled_apply

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["save_memory", "checkpoint_activations", "check_savers"]

_CHUNKS = "_cp_mlp_chunks"  # on a tiled MLP: its chunk count
_INNER = "_cp_mlp_inner_forward"  # on a tiled MLP: the instance-level forward it had before (or None)


def checkpoint_activations(model: torch.nn.Module) -> None:
    """Turn on transformers' activation checkpointing (non-reentrant) on ``model``: each decoder layer
    runs again in backward, reusing its forward's attention plan (see ``.checks.ForwardChecks``). Sets
    every layer's checkpoint function anew, so it also undoes an earlier offload."""
    model = cast("PreTrainedModel", model)  # transformers' model: its config and checkpointing methods
    model.config.use_cache = False  # training reads no KV cache; transformers warns on every forward else
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x; the older name is deprecated
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _disable_checkpointing(model: torch.nn.Module) -> None:
    model = cast("PreTrainedModel", model)  # save_memory checked supports_gradient_checkpointing
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """transformers' checkpointable decoder layers of ``model`` (``GradientCheckpointingLayer``)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _recorded_classes(model: torch.nn.Module) -> dict[type, str]:
    """The module classes whose outputs transformers records per call (``_can_record_outputs``: router
    logits, attention weights, ...) -> what it records them as."""
    found: dict[type, str] = {}
    for m in model.modules():
        for key, spec in (getattr(m, "_can_record_outputs", None) or {}).items():
            target = getattr(spec, "target_class", spec)
            if isinstance(target, type):
                found[target] = key
    return found


def _mlp_problem(layer: torch.nn.Module, recorded: dict[type, str]) -> str | None:
    """Why ``layer``'s MLP cannot run over sequence chunks exactly, or None."""
    name = type(layer).__name__
    mlp = getattr(layer, "mlp", None)
    if not isinstance(mlp, torch.nn.Module):
        return f"{name} has no .mlp module to run over sequence chunks"
    for sub_name, sub in mlp.named_modules():
        where = f"{name}.mlp{'.' + sub_name if sub_name else ''} ({type(sub).__name__})"
        if type(sub) in recorded:
            # MoE blocks: their router's logits are recorded (and feed the aux loss); chunked, they would be
            # recorded once per chunk, without gradient. Routing can also be capacity-limited or jittered.
            return (f"{where} is a module whose outputs transformers records as {recorded[type(sub)]!r}: a "
                    "mixture-of-experts block, which mlp_chunks does not tile (only per-token dense MLPs are exact)")
        if isinstance(sub, torch.nn.modules.dropout._DropoutNd) and sub.p > 0:
            return f"{where} has dropout p={sub.p}: its recompute in backward would draw other masks"
    return None


def _tiled_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """A tiled MLP's (or RMSNorm's) forward: its former forward over ``self._cp_mlp_chunks`` sequence chunks."""
    inner = getattr(self, _INNER) or types.MethodType(type(self).forward, self)
    # the parameters now (FSDP2: the unsharded ones, the same objects its backward unshards again)
    return tiled_apply(inner, hidden_states, tuple(self.parameters()), getattr(self, _CHUNKS), dim=-2,
                       name=f"{type(self).__name__}.forward")


def _set_chunks(mlp: torch.nn.Module, chunks: int | None) -> None:
    tiled = _CHUNKS in mlp.__dict__
    if chunks is None:
        if tiled:
            inner = mlp.__dict__.pop(_INNER)
            del mlp.__dict__[_CHUNKS], mlp.__dict__["forward"]
            if inner is not None:
                mlp.forward = inner
        return
    if not tiled:
        mlp.__dict__[_INNER] = mlp.__dict__.get("forward")  # e.g. a hook library's wrapper: kept inside
        mlp.forward = types.MethodType(_tiled_forward, mlp)
    mlp.__dict__[_CHUNKS] = chunks


def check_savers(checkpoint: bool | str, mlp_chunks: int | None,
                 names: tuple[str, str] = ("checkpoint", "mlp_chunks")) -> None:
    """Refuse memory-saver values :func:`save_memory` cannot take: ``checkpoint`` must be True, False or
    ``"offload"``, ``mlp_chunks`` None or an int >= 1. ``names``: how the caller calls the two (an
    argument, a config key). Raises ``ValueError`` naming the argument (pure: alike on every rank)."""
    if not (checkpoint is True or checkpoint is False or (isinstance(checkpoint, str) and checkpoint == "offload")):
        raise ValueError(f"{names[0]}={checkpoint!r}: expected True (recompute each decoder layer in backward), "
                         "'offload' (and hold its saved input in CPU memory) or False")
    if mlp_chunks is not None and (isinstance(mlp_chunks, bool) or not isinstance(mlp_chunks, int) or mlp_chunks < 1):
        raise ValueError(f"{names[1]}={mlp_chunks!r}: expected None (the MLP over the whole sequence at once) or an "
                         "int >= 1, the sequence chunks each decoder layer's MLP runs over (e.g. 4)")


def save_memory(model: torch.nn.Module, checkpoint: bool | str = True,
                mlp_chunks: int | None = None) -> torch.nn.Module:
    """Put memory savers on a HuggingFace causal LM (before or after ``apply_context_parallel``, before
    FSDP2 or DDP wraps it); returns ``model``. Exact: the loss and the gradients are those without savers
    (up to floating-point reordering in the tiled MLP's matmuls).

    ``checkpoint``: ``True`` recomputes each decoder layer in backward (transformers' activation
    checkpointing, non-reentrant); ``"offload"`` also keeps each layer's saved input in pinned host memory
    until its recompute (CUDA: copies on a side stream, no host sync; on the CPU a plain copy);
    ``False`` turns checkpointing off. ``mlp_chunks``: run each decoder layer's MLP and RMSNorms over that many chunks
    of the sequence, keeping only its input for the backward (ALST's TiledMLP); ``None``: untiled.

    Each call states the whole set: ``save_memory(model, checkpoint=False)`` leaves no saver on (nor a
    checkpointing turned on before by other means), calling it again with the same arguments changes nothing.

    Raises, changing nothing: ``ValueError`` for a ``checkpoint`` other than True, False or "offload", an
    ``mlp_chunks`` other than None or a positive int, a model that cannot checkpoint activations when asked
    to, or (``mlp_chunks``) a model without decoder layers or with a decoder layer whose MLP is no per-token
    dense MLP: a mixture-of-experts block (gpt-oss, Qwen2-MoE, Mixtral: their router logits are recorded per
    call and routing may be capacity-limited), an MLP with dropout, or one missing. At the first forward:
    ``TypeError``/``ValueError`` if a tiled MLP returns anything but one tensor of its input's shape.
    """
    check_savers(checkpoint, mlp_chunks)
    layers = _decoder_layers(model)
    if checkpoint is not False and not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"save_memory(checkpoint={checkpoint!r}): {type(model).__name__} does not support "
                         "transformers' activation checkpointing; pass checkpoint=False")
    if mlp_chunks is not None:
        if not layers:
            raise ValueError(f"save_memory(mlp_chunks={mlp_chunks}): {type(model).__name__} has no transformers "
                             "decoder layers (GradientCheckpointingLayer) whose MLP to tile; pass mlp_chunks=None")
        recorded = _recorded_classes(model)
        problems = sorted({p for p in (_mlp_problem(layer, recorded) for layer in layers) if p is not None})
        if problems:
            raise ValueError(f"save_memory(mlp_chunks={mlp_chunks}) cannot tile this model's MLPs exactly: "
                             f"{'; '.join(problems)}. Pass mlp_chunks=None")
    if checkpoint is False:
        if getattr(model, "supports_gradient_checkpointing", False):
            _disable_checkpointing(model)
    else:
        checkpoint_activations(model)
        if checkpoint == "offload":
            for layer in layers:
                # a plain attribute; torch's stubs type Module.__setattr__ for tensors and submodules only
                layer._gradient_checkpointing_func = offload_checkpoint  # type: ignore[assignment]
    for layer in layers:
        for module in _per_token_parts(layer):
            _set_chunks(module, mlp_chunks)
    return model


def _fp32_weight(cls: type[torch.nn.Module]) -> bool:
    """Whether a norm class casts its weight to fp32 in forward (Gemma's ``1 + self.weight.float()``): its
    weight's gradient is then an fp32 sum over the tokens, which chunks would round differently (1e-7
    relative even in an fp64 model), so such a norm stays whole."""
    import inspect
    import re

    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return True  # unknown: keep it whole
    return re.search(r"self\.weight\.(float\(|to\(torch\.float32)", source) is not None


def _per_token_parts(layer: torch.nn.Module) -> list[torch.nn.Module]:
    """The parts of a decoder layer ``mlp_chunks`` runs over sequence chunks: its ``mlp`` and its own
    RMSNorms (direct children; HF's upcast their input to fp32 and save it, and their backward makes
    several more fp32 copies: at Llama-3-8B's width the largest block of a layer's backward once the
    other savers are on). Both treat each token alone, so their chunks are exact."""
    parts = [m for m in layer.children() if type(m).__name__.endswith("RMSNorm") and not _fp32_weight(type(m))]
    mlp = getattr(layer, "mlp", None)
    return parts + [mlp] if isinstance(mlp, torch.nn.Module) else parts
