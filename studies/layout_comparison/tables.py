"""The modelled side of the layout comparison as record tables (lists of dicts, one per CSV row).

Everything here comes from the schedule's work model (exact pair counts) via
:mod:`studies.layout_comparison.analysis` and :mod:`benchmarks.modelled`; nothing runs attention. A
combination a layout cannot split is not an error: it becomes a ``skipped`` record with the layout's own
message, and the report lists it.
"""

from __future__ import annotations

from functools import cache
from typing import Iterable

from benchmarks.modelled import AttentionShape, comm_bytes_per_rank
from cp_attention.schedules import work_model
from studies.layout_comparison.analysis import ClusterSpec, pair_owners, project, split_problem, summarize

Records = list[dict]


@cache
def work(layout: str, causal: bool, seq_len: int, world_size: int) -> tuple[tuple[int, ...], ...]:
    """``work_model`` memoised: the sweeps ask for the same matrix several times."""
    return tuple(map(tuple, work_model(layout, causal, seq_len, world_size)))


def _splittable(part: str, layouts: Iterable[str], world_sizes: Iterable[int], seq_lens: Iterable[int],
                skipped: Records):
    """Yield (layout, world_size, seq_len) a layout can split; record the others in ``skipped``."""
    for ws in world_sizes:
        for seq in seq_lens:
            for lay in layouts:
                why = split_problem(lay, seq, ws)
                if why:
                    skipped.append({"part": part, "layout": lay, "world_size": ws, "seq_len": seq, "reason": why})
                else:
                    yield lay, ws, seq


def modelled(layouts: list[str], causal: bool, world_sizes: list[int], seq_lens: list[int],
             shape: AttentionShape, skipped: Records) -> Records:
    """One record per (layout, N, S): imbalance, step-synchronous efficiency, waste, bytes per rank."""
    rows = []
    for lay, ws, seq in _splittable("modelled", layouts, world_sizes, seq_lens, skipped):
        s = summarize(work(lay, causal, seq, ws), seq, causal)
        fwd, bwd = comm_bytes_per_rank(seq, ws, shape)
        rows.append({
            "layout": lay, "world_size": ws, "seq_len": seq,
            "imbalance": s.imbalance, "step_sync_efficiency": s.step_sync_efficiency,
            "redundant_fraction": s.redundant_fraction, "idle_fraction": s.idle_fraction,
            "total_pairs": s.total_pairs, "min_pairs": s.min_pairs, "busiest_rank_pairs": max(s.per_rank),
            "fwd_bytes_per_rank": fwd, "bwd_bytes_per_rank": bwd,
        })
    return rows


def work_rows(layouts: list[str], causal: bool, world_sizes: list[int], seq_len: int, skipped: Records) -> Records:
    """Score pairs per rank and step at one S, for every layout and N (``work[rank][step]`` flattened)."""
    rows = []
    for lay, ws, seq in _splittable("work", layouts, world_sizes, [seq_len], skipped):
        w = work(lay, causal, seq, ws)
        mean = sum(map(sum, w)) / ws
        rows += [{"layout": lay, "world_size": ws, "seq_len": seq, "rank": r, "step": s, "pairs": w[r][s],
                  "rank_total_over_mean": sum(w[r]) / mean}
                 for r in range(ws) for s in range(ws)]
    return rows


def atlas_rows(layouts: list[str], causal: bool, seq_len: int, world_size: int, skipped: Records) -> Records:
    """Every computed (query, key) pair in global positions with the rank and step that compute it."""
    rows = []
    for lay, ws, seq in _splittable("atlas", layouts, [world_size], [seq_len], skipped):
        rows += [{"layout": lay, "world_size": ws, "seq_len": seq, "q": q, "k": k, "rank": r, "step": s}
                 for q, k, r, s in pair_owners(lay, causal, seq, ws)]
    return rows


def projection_rows(layouts: list[str], causal: bool, world_sizes: list[int], seq_lens: list[int],
                    shape: AttentionShape, cluster: ClusterSpec, skipped: Records) -> Records:
    """Projected attention time per (layout, N, S) on ``cluster``, with and without overlap (ms)."""
    rows = []
    for lay, ws, seq in _splittable("projection", layouts, world_sizes, seq_lens, skipped):
        p = project(work(lay, causal, seq, ws), seq, shape, cluster)
        rows.append({
            "cluster": cluster.name, "layout": lay, "world_size": ws, "seq_len": seq,
            "fwd_overlap_ms": p.fwd_overlap_s * 1e3, "fwd_serial_ms": p.fwd_serial_s * 1e3,
            "bwd_overlap_ms": p.bwd_overlap_s * 1e3, "bwd_serial_ms": p.bwd_serial_s * 1e3,
            "ideal_fwdbwd_ms": (p.ideal_fwd_s + p.ideal_bwd_s) * 1e3,
            "efficiency_overlap": p.efficiency_overlap, "efficiency_serial": p.efficiency_serial,
            "slowest_fwd_step_ms": p.slowest_fwd_step_s * 1e3, "comm_bound_fwd_steps": p.comm_bound_steps,
        })
    return rows


def with_modelled_efficiency(summary: Records, causal: bool) -> Records:
    """Measured summary records with the modelled step-synchronous efficiency at the same N and S."""
    out = []
    for row in summary:
        s = summarize(work(row["layout"], causal, row["seq_len"], row["world_size"]), row["seq_len"], causal)
        out.append({**row, "modelled_efficiency": s.step_sync_efficiency, "modelled_imbalance": s.imbalance})
    return out
