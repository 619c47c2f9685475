"""Run the spawned examples and the distributed tests many times and count the runs that aborted.

An abort is a run killed by SIGABRT (exit code -6 or 134), or one whose output holds
"terminate called" (a C++ exception escaping gloo's threads at exit), whatever its exit code. Other
failures are counted apart. Nothing is downloaded; every run has a timeout.

    python scripts/stress.py --runs 100                  # every target, 100 times each
    python scripts/stress.py --runs 20 --targets ring    # one target
    python scripts/stress.py --runs 5 --json out.json    # also write the counts as JSON

The commands run from the repository root (``root``), where scripts/ and tests/ live.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["TARGETS", "classify", "parse_args", "main"]

TARGETS = {
    "finetune_hf": [sys.executable, "scripts/finetune_hf.py", "--steps", "3", "--seq-len", "64", "--batch", "2"],
    "pretrain_megatron": [sys.executable, "scripts/pretrain_megatron.py", "--steps", "3", "--seq-len", "64",
                          "--batch", "2"],
    "ring": [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests/test_ring.py",
             "tests/test_faults.py", "tests/test_validation.py"],
}


def parse_args(argv: "list[str] | None" = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=100, help="runs per target")
    p.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    p.add_argument("--timeout", type=int, default=900, help="seconds per run")
    p.add_argument("--json", metavar="PATH", help="also write the counts as JSON")
    return p.parse_args(argv)


def classify(returncode: int, output: str) -> str:
    """'aborted', 'failed' or 'ok' for one run."""
    if returncode in (-6, 134) or "terminate called" in output:
        return "aborted"
    return "ok" if returncode == 0 else "failed"


def main(argv: "list[str] | None" = None, root: "str | Path" = ".") -> int:
    """Run every target ``--runs`` times from ``root``; print each non-ok run and the running counts.
    Returns 1 if any run aborted, failed or timed out, else 0."""
    args = parse_args(argv)
    counts = {t: {"ok": 0, "aborted": 0, "failed": 0, "timeout": 0, "seconds": 0.0} for t in args.targets}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for i in range(args.runs):
        for target in args.targets:
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(TARGETS[target], cwd=root, env=env, capture_output=True, text=True,
                                      timeout=args.timeout)
                verdict = classify(proc.returncode, proc.stdout + proc.stderr)
                if verdict != "ok":
                    tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
                    print(f"  run {i + 1} {target}: {verdict} (exit {proc.returncode}): " + " | ".join(tail),
                          flush=True)
            except subprocess.TimeoutExpired:
                verdict = "timeout"
                print(f"  run {i + 1} {target}: timed out after {args.timeout} s", flush=True)
            counts[target][verdict] += 1
            counts[target]["seconds"] += time.perf_counter() - t0
        done = ", ".join(f"{t}: {c['ok']} ok / {c['aborted']} aborted / {c['failed'] + c['timeout']} failed"
                         for t, c in counts.items())
        print(f"run {i + 1}/{args.runs}: {done}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(counts, indent=2))
    return 1 if any(c["aborted"] or c["failed"] or c["timeout"] for c in counts.values()) else 0
