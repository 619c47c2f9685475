"""Ring attention with all N ranks in one process (cp_attention.transport.loopback), against an fp64 reference.

Shared by tests/test_loopback.py (CPU, fp64, in CI) and tests/test_ring_cuda.py (one GPU, real CUDA
kernels). The reference runs on the CPU in fp64 and never sees the sharding or the packing.
"""

from __future__ import annotations

import torch

import cp_attention as cpa
from cp_attention.layouts.documents import cu_seqlens_from_lengths
from cp_attention.transport.loopback import LoopbackGroup

from .reference import excess_error, reference_attention


def _reference(q, k, v, dout, causal: bool, scale: float, cu: list[int], window) -> tuple[torch.Tensor, ...]:
    """out, lse, dq, dk, dv in fp64 on the CPU; per document when ``cu`` has several."""
    qr, kr, vr = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    parts = [reference_attention(qr[:, a:b], kr[:, a:b], vr[:, a:b], causal, scale, window=window)
             for a, b in zip(cu, cu[1:])]
    out = torch.cat([o for o, _ in parts], 1)
    lse = torch.cat([s for _, s in parts], 2)
    (out * dout.cpu().double()).sum().backward()
    return out, lse, qr.grad, kr.grad, vr.grad


def loopback_errors(world_size: int, *, layout: str, causal: bool, dtype: torch.dtype = torch.float64,
                    device: str = "cpu", kernel: str = "auto", heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                    v_dim: "int | None" = None, local_len: int = 8, lengths: "list[int] | None" = None,
                    window: tuple = (-1, -1), atol: float = 1e-10, rtol: float = 0.0, seed: int = 0,
                    use_plan: bool = False) -> dict:
    """Excess error over tolerance (<= 0 passes) of out, lse, dq, dk, dv, the worst over the ranks.

    ``lengths``: packed documents (their sum must be ``local_len * world_size``); None: one sequence.
    ``use_plan``: each rank builds the batch's plan and calls with it (twice: the second call reuses it).
    """
    total = local_len * world_size
    v_dim = v_dim or head_dim
    cu = list(cu_seqlens_from_lengths(lengths)) if lengths else [0, total]
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, total, h, d, generator=g).to(dtype)
               for h, d in ((heads, head_dim), (kv_heads, head_dim), (kv_heads, v_dim)))
    dout = torch.randn(1, total, heads, v_dim, generator=g).to(dtype)
    scale = head_dim ** -0.5
    ref = _reference(q, k, v, dout, causal, scale, cu, window)
    lay = cpa.get_layout(layout)
    packed = dict(cu_seqlens=cu) if lengths else {}

    def rank_fn(group, r: int) -> tuple[torch.Tensor, ...]:
        shard = lambda t, dim=1: lay.shard(t, dim, r, world_size, **packed).to(device)  # noqa: E731
        ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
        cu_arg = torch.tensor(cu) if lengths else None
        if use_plan:
            plan = cpa.plan(lay, group, causal=causal, cu_seqlens=cu_arg, window_size=tuple(window))
            cpa.ring_attention(ql.detach(), kl.detach(), vl.detach(), kernel=kernel, plan=plan)  # a layer before
            out, lse = cpa.ring_attention(ql, kl, vl, kernel=kernel, return_lse=True, plan=plan)
        else:
            out, lse = cpa.ring_attention(ql, kl, vl, group=group, layout=lay, causal=causal, kernel=kernel,
                                          return_lse=True, window_size=tuple(window), cu_seqlens=cu_arg)
        out.backward(shard(dout))
        return out, lse, ql.grad, kl.grad, vl.grad

    loop = LoopbackGroup(world_size)
    results = loop.run(lambda group: rank_fn(group, group.rank))
    errors = {}
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        dim = 2 if name == "lse" else 1
        errors[name] = max(excess_error(results[r][i].cpu(), lay.shard(ref[i], dim, r, world_size, **packed),
                                        atol, rtol) for r in range(world_size))
    return errors


def loopback_refusal(world_size: int, bad_rank: int) -> list[str]:
    """A bad head count on one rank: what every rank raised (validation's loopback all-gather)."""
    loop = LoopbackGroup(world_size)

    def rank_fn(group):
        heads = 3 if group.rank == bad_rank else 4
        q = torch.randn(1, 4, heads, 8, dtype=torch.float64)
        k = v = torch.randn(1, 4, 2, 8, dtype=torch.float64)
        try:
            cpa.ring_attention(q, k, v, group=group)
        except ValueError as e:
            return str(e)
        return ""
    return loop.run(rank_fn)
