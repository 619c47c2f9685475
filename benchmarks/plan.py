"""Host time per attention call, with a plan built once per batch against without one.

What is measured is the host work of a ``ring_attention`` call before the engine starts: validation,
the plan lookup, the kernel choice and the lowered steps. The engine itself is replaced by a stub for
the timed calls (its work does not depend on the plan), so the figures are the per-layer overhead a
model pays on top of attention. World size 1 (no process group), packed documents of random lengths.

Usage (from the repo root):
  python benchmarks/plan.py [--tokens 65536] [--documents 1000 8000] [--calls 200]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script: `benchmarks` imports from the repository root, and this folder's
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # files never shadow top-level packages

import argparse
import contextlib
import random
import statistics
from typing import Iterator

import torch

from benchmarks import args as flags
from benchmarks.measure import call_times_ms, elapsed_ms
from cp_attention import api
from cp_attention.api import plan as build_plan
from cp_attention.api import ring_attention
from cp_attention.layouts.documents import cu_seqlens_from_lengths

__all__ = ["add_arguments", "run", "stub_engine"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    flags.add_documents(p, tokens=65536, documents=[1000, 8000], seed=0)
    flags.add_ring(p, layout="zigzag")
    p.add_argument("--calls", type=int, default=200, help="timed calls per measurement (one per layer)")


class _StubEngine:
    """Stands in for the engine's autograd Function: returns at once (the output is q itself)."""

    @staticmethod
    def apply(q, k, v, ring, sinks):
        return q, None


@contextlib.contextmanager
def stub_engine() -> Iterator[None]:
    """Run ``ring_attention`` calls without the engine: only their host work before it is timed."""
    saved = api.AttentionFunction
    api.AttentionFunction = _StubEngine
    try:
        yield
    finally:
        api.AttentionFunction = saved


def _boundaries(tokens: int, documents: int, seed: int) -> torch.Tensor:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, tokens), documents - 1))
    lengths = [b - a for a, b in zip([0, *cuts], [*cuts, tokens])]
    return torch.tensor(cu_seqlens_from_lengths(lengths), dtype=torch.int32)


def _per_call_us(fn, calls: int) -> float:
    # one warm-up: the first call of a batch builds what the others reuse
    return statistics.median(call_times_ms(fn, calls, warmup=1)) * 1e3


def run(args: argparse.Namespace) -> list[dict]:
    """Measure and print one row per document count; returns the rows."""
    q = torch.randn(1, args.tokens, 2, 16)
    rows = []
    print(f"host time per attention call before the engine starts: T={args.tokens} tokens, world 1, "
          f"layout {args.layout}, median of {args.calls} calls")
    print(f"{'documents':>9} | {'plan build (ms)':>15} | {'with plan (us)':>14} | {'without plan (us)':>17} | ratio")
    for docs in args.documents:
        cu = _boundaries(args.tokens, docs, args.seed)
        with stub_engine():
            def build(cu=cu):
                p = build_plan(args.layout, None, causal=True, cu_seqlens=cu)
                ring_attention(q, q, q, plan=p)  # its first call lowers the steps
                return p

            p, build_ms = elapsed_ms(build)
            with_plan = _per_call_us(lambda p=p: ring_attention(q, q, q, plan=p), args.calls)
            without = _per_call_us(lambda cu=cu: ring_attention(q, q, q, layout=args.layout, cu_seqlens=cu),
                                   args.calls)
        row = {"documents": docs, "plan_build_ms": build_ms, "with_plan_us": with_plan, "without_plan_us": without}
        rows.append(row)
        print(f"{docs:>9} | {build_ms:>15.1f} | {with_plan:>14.1f} | {without:>17.1f} | {with_plan / without:.3f}")
    return rows


if __name__ == "__main__":
    from benchmarks.measure import command_line

    command_line(__doc__, add_arguments, run, json_option=False)
