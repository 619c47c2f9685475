"""The cost model behind cp_comm_type="auto": its pair counts against brute-force masks and the work
model, its ring lengths against the schedules', its bytes against what each strategy's execution sends
on a loopback group, its feasibility rules against the execution's, and "auto" itself exact."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

import cp_attention as cpa
from cp_attention.schedules.derived import ring_length
from cp_attention.schedules.work import work_model
from cp_attention.strategies import STRATEGIES, cost
from cp_attention.strategies.cost import (
    HARDWARE,
    Workload,
    choose,
    closed_ring_length,
    estimate,
    infeasible,
    pairs,
    rank_pairs,
    set_hardware,
)
from cp_attention.transport.loopback import LoopbackGroup
from tests.support.core.loopback_cases import loopback_errors


def _seen(total: int, causal: bool, window: tuple, cu: tuple | None) -> torch.Tensor:
    """The mask oracle: [query, key] of packed positions, True where the query sees the key."""
    cu = cu or (0, total)
    doc = torch.bucketize(torch.arange(total), torch.tensor(cu[1:]), right=True)
    rel = torch.arange(total) - torch.tensor(cu)[doc]
    i, j = rel[:, None], rel[None, :]
    seen = doc[:, None] == doc[None, :]
    if causal:
        seen &= j <= i
    if window[0] >= 0:
        seen &= j >= i - window[0]
    if window[1] >= 0 and not causal:
        seen &= j <= i + window[1]
    return seen


@pytest.mark.parametrize("length,causal,window", [(17, True, (-1, -1)), (17, True, (4, 0)), (17, False, (3, 5)),
                                                  (17, False, (-1, 2)), (5, True, (9, 0)), (1, True, (0, 0))])
def test_pairs_count_the_mask(length, causal, window):
    assert pairs(length, causal, window) == int(_seen(length, causal, window, None).sum())


@pytest.mark.parametrize("world,causal,window,cu", [
    (4, True, (-1, -1), None), (4, True, (5, 0), (0, 3, 30, 41, 48)), (3, False, (4, 2), (0, 20, 21, 48)),
    (4, False, (-1, -1), (0, 7, 48)), (2, False, (-1, 0), None), (3, True, (0, 0), (0, 1, 47, 48))])
def test_contiguous_rank_pairs_are_exact(world, causal, window, cu):
    """Each contiguous rank's pairs (the busiest bounds the ring), closed form against the oracle."""
    per_query = _seen(48, causal, window, cu).sum(1)
    n = 48 // world
    assert rank_pairs(48, world, causal, window, cu) == tuple(int(per_query[r * n:(r + 1) * n].sum())
                                                               for r in range(world))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "interleaved"])
def test_causal_shares_match_the_work_model(layout):
    """The busiest rank's share of a causal sequence (closed forms) against the work model."""
    for world in (2, 3, 5):
        work = work_model(cpa.get_layout(layout), True, 2 * world * 6, world)
        w = Workload(world, 1, 2 * world * 6, 4, 2, 8, 8, 4, layout=layout)
        assert cost._busiest_share(w, world) == pytest.approx(max(map(sum, work)) / sum(map(sum, work)), abs=1e-12)


_DOCS = (0, 5, 39, 48)


@pytest.mark.parametrize("layout,world,causal,window,cu", [
    (layout, world, causal, window, cu) for layout in ("contiguous", "zigzag", "interleaved")
    for world, causal, window, cu in ((4, True, (7, 0), None), (3, True, (16, 0), None), (4, True, (1, -1), _DOCS),
                                      (4, True, (0, 0), None), (4, False, (9, 3), None), (4, False, (-1, 0), _DOCS),
                                      (3, False, (40, -1), _DOCS))])
def test_ring_lengths_match_the_schedules(layout, world, causal, window, cu):
    """The ring's length under a window (closed forms) against the one the schedules derive from
    positions (contiguous: 1 + ceil(reach / n); interleaved: 1 + reach; zigzag: every step)."""
    w = Workload(world, 1, 48, 4, 2, 8, 8, 4, causal, window, cu, layout)
    assert closed_ring_length(w) == ring_length(layout, causal, 48, world, window, cu)


def _sent_bytes(strategy: str, *, layout: str, window: tuple, backward: bool, cu=None, dtype=torch.bfloat16
                ) -> tuple[float, ...]:
    """Bytes of attention data each rank sends in one call on 4 loopback ranks (a 2 x 2 mesh for
    a2a+p2p), by rank; the checks' small int exchanges are not counted."""
    group = LoopbackGroup(4, mesh_shape=(2, 2) if strategy == "a2a+p2p" else None)
    sent: defaultdict[int, int] = defaultdict(int)
    post = group._post

    def counting(src: int, dst: int, tensor: torch.Tensor) -> None:
        if tensor.is_floating_point():
            sent[src] += tensor.numel() * tensor.element_size()
        post(src, dst, tensor)

    group._post = counting
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 64, h, d, generator=g).to(dtype) for h, d in ((4, 16), (2, 16), (2, 8)))
    lay = cpa.get_layout(layout)

    def rank_fn(handle):
        ql, kl, vl = (lay.shard(t, 1, handle.rank, 4, cu_seqlens=cu).requires_grad_(backward) for t in (q, k, v))
        out = cpa.ring_attention(ql, kl, vl, group=handle, layout=lay, causal=True, window_size=window,
                                 cp_comm_type=strategy, cu_seqlens=cu)
        if backward:
            out.sum().backward()

    group.run(rank_fn)
    return tuple(float(sent[r]) for r in range(4))


@pytest.mark.parametrize("layout,window,cu", [("zigzag", (-1, -1), None), ("contiguous", (20, 0), None),
                                              ("contiguous", (-1, -1), (0, 5, 30, 34, 64)),
                                              ("balanced", (-1, -1), (0, 5, 30, 34, 64))])
def test_bytes_follow_the_execution(layout, window, cu):
    """comm_bytes is the most any rank sends, and extra["rank_bytes"] (ring, all-gather: only the rows
    a rank needs travel, so ranks differ) every rank's, forward and forward+backward, for every
    strategy: GQA heads the all-to-all must repeat, a v head dim of its own, bf16 inputs with fp32
    dK/dV, a window that ends the ring early (contiguous: 3 of 4 steps), packed documents."""
    for strategy in STRATEGIES:
        for backward in (False, True):
            w = Workload(4, 1, 64, 4, 2, 16, 8, 2, True, window, cu, layout, 2 if strategy == "a2a+p2p" else 1,
                         backward)
            got = _sent_bytes(strategy, layout=layout, window=window, backward=backward, cu=cu)
            est = estimate(w, strategy, HARDWARE["h100"])
            assert est.extra.get("rank_bytes", (est.comm_bytes,) * 4) == pytest.approx(got), (strategy, backward)
            assert est.comm_bytes == pytest.approx(max(got)), (strategy, backward)


def test_memory_and_flops():
    w = Workload(4, 1, 4096, 8, 2, 64, 64, 2, backward=False)
    kv = 1024 * 2 * 128 * 2  # one rank's K/V shard: n tokens x kv heads x (d + dv) x 2 bytes
    ring, gathered = estimate(w, "p2p", HARDWARE["h100"]), estimate(w, "all_gather", HARDWARE["h100"])
    assert ring.peak_kv_bytes == 3 * kv and gathered.peak_kv_bytes == 4 * kv  # all-gather holds every shard
    # Ulysses: its input shard and the whole sequence for its heads (2 K/V heads repeated to 4 first)
    assert estimate(w, "a2a", HARDWARE["h100"]).peak_kv_bytes == kv + 2 * kv
    # compute: causal pairs of the sequence / N (zigzag is balanced) x 4 * head_dim FLOPs x heads
    fast = cost.Hardware("fast links", 1e12, 1e30, 1e30, 8, 0.0, 0.0)
    assert estimate(w, "p2p", fast).total_s == pytest.approx(4096 * 4097 / 2 / 4 * 256 * 8 / 1e12)
    trained = estimate(Workload(4, 1, 4096, 8, 2, 64, 64, 2), "p2p", fast)
    assert trained.total_s == pytest.approx(3.5 * estimate(w, "p2p", fast).total_s)  # backward 2.5x forward


def test_lists_and_tensors_are_taken():
    """A window given as a list and documents as a tensor (they key caches: made tuples first)."""
    tidy = Workload(4, 1, 64, 4, 2, 16, 16, 2, True, (20, 0), (0, 10, 64), "contiguous")
    loose = Workload(4, 1, 64, 4, 2, 16, 16, 2, True, [20, 0], torch.tensor([0, 10, 64]), "contiguous")
    assert estimate(loose, "p2p", HARDWARE["h100"]) == estimate(tidy, "p2p", HARDWARE["h100"])
    assert closed_ring_length(loose) == 3


def test_feasibility_matches_the_execution():
    base = dict(world_size=4, batch=1, seq_len=4096, kv_heads=2, head_dim=64, v_head_dim=64, dtype_bytes=2)
    assert infeasible(Workload(heads=6, **base), "a2a") is not None  # 6 heads over 4 ranks
    assert infeasible(Workload(heads=8, **base), "a2a+p2p") is not None  # a 1-D group
    assert infeasible(Workload(heads=6, inner=2, **base), "a2a+p2p") is None
    assert choose(Workload(heads=6, **base), HARDWARE["h100"]) in ("p2p", "all_gather")
    with pytest.raises(ValueError, match="a2a needs heads divisible by 4"):
        estimate(Workload(heads=6, **base), "a2a", HARDWARE["h100"])


def test_the_model_ranks_what_it_should():
    h100 = HARDWARE["h100"]
    shape = dict(batch=1, heads=32, kv_heads=8, head_dim=128, v_head_dim=128, dtype_bytes=2)
    # contiguous causal leaves the last rank ~(2N-1)/N of the average work; Ulysses is balanced
    lopsided = Workload(8, seq_len=65536, layout="contiguous", **shape)
    assert estimate(lopsided, "a2a", h100).compute_s < 0.6 * estimate(lopsided, "p2p", h100).compute_s
    assert choose(lopsided, h100) == "a2a"
    # across nodes the 2-D mesh keeps its all-to-all inside a node, all-gather crosses them at once
    wide = Workload(64, seq_len=64 * 1024, inner=8, **shape)
    assert estimate(wide, "a2a+p2p", h100).comm_s < estimate(wide, "all_gather", h100).comm_s
    # long shards hide the ring's hops behind compute; all-gather cannot
    assert choose(Workload(8, seq_len=8 * 16384, **shape), h100) == "p2p"


def test_set_hardware_and_refusals():
    try:
        set_hardware("h200")
        assert cost.current_hardware("cpu").name == "h200"
        with pytest.raises(ValueError, match="unknown hardware preset 'tpu'"):
            set_hardware("tpu")
    finally:
        set_hardware(None)
    assert cost.current_hardware("cpu").name == "cpu_gloo" and cost.current_hardware("cuda").name == "h100"
    assert set(STRATEGIES) == {"p2p", "all_gather", "a2a", "a2a+p2p"}


@pytest.mark.parametrize("mesh,heads,documents", [(None, 4, False), (None, 6, True), ((2, 2), 4, True)])
def test_auto_is_exact(mesh, heads, documents):
    extra = dict(lengths=[5, 14, 9, 4]) if documents else {}
    errors = loopback_errors(4, layout="zigzag", causal=True, cp_comm_type="auto", mesh_shape=mesh, heads=heads,
                             kv_heads=2, local_len=8, sinks=True, **extra)
    assert max(errors.values()) <= 0.0, errors


def test_auto_is_agreed_when_ranks_model_different_hardware(monkeypatch):
    """Rank 0 models an H100, rank 1 the CPU preset (as set_hardware or LOCAL_WORLD_SIZE can make
    them): alone they pick the ring and the all-to-all, and the group would run mismatched
    collectives. Agreed, both run rank 0's pick, exactly."""
    import threading

    from cp_attention.strategies import auto
    from cp_attention.strategies.plan_cache import plan_cache
    from tests.support.core.reference import reference_attention

    seat = threading.local()
    profiles = {0: HARDWARE["h100"], 1: HARDWARE["cpu_gloo"]}
    monkeypatch.setattr(auto, "current_hardware", lambda device_type: profiles[seat.rank])
    shape = dict(world_size=2, batch=1, seq_len=16, heads=4, kv_heads=2, head_dim=16, v_head_dim=16, dtype_bytes=8,
                 causal=True, layout="zigzag", backward=True)
    assert [choose(Workload(**shape), profiles[r]) for r in (0, 1)] == ["p2p", "a2a"]  # they would differ
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 16, h, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    lay = cpa.get_layout("zigzag")

    def rank_fn(group):
        seat.rank = group.rank
        plan = cpa.plan(lay, group, causal=True)
        ql, kl, vl = (lay.shard(t, 1, group.rank, 2).requires_grad_() for t in (q, k, v))
        out = cpa.ring_attention(ql, kl, vl, plan=plan, cp_comm_type="auto")
        return out.detach(), dict(plan_cache(plan).auto_picks)

    results = LoopbackGroup(2, timeout_s=20).run(rank_fn)
    picks = [set(p.values()) for _, p in results]
    assert picks == [{"p2p"}, {"p2p"}], picks
    ref, _ = reference_attention(q, k, v, True, 16 ** -0.5)
    for r, (out, _) in enumerate(results):
        assert torch.allclose(out, lay.shard(ref, 1, r, 2), atol=1e-10, rtol=0)
