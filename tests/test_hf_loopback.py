"""The HF adapter with every rank in one process (the loopback ring): exact in fp64 on CPU, so the GPU
test of the adapter (tests/test_adapters_cuda.py) runs the same path."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from .hf_loopback_cases import loopback_equivalence  # noqa: E402


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "interleaved"])
def test_hf_adapter_on_loopback_ranks_is_exact(layout):
    errors = loopback_equivalence(2, layout=layout)
    assert errors["logits"] < 1e-10 and errors["loss"] < 1e-10 and errors["grads"] < 1e-10, errors
