"""The cost model behind cp_comm_type="auto": its pair counts against brute force, its bytes against
what the strategies send, its feasibility rules against the execution's, and "auto" itself exact."""

from __future__ import annotations

import pytest
import torch

from cp_attention.strategies import STRATEGIES
from cp_attention.strategies import cost
from cp_attention.strategies.cost import HARDWARE, Workload, choose, estimate, infeasible, pairs, set_hardware

from .loopback_cases import loopback_errors


@pytest.mark.parametrize("length,causal,window", [(17, True, (-1, -1)), (17, True, (4, 0)), (17, False, (3, 5)),
                                                  (17, False, (-1, 2)), (5, True, (9, 0)), (1, True, (0, 0))])
def test_pairs_count_the_mask(length, causal, window):
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    seen = torch.ones(length, length, dtype=torch.bool)
    if causal:
        seen &= j <= i
    if window[0] >= 0:
        seen &= j >= i - window[0]
    if window[1] >= 0 and not causal:
        seen &= j <= i + window[1]
    assert pairs(length, causal, window) == int(seen.sum())


def _work(**kw) -> Workload:
    base = dict(world_size=4, batch=1, seq_len=4096, heads=8, kv_heads=2, head_dim=64, v_head_dim=64, dtype_bytes=2)
    return Workload(**{**base, **kw})


def test_bytes_and_memory_follow_the_execution():
    w = _work(backward=False)
    kv = 1 * 1024 * 2 * 128 * 2  # one rank's K/V shard: n tokens x kv heads x (d + dv) x 2 bytes
    ring = estimate(w, "p2p", HARDWARE["h100"])
    gathered = estimate(w, "all_gather", HARDWARE["h100"])
    assert ring.comm_bytes == gathered.comm_bytes == 3 * kv  # N - 1 shards either way
    assert gathered.peak_kv_bytes == 4 * kv > ring.peak_kv_bytes  # all-gather holds every shard
    ulysses = estimate(w, "a2a", HARDWARE["h100"])
    q = o = 1024 * 8 * 64 * 2
    # 2 K/V heads cannot split over 4 ranks: they are repeated to 4 first (as the execution does)
    assert ulysses.comm_bytes == pytest.approx(3 / 4 * (q + 2 * kv + o))
    trained = estimate(_work(), "p2p", HARDWARE["h100"])
    assert trained.comm_bytes == 3 * kv + 2 * kv + 3 * kv * 2  # + backward: K/V twice, fp32 dK/dV thrice


def test_feasibility_matches_the_execution():
    assert infeasible(_work(heads=6, kv_heads=2), "a2a") is not None  # 6 heads over 4 ranks
    assert infeasible(_work(), "a2a+p2p") is not None  # a 1-D group
    assert infeasible(_work(heads=6, kv_heads=2, inner=2), "a2a+p2p") is None
    assert choose(_work(heads=6, kv_heads=2), HARDWARE["h100"]) in ("p2p", "all_gather")
    with pytest.raises(ValueError, match="a2a needs heads divisible by 4"):
        estimate(_work(heads=6, kv_heads=2), "a2a", HARDWARE["h100"])


def test_the_model_ranks_what_it_should():
    h100 = HARDWARE["h100"]
    # contiguous causal leaves the last rank ~(2N-1)/N of the average work; Ulysses is balanced
    lopsided = _work(layout="contiguous", seq_len=65536, world_size=8, heads=32, kv_heads=8)
    assert estimate(lopsided, "a2a", h100).compute_s < 0.6 * estimate(lopsided, "p2p", h100).compute_s
    # across nodes the ring's exposed hops grow; the 2-D mesh keeps its all-to-all inside a node
    wide = _work(world_size=64, seq_len=64 * 1024, heads=32, kv_heads=8, inner=8)
    assert estimate(wide, "a2a+p2p", h100).comm_s < estimate(wide, "all_gather", h100).comm_s


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
