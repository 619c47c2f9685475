"""The K/V source of the strategies other than the ring: the layout's own per-rank tasks, run by
"virtual ranks" against K/V that come from an all-gather or from a ring over fewer, larger shards
(the engine's :class:`~cp_attention.engine.function.AttentionFunction` runs it).

After Ulysses' all-to-all a process holds, for its H/A heads, the tokens of A ranks of the layout
("virtual ranks" a = 0..A-1, flattened rank f = p*A + a, rows a*n:(a+1)*n of its tensors). A ring
over the P = N/A processes then brings every other process's A shards. At outer step s, virtual rank
a meets virtual rank a' of process p - s; that is the layout's ring step t = (s*A + a - a') mod N of
flat rank f, so running that step's tasks (the same exact blocks the ring runs: causal, packed
documents, windows) covers every (query, key) pair once. All-gather is the case A = 1 with every
shard gathered at once instead of passed round; pure Ulysses is P = 1 (no ring at all).

Every block is LSE-merged into accumulators that start empty (the ring's "first write" shortcuts
depend on its step order, which virtual ranks do not keep). Backward: the gathered shards' dK/dV go
home by one reduce-scatter (exchanges posted as each step ends); on a ring, a dK/dV accumulator
travels with its shard and makes one last hop home.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._deprecated import deprecated_names, warn_renamed
from ..engine.fault import RingFault
from ..engine.needs_index import StepIndex, place_rows, post_rows
from ..engine.tasks import KernelSettings, add_rows, merge_rows, task_backward, task_forward
from ..transport.base import Pending, Transport

__all__ = ["CompositeSource", "pair_steps"]

# Deprecated names (one release): the module answers them with a DeprecationWarning.
__getattr__ = deprecated_names(__name__, {"CompositeSchedule": "CompositeSource"}, globals())


def pair_steps(step_counts: tuple[int, ...], world_size: int, inner: int
               ) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """``pairs[s]``: the ``(a, a', t)`` that run at outer step ``s``: virtual rank ``a``'s ring step ``t``
    against virtual rank ``a'`` of the shard held, for steps ``t`` below ``step_counts[a]`` (a window can
    end the ring early). Outer steps after the last that has work are left out (the same on every
    process: ``t`` depends on ``s``, ``a`` and ``a'`` only)."""
    outer = world_size // inner
    pairs = [tuple((a, b, (s * inner + a - b) % world_size) for a in range(inner) for b in range(inner)
                   if (s * inner + a - b) % world_size < step_counts[a]) for s in range(outer)]
    while len(pairs) > 1 and not pairs[-1]:
        pairs.pop()
    return tuple(pairs)


@dataclass(frozen=True)
class CompositeSource:
    """One call's K/V source (:class:`~cp_attention.engine.function.KVSource`): ``settings`` the
    kernel settings; ``transport`` the outer group (P ranks) that the shards travel or are gathered over;
    ``fault_transport`` the whole group, which agrees on failures; ``virtual[a][t]`` virtual rank a's tasks
    at ring step t; ``pairs`` from :func:`pair_steps`; ``gather``: all-gather the shards instead of a
    ring."""

    settings: KernelSettings
    transport: Transport
    fault_transport: Transport
    virtual: tuple
    pairs: tuple
    inner: int
    gather: bool
    # gather only: the rows each step sends and receives (engine.needs_index.StepIndex, None at step 0)
    # from the plan, so only the needed rows are gathered and go home; () moves whole shards
    needs_index: tuple = ()

    @property
    def steps(self) -> int:
        return len(self.pairs)

    def index(self, s: int, n: int) -> StepIndex:
        """Step ``s``'s needs as device indices (whole shards of ``n`` rows without them)."""
        return self.needs_index[s] if self.needs_index else StepIndex(None, None, n, n)

    # Deprecated names (one release), with a DeprecationWarning.
    @property
    def comm(self) -> Transport:
        warn_renamed("CompositeSource.comm", "CompositeSource.transport")
        return self.transport

    @property
    def fault_comm(self) -> Transport:
        warn_renamed("CompositeSource.fault_comm", "CompositeSource.fault_transport")
        return self.fault_transport

    @property
    def traffic(self) -> tuple:
        warn_renamed("CompositeSource.traffic", "CompositeSource.needs_index")
        return self.needs_index

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fault: RingFault, acc: torch.dtype):
        """Every block LSE-merged into accumulators that start empty; nothing held for backward."""
        b, m, h, _ = q.shape
        n = m // self.inner
        out = q.new_zeros(b, m, h, v.shape[-1], dtype=acc)
        lse = q.new_full((b, h, m), float("-inf"), dtype=acc)
        shards = _Shards(self, (k, v))
        for s in range(self.steps):
            kc, vc = shards.at(s)
            if fault.ok:
                with fault.contained():
                    _forward_blocks(self, s, q, kc, vc, k, v, out, lse, n, acc)
        return out, lse, ()

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 held: tuple[torch.Tensor, ...], out: torch.Tensor, lse: torch.Tensor, fault: RingFault,
                 acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _backward_pass(self, dout, q, k, v, out, lse, fault, acc)


class _Shards:
    """The K/V shard held at each outer step: gathered up front, or passed round the ring."""

    def __init__(self, source: CompositeSource, own: tuple[torch.Tensor, ...]) -> None:
        self.source, self.own = source, tuple(t.contiguous() for t in own)
        last = source.steps - 1
        self.held = self.own
        # (sent, recv, handle) of the next step's shard on its way
        self._pending: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], Pending] | None = None
        if source.gather:
            # Each step's needed rows of another shard, placed in a full-length buffer whose other rows
            # are zeros (no task reads them).
            n = self.own[0].shape[1]
            posted = []
            for s in range(1, last + 1):
                index = source.index(s, n)
                posted.append((*post_rows(source.transport, self.own, index.send, index.send_count,
                                          index.recv_count, s), index))
            self.gathered = [self.own]
            for handle, recv, _, index in posted:
                if handle is not None:
                    handle.wait()
                if index.recv is None:  # the whole shard
                    self.gathered.append(recv)
                    continue
                bufs = tuple(torch.zeros_like(t) for t in self.own)
                for b, got in zip(bufs, recv):
                    place_rows(b, index.recv, got)
                self.gathered.append(bufs)

    def at(self, s: int) -> tuple[torch.Tensor, ...]:
        """The shard held at step ``s`` (call in order; on a ring the next one is already on its way)."""
        if self.source.gather:
            return self.gathered[s]
        if s > 0:
            if self._pending is None:
                raise RuntimeError("internal error: a ring shard was read out of order; please report it")
            sent, recv, handle = self._pending
            handle.wait()
            self.held = recv
        if s < self.source.steps - 1:
            recv = tuple(torch.empty_like(t) for t in self.held)
            self._pending = (self.held, recv, self.source.transport.exchange(self.held, recv, 1))
        return self.held


def _rows(t: torch.Tensor, a: int, n: int) -> torch.Tensor:
    return t[:, a * n:(a + 1) * n]


def _forward_blocks(source: CompositeSource, s: int, q, kc, vc, k, v, out, lse, n: int, acc) -> None:
    for a, b, t in source.pairs[s]:
        qa, oa, la = _rows(q, a, n), _rows(out, a, n), lse[:, :, a * n:(a + 1) * n]
        for task in source.virtual[a][t]:
            _, results = task_forward(source.settings, task, qa, _rows(kc, b, n), _rows(vc, b, n), _rows(k, a, n),
                                      _rows(v, a, n))
            for rows, o_blk, lse_blk in results:
                merge_rows(oa, la, rows, o_blk, lse_blk, n, acc)


def _backward_blocks(source: CompositeSource, s: int, dout, q, kc, vc, k, v, out, lse, dq, own, held, n: int,
                     acc) -> None:
    """Add step ``s``'s gradients: ``dq``, this process's own shard's ``own`` (dk, dv) and the held
    shard's ``held`` (dk, dv), all accumulators of full rows."""
    for a, b, t in source.pairs[s]:
        args = (_rows(dout, a, n), _rows(q, a, n), _rows(kc, b, n), _rows(vc, b, n), _rows(k, a, n),
                _rows(v, a, n), _rows(out, a, n), lse[:, :, a * n:(a + 1) * n])
        for task in source.virtual[a][t]:
            _, results = task_backward(source.settings, task, *args)
            for q_rows, dq_blk, keys in results:
                add_rows(_rows(dq, a, n), q_rows, dq_blk, n, acc)
                for home, kv_rows, dk_blk, dv_blk in keys:
                    target, at = (own, a) if home else (held, b)
                    add_rows(_rows(target[0], at, n), kv_rows, dk_blk, n, acc)
                    add_rows(_rows(target[1], at, n), kv_rows, dv_blk, n, acc)


def _backward_pass(source: CompositeSource, dout, q, k, v, out, lse, fault: RingFault, acc):
    n = q.shape[1] // source.inner
    last = source.steps - 1
    transport = source.transport
    # contiguous accumulators whatever the inputs' strides: they are sent as they are
    dq = q.new_zeros(q.shape, dtype=acc)
    own = (k.new_zeros(k.shape, dtype=acc), v.new_zeros(v.shape, dtype=acc))
    shards = _Shards(source, (k, v))
    posted: list = []  # gather: each step's partial on its way home; ring: the accumulator on its way on
    travelling: tuple[torch.Tensor, ...] = ()  # ring: set at every step before it is read
    held: tuple[torch.Tensor, ...]
    for s in range(last + 1):
        kc, vc = shards.at(s)
        if s == 0:
            held = own
        elif source.gather or s == 1:
            held = (k.new_zeros(k.shape, dtype=acc), v.new_zeros(v.shape, dtype=acc))
        else:  # the accumulator of the shard held now, from the rank it came from
            posted.pop().wait()
            held = travelling
        if fault.ok:
            with fault.contained():
                _backward_blocks(source, s, dout, q, kc, vc, k, v, out, lse, dq, own, held, n, acc)
        if s == 0:
            continue
        if source.gather:  # home now: the needed rows to the rank s back, whose shard it is
            index = source.index(s, n)
            posted.append((*post_rows(transport, held, index.recv, index.recv_count, index.send_count, -s), index))
        else:
            travelling = tuple(torch.empty_like(t) for t in held)
            # on round the ring, or after the last step home: the shard held at step s is rank p - s's
            posted.append(transport.exchange(held, travelling, 1 if s < last else -s))
    if source.gather:
        for handle, home, _, index in posted:
            if handle is not None:
                handle.wait()
            for o, got in zip(own, home):
                place_rows(o, index.send, got, add=True)
    elif posted:
        posted.pop().wait()
        own[0].add_(travelling[0])
        own[1].add_(travelling[1])
    return dq, own[0], own[1]

