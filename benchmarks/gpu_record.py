"""The markdown record of a GPU benchmark run: ``benchmarks/attention.py --device cuda --json RUN.json``
turned into ``docs/benchmarks/<date>-gpu-<device>.md`` (``benchmarks/gpu_check.sh`` writes both).

Usage (from the repo root):  python -m benchmarks.gpu_record RUN.json [--out RUN.md] [--commit abc1234]
                                 [--date 2026-11-28] [--tests pytest.log]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

__all__ = ["device_slug", "record", "parse_args", "main"]


def device_slug(name: str) -> str:
    """A GPU's name as a file name part: lower case, every run of other characters than letters and
    digits one ``-`` (``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"``)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _table(heads: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)] + ["| " + " | ".join(r) + " |" for r in rows]


def _errors(rows: list[dict], label) -> list[str]:
    """The rows' errors as a list, after a blank line (nothing without errors)."""
    found = [f"- {label(r)}: `{r['error']}`" for r in rows if r.get("error")]
    return [""] + found if found else []


def record(run: dict, commit: str = "unknown", date: str = "", tests: str | None = None) -> str:
    """The markdown of one run's JSON (:func:`benchmarks.gpu.run`'s): a header ``measured on <GPU>`` with
    the commit, torch and the shapes, then the kernel, schedule and packed-replay tables. ``tests``: the
    gpu-marked tests' summary line, if they ran."""
    a = run["args"]
    lines = [f"# GPU benchmark{', ' + date if date else ''}: {run['device']}", "",
             f"measured on {run['device']}, commit {commit}, torch {run['torch']}; {a['dtype']}, "
             f"{a['heads']} query / {a['kv_heads']} K/V heads, head dim {a['head_dim']}, causal, "
             f"{a['tokens_per_rank']} tokens per rank, kernel `{a['kernel']}` in the ring; median of "
             f"{a['repeats']} (+1 warm-up), CUDA events"
             + (f"; {run['wall_s']:.0f} s in all" if run.get("wall_s") is not None else "") + ".", ""]
    if not run.get("complete", True):
        lines += ["**Incomplete**: the run stopped before its last world size; these are the sizes it finished.", ""]
    # inline, not a bash fence: tests/system/test_docs.py runs the docs' bash blocks, and this needs CUDA
    lines += [f"Command: `{run.get('command', 'python benchmarks/attention.py --device cuda')}`", ""]
    if tests:
        lines += [f"gpu-marked tests: {tests}", ""]
    sdpa = {s["world_size"]: s for s in run.get("sdpa", [])}
    if sdpa:
        lines += ["## SDPA on the full sequence", ""]
        lines += _table(["N", "S", "fwd ms", "fwd+bwd ms"],
                        [[str(n), str(s["seq"]), _f(s["fwd_ms"], ".2f"), _f(s["fwdbwd_ms"], ".2f")]
                         for n, s in sdpa.items()]) + [""]
    lines += ["## Kernels on the full sequence", "", "TFLOP/s over causal pairs; × SDPA: its time over ours "
              "(> 1: faster than SDPA).", ""]
    lines += _table(["N", "kernel", "fwd ms", "fwd TFLOP/s", "fwd × SDPA", "fwd+bwd ms", "fwd+bwd TFLOP/s",
                     "fwd+bwd × SDPA"],
                    [[str(r["world_size"]), f"`{r['kernel']}`", _f(r["fwd_ms"], ".2f"), _f(r["fwd_tflops"], ".0f"),
                      _f(r["fwd_vs_sdpa"], ".2f"), _f(r["fwdbwd_ms"], ".2f"), _f(r["fwdbwd_tflops"], ".0f"),
                      _f(r["fwdbwd_vs_sdpa"], ".2f")] for r in run["kernels"] if not r.get("error")])
    picks = next((r["picks"] for r in run["kernels"] if r.get("picks")), None)
    if picks:
        named = (f"{kind} → " + (f"`{name}`" if name else "none") for kind, name in picks.items())
        lines += ["", "`auto` picks: " + ", ".join(named) + "."]
    lines += _errors(run["kernels"], lambda r: f"`{r['kernel']}` at N={r['world_size']}")
    lines += ["", "## Ring schedules (dense), busiest rank", "",
              "Each rank's schedule replayed alone (exchanges as local copies: compute only). Efficiency: "
              "SDPA on the full sequence / N over the busiest rank.", ""]
    lines += _table(["N", "layout", "fwd ms", "fwd eff", "fwd+bwd ms", "fwd+bwd eff", "peak MiB/rank",
                     "sent MiB/rank"],
                    [[str(r["world_size"]), r["layout"], _f(r["busiest_fwd_ms"], ".2f"), _f(r["fwd_efficiency"], ".1%"),
                      _f(r["busiest_fwdbwd_ms"], ".2f"), _f(r["fwdbwd_efficiency"], ".1%"),
                      _f(r["peak_mib_per_rank"], ".0f"), _f(r["sent_mib_per_rank"], ".1f")]
                     for r in run["schedules"] if not r.get("error")])
    lines += _errors(run["schedules"], lambda r: f"{r['layout']} at N={r['world_size']}")
    if run.get("packed"):
        lines += _packed(run, a)
    return "\n".join(lines).rstrip() + "\n"


def _packed(run: dict, a: dict) -> list[str]:
    lines = ["", "## Packed replay, busiest rank", "",
             f"Lognormal documents of mean {a.get('doc_mean', 2048):.0f} (sigma 1.5, seed 0) in T = N × "
             f"{a['tokens_per_rank']} tokens; each rank's packed schedule replayed alone. Efficiency: the whole "
             "batch through the single-GPU varlen kernel / N over the busiest rank. Sent: K/V + dK/dV of all ranks "
             "in one fwd+bwd (model: the work model's figure).", ""]
    lines += _table(["N", "T", "documents", "longest", "whole batch", "fwd ms", "fwd+bwd ms"],
                    [[str(b["world_size"]), str(b["tokens"]), str(b["documents"]), str(b["longest"]), b["kernel"],
                      _f(b["fwd_ms"], ".2f"), _f(b["fwdbwd_ms"], ".2f")] for b in run.get("packed_baselines", [])])
    lines += [""] + _table(["N", "layout", "needs-only", "fwd ms", "fwd eff", "fwd+bwd ms", "fwd+bwd eff",
                            "sent MiB", "model MiB"],
                           [[str(r["world_size"]), r["layout"], "yes" if r["needs_only"] else "no",
                             _f(r["busiest_fwd_ms"], ".2f"), _f(r["fwd_efficiency"], ".1%"),
                             _f(r["busiest_fwdbwd_ms"], ".2f"), _f(r["fwdbwd_efficiency"], ".1%"),
                             _f(r["sent_mib"], ".1f"), _f(r["model_mib"], ".1f")]
                            for r in run["packed"] if not r.get("error")])
    bad = run.get("packed_baselines", []) + run["packed"]
    return lines + _errors(bad, lambda r: f"{r.get('layout', 'whole batch')} at N={r['world_size']}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", help="the benchmark's --json output")
    p.add_argument("--out", help="the markdown file (default: the JSON's path with .md)")
    p.add_argument("--commit", default="unknown", help="the commit measured (git rev-parse --short HEAD)")
    p.add_argument("--date", default="", help="the run's date, for the title")
    p.add_argument("--tests", metavar="LOG", help="the gpu-marked tests' pytest log: its last line joins the header")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    """Write the record of ``argv``'s JSON; returns its path."""
    args = parse_args(argv)
    run = json.loads(Path(args.json).read_text(encoding="utf-8"))
    tests = None
    if args.tests and Path(args.tests).exists():
        tests = next((ln.strip() for ln in reversed(Path(args.tests).read_text(errors="replace").splitlines())
                      if ln.strip()), None)
    out = Path(args.out) if args.out else Path(args.json).with_suffix(".md")
    out.write_text(record(run, args.commit, args.date, tests), encoding="utf-8")
    return out


if __name__ == "__main__":
    print(main())
