"""HuggingFace sliding-window cases that need no model: the attention entry on a non-causal layer, run
inside the gloo workers. The model-level windowed cases are ``hf_cases.equivalence`` with the
``*_window`` families."""

from __future__ import annotations

import torch


def _reference(q, k, v, scale: float, visible: torch.Tensor) -> torch.Tensor:
    """fp64 attention of q ``[B, H, S, D]`` over k/v ``[B, Hkv, S, D]`` where ``visible[i, j]``; ``[B, S, H, Dv]``."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q @ k.transpose(2, 3) * scale).masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def noncausal_window(rank: int, world_size: int, *, layout: str, window: int, seq: int = 32) -> dict:
    """``_ring_attention_forward`` on a non-causal layer with ``sliding_window=window``: transformers'
    flash-attention semantics, query i sees key j iff ``|i - j| < window``. Max abs differences of the
    output and of dq/dk/dv against fp64 attention with that mask, on this rank's shard."""
    import cp_attention as cpa
    from cp_attention.integrations.huggingface import attention as hf_attention
    from cp_attention.integrations.huggingface.checks import ForwardChecks

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, seq, 8, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    pos = torch.arange(seq)
    visible = (pos[:, None] - pos[None, :]).abs() < window
    want = _reference(q, k, v, 8 ** -0.5, visible)
    grad_out = torch.randn(want.shape, generator=g, dtype=torch.float64)
    want.backward(grad_out)

    lay = cpa.get_layout(layout)
    module = torch.nn.Module()
    module.is_causal = False
    checks = ForwardChecks(None, lay, rank, world_size)  # never run: the layer checks its own inputs
    module._cp_attention = hf_attention._CPState(None, lay, "auto", rank, world_size, checks)
    local = [lay.shard(t.detach(), 2, rank, world_size).requires_grad_() for t in (q, k, v)]
    out, _ = hf_attention._ring_attention_forward(module, *local, None, scaling=8 ** -0.5, sliding_window=window)
    out.backward(lay.shard(grad_out, 1, rank, world_size))
    diffs = {"out": (out - lay.shard(want.detach(), 1, rank, world_size)).abs().max().item()}
    for name, mine, full in zip(("dq", "dk", "dv"), local, (q, k, v)):
        diffs[name] = (mine.grad - lay.shard(full.grad, 2, rank, world_size)).abs().max().item()
    # what the test would see with the window dropped (every key visible)
    diffs["window_effect"] = (_reference(q, k, v, 8 ** -0.5, torch.ones_like(visible)) - want).abs().max().item()
    return diffs
