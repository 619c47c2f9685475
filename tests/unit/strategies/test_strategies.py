"""cp_comm_type beyond the ring: all-gather, Ulysses all-to-all and all-to-all inside a ring, exact in
fp64 against one process for every layout and mask feature; the refusals, alike on every rank.

The matrix runs on the in-process loopback group (every rank a thread: cheap); real gloo processes,
with a real 2-D DeviceMesh for "a2a+p2p", check the same on process groups.
"""

from __future__ import annotations

import pytest
import torch

import cp_attention as cpa
from cp_attention.strategies.composite import pair_steps
from cp_attention.transport.loopback import LoopbackGroup
from tests.support.core import dist_cases
from tests.support.core.loopback_cases import loopback_errors

# (cp_comm_type, world size, mesh shape, heads, kv heads): N in {2, 3, 4} (6 for a 2-D mesh of 2 x 3);
# GQA with fewer K/V heads than the all-to-all degree, so they are repeated.
GROUPS = [("all_gather", 2, None, 4, 2), ("all_gather", 3, None, 6, 2), ("all_gather", 4, None, 4, 2),
          ("a2a", 2, None, 4, 2), ("a2a", 3, None, 6, 2), ("a2a", 4, None, 4, 2), ("a2a", 4, None, 4, 1),
          ("a2a+p2p", 4, (2, 2), 4, 2), ("a2a+p2p", 6, (2, 3), 6, 1)]
FEATURES = {
    "causal": dict(causal=True),
    "full": dict(causal=False),
    "packed": dict(causal=True, documents=True),
    "packed_full_window": dict(causal=False, documents=True, window=(4, 2)),
    "window": dict(causal=True, window=(5, 0)),
    "sinks_softcap_lse": dict(causal=True, sinks=True, softcap=3.0, lse_grad=True),
}
# Every group meets every feature once and every layout twice (the layout turns with the feature), so
# each strategy runs every layout and every feature at every N, in a third of the full product's time.
MATRIX = [(g, cpa.LAYOUT_NAMES[(i + j) % len(cpa.LAYOUT_NAMES)], f)
          for i, g in enumerate(GROUPS) for j, f in enumerate(FEATURES)]


def _documents(total: int) -> list[int]:
    """Odd document lengths over ``total`` tokens: none divides by the world size."""
    lengths, left, n = [], total, 3
    while left > n:
        lengths.append(n)
        left -= n
        n += 4
    return lengths + [left]


@pytest.mark.parametrize("group,layout,feature", MATRIX,
                         ids=[f"{g[0]}-{g[1]}{'x'.join(map(str, g[2])) if g[2] else ''}-{g[3]}h{g[4]}-{lay}-{f}"
                              for g, lay, f in MATRIX])
def test_every_strategy_is_exact(group, layout, feature):
    comm, world, mesh, heads, kv_heads = group
    opts = dict(FEATURES[feature])
    local_len = 8
    if opts.pop("documents", False):
        opts["lengths"] = _documents(local_len * world)
    errors = loopback_errors(world, layout=layout, cp_comm_type=comm, mesh_shape=mesh, heads=heads,
                             kv_heads=kv_heads, local_len=local_len, v_dim=12, use_plan=feature == "packed", **opts)
    assert max(errors.values()) <= 0.0, errors


@pytest.mark.parametrize("world,inner", [(4, 1), (4, 2), (4, 4), (6, 2), (6, 3), (8, 2)])
def test_virtual_ranks_meet_every_shard_once(world, inner):
    """Over the outer steps, each virtual rank a runs ring step t of flat rank p*inner + a exactly once
    for every t, against the shard the ring step names: rank (f - t) mod N."""
    outer = world // inner
    pairs = pair_steps((world,) * inner, world, inner)
    for p in range(outer):
        for a in range(inner):
            f = p * inner + a
            seen = [(t, ((p - s) % outer) * inner + b) for s, step in enumerate(pairs) for a2, b, t in step if a2 == a]
            assert sorted(t for t, _ in seen) == list(range(world))
            assert all(src == (f - t) % world for t, src in seen)


def _raised(world: int, fn, mesh_shape=None) -> list[str]:
    def body(group):
        try:
            fn(group)
        except ValueError as e:
            return str(e)
        return ""
    return LoopbackGroup(world, mesh_shape=mesh_shape).run(body)


def _qkv(heads: int = 4, kv_heads: int = 2, n: int = 4):
    return (torch.randn(1, n, heads, 8, dtype=torch.float64), torch.randn(1, n, kv_heads, 8, dtype=torch.float64),
            torch.randn(1, n, kv_heads, 8, dtype=torch.float64))


@pytest.mark.parametrize("case,expected", [
    ("a2a_heads", "needs heads divisible by 4, got 6"),
    ("mesh_heads", "needs heads divisible by 2, got 3"),
    ("no_mesh", "needs a two-level group"),
    ("unknown", "unknown cp_comm_type"),
    ("differ", "cp_comm_type"),
])
def test_refusals_alike_on_every_rank(case, expected):
    world, mesh = (4, (2, 2)) if case == "mesh_heads" else (4, None)

    def call(group):
        heads = {"a2a_heads": 6, "mesh_heads": 3}.get(case, 4)
        q, k, v = _qkv(heads, 1 if case == "mesh_heads" else 2)
        comm = {"a2a_heads": "a2a", "mesh_heads": "a2a+p2p", "no_mesh": "a2a+p2p", "unknown": "ulysses"}.get(
            case, "a2a" if group.rank == 1 else "p2p")
        cpa.ring_attention(q, k, v, group=group, cp_comm_type=comm)

    messages = _raised(world, call, mesh)
    assert messages[0] and len(set(messages)) == 1, messages
    assert expected in messages[0], messages[0]


@pytest.mark.parametrize("comm,mesh", [("all_gather", None), ("a2a", None), ("a2a+p2p", (2, 2))])
def test_process_groups_and_a_device_mesh(pools, comm, mesh):
    """Real gloo ranks (and a real 2-D DeviceMesh): batch 2, GQA, sinks, softcap, a window, the LSE's
    gradient; every rank's shard and the summed sink gradient within 1e-10 of one process in fp64."""
    errors = pools(4).run(dist_cases.attention_errors, layout="zigzag", causal=True, dtype="float64", kernel="auto",
                          heads=4, kv_heads=2, local_len=6, sinks=True, softcap=5.0, lse_grad=True, window=(9, 0),
                          atol=1e-10, rtol=0.0, cp_comm_type=comm, mesh_shape=mesh)
    for rank, e in enumerate(errors):
        assert e["out_dtype_ok"] and e["grad_dtypes_ok"] and e["dsinks_dtype_ok"], rank
        assert max(e[key] for key in ("out", "lse", "dq", "dk", "dv", "dsinks")) <= 0.0, (rank, e)
