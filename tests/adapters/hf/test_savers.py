"""``cphf.save_memory`` on CP-patched HF models (fp64, every rank in one process on the loopback transport):
each saver alone and together leaves the loss and every rank-summed parameter gradient within 1e-10 of the
same CP model without savers, on every family of tests/support/hf/hf_cases.py, plain, padded and packed
batches, N=2 and 4, every cp_comm_type, with ``causal_lm_loss`` and with ``lm_loss``; and the savers
really ran (layers recomputed, inputs stashed in host memory and restored, MLPs run chunk by chunk).
Mixture-of-experts MLPs are refused by name under ``mlp_chunks``; calls are re-callable and undoable."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from tests.support.hf.hf_cases import build  # noqa: E402
from tests.support.hf.hf_versions import checkpointing_on  # noqa: E402
from tests.support.hf.savers_cases import cp_step, difference, make_batch  # noqa: E402

TOL = 1e-10
CHUNKS = 3
SAVERS = {"checkpoint": dict(checkpoint=True), "offload": dict(checkpoint="offload"),
          "mlp_chunks": dict(checkpoint=False, mlp_chunks=CHUNKS),
          "offload+mlp_chunks": dict(checkpoint="offload", mlp_chunks=CHUNKS)}
FAMILIES = ("llama", "llama_bidirectional", "qwen2", "mistral", "gemma2", "gemma2_softcap", "gpt_oss",
            "mistral_window", "qwen2_window", "qwen3_window", "qwen2_moe_window", "gemma2_window", "gemma3_window",
            "gpt_oss_window")
MOE = ("gpt_oss", "qwen2_moe", "gpt_oss_window", "qwen2_moe_window")


def _expected_counts(savers: dict, layers: int, world: int) -> dict:
    """What each saver does per step: a checkpointed layer runs twice, a tiled MLP once per chunk (and
    each chunk again in backward), an offloaded layer stashes its input once and restores it once."""
    ckpt = 1 if savers.get("checkpoint") else 0
    chunks = savers.get("mlp_chunks")
    mlp = 1 + ckpt if chunks is None else chunks * (2 + ckpt)
    stashed = layers * world if savers.get("checkpoint") == "offload" else 0
    return {"attention": layers * world * (1 + ckpt), "mlp_inner": layers * world * mlp, "stashed": stashed,
            "restored": stashed, "stashed_on_cpu": stashed, "layers": layers}


def _check(base: dict, got: dict, savers: dict, world: int) -> None:
    assert difference(base, got) < TOL, (savers, difference(base, got))
    assert got["counts"] == _expected_counts(savers, got["counts"]["layers"], world), (savers, got["counts"])


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_each_saver_alone_and_together(family):
    model = build(family)
    full = make_batch("plain", family)
    base = cp_step(model, 2, full, None)
    assert base["counts"] == _expected_counts({}, base["counts"]["layers"], 2)
    for _name, savers in SAVERS.items():
        if "mlp_chunks" in savers and savers["mlp_chunks"] and family in MOE:
            with pytest.raises(ValueError, match=r"mlp\.(router|gate) \(\w+TopKRouter\) .* mixture-of-experts"):
                cp_step(model, 2, full, savers)
            continue
        _check(base, cp_step(model, 2, full, savers), savers, 2)


CASES = [(kind, 2, comm, None) for kind in ("plain", "padded", "packed") for comm in ("p2p", "all_gather", "a2a")]
CASES += [(kind, 4, comm, None) for kind in ("plain", "padded", "packed") for comm in ("p2p", "all_gather", "a2a")]
CASES += [(kind, 4, "a2a+p2p", (2, 2)) for kind in ("plain", "padded", "packed")]


@pytest.mark.parametrize("kind,world,comm,mesh", CASES)
def test_batches_world_sizes_and_strategies(kind, world, comm, mesh):
    model = build("qwen2")
    full = make_batch(kind, "qwen2")
    base = cp_step(model, world, full, None, cp_comm_type=comm, mesh_shape=mesh, layout="zigzag")
    for savers in (SAVERS["offload"], dict(checkpoint=True, mlp_chunks=2), SAVERS["offload+mlp_chunks"]):
        got = cp_step(model, world, full, savers, cp_comm_type=comm, mesh_shape=mesh, layout="zigzag")
        _check(base, got, savers, world)


LM_LOSS_CASES = [("llama", "plain", 2, "zigzag"), ("gemma2", "packed", 4, "contiguous"),
                 ("mistral_window", "plain", 4, "interleaved"), ("qwen2", "padded", 2, "interleaved")]


@pytest.mark.parametrize("family,kind,world,layout", LM_LOSS_CASES)
def test_with_lm_loss(family, kind, world, layout):
    """The chunked head and loss (``cphf.lm_loss``) on a model with savers, against lm_loss without."""
    model = build(family)
    full = make_batch(kind, family)
    base = cp_step(model, world, full, None, layout=layout, loss="lm_loss")
    for savers in (SAVERS["checkpoint"], SAVERS["offload+mlp_chunks"]):
        _check(base, cp_step(model, world, full, savers, layout=layout, loss="lm_loss"), savers, world)


def test_re_calling_switches_and_undoes():
    """Each call states the whole set: calling twice changes nothing, a later call replaces an earlier
    one, ``checkpoint=False`` without ``mlp_chunks`` leaves the model as it was (same counts, no patched
    forward), and a deep copy of a saved model runs its own MLPs."""
    from cp_attention.integrations import huggingface as cphf

    model = build("llama")
    full = make_batch("plain", "llama")
    base = cp_step(model, 2, full, None)
    saved = build("llama")
    for savers in (SAVERS["offload+mlp_chunks"], SAVERS["offload+mlp_chunks"], dict(checkpoint=True, mlp_chunks=2),
                   dict(checkpoint="offload"), dict(checkpoint=False)):
        cphf.save_memory(saved, **savers)
        assert checkpointing_on(saved) is (savers["checkpoint"] is not False)  # either name's enable/disable
        _check(base, cp_step(saved, 2, full, None), savers, 2)  # cp_step deep-copies the saved model
    assert not checkpointing_on(saved)
    assert all("forward" not in m.__dict__ and not any(k.startswith("_cp_mlp") for k in m.__dict__)
               for m in saved.modules())
    cphf.save_memory(saved, mlp_chunks=4)
    twin = copy.deepcopy(saved)
    assert all(m.forward.__self__ is m for m in twin.modules() if "forward" in m.__dict__)
    assert sum("forward" in m.__dict__ for m in twin.modules()) == 6  # the two layers' MLPs and 2 RMSNorms each


def test_refusals_change_nothing():
    from cp_attention.integrations import huggingface as cphf

    model = build("llama")
    for bad in (1, 0, None, "Offload", "cpu"):
        with pytest.raises(ValueError, match=r"checkpoint=.*: expected True .*, 'offload' .* or False"):
            cphf.save_memory(model, checkpoint=bad)
    for bad in (0, -2, 2.0, True, "4"):
        with pytest.raises(ValueError, match=r"mlp_chunks=.*: expected None .* or an int >= 1"):
            cphf.save_memory(model, mlp_chunks=bad)
    with pytest.raises(ValueError, match="Linear does not support transformers' activation checkpointing"):
        cphf.save_memory(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="Linear has no transformers decoder layers"):
        cphf.save_memory(torch.nn.Linear(2, 2), checkpoint=False, mlp_chunks=2)
    model.model.layers[1].mlp.add_module("drop", torch.nn.Dropout(0.1))
    with pytest.raises(ValueError, match=r"LlamaDecoderLayer\.mlp\.drop \(Dropout\) has dropout p=0\.1"):
        cphf.save_memory(model, mlp_chunks=2)
    moe = build("qwen2_moe_window")
    with pytest.raises(ValueError, match="Qwen2MoeDecoderLayer.mlp.gate .* records as 'router_logits'"):
        cphf.save_memory(moe, checkpoint="offload", mlp_chunks=2)
    for m in (model, moe):  # refused before anything changed
        assert not checkpointing_on(m) and not any("forward" in x.__dict__ for x in m.modules())


def test_an_mlp_that_returns_more_than_one_tensor_is_refused_at_its_first_call():
    from cp_attention.integrations import huggingface as cphf

    class PairMLP(torch.nn.Module):  # like gpt-oss's MLP: (hidden states, router scores)
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(32, 32).double()

        def forward(self, x):
            return self.proj(x), x.sum(-1)

    model = build("llama")
    model.model.layers[0].mlp = PairMLP()
    cphf.save_memory(model, checkpoint=False, mlp_chunks=2)
    with pytest.raises(TypeError, match="PairMLP.forward returned tuple, not one tensor"):
        model(input_ids=make_batch("plain", "llama")["input_ids"])


def test_mlp_chunks_tile_the_norms_so_no_fp32_copy_of_the_sequence_is_saved():
    """HF's RMSNorm upcasts its input to fp32 and saves it (and more fp32 copies in backward); tiled with
    the MLP, a bf16 layer saves no fp32 tensor of the whole local sequence. Gemma's norms, which sum their
    weight's gradient in fp32, stay whole (chunks would round that sum differently)."""
    from cp_attention.integrations import huggingface as cphf
    from cp_attention.integrations.huggingface.savers import _per_token_parts

    def saved_fp32_rows(model, ids):
        """The sequence length of every fp32 [..., seq, hidden] tensor a decoder layer saves."""
        rows, inside = [], []
        for layer in model.model.layers:
            layer.register_forward_pre_hook(lambda *a: inside.append(1))
            layer.register_forward_hook(lambda *a: inside.pop() and None)

        def pack(t):
            if inside and t.dtype == torch.float32 and t.dim() >= 2 and t.shape[-1] == model.config.hidden_size:
                rows.append(t.shape[-2])
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, use_cache=False).logits.sum().backward()
        return rows

    torch.manual_seed(0)
    model = build("llama").to(torch.bfloat16)
    ids = torch.randint(0, 64, (1, 32))
    assert 32 in saved_fp32_rows(model, ids)  # whole-sequence fp32 saves without the saver
    cphf.save_memory(model, checkpoint=False, mlp_chunks=4)
    assert 32 not in saved_fp32_rows(model, ids)
    gemma = build("gemma2")
    names = [type(m).__name__ for layer in gemma.model.layers for m in _per_token_parts(layer)]
    assert names and all(not n.endswith("RMSNorm") for n in names), names
