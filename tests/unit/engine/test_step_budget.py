"""Issue 41 item 3: the ring's launch and byte budget per ring step (docs/design.md, "Per-step
budget"), counted on every rank with the fake-CUDA dispatch trace (``tests/support/cuda/fake_cuda_cases.py``).

Every aten op a rank dispatches on a CUDA tensor inside the ring is counted per ring step and
attributed to who issued it: the step's block tasks (``task``: the kernel calls and their gathers),
the folds into the accumulators (``fold``: merges, row adds and writes), the transport (``wire``:
the loopback's own copies, standing for the send and the receive) and the ring itself (``ring``:
packing rows to send, placing received rows, buffers). An op that only makes a view or reads
metadata is not counted; an allocation (a factory op, or an out-of-place op's output) is counted
as an allocation, and a factory that also fills (zeros, full) as a launch too. The budget:

- per step, on every rank, the ring itself allocates nothing: a call's buffers are made before its
  first step;
- forward, per step: ring launches <= 4 (per K and V, a gather of the rows to send and a placement
  of rows received that cannot land in place); whole shards 0; packed documents' rows land in place
  (a compact shard), so needs-only launches no more than whole shards beyond the 2 gathers;
- backward, per step: ring launches <= 8 (K/V as in forward, a gather of the dK/dV partial's rows,
  adding the rows that came home), +2 at the last step (the total into the rank's own); whole shards
  <= 2 (+2);
- bytes received per (rank, step): exactly the needed rows, ``rows x B x Hkv x (D + Dv) x 2`` (bf16)
  for K/V and ``x 4`` (fp32) for the dK/dV partials.
"""

from __future__ import annotations

import collections
import functools
import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import cp_attention as cpa
import cp_attention.engine.ring as ring_mod
from cp_attention.engine.ring import RingSource
from cp_attention.transport import loopback
from tests.support.cuda.fake_cuda_cases import check_clean, env, lengths, ring_case  # noqa: F401 - env: the fixture

pytestmark = pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")

aten = torch.ops.aten
# factories: an allocation; those that also fill are a launch as well
_ALLOC_ONLY = {aten.empty, aten.empty_strided, aten.new_empty, aten.new_empty_strided, aten.empty_like}
_FILLING = {aten.zeros, aten.new_zeros, aten.zeros_like, aten.full, aten.new_full, aten.full_like, aten.ones,
            aten.new_ones, aten.ones_like}
_METADATA = {aten.detach, aten.alias, aten._unsafe_view, aten.lift_fresh, aten.lift_fresh_copy}


class _Counter(TorchDispatchMode):
    """Counts one rank's ops per (rank, pass, call, step, who): launches, allocations (entered on that
    rank's thread only)."""

    def __init__(self, log: dict, rank: int) -> None:
        super().__init__()
        self.log, self.rank = log, rank
        self.key = None  # (pass, call, step)
        self.who: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.key is None or not any(isinstance(t, torch.Tensor) and t.device.type == "cuda"
                                       for t in tree_leaves((args, kwargs, out))):
            return out
        packet = func.overloadpacket
        if func.is_view or packet in _METADATA or not any(isinstance(t, torch.Tensor) for t in tree_leaves(out)):
            return out
        entry = self.log[(self.rank, *self.key, self.who[-1] if self.who else "ring")]
        entry["ops"].append(str(packet))
        if packet in _ALLOC_ONLY:
            entry["alloc"] += 1
            return out
        entry["launch"] += 1
        entry["alloc"] += sum(r.alias_info is None and "Tensor" in str(r.type) for r in func._schema.returns)
        return out


def _trace(env, world: int, kernel: str, layout: str, packed: bool, needs_only: bool) -> dict:
    """Run one ring_case (2 layers) and return every rank's counts per (rank, pass, call, step, who)
    and bytes received per (rank, pass, call, step, what), from the second forward and the first
    backward (the plan's caches warm)."""
    log = collections.defaultdict(lambda: {"launch": 0, "alloc": 0, "ops": []})
    received = collections.Counter()
    counters = {r: _Counter(log, r) for r in range(world)}
    calls = collections.Counter()
    local = threading.local()  # this thread's rank's counter, while its ring runs

    def mine():
        return getattr(local, "counter", None)

    def pass_(fn, name):
        @functools.wraps(fn)
        def wrapped(source, *args, **kw):
            counter = counters[source.transport.rank]
            calls[(counter.rank, name)] += 1
            counter.key = (name, calls[(counter.rank, name)], "setup")
            local.counter = counter
            with counter:
                try:
                    return fn(source, *args, **kw)
                finally:
                    counter.key = local.counter = None
        return wrapped

    def at(s):
        counter = mine()
        if counter is not None and counter.key is not None:
            counter.key = (*counter.key[:2], s)

    def stepping(fn):
        @functools.wraps(fn)
        def wrapped(source, s, *args):
            at(s)
            return fn(source, s, *args)
        return wrapped

    def who(fn, name, what=None, forward_step=None):
        @functools.wraps(fn)
        def wrapped(*args, **kw):
            counter = mine()
            if counter is None:
                return fn(*args, **kw)
            if what is not None:
                local.what = what
            if forward_step is not None and counter.key is not None:
                # forward posts step s + 1's shard at step s, backward step s - 1's
                hop = args[-1]
                at(hop - 1 if counter.key[0] == "fwd" else hop + 1)
            counter.who.append(name)
            try:
                return fn(*args, **kw)
            finally:
                counter.who.pop()
        return wrapped

    def exchange(fn):
        @functools.wraps(fn)
        def wrapped(self, send, recv, hop=1):
            counter = mine()
            if counter is not None and counter.key is not None:
                received[(counter.rank, *counter.key, local.what)] += sum(t.numel() * t.element_size() for t in recv)
            return who(fn, "wire")(self, send, recv, hop)
        return wrapped

    with pytest.MonkeyPatch.context() as mp:
        if not needs_only:
            mp.setattr(cpa, "plan", functools.partial(cpa.plan, needs_only=False))
        mp.setattr(RingSource, "forward", pass_(RingSource.forward, "fwd"))
        mp.setattr(RingSource, "backward", pass_(RingSource.backward, "bwd"))
        mp.setattr(RingSource, "_step_forward", stepping(RingSource._step_forward))
        mp.setattr(RingSource, "_step_backward", stepping(RingSource._step_backward))
        for name in ("task_forward", "task_backward"):
            mp.setattr(ring_mod, name, who(getattr(ring_mod, name), "task"))
        for name in ("add_rows", "set_rows", "merge_rows"):
            mp.setattr(ring_mod, name, who(getattr(ring_mod, name), "fold"))
        mp.setattr(ring_mod._Shards, "post", who(ring_mod._Shards.post, "ring", "kv", forward_step=True))
        mp.setattr(ring_mod._Home, "send", who(ring_mod._Home.send, "ring", "dkv"))
        mp.setattr(loopback.LoopbackRank, "exchange", exchange(loopback.LoopbackRank.exchange))
        mp.setattr(loopback._Posted, "wait", who(loopback._Posted.wait, "wire"))
        kw = dict(lengths=lengths(world, 64)) if packed else {}
        res = ring_case(env, world, kernel, layout, torch.bfloat16, layers=2, **kw)
    check_clean(res, kernel)
    warm = (("fwd", 2), ("bwd", 1))
    return {"counts": {k: v for k, v in log.items() if k[1:3] in warm},
            "received": {k: v for k, v in received.items() if k[1:3] in warm}}


def per_step(trace: dict, pass_: str, who: str, kind: str) -> dict:
    """``{(rank, step): count}`` of ``kind`` ("launch"/"alloc") by ``who`` in ``pass_``; the call's
    setup (before its first step) as step "setup"."""
    out = collections.Counter()
    for (r, p, _, s, w), entry in trace["counts"].items():
        if p == pass_ and w == who:
            out[(r, s)] += entry[kind]
    return dict(out)


def ops(trace: dict, pass_: str, who: str) -> dict:
    out = collections.defaultdict(list)
    for (r, p, _, s, w), entry in trace["counts"].items():
        if p == pass_ and w == who:
            out[(r, s)] += entry["ops"]
    return dict(out)


def _received(trace: dict, pass_: str, what: str) -> dict:
    return {(r, s): b for (r, p, _, s, w), b in trace["received"].items() if p == pass_ and w == what and b}


def _expected_bytes(world: int, layout: str, packed: bool, needs_only: bool, n: int = 64, hkv: int = 2,
                    d: int = 64) -> tuple[dict, dict, dict]:
    """Every rank's bytes received per (rank, step) from the needs model (schedules.needs, on the
    host): forward K/V at step s (step s + 1's rows), backward K/V at step s (step s - 1's), backward
    dK/dV at step s (its own rows that rank r + s needed). bf16 K/V, fp32 partials."""
    from cp_attention.schedules.needs import rank_needs
    cu = None
    if packed:
        cu = torch.tensor([0, *torch.tensor(lengths(world, n)).cumsum(0).tolist()])
    row = (1 if packed else 2) * hkv * 2 * d  # ring_case's batch (1 when packed), K and V, every head
    fwd, bwd_kv, bwd_dkv = {}, {}, {}
    for r in range(world):
        needs = rank_needs(layout, True, world, world * n, cu, None, r, world)
        for s in range(1, world):
            recv, send = (needs[s].recv.numel(), needs[s].send.numel()) if needs_only else (n, n)
            if recv:
                fwd[(r, s - 1)] = recv * row * 2
                if s < world - 1:
                    bwd_kv[(r, s + 1)] = recv * row * 2
            if send:
                bwd_dkv[(r, s)] = send * row * 4
    return fwd, bwd_kv, bwd_dkv


CASES = [pytest.param(world, layout, kernel, packed,
                      id=f"N{world}-{layout}-{'packed-' + kernel if packed else 'dense'}")
         for world in (2, 4) for layout in ("zigzag", "interleaved")
         for kernel, packed in (("flash", False), ("flash", True), ("efficient", True))]


@pytest.fixture(scope="module")
def traces(env):
    cache = {}

    def get(world, layout, kernel, packed, needs_only):
        key = (world, layout, kernel, packed, needs_only)
        if key not in cache:
            cache[key] = _trace(env, world, kernel, layout, packed, needs_only)
        return cache[key]
    return get


def _steps(counts: dict) -> dict:
    return {k: v for k, v in counts.items() if k[1] != "setup"}


@pytest.mark.parametrize("world, layout, kernel, packed", CASES)
def test_the_ring_allocates_nothing_per_step(traces, world, layout, kernel, packed):
    """A call's buffers (held shards, scratch for rows to send and to place, dK/dV partials, the total
    of the partials that came home) are made once, before its first step: per step, on every rank,
    the ring allocates nothing."""
    for needs_only in (True, False):
        trace = traces(world, layout, kernel, packed, needs_only)
        for pass_ in ("fwd", "bwd"):
            per = {k: a for k, a in _steps(per_step(trace, pass_, "ring", "alloc")).items() if a}
            assert not per, (f"needs_only={needs_only} {pass_}: the ring allocated at (rank, step) {per}: "
                             f"{ {k: ops(trace, pass_, 'ring')[k] for k in per} }")


@pytest.mark.parametrize("world, layout, kernel, packed", CASES)
def test_ring_launches_per_step_within_budget(traces, world, layout, kernel, packed):
    """The ring's own launches per step on every rank, as docs/design.md states them. Whole shards:
    none in forward (sent and received in place), in backward only adding the dK/dV rows that came
    home (2; and at the last step the total into the rank's own, 2). Needs-only: at most a gather of
    the rows it sends and a placement of rows received that cannot land in place, per K and V; for
    packed documents the rows land in place (compact), so never more than whole shards beyond the
    gathers of the rows sent."""
    whole, needs = traces(world, layout, kernel, packed, False), traces(world, layout, kernel, packed, True)
    for pass_ in ("fwd", "bwd"):
        w = _steps(per_step(whole, pass_, "ring", "launch"))
        o = _steps(per_step(needs, pass_, "ring", "launch"))
        final = {k: 2 if pass_ == "bwd" and k[1] == 0 else 0 for k in {**w, **o}}
        for k, count in w.items():
            assert count <= (2 if pass_ == "bwd" else 0) + final[k], (pass_, k, ops(whole, pass_, "ring")[k])
        budget = 4 if pass_ == "fwd" else 8  # K/V gather + placement; backward also the partial's, and adding
        for k, count in o.items():
            assert count <= budget + final[k], (pass_, k, ops(needs, pass_, "ring")[k])
            if packed:
                gathers = 2 if pass_ == "fwd" else 4  # K/V rows to send; backward also the partial's rows
                assert count <= w.get(k, 0) + gathers, (pass_, k, ops(needs, pass_, "ring")[k],
                                                        ops(whole, pass_, "ring").get(k))
        if packed and pass_ == "fwd":  # received rows land in place: no copy, no scatter; only the send gathers
            placed = {k: [op for op in got if op != "aten.index_select"]
                      for k, got in ops(needs, "fwd", "ring").items() if k[1] != "setup"}
            assert not any(placed.values()), placed


@pytest.mark.parametrize("world, layout, kernel, packed", CASES)
def test_bytes_received_per_step_are_exactly_the_needed_rows(traces, world, layout, kernel, packed):
    """Per (rank, step): K/V bytes = rows x Hkv x (D + Dv) x 2 (bf16), dK/dV = rows x Hkv x (D + Dv) x 4
    (fp32), rows the needs model's (whole shards: all of them)."""
    for needs_only in (True, False):
        trace = traces(world, layout, kernel, packed, needs_only)
        fwd, bwd_kv, bwd_dkv = _expected_bytes(world, layout, packed, needs_only)
        assert _received(trace, "fwd", "kv") == fwd
        assert _received(trace, "bwd", "kv") == bwd_kv
        assert _received(trace, "bwd", "dkv") == bwd_dkv
