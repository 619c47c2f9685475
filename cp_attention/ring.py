"""The ring engine: one autograd Function that executes any layout's schedule with any kernel.

Forward: at step s this rank holds the K/V shard of rank (r - s) mod N. It posts the exchange of
that shard to the next rank (double buffer), runs the step's block tasks, and folds each block into
fp32 out/LSE accumulators. Backward replays the same plan: K/V ride the ring again, and a fp32 dK/dV
accumulator travels with each shard, collecting every rank's contribution, and arrives back at its
owner after N hops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .comm import RingComm
from .kernels import AttentionKernel, accumulation_dtype
from .merge import merge_block
from .schedule import BlockTask

__all__ = ["RingPlan", "RingAttentionFunction"]


@dataclass(frozen=True)
class RingPlan:
    """Everything the engine needs besides the tensors: the ring, the per-step tasks, the kernel."""

    comm: RingComm
    steps: list[tuple[BlockTask, ...]]  # steps[s] = this rank's tasks at ring step s
    kernel: AttentionKernel
    scale: float


class _KVRing:
    """Shards travelling round the ring. Receives alternate between two buffers of our own, so the
    caller's tensors are only ever sent, and a buffer is reused only after its send completed."""

    def __init__(self, comm: RingComm, tensors: tuple[torch.Tensor, ...]) -> None:
        self.comm = comm
        self.current = tensors
        self._buffers: list[tuple[torch.Tensor, ...]] = []
        self._next = 0
        self._pending = None

    def start(self) -> None:
        """Post the exchange: send the current shard, receive the next one into a free buffer."""
        if len(self._buffers) <= self._next:
            self._buffers.append(tuple(torch.empty_like(t) for t in self.current))
        self._pending = self.comm.exchange(self.current, self._buffers[self._next])

    def finish(self) -> None:
        """Wait for the exchange and make the received shard current."""
        self._pending.wait()
        self._pending = None
        self.current = self._buffers[self._next]
        self._next ^= 1


class RingAttentionFunction(torch.autograd.Function):
    """Ring attention over local shards ``q [B, n, H, D]``, ``k [B, n, Hkv, D]``, ``v [B, n, Hkv, Dv]``.

    Returns ``out [B, n, H, Dv]`` in q's dtype and ``lse [B, H, n]`` (fp32; fp64 for fp64 inputs).
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan):
        acc = accumulation_dtype(q.dtype)
        b, n, h, _ = q.shape
        out = q.new_zeros(b, n, h, v.shape[-1], dtype=acc)
        lse = q.new_full((b, h, n), float("-inf"), dtype=acc)
        ring = _KVRing(plan.comm, (k.contiguous(), v.contiguous()))
        last = len(plan.steps) - 1
        for s, tasks in enumerate(plan.steps):
            if s < last:
                ring.start()
            kc, vc = ring.current
            for t in tasks:
                o_blk, lse_blk = plan.kernel.forward(q[:, t.q], kc[:, t.kv], vc[:, t.kv], t.causal, plan.scale)
                merge_block(out, lse, o_blk, lse_blk, t.q)
            if s < last:
                ring.finish()
        out = out.to(q.dtype)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout: torch.Tensor, _dlse: torch.Tensor):
        plan: RingPlan = ctx.plan
        q, k, v, out, lse = ctx.saved_tensors
        acc = accumulation_dtype(q.dtype)
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=acc)
        kv = _KVRing(plan.comm, (k.contiguous(), v.contiguous()))
        # dK/dV accumulators for the shard currently held; they follow that shard round the ring.
        dkv = _KVRing(plan.comm, (torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)))
        last = len(plan.steps) - 1
        for s, tasks in enumerate(plan.steps):
            if s < last:
                kv.start()
            kc, vc = kv.current
            grads = [plan.kernel.backward(dout[:, t.q], q[:, t.q], kc[:, t.kv], vc[:, t.kv], out[:, t.q],
                                          lse[:, :, t.q], t.causal, plan.scale) for t in tasks]
            if s > 0:
                dkv.finish()  # the accumulator for the shard we hold, sent by the previous rank
            dk_acc, dv_acc = dkv.current
            for t, (dq_blk, dk_blk, dv_blk) in zip(tasks, grads):
                dq[:, t.q] += dq_blk
                dk_acc[:, t.kv] += dk_blk
                dv_acc[:, t.kv] += dv_blk
            if plan.comm.world_size > 1:
                dkv.start()
            if s < last:
                kv.finish()
        if plan.comm.world_size > 1:
            dkv.finish()  # one more hop: our own shard's gradients come home
        dk, dv = dkv.current
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None
