"""The layout comparison's strategies x layouts part (the ``strategies`` config section): each
``cp_comm_type`` with each layout, modelled by the cost model (:mod:`cp_attention.strategies.cost`),
measured on CPU gloo at one small N, and projected to large N on a GPU cluster profile (NVLink inside a
node, InfiniBand across).
"""

from __future__ import annotations

from typing import Callable

import torch.distributed as dist

from cp_attention.layouts import get_layout
from cp_attention.strategies import STRATEGIES
from cp_attention.strategies.cost import HARDWARE, Workload, estimate, infeasible

__all__ = ["check_strategies", "strategy_tables", "measure_strategies", "strategies_section"]

Records = list[dict]


def check_strategies(s: dict) -> None:
    """Raise ``ValueError`` naming the ``strategies.*`` key that cannot run."""
    def fail(key: str, got, want: str) -> None:
        raise ValueError(f"config strategies.{key}={got!r}: expected {want} (override with strategies.{key}=...)")

    if not s.get("names") or any(n not in STRATEGIES for n in s["names"]):
        fail("names", s.get("names"), f"a non-empty list of {', '.join(STRATEGIES)}")
    if not isinstance(s.get("inner"), int) or s["inner"] < 2:
        fail("inner", s.get("inner"), "the a2a degree of a2a+p2p, an int >= 2")
    if s.get("hardware") not in HARDWARE:
        fail("hardware", s.get("hardware"), " or ".join(HARDWARE))
    for key in ("world_sizes", "seq_lens"):
        if not isinstance(s.get(key), list) or not all(isinstance(v, int) and v >= 1 for v in s[key]):
            fail(key, s.get(key), "a list of positive integers")
    m = s.get("measure") or {}
    if not isinstance(m.get("world_size"), int) or m["world_size"] < 0 or not isinstance(m.get("seq_len"), int) \
            or not isinstance(m.get("inner"), int) or m["inner"] < 2:
        fail("measure", m, "{world_size: N (0: do not measure), seq_len: S, inner: a2a degree >= 2}")


def _workload(s: dict, shape: dict, layout: str, causal: bool, world: int, seq: int) -> Workload:
    inner = s["inner"] if world % s["inner"] == 0 and world > s["inner"] else 1
    return Workload(world, shape["batch"], seq, shape["heads"], shape["kv_heads"] or shape["heads"], shape["head_dim"],
                    shape.get("v_head_dim") or shape["head_dim"], shape["elem_bytes"], causal, layout=layout,
                    inner=inner)


def strategy_tables(s: dict, layouts: list[str], causal: bool, shape: dict) -> dict[str, Records]:
    """``strategies_projected``: every (layout, strategy, N, S) on the profile, time and bytes per rank."""
    hw = HARDWARE[s["hardware"]]
    rows = []
    for lay in layouts:
        for world in s["world_sizes"]:
            for seq in s["seq_lens"]:
                if seq % get_layout(lay).divisor(world):
                    continue
                w = _workload(s, shape, lay, causal, world, seq)
                for name in s["names"]:
                    why = infeasible(w, name)
                    e = None if why else estimate(w, name, hw)
                    rows.append({"layout": lay, "strategy": name, "world_size": world, "seq_len": seq,
                                 "ms": None if e is None else e.total_s * 1e3,
                                 "exposed_comm_ms": None if e is None else e.exposed_comm_s * 1e3,
                                 "comm_mib": None if e is None else e.comm_bytes / 2**20,
                                 "kv_mib": None if e is None else e.peak_kv_bytes / 2**20, "why_not": why})
    return {"strategies_projected": rows}


def _measure_worker(layouts: list[str], names: list[str], seq: int, shape: dict, inner: int, repeats: int,
                    causal: bool) -> Records:
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks.measure import measure
    from benchmarks.strategies import Case, _calls, _tensors

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world // inner, inner)) if world % inner == 0 and world > inner else None
    case = Case(seq, shape["heads"], shape["kv_heads"] or shape["heads"], "causal" if causal else "full",
                shape["head_dim"])
    q, k, v, dout = _tensors(case)
    out = []
    for lay in layouts:
        shard = lambda t, lay=lay: get_layout(lay).shard(t, 1, rank, world)  # noqa: E731
        impls = {n: _calls(*(shard(t) for t in (q, k, v, dout)), group=mesh if n == "a2a+p2p" else None,
                           layout=lay, causal=causal, cp_comm_type=n)
                 for n in names if (n != "a2a+p2p" or mesh is not None) and (n != "a2a" or case.heads % world == 0)}
        for row in measure(impls, seq, repeats, dist.group.WORLD):
            out.append({"layout": lay, "strategy": row.impl, "world_size": world, "seq_len": seq,
                        "fwd_ms": row.fwd_ms, "fwdbwd_ms": row.fwdbwd_ms, "fwdbwd_peak_mib": row.fwdbwd_peak_mib})
    return out


def measure_strategies(s: dict, cfg: dict, layouts: list[str], causal: bool, log: Callable[[str], None]) -> Records:
    """Every (layout, strategy) on ``strategies.measure.world_size`` CPU gloo ranks at its S (fwd and
    fwd+bwd, median of the slowest rank), with the cost model's estimate on the ``cpu_gloo`` profile."""
    from cp_attention.launch import run_on_ranks

    m = s["measure"]
    if not m["world_size"]:
        return []
    shape = {"batch": 1, "heads": cfg["heads"], "kv_heads": cfg["kv_heads"], "head_dim": cfg["head_dim"],
             "elem_bytes": 4}
    lays = [lay for lay in layouts if m["seq_len"] % get_layout(lay).divisor(m["world_size"]) == 0]
    rows = run_on_ranks(_measure_worker, m["world_size"], lays, list(s["names"]), m["seq_len"], shape, m["inner"],
                        cfg["repeats"], causal, timeout_s=cfg["measure"]["timeout"])
    for r in rows:
        w = _workload({**s, "inner": m["inner"]}, shape, r["layout"], causal, r["world_size"], r["seq_len"])
        r["modelled_ms"] = estimate(w, r["strategy"], HARDWARE["cpu_gloo"]).total_s * 1e3
    log(f"measured {len(rows)} (layout, strategy) pairs at N={m['world_size']}, S={m['seq_len']}")
    return rows


def _f(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def strategies_section(cfg: dict, res: dict, md_table: Callable) -> str:
    """The report's section: measured here, then projected."""
    s, st = cfg["strategies"], res["strategies"]
    parts = ["## Communication strategies x layouts",
             "Each `cp_comm_type` runs the layout's own exact tasks; only how K/V travel differs (see "
             "docs/guides/strategies.md). a2a+p2p uses a 2-D mesh of N/inner x inner "
             f"(inner = {s['inner']}); a2a needs heads divisible by N."]
    meas = st.get("strategies_measured") or []
    if meas:
        parts += ["### Measured (this machine, CPU gloo)",
                  "Median of the slowest rank; `modelled ms` is the cost model on its `cpu_gloo` preset. Data: "
                  "`strategies_measured.csv`.",
                  md_table(["layout", "strategy", "N", "S", "fwd ms", "fwd+bwd ms", "modelled ms", "peak MiB"],
                           [[r["layout"], r["strategy"], r["world_size"], r["seq_len"], _f(r["fwd_ms"], ".1f"),
                             _f(r["fwdbwd_ms"], ".1f"), _f(r["modelled_ms"], ".1f"), _f(r["fwdbwd_peak_mib"], ".1f")]
                            for r in meas])]
    proj = st["strategies_projected"]
    rows = [[r["layout"], r["strategy"], r["world_size"], r["seq_len"],
             _f(r["ms"]) if r["why_not"] is None else "n/a", _f(r["exposed_comm_ms"]), _f(r["comm_mib"], ".1f"),
             _f(r["kv_mib"], ".1f")] for r in proj]
    parts += [f"### Projected ({s['hardware']} profile: NVLink inside a node, InfiniBand across)",
              "The cost model's forward+backward time per rank, its communication not hidden behind compute, bytes "
              "sent and K/V held per rank. Data: `strategies_projected.csv`.",
              md_table(["layout", "strategy", "N", "S", "ms", "exposed comm ms", "sent MiB", "K/V MiB"], rows)]
    return "\n\n".join(parts)
