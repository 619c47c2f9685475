"""FSDP2 over a (dp, cp) DeviceMesh with context parallelism (``cphf.parallelize``) on real gloo ranks:
after several optimizer steps the full parameters equal one process training on the global batch."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")

from tests.support.hf import fsdp_cases  # noqa: E402

EXACT = 1e-9  # relative, fp64 (the bound; AdamW's division amplifies rounding to ~1e-13)

# (dp, cp, layout, family, packed, activation checkpointing, optimizer, cp_comm_type, lm_loss's chunk_tokens
# (None: causal_lm_loss on full logits), mlp_chunks, offload_optimizer): every mesh with every layout, each
# family, packing, checkpointing off, on and offloaded, SGD (with momentum) and AdamW, every strategy a
# (dp, cp) mesh can run, the loss on full logits and in chunks smaller and larger than a rank's tokens, the
# MLP in chunks and the optimizer offloaded (CPUOffloadPolicy), all covered.
CASES = [
    (1, 2, "zigzag", "llama", False, False, "sgd", "p2p", None, None, False),
    (1, 2, "contiguous", "qwen2", True, True, "adamw", "p2p", 3, 2, False),
    (1, 2, "interleaved", "gpt_oss", False, "offload", "sgd", "p2p", 1024, None, True),
    (2, 2, "zigzag", "qwen2", False, "offload", "adamw", "p2p", 5, 3, True),
    # balanced: packed documents placed per batch (other documents every step and dp rank)
    (2, 2, "balanced", "mistral_window", True, False, "sgd", "all_gather", 1024, None, False),
    (2, 2, "interleaved", "gpt_oss", True, True, "adamw", "a2a", 7, None, False),
    (1, 4, "zigzag", "mistral_window", False, True, "sgd", "p2p", 2, 4, False),
    (1, 4, "contiguous", "llama", True, False, "adamw", "a2a", 1, None, True),
    (0, 4, "interleaved", "qwen2", False, False, "sgd", "auto", None, None, False),  # dp=0: a 1-D mesh named "cp"
]


def _id(case) -> str:
    dp, cp, layout, family, packed, ac, optim, comm, chunk, mlp, offload = case
    ac = {False: "noac", True: "ac", "offload": "acoffload"}[ac]
    loss = "logits" if chunk is None else f"chunk{chunk}"
    return (f"{dp or 'cp'}x{cp}-{layout}-{family}-{'packed' if packed else 'plain'}-{ac}-{optim}-{comm}-{loss}"
            f"{f'-mlp{mlp}' if mlp else ''}{'-offopt' if offload else ''}")


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_parameters_equal_single_process_on_the_global_batch(pools, case):
    dp, cp, layout, family, packed, ac, optim, comm, chunk, mlp, offload = case
    results = pools(max(dp, 1) * cp).run(fsdp_cases.equivalence, family=family, layout=layout, dp=dp, cp=cp,
                                         packed=packed, checkpointing=ac, optim=optim, cp_comm_type=comm,
                                         chunk_tokens=chunk, mlp_chunks=mlp, offload_optimizer=offload, timeout=300)
    what = _id(case)
    for rank, r in enumerate(results):
        assert r["impl"] == "cp_ring", f"{what}: rank {rank} not patched"
        assert r["moved"] > 1e-3, f"{what}: training did not move the parameters ({r['moved']:.2e})"
        assert r["params"] <= EXACT, f"{what}: rank {rank} parameters differ by {r['params']:.2e} (relative)"
        assert r["loss"] <= EXACT, f"{what}: rank {rank} losses differ by {r['loss']:.2e} (relative)"
        assert r["losses"] == results[0]["losses"], f"{what}: rank {rank}'s loss values differ from rank 0's"
        # FSDP shards every parameter over all dp x cp ranks: each holds about 1/(dp*cp) of them
        assert r["held"] <= r["full"] / (max(dp, 1) * cp) * 1.25, \
            f"{what}: rank {rank} holds {r['held']} of {r['full']}"
        assert r["offloaded"] == offload, f"{what}: rank {rank} CPUOffloadPolicy {r['offloaded']}, asked {offload}"
    assert sum(r["held"] for r in results) >= results[0]["full"], f"{what}: the shards do not cover the parameters"


REFUSALS = {
    "no_cp_dim": ("ValueError", "with a 'cp' dim"),
    "cp_not_world": ("ValueError", "must span every rank"),
    "already_fsdp": ("ValueError", "already wrapped by FSDP2"),
    "weights_differ": ("ValueError", "models differ"),
    "batch_differs": ("ValueError", "different batches"),
    "a2a_p2p": ("NotImplementedError", "parallelize cannot run cp_comm_type='a2a+p2p'"),
    "moe_mlp_chunks": ("ValueError", "parallelize(activation_checkpointing=False, mlp_chunks=2): save_memory"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_bad_input_is_refused_alike_on_every_rank(pools, case):
    kind, words = REFUSALS[case]
    results = pools(4).run(fsdp_cases.refusal, case=case, timeout=180)
    assert len(set(results)) == 1, f"{case}: the ranks raised differently: {results}"
    assert results[0][0] == kind and words in results[0][1], f"{case}: got {results[0]}"


def test_mixed_precision_policy(pools):
    results = pools(2).run(fsdp_cases.mixed_precision, timeout=180)
    for r in results:
        # fp32 compute, fp64 gradients: close to the fp64 run at fp32 rounding, not equal
        assert r["dtypes"] == ["torch.float32", "torch.float64"], r["dtypes"]
        assert r["loss"] <= 1e-5 and r["params"] <= 1e-4, r


def test_a_mesh_is_a_group_everywhere(pools):
    for rank, r in enumerate(pools(4).run(fsdp_cases.mesh_as_group, timeout=180)):
        assert all(r[key] for key in ("ring", "plan", "gather", "shard_batch")), (rank, r)
        assert r["loss"] <= 1e-12, (rank, r)


@pytest.mark.parametrize("kwargs,words", [
    (dict(activation_checkpointing="yes"), "activation_checkpointing='yes': expected True"),
    (dict(activation_checkpointing=1), "activation_checkpointing=1: expected True"),
    (dict(mlp_chunks=0), "mlp_chunks=0: expected None"),
    (dict(mlp_chunks=2.0), "mlp_chunks=2.0: expected None"),
    (dict(mlp_chunks=True), "mlp_chunks=True: expected None"),
    (dict(offload_optimizer="cpu"), "offload_optimizer='cpu': expected True"),
])
def test_bad_memory_saver_values_are_refused_by_name(kwargs, words):
    """Refused before the mesh is even looked at (so before any communication), naming the argument."""
    from cp_attention.integrations import huggingface as cphf

    with pytest.raises(ValueError, match=words):
        cphf.parallelize(fsdp_cases.build("llama"), None, **kwargs)
