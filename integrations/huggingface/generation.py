"""``generate`` on a context-parallel HuggingFace model: sharded prefill, sharded KV cache, pass-Q decoding.

:func:`generate` runs transformers' own ``generate`` (greedy, beam search, sampling, logits processors,
stopping criteria, scores) with a :func:`~.kvcache.sharded_cache` and this module's hooks:

- prefill: the model's forward pre-hook swaps the prompt batch for this rank's shard of ONE packed
  stream (each row's real tokens a document, left padding dropped, one padding document up to the
  layout's divisor), which the ring attends exactly; each layer's cache keeps this rank's tokens per
  row. Only the rows' last tokens reach the LM head (``logits_to_keep``), and one all-reduce gives every
  rank the ``[B, 1, V]`` logits;
- decoding: every rank runs the new token (it is tiny); each attention layer attends it to this rank's
  share of the cache and merges the ranks' partial results by log-sum-exp in one small all-gather
  (:func:`cp_attention.engine.decode.decode_attention`); the new token's K/V stay on rank ``step mod N``.

Every rank computes the same logits bit for bit, so greedy and beam search pick the same token; a sampled
token is drawn on group rank 0 and shared (:mod:`.gen_draws`), whatever the other ranks' generators
hold. Before the prefill, every argument's value (the generation config transformers would merge from
the keywords, ``generation_config`` and ``model.generation_config`` included) is agreed across the group,
and what the sharded cache cannot serve is refused on every rank alike (:mod:`.gen_args`). The state
of a generation is per thread (a loopback rank is a thread): :mod:`.gen_state`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, cast

import torch

import cp_attention as cpa
from cp_attention.checks.verdicts import agree
from cp_attention.engine.decode import decode_attention
from cp_attention.layouts.documents import cu_seqlens_from_lengths, document_position_ids, pad_cu_seqlens
from cp_attention.transport import group_rank_and_size, transport_for
from cp_attention.transport.process_group import group_token

from .gen_args import (
    GENERATE_PARAMETERS,
    differing_arguments,
    digest,
    effective_config,
    named_fingerprints,
    refused_option,
)
from .gen_draws import shared_draws
from .gen_state import running

if TYPE_CHECKING:
    from transformers import GenerationMixin, PreTrainedModel

__all__ = ["generate", "Generation"]

_KINDS = (ValueError, NotImplementedError)
# generate keyword arguments (not generation options) that would need what a sharded cache cannot give
_REFUSED = {
    "assistant_model": "assisted decoding (it crops the cache)",
    "custom_generate": "a decoding loop of its own (the sharded cache serves transformers' greedy, sampling and "
                       "beam search loops)",
    "past_key_values": "a cache of your own (generation uses the sharded KV cache)",
    "cache": "a cache of your own (generation uses the sharded KV cache)",
    "inputs_embeds": "prompts as embeddings (pass input_ids)",
    "logits_to_keep": "logits_to_keep (generation keeps the last token's logits itself)",
}
_NOTE = "(on rank {first}; ranks refused: {bad})"


class Generation:
    """One :func:`generate` call on one rank: its cache, and where the prefill's last tokens are."""

    def __init__(self, state: Any, cache: Any) -> None:
        self.state, self.cache = state, cache
        self.transport = transport_for(state.group)
        self.prefilled = False
        self.step = -1  # decoding steps so far (the first is 0)
        self._logit_rows: torch.Tensor | None = None
        self.batch = 0

    def keeps_new_token(self) -> bool:
        """Whether this rank caches the current step's token (one rank per step, in turn)."""
        return self.step % self.state.world_size == self.state.rank

    def prefill_inputs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The prefill forward's keyword arguments for this rank: its shard of the packed prompt."""
        ids, mask = kwargs["input_ids"], kwargs.get("attention_mask")
        b, s = ids.shape
        if mask is not None and _left_padding_problem(mask) is not None:
            # transformers infers a mask from pad_token_id when none is given: the same on every rank
            raise ValueError(f"the prompt's attention mask (given, or inferred by transformers from pad_token_id) "
                             f"{_left_padding_problem(mask)}")
        lengths = [s] * b if mask is None else [int(n) for n in mask.sum(1).tolist()]
        pads = [s - n for n in lengths]
        layout, rank, world = self.state.layout, self.state.rank, self.state.world_size
        cu, pad = pad_cu_seqlens(cu_seqlens_from_lengths(lengths), layout.divisor(world))
        total, device = cu[-1], ids.device
        stream = torch.cat([ids[r, pads[r]:] for r in range(b)] + [ids.new_zeros(pad)])
        # One prompt needs no documents: its padding comes after every real token, which a causal
        # query never sees, so the plain (faster) schedules run it.
        documents = cu if b > 1 else None
        held = layout.positions(total, rank, world, cu_seqlens=documents)  # stream indices, increasing
        bounds = torch.tensor(cu)
        row = torch.searchsorted(bounds[1:], held, right=True)  # b for the padding document
        real = row < b
        index_in_row = held - bounds[row.clamp(max=b - 1)] + torch.tensor(pads)[row.clamp(max=b - 1)]
        per_row = [torch.nonzero((row == r) & real).flatten() for r in range(b)]
        width = max(1, max(len(p) for p in per_row))
        rows_index = torch.zeros(b, width, dtype=torch.long)
        positions = torch.full((b, width), -1, dtype=torch.long)
        for r, picked in enumerate(per_row):
            rows_index[r, :len(picked)] = picked
            positions[r, :len(picked)] = index_in_row[picked]
        for layer in self.cache.layers:
            layer.start(rows_index.to(device), positions.to(device), s)
        last = real & (held == bounds[(row + 1).clamp(max=b)] - 1)  # a row's last token
        self._logit_rows = row[last].to(device)
        self.batch = b
        local: dict[str, Any]  # tensors, and the ints max_length_q/k
        local = {"input_ids": stream[held.to(device)][None],
                 "position_ids": (held if documents is None else document_position_ids(held, cu)).to(device)[None],
                 "logits_to_keep": torch.nonzero(last).flatten().to(device)}
        if documents is not None:
            boundaries = torch.tensor(cu, dtype=torch.int32, device=device)
            longest = max(b_ - a for a, b_ in zip(cu, cu[1:]))
            local.update(cu_seq_lens_q=boundaries, cu_seq_lens_k=boundaries, max_length_q=longest,
                         max_length_k=longest)
        kept = {key: val for key, val in kwargs.items() if key not in ("attention_mask", "position_ids")}
        return {**kept, **local}

    def finish_prefill(self, output: Any) -> Any:
        """The prefill's output with every rank's ``[B, 1, V]`` logits of the rows' last tokens."""
        logits = output.logits
        full = logits.new_zeros(self.batch, 1, logits.shape[-1])
        full[self._logit_rows, 0] = logits[0]
        # one rank holds each row's last token, so the sum is that rank's logits, bit for bit
        output.logits = self.transport.all_reduce_sum_(full)
        self.prefilled = True
        return output

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               window: int | None, scaling: float | None, softcap: float | None,
               sinks: torch.Tensor | None) -> tuple[torch.Tensor, None]:
        """A decoding step's attention: ``query [B, H, 1, D]`` against every rank's share of this layer's
        cache (``key``/``value``: this rank's, the new token included if it keeps it) -> ``[B, 1, H, Dv]``."""
        if query.shape[2] != 1:
            raise NotImplementedError(f"decoding from the sharded KV cache takes one token per step, got "
                                      f"{query.shape[2]}")
        layer = self.cache.layers[module.layer_idx]
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        visible = layer.visible(None if window is None else window - 1)
        out, _ = decode_attention(query[:, :, 0], key, value, visible, self.transport, scale, softcap or 0.0, sinks)
        return out[:, None], None


def _problem(model: Any, state: Any, group: Any, layout: Any, input_ids: Any, attention_mask: Any,
             kwargs: dict[str, Any]) -> tuple[tuple[int, str] | None, dict[str, tuple[int, str]]]:
    """This rank's refusal of the call (an index into ``_KINDS`` and a message), or None and every argument's
    fingerprint (:func:`~.gen_args.named_fingerprints`)."""
    try:
        lay = cpa.get_layout(layout)
    except (ValueError, TypeError, KeyError) as e:
        return (0, f"generate got layout={layout!r}, which is not a layout: {e}"), {}
    if group_token(group) != group_token(state.group) or lay != state.layout:
        return (0, f"generate got group/layout {layout!r} other than the model was patched with "
                   f"({state.layout.name!r}); pass the ones given to apply_context_parallel"), {}
    refused = [name for name in _REFUSED if kwargs.get(name) not in (None, False)]
    if refused:
        what = "; ".join(f"{name}: {_REFUSED[name]}" for name in refused)
        return (1, f"context-parallel generate does not support {what}; drop {', '.join(refused)}"), {}
    try:  # what transformers would decode with: the keywords, generation_config and model.generation_config
        config, model_kwargs = effective_config(model, kwargs)
    except (ValueError, TypeError) as e:
        return (0, f"the generation options were refused by transformers: {e}"), {}
    why = refused_option(config, kwargs.get("assistant_model"))
    if why is not None:
        return (1, why), {}
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        return (0, "input_ids must be a [batch, seq] integer tensor (the whole prompt, the same on every rank)"), {}
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
            return (0, f"attention_mask must be a [batch, seq] tensor like input_ids {tuple(input_ids.shape)}"), {}
        problem = _left_padding_problem(attention_mask)
        if problem is not None:
            return (0, f"attention_mask {problem}"), {}
    if not model._supports_logits_to_keep():
        return (1, f"{type(model).__name__}.forward takes no logits_to_keep, which the sharded prefill needs"), {}
    arguments = {"input_ids": input_ids, "attention_mask": attention_mask, "layout": lay.name, **model_kwargs,
                 **{k: kwargs.get(k) for k in GENERATE_PARAMETERS if k != "generation_config"}}
    try:
        return None, named_fingerprints(arguments, config)
    except Exception as e:  # noqa: BLE001 - a rank leaving here would leave its peers waiting: refuse instead
        return (0, f"generate could not fingerprint its arguments to agree them across ranks: {e!r}"), {}


def _left_padding_problem(mask: torch.Tensor) -> str | None:
    """Why ``mask [B, S]`` is not left padding (each row zeros, then at least one 1), or None."""
    ones = mask.to(torch.long)
    if not bool(((ones == 0) | (ones == 1)).all()) or bool((ones[:, 1:] < ones[:, :-1]).any()) \
            or not bool(ones[:, -1].all()):
        return ("must hold left padding only (each row zeros, then at least one 1): set the tokenizer's "
                "padding_side='left' for generation, and pass attention_mask when pad_token_id occurs in the prompt")
    return None


def generate(model: torch.nn.Module, input_ids: torch.Tensor, group=None, layout: str | cpa.Layout = "zigzag",
             attention_mask: torch.Tensor | None = None, **generate_kwargs: Any) -> Any:
    """What ``model.generate(input_ids, attention_mask=..., **generate_kwargs)`` returns in one process
    without CP, on every rank alike, for a model patched by ``apply_context_parallel(model, group, layout)``.

    ``input_ids [B, S]`` is the whole prompt batch on every rank (left-padded as ``attention_mask``
    says); the prompt is sharded internally, whatever its length, and each rank keeps ~1/N of the KV
    cache. ``generate_kwargs`` are transformers' (greedy, beam search, sampling, logits processors,
    stopping criteria, ``generation_config``, ``output_scores``, ``return_dict_in_generate``...). Sampling
    draws from group rank 0's generator only; every rank gets its tokens.

    Raises ``ValueError`` for a model patched with another group or layout, arguments whose values differ
    between ranks (naming them and the ranks), or padding that is not left padding; ``NotImplementedError``
    naming a generation option the sharded cache cannot serve (``use_cache=False``, attention weights,
    hidden states, assisted, contrastive or group-beam decoding, another cache, ``max_time``), whether it
    comes as a keyword, in ``generation_config`` or from ``model.generation_config``. Raised on every rank
    alike, before the prefill.
    """
    state = getattr(model, "_cp_attention", None)
    _, world = group_rank_and_size(group)
    if state is None:
        if world == 1:  # apply_context_parallel leaves a world of one untouched
            return _class_generate(model)(model, input_ids, attention_mask=attention_mask, **generate_kwargs)
        unpatched = ("generate needs a model patched for context parallelism: call "
                     "apply_context_parallel(model, group=group, layout=layout) first")
        # agreed, so that ranks whose model is patched are not left waiting for this one
        agree(group, world, (0, unpatched), _KINDS, _NOTE, [0])
        raise _KINDS[0](unpatched)  # not reached: agree raised it on every rank
    problem, named = _problem(model, state, group, layout, input_ids, attention_mask, generate_kwargs)
    # One digest of every argument's value rides on the agreement; the names come only if it differs.
    header = [0] if problem else [digest(";".join(f"{k}={v[0]}" for k, v in sorted(named.items())))]
    headers = agree(state.group, state.world_size, problem, _KINDS, _NOTE, header)
    if len(set(headers)) > 1:  # every rank sees the same headers: all of them exchange the names
        raise ValueError(f"the ranks passed different generate arguments: {differing_arguments(state.group, named)}; "
                         "every rank must call generate with the same input_ids, attention_mask, layout, arguments "
                         "and generation config (model.generation_config included)")
    from .kvcache import sharded_cache

    gen = Generation(state, None)
    config = cast("PreTrainedModel", model).config  # the patched model is a transformers one
    gen.cache = sharded_cache(config.get_text_config().num_hidden_layers, gen.keeps_new_token)
    cache_name = "cache" if "cache" in _forward_parameters(model) else "past_key_values"
    with running(gen), shared_draws(model, gen.transport):  # sampled tokens: group rank 0's draws
        return _class_generate(model)(model, input_ids, attention_mask=attention_mask, **{cache_name: gen.cache},
                                      **generate_kwargs)


def _class_generate(model: torch.nn.Module) -> Callable[..., Any]:
    """The model class's own ``generate`` (apply_context_parallel replaces the instance's with a refusal)."""
    return cast("type[GenerationMixin]", type(model)).generate


def _forward_parameters(model: torch.nn.Module) -> set[str]:
    import inspect

    return set(inspect.signature(type(model).forward).parameters)
