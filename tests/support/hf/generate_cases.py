"""Generation under CP against single-process ``generate``: every rank's output must equal the unpatched
model's, sequences exactly and every step's scores within ``atol``. Loopback (every rank a thread) and
gloo processes; sampling draws on group rank 0 only, so loopback threads (one shared generator) and
differently seeded processes agree, and equal one process seeded as rank 0."""

from __future__ import annotations

import copy
from typing import Any

import torch

from .hf_cases import VOCAB, build

ATOL = 1e-8


def prompts(rows: int = 2, seq: int = 13, pads: tuple = (0, 3), seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids [rows, seq]`` with no token 0 (the pad id) and their left-padding mask."""
    ids = torch.randint(1, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    for r, p in enumerate(pads[:rows]):
        ids[r, :p] = 0
        mask[r, :p] = 0
    return ids, mask


def _compare(got: Any, want: Any) -> dict:
    """``sequences`` equal, and the worst score difference (inf when the step counts differ)."""
    same = torch.equal(got.sequences, want.sequences)
    if len(got.scores) != len(want.scores):
        return {"sequences": same, "scores": float("inf")}
    # processors mask scores to -inf (min_new_tokens, no_repeat_ngram_size): equal infinities agree
    gaps = [torch.where(a == b, torch.zeros_like(a), (a - b).abs()).max().item()
            for a, b in zip(got.scores, want.scores)]
    return {"sequences": same, "scores": max(gaps)}


def loopback_generate(world: int, family: str, layout: str, seq: int = 13, pads: tuple = (0, 3), rows: int = 2,
                      device: str = "cpu", seed: int | None = None, **gen_kwargs: Any) -> list[dict]:
    """Per rank: whether its sequences equal single-process generate's, its worst score difference, how
    many prompt and generated tokens its cache holds (``cached``) and its ``tokens``. With ``seed``, the
    process's generator (which every loopback thread shares) is seeded so before either generate."""
    from cp_attention.integrations import huggingface as cphf
    from cp_attention.transport.loopback import LoopbackGroup

    ref = build(family).to(device)
    ids, mask = (t.to(device) for t in prompts(rows, seq, pads))
    kwargs = dict(attention_mask=mask, return_dict_in_generate=True, output_scores=True, pad_token_id=0,
                  **gen_kwargs)
    if seed is not None:
        torch.manual_seed(seed)
    want = ref.generate(ids, **kwargs)
    loop = LoopbackGroup(world)
    replicas = [cphf.apply_context_parallel(copy.deepcopy(ref), group=loop.rank(r), layout=layout)
                for r in range(world)]

    def rank_fn(group):
        got = cphf.generate(replicas[group.rank], ids, group=group, layout=layout, **kwargs)
        layer = got.cache.layers[0] if hasattr(got, "cache") else got.past_key_values.layers[0]
        return {**_compare(got, want), "cached": int((layer.positions >= 0).sum()), "tokens": got.sequences.tolist()}

    if seed is not None:
        torch.manual_seed(seed)
    return loop.run(rank_fn)


def sampled(rank: int, world_size: int, *, family: str, layout: str, seed: int, rank_seed_step: int = 0) -> dict:
    """On a gloo rank: sampling under CP against single-process sampling seeded ``seed``; the CP call
    runs seeded ``seed + rank * rank_seed_step`` (0: every rank alike)."""
    from cp_attention.integrations import huggingface as cphf

    ref = build(family)
    ids, mask = prompts(seq=11, pads=(2, 0))
    kwargs = dict(attention_mask=mask, return_dict_in_generate=True, output_scores=True, pad_token_id=0,
                  do_sample=True, top_k=20, temperature=0.9, max_new_tokens=6)
    torch.manual_seed(seed)
    want = ref.generate(ids, **kwargs)
    model = cphf.apply_context_parallel(copy.deepcopy(ref), layout=layout)
    torch.manual_seed(seed + rank * rank_seed_step)
    got = cphf.generate(model, ids, layout=layout, **kwargs)
    return {**_compare(got, want), "tokens": got.sequences.tolist()}


def refusals(world: int, case: str, timeout_s: float = 60.0) -> list[dict]:
    """Per loopback rank: what it raised for a call that must be refused (``message``, empty: none raised)
    and how many forwards its model began (``forwards``: 0 when refused before the prefill). A rank left
    waiting fails with the loopback's timeout instead of hanging the test."""
    from transformers import GenerationConfig

    from cp_attention.integrations import huggingface as cphf
    from cp_attention.transport.loopback import LoopbackGroup

    ref = build("llama")
    ids, mask = prompts()
    loop = LoopbackGroup(world, timeout_s=timeout_s)
    replicas = [cphf.apply_context_parallel(copy.deepcopy(ref), group=loop.rank(r), layout="zigzag")
                for r in range(world)]
    forwards = [0] * world
    for r, replica in enumerate(replicas):  # prepended: counts a forward even if a later hook refuses it
        replica.register_forward_pre_hook(lambda *_, r=r: forwards.__setitem__(r, forwards[r] + 1), prepend=True)

    def rank_fn(group):
        rank = group.rank
        model, kwargs, prompt = replicas[rank], dict(attention_mask=mask, max_new_tokens=2, pad_token_id=0), ids
        layout = "zigzag"
        if case == "model.generate":
            call = lambda: model.generate(prompt, **kwargs)  # noqa: E731
        else:
            if case == "output_attentions":
                kwargs.update(output_attentions=True, return_dict_in_generate=True)
            elif case == "right_padding":
                kwargs["attention_mask"] = mask.flip(1)
            elif case == "differing_prompts" and rank == 1:
                prompt = ids.roll(1, 1)
            elif case == "differing_generation_config":  # equal objects' values would agree, not their identity
                del kwargs["max_new_tokens"], kwargs["pad_token_id"]
                kwargs["generation_config"] = GenerationConfig(max_new_tokens=2 + rank, pad_token_id=0)
            elif case == "differing_do_sample":  # a keyword on one rank, a GenerationConfig field on the other
                if rank == 1:
                    kwargs["generation_config"] = GenerationConfig(do_sample=True, top_k=5)
            elif case == "differing_layout" and rank == 1:
                layout = "contiguous"
            elif case == "generation_config_use_cache":
                kwargs["generation_config"] = GenerationConfig(use_cache=False)
            elif case == "model_generation_config_use_cache":
                model.generation_config.use_cache = False
            elif case == "max_time":
                kwargs["max_time"] = 60.0
            elif case == "group_beam_search":
                kwargs.update(num_beams=2, num_beam_groups=2, diversity_penalty=0.5)
            elif case in ("own_past_key_values", "own_cache"):  # either name transformers has had for it
                from transformers import DynamicCache

                kwargs[case[len("own_"):]] = DynamicCache()
            call = lambda: cphf.generate(model, prompt, group=group, layout=layout, **kwargs)  # noqa: E731
        try:
            call()
        except (ValueError, NotImplementedError) as e:
            return {"message": f"{type(e).__name__}: {e}", "forwards": forwards[rank]}
        return {"message": "", "forwards": forwards[rank]}

    return loop.run(rank_fn)


def differing_config(rank: int, world_size: int) -> str:
    """On a gloo rank: generate with a GenerationConfig of this rank's own; what it raised (empty: none)."""
    from transformers import GenerationConfig

    from cp_attention.integrations import huggingface as cphf

    ids, mask = prompts()
    model = cphf.apply_context_parallel(build("llama"), layout="zigzag")
    config = GenerationConfig(max_new_tokens=2, pad_token_id=0, do_sample=rank > 0)
    try:
        cphf.generate(model, ids, layout="zigzag", attention_mask=mask, generation_config=config)
    except ValueError as e:
        return f"{type(e).__name__}: {e}"
    return ""
