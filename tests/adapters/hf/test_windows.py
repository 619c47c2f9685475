"""Sliding windows through the HuggingFace adapter (issue 11): windowed models on real gloo ranks equal
the models without CP, for every layout, at sequences several times longer than the windows."""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")

import cp_attention as cpa  # noqa: E402
from tests.adapters.hf.test_equivalence import FP64, PLAIN_LAYOUTS, _assert_equivalent  # noqa: E402
from tests.support.hf import hf_cases, hf_window_cases  # noqa: E402
from tests.support.hf.hf_versions import BIDIRECTIONAL_CONFIG, needs  # noqa: E402

# Every layer, max_window_layers, mask-only windows (Qwen2-MoE), alternating with softcap (Gemma2),
# local/global layer_types (Gemma3), alternating with sinks (GPT-OSS): see hf_cases._window_config.
WINDOW_FAMILIES = ("mistral_window", "qwen2_window", "qwen3_window", "qwen2_moe_window", "gemma2_window",
                   "gemma3_window", "gpt_oss_window")
# Their windows change the logits by at least this much: a run that dropped them would fail.
WINDOW_MATTERS = 1e-3


def _assert_windows_matter(results, what):
    for rank, r in enumerate(results):
        assert r["window_effect"] > WINDOW_MATTERS, f"{what}: rank {rank}: the windows change nothing ({r})"


CASES = list(itertools.product((2, 4), WINDOW_FAMILIES, PLAIN_LAYOUTS))


@pytest.mark.parametrize("world_size,family,layout", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_windowed_model_matches_model_without_cp(pools, world_size, family, layout):
    results = pools(world_size).run(hf_cases.equivalence, family=family, layout=layout, seq=hf_cases.WINDOW_SEQ,
                                    timeout=180)
    what = f"{family} {layout} cp={world_size}"
    _assert_equivalent(results, what, family)
    _assert_windows_matter(results, what)


DOC_CASES = [(2, lay, "packed_positions") for lay in cpa.LAYOUT_NAMES] + [(4, "zigzag", "collator"),
                                                                           (2, "interleaved", "padded_left")]


@pytest.mark.parametrize("world_size,layout,mode", DOC_CASES, ids=["-".join(map(str, c)) for c in DOC_CASES])
def test_windowed_packed_documents_equal_their_documents(pools, world_size, layout, mode):
    """Packed documents longer than the window: the window counts within each document."""
    results = pools(world_size).run(hf_cases.documents_equivalence, family="mistral_window", layout=layout,
                                    mode=mode, timeout=180)
    for rank, r in enumerate(results):
        assert r["finite"] and r["impl"] == "cp_ring", (rank, r)
        for key in ("logits", "loss", "grads"):
            assert r[key] <= FP64, f"{layout} {mode} cp={world_size}: rank {rank} {key} differs by {r[key]:.3e}"
    _assert_windows_matter(results, f"packed {layout} {mode} cp={world_size}")


@pytest.mark.parametrize("layout", PLAIN_LAYOUTS)
def test_noncausal_layer_window_is_flash_attentions(pools, layout):
    """A non-causal layer's window W is transformers' flash-attention one: |i - j| < W, both sides."""
    for rank, r in enumerate(pools(2).run(hf_window_cases.noncausal_window, layout=layout, window=5, timeout=180)):
        assert max(r[key] for key in ("out", "dq", "dk", "dv")) <= FP64, (rank, r)
        assert r["window_effect"] > WINDOW_MATTERS, (rank, r)


_BIDIRECTIONAL = needs(BIDIRECTIONAL_CONFIG, "config.is_causal=False (before, the model stays causal)")


@_BIDIRECTIONAL
@pytest.mark.parametrize("layout", PLAIN_LAYOUTS)
def test_bidirectional_config_matches_model_without_cp(pools, layout):
    """config.is_causal=False: transformers asks the mask interface for a bidirectional mask and passes
    is_causal=False to every attention call; the two agree, so the ring runs non-causal."""
    results = pools(2).run(hf_cases.equivalence, family="llama_bidirectional", layout=layout, timeout=180)
    _assert_equivalent(results, f"bidirectional {layout}", "llama_bidirectional")


def _tiny_config(**attrs):
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    for key, val in attrs.items():
        setattr(cfg, key, val)
    cfg._attn_implementation = "cp_ring"
    return cfg


def _creator_kwargs(creator) -> dict:
    """A first forward's arguments for one of transformers' mask creators, under the names the installed
    version's takes (``input_embeds`` before 5.2, a required ``cache_position`` before 5.4, ``cache`` for
    ``past_key_values`` from 5.24)."""
    import inspect

    import torch

    names = inspect.signature(creator).parameters
    kwargs = {"inputs_embeds" if "inputs_embeds" in names else "input_embeds": torch.zeros(1, 6, 8),
              "cache" if "cache" in names else "past_key_values": None, "attention_mask": None, "position_ids": None}
    if "cache_position" in names:
        kwargs["cache_position"] = torch.arange(6)
    return kwargs


def test_mask_interface_hands_windows_on_and_refuses_what_it_cannot_honour():
    """transformers' own mask creators, asked for a patched model's masks (no process group needed)."""
    import torch
    from transformers import masking_utils as mu

    from cp_attention.integrations.huggingface import attention as hf_attention
    from cp_attention.integrations.huggingface import masks as hf_masks

    hf_attention._register()
    kwargs = _creator_kwargs(mu.create_causal_mask)
    assert mu.create_causal_mask(config=_tiny_config(), **kwargs) is None
    assert mu.create_sliding_window_causal_mask(config=_tiny_config(sliding_window=3), **kwargs) == \
        hf_masks.RingMask(causal=True, window=3)
    with pytest.raises(NotImplementedError, match="chunked attention"):
        mu.create_chunked_causal_mask(config=_tiny_config(attention_chunk_size=4), **kwargs)
    with pytest.raises(NotImplementedError, match="lays its own mask functions"):
        mu.create_sliding_window_causal_mask(config=_tiny_config(sliding_window=3), **kwargs,
                                             or_mask_function=lambda *a: torch.tensor(True))
    # anything else transformers may pass the mask interface one day is refused by name, not dropped
    with pytest.raises(NotImplementedError, match="does not implement: block_sequence_ids"):
        hf_masks.ring_mask(1, 6, 6, block_sequence_ids=torch.zeros(1, 6))
    # the attention side: a mask-only window is honoured, a disagreeing pair refused
    assert hf_masks.layer_window(hf_masks.RingMask(True, 4), None, True) == 4
    assert hf_masks.layer_window(None, 4, False) == 4
    with pytest.raises(NotImplementedError, match="disagree"):
        hf_masks.layer_window(hf_masks.RingMask(True, 4), 5, True)
    with pytest.raises(NotImplementedError, match="bidirectional sliding-window"):
        hf_masks.layer_window(hf_masks.RingMask(False, 4), 4, False)


@_BIDIRECTIONAL
def test_mask_interface_hands_a_bidirectional_config_on():
    """config.is_causal=False: transformers asks the mask interface for a bidirectional mask, handed on."""
    from transformers import masking_utils as mu

    from cp_attention.integrations.huggingface import attention as hf_attention
    from cp_attention.integrations.huggingface import masks as hf_masks

    hf_attention._register()
    assert mu.create_causal_mask(config=_tiny_config(is_causal=False), **_creator_kwargs(mu.create_causal_mask)) == \
        hf_masks.RingMask(causal=False, window=None)
