"""``torch.compile``: the ring and a patched HF model compile, and compiled equals eager.

Every context-parallel entry point (``ring_attention``, ``plan``, the transports' collectives, the HF
attention and mask functions and the model's forward checks) runs eagerly under ``torch.compile``: a
named graph break (``cp_attention.transport.eager``). These tests pin what that buys:

- the ring compiled at world size 1, on loopback threads and on real gloo ranks (no plan, a plan
  passed in, a plan built inside the compiled function) equals eager, forward and backward;
- a patched tiny Llama compiled (``aot_eager``; ``inductor`` where a C++ compiler is on PATH) gives
  eager's loss and gradients at world size 1 and 2 (threads and processes), packed batches too, and
  still refuses bad input with the eager error (the checks are not compiled away);
- ``fullgraph=True`` fails with a message naming the entry point and why it is a graph break.

Before the fix a process group reached Dynamo, which failed internally ("Member 'exchange' is not
registered"). Tiny shapes: compile time on a small machine is the cost here.
"""

from __future__ import annotations

import copy
import os
import shutil

import pytest
import torch

import cp_attention
from cp_attention.transport.loopback import LoopbackGroup
from cp_attention.versions import parse_version

SEQ, VOCAB = 16, 64
# What a fullgraph compile's error must say: why a context-parallel entry point is a graph break.
WHY = "runs eagerly: a graph break under torch.compile"
# Reasons a compiled call differs from eager only by rounding: fused or reordered fp32 ops.
TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # each test compiles from scratch: no cache entry or recompile limit carries over
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def _has_cxx() -> bool:
    return any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "g++", "c++", "clang++"))


# ---------------------------------------------------------------------------------------------- the ring


def _ring_inputs(rank: int, world: int):
    gen = torch.Generator().manual_seed(0)  # the same full tensors on every rank (no shared global RNG)
    q, k, v = (torch.randn(1, SEQ, 4, 8, generator=gen) for _ in range(3))
    layout = cp_attention.get_layout("zigzag")
    return [layout.shard(t, dim=1, rank=rank, world_size=world) for t in (q, k, v)]


def _ring_step(q, k, v, group, mode: str, backend: "str | None"):
    """Out and q/k/v grads of a function with compiled ops around the ring; ``mode``: how it gets its plan."""
    layout = cp_attention.get_layout("zigzag")
    prebuilt = cp_attention.plan(layout, group, causal=True)

    def fn(q, k, v, plan):
        q = q * 1.5  # compiled ops before and after the graph break
        if mode == "prebuilt":
            out = cp_attention.ring_attention(q, k, v, plan=plan)
        elif mode == "inside":
            out = cp_attention.ring_attention(q, k, v, plan=cp_attention.plan(layout, group, causal=True))
        else:
            out = cp_attention.ring_attention(q, k, v, group, layout, causal=True)
        return out.tanh()

    run = fn if backend is None else torch.compile(fn, backend=backend)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = run(*leaves, prebuilt)
    out.square().sum().backward()
    return [out.detach(), *(t.grad for t in leaves)]


def _ring_compiled_vs_eager(group, rank: int, world: int) -> dict[str, float]:
    q, k, v = _ring_inputs(rank, world)
    diffs = {}
    for mode in ("implicit", "prebuilt", "inside"):
        eager = _ring_step(q, k, v, group, mode, None)
        compiled = _ring_step(q, k, v, group, mode, "aot_eager")
        diffs[mode] = max(float((a - b).abs().max()) for a, b in zip(eager, compiled))
    return diffs


def test_ring_attention_compiles_alone():
    for mode, diff in _ring_compiled_vs_eager(None, 0, 1).items():
        assert diff <= 1e-6, f"world size 1, {mode}: compiled differs from eager by {diff}"


def test_fullgraph_names_the_graph_break():
    q, k, v = _ring_inputs(0, 1)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def fn(q, k, v):
        return cp_attention.ring_attention(q, k, v, layout="zigzag", causal=True)

    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        fn(q, k, v)
    message = str(info.value)
    assert "ring_attention" in message and WHY in message, message


# ---------------------------------------------------------------------------------------------- HF


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(cfg)


def _batches() -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, VOCAB, (1, SEQ), generator=gen) for _ in range(2)]
    packed = torch.cat([torch.arange(6), torch.arange(SEQ - 6)])[None]  # two documents: a packed batch
    return [{"input_ids": ids[0]}, {"input_ids": ids[1], "position_ids": packed}]


def _hf_losses_and_grads(base, group, backend: "str | None", batches) -> list[list[torch.Tensor]]:
    """Per batch: [loss, *grads] of a fresh copy of ``base`` patched for ``group``, compiled with ``backend``."""
    from cp_attention.integrations import huggingface as cphf

    model = cphf.apply_context_parallel(copy.deepcopy(base), group=group, layout="zigzag")
    run = model if backend is None else torch.compile(model, backend=backend)
    results = []
    for batch in batches:
        model.zero_grad(set_to_none=True)
        local = cphf.shard_batch(batch, group=group, layout="zigzag")
        out = run(**cphf.model_inputs(local), use_cache=False)
        loss = cphf.causal_lm_loss(out.logits, local["shift_labels"], group=group)
        loss.backward()
        results.append([loss.detach(), *(p.grad for p in model.parameters())])
    return results


def _hf_compiled_vs_eager(group, base, batches, backend: str) -> float:
    eager = _hf_losses_and_grads(base, group, None, batches)
    compiled = _hf_losses_and_grads(base, group, backend, batches)
    for n, (e, c) in enumerate(zip(eager, compiled)):
        for i, (a, b) in enumerate(zip(e, c)):
            torch.testing.assert_close(b, a, **TOL, msg=lambda m: f"batch {n}, {'loss' if i == 0 else f'grad {i}'}: {m}")
    return max(float((a - b).abs().max()) for e, c in zip(eager, compiled) for a, b in zip(e, c))


def _bad_positions_error(group, base, backend: "str | None") -> str:
    """The error a patched model (compiled with ``backend``) raises for position ids that are not the layout's."""
    from cp_attention.integrations import huggingface as cphf

    model = cphf.apply_context_parallel(copy.deepcopy(base), group=group, layout="zigzag")
    run = model if backend is None else torch.compile(model, backend=backend)
    local = cphf.model_inputs(cphf.shard_batch(_batches()[0], group=group, layout="zigzag"))
    local["position_ids"] = local["position_ids"].flip(-1)
    with pytest.raises(ValueError) as info:
        run(**local, use_cache=False)
    return str(info.value)


def test_patched_llama_compiled_at_world_size_1():
    pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
    _hf_compiled_vs_eager(None, _llama(), _batches()[:1], "aot_eager")  # untouched at world size 1


@pytest.mark.skipif(parse_version(torch.__version__) < (2, 13), reason=(
    "Dynamo compiling in two threads at once (the loopback ring's ranks) fails in torch's own metrics context "
    "('Metric(s) ... have already been set in the current context') on torch 2.9.1; 2.13 is the first release "
    "the suite ran it on. Ranks in processes compile on every supported torch (test_compiled_on_gloo_ranks)"))
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.skipif(
    not _has_cxx(), reason="inductor on CPU needs a C++ compiler (g++, c++ or clang++; $CXX names another)"))])
def test_patched_llama_compiled_on_loopback(backend):
    """Two ranks as threads of this process: Dynamo compiles each rank's model (one cache entry each)."""
    pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
    base, batches = _llama(), _batches()
    LoopbackGroup(2).run(lambda h: _hf_compiled_vs_eager(h, base, batches, backend))
    breaks = torch._dynamo.utils.counters["graph_break"]
    assert any(WHY in reason for reason in breaks), f"CP ran traced, not as graph breaks: {list(breaks)}"
    if backend == "aot_eager":  # the forward checks still run, and refuse as in eager
        eager, compiled = LoopbackGroup(2).run(lambda h: (_bad_positions_error(h, base, None),
                                                         _bad_positions_error(h, base, backend)))[0]
        assert compiled == eager


# ---------------------------------------------------------------------------------------------- gloo


def _gloo_case(rank: int, world_size: int) -> dict[str, float]:
    """On every rank of a gloo group: the ring (three ways to get a plan) and a patched Llama, compiled
    with aot_eager, against eager; the largest differences, and the error of a fullgraph compile."""
    torch._dynamo.reset()
    try:
        diffs = _ring_compiled_vs_eager(None, rank, world_size)
        diffs["llama"] = _hf_compiled_vs_eager(None, _llama(), _batches(), "aot_eager")
        from cp_attention.integrations import huggingface as cphf

        torch._dynamo.reset()  # a fresh cache: no frame here has reached Dynamo's recompile limit
        model = torch.compile(cphf.apply_context_parallel(_llama(), layout="zigzag"), backend="aot_eager",
                              fullgraph=True)
        local = cphf.model_inputs(cphf.shard_batch(_batches()[0], layout="zigzag"))
        try:
            model(**local, use_cache=False)
            diffs["fullgraph"] = "compiled"
        except torch._dynamo.exc.Unsupported as e:
            diffs["fullgraph"] = str(e)
        return diffs
    finally:
        torch._dynamo.reset()


@pytest.mark.slow
def test_compiled_on_gloo_ranks(pools):
    """Real processes: a process group is what Dynamo failed on before."""
    pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
    for rank, diffs in enumerate(pools(2).run(_gloo_case, timeout=240)):
        fullgraph = diffs.pop("fullgraph")
        for name, diff in diffs.items():
            assert diff <= 1e-5, f"rank {rank}, {name}: compiled differs from eager by {diff}"
        assert WHY in fullgraph, fullgraph  # at the first CP entry point it meets (the mask function)
