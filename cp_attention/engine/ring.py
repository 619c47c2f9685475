"""The ring: K/V shards travelling between the ranks of the group, as the source of the engine's
autograd Function (:class:`~cp_attention.engine.function.AttentionFunction`), for any layout's schedule
and any kernel.

Forward: at step s this rank computes against the K/V shard of rank (r - s) mod N. While it runs step
s's block tasks it receives step s + 1's shard; each block is folded into fp32 out/LSE accumulators.
Only the rows a rank needs travel (the plan's :meth:`~cp_attention.engine.plan.AttentionPlan.needs_index`,
from :mod:`cp_attention.schedules.needs`): at step s each rank sends rank r + s exactly the rows of its
own shard that rank needs, and nothing when it needs none. The held shard is a full-length buffer in
which those rows are filled, so the tasks index it as they index a whole shard. Without the needs
whole shards travel the same way.

Backward replays the steps in reverse, starting with the shard the forward held last (kept for it). At
step s the dK/dV partial of the held shard's needed rows goes straight home to rank r - s, which adds
it to its own; K/V for the step before are received while the step runs, as in forward (one exchange
fewer than forward: the last step's shard was kept).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from .._deprecated import deprecated_names, warn_renamed
from ..transport.base import Pending, Transport
from .fault import RingFault
from .needs_index import StepIndex, direct_view, place_rows, shaped, wire_rows
from .tasks import KernelSettings, add_rows, merge_rows, set_rows, task_backward, task_forward

__all__ = ["RingSource"]

# Deprecated names (one release): the module answers them with a DeprecationWarning.
__getattr__ = deprecated_names(__name__, {"RingSchedule": "RingSource"}, globals())


@dataclass(frozen=True)
class RingSource:
    """The ring as a call's K/V source (:class:`~cp_attention.engine.function.KVSource`): the
    transport, this rank's tasks per ring step (from the batch's
    :class:`~cp_attention.engine.plan.AttentionPlan`), the kernel settings, and the rows that travel."""

    transport: Transport
    # steps[s] = this rank's tasks at ring step s: plain blocks, and for packed documents batches of
    # document blocks (engine.doc_batch.DocBatch, engine.varlen_batch.VarlenBatch) with the same
    # forward/backward/first interface
    steps: list[tuple] | tuple[tuple, ...]
    settings: KernelSettings
    # Step 0's tasks cover every query row and every held key row exactly once (schedules.lowering
    # checks it for packed documents without a window), so the accumulators are written there, not
    # merged into zeros. (A DocBatch says for itself whether it writes first: folded documents'
    # rows are first written at a later step.)
    first_step_tiles: bool = False
    # needs_index[s]: the rows sent and received at step s (engine.needs_index.StepIndex; None at step 0),
    # from the plan; () sends whole shards
    needs_index: tuple = ()

    @property
    def fault_transport(self) -> Transport:
        return self.transport

    # Deprecated names (one release), with a DeprecationWarning.
    @property
    def comm(self) -> Transport:
        warn_renamed("RingSource.comm", "RingSource.transport")
        return self.transport

    @property
    def fault_comm(self) -> Transport:
        warn_renamed("RingSource.fault_comm", "RingSource.fault_transport")
        return self.transport

    @property
    def traffic(self) -> tuple:
        warn_renamed("RingSource.traffic", "RingSource.needs_index")
        return self.needs_index

    def _index(self, s: int, n: int) -> StepIndex:
        return self.needs_index[s] if self.needs_index else StepIndex(None, None, n, n)

    def _compact(self, s: int, n: int) -> bool:
        """Whether step ``s``'s shard is held compact (only its needed rows, received in place): its
        rows are a list, and every task reads the held shard through index lists it can remap."""
        recv = self._index(s, n).recv if s > 0 else None
        return isinstance(recv, torch.Tensor) and all(hasattr(t, "compact") for t in self.steps[s])

    def _tasks(self, s: int, n: int) -> tuple:
        """Step ``s``'s tasks as they read the shard held (remapped once per plan when it is compact)."""
        if not self._compact(s, n):
            return self.steps[s]
        recv = self._index(s, n).recv
        return tuple(t.compact(recv) for t in self.steps[s])

    def _hop(self, s: int, n: int) -> tuple[StepIndex, bool]:
        return self._index(s, n), self._compact(s, n)

    def _hops(self, steps: range, n: int) -> list:
        return [self._hop(s, n) for s in steps]

    def _step_forward(self, s: int, q, kc, vc, k, v):
        """Step ``s``'s tasks' ``(first, results)`` against the held shard ``kc``/``vc``, one task at a
        time (each folded before the next runs)."""
        tiles = self.first_step_tiles and s == 0
        for t in self._tasks(s, q.shape[1]):
            yield task_forward(self.settings, t, q, kc, vc, k, v, tiles)

    def _step_backward(self, s: int, dout, q, kc, vc, k, v, out, lse) -> list:
        """Step ``s``'s tasks' ``(first, gradients)`` against the held shard ``kc``/``vc``."""
        tiles = self.first_step_tiles and s == 0
        return [task_backward(self.settings, t, dout, q, kc, vc, k, v, out, lse, tiles)
                for t in self._tasks(s, q.shape[1])]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fault: RingFault, acc: torch.dtype):
        """The ring's forward; keeps the shard held last for backward, which starts with it (see
        :meth:`backward`): at N=2 backward then moves no K/V at all."""
        n = q.shape[1]
        out = lse = None
        last = len(self.steps) - 1
        shards = _Shards(self.transport, (k, v), self.settings.head_major, self._hops(range(1, last + 1), n))
        held = shards.own_views
        for s in range(last + 1):
            if s < last:
                shards.post(*self._hop(s + 1, n), s + 1)
            if fault.ok:
                with fault.contained():
                    kc, vc = held
                    for first, results in self._step_forward(s, q, kc, vc, k, v):
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
                 acc: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | tuple[None, None, None]:
        """The ring's backward: this rank's ``dq``, ``dk``, ``dv`` (in ``acc``) given the final ``out``/``lse``
        (Nones after a contained failure).

        The steps run in reverse, starting with ``held``, the shard the forward held last (``()`` with a
        single step; saved for backward, so never received into: a second backward reads it again).
        While step s runs, step s - 1's shard arrives; after it, the partial dK/dV of the held shard's
        needed rows goes home to rank r - s, and this rank's own rows' partial arrives from rank r + s.
        """
        n = q.shape[1]
        last = len(self.steps) - 1
        shards = _Shards(self.transport, (k, v), self.settings.head_major, self._hops(range(last - 1, 0, -1), n))
        current = held
        dq = None
        # this rank's gradients of its own shard: its own tasks', then the others' partials
        own: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        home = _Home(self.transport, acc, (k, v), self._hops(range(last, 0, -1), n))
        for s in range(last, -1, -1):
            if s > 1:
                shards.post(*self._hop(s - 1, n), s - 1)
            grads = []
            if fault.ok:
                with fault.contained():
                    kc, vc = current if s > 0 else shards.own_views
                    grads = self._step_backward(s, dout, q, kc, vc, k, v, out, lse)
            # the held shard's gradients at this step
            partial: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
            # where they start: a buffer of the call's (full length, or the compact shard's rows)
            blank, length = home.blank(s) if s > 0 else ((None, None), n)
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
                            partial = (add_rows(partial[0], kv_rows, dk_blk, length, acc, blank[0]),
                                       add_rows(partial[1], kv_rows, dv_blk, length, acc, blank[1]))
            if s > 0:
                home.arrived()
                home.send(partial, blank, *self._hop(s, n), s)
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
                 else t.new_empty(t.shape[0], t.shape[2], t.shape[1], t.shape[3])
                 .copy_(t.transpose(1, 2)).transpose(1, 2)
                 for t in tensors)


class _Shards:
    """The shards this rank receives in one call, and its own shard's rows sent to the ranks that
    need them. What the rows pass through is allocated once, before the first step: at most two held
    buffers (recycled), a scratch for own rows to send that are not one contiguous range, and one for
    received rows that cannot land in place. ``hops``: ``(StepIndex, compact)`` of every shard the
    call receives, in order.

    A held shard is full length (the needed rows in place, so the tasks index it as a whole shard) or,
    ``compact``, only its needed rows (the step's tasks remapped to them). ``own`` is only ever read.
    A full-length buffer of which a step fills only some rows is zero-filled once, when made: rows
    no step filled read zeros, rows filled earlier the earlier shard's values, finite either way (a
    padded batch may gather them)."""

    def __init__(self, transport: Transport, own: tuple[torch.Tensor, ...], head_major: bool, hops: list) -> None:
        self.transport, self.own, self.head_major = transport, own, head_major
        self.own_views = _kernel_views(own, head_major)
        # rows travel token-major ([B, m, H, D]), picked from the call's contiguous copy where there is one
        self._source = own if head_major else self.own_views
        n = own[0].shape[1]
        rows = max([n if not compact else index.recv_count for index, compact in hops], default=0)
        fill = any(not compact and index.recv is not None for index, compact in hops)
        make = torch.zeros if fill else torch.empty
        self._free = [tuple(make(t.numel() // n * rows, dtype=t.dtype, device=t.device) for t in own)
                      for _ in range(min(2, len(hops)))]
        self._slots: dict[int, tuple] = {}
        send = recv = 0
        for index, compact in hops:
            if index.send_count and any(direct_view(t, index.send) is None for t in self._source):
                send = max(send, index.send_count)
            if index.recv_count and not compact and self._free:
                held = self._held(self._free[0], index, compact)
                if self._target(held[0], index, compact) is None:
                    recv = max(recv, index.recv_count)
        self._send = tuple(t.new_empty(t.numel() // n * send) for t in own) if send else (None,) * len(own)
        self._recv = tuple(t.new_empty(t.numel() // n * recv) for t in own) if recv else (None,) * len(own)
        # (held, place, index, handle, send) of the exchange posted, until finished
        self._pending: tuple[tuple[torch.Tensor, ...], list[tuple[torch.Tensor, torch.Tensor]], StepIndex,
                             Pending | None, tuple[torch.Tensor, ...]] | None = None

    def _held(self, slot: tuple, index: StepIndex, compact: bool) -> tuple[torch.Tensor, ...]:
        """The held shard in ``slot`` as the tasks index it: ``[B, n or recv_count, H, D]`` views."""
        out = []
        for flat, t in zip(slot, self.own):
            b, n, h, d = t.shape
            if compact:
                out.append(shaped(flat, (b, index.recv_count, h, d)))
            elif self.head_major:
                out.append(shaped(flat, (b, h, n, d)).transpose(1, 2))
            else:
                out.append(shaped(flat, (b, n, h, d)))
        return tuple(out)

    def _target(self, held: torch.Tensor, index: StepIndex, compact: bool) -> torch.Tensor | None:
        """Where the received rows land in place (contiguous), or None when they need placing (rows
        that are not one contiguous range of the buffer, and head-major buffers)."""
        return held if compact else direct_view(held, index.recv)

    def post(self, index: StepIndex, compact: bool, hop: int) -> None:
        """Send this rank's ``index.send`` rows ``hop`` ranks on; receive ``index.recv`` rows of the
        shard ``hop`` ranks back into a free buffer, in place where they can land so."""
        slot = self._free.pop()
        held = self._held(slot, index, compact)
        self._slots[id(held)] = slot
        recv, place = [], []
        for i, (h, t) in enumerate(zip(held, self.own) if index.recv_count else ()):
            target = self._target(h, index, compact)
            if target is None:
                # sized in __init__ for every step whose rows cannot land in place
                target = shaped(cast(torch.Tensor, self._recv[i]), (t.shape[0], index.recv_count, *t.shape[2:]))
                place.append((h, target))
            recv.append(target)
        send = tuple(wire_rows(src, index.send, scratch)
                     for src, scratch in zip(self._source, self._send)) if index.send_count else ()
        handle = self.transport.exchange(send, recv, hop) if send or recv else None
        self._pending = (held, place, index, handle, send)

    def finish(self) -> tuple[torch.Tensor, ...]:
        """Wait for the posted exchange; the held shard with the received rows in place."""
        if self._pending is None:
            raise RuntimeError("internal error: _Shards.finish() with no exchange posted; please report it")
        held, place, index, handle, _ = self._pending
        self._pending = None
        if handle is not None:
            handle.wait()
        for h, got in place:
            place_rows(h, index.recv, got)
        return held

    def release(self, held: tuple[torch.Tensor, ...]) -> None:
        """``held``'s step is done: receive a later step into its buffer."""
        self._free.append(self._slots.pop(id(held)))


class _Home:
    """dK/dV partials on their way home in backward: the held shard's needed rows to its owner, this
    rank's own rows from the ranks that held them; at most one exchange in flight. ``hops``:
    ``(StepIndex, compact)`` of steps ``last, ..., 1``. The partials start in two buffers made once per
    call (one in flight, one being added up), the rows received land in one scratch, and
    :attr:`total` is made once."""

    def __init__(self, transport: Transport, acc: torch.dtype, like: tuple[torch.Tensor, ...], hops: list) -> None:
        self.transport, self.acc, self.like = transport, acc, like
        # (handle, recv, index, send) of the exchange posted, until it arrived
        self._pending: tuple[Pending | None, tuple[torch.Tensor, ...], StepIndex,
                             tuple[torch.Tensor, ...]] | None = None
        n = like[0].shape[1]
        rows = max([index.recv_count if compact else n for index, compact in hops], default=0)
        self._blank = [tuple(t.new_empty(t.numel() // n * rows, dtype=acc) for t in like)
                       for _ in range(min(2, len(hops)))]
        send = max([index.recv_count for index, compact in hops if not compact and index.recv is not None
                    and index.recv_count and direct_view(shaped(self._blank[0][0], like[0].shape), index.recv)
                    is None], default=0)
        recv = max([index.send_count for index, _ in hops], default=0)
        self._send = tuple(t.new_empty(t.numel() // n * send, dtype=acc) if send else None for t in like)
        self._recv = tuple(t.new_empty(t.numel() // n * recv, dtype=acc) if recv else None for t in like)
        # the partials of this rank's rows that arrived, added up
        self.total: tuple = tuple(t.new_zeros(t.shape, dtype=acc) for t in like) if recv else (None, None)
        self._hops = {len(hops) - i: hop for i, hop in enumerate(hops)}

    def blank(self, s: int) -> tuple[tuple[torch.Tensor, ...], int]:
        """Step ``s``'s partial buffers (``[B, length, H, D]``, contents undefined) and their ``length``."""
        index, compact = self._hops[s]
        length = index.recv_count if compact else self.like[0].shape[1]
        slot = self._blank[s % len(self._blank)]
        return tuple(shaped(f, (t.shape[0], length, *t.shape[2:])) for f, t in zip(slot, self.like)), length

    def send(self, partial: tuple, blank: tuple, index: StepIndex, compact: bool, s: int) -> None:
        """Post step ``s``'s ``partial`` (dk, dv of the held shard, in ``blank``, or None) home to rank
        r - s, and the receive of this rank's ``index.send`` rows' partial from rank r + s."""
        # no partial: no task touched the held shard (a contained failure); zeros keep the sizes agreed
        parts = tuple(b.zero_() if p is None else p for p, b in zip(partial, blank))
        rows = None if compact else index.recv
        send = tuple(p if rows is None else wire_rows(p, rows, scratch)
                     for p, scratch in zip(parts, self._send)) if index.recv_count else ()
        # sized in __init__ for the most rows any step receives
        recv = tuple(shaped(cast(torch.Tensor, f), (t.shape[0], index.send_count, *t.shape[2:]))
                     for f, t in zip(self._recv, self.like)) if index.send_count else ()
        handle = self.transport.exchange(send, recv, -s) if send or recv else None
        self._pending = (handle, recv, index, send)

    def arrived(self) -> None:
        """Wait for the exchange in flight, if any, and add the partial that arrived to :attr:`total`."""
        if self._pending is None:
            return
        handle, recv, index, _ = self._pending
        self._pending = None
        if handle is not None:
            handle.wait()
        for o, got in zip(self.total, recv):
            place_rows(o, index.send, got, add=True)
