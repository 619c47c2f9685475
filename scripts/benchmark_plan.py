#!/usr/bin/env python
"""Host time per attention call with a per-batch plan against without one (see
cp_attention.experiments.plan_bench).

Usage (from the repo root):
  python scripts/benchmark_plan.py [--tokens 65536] [--documents 1000 8000] [--calls 200]
"""

from __future__ import annotations

import argparse

from cp_attention.experiments import plan_bench
from cp_attention.training.summary import benchmark_summary


def parse_args(argv: "list[str] | None" = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    plan_bench.add_arguments(p)
    return p.parse_args(argv)


if __name__ == "__main__":
    plan_bench.run(parse_args())
    print(benchmark_summary(None, json_option=False), flush=True)
