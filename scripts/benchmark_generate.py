#!/usr/bin/env python
"""Long-prompt generation under context parallelism on CPU: prefill time, per-token decode latency, KV
bytes per rank and bytes communicated per decoding step, for N = 1 (plain generate) and N > 1
(cp_attention.integrations.huggingface.generate); see cp_attention.experiments.generate_bench.

Usage (from the repo root):
  python scripts/benchmark_generate.py [--prompt-lens 4096 16384] [--worlds 1 2 4] [--new-tokens 8]
                                       [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse

from cp_attention.experiments import generate_bench
from cp_attention.training.summary import benchmark_summary


def parse_args(argv: "list[str] | None" = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    generate_bench.add_arguments(p)
    return p.parse_args(argv)


if __name__ == "__main__":
    parsed = parse_args()
    generate_bench.run(parsed)
    print(benchmark_summary(parsed.json), flush=True)
