"""The ring: K/V shards travelling between the ranks of the group, as the source of the engine's
autograd Function (:class:`~cp_attention.engine.function.AttentionFunction`), for any layout's schedule
and any kernel.

Forward: at step s this rank computes against the K/V shard of rank (r - s) mod N. While it runs step
s's block tasks it receives step s + 1's shard; each block is folded into fp32 out/LSE accumulators.
Only the rows a rank needs travel (the plan's :meth:`~cp_attention.engine.plan.AttentionPlan.traffic`,
from :mod:`cp_attention.schedules.needs`): at step s each rank sends rank r + s exactly the rows of its
own shard that rank needs, and nothing when it needs none. The held shard is a full-length buffer in
which those rows are filled, so the tasks index it as they index a whole shard. Without a traffic plan
whole shards travel the same way.

Backward replays the steps in reverse, starting with the shard the forward held last (kept for it). At
step s the dK/dV partial of the held shard's needed rows goes straight home to rank r - s, which adds
it to its own; K/V for the step before are received while the step runs, as in forward (one exchange
fewer than forward: the last step's shard was kept).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..transport.base import Transport
from .fault import RingFault
from .tasks import KernelSettings, add_rows, merge_rows, set_rows, task_backward, task_forward
from .traffic import StepIndex, direct_view, place_rows, post_rows

__all__ = ["RingSchedule"]


@dataclass(frozen=True)
class RingSchedule:
    """The ring as a call's K/V source (:class:`~cp_attention.engine.function.KVSource`): the
    transport, this rank's tasks per ring step (from the batch's
    :class:`~cp_attention.engine.plan.AttentionPlan`), the kernel settings, and the rows that travel."""

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
    # traffic[s]: the rows sent and received at step s (engine.traffic.StepIndex; None at step 0), from
    # the plan; () sends whole shards
    traffic: tuple = ()

    @property
    def fault_comm(self) -> Transport:
        return self.comm

    def _index(self, s: int, n: int) -> StepIndex:
        return self.traffic[s] if self.traffic else StepIndex(None, None, n, n)

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
        shards = _Shards(self.comm, (k, v), self.settings.head_major)
        held = shards.own_views
        for s in range(last + 1):
            if s < last:
                shards.post(self._index(s + 1, n), s + 1)
            if fault.ok:
                with fault.contained():
                    for first, results in self._step_forward(s, q, *held, k, v):
                        for rows, o_blk, lse_blk in results:
                            if first:  # the rows' first result: written, not merged
                                out = set_rows(out, rows, o_blk, n, acc)
                                lse = set_rows(lse.transpose(1, 2) if lse is not None else None, rows,
                                                lse_blk.transpose(1, 2), n, acc).transpose(1, 2)
                            else:
                                out, lse = merge_rows(out, lse, rows, o_blk, lse_blk, n, acc)
            if s < last:
                if s > 0:
                    shards.release(held)
                held = shards.finish()
        return out, lse, (held if last > 0 else ())

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 held: tuple[torch.Tensor, ...], out: torch.Tensor, lse: torch.Tensor, fault: RingFault,
                 acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The ring's backward: this rank's ``dq``, ``dk``, ``dv`` (in ``acc``) given the final ``out``/``lse``.

        The steps run in reverse, starting with ``held``, the shard the forward held last (``()`` with a
        single step; saved for backward, so never received into: a second backward reads it again).
        While step s runs, step s - 1's shard arrives; after it, the partial dK/dV of the held shard's
        needed rows goes home to rank r - s, and this rank's own rows' partial arrives from rank r + s.
        """
        n = q.shape[1]
        last = len(self.steps) - 1
        shards = _Shards(self.comm, (k, v), self.settings.head_major)
        current = held
        dq = None
        own = (None, None)  # this rank's gradients of its own shard: its own tasks', then the others' partials
        home = _Home(self.comm, acc)
        for s in range(last, -1, -1):
            if s > 1:
                shards.post(self._index(s - 1, n), s - 1)
            grads = []
            if fault.ok:
                with fault.contained():
                    kc, vc = current if s > 0 else shards.own_views
                    grads = self._step_backward(s, dout, q, kc, vc, k, v, out, lse)
            partial = (None, None)  # the held shard's gradients at this step
            for first, results in grads:
                for q_rows, dq_blk, keys in results:
                    # Reverse order: dq rows may already hold a later step's part, so always add.
                    dq = add_rows(dq, q_rows, dq_blk, n, acc)
                    for is_home, kv_rows, dk_blk, dv_blk in keys:
                        if is_home or s == 0:
                            # This rank's own rows: step 0's tasks and folded documents each cover
                            # different rows, so a first result writes them, whichever comes first.
                            update = set_rows if first else add_rows
                            own = (update(own[0], kv_rows, dk_blk, n, acc), update(own[1], kv_rows, dv_blk, n, acc))
                        else:
                            partial = (add_rows(partial[0], kv_rows, dk_blk, n, acc),
                                       add_rows(partial[1], kv_rows, dv_blk, n, acc))
            if s > 0:
                home.arrived()
                home.send(partial, self._index(s, n), s, k, v)
            if s > 1:
                if s < last:
                    shards.release(current)
                current = shards.finish()
        home.arrived()
        if not fault.ok:  # the frame raises; nothing to add up
            return None, None, None
        dk, dv = (mine if theirs is None else theirs if mine is None else mine.add_(theirs)
                  for mine, theirs in zip(own, home.total))
        dk = torch.zeros_like(k, dtype=acc) if dk is None else dk
        dv = torch.zeros_like(v, dtype=acc) if dv is None else dv
        dq = torch.zeros_like(q, dtype=acc) if dq is None else dq
        return dq, dk, dv


def _kernel_views(tensors: tuple[torch.Tensor, ...], head_major: bool) -> tuple[torch.Tensor, ...]:
    """``[B, n, H, D]``-shaped views of ``tensors`` in the memory the kernel prefers (a copy once per
    call when it wants head-major memory and they are not)."""
    if not head_major:
        return tuple(t.contiguous() for t in tensors)
    return tuple(t if t.transpose(1, 2).is_contiguous()
                 else t.new_empty(t.shape[0], t.shape[2], t.shape[1], t.shape[3]).copy_(t.transpose(1, 2)).transpose(1, 2)
                 for t in tensors)


class _Shards:
    """The shards this rank receives: full-length buffers (at most two in use, recycled) in which the
    needed rows are filled, and its own shard's rows sent to the ranks that need them.

    ``own`` is only ever read. A buffer's rows no step has filled are zeros, so a padded batch that
    gathers one reads finite values."""

    def __init__(self, comm: Transport, own: tuple[torch.Tensor, ...], head_major: bool) -> None:
        self.comm, self.own, self.head_major = comm, own, head_major
        self.own_views = _kernel_views(own, head_major)
        self._free: list[tuple[torch.Tensor, ...]] = []
        self._pending = None

    def _buffer(self, filled: bool) -> tuple[torch.Tensor, ...]:
        if self._free:
            return self._free.pop()
        make = torch.empty if filled else torch.zeros
        if self.head_major:
            return tuple(make(t.shape[0], t.shape[2], t.shape[1], t.shape[3], dtype=t.dtype, device=t.device
                              ).transpose(1, 2) for t in self.own)
        return tuple(make(t.shape, dtype=t.dtype, device=t.device) for t in self.own)

    def post(self, index: StepIndex, hop: int) -> None:
        """Send this rank's ``index.send`` rows ``hop`` ranks on; receive ``index.recv`` rows of the
        shard ``hop`` ranks back into a free buffer."""
        buf = self._buffer(filled=index.recv is None)
        direct = [direct_view(b, index.recv) for b in buf] if index.recv_count else []
        recv = tuple(d if d is not None else t.new_empty(t.shape[0], index.recv_count, *t.shape[2:])
                     for d, t in zip(direct, self.own))
        handle, recv, send = post_rows(self.comm, self.own, index.send, index.send_count, index.recv_count, hop, recv)
        self._pending = (buf, recv, direct, index, handle, send)

    def finish(self) -> tuple[torch.Tensor, ...]:
        """Wait for the posted exchange; the buffer with the received rows in place."""
        buf, recv, direct, index, handle, _ = self._pending
        self._pending = None
        if handle is not None:
            handle.wait()
        for b, got, d in zip(buf, recv, direct):
            if d is None:
                place_rows(b, index.recv, got)
        return buf

    def release(self, buf: tuple[torch.Tensor, ...]) -> None:
        """``buf``'s step is done: receive a later step into it."""
        self._free.append(buf)


class _Home:
    """dK/dV partials on their way home in backward: the held shard's needed rows to its owner, this
    rank's own rows from the ranks that held them; at most one exchange in flight."""

    def __init__(self, comm: Transport, acc: torch.dtype) -> None:
        self.comm, self.acc = comm, acc
        self._pending = None
        self.total: tuple = (None, None)  # the partials of this rank's rows that arrived, added up

    def send(self, partial: tuple, index: StepIndex, s: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Post step ``s``'s ``partial`` (dk, dv of the held shard, full length or None) home to rank
        r - s, and the receive of this rank's ``index.send`` rows' partial from rank r + s."""
        # no partial: no task touched the held shard (a contained failure); zeros keep the sizes agreed
        parts = tuple(t.new_zeros(t.shape, dtype=self.acc) if p is None else p for p, t in zip(partial, (k, v)))
        handle, recv, send = post_rows(self.comm, parts, index.recv, index.recv_count, index.send_count, -s)
        self._pending = (handle, recv, index, send, (k, v))

    def arrived(self) -> None:
        """Wait for the exchange in flight, if any, and add the partial that arrived to :attr:`total`."""
        if self._pending is None:
            return
        handle, recv, index, _, like = self._pending
        self._pending = None
        if handle is not None:
            handle.wait()
        if recv:
            self.total = tuple(t.new_zeros(t.shape, dtype=self.acc) if o is None else o
                               for o, t in zip(self.total, like))
            for o, got in zip(self.total, recv):
                place_rows(o, index.send, got, add=True)


