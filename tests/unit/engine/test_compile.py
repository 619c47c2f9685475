"""``torch.compile`` and the ring: ``ring_attention`` compiles around its graph break at world size 1 (no plan,
a plan passed in, a plan built inside) equal to eager, forward and backward, and ``fullgraph=True`` names the
graph break. A patched HF model compiled: tests/adapters/hf/test_compile.py."""

from __future__ import annotations

import pytest
import torch

import cp_attention
from tests.support.core import compile_cases as cases
from tests.support.core.compile_cases import WHY

_fresh_dynamo = pytest.fixture(autouse=True)(cases.fresh_dynamo)


def test_ring_attention_compiles_alone():
    for mode, diff in cases.ring_compiled_vs_eager(None, 0, 1).items():
        assert diff <= 1e-6, f"world size 1, {mode}: compiled differs from eager by {diff}"


def test_fullgraph_names_the_graph_break():
    q, k, v = cases.ring_inputs(0, 1)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def fn(q, k, v):
        return cp_attention.ring_attention(q, k, v, layout="zigzag", causal=True)

    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        fn(q, k, v)
    message = str(info.value)
    assert "ring_attention" in message and WHY in message, message
