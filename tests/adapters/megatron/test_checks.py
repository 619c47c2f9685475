"""Issue 12 for the Megatron adapter: never hang, agreed errors. What one CP rank's own data makes it
refuse (a mask, packed boundaries, its input shape, its batch) is raised alike on every rank, and a
checked model forward pays exactly one small collective for it, not one per layer."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="needs the megatron extra: pip install -e '.[megatron]'")

from tests.support.megatron import megatron_checks_cases as mcc  # noqa: E402

FP64 = 1e-10


def _same_error(results, name, kind, *fragments):
    errors = [r[name] for r in results]
    assert len(set(errors)) == 1, f"{name}: ranks raised different errors: {errors}"
    assert errors[0].startswith(kind + ":"), f"{name}: {errors[0]}"
    for fragment in fragments:
        assert fragment in errors[0], f"{name}: {fragment!r} not in {errors[0]!r}"


@pytest.mark.parametrize("world_size", (2, 3))
def test_mask_on_one_rank_and_none_on_the_others(pools, world_size):
    results = pools(world_size).run(mcc.mixed_masks, timeout=180)
    for name in ("layer_bad", "model_bad", "model_ring_after_forward"):
        _same_error(results, name, "NotImplementedError", "cannot honour any other attention_mask",
                    "(on CP rank 0; CP ranks with bad input: [0])")
    for rank, r in enumerate(results):
        assert r["model_bad_ring_calls"] == 0, f"rank {rank}: a layer ran before the refusal"
        for name in ("layer_causal_vs_none", "model_causal_vs_none", "model_after_refusal"):
            assert r[name] <= FP64, (rank, name, r[name])


def test_packed_boundaries_bad_on_one_rank(pools):
    results = pools(2).run(mcc.packed_one_rank_bad, timeout=180)
    for where in ("model", "layer"):
        _same_error(results, f"{where}/bad_boundaries", "ValueError", "packed_seq_params.cu_seqlens_q",
                    "(on CP rank 0; CP ranks with bad input: [0])")
        _same_error(results, f"{where}/other_documents", "ValueError", "packed_seq_params differ across the CP ranks",
                    "CP ranks [1] cut the same 24 tokens into other documents than CP rank 0")
    _same_error(results, "model/packed_on_one_rank", "ValueError",
                "packed_seq_params were given on CP ranks [1] but are None on CP ranks [0]")
    _same_error(results, "layer/packed_on_one_rank", "ValueError",
                "packed_seq_params were given on CP ranks [1] but are None on CP ranks [0]")
    assert [r["ring_calls"] for r in results] == [0, 0], "a layer of the model ran before a refusal"


def test_local_shapes_that_differ_are_refused_before_any_layer(pools):
    results = pools(2).run(mcc.shapes_differ, timeout=180)
    _same_error(results, "rows", "ValueError", "inputs (input_ids, else decoder_input) of different shapes",
                "(1, 12) on CP rank 0, (2, 12) on CP rank 1")
    _same_error(results, "layer_length", "ValueError", "queries of different shapes",
                "(14, 2, 4, 8) on CP rank 0, (12, 2, 4, 8) on CP rank 1")
    assert [r["ring_calls"] for r in results] == [0, 0]


def _collectives(counts):
    return {k: n for k, n in counts.items() if k in mcc.COLLECTIVES}


@pytest.mark.parametrize("world_size,layout", ((2, "zigzag"), (3, "interleaved")))
def test_a_checked_forward_runs_one_collective_for_its_checks(pools, world_size, layout):
    """Counted in the workers: collectives, Tensor.item/tolist and torch.equal called from integrations/
    (the ring's own P2P is not the adapter's and is not counted; its validation is counted as ``any:``)."""
    for rank, r in enumerate(pools(world_size).run(mcc.collectives_per_forward, layout=layout, timeout=300)):
        for name in ("plain", "mask", "mask_as_kwargs", "packed"):
            for layers in (2, 4):
                counts = r[f"{name}/{layers}"]
                assert r[f"{name}/{layers}/finite"], (rank, name, layers)
                assert _collectives(counts) == {"all_gather": 1}, (rank, name, layers, counts)
                # Not one collective more anywhere: the ring's validation needs none in a checked forward.
                assert counts.get("any:all_gather", 0) == 1 and len([k for k in counts if k.startswith("any:")]) == 1, \
                    (rank, name, layers, counts)
                assert counts.get("item", 0) == 0, (rank, name, layers, counts)
            # Per forward, not per layer: twice the layers cost exactly the same.
            assert r[f"{name}/2"] == r[f"{name}/4"], (rank, name, r[f"{name}/2"], r[f"{name}/4"])
        # One torch.equal for a mask (the hook's), none without one.
        assert r["plain/2"].get("equal", 0) == 0 and r["mask/2"].get("equal", 0) == 1, (rank, r)
        # Outside a checked forward a layer agrees on its own call, and the count sees per-layer collectives.
        assert _collectives(r["direct_layer"]) == {"all_gather": 1}, (rank, r["direct_layer"])
        assert _collectives(r["unhooked_mask/4"]) == {"all_gather": 4}, (rank, r["unhooked_mask/4"])


@pytest.mark.parametrize("world_size", (2, 3))
def test_get_batch_refusal_on_one_rank_is_raised_on_every_rank(pools, world_size):
    results = pools(world_size).run(mcc.batch_one_rank_bad, timeout=180)
    for name in ("ragged", "ragged_group"):
        _same_error(results, name, "ValueError", "batch['labels'] has sequence length 20",
                    "(on CP rank 0; CP ranks with bad input: [0])")
    _same_error(results, "packed", "ValueError", "packed_seq_params.cu_seqlens_q", "CP ranks with bad input: [0]")
    _same_error(results, "not_a_batch", "RuntimeError", "AttributeError", "CP ranks with bad input: [0]")
    assert all(r["good"] for r in results)
