#!/usr/bin/env python
"""Every cp_comm_type (p2p, all_gather, a2a, a2a+p2p) against one process on 4 CPU gloo ranks: forward and
forward+backward, causal, packed and windowed, per-rank peak memory, and how often cp_comm_type="auto"
picks a strategy within 10% of the best measured one (see cp_attention.experiments.strategy_bench).

Usage (from the repo root):
  python scripts/benchmark_strategies.py [--seq-lens 2048 8192] [--heads 8/2 8/8] [--masks causal packed window]
                                         [--repeats 5] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse

from cp_attention.experiments import strategy_bench
from cp_attention.training.summary import benchmark_summary


def parse_args(argv: "list[str] | None" = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    strategy_bench.add_arguments(p)
    return p.parse_args(argv)


if __name__ == "__main__":
    parsed = parse_args()
    strategy_bench.run(parsed)
    print(benchmark_summary(parsed.json), flush=True)
