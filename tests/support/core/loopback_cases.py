"""Ring attention with all N ranks in one process (cp_attention.transport.loopback), against an fp64 reference.

Shared by tests/unit/transport/test_loopback.py (CPU, fp64, in CI) and tests/unit/engine/test_ring_cuda.py (one GPU,
real CUDA kernels). The reference runs on the CPU in fp64 and never sees the sharding or the packing.
"""

from __future__ import annotations

import torch

import cp_attention as cpa
from cp_attention.layouts.documents import cu_seqlens_from_lengths
from cp_attention.transport.loopback import LoopbackGroup

from .reference import excess_error, reference_attention
from .strides import restride


def _reference(q, k, v, dout, causal: bool, scale: float, cu: list[int], window, sinks=None, softcap: float = 0.0,
               dlse=None) -> tuple[torch.Tensor, ...]:
    """out, lse, dq, dk, dv (and dsinks with ``sinks``) in fp64 on the CPU; per document when ``cu`` has
    several. ``dlse``: a gradient on the LSE too."""
    qr, kr, vr = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    sr = None if sinks is None else sinks.detach().cpu().double().requires_grad_()
    parts = [reference_attention(qr[:, a:b], kr[:, a:b], vr[:, a:b], causal, scale, sinks=sr, softcap=softcap,
                                 window=window) for a, b in zip(cu, cu[1:])]
    out = torch.cat([o for o, _ in parts], 1)
    lse = torch.cat([s for _, s in parts], 2)
    loss = (out * dout.cpu().double()).sum()
    if dlse is not None:
        loss = loss + (lse * dlse.cpu().double()).sum()
    loss.backward()
    return (out, lse, qr.grad, kr.grad, vr.grad) + (() if sr is None else (sr.grad,))


def loopback_errors(world_size: int, *, layout: str, causal: bool, dtype: torch.dtype = torch.float64,
                    device: str = "cpu", kernel: str = "auto", heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                    v_dim: int | None = None, local_len: int = 8, lengths: list[int] | None = None,
                    window: tuple = (-1, -1), atol: float = 1e-10, rtol: float = 0.0, seed: int = 0,
                    use_plan: bool = False, cp_comm_type: str = "p2p", mesh_shape: tuple | None = None,
                    sinks: bool = False, softcap: float = 0.0, lse_grad: bool = False, strided: tuple = (),
                    stride_form: str = "transposed") -> dict:
    """Excess error over tolerance (<= 0 passes) of out, lse, dq, dk, dv (and dsinks, summed over the
    ranks as data parallelism would), the worst over the ranks.

    ``lengths``: packed documents (their sum must be ``local_len * world_size``); None: one sequence.
    ``use_plan``: each rank builds the batch's plan and calls with it (twice: the second call reuses it).
    ``mesh_shape``: a two-level group (outer, inner), for ``cp_comm_type="a2a+p2p"``. ``lse_grad``: the
    loss also weighs the LSE, so its gradient flows back. ``strided``: which of ``"q"``, ``"k"``, ``"v"``,
    ``"dout"`` each rank passes in the memory form ``stride_form`` (:mod:`tests.support.core.strides`: same values, a
    last dim whose stride is not 1).
    """
    total = local_len * world_size
    v_dim = v_dim or head_dim
    cu = list(cu_seqlens_from_lengths(lengths)) if lengths else [0, total]
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, total, h, d, generator=g).to(dtype)
               for h, d in ((heads, head_dim), (kv_heads, head_dim), (kv_heads, v_dim)))
    dout = torch.randn(1, total, heads, v_dim, generator=g).to(dtype)
    dlse = torch.randn(1, heads, total, generator=g).double() if lse_grad else None
    sink_logits = torch.randn(heads, generator=g).to(dtype) if sinks else None
    scale = head_dim ** -0.5
    ref = _reference(q, k, v, dout, causal, scale, cu, window, sink_logits, softcap, dlse)
    lay = cpa.get_layout(layout)
    packed = dict(cu_seqlens=cu) if lengths else {}

    def rank_fn(group, r: int) -> tuple[torch.Tensor, ...]:
        shard = lambda t, dim=1: lay.shard(t, dim, r, world_size, **packed).to(device)  # noqa: E731
        ql, kl, vl = (restride(shard(t), stride_form) if name in strided else shard(t)
                      for name, t in zip("qkv", (q, k, v)))
        ql, kl, vl = (t.requires_grad_() for t in (ql, kl, vl))
        sl = None if sink_logits is None else sink_logits.to(device).clone().requires_grad_()
        cu_arg = torch.tensor(cu) if lengths else None
        common = dict(kernel=kernel, cp_comm_type=cp_comm_type, sinks=sl, softcap=softcap, return_lse=True)
        if use_plan:
            plan = cpa.plan(lay, group, causal=causal, cu_seqlens=cu_arg, window_size=tuple(window))
            cpa.ring_attention(ql.detach(), kl.detach(), vl.detach(), plan=plan,  # a layer before
                               **{**common, "sinks": None if sl is None else sl.detach()})
            out, lse = cpa.ring_attention(ql, kl, vl, plan=plan, **common)
        else:
            out, lse = cpa.ring_attention(ql, kl, vl, group=group, layout=lay, causal=causal,
                                          window_size=tuple(window), cu_seqlens=cu_arg, **common)
        dout_l = restride(shard(dout), stride_form) if "dout" in strided else shard(dout)
        if dlse is None:
            out.backward(dout_l)
        else:
            torch.autograd.backward([out, lse], [dout_l, shard(dlse, 2).to(lse.dtype)])
        return (out, lse, ql.grad, kl.grad, vl.grad) + (() if sl is None else (sl.grad,))

    loop = LoopbackGroup(world_size, mesh_shape=mesh_shape)
    results = loop.run(lambda group: rank_fn(group, group.rank))
    errors = {}
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        dim = 2 if name == "lse" else 1
        errors[name] = max(excess_error(results[r][i].cpu(), lay.shard(ref[i], dim, r, world_size, **packed),
                                        atol, rtol) for r in range(world_size))
    if sinks:  # each rank's gradient is its own rows' (or heads') share: summed, the whole
        errors["dsinks"] = excess_error(sum(res[5].cpu() for res in results), ref[5], atol, rtol)
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
