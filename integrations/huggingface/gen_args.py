"""The arguments of one :func:`~.generation.generate` call: what the sharded cache cannot serve, and
fingerprints of every argument's VALUE, agreed across the group before the prefill.

transformers merges the keyword arguments, ``generation_config`` and ``model.generation_config`` into
the generation config it decodes with; :func:`effective_config` makes the same merge, so a refusal
sees what would really run (``GenerationConfig(use_cache=False)`` as well as ``use_cache=False``) and
ranks that spell the same call differently agree. :func:`named_fingerprints` gives each argument (each
field of that config, each other keyword, the prompt) a 64-bit digest of its value, never of its
identity (objects live at other addresses in other processes). One digest of them all travels in the
agreement every generate call makes anyway; only when it differs does :func:`differing_arguments` run
a second exchange of the per-argument digests, to name what differs on which ranks.
"""

from __future__ import annotations

import enum
import hashlib
import types
from typing import TYPE_CHECKING, Any, Mapping

import torch

from cp_attention.checks.codec import Codec, Field, agree_rows, decode_text, encode_text
from cp_attention.transport import transport_for

from .batch import batch_fingerprint

if TYPE_CHECKING:  # transformers is the hf extra's: imported where generate runs, so a missing extra is named
    from transformers import GenerationConfig

__all__ = ["GENERATE_PARAMETERS", "effective_config", "refused_option", "named_fingerprints", "digest",
           "differing_arguments"]

# transformers' generate parameters that are not generation options (the rest of **kwargs are)
GENERATE_PARAMETERS = ("generation_config", "logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn",
                       "synced_gpus", "assistant_model", "streamer", "negative_prompt_ids",
                       "negative_prompt_attention_mask", "custom_generate")
_SUPPORTED_MODES = ("greedy_search", "sample", "beam_search", "beam_sample")  # GenerationMode values
# generation options (fields of the merged config) whose decoding a sharded cache cannot serve, and why
_REFUSED_OPTIONS = {
    "output_attentions": "the attention weights (ring attention never holds them)",
    "output_hidden_states": "every layer's hidden states of the whole prompt (each rank holds its shard only)",
    "prompt_lookup_num_tokens": "prompt-lookup decoding (it crops the cache)",
    "penalty_alpha": "contrastive search (it crops the cache)",
    "prefill_chunk_size": "chunked prefill (the prefill is sharded instead)",
    "cache_implementation": "another cache (generation uses the sharded KV cache)",
    "max_time": "a time limit (each rank's own clock could stop it at a step of its own, and its peers would wait)",
    "guidance_scale": "classifier-free guidance (it runs the model again per step outside the sharded cache)",
}
_WHERE = "(a generate keyword, or a field of generation_config or model.generation_config)"
NAMES_BYTES = 16384  # the second exchange's payload per rank (only when the ranks' arguments differ)
_NAMES = Codec(Field("names", NAMES_BYTES // 8, label="generate arguments"))


def effective_config(model: Any, generate_kwargs: Mapping[str, Any]) -> tuple[GenerationConfig, dict[str, Any]]:
    """The generation config ``model.generate(**generate_kwargs)`` decodes with, and the keyword arguments
    left for the model (as transformers' own ``_prepare_generation_config`` merges them)."""
    options = {k: v for k, v in generate_kwargs.items() if k not in GENERATE_PARAMETERS}
    return model._prepare_generation_config(generate_kwargs.get("generation_config"), **options)


def refused_option(config: GenerationConfig, assistant_model: Any) -> str | None:
    """Why the merged ``config`` asks for what context-parallel generate cannot do, or None."""
    if config.use_cache is False:
        return (f"use_cache=False {_WHERE}: context-parallel generation decodes from its sharded KV cache; "
                "expected use_cache=True or unset: drop use_cache=False")
    refused = [name for name in _REFUSED_OPTIONS if getattr(config, name, None) not in (None, False)
               and not (name == "guidance_scale" and config.guidance_scale == 1)]
    if refused:
        what = "; ".join(f"{name}={getattr(config, name)!r}: {_REFUSED_OPTIONS[name]}" for name in refused)
        return f"context-parallel generate does not support {what}; drop {', '.join(refused)} {_WHERE}"
    mode = config.get_generation_mode(assistant_model)
    if mode.value not in _SUPPORTED_MODES:
        names = ", ".join(_SUPPORTED_MODES)
        return (f"context-parallel generate does not support the generation mode {mode.value!r} (set by the "
                f"generation options {_WHERE}); expected one of {names}: use greedy search, sampling or beam search")
    return None


def named_fingerprints(arguments: Mapping[str, Any], config: GenerationConfig) -> dict[str, tuple[int, str]]:
    """``{name: (digest of its value, its value shown briefly)}`` for every argument and every field of
    the merged generation ``config`` (named by the field)."""
    named = {**config.to_dict(), **arguments}
    return {name: (digest(_canonical(value)), _shown(value)) for name, value in named.items()}


def digest(text: str) -> int:
    """A signed 64-bit digest of ``text``, the same in every process (unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def _canonical(value: Any, depth: int = 0) -> str:
    """``value`` as text that depends on its value only: plain values, tensors (their bits), containers,
    and other objects as their type and their public attributes (a few levels deep); never an address."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.dtype, torch.device, enum.Enum)):
        return repr(value)
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}{value.dtype}{batch_fingerprint({'t': value})}"
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
        return f"function {value.__module__}.{value.__qualname__}"
    if isinstance(value, types.MethodType):
        return f"method {value.__func__.__qualname__} of {_canonical(value.__self__, depth + 1)}"
    if isinstance(value, torch.nn.Module) or depth > 3:  # a model's weights are not compared
        return kind
    from transformers import GenerationConfig

    if isinstance(value, GenerationConfig):
        return f"{kind}{_canonical(value.to_dict(), depth)}"
    if isinstance(value, Mapping):
        items = sorted(f"{_canonical(k, depth + 1)}:{_canonical(v, depth + 1)}" for k, v in value.items())
        return f"{kind}{{{','.join(items)}}}"
    if isinstance(value, (list, tuple)):
        return f"{kind}[{','.join(_canonical(v, depth + 1) for v in value)}]"
    if isinstance(value, (set, frozenset)):
        return f"{kind}{{{','.join(sorted(_canonical(v, depth + 1) for v in value))}}}"
    if hasattr(value, "__dict__"):  # its private state (locks, queues, caches) says nothing of the call
        public = {k: v for k, v in vars(value).items() if not k.startswith("_")}
        return f"{kind}({_canonical(public, depth + 1)})"
    return kind


def _shown(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor {tuple(value.shape)}"
    if value is None or isinstance(value, (bool, int, float, str, list, tuple, dict)):
        text = repr(value)
        return text if len(text) <= 48 else text[:45] + "..."
    return f"a {type(value).__name__}"


def differing_arguments(group: Any, named: Mapping[str, tuple[int, str]]) -> str:
    """Which arguments differ between the ranks of ``group`` and how, as text (the same on every rank):
    one all-gather of every rank's ``named`` fingerprints. Every rank must call it (they do when the
    agreed digest of their arguments differs)."""
    lines = "".join(f"{name}\t{code}\t{' '.join(shown.split())}\n" for name, (code, shown) in sorted(named.items()))
    rows = agree_rows(transport_for(group), _NAMES, {"names": encode_text(lines, NAMES_BYTES // 8)})
    seen = []
    for row in rows:
        entries = decode_text(row["names"]).split("\n")[:-1]  # a line cut by the size limit is dropped
        seen.append({name: (code, shown) for name, code, shown in (e.split("\t", 2) for e in entries)})
    parts = []
    for name in sorted(set().union(*seen)):
        values = [rank_seen.get(name) for rank_seen in seen]
        if len({v[0] if v else None for v in values}) > 1:
            by_value: dict[tuple[str, str], list[int]] = {}  # ranks by value (equal shown texts may differ)
            for rank, v in enumerate(values):
                by_value.setdefault(v if v else ("", "not passed"), []).append(rank)
            shown_alike = len({shown for _, shown in by_value}) < len(by_value)  # tensors of one shape
            parts.append(f"{name} (" + "; ".join(
                f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {shown}"
                + (f" of fingerprint {int(code) & 0xFFFFFFFF:08x}" if shown_alike and code else "")
                for (code, shown), r in by_value.items()) + ")")
    return ", ".join(parts) if parts else "(too many arguments to name which)"
