"""The peak-memory meter (studies/memory/peak.py) against peaks worked out by hand, its attribution on a tiny
Llama, and the projection's arithmetic (studies/memory/projection.py) against published parameter counts."""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F

from studies.memory import projection
from studies.memory.peak import MIB, TERMS, measure_step, term_of


class _ExpSum(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(256, 1024))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w).exp().sum()


def test_the_peak_of_a_step_worked_out_by_hand():
    # forward: h = x @ w (4 MiB), e = exp(h) (4 MiB, saved) while h is live: 8 MiB; h is freed.
    # backward: exp's gradient (4 MiB) while e is still saved: 8 MiB again; then w's gradient (1 MiB).
    # With the parameter (1 MiB) the peak is 9 MiB, plus the loss's and the seed's 4-byte scalars.
    model, x = _ExpSum(), torch.randn(1024, 256)
    peak = measure_step(model, lambda: model(x), vocab=1024)
    assert peak.before == MIB
    assert 9 * MIB <= peak.peak <= 9 * MIB + 64, peak.peak
    assert sum(peak.at_peak.terms.values()) == peak.peak
    assert peak.window_peak == peak.peak - MIB
    assert model.w.grad is not None  # the step's gradients are left in place


def test_a_step_with_gradients_left_is_refused():
    model, x = _ExpSum(), torch.randn(8, 256)
    model(x).backward()
    with pytest.raises(ValueError, match="zero_grad"):
        measure_step(model, lambda: model(x), vocab=1024)


def _tiny_llama(checkpointing: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=3000, hidden_size=64, intermediate_size=224, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, use_cache=False, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).train()
    if checkpointing:  # the adapter's own switch: activation_ or gradient_checkpointing_enable by version
        from cp_attention.integrations.huggingface.savers import checkpoint_activations

        checkpoint_activations(model)
    return model


@pytest.mark.parametrize("checkpointing", (False, True))
def test_a_llama_step_is_attributed_to_its_parts(checkpointing):
    model = _tiny_llama(checkpointing)
    ids = torch.randint(0, 3000, (1, 256), generator=torch.Generator().manual_seed(0))

    def loss():
        logits = model(input_ids=ids).logits
        return F.cross_entropy(logits[0, :-1].float(), ids[0, 1:])

    peak = measure_step(model, loss, vocab=3000)
    terms = peak.at_peak.terms
    assert set(terms) <= set(TERMS)
    assert sum(terms.values()) == peak.peak
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert peak.before == params and terms["params+grads"] >= params
    # the full logits and their fp32 copies (256 x 3000 x 4 bytes each) dominate: the peak is in the loss
    loss_bytes = terms["logits/loss"] - peak.at_peak.vocab_bytes
    assert peak.at_peak.vocab_bytes >= 2 * 255 * 3000 * 4 and loss_bytes < peak.at_peak.vocab_bytes / 10
    assert max(peak.regions, key=lambda k: peak.regions[k].total) in ("backward head+loss", "forward head+loss")
    # the decoder's activations live at the peak: every layer's without checkpointing, none with it
    # (only the layers' inputs, which are the checkpoints, and the final norm's)
    if checkpointing:
        assert terms.get("attention", 0) == 0 and terms.get("MLP", 0) == 0
        assert terms.get("checkpoints", 0) >= 256 * 64 * 4  # one layer's output, fp32
    else:
        assert terms["MLP"] >= 2 * 256 * 224 * 4 * 2  # two layers: gate and up outputs at least
        assert terms["attention"] > 0 and terms["norms"] > 0
    assert all(s.total <= peak.peak for s in peak.regions.values())


def test_module_paths_map_to_terms():
    assert term_of(None) == "logits/loss" and term_of("lm_head") == "logits/loss" and term_of("") == "logits/loss"
    assert term_of("model.layers.3.self_attn.q_proj") == "attention"
    assert term_of("model.layers.3.mlp.down_proj") == "MLP"
    assert term_of("model.layers.0.input_layernorm") == "norms" and term_of("model.norm") == "norms"
    assert term_of("model.layers.12") == "checkpoints"
    assert term_of("model.embed_tokens") == "other" and term_of("model.rotary_emb") == "other"


def test_parameter_counts_are_llama_3s():
    # Meta's model cards: Llama-3-8B 8,030,261,248 and Llama-3-70B 70,553,706,496 parameters
    m8, m70 = projection.MODELS["Llama-3-8B"], projection.MODELS["Llama-3-70B"]
    assert projection._params(*(m8[k] for k in ("hidden", "intermediate", "heads", "kv_heads", "layers", "vocab"))
                              )[0] == 8_030_261_248
    assert projection._params(*(m70[k] for k in ("hidden", "intermediate", "heads", "kv_heads", "layers", "vocab"))
                              )[0] == 70_553_706_496


def _lines(alpha_vocab: float, beta_width: float, beta_ckpt: float) -> dict:
    return {"backward head+loss": {"vocab": (alpha_vocab, 0.0), "attention": (0.0, beta_width),
                                   "checkpoints": (0.0, beta_ckpt), "params+grads": (1e9, 0.0)}}


def test_the_projection_fills_the_budget_exactly():
    args = argparse.Namespace(gpu_gb=80.0, reserve_gib=3.0, fragmentation=0.05, host_gb_per_node=1e9)
    small = dict(hidden=512, layers=4)
    lines = _lines(alpha_vocab=3e8, beta_width=2000.0, beta_ckpt=4096.0)
    for saver, ckpt_scale in (("checkpoint", 8 * 32 / 4), ("all", 8)):
        p = projection.project(lines, saver, "Llama-3-8B", 8, small, args)
        beta = 2000.0 * 8 + 4096.0 * ckpt_scale  # one layer's attention x width; checkpoints x width (x layers)
        assert p["beta"] == pytest.approx(beta) and p["alpha"] == pytest.approx(3e8)  # vocab-sized: x 1
        used = p["states"] + p["buffers"] + p["alpha"] + p["beta"] * p["tokens_per_gpu"]
        assert used == pytest.approx(80e9 * 0.95 - 3 * 1024 ** 3, rel=1e-12)
        assert p["sequence"] == pytest.approx(8 * p["tokens_per_gpu"])
    # the optimizer is offloaded with the offloaded checkpoints only
    assert projection.project(lines, "all", "Llama-3-8B", 8, small, args)["states"] == 0
    assert projection.project(lines, "checkpoint", "Llama-3-8B", 8, small, args)["states"] == \
        pytest.approx(16 * 8_030_261_248 / 8)


def test_the_host_binds_when_the_offloaded_checkpoints_do_not_fit_it():
    args = argparse.Namespace(gpu_gb=80.0, reserve_gib=3.0, fragmentation=0.05, host_gb_per_node=800.0)
    lines = _lines(alpha_vocab=3e8, beta_width=2000.0, beta_ckpt=4096.0)
    lines["backward head+loss"]["offloaded (host)"] = (0.0, 4096.0)  # 4 layers x 512 x 2 bytes per token
    p = projection.project(lines, "all", "Llama-3-8B", 8, dict(hidden=512, layers=4), args)
    host_per_token = 4096.0 * 8 * 32 / 4  # 32 layers x 4096 x 2 bytes
    assert p["region"] == "host memory"
    assert p["host_per_gpu"] == pytest.approx(800e9 / 8)
    assert p["tokens_per_gpu"] == pytest.approx((800e9 / 8 - 16 * 8_030_261_248 / 8) / host_per_token)
