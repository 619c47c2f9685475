"""The sliding-window workload of the layout comparison (the ``window`` config group).

For every layout and world size, a causal window of ``W = S/d`` tokens for each ``d`` in
``window.fractions`` (:func:`benchmarks.window.window_size` turns W into ``window_size=(left, right)`` by
the configured convention) is set against no window, from the schedule's work model
(:func:`cp_attention.work_model` with ``window_size=``) and :func:`cp_attention.ring_length`:

- **ring length**: a ring step whose K/V no rank's window reaches does not run, so each rank receives
  ``L - 1`` K/V shards instead of ``N - 1`` and sends ``L - 1`` K/V and ``L - 1`` dK/dV hops
  (:func:`benchmarks.modelled.comm_bytes_per_rank`). Contiguous holds one stretch per rank and stops
  after ``ceil(W / (S/N)) + 1`` steps; zigzag and interleaved hold pieces everywhere, so their ring runs
  fully but computes only the band;
- **imbalance** and **step-synchronous efficiency** as in the rest of the comparison;
- the **projection** onto the configured cluster (:func:`studies.layout_comparison.analysis.project`, with only
  the steps that run), which names the winner per (N, W);
- a small measured run per layout and window on CPU gloo (:func:`benchmarks.window.measure_windows`).
"""

from __future__ import annotations

import argparse
from typing import Callable

from benchmarks.measure import Stopwatch
from benchmarks.modelled import AttentionShape, comm_bytes_per_rank, one_thread
from benchmarks.window import CONVENTIONS, NO_WINDOW, check_fractions, measure_windows, modelled_window, window_label
from cp_attention.layouts import get_layout
from cp_attention.schedules import ring_length
from studies.layout_comparison.analysis import ClusterSpec, project, split_problem, summarize

__all__ = ["TIE", "check_window", "window_tables", "measure_window", "window_figures", "window_section"]

Records = list[dict]
TIE = 0.01  # layouts whose projected time is within 1% of the best share the win


def check_window(w: dict) -> None:
    """Raise ``ValueError`` naming the ``window.*`` key, what it got and what it accepts."""
    def fail(key: str, got, want: str) -> None:
        raise ValueError(f"config window.{key}={got!r}: expected {want} (override with window.{key}=...)")

    def positive_int(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 1

    try:
        check_fractions(w["fractions"], allow_none=False)
    except ValueError:
        fail("fractions", w["fractions"], "a list of integers >= 1, e.g. [64,8] (W = S/64 and S/8)")
    if w["convention"] not in CONVENTIONS:
        fail("convention", w["convention"], " or ".join(CONVENTIONS))
    for key in ("seq_len", "bars_world_size"):
        if not positive_int(w[key]):
            fail(key, w[key], "a positive integer")
    for key, vals in (("world_sizes", w["world_sizes"]), ("measure.world_sizes", w["measure"]["world_sizes"]),
                      ("measure.seq_lens", w["measure"]["seq_lens"])):
        if not isinstance(vals, list) or not all(positive_int(v) for v in vals):
            fail(key, vals, "a list of positive integers, e.g. [2,4,8]")
    for key, seqs in (("seq_len", [w["seq_len"]]), ("measure.seq_lens", w["measure"]["seq_lens"])):
        for seq in seqs:
            if any(seq // d < 1 for d in w["fractions"]):
                fail(key, seq, f"at least the largest fraction {max(w['fractions'])} (a window of >= 1 token)")


# ---------------------------------------------------------------- modelled

def window_tables(w: dict, layouts: list[str], causal: bool, shape: AttentionShape, proj_shape: AttentionShape,
                  cluster: ClusterSpec, skipped: Records) -> dict:
    """``{"window", "window_winners", "window_work_per_rank_step"}``: one record per (N, window,
    layout), no window included (``fraction`` 0); the projected winner per (N, window); pairs per rank
    and step at ``window.bars_world_size`` for every window. Bytes use ``shape`` (the measured runs'),
    the projection ``proj_shape`` on ``cluster``."""
    with one_thread():  # the work model's index math runs fastest on one thread
        return _window_tables(w, layouts, causal, shape, proj_shape, cluster, skipped)


def _window_tables(w, layouts, causal, shape, proj_shape, cluster, skipped) -> dict:
    seq, fractions = w["seq_len"], [NO_WINDOW] + [d for d in w["fractions"] if d != NO_WINDOW]
    rows, winners, steps = [], [], []
    for ws in sorted({*w["world_sizes"], w["bars_world_size"]}):  # the picture's N too
        ok = []
        for lay in layouts:
            why = split_problem(lay, seq, ws)
            if why:
                skipped.append({"part": "window", "layout": lay, "world_size": ws, "seq_len": seq, "reason": why})
            else:
                ok.append(lay)
        ok = [lay for lay in ok if _supports_windows(lay, seq, ws, skipped)]
        base: dict[str, dict] = {}
        for d in fractions:
            here = []
            for lay in ok:
                m = modelled_window(lay, causal, seq, ws, d, w["convention"])
                work, length = m["work"], m["ring_length"]
                s = summarize(work, seq, causal)
                fwd, bwd = comm_bytes_per_rank(seq, ws, shape, length)
                p = project(work, seq, proj_shape, cluster, length)
                row = {
                    "layout": lay, "world_size": ws, "seq_len": seq, "window": window_label(d), "fraction": d,
                    "window_tokens": seq // d if d else seq, "window_left": m["window_size"][0],
                    "window_right": m["window_size"][1], "ring_length": length, "ring_length_saved": ws - length,
                    "kv_shards_received": length - 1, "fwd_bytes_per_rank": fwd, "bwd_bytes_per_rank": bwd,
                    "imbalance": s.imbalance, "step_sync_efficiency": s.step_sync_efficiency,
                    "total_pairs": s.total_pairs, "busiest_rank_pairs": max(s.per_rank),
                    "rank_pairs": " ".join(map(str, s.per_rank)),
                    "projected_fwdbwd_ms": (p.fwd_overlap_s + p.bwd_overlap_s) * 1e3,
                    "projected_fwdbwd_serial_ms": (p.fwd_serial_s + p.bwd_serial_s) * 1e3,
                    "projected_efficiency": p.efficiency_overlap, "comm_bound_fwd_steps": p.comm_bound_steps,
                }
                b = base.setdefault(lay, row)  # the no-window row comes first
                before = b["fwd_bytes_per_rank"] + b["bwd_bytes_per_rank"]
                saved = before - fwd - bwd
                row.update({
                    "bytes_saved_per_rank": saved, "bytes_saved_pct": 100 * saved / before if before else 0.0,
                    "busiest_pairs_x_none": row["busiest_rank_pairs"] / b["busiest_rank_pairs"],
                    "projected_x_none": row["projected_fwdbwd_ms"] / b["projected_fwdbwd_ms"],
                })
                here.append(row)
                if ws == w["bars_world_size"]:
                    mean = sum(s.per_rank) / ws
                    steps += [{"layout": lay, "world_size": ws, "seq_len": seq, "window": window_label(d), "rank": r,
                               "step": t, "pairs": work[r][t], "rank_total_over_mean": s.per_rank[r] / mean}
                              for r in range(ws) for t in range(ws)]
            if here:
                winners.append(_winner(here))
            rows += here
    return {"window": rows, "window_winners": winners, "window_work_per_rank_step": steps}


def _supports_windows(layout: str, seq: int, ws: int, skipped: Records | None = None) -> bool:
    """False (and a ``skipped`` record) for a layout whose tokens do not increase on a rank, which
    sliding-window schedules need (a user-defined layout may not)."""
    try:
        ring_length(layout, True, seq, ws, (0, 0))
    except NotImplementedError as e:
        if skipped is not None:
            skipped.append({"part": "window", "layout": layout, "world_size": ws, "seq_len": seq, "reason": str(e)})
        return False
    return True


def _best(rows: Records, key: str, low: bool = True) -> str:
    """The layouts within :data:`TIE` of the best ``key``, joined by " = "."""
    vals = [r[key] for r in rows]
    best = min(vals) if low else max(vals)
    near = [r["layout"] for r in rows if (r[key] <= best * (1 + TIE) if low else r[key] >= best * (1 - TIE))]
    return " = ".join(near)


def _winner(rows: Records) -> dict:
    r0 = rows[0]
    out = {"world_size": r0["world_size"], "seq_len": r0["seq_len"], "window": r0["window"],
           "fraction": r0["fraction"], "winner_projected": _best(rows, "projected_fwdbwd_ms"),
           "shortest_ring": _best(rows, "ring_length"),
           "best_step_sync_efficiency": _best(rows, "step_sync_efficiency", low=False)}
    out.update({f"projected_ms_{r['layout']}": r["projected_fwdbwd_ms"] for r in rows})
    return out


# ---------------------------------------------------------------- measured

def measure_window(w: dict, m: dict, layouts: list[str], causal: bool, log: Callable[[str], None]) -> Records:
    """Time ``ring_attention(window_size=)`` per layout and window (and without one) at each
    ``window.measure`` world size and S; ``m`` holds the attention settings (batch, heads, kv_heads,
    head_dim, dtype, kernel, repeats, timeout). Records of :func:`benchmarks.window.measure_windows`."""
    out: Records = []
    for ws in w["measure"]["world_sizes"]:
        for seq in w["measure"]["seq_lens"]:
            ok = [lay for lay in layouts if not split_problem(lay, seq, ws) and _supports_windows(lay, seq, ws)]
            if not ok:
                continue
            # Layout objects, not names: unpickling one in a worker imports (and so registers) its module.
            args = argparse.Namespace(**m, world_size=ws, layouts=[get_layout(x) for x in ok], windows=w["fractions"],
                                      convention=w["convention"], causal=causal)
            clock = Stopwatch()
            out += measure_windows(args, seq)
            log(f"measured sliding windows at world size {ws}, S={seq} in {clock.seconds():.0f} s")
    return out


# ---------------------------------------------------------------- report

def window_figures(cfg: dict, res: dict) -> dict[str, Records]:
    """The per-rank picture's records: ``window.bars_world_size``, the widest window."""
    if not res.get("window"):
        return {}
    widest = window_label(min(cfg["window"]["fractions"]))
    return {"window_work_bars": [r for r in res["window"]["window_work_per_rank_step"] if r["window"] == widest]}


def _f(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _table(headers: list[str], rows: list[list]) -> str:
    return "\n".join(["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
                     + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def _verdict(rows: Records, winners: Records, label: str) -> str:
    """One sentence per window: who wins at which N, and the numbers at the largest N."""
    mine = [x for x in winners if x["window"] == label and x["world_size"] > 1]
    if not mine:
        return ""
    by: dict[str, list[int]] = {}
    for x in mine:
        by.setdefault(x["winner_projected"], []).append(x["world_size"])
    text = f"**W = {label}**: projected winner " + "; ".join(
        f"{who} at N = {', '.join(map(str, ns))}" for who, ns in by.items()) + "."
    n = max(x["world_size"] for x in mine)
    at = [r for r in rows if r["window"] == label and r["world_size"] == n]
    none = {r["layout"]: r for r in rows if r["window"] == "none" and r["world_size"] == n}
    parts = [f"{r['layout']} runs {r['ring_length']} of {n} ring steps, sends "
             f"{100 - r['bytes_saved_pct']:.0f}% of its no-window bytes, imbalance {r['imbalance']:.3f} "
             f"(no window {none[r['layout']]['imbalance']:.3f}), step-sync efficiency {r['step_sync_efficiency']:.3f}, "
             f"projected {r['projected_fwdbwd_ms']:.2f} ms" for r in at]
    return text + f" At N = {n}: " + "; ".join(parts) + "."


def window_section(cfg: dict, res: dict) -> str:
    """The report's "Sliding windows" section."""
    w, wr = cfg["window"], res["window"]
    rows, winners, meas = wr["window"], wr["window_winners"], wr.get("window_measured") or []
    if not rows:
        return "## Sliding windows (window_size)\n\nEvery combination was skipped (see Skipped)."
    conv = ("left = W − 1: a query sees W keys, itself included (HF/Mistral `sliding_window=W`; "
            "`window.convention=flash` gives flash-attn's left = W, W + 1 keys)" if w["convention"] == "hf" else
            "left = W: a query sees W + 1 keys, itself included (flash-attn's `window_size=(W, 0)`; "
            "`window.convention=hf` gives HF's left = W − 1)")
    sh, c = cfg["projection"]["shape"], cfg["projection"]["cluster"]
    kv = cfg["kv_heads"] or cfg["heads"]
    parts = [
        "## Sliding windows (window_size)",
        f"A window of W = S/d tokens for d in {w['fractions']}, S = {w['seq_len']}, {conv}, "
        f"{'right = 0 (causal)' if cfg['causal'] else 'right = left (a symmetric band)'}, set against no "
        "window, from the work model (`work_model(window_size=)`, `ring_length`). A ring step whose K/V no rank's "
        "window reaches does not run: with L of N steps each rank receives L − 1 K/V shards instead of N − 1 and "
        "sends L − 1 K/V hops forward and L − 1 K/V plus L − 1 fp32 dK/dV hops backward. Contiguous holds one "
        "stretch per rank, so its ring stops once the window is covered; zigzag and interleaved hold pieces "
        "everywhere, so their ring runs fully and computes only the band. **MiB/rank**: forward + backward "
        f"(B={cfg['batch']}, Hkv={kv}, D={cfg['head_dim']}, {cfg['dtype']}), in brackets the share saved against "
        "no window. **pairs × none**: the busiest rank's score pairs over its pairs without the window. "
        f"**projected**: forward + backward with overlap on {c['name']} (the projection's model and shape: "
        f"H={sh['heads']}, Hkv={sh['kv_heads']}, D={sh['head_dim']}, {sh['elem_bytes']}-byte elements), counting only "
        f"the steps that run. Layouts within {TIE:.0%} of the best projected time share the win. Data: `window.csv`, "
        "`window_winners.csv`, `window_work_per_rank_step.csv`.",
    ]
    labels = list(dict.fromkeys(r["window"] for r in rows))
    for label in labels:
        trows = [[r["world_size"], r["layout"], f"{r['ring_length']}/{r['world_size']}", r["kv_shards_received"],
                  f"{(r['fwd_bytes_per_rank'] + r['bwd_bytes_per_rank']) / 2**20:.1f} ({r['bytes_saved_pct']:.0f}%)",
                  _f(r["busiest_pairs_x_none"], ".4f"), _f(r["imbalance"]), _f(r["step_sync_efficiency"]),
                  f"{r['projected_fwdbwd_ms']:.2f} ({r['projected_x_none']:.3f})"]
                 for r in rows if r["window"] == label]
        left = next(r["window_left"] for r in rows if r["window"] == label)
        parts += [f"### W = {label}" + ("" if label == "none" else f" (window_size = ({left}, "
                                        f"{next(r['window_right'] for r in rows if r['window'] == label)}))"),
                  _table(["N", "layout", "ring length", "K/V shards received", "MiB/rank (saved)", "pairs × none",
                          "imbalance", "step-sync eff", "projected ms (× none)"], trows)]
    heads = ["N"] + [f"W = {x}" for x in labels]
    sizes = sorted({x["world_size"] for x in winners})
    def cell(n: int, lab: str) -> str:
        x = next((x for x in winners if x["world_size"] == n and x["window"] == lab), None)
        return "-" if x is None else \
            f"{x['winner_projected']} ({min(v for k, v in x.items() if k.startswith('projected_ms_')):.2f} ms)"
    grid = [[n] + [cell(n, lab) for lab in labels] for n in sizes]
    cells = [x for x in winners if x["fraction"] != NO_WINDOW and x["world_size"] > 1]
    sole = {}
    for x in cells:
        sole[x["winner_projected"]] = sole.get(x["winner_projected"], 0) + 1
    summary = (f"Under a window (N ≥ 2, {len(cells)} cells) the projected winner is " + ", ".join(
        f"{who} in {k}" for who, k in sorted(sole.items(), key=lambda kv: -kv[1])) + "." if cells else "")
    parts += ["### Which layout wins", _table(heads, grid), summary]
    parts += [v for v in (_verdict(rows, winners, lab) for lab in labels if lab != "none") if v]
    parts.append("Without a window causal contiguous sharding is unbalanced (imbalance → (2N−1)/N) and zigzag "
                 "wins. "
                 "Under a window every query sees at most W keys, so that imbalance mostly disappears for every "
                 "layout (only the first W tokens have shorter rows), and what separates the layouts is the ring: "
                 "contiguous stops after the steps the window reaches, sending fewer bytes, while zigzag and "
                 "interleaved pay all N − 1 hops for ever smaller blocks and, for zigzag, steps at which only some "
                 "ranks compute (its step-sync efficiency falls).")
    if window_figures(cfg, res).get("window_work_bars"):
        parts.append(f"![work per rank under a window](window_work_bars.png)\n\n(`window_work_bars.csv`, N = "
                     f"{w['bars_world_size']}, W = {window_label(min(w['fractions']))})")
    if meas:
        mrows = [[r["world_size"], r["seq_len"], r["layout"], r["window"], r["window_left"],
                  f"{r['ring_length']}/{r['world_size']}", _f(r["fwd_ms"], ".1f"), _f(r["fwdbwd_ms"], ".1f"),
                  _f(r["time_x_none"]), _f(r["model_busiest_x_none"]), _f(r["modelled_imbalance"]),
                  _f(r["fwdbwd_spread"], ".0%")] for r in meas]
        fastest = []
        for (n, s, lab) in dict.fromkeys((r["world_size"], r["seq_len"], r["window"]) for r in meas):
            here = [r for r in meas if (r["world_size"], r["seq_len"], r["window"]) == (n, s, lab)]
            best = min(here, key=lambda r: r["fwdbwd_ms"])
            fastest.append(f"N = {n}, S = {s}, W = {lab}: {best['layout']} ({best['fwdbwd_ms']:.1f} ms)")
        parts += [
            "### Measured (this machine)",
            "`ring_attention(window_size=)` on CPU gloo, one process per rank with one thread each "
            f"(H={cfg['heads']}, D={cfg['head_dim']}, {cfg['dtype']}, kernel {cfg['kernel']}); every (layout, window) "
            f"timed round-robin in one run, median of the slowest rank over {cfg['repeats']} call(s) after one "
            "warm-up. **time × none**: forward+backward time over the same layout without a window; **model × "
            "none**: the work model's busiest-rank pairs, the same ratio. A band runs as row tiles against the keys "
            "they can see, with a small masked corner each: narrow windows pay per-call overhead and those corners, "
            "so time falls less than pairs. **spread** = (slowest − fastest) / median of the timed forward+backward "
            "calls. Data: `window_measured.csv`.",
            _table(["N", "S", "layout", "window", "left", "ring length", "fwd ms", "fwd+bwd ms", "time × none",
                    "model × none", "modelled imb", "spread"], mrows),
            "Fastest measured forward+backward: " + "; ".join(fastest) + ".",
        ]
    return "\n\n".join(parts)
