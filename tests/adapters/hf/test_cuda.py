"""The HF adapter on one GPU: N ranks in one process (the loopback ring), real CUDA kernels, against the
unpatched model in the same dtype. (The Megatron adapter runs on CUDA in tests/system/test_train_gpu.py through
examples/pretrain_megatron.py.) Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

pytest.importorskip("transformers")

from tests.support.hf.hf_loopback_cases import loopback_equivalence  # noqa: E402


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "interleaved"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_hf_adapter_bf16_on_cuda(layout, world_size):
    errors = loopback_equivalence(world_size, layout=layout, device="cuda", dtype=torch.bfloat16, seq=256)
    # bf16 on CPU (the same model) gives loss 2e-5, logits 2e-3, grads_rel 7e-3
    assert errors["loss"] < 5e-3 and errors["logits"] < 0.1 and errors["grads_rel"] < 0.05, errors


@pytest.mark.parametrize("layout", ["zigzag", "interleaved"])
def test_hf_adapter_fp32_on_cuda(layout):
    errors = loopback_equivalence(2, layout=layout, device="cuda", dtype=torch.float32, seq=128)
    assert errors["loss"] < 1e-4 and errors["logits"] < 1e-3 and errors["grads_rel"] < 1e-3, errors
