"""The ring on one GPU: every layout and N in {2, 3, 4, 8}, all ranks in one process through the loopback
ring, with the real CUDA kernels ("auto" picks them), against fp64 full attention. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.support.core.loopback_cases import loopback_errors
from tests.support.core.reference import BF16_GQA, TOLERANCES

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _assert_within(errors: dict) -> None:
    bad = {k: v for k, v in errors.items() if v > 0}
    assert not bad, f"beyond tolerance: {bad}"


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "interleaved"])
@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_bf16_on_cuda(layout, world_size, causal):
    # GQA 8:2 at head_dim 64, 128 tokens per rank: blocks of unequal query and key lengths under
    # interleaved and zigzag, so a kernel's causal alignment is exercised.
    _assert_within(loopback_errors(world_size, layout=layout, causal=causal, dtype=torch.bfloat16, device="cuda",
                                   heads=8, kv_heads=2, head_dim=64, local_len=128, **BF16_GQA))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "interleaved"])
def test_ring_fp32_on_cuda(layout):
    _assert_within(loopback_errors(4, layout=layout, causal=True, dtype=torch.float32, device="cuda",
                                   heads=4, kv_heads=4, head_dim=32, v_dim=48, local_len=64, atol=1e-4))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "interleaved"])
def test_ring_packed_and_windowed_on_cuda(layout):
    _assert_within(loopback_errors(4, layout=layout, causal=True, dtype=torch.bfloat16, device="cuda", heads=8,
                                   kv_heads=8, head_dim=64, local_len=96, lengths=[1, 100, 7, 200, 3, 73],
                                   **TOLERANCES[torch.bfloat16]))
    _assert_within(loopback_errors(4, layout=layout, causal=True, dtype=torch.bfloat16, device="cuda", heads=8,
                                   kv_heads=8, head_dim=64, local_len=128, window=(100, -1),
                                   **TOLERANCES[torch.bfloat16]))


@pytest.mark.parametrize("comm,mesh", [("all_gather", None), ("a2a", None), ("a2a+p2p", (2, 2))])
@pytest.mark.parametrize("layout", ["zigzag", "interleaved"])
def test_strategies_on_cuda(comm, mesh, layout):
    """all_gather, Ulysses and a2a+p2p with the real CUDA kernels: plain, packed, windowed, sinks + LSE grad."""
    common = dict(layout=layout, causal=True, dtype=torch.bfloat16, device="cuda", heads=8, kv_heads=2, head_dim=64,
                  cp_comm_type=comm, mesh_shape=mesh, **BF16_GQA)
    _assert_within(loopback_errors(4, local_len=128, **common))
    _assert_within(loopback_errors(4, local_len=96, lengths=[1, 100, 7, 200, 3, 73], **common))
    _assert_within(loopback_errors(4, local_len=128, window=(100, -1), sinks=True, lse_grad=True, **common))
