"""Generation under CP against single-process ``generate``: every rank's output must equal the unpatched
model's, sequences exactly and every step's scores within ``atol``. Loopback (every rank a thread) for
the deterministic modes; gloo processes for sampling (threads would share one random generator)."""

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
    gaps = [torch.where(a == b, torch.zeros_like(a), (a - b).abs()).max().item() for a, b in zip(got.scores, want.scores)]
    return {"sequences": same, "scores": max(gaps)}


def loopback_generate(world: int, family: str, layout: str, seq: int = 13, pads: tuple = (0, 3), rows: int = 2,
                      device: str = "cpu", **gen_kwargs: Any) -> list[dict]:
    """Per rank: whether its sequences equal single-process generate's, its worst score difference, and
    how many prompt and generated tokens its cache holds (``cached``)."""
    from cp_attention.integrations import huggingface as cphf
    from cp_attention.transport.loopback import LoopbackGroup

    ref = build(family).to(device)
    ids, mask = (t.to(device) for t in prompts(rows, seq, pads))
    kwargs = dict(attention_mask=mask, return_dict_in_generate=True, output_scores=True, pad_token_id=0,
                  **gen_kwargs)
    want = ref.generate(ids, **kwargs)
    loop = LoopbackGroup(world)
    replicas = [cphf.apply_context_parallel(copy.deepcopy(ref), group=loop.rank(r), layout=layout)
                for r in range(world)]

    def rank_fn(group):
        got = cphf.generate(replicas[group.rank], ids, group=group, layout=layout, **kwargs)
        layer = got.cache.layers[0] if hasattr(got, "cache") else got.past_key_values.layers[0]
        return {**_compare(got, want), "cached": int((layer.positions >= 0).sum())}

    return loop.run(rank_fn)


def sampled(rank: int, world_size: int, *, family: str, layout: str, seed: int) -> dict:
    """On a gloo rank: sampling with the same seed on every rank equals single-process sampling."""
    from cp_attention.integrations import huggingface as cphf

    ref = build(family)
    ids, mask = prompts(seq=11, pads=(2, 0))
    kwargs = dict(attention_mask=mask, return_dict_in_generate=True, output_scores=True, pad_token_id=0,
                  do_sample=True, top_k=20, temperature=0.9, max_new_tokens=6)
    torch.manual_seed(seed)
    want = ref.generate(ids, **kwargs)
    model = cphf.apply_context_parallel(copy.deepcopy(ref), layout=layout)
    torch.manual_seed(seed)
    got = cphf.generate(model, ids, layout=layout, **kwargs)
    return {**_compare(got, want), "tokens": got.sequences.tolist()}


def refusals(world: int, case: str) -> list[str]:
    """What every loopback rank raised for a call that must be refused (empty: none raised)."""
    from cp_attention.integrations import huggingface as cphf
    from cp_attention.transport.loopback import LoopbackGroup

    ref = build("llama")
    ids, mask = prompts()
    loop = LoopbackGroup(world)
    replicas = [cphf.apply_context_parallel(copy.deepcopy(ref), group=loop.rank(r), layout="zigzag")
                for r in range(world)]

    def rank_fn(group):
        model, kwargs, prompt = replicas[group.rank], dict(attention_mask=mask, max_new_tokens=2, pad_token_id=0), ids
        if case == "model.generate":
            call = lambda: model.generate(prompt, **kwargs)  # noqa: E731
        else:
            if case == "output_attentions":
                kwargs.update(output_attentions=True, return_dict_in_generate=True)
            elif case == "right_padding":
                kwargs["attention_mask"] = mask.flip(1)
            elif case == "differing_prompts" and group.rank == 1:
                prompt = ids.roll(1, 1)
            call = lambda: cphf.generate(model, prompt, group=group, layout="zigzag", **kwargs)  # noqa: E731
        try:
            call()
        except (ValueError, NotImplementedError) as e:
            return f"{type(e).__name__}: {e}"
        return ""

    return loop.run(rank_fn)
