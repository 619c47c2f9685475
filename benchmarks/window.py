"""The sliding-window benchmark and the layout comparison's windowed
measurement: ``ring_attention(window_size=)`` forward and forward+backward on CPU gloo, per layout and
window, against the same layout without a window in the same run, beside what the work model predicts.

A window is given as a fraction denominator ``d`` of the sequence: ``W = S // d`` tokens (0 = no window).
Two conventions turn W into flash-attn's ``window_size=(left, right)``:

  hf     left = W - 1: a query sees W keys, itself included (HF/Mistral ``sliding_window=W``)
  flash  left = W:     a query sees W + 1 keys (flash-attn ``window_size=(W, 0)``)

Causal: ``(left, 0)``; not causal: ``(left, left)``, a symmetric band.

Usage (from the repo root):
  python benchmarks/window.py [--seq-lens 16384] [--layouts contiguous zigzag] [--windows 0 64 8]
  python benchmarks/window.py --quick          # smoke test
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script: `benchmarks` imports from the repository root, and this folder's
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # files never shadow top-level packages

import argparse
import json
import statistics

import torch
import torch.distributed as dist

from benchmarks import args as flags
from benchmarks.attention import make_inputs, ours
from benchmarks.measure import Stopwatch, command_text, limit_malloc_caching, measure, memory_method
from benchmarks.modelled import AttentionShape, comm_bytes_per_rank, imbalance, one_thread, step_sync_efficiency
from cp_attention import LAYOUT_NAMES
from cp_attention.kernels.dtypes import DTYPES
from cp_attention.launch import spawn
from cp_attention.layouts import get_layout
from cp_attention.schedules import ring_length, work_model

__all__ = ["CONVENTIONS", "NO_WINDOW", "window_size", "window_label", "check_fractions", "modelled_window",
           "ring_worker", "measure_windows", "run"]

CONVENTIONS = ("hf", "flash")
NO_WINDOW = 0


def window_label(fraction: int) -> str:
    """``"none"`` for 0, else ``"S/d"``."""
    return "none" if fraction == NO_WINDOW else f"S/{fraction}"


def window_size(seq_len: int, fraction: int, causal: bool, convention: str = "hf") -> tuple[int, int]:
    """flash-attn's ``(left, right)`` for a window of ``W = seq_len // fraction`` tokens (see the module
    docstring); ``(-1, -1)`` for ``fraction`` 0. Raises ``ValueError`` for a bad convention or fraction."""
    if convention not in CONVENTIONS:
        raise ValueError(f"window convention must be one of {CONVENTIONS}, got {convention!r}")
    if fraction == NO_WINDOW:
        return -1, -1
    if fraction < 1 or seq_len // fraction < 1:
        raise ValueError(f"window fraction {fraction} gives no window of S={seq_len} (need 1 <= d <= S)")
    w = seq_len // fraction
    left = w - 1 if convention == "hf" else w
    return (left, 0) if causal else (left, left)


def check_fractions(fractions, allow_none: bool) -> None:
    """Raise ``ValueError`` unless ``fractions`` is a list of ints >= 1 (or 0 with ``allow_none``)."""
    low = 0 if allow_none else 1
    if not isinstance(fractions, (list, tuple)) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= low for d in fractions):
        raise ValueError(f"expected a list of integers >= {low} (window W = S / d), got {fractions!r}")


def modelled_window(layout: str, causal: bool, seq_len: int, world_size: int, fraction: int,
                    convention: str = "hf") -> dict:
    """The work model under one window: ``{"window_size", "work", "ring_length"}`` (``work[rank][step]``,
    zeros on the steps the ring does not run). Run it on one torch thread (:func:`benchmarks.modelled.one_thread`)
    for speed at large N."""
    ws = window_size(seq_len, fraction, causal, convention)
    length = ring_length(layout, causal, seq_len, world_size, ws)
    return {"window_size": ws, "work": work_model(layout, causal, seq_len, world_size, window_size=ws),
            "ring_length": length}


# ---------------------------------------------------------------- measured

def ring_worker(args, seq: int) -> dict:
    """One rank: every (layout, window) of ``args`` timed round-robin, so noise hits all alike."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    full = make_inputs(args, seq)
    impls = {}
    for lay in (get_layout(x) for x in args.layouts):
        shard = [lay.shard(t, 1, rank, ws) for t in full]
        for d in args.windows:
            win = window_size(seq, d, args.causal, args.convention)
            impls[f"ring/{lay.name} {window_label(d)}"] = ours(*shard, dist.group.WORLD, lay, args.kernel,
                                                              args.causal, window_size=win)
    return {"rows": measure(impls, seq, args.repeats, dist.group.WORLD), "threads": torch.get_num_threads(),
            "memory": memory_method()}


def measure_windows(args, seq: int) -> list[dict]:
    """Time every layout and window of ``args`` at one S on ``args.world_size`` gloo ranks (one thread
    each) and set each against the same layout without a window (added if ``args.windows`` lacks 0).

    ``args``: world_size, layouts, windows (fraction denominators), convention, batch, heads,
    kv_heads, head_dim, dtype, kernel, repeats, causal, timeout. One record per (layout, window):
    times, ``time_x_none`` (forward+backward over the no-window row; ``best_x_none`` the same for the
    fastest call of each, which a shared machine disturbs least), the work model's
    ``model_busiest_x_none`` (the busiest rank's pairs over its pairs without the window),
    ``model_sync_x_none`` (the sum over ring steps of the busiest rank's pairs, the same ratio),
    the ring length and the K/V + dK/dV bytes each rank sends.
    """
    args = argparse.Namespace(**{**vars(args), "windows": [NO_WINDOW] + [d for d in args.windows if d != NO_WINDOW]})
    ring = spawn(ring_worker, args.world_size, args, seq, threads=1, timeout_s=args.timeout)
    shape = AttentionShape(args.batch, args.heads, args.kv_heads, args.head_dim,
                           elem_bytes=DTYPES[args.dtype].itemsize)
    timed = {r.impl: r for r in ring["rows"]}
    out = []
    for name in (get_layout(x).name for x in args.layouts):
        with one_thread():
            model = {d: modelled_window(name, args.causal, seq, args.world_size, d, args.convention)
                     for d in args.windows}
        base_w, base_t = model[NO_WINDOW]["work"], timed[f"ring/{name} none"]
        for d in args.windows:
            m, r = model[d], timed[f"ring/{name} {window_label(d)}"]
            w = m["work"]
            fwd_b, bwd_b = comm_bytes_per_rank(seq, args.world_size, shape, m["ring_length"])
            out.append({
                "world_size": args.world_size, "seq_len": seq, "layout": name, "window": window_label(d),
                "fraction": d, "window_left": m["window_size"][0], "window_right": m["window_size"][1],
                "fwd_ms": r.fwd_ms, "fwdbwd_ms": r.fwdbwd_ms,
                "fwd_time_x_none": r.fwd_ms / base_t.fwd_ms, "time_x_none": r.fwdbwd_ms / base_t.fwdbwd_ms,
                "best_x_none": min(r.fwdbwd_runs_ms) / min(base_t.fwdbwd_runs_ms),
                "model_busiest_x_none": max(map(sum, w)) / max(map(sum, base_w)),
                "model_sync_x_none": _sync(w) / _sync(base_w),
                "ring_length": m["ring_length"], "modelled_imbalance": imbalance(w),
                "modelled_step_sync_efficiency": step_sync_efficiency(w),
                "fwd_bytes_per_rank": fwd_b, "bwd_bytes_per_rank": bwd_b, "fwdbwd_peak_mib": r.fwdbwd_peak_mib,
                "fwdbwd_spread": _spread(r.fwdbwd_runs_ms),
                "fwd_runs_ms": " ".join(f"{x:.2f}" for x in r.fwd_runs_ms),
                "fwdbwd_runs_ms": " ".join(f"{x:.2f}" for x in r.fwdbwd_runs_ms),
                "threads_per_rank": ring["threads"],
            })
    return out


def _spread(runs: list) -> float:
    """(slowest - fastest) / median of the timed calls: 0 with one call."""
    return (max(runs) - min(runs)) / statistics.median(runs)


def _sync(work) -> int:
    """Step-synchronous cost: the sum over ring steps of the busiest rank's pairs."""
    return sum(max(row[s] for row in work) for s in range(len(work[0])))


# ---------------------------------------------------------------- the script

def print_table(rows: list[dict]) -> None:
    """One line per (S, layout, window)."""
    head = (f"{'S':>6}  {'layout':<12}{'window':>7}{'left':>7}{'ring length':>12}{'fwd ms':>10}{'fwd+bwd ms':>12}"
            f"{'time x none':>13}{'best x none':>13}{'model x none':>14}{'sync x none':>13}{'K/V+dK/dV MiB':>15}"
            f"{'spread':>8}")
    print(head + "\n" + "-" * len(head))
    for r in rows:
        mib = (r["fwd_bytes_per_rank"] + r["bwd_bytes_per_rank"]) / 2**20
        print(f"{r['seq_len']:>6}  {r['layout']:<12}{r['window']:>7}{r['window_left']:>7}"
              f"{str(r['ring_length']) + '/' + str(r['world_size']):>12}{r['fwd_ms']:>10.1f}{r['fwdbwd_ms']:>12.1f}"
              f"{r['time_x_none']:>13.3f}{r['best_x_none']:>13.3f}{r['model_busiest_x_none']:>14.3f}"
              f"{r['model_sync_x_none']:>13.3f}{mib:>15.1f}{r['fwdbwd_spread']:>8.0%}")


def run(args: argparse.Namespace) -> list[dict]:
    """The whole benchmark for parsed ``args`` (seq_lens, world_size, layouts, windows, convention,
    batch, heads, kv_heads, head_dim, dtype, kernel, repeats, causal, timeout, json): prints the table,
    writes ``args.json`` if set, returns the records."""
    print(f"command: {command_text()}")
    mask = "causal" if args.causal else "non-causal"
    print(f"torch {torch.__version__}, world size {args.world_size}, gloo on 127.0.0.1, {mask}, {args.dtype}, "
          f"kernel {args.kernel}, B={args.batch} H={args.heads} Hkv={args.kv_heads} D={args.head_dim}; windows W = S/d "
          f"for d in {args.windows} (0 = none), {args.convention} convention "
          f"(left = {'W-1' if args.convention == 'hf' else 'W'}); median of {args.repeats} (+1 warm-up) of the "
          "slowest rank, every (layout, window) timed round-robin in one run", flush=True)
    limit_malloc_caching()
    clock = Stopwatch()
    rows: list[dict] = []
    for seq in args.seq_lens:
        rows += measure_windows(args, seq)
        print(f"  S={seq} done after {clock.seconds():.0f} s", flush=True)
    print(f"threads: 1 per rank x {args.world_size}\n")
    print_table(rows)
    print("\ntime x none: median forward+backward time over the same layout's time without a window (same run). "
          "best x none: the same for the fastest timed call of each (what a shared machine disturbs least). "
          "model x none: the busiest rank's score pairs over its pairs without the window (work_model); sync x "
          "none: the same for the sum over ring steps of each step's busiest rank. ring length: ring steps run / N. "
          "MiB: K/V and dK/dV each rank sends, forward + backward. spread: (slowest - fastest) / median of the timed "
          "forward+backward calls; above 25% another process probably competed for the cores.")
    print(f"\ntotal {clock.seconds():.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv, "torch": torch.__version__, "args": vars(args), "rows": rows}, f, indent=2)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.add_ring(p, seq_lens=[16384], world_size=2, layouts=LAYOUT_NAMES, kernel="auto")
    p.add_argument("--windows", type=int, nargs="+", default=[0, 64, 8],
                   help="window W = S/d for each d (0 = no window, always measured: the ratios' reference)")
    p.add_argument("--convention", choices=CONVENTIONS, default="hf",
                   help="hf: left = W-1 (W keys, HF sliding_window=W); flash: left = W (W+1 keys)")
    p.add_argument("--non-causal", dest="causal", action="store_false", help="a symmetric band (left, left)")
    flags.add_shape(p, batch=1, heads=8, kv_heads=None, head_dim=64, dtype="float32")
    flags.add_run(p, repeats=3, timeout=600, quick="smoke test: S = 1024, H = 2, D = 16, 1 repeat",
                  json="the results")
    args = p.parse_args(argv)
    flags.resolve_kv_heads(args)
    if args.quick:
        args.seq_lens, args.heads, args.kv_heads, args.head_dim, args.repeats = [1024], 2, 2, 16, 1
    try:
        check_fractions(args.windows, allow_none=True)
        for seq in args.seq_lens:
            for d in args.windows:
                window_size(seq, d, args.causal, args.convention)
    except ValueError as e:
        p.error(f"--windows: {e}")
    return args


if __name__ == "__main__":
    from benchmarks.measure import finish

    finish(run, parse_args())
