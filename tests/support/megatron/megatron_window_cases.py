"""Sliding-window cases of the Megatron adapter (issue 11) at the core-attention level, run inside the gloo
workers. The reference is megatron's own local ``DotProductAttention`` with its own sliding-window mask
(``get_sliding_window_causal_mask``), at CP=1 on the full sequence; the model-level cases are
:func:`tests.support.megatron.megatron_cases.equivalence` and
:func:`tests.support.megatron.megatron_packed_cases.packed_equivalence`."""

from __future__ import annotations

import torch

from .megatron_cases import SEQ, _qkv, _ring, config, parallel_state
from .megatron_cpu import megatron_cuda_hardcodes_on_cpu

SEED = 21


def _dout() -> torch.Tensor:
    return torch.randn(SEQ, 2, 4 * 8, generator=torch.Generator().manual_seed(SEED + 1), dtype=torch.float64)


def _mask_type(causal: bool):
    from megatron.core.transformer.enums import AttnMaskType

    return AttnMaskType.causal if causal else AttnMaskType.no_mask


def megatron_window_reference(rank: int, world_size: int, causal: bool, window: tuple) -> dict:
    """megatron's ``DotProductAttention`` (CP=1, window_size=window) on the full q, k, v (GQA, fp64):
    its output and the q, k, v gradients for :func:`_dout`."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    with megatron_cuda_hardcodes_on_cpu():
        parallel_state(1)
        attention = DotProductAttention(config=config(1, window_size=window), layer_number=1,
                                        attn_mask_type=_mask_type(causal), attention_type="self")
        q, k, v = (t.requires_grad_() for t in _qkv(SEQ, seed=SEED))
        out = attention(q, k, v, None)
        out.backward(_dout())
    return {"out": out.detach(), "grads": [q.grad, k.grad, v.grad]}


def window_core_attention(rank: int, world_size: int, layout: str, causal: bool, window: tuple, ref: dict) -> dict:
    """RingDotProductAttention with ``config.window_size=window`` on this rank's shard vs ``ref``
    (:func:`megatron_window_reference`): output and q, k, v gradients, and the window the layer took."""
    import cp_attention as cpa

    parallel_state(world_size)
    ring = _ring(world_size, layout=layout, cfg=config(world_size, window_size=window),
                 attn_mask_type=_mask_type(causal))
    ring.global_positions_ready = True
    lay = cpa.get_layout(layout)

    def mine(t: torch.Tensor) -> torch.Tensor:
        return lay.shard(t, 0, rank, world_size)

    local = [mine(t).requires_grad_() for t in _qkv(SEQ, seed=SEED)]
    got = ring(*local, None)
    got.backward(mine(_dout()))
    return {
        "window": ring.window_size,
        "out": (got - mine(ref["out"])).abs().max().item(),
        "grads": max((a.grad - mine(b)).abs().max().item() for a, b in zip(local, ref["grads"])),
        "finite": bool(torch.isfinite(got).all()) and all(bool(torch.isfinite(a.grad).all()) for a in local),
    }
