"""The one autograd Function every strategy runs: the frame around "where K/V come from".

A call's K/V source (:class:`KVSource`) runs the blocks: the ring's travelling shards
(:class:`~cp_attention.engine.ring.RingSource`), or the other strategies' gathered or ringed shards
(:class:`~cp_attention.strategies.composite.CompositeSource`). Everything around them is written
once here: q, k, v made unit-stride (the kernels' contract), failures contained until the pass's last
exchange (:class:`~cp_attention.engine.fault.RingFault`), sinks folded into the final out/LSE, the
tensors saved, the sinks' and the LSE's gradients, dout made contiguous.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch

from .._deprecated import warn_renamed
from ..kernels.base import accumulation_dtype, unit_stride
from ..transport.base import Transport
from .fault import RingFault
from .sinks import fold_sinks, sinks_grad, with_lse_grad

__all__ = ["AttentionFunction", "KVSource"]


class KVSource(Protocol):
    """Where one call's K/V come from, and the blocks run against them.

    ``forward`` and ``backward`` run every exchange of their pass; a block's failure is contained
    with ``fault`` (``if fault.ok: with fault.contained(): ...``) and raised by the frame after the
    pass, on every rank alike.
    """

    # The group that agrees on a pass's failure (every rank the call's exchanges reach).
    fault_transport: Transport

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fault: RingFault, acc: torch.dtype
                ) -> tuple[torch.Tensor | None, torch.Tensor | None, tuple[torch.Tensor, ...]]:
        """``(out, lse, held)``: the accumulators (``acc``; None when no block ran) and ``held``, a
        K/V shard ``(k, v)`` kept for backward, or ``()``."""
        ...

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 held: tuple[torch.Tensor, ...], out: torch.Tensor, lse: torch.Tensor, fault: RingFault,
                 acc: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | tuple[None, None, None]:
        """``(dq, dk, dv)`` in ``acc`` given the final ``out``/``lse``; ``held`` is what forward kept
        (its V, like ``v``, may carry the LSE gradient's extra channel). Nones may come back after a
        contained failure (the frame then raises)."""
        ...


def _fault_transport(source: KVSource) -> Transport:
    """``source.fault_transport``; a source written before the rename has ``fault_comm`` (deprecated,
    read for one release with a DeprecationWarning)."""
    if hasattr(source, "fault_transport"):
        return source.fault_transport
    # a source with neither raises AttributeError, as before
    legacy = source.fault_comm  # type: ignore[attr-defined]  # pre-rename sources only, not in the protocol
    warn_renamed(f"{type(source).__name__}.fault_comm (a KVSource's)", f"{type(source).__name__}.fault_transport")
    return legacy


class AttentionFunction(torch.autograd.Function):
    """Attention over ``q [B, m, H, D]``, ``k [B, m, Hkv, D]``, ``v [B, m, Hkv, Dv]`` with K/V from
    ``source``. Returns ``out [B, m, H, Dv]`` in q's dtype and ``lse [B, H, m]`` (fp32; fp64 for fp64
    inputs), both differentiable.
    ``sinks [H]`` adds one logit per head to every softmax denominator (GPT-OSS ``s_aux``); its
    gradient is these rows' share, so summed over the group it is the full gradient.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, source: KVSource,
                sinks: torch.Tensor | None = None):
        acc = accumulation_dtype(q.dtype)
        q, k, v = unit_stride(q), unit_stride(k), unit_stride(v)  # the kernels' contract, once per call
        fault = RingFault(_fault_transport(source))
        out, lse, held = source.forward(q, k, v, fault, acc)
        fault.raise_if_failed("forward")
        if out is None:  # no block at all: every row attends to nothing
            b, m, h, _ = q.shape
            out = q.new_zeros(b, m, h, v.shape[-1], dtype=acc)
            lse = q.new_full((b, h, m), float("-inf"), dtype=acc)
        out, lse = fold_sinks(out, cast(torch.Tensor, lse), sinks, acc)  # lse is None only together with out
        out = out.to(q.dtype)
        ctx.source = source
        ctx.save_for_backward(q, k, v, out, lse, sinks, *held)
        ctx.set_materialize_grads(False)  # an unused LSE must cost nothing in backward
        return out, lse

    @staticmethod
    def backward(ctx, dout: torch.Tensor | None, dlse: torch.Tensor | None):
        source: KVSource = ctx.source
        q, k, v, out, lse, sinks, *held = ctx.saved_tensors
        acc = accumulation_dtype(q.dtype)
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        dsinks = sinks_grad(dout, out, lse, dlse, sinks, acc) if sinks is not None and ctx.needs_input_grad[4] else None
        dv_dim = v.shape[-1]
        if dlse is not None:
            out, dout, v, *held_v = with_lse_grad(out, dout, dlse, v, *held[1:])
            held = [*held[:1], *held_v]  # the held shard's V gets the column, its K not
        fault = RingFault(_fault_transport(source))
        grads = source.backward(dout, q, k, v, tuple(held), out, lse, fault, acc)
        fault.raise_if_failed("backward")
        dq, dk, dv = cast("tuple[torch.Tensor, torch.Tensor, torch.Tensor]", grads)  # a failed pass raised above
        return dq.to(q.dtype), dk.to(k.dtype), dv[..., :dv_dim].to(v.dtype), None, dsinks
