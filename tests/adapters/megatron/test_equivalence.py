"""Megatron-core integration on real gloo ranks: a tiny GPTModel with CP equals the same model at CP=1."""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("megatron.core", reason="needs the megatron extra: pip install -e '.[megatron]'")

import cp_attention as cpa  # noqa: E402
from tests.support.megatron import megatron_cases as mc  # noqa: E402
from tests.support.megatron import megatron_packed_cases as mpc  # noqa: E402

FP64 = 1e-10  # docs/design.md: fp64 model, fp64 reference
FP32 = 2e-6  # megatron's own loss is computed in fp32

_REFS: dict = {}


def _reference(pools, with_mask=False, **model_kw):
    """The CP=1 run (megatron's own attention and RoPE), computed once per model in a 1-rank worker."""
    key = (with_mask, tuple(sorted(model_kw.items())))
    if key not in _REFS:
        _REFS[key] = pools(1).run(mc.reference, model_kw=model_kw, with_mask=with_mask, timeout=180)[0]
    return _REFS[key]


def _equivalence(pools, world_size, layout, with_mask=False, rope_layout=None, cp_comm_type=None, hierarchical=None,
                 **model_kw):
    ref = _reference(pools, with_mask=with_mask, **model_kw)
    return pools(world_size).run(mc.equivalence, layout=layout, ref=ref, model_kw=model_kw, with_mask=with_mask,
                                 rope_layout=rope_layout, cp_comm_type=cp_comm_type, hierarchical=hierarchical,
                                 timeout=180)


def _assert_equivalent(results, what):
    for rank, r in enumerate(results):
        assert r["finite"], f"{what}: rank {rank} produced NaN/Inf"
        assert r["attention"] == ["RingDotProductAttention", "SelfAttention"], (what, r["attention"])
        assert r["unpatched"], f"{what}: rank {rank} ran with megatron's CUDA hard-codes patched"
        for key in ("logits", "loss", "grads"):
            assert r[key] <= FP64, f"{what}: rank {rank} {key} differs by {r[key]:.3e}"
        assert r["mcore_loss"] <= FP32, f"{what}: rank {rank} megatron's loss differs by {r['mcore_loss']:.3e}"


# Unpacked batches: balanced IS zigzag without documents (tests/adapters/{hf,megatron}/test_balanced.py),
# so the unpacked matrices run it once, not again for every case zigzag runs.
PLAIN_LAYOUTS = tuple(name for name in cpa.LAYOUT_NAMES if name != "balanced")
CASES = list(itertools.product((2, 3, 4), PLAIN_LAYOUTS)) + [(2, "balanced")]


@pytest.mark.parametrize("world_size,layout", CASES, ids=[f"cp{w}-{lay}" for w, lay in CASES])
def test_gpt_model_matches_cp1(pools, world_size, layout):
    _assert_equivalent(_equivalence(pools, world_size, layout), f"{layout} cp={world_size}")


VARIANTS = {
    "mha": dict(num_query_groups=4),
    "mqa": dict(num_query_groups=1),
    "rotary_interleaved": dict(rotary_interleaved=True),
    "learned_absolute": dict(position_embedding_type="learned_absolute"),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("layout", ("zigzag", "interleaved"))
def test_model_variants_match_cp1(pools, variant, layout):
    _assert_equivalent(_equivalence(pools, 2, layout, **VARIANTS[variant]), f"{variant} {layout}")


@pytest.mark.parametrize("world_size,layout,comm,hierarchical", [
    (2, "interleaved", ["a2a", "all_gather"], None),
    (4, "zigzag", ["a2a+p2p", "auto"], (2, 2)),
    (4, "contiguous", "a2a+p2p", (2, 2)),
])
def test_per_layer_strategies_match_cp1(pools, world_size, layout, comm, hierarchical):
    """One strategy per layer through the layer spec (megatron-core 0.16's own list indexes with the
    1-based layer number); a2a+p2p over megatron's two hierarchical CP groups."""
    results = _equivalence(pools, world_size, layout, cp_comm_type=comm, hierarchical=hierarchical)
    _assert_equivalent(results, f"{layout} cp={world_size} {comm}")
    assert results[0]["comm_types"] == ([comm] * 2 if isinstance(comm, str) else comm)


@pytest.mark.parametrize("layout", PLAIN_LAYOUTS)
def test_causal_mask_sharded_by_the_layout_is_accepted(pools, layout):
    _assert_equivalent(_equivalence(pools, 2, layout, with_mask=True), f"{layout} with mask")


def test_rope_at_the_wrong_positions_is_detected(pools):
    """Megatron's own RoPE slicing is zigzag's: under interleaved it would be wrong, and visibly so."""
    results = _equivalence(pools, 2, "interleaved", rope_layout="zigzag")
    for key in ("logits", "grads"):
        assert min(r[key] for r in results) > 1e4 * FP64, (key, [r[key] for r in results])


REFUSED = {
    "not_prepared": ("RuntimeError", "apply_context_parallel(model)"),
    "attention_bias": ("NotImplementedError", "attention_bias"),
    "packed_sbhd": ("NotImplementedError", "packed_seq_params.qkv_format='sbhd' is not supported"),
    "packed_cross": ("NotImplementedError", "differ from the query's"),
    "packed_one_rank_bad": ("NotImplementedError", "(on CP rank 0; CP ranks with bad input: [0])"),
    "packed_mask": ("NotImplementedError", "attention_mask (1, 1, 12, 24) with packed sequences"),
    "packed_local_cp_size": ("NotImplementedError", "local_cp_size=1"),
    "packed_cp_group": ("NotImplementedError", "dynamic CP groups are not supported"),
    "packed_wrong_length": ("ValueError", "packed stream of 24 tokens, but this rank holds 10 tokens"),
    "packed_no_cu": ("ValueError", "cu_seqlens_q is None"),
    "packed_padding_too_short": ("ValueError", "document 1 has 5 real tokens (cu_seqlens_q) but only 2 padded"),
    "packed_mtp": ("NotImplementedError", "multi-token prediction (mtp_num_layers=1)"),
    "packed_batch_twice": ("ValueError", "given twice"),
    "packed_batch_rows": ("ValueError", "holds one row [1, 24, ...]"),
    "packed_unsplittable": ("ValueError", "cp_attention.pad_cu_seqlens(cu_seqlens, 4)"),
    "packed_batch_mask": ("ValueError", "takes no attention_mask"),
    "packed_rope_not_linked": ("NotImplementedError", "apply_context_parallel(model)"),
    "dropout_train": ("NotImplementedError", "attention_dropout=0.0"),
    "padding_mask": ("NotImplementedError", "cannot honour any other attention_mask"),
    "one_rank_bad_mask": ("NotImplementedError", "(on CP rank 0; CP ranks with bad input: [0])"),
    "mask_sliced_for_another_layout": ("NotImplementedError", "layout='interleaved'"),
    "unsharded_mask": ("NotImplementedError", "[b, 1, 12, 24]"),
    "cp_comm_type": ("ValueError", "unknown cp_comm_type 'ulysses'"),
    "a2a_p2p_without_levels": ("ValueError", "hierarchical_context_parallel_sizes=[a2a, p2p]"),
    "config_list_shifted": ("ValueError", "this layer's is 'all_gather' (entry 0), but megatron-core passed 'a2a'"),
    "spec_list_length": ("ValueError", "cp_comm_type lists 3 strategies, but the model has config.num_layers=2"),
    "a2a_heads": ("ValueError", "layer 1: cp_comm_type='a2a' splits the query heads over the 2 ranks of the group, "
                                "so it needs heads divisible by 2, got 3"),
    "window": ("ValueError", "config.window_size=(4, -2) must be (left, right)"),
    "softmax_type": ("ValueError", "softmax_type='sigmoid' is not known"),
    "cross_attention": ("NotImplementedError", "self attention only"),
    "cp_size_mismatch": ("ValueError", "context_parallel_size=1"),
    "unknown_layout": ("ValueError", "diagonal"),
    "unknown_kernel": ("ValueError", "no_such_kernel"),
    "no_ring_in_model": ("ValueError", "get_gpt_layer_ring_spec"),
    "mixed_layouts": ("ValueError", "['interleaved', 'zigzag']"),
    "rope_subclass": ("NotImplementedError", "ScaledRotaryEmbedding"),
    "mtp_not_zigzag": ("NotImplementedError", "multi-token prediction (mtp_num_layers=1)"),
    "ragged_batch": ("ValueError", "batch['labels'] has sequence length 20"),
    "unsplittable_batch": ("ValueError", "zigzag layout needs seq_len divisible by 2*world_size=4, got 6"),
    "te_backend": ("ImportError", "TransformerEngine"),
    "unknown_backend": ("ValueError", "'apex'"),
}


def test_unsupported_inputs_are_refused_on_every_rank(pools):
    results = [{**plain, **packed} for plain, packed in zip(pools(2).run(mc.refusals, timeout=180),
                                                            pools(2).run(mpc.packed_refusals, timeout=180))]
    for name, (exc, fragment) in REFUSED.items():
        for rank, r in enumerate(results):
            assert r[name].startswith(exc + ":"), f"{name} on rank {rank}: {r[name]}"
            assert fragment in r[name], f"{name} on rank {rank}: {fragment!r} not in {r[name]!r}"
        assert results[0][name] == results[1][name], f"{name}: ranks raised different errors"
    for _rank, r in enumerate(results):
        assert r["dropout_eval"] == "no error", r["dropout_eval"]  # dropout is a no-op in eval mode
        assert r["config_list_entry"] == "a2a", r["config_list_entry"]  # the list's entry 1 for layer 2
        assert r["rope_subclass_left_untouched"] == "ScaledRotaryEmbedding", "a refused model was half-modified"


def test_core_attention_at_cp1_is_megatrons_dot_product_attention(pools):
    results = pools(1).run(mc.core_attention_cp1, timeout=180)[0]
    for name, value in results.items():
        if name.endswith("/shape"):
            assert value, f"{name}: output shape differs from DotProductAttention's"
        else:
            assert value <= FP64, f"{name}: differs from DotProductAttention by {value:.3e}"


ROPE = {"plain": ({}, 0), "interleaved_pairs": ({"rotary_interleaved": True}, 0),
        "offset_and_interpolation": ({"seq_len_interpolation_factor": 2.0}, 5)}


@pytest.mark.parametrize("world_size", (1, 2, 3))
@pytest.mark.parametrize("rope", sorted(ROPE))
def test_rotary_rows_are_megatrons_table_at_global_positions(pools, rope, world_size):
    kw, offset = ROPE[rope]
    table = pools(1).run(mc.megatron_rope_table, kw=kw, offset=offset, timeout=120)[0]
    for rank, r in enumerate(pools(world_size).run(mc.rope_rows, table=table, kw=kw, offset=offset, timeout=120)):
        assert all(r.values()), (rank, r)


_PACKED_REFS: dict = {}


def _packed_references(pools, **model_kw):
    """Each document of the packed batches run on its own at CP=1 (megatron's attention and RoPE), per padding."""
    key = repr(sorted(model_kw.items()))  # values may be lists (window_attn_skip_freq)
    if key not in _PACKED_REFS:
        _PACKED_REFS[key] = {padded: pools(1).run(mpc.packed_reference, model_kw=model_kw, padded=padded,
                                                  timeout=180)[0] for padded in (False, True)}
    return _PACKED_REFS[key]


def _packed_equivalence(pools, world_size, layout, rope_layout=None, **model_kw):
    return pools(world_size).run(mpc.packed_equivalence, layout=layout, refs=_packed_references(pools, **model_kw),
                                 model_kw=model_kw, rope_layout=rope_layout, timeout=180)


PACKED_CASES = list(itertools.product((2, 3), cpa.LAYOUT_NAMES))


@pytest.mark.parametrize("world_size,layout", PACKED_CASES, ids=[f"cp{w}-{lay}" for w, lay in PACKED_CASES])
def test_packed_thd_batch_matches_each_document_alone(pools, world_size, layout):
    """A THD packed batch (documents of 1, 5, 2, 9, 7 tokens; padded or not) on CP ranks equals running each
    document unpacked at CP=1 with megatron's own attention: logits of real tokens, loss and gradients."""
    for rank, per_padding in enumerate(_packed_equivalence(pools, world_size, layout)):
        for padded, r in per_padding.items():
            what = f"{layout} cp={world_size} padded={padded} rank {rank}"
            assert r["finite"] and r["rope_in_ring"] and r["unpatched"] and r["wrapped_once"], (what, r)
            for key in ("logits", "loss", "grads"):
                assert r[key] <= FP64, f"{what}: {key} differs by {r[key]:.3e}"


def test_packed_learned_absolute_positions_restart_at_every_document(pools):
    for rank, per_padding in enumerate(_packed_equivalence(pools, 3, "interleaved",
                                                           position_embedding_type="learned_absolute")):
        for padded, r in per_padding.items():
            assert r["finite"] and r["rope_in_ring"], (rank, padded, r)
            assert max(r[k] for k in ("logits", "loss", "grads")) <= FP64, (rank, padded, r)


def test_packed_rope_at_the_wrong_positions_is_detected(pools):
    """The ring's packed RoPE rows follow the layout's sharding of the documents: another layout's rows
    (here zigzag's, TransformerEngine's own split of each document, under interleaved) are visibly wrong.
    (Rows at positions in the packed stream instead of within documents would differ only by rounding:
    RoPE scores depend on q and k's position difference, the same inside a document.)"""
    results = [r for per_padding in _packed_equivalence(pools, 2, "interleaved", rope_layout="zigzag")
               for r in per_padding.values()]
    for key in ("logits", "grads"):
        assert min(r[key] for r in results) > 1e4 * FP64, (key, [r[key] for r in results])


@pytest.mark.parametrize("causal", (True, False), ids=("causal", "no_mask"))
@pytest.mark.parametrize("layout", cpa.LAYOUT_NAMES)
def test_packed_padding_is_attended_by_no_real_token(pools, layout, causal):
    """cu_seqlens_q_padded: real tokens see only their document's real tokens, causal or not (GQA, fp64)."""
    for rank, r in enumerate(pools(3).run(mpc.packed_core_attention, layout=layout, causal=causal, timeout=120)):
        assert r["shape"] and r["finite"], (rank, r)
        assert r["out"] <= FP64 and r["grads"] <= FP64, (rank, r)


@pytest.mark.parametrize("world_size", (2, 3))
def test_packed_batch_sharding(pools, world_size):
    table = pools(1).run(mc.megatron_rope_table, kw={}, offset=0, timeout=120)[0]
    for rank, r in enumerate(pools(world_size).run(mpc.packed_batch_sharding, table=table, timeout=120)):
        assert all(r.values()), (rank, {k: v for k, v in r.items() if not v})


@pytest.mark.parametrize("world_size", (2, 4))
def test_batch_sharding(pools, world_size):
    for rank, r in enumerate(pools(world_size).run(mc.batch_sharding, timeout=120)):
        assert all(r.values()), (rank, r)


def test_layout_comes_from_the_spec_then_the_config(pools):
    for r in pools(2).run(mc.layout_from_config, timeout=120):
        assert r == {"config": "interleaved", "spec_wins": "contiguous", "default": "zigzag"}, r


def test_use_ring_attention_replaces_every_core_attention_slot():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from cp_attention.integrations import megatron as cpm

    local = get_gpt_layer_local_spec()
    ring = cpm.use_ring_attention(local, layout="interleaved")
    assert ring.submodules.self_attention.submodules.core_attention is cpm.ring_core_attention("interleaved")
    assert local.submodules.self_attention.submodules.core_attention is DotProductAttention, "input spec modified"
    assert issubclass(cpm.ring_core_attention("striped"), cpm.RingDotProductAttention)
    assert cpm.ring_core_attention("striped") is cpm.ring_core_attention("interleaved")
    block = TransformerBlockSubmodules(layer_specs=[get_gpt_layer_local_spec() for _ in range(3)])
    ring_block = cpm.use_ring_attention(block, layout="contiguous")
    assert len(ring_block.layer_specs) == 3
    for layer in ring_block.layer_specs:
        assert layer.submodules.self_attention.submodules.core_attention is cpm.ring_core_attention("contiguous")
    with pytest.raises(ValueError, match="no core_attention slot"):
        cpm.use_ring_attention(local.submodules.mlp)
    with pytest.raises(ValueError, match="unknown layout 'diagonal'"):
        cpm.ring_core_attention("diagonal")


EXAMPLE = ["--dtype", "float64", "--steps", "3", "--seq-len", "48", "--batch", "2", "--log-every", "100"]


def test_example_tp_and_dp_compose_with_cp(pools):
    """examples/pretrain_megatron.py: TP=2 x CP=2 and CP=2 x DP=2 train exactly like CP=1 (3 AdamW steps);
    the CP x DP run with one strategy per layer (--cp-comm-type a2a,all_gather)."""
    single = pools(1).run(mc.example_losses, argv=EXAMPLE, timeout=180)[0]
    tp_cp = pools(4).run(mc.example_losses, argv=EXAMPLE + ["--tp-size", "2", "--layout", "interleaved"],
                         timeout=180)
    dp = pools(2).run(mc.example_losses, argv=EXAMPLE + ["--cp-size", "1"], timeout=180)
    cp_dp = pools(4).run(mc.example_losses, argv=EXAMPLE + ["--cp-size", "2", "--layout", "contiguous",
                                                          "--cp-comm-type", "a2a,all_gather"], timeout=180)
    # megatron's cross-entropy runs in fp32 even for an fp64 model: docs/design.md's fp32 bound.
    assert len(single) == 3 and single[-1] < single[0], single
    for rank, losses in enumerate(tp_cp):
        assert max(abs(a - b) for a, b in zip(losses, single)) <= FP32, (rank, losses, single)
    for rank, losses in enumerate(cp_dp):  # DP replicas see different batches: compare with DP alone
        assert max(abs(a - b) for a, b in zip(losses, dp[rank // 2])) <= FP32, (rank, losses, dp)
    assert max(abs(a - b) for a, b in zip(dp[0], single)) > 1e-3, "DP replicas did not get their own batches"


@pytest.mark.parametrize("layout", ("zigzag", "interleaved"))
def test_cp_group_from_pg_collection(pools, layout):
    for rank, r in enumerate(pools(4).run(mc.pg_collection_group, layout=layout, timeout=120)):
        assert r["group"] and r["error"] <= FP64, (rank, r)


def test_hierarchical_levels_in_megatrons_order(pools):
    for rank, r in enumerate(pools(4).run(mc.hierarchical_levels, timeout=120)):
        assert r["levels"] == ((rank // 2, 2), (rank % 2, 2)), (rank, r)
        if rank in (1, 2):
            assert r["swapped"].startswith("ValueError: megatron's hierarchical CP groups do not split the CP group "
                                           f"as a2a+p2p needs: CP rank {rank} of 4 is rank {rank // 2} of 2 in "
                                           "level 0"), r
            assert r["swapped_p2p"], r  # levels that cannot serve a2a+p2p are dropped, not used
        else:  # the formula holds here: a rank cannot see the others' groups without communicating
            assert r["swapped"] == "no error", r


@pytest.mark.parametrize("world_size", (2, 3))
@pytest.mark.parametrize("layout", PLAIN_LAYOUTS)
@pytest.mark.parametrize("softmax_type", ("off-by-one", "learnable"))
def test_softmax_type_sinks_are_exact(pools, world_size, layout, softmax_type):
    for rank, r in enumerate(pools(world_size).run(mc.softmax_sinks, layout=layout, softmax_type=softmax_type,
                                                   timeout=120)):
        assert r["kind"] == ("Parameter" if softmax_type == "learnable" else "Tensor"), r
        assert r["sink_effect"] > 1e-3, r  # a learnable offset that stayed zero would test nothing new
        assert r["out"] <= 1e-10 and r["grads"] <= 1e-10, (rank, r)
        assert r.get("offset_grad", 0.0) <= 1e-10, (rank, r)
