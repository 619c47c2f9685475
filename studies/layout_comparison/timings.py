"""The measured side of the layout comparison, on CPU gloo: wall timings and step-by-step kernel timings.

Per (world size, S): single-process attention (the baseline) and the real ``ring_attention`` of
every layout, with PyTorch's ring as a peer row, timed and memory-profiled by
``benchmarks.attention``; then, on every rank, the kernel calls of that rank's schedule timed step by step
(:func:`step_times`), which is the compute the ring engine does at each step without its merges and
communication.
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist

from benchmarks.attention import measure_seq
from benchmarks.measure import Stopwatch, call_ms
from benchmarks.modelled import imbalance, step_sync_efficiency
from cp_attention.kernels import get_kernel
from cp_attention.kernels.dtypes import dtype_from_name
from cp_attention.layouts import get_layout
from cp_attention.schedules import rank_steps
from studies.layout_comparison.analysis import split_problem

__all__ = ["step_times", "measure_all"]

PASSES = ("fwd", "bwd")


def _local_inputs(args, n: int, head_major_kv: bool) -> tuple[torch.Tensor, ...]:
    """Random local q, k, v, dout ``[B, n, H, D]``; K/V head-major in memory where the engine keeps them so."""
    g = torch.Generator().manual_seed(4321 + n)
    dt = dtype_from_name(args.dtype)
    b, h, hkv, d = args.batch, args.heads, args.kv_heads, args.head_dim
    q, dout = (torch.randn(b, n, h, d, generator=g).to(dt) for _ in range(2))
    if head_major_kv:
        k, v = (torch.randn(b, hkv, n, d, generator=g).to(dt).transpose(1, 2) for _ in range(2))
    else:
        k, v = (torch.randn(b, n, hkv, d, generator=g).to(dt) for _ in range(2))
    return q, k, v, dout


def _layout_step_ms(args, group, rank: int, ws: int, seq: int, layout) -> torch.Tensor:
    """This rank's kernel time per step, ``[2 (fwd, bwd), steps]`` in ms, median over repeats.

    A barrier starts every step on every rank together, so the ranks contend for the machine as
    they do in the ring.
    """
    n = seq // ws
    steps = rank_steps(get_layout(layout), args.causal, rank, ws, n)
    kernel = get_kernel(args.kernel, "cpu", dtype_from_name(args.dtype))
    q, k, v, dout = _local_inputs(args, n, getattr(kernel, "head_major_kv", False))
    scale = args.head_dim ** -0.5
    # Backward needs each block's out/LSE; the block's own are as good as the merged ones for timing.
    saved = [[kernel.forward(q[:, t.q], k[:, t.kv], v[:, t.kv], t.causal, scale) for t in tasks] for tasks in steps]

    def fwd(s: int) -> None:
        for t in steps[s]:
            kernel.forward(q[:, t.q], k[:, t.kv], v[:, t.kv], t.causal, scale)

    def bwd(s: int) -> None:
        for t, (o, lse) in zip(steps[s], saved[s]):
            kernel.backward(dout[:, t.q], q[:, t.q], k[:, t.kv], v[:, t.kv], o, lse, t.causal, scale)

    runs = torch.zeros(2, len(steps), args.repeats, dtype=torch.float64)
    for rep in range(args.repeats + 1):  # the first round warms up
        for p, fn in enumerate((fwd, bwd)):
            for s in range(len(steps)):
                ms = call_ms(partial(fn, s), group)  # every rank starts the step together
                if rep:
                    runs[p, s, rep - 1] = ms
    return runs.median(dim=-1).values


def step_times(args, group, rank: int, ws: int, seq: int) -> dict:
    """``ring_worker`` hook: ``{"step_ms": {layout: tensor [ws, 2, steps]}}`` gathered from every rank."""
    result = {}
    for layout in args.layouts:
        mine = _layout_step_ms(args, group, rank, ws, seq, layout)
        parts = [torch.empty_like(mine) for _ in range(ws)]
        dist.all_gather(parts, mine, group=group)
        result[get_layout(layout).name] = torch.stack(parts)
    return {"step_ms": result}


def _wall_rows(rows: list, ws: int) -> list[dict]:
    base = next((r for r in rows if r.impl == "baseline"), None)

    def ratio(x: float | None, b: float | None) -> float | None:
        return x / b if x is not None and b else None

    def spread(runs: list | None) -> float | None:
        return (max(runs) - min(runs)) / statistics.median(runs) if runs and len(runs) > 1 else None

    out = []
    for r in rows:
        out.append({
            "world_size": ws, "seq_len": r.seq, "impl": r.impl,
            "fwd_ms": r.fwd_ms, "fwdbwd_ms": r.fwdbwd_ms,
            "fwd_x_baseline": ratio(r.fwd_ms, base and base.fwd_ms),
            "fwdbwd_x_baseline": ratio(r.fwdbwd_ms, base and base.fwdbwd_ms),
            "fwd_peak_mib": r.fwd_peak_mib, "fwdbwd_peak_mib": r.fwdbwd_peak_mib,
            "fwd_spread": spread(r.fwd_runs_ms), "fwdbwd_spread": spread(r.fwdbwd_runs_ms),
            "fwd_runs_ms": " ".join(f"{x:.2f}" for x in r.fwd_runs_ms or []),
            "fwdbwd_runs_ms": " ".join(f"{x:.2f}" for x in r.fwdbwd_runs_ms or []),
            "error": r.error or "",
        })
    return out


def measure_all(m: dict, layouts: list[str], causal: bool, log: Callable[[str], None]) -> dict:
    """Run every (world size, S) of the ``measure`` config ``m``; return record tables.

    Returns ``{"wall": [...], "steps": [...], "summary": [...], "skipped": [...], "meta": {...}}``:
    wall-clock rows (with ratios to the baseline at the same world size and S), per-rank step times,
    measured imbalance/efficiency per layout and pass, and the combinations a layout cannot split.
    """
    tables: dict = {"wall": [], "steps": [], "summary": [], "skipped": [], "meta": {}}
    for ws in m["world_sizes"]:
        for seq in m["seq_lens"]:
            ok = []
            for lay in layouts:
                why = split_problem(lay, seq, ws)
                if why:
                    tables["skipped"].append({"part": "measured", "layout": lay, "world_size": ws,
                                              "seq_len": seq, "reason": why})
                else:
                    ok.append(lay)
            if not ok:
                continue
            # Layout objects, not names: unpickling one in a worker imports (and so registers) its module.
            args = argparse.Namespace(**{**m, "world_size": ws, "layouts": [get_layout(x) for x in ok],
                                         "causal": causal, "kv_heads": m["kv_heads"] or m["heads"]})
            clock = Stopwatch()
            base, ring = measure_seq(args, seq, step_times)
            log(f"measured world size {ws}, S={seq} in {clock.seconds():.0f} s")
            tables["wall"] += _wall_rows(base["rows"] + ring["rows"], ws)
            for lay, ms in ring["step_ms"].items():
                for p, name in enumerate(PASSES):
                    work = ms[:, p].tolist()
                    tables["summary"].append({
                        "layout": lay, "world_size": ws, "seq_len": seq, "pass": name,
                        "imbalance": imbalance(work), "step_sync_efficiency": step_sync_efficiency(work),
                        "slowest_steps_ms": sum(max(row[s] for row in work) for s in range(ws)),
                    })
                    tables["steps"] += [{"layout": lay, "world_size": ws, "seq_len": seq, "pass": name,
                                         "rank": r, "step": s, "ms": work[r][s]}
                                        for r in range(ws) for s in range(ws)]
            tables["meta"][f"ws{ws}_S{seq}"] = {
                "baseline_threads": base["threads"], "threads_per_rank": ring["threads"],
                "memory": ring["memory"], "torch_ring_check_max_abs_err": ring.get("torch_ring_check_max_abs_err"),
            }
    return tables
