"""Issue 27: generation from a sharded prompt and KV cache equals single-process ``generate`` (tokens and
every step's scores), for every layout, N in {2, 4}, odd prompt lengths with left padding, and models
with sliding windows shorter than the prompt (Mistral), softcap and alternating windows (Gemma2) and
sinks (GPT-OSS); beam search, logits processors and sampling; the refusals alike on every rank.

Issue 32: a sampled token is drawn once (on group rank 0) and shared, so ranks whose generators are out of
step (loopback threads, differently seeded processes) agree; every argument's value, GenerationConfig
objects included, is agreed before the prefill, and what is refused is refused there on every rank."""

from __future__ import annotations

import pytest
import torch

from tests.support.hf import generate_cases
from tests.support.hf.generate_cases import ATOL

FAMILIES = ("llama", "qwen2", "mistral_window", "gemma2_window", "gpt_oss_window")
LAYOUTS = ("contiguous", "zigzag", "interleaved")
# Every family at N = 2 and 4, the layout turning, so each family meets every layout but one and
# each layout every family (odd prompt lengths: 13 and 17, one row left-padded).
MATRIX = [(family, world, LAYOUTS[(i + j) % 3]) for i, family in enumerate(FAMILIES) for j, world in enumerate((2, 4))]


@pytest.mark.parametrize("family,world,layout", MATRIX, ids=[f"{f}-N{w}-{lay}" for f, w, lay in MATRIX])
def test_greedy_equals_one_process(family, world, layout):
    seq = 17 if world == 4 else 13
    results = generate_cases.loopback_generate(world, family, layout, seq=seq, max_new_tokens=5)
    for rank, r in enumerate(results):
        assert r["sequences"] and r["scores"] <= ATOL, (rank, r)
    # every prompt token (left padding dropped) and every new one is cached on exactly one rank, evenly
    real, new = 2 * seq - 3, 2 * 5 - 2  # the last step's token is never fed back
    held = [r["cached"] for r in results]
    assert sum(held) == real + new, held
    assert max(held) - min(held) <= 2 * (2 + 1), held


@pytest.mark.parametrize("kwargs", [
    dict(num_beams=3, max_new_tokens=4),
    dict(num_beams=2, num_return_sequences=2, length_penalty=0.5, max_new_tokens=4),
    dict(repetition_penalty=1.4, no_repeat_ngram_size=2, max_new_tokens=6),
    dict(eos_token_id=7, max_new_tokens=8, min_new_tokens=2),
], ids=["beam3", "beam2x2", "processors", "eos"])
def test_generate_options(kwargs):
    results = generate_cases.loopback_generate(4, "gemma2_window", "zigzag", seq=15, pads=(4, 0), **kwargs)
    for rank, r in enumerate(results):
        assert r["sequences"] and r["scores"] <= ATOL, (rank, r)


@pytest.mark.parametrize("layout,pad", [("zigzag", 0), ("interleaved", 3)])
def test_one_prompt_runs_the_plain_schedule(layout, pad):
    """One prompt (left-padded or not) is prefilled without documents, its padding after its tokens."""
    results = generate_cases.loopback_generate(4, "mistral_window", layout, seq=19, pads=(pad,), rows=1,
                                               max_new_tokens=5, num_beams=2)
    for rank, r in enumerate(results):
        assert r["sequences"] and r["scores"] <= ATOL, (rank, r)


@pytest.mark.parametrize("rank_seed_step", [0, 1000], ids=["same-seed", "seeded-differently"])
def test_sampling_is_identical_on_every_rank(pools, rank_seed_step):
    """gloo processes: the same tokens on both ranks, and what one process seeded as rank 0 samples, also
    when rank 1's generator is seeded otherwise (rank 0's draw counts)."""
    results = pools(2).run(generate_cases.sampled, family="gpt_oss_window", layout="interleaved", seed=3,
                           rank_seed_step=rank_seed_step, timeout=180)
    assert results[0]["tokens"] == results[1]["tokens"]
    for r in results:
        assert r["sequences"] and r["scores"] <= ATOL, r


@pytest.mark.parametrize("world,kwargs", [
    (2, dict(do_sample=True, top_k=20, temperature=0.9, max_new_tokens=6)),
    (4, dict(do_sample=True, num_beams=2, max_new_tokens=4)),
], ids=["sample-N2", "beam-sample-N4"])
def test_sampling_on_loopback_equals_one_process(world, kwargs):
    """Loopback ranks are threads drawing from ONE generator: unless one rank draws for all, each step's
    token differs between ranks. Seeded alike, the result is one process's, tokens and scores."""
    results = generate_cases.loopback_generate(world, "llama", "zigzag", seed=11, **kwargs)
    assert all(r["tokens"] == results[0]["tokens"] for r in results), [r["tokens"] for r in results]
    for rank, r in enumerate(results):
        assert r["sequences"] and r["scores"] <= ATOL, (rank, r)


@pytest.mark.parametrize("case,expected", [
    ("model.generate", "NotImplementedError: model.generate() on a context-parallel model"),
    ("output_attentions", "NotImplementedError: context-parallel generate does not support output_attentions"),
    ("right_padding", "ValueError: attention_mask must hold left padding only"),
    ("differing_prompts", "ValueError: the ranks passed different generate arguments: input_ids (rank 0: a "
                          "torch.int64 tensor (2, 13) of fingerprint "),
    ("differing_generation_config", "ValueError: the ranks passed different generate arguments: max_new_tokens "
                                    "(rank 0: 2; rank 1: 3)"),
    ("differing_do_sample", "ValueError: the ranks passed different generate arguments: do_sample (rank 0: False; "
                            "rank 1: True), top_k (rank 0: 50; rank 1: 5)"),
    ("differing_layout", "ValueError: generate got group/layout 'contiguous' other than the model was patched with"),
    ("generation_config_use_cache", "NotImplementedError: use_cache=False (a generate keyword, or a field of "
                                    "generation_config or model.generation_config)"),
    ("model_generation_config_use_cache", "NotImplementedError: use_cache=False"),
    ("max_time", "NotImplementedError: context-parallel generate does not support max_time=60.0"),
    ("group_beam_search", "NotImplementedError: context-parallel generate does not support the generation mode "
                          "'group_beam_search'"),
    ("own_past_key_values", "NotImplementedError: context-parallel generate does not support past_key_values: a "
                            "cache of your own (generation uses the sharded KV cache); drop past_key_values"),
    ("own_cache", "NotImplementedError: context-parallel generate does not support cache: a cache of your own "
                  "(generation uses the sharded KV cache); drop cache"),
], ids=lambda v: v if " " not in v else "")
def test_refusals_alike_on_every_rank(case, expected):
    """The same error on every rank, before any forward (the prefill never starts); never a rank left
    waiting (the loopback's timeout would fail the test)."""
    results = generate_cases.refusals(2, case, timeout_s=30)
    messages = [r["message"] for r in results]
    assert len(set(messages)) == 1 and messages[0].startswith(expected), messages
    assert [r["forwards"] for r in results] == [0, 0], results


def test_differing_generation_config_refused_on_gloo(pools):
    """Real processes: a GenerationConfig that differs between the ranks (equal objects would agree) raises
    the same ValueError on both, naming the option and the ranks, instead of one rank hanging."""
    messages = pools(2).run(generate_cases.differing_config, timeout=120)
    assert messages[0] == messages[1], messages
    assert messages[0].startswith("ValueError: the ranks passed different generate arguments: do_sample (rank 0: "
                                  "False; rank 1: True)"), messages


def _bench_on_rank(rank: int, world_size: int, *args):
    from benchmarks import generate as generate_bench

    return generate_bench._worker(*args)


def test_generate_benchmark_figures(pools):
    """benchmarks/generate.py's measurement, small: N = 2 gives N = 1's tokens on every rank, about
    half its KV bytes per rank, and the same bytes per decoding step at both prompt lengths (flat in S)."""
    import argparse

    from benchmarks import generate as generate_bench

    args = argparse.Namespace(**generate_bench.QUICK, layout="zigzag")
    one = {seq: generate_bench.measure(args, seq) for seq in (128, 256)}
    two = {r["seq"]: r for r in pools(2).run(_bench_on_rank, args, [128, 256], timeout=180)[0]}
    for seq in (128, 256):
        assert two[seq]["tokens"] == one[seq]["tokens"] and two[seq]["same_tokens_on_every_rank"]
        assert 0.4 < two[seq]["kv_bytes"] / one[seq]["kv_bytes"] < 0.65, (two[seq]["kv_bytes"], one[seq]["kv_bytes"])
    assert two[128]["comm_bytes_per_step"] == two[256]["comm_bytes_per_step"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family,kwargs", [
    ("mistral_window", dict(num_beams=2)),
    ("gpt_oss_window", dict(num_beams=2)),
    ("llama", dict(do_sample=True, top_k=20)),  # rank 0 draws from the CUDA generator; the ranks share it
], ids=["mistral_window-beam", "gpt_oss_window-beam", "llama-sample"])
def test_generate_on_cuda(family, kwargs):
    """fp64 on one GPU (the ring's CUDA path falls back where a kernel lacks fp64), every rank a thread."""
    results = generate_cases.loopback_generate(4, family, "zigzag", seq=17, device="cuda", max_new_tokens=5,
                                               seed=5, **kwargs)
    for rank, r in enumerate(results):
        assert r["sequences"] and r["scores"] <= ATOL, (rank, r)
