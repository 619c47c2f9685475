"""The HF adapter with every rank in one process (the loopback ring): exact in fp64 on CPU, so the GPU
test of the adapter (tests/adapters/hf/test_cuda.py) runs the same path."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tests.support.hf.hf_loopback_cases import loopback_equivalence  # noqa: E402


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "interleaved"])
def test_hf_adapter_on_loopback_ranks_is_exact(layout):
    errors = loopback_equivalence(2, layout=layout)
    assert errors["logits"] < 1e-10 and errors["loss"] < 1e-10 and errors["grads"] < 1e-10, errors


@pytest.mark.parametrize("family,comm,mesh,layout", [
    ("llama", "all_gather", None, "zigzag"),
    ("qwen2", "a2a", None, "interleaved"),
    ("gemma2_window", "a2a+p2p", (2, 2), "contiguous"),
    ("gpt_oss_window", "auto", (2, 2), "zigzag"),
    ("mistral_window", "a2a", None, "zigzag"),
])
def test_hf_adapter_with_every_strategy_is_exact(family, comm, mesh, layout):
    """A whole model's logits, loss and rank-summed gradients with cp_comm_type set, against no CP."""
    errors = loopback_equivalence(4, family=family, layout=layout, cp_comm_type=comm, mesh_shape=mesh)
    # Gemma2's RMSNorm computes in fp32 even in an fp64 model: its gradients summed over ranks differ at
    # fp32 rounding (~2e-7 relative on the norm weights, as in tests/adapters/hf/test_equivalence.py and with p2p)
    grads = 2e-6 if family.startswith("gemma") else 1e-10
    assert errors["logits"] < 1e-10 and errors["loss"] < 1e-10 and errors["grads_rel"] < grads, errors


def test_unknown_or_impossible_strategies_are_refused():
    from cp_attention.integrations import huggingface as cphf
    from cp_attention.transport.loopback import LoopbackGroup
    from tests.support.hf.hf_cases import build

    with pytest.raises(ValueError, match="unknown cp_comm_type 'ulysses'"):
        cphf.apply_context_parallel(build("llama"), group=LoopbackGroup(2).rank(0), cp_comm_type="ulysses")
    # 4 query heads over 3 ranks: refused when the model first runs, on every rank alike
    errors = []
    try:
        loopback_equivalence(3, family="llama", cp_comm_type="a2a", seq=24)
    except ValueError as e:
        errors.append(str(e))
    assert errors and "needs heads divisible by 3, got 4" in errors[0], errors


@pytest.mark.parametrize("comm,mesh", [("a2a", None), ("a2a+p2p", (2, 2))])
def test_generate_after_a_strategys_prefill_equals_one_process(comm, mesh):
    """cphf.generate on a model patched with cp_comm_type: the prefill runs the strategy, decoding its
    pass-Q steps; the tokens and every step's scores equal single-process generate's."""
    import copy

    from cp_attention.integrations import huggingface as cphf
    from cp_attention.transport.loopback import LoopbackGroup
    from tests.support.hf.generate_cases import _compare, build, prompts

    world = 4 if mesh else 2
    ref = build("qwen2")
    ids, mask = prompts(2, 13, (0, 3))
    kwargs = dict(attention_mask=mask, return_dict_in_generate=True, output_scores=True, pad_token_id=0,
                  max_new_tokens=4)
    want = ref.generate(ids, **kwargs)
    loop = LoopbackGroup(world, mesh_shape=mesh)
    replicas = [cphf.apply_context_parallel(copy.deepcopy(ref), group=loop.rank(r), layout="zigzag", cp_comm_type=comm)
                for r in range(world)]
    for got in loop.run(lambda g: _compare(cphf.generate(replicas[g.rank], ids, group=g, layout="zigzag", **kwargs),
                                           want)):
        assert got["sequences"] and got["scores"] < 1e-10, got
