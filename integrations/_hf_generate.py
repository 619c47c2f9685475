"""``generate`` on a context-parallel HuggingFace model: sharded prefill, sharded KV cache, pass-Q decoding.

:func:`generate` runs transformers' own ``generate`` (greedy, beam search, sampling, logits processors,
stopping criteria, scores) with a :func:`~._hf_kvcache.sharded_cache` and this module's hooks:

- prefill: the model's forward pre-hook swaps the prompt batch for this rank's shard of ONE packed
  stream (each row's real tokens a document, left padding dropped, one padding document up to the
  layout's divisor), which the ring attends exactly; each layer's cache keeps this rank's tokens per
  row. Only the rows' last tokens reach the LM head (``logits_to_keep``), and one all-reduce gives every
  rank the ``[B, 1, V]`` logits;
- decoding: every rank runs the new token (it is tiny); each attention layer attends it to this rank's
  share of the cache and merges the ranks' partial results by log-sum-exp in one small all-gather
  (:func:`cp_attention.engine.decode.decode_attention`); the new token's K/V stay on rank ``step mod N``.

Every rank computes the same logits bit for bit, so it picks (or samples, under the same seed) the
same token. The state of a generation is per thread (a loopback rank is a thread): :mod:`._hf_gen_state`.
"""

from __future__ import annotations

import zlib
from typing import Any, Optional

import torch

import cp_attention as cpa
from cp_attention.engine.decode import decode_attention
from cp_attention.layouts.documents import cu_seqlens_from_lengths, document_position_ids, pad_cu_seqlens
from cp_attention.transport import group_rank_and_size, transport_for
from cp_attention.transport.process_group import group_token

from ._agree import agree
from ._hf_batch import batch_fingerprint
from ._hf_gen_state import running

__all__ = ["generate", "Generation"]

_KINDS = (ValueError, NotImplementedError)
# generate arguments that would need what a sharded cache cannot give: the attention weights, every
# layer's hidden states, a cropped cache (assisted, prompt-lookup and contrastive decoding), a cache
# of another kind, or the prompt as embeddings.
_REFUSED = {
    "output_attentions": "the attention weights (ring attention never holds them)",
    "output_hidden_states": "every layer's hidden states of the whole prompt (each rank holds its shard only)",
    "assistant_model": "assisted decoding (it crops the cache)",
    "prompt_lookup_num_tokens": "prompt-lookup decoding (it crops the cache)",
    "penalty_alpha": "contrastive search (it crops the cache)",
    "prefill_chunk_size": "chunked prefill (the prefill is sharded instead)",
    "cache_implementation": "another cache (generation uses the sharded KV cache)",
    "past_key_values": "a cache of your own (generation uses the sharded KV cache)",
    "cache": "a cache of your own (generation uses the sharded KV cache)",
    "inputs_embeds": "prompts as embeddings (pass input_ids)",
    "logits_to_keep": "logits_to_keep (generation keeps the last token's logits itself)",
}


class Generation:
    """One :func:`generate` call on one rank: its cache, and where the prefill's last tokens are."""

    def __init__(self, state: Any, cache: Any) -> None:
        self.state, self.cache = state, cache
        self.transport = transport_for(state.group)
        self.prefilled = False
        self.step = -1  # decoding steps so far (the first is 0)
        self._logit_rows: Optional[torch.Tensor] = None
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
        for r, local in enumerate(per_row):
            rows_index[r, :len(local)] = local
            positions[r, :len(local)] = index_in_row[local]
        for layer in self.cache.layers:
            layer.start(rows_index.to(device), positions.to(device), s)
        last = real & (held == bounds[(row + 1).clamp(max=b)] - 1)  # a row's last token
        self._logit_rows = row[last].to(device)
        self.batch = b
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
               window: Optional[int], scaling: Optional[float], softcap: Optional[float],
               sinks: Optional[torch.Tensor]) -> tuple[torch.Tensor, None]:
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


def _problem(input_ids: Any, attention_mask: Any, kwargs: dict[str, Any], model: Any) -> "tuple[int, str] | None":
    refused = [name for name in _REFUSED if kwargs.get(name) not in (None, False)]
    if kwargs.get("use_cache") is False:
        return 1, "use_cache=False: context-parallel generation decodes from its sharded KV cache; drop use_cache"
    if getattr(model.generation_config, "cache_implementation", None) is not None and "generation_config" not in kwargs:
        refused.append("cache_implementation")
    if refused:
        what = "; ".join(f"{name}: {_REFUSED[name]}" for name in refused)
        return 1, f"context-parallel generate does not support {what}; drop {', '.join(refused)}"
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        return 0, "input_ids must be a [batch, seq] integer tensor (the whole prompt, the same on every rank)"
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
            return 0, f"attention_mask must be a [batch, seq] tensor like input_ids {tuple(input_ids.shape)}"
        problem = _left_padding_problem(attention_mask)
        if problem is not None:
            return 0, f"attention_mask {problem}"
    if not model._supports_logits_to_keep():
        return 1, f"{type(model).__name__}.forward takes no logits_to_keep, which the sharded prefill needs"
    return None


def _left_padding_problem(mask: torch.Tensor) -> Optional[str]:
    """Why ``mask [B, S]`` is not left padding (each row zeros, then at least one 1), or None."""
    ones = mask.to(torch.long)
    if not bool(((ones == 0) | (ones == 1)).all()) or bool((ones[:, 1:] < ones[:, :-1]).any()) \
            or not bool(ones[:, -1].all()):
        return ("must hold left padding only (each row zeros, then at least one 1): set the tokenizer's "
                "padding_side='left' for generation, and pass attention_mask when pad_token_id occurs in the prompt")
    return None


def _arguments_header(kwargs: dict[str, Any]) -> list[int]:
    """A fingerprint of the plain-valued generate arguments (objects differ between processes by address)."""
    plain = sorted((k, v) for k, v in kwargs.items() if isinstance(v, (bool, int, float, str, type(None), tuple)))
    return [zlib.crc32(repr(plain).encode())]


def generate(model: torch.nn.Module, input_ids: torch.Tensor, group=None, layout: "str | cpa.Layout" = "zigzag",
             attention_mask: Optional[torch.Tensor] = None, **generate_kwargs: Any) -> Any:
    """What ``model.generate(input_ids, attention_mask=..., **generate_kwargs)`` returns in one process
    without CP, on every rank alike, for a model patched by ``apply_context_parallel(model, group, layout)``.

    ``input_ids [B, S]`` is the whole prompt batch on every rank (left-padded as ``attention_mask``
    says); the prompt is sharded internally, whatever its length, and each rank keeps ~1/N of the KV
    cache. ``generate_kwargs`` are transformers' (greedy, beam search, sampling with the same seed on
    every rank, logits processors, stopping criteria, ``output_scores``, ``return_dict_in_generate``...).

    Raises ``ValueError`` for a model patched with another group or layout, inputs that differ between
    ranks, or padding that is not left padding; ``NotImplementedError`` naming a ``generate`` argument
    the sharded cache cannot serve (attention weights, hidden states, assisted or contrastive decoding,
    another cache). Raised on every rank alike, before the prefill.
    """
    state = getattr(model, "_cp_attention", None)
    rank, world = group_rank_and_size(group)
    if state is None:
        if world == 1:  # apply_context_parallel leaves a world of one untouched
            return type(model).generate(model, input_ids, attention_mask=attention_mask, **generate_kwargs)
        raise ValueError("generate needs a model patched for context parallelism: call "
                         "apply_context_parallel(model, group=group, layout=layout) first")
    if group_token(group) != group_token(state.group) or cpa.get_layout(layout) != state.layout:
        raise ValueError(f"generate got group/layout {layout!r} other than the model was patched with "
                         f"({state.layout.name!r}); pass the ones given to apply_context_parallel")
    problem = _problem(input_ids, attention_mask, generate_kwargs, model)
    header = _arguments_header(generate_kwargs)
    if problem is None:
        header += batch_fingerprint({"input_ids": input_ids, "attention_mask": attention_mask})
    headers = agree(state.group, world, problem, _KINDS, "(on rank {first}; ranks refused: {bad})", header)
    if len(set(headers)) > 1:
        raise ValueError("the ranks passed different prompts or generate arguments; every rank must call generate "
                         "with the same input_ids, attention_mask and arguments")
    from ._hf_kvcache import sharded_cache

    gen = Generation(state, None)
    gen.cache = sharded_cache(model.config.get_text_config().num_hidden_layers, gen.keeps_new_token)
    cache_name = "cache" if "cache" in _forward_parameters(model) else "past_key_values"
    with running(gen):
        return type(model).generate(model, input_ids, attention_mask=attention_mask, **{cache_name: gen.cache},
                                    **generate_kwargs)


def _forward_parameters(model: torch.nn.Module) -> set[str]:
    import inspect

    return set(inspect.signature(type(model).forward).parameters)
