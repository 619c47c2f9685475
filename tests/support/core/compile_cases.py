"""The ``torch.compile`` cases shared by tests/unit/engine/test_compile.py (the ring) and
tests/adapters/hf/test_compile.py (a patched HF model): inputs, the compiled-vs-eager comparisons and the
gloo pool case."""

from __future__ import annotations

import copy
import os
import shutil

import pytest
import torch

import cp_attention

SEQ, VOCAB = 16, 64
# What a fullgraph compile's error must say: why a context-parallel entry point is a graph break.
WHY = "runs eagerly: a graph break under torch.compile"
# Reasons a compiled call differs from eager only by rounding: fused or reordered fp32 ops.
TOL = dict(rtol=1e-5, atol=1e-6)



def fresh_dynamo():
    """Each test compiles from scratch: no cache entry or recompile limit carries over."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def has_cxx() -> bool:
    return any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "g++", "c++", "clang++"))


def ring_inputs(rank: int, world: int):
    gen = torch.Generator().manual_seed(0)  # the same full tensors on every rank (no shared global RNG)
    q, k, v = (torch.randn(1, SEQ, 4, 8, generator=gen) for _ in range(3))
    layout = cp_attention.get_layout("zigzag")
    return [layout.shard(t, dim=1, rank=rank, world_size=world) for t in (q, k, v)]


def ring_step(q, k, v, group, mode: str, backend: str | None):
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


def ring_compiled_vs_eager(group, rank: int, world: int) -> dict[str, float]:
    q, k, v = ring_inputs(rank, world)
    diffs = {}
    for mode in ("implicit", "prebuilt", "inside"):
        eager = ring_step(q, k, v, group, mode, None)
        compiled = ring_step(q, k, v, group, mode, "aot_eager")
        diffs[mode] = max(float((a - b).abs().max()) for a, b in zip(eager, compiled))
    return diffs


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(cfg)


def batches() -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, VOCAB, (1, SEQ), generator=gen) for _ in range(2)]
    packed = torch.cat([torch.arange(6), torch.arange(SEQ - 6)])[None]  # two documents: a packed batch
    return [{"input_ids": ids[0]}, {"input_ids": ids[1], "position_ids": packed}]


def hf_losses_and_grads(base, group, backend: str | None, batches) -> list[list[torch.Tensor]]:
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


def hf_compiled_vs_eager(group, base, batches, backend: str) -> float:
    eager = hf_losses_and_grads(base, group, None, batches)
    compiled = hf_losses_and_grads(base, group, backend, batches)
    for n, (e, c) in enumerate(zip(eager, compiled)):
        for i, (a, b) in enumerate(zip(e, c)):
            torch.testing.assert_close(
                b, a, **TOL, msg=lambda m, n=n, i=i: f"batch {n}, {'loss' if i == 0 else f'grad {i}'}: {m}")
    return max(float((a - b).abs().max()) for e, c in zip(eager, compiled) for a, b in zip(e, c))


def bad_positions_error(group, base, backend: str | None) -> str:
    """The error a patched model (compiled with ``backend``) raises for position ids that are not the layout's."""
    from cp_attention.integrations import huggingface as cphf

    model = cphf.apply_context_parallel(copy.deepcopy(base), group=group, layout="zigzag")
    run = model if backend is None else torch.compile(model, backend=backend)
    local = cphf.model_inputs(cphf.shard_batch(batches()[0], group=group, layout="zigzag"))
    local["position_ids"] = local["position_ids"].flip(-1)
    with pytest.raises(ValueError) as info:
        run(**local, use_cache=False)
    return str(info.value)


def gloo_case(rank: int, world_size: int) -> dict[str, float]:
    """On every rank of a gloo group: the ring (three ways to get a plan) and a patched Llama, compiled
    with aot_eager, against eager; the largest differences, and the error of a fullgraph compile."""
    torch._dynamo.reset()
    try:
        diffs = ring_compiled_vs_eager(None, rank, world_size)
        diffs["llama"] = hf_compiled_vs_eager(None, llama(), batches(), "aot_eager")
        from cp_attention.integrations import huggingface as cphf

        torch._dynamo.reset()  # a fresh cache: no frame here has reached Dynamo's recompile limit
        model = torch.compile(cphf.apply_context_parallel(llama(), layout="zigzag"), backend="aot_eager",
                              fullgraph=True)
        local = cphf.model_inputs(cphf.shard_batch(batches()[0], layout="zigzag"))
        try:
            model(**local, use_cache=False)
            diffs["fullgraph"] = "compiled"
        except torch._dynamo.exc.Unsupported as e:
            diffs["fullgraph"] = str(e)
        return diffs
    finally:
        torch._dynamo.reset()
