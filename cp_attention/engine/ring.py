"""The ring: K/V shards travelling round the group, as the source of the engine's autograd Function
(:class:`~cp_attention.engine.function.AttentionFunction`), for any layout's schedule and any kernel.

Forward: at step s this rank holds the K/V shard of rank (r - s) mod N. It posts the exchange of
that shard to the next rank (double buffer), runs the step's block tasks, and folds each block into
fp32 out/LSE accumulators. Backward replays the same steps in reverse, starting with the shard the
forward held last (kept for it): K/V ride the ring backwards, and a fp32 dK/dV accumulator travels
with each shard, collecting every other rank's contribution, back to its owner, where the owner's
own part waited. So backward sends K/V one hop fewer than forward (none at N=2), and no hop follows
its last compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..transport.base import Transport
from .fault import RingFault
from .tasks import KernelSettings, add_rows, merge_rows, set_rows, task_backward, task_forward

__all__ = ["RingSchedule"]


@dataclass(frozen=True)
class RingSchedule:
    """The ring as a call's K/V source (:class:`~cp_attention.engine.function.KVSource`): the
    transport, this rank's tasks per ring step (from the batch's
    :class:`~cp_attention.engine.plan.AttentionPlan`), the kernel settings."""

    comm: Transport
    # steps[s] = this rank's tasks at ring step s: plain blocks, and for packed documents batches of
    # document blocks (engine.doc_batch.DocBatch, engine.varlen_batch.VarlenBatch) with the same
    # forward/backward/first interface
    steps: "list[tuple] | tuple[tuple, ...]"
    settings: KernelSettings
    # Step 0's tasks cover every query row and every held key row exactly once (schedules.lowering
    # checks it for packed documents without a window), so the accumulators are written there, not
    # merged into zeros. (A DocBatch says for itself whether it writes first: folded documents'
    # rows are first written at a later step.)
    first_step_tiles: bool = False

    @property
    def fault_comm(self) -> Transport:
        return self.comm

    def _step_forward(self, s: int, q, kc, vc, k, v):
        """Step ``s``'s tasks' ``(first, results)`` against the held shard ``kc``/``vc``, one task at a
        time (each folded before the next runs)."""
        tiles = self.first_step_tiles and s == 0
        for t in self.steps[s]:
            yield task_forward(self.settings, t, q, kc, vc, k, v, tiles)

    def _step_backward(self, s: int, dout, q, kc, vc, k, v, out, lse) -> list:
        """Step ``s``'s tasks' ``(first, gradients)`` against the held shard ``kc``/``vc``."""
        tiles = self.first_step_tiles and s == 0
        return [task_backward(self.settings, t, dout, q, kc, vc, k, v, out, lse, tiles) for t in self.steps[s]]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fault: RingFault, acc: torch.dtype):
        """The ring's forward; keeps the shard held last for backward, which starts with it (see
        :meth:`backward`): at N=2 backward then moves no K/V at all."""
        n = q.shape[1]
        out = lse = None
        last = len(self.steps) - 1
        ring = _KVRing(self.comm, (k, v), last, head_major=self.settings.head_major)
        for s in range(last + 1):
            if s < last:
                ring.start()
            if fault.ok:
                with fault.contained():
                    for first, results in self._step_forward(s, q, *ring.views(), k, v):
                        for rows, o_blk, lse_blk in results:
                            if first:  # the rows' first result: written, not merged
                                out = set_rows(out, rows, o_blk, n, acc)
                                lse = set_rows(lse.transpose(1, 2) if lse is not None else None, rows,
                                                lse_blk.transpose(1, 2), n, acc).transpose(1, 2)
                            else:
                                out, lse = merge_rows(out, lse, rows, o_blk, lse_blk, n, acc)
            if s < last:
                ring.finish()
        return out, lse, (ring.views() if last > 0 else ())

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 held: tuple[torch.Tensor, ...], out: torch.Tensor, lse: torch.Tensor, fault: RingFault,
                 acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The ring's backward: this rank's ``dq``, ``dk``, ``dv`` (in ``acc``) given the final ``out``/``lse``.

        The steps run in reverse, starting with ``held``, the shard the forward held last (``()`` with a
        single step). At step s this rank holds rank (r - s)'s shard; the shard for step s - 1 comes from
        rank r + 1, and so does the dK/dV accumulator of the shard held, carrying the contributions of
        steps last..s+1 of the ranks after this one. This rank adds its own and passes it on to rank r - 1.
        At step 0 the accumulator for this rank's own shard arrives complete, so no hop follows the last
        compute, and K/V make one hop fewer than in forward order (none at N=2).
        """
        n = q.shape[1]
        last = len(self.steps) - 1
        comm = self.comm
        head_major = self.settings.head_major
        # ``held`` is saved for backward, so never received into: a second backward (retain_graph) reads it again.
        kv = _KVRing(comm, held, last - 1, head_major=head_major) if last else None
        dq = None
        own = (None, None)  # this rank's contributions to its own shard's gradients (step 0, folded documents)
        dkv = None  # the travelling accumulator of the shard held now
        for s in range(last, -1, -1):
            if s > 1:
                kv.start(-1)
            grads = []
            if fault.ok:
                with fault.contained():
                    if s > 0:
                        kc, vc = kv.views()
                    else:  # our own shard; head-major copies where the kernel runs faster on them
                        kc, vc = _KVRing(comm, (k, v), 0, head_major=head_major).views()
                    grads = self._step_backward(s, dout, q, kc, vc, k, v, out, lse)
            if s < last:
                dkv.finish()
            travelling = dkv.current if s < last else (None, None)
            for first, results in grads:
                for q_rows, dq_blk, keys in results:
                    # Reverse order: dq rows may already hold a later step's part, so always add.
                    dq = add_rows(dq, q_rows, dq_blk, n, acc)
                    for home, kv_rows, dk_blk, dv_blk in keys:
                        if home or s == 0:
                            # This rank's own rows: step 0's tasks and folded documents each cover
                            # different rows, so a first result writes them, whichever comes first.
                            update = set_rows if first else add_rows
                            own = (update(own[0], kv_rows, dk_blk, n, acc), update(own[1], kv_rows, dv_blk, n, acc))
                        else:
                            travelling = (add_rows(travelling[0], kv_rows, dk_blk, n, acc),
                                          add_rows(travelling[1], kv_rows, dv_blk, n, acc))
            if s > 0:
                if dkv is None:  # the step that starts the accumulator
                    travelling = tuple(torch.zeros_like(t, dtype=acc) if a is None else a
                                       for t, a in zip((k, v), travelling))
                    dkv = _KVRing(comm, travelling, last, owned=True)
                dkv.start(-1)
            if 1 < s:
                kv.finish()
        if not fault.ok:  # the frame raises; nothing to add up
            return None, None, None
        dk, dv = own
        if dkv is not None:  # the other ranks' contributions to this rank's shard
            dk = dkv.current[0] if dk is None else dk.add_(dkv.current[0])
            dv = dkv.current[1] if dv is None else dv.add_(dkv.current[1])
        dk = torch.zeros_like(k, dtype=acc) if dk is None else dk
        dv = torch.zeros_like(v, dtype=acc) if dv is None else dv
        dq = torch.zeros_like(q, dtype=acc) if dq is None else dq
        return dq, dk, dv


class _KVRing:
    """Shards travelling round the ring: the one held now, and at most one spare buffer to receive
    the next into.

    ``head_major`` keeps each shard in ``[B, H, n, D]`` memory (copied once per call) for kernels
    that run faster on it; :meth:`views` always hands out ``[B, n, H, D]``-shaped views. The
    caller's tensors are only ever sent; tensors the ring ``owned`` from the start are recycled as
    receive buffers once their send completed. After the last of ``exchanges`` the spare is dropped,
    so the final step's compute runs without it.
    """

    def __init__(self, comm: Transport, tensors: tuple[torch.Tensor, ...], exchanges: int,
                 head_major: bool = False, owned: bool = False) -> None:
        self.comm = comm
        self.head_major = head_major
        if head_major:
            if all(t.transpose(1, 2).is_contiguous() for t in tensors):  # already head-major memory
                tensors = tuple(t.transpose(1, 2) for t in tensors)
            else:
                tensors = tuple(t.new_empty(t.shape[0], t.shape[2], t.shape[1], t.shape[3]).copy_(t.transpose(1, 2))
                                for t in tensors)
                owned = True
        else:
            tensors = tuple(t.contiguous() for t in tensors)
        self.current = tensors
        self._callers = None if owned else tensors  # never written into
        self._remaining = exchanges
        self._spare: "tuple[torch.Tensor, ...] | None" = None
        self._pending = None

    def views(self) -> tuple[torch.Tensor, ...]:
        """The current shard as ``[B, n, H, D]``-shaped tensors (strided views when head-major)."""
        return tuple(t.transpose(1, 2) for t in self.current) if self.head_major else self.current

    def start(self, hop: int = 1) -> None:
        """Post the exchange: send the current shard ``hop`` ranks on, receive the next one into the
        spare buffer."""
        recv = self._spare if self._spare is not None else tuple(torch.empty_like(t) for t in self.current)
        self._spare = None
        self._pending = (self.current, recv, self.comm.exchange(self.current, recv, hop))

    def finish(self) -> None:
        """Wait for the exchange and make the received shard current."""
        sent, recv, handle = self._pending
        handle.wait()
        self._pending = None
        self.current = recv
        self._remaining -= 1
        if self._remaining > 0 and sent is not self._callers:
            self._spare = sent
