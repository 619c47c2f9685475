#!/usr/bin/env python
"""Per-rank memory of FSDP2 x context parallelism on a random-weight HuggingFace Llama: model states,
activations, tokens/s and the longest sequence under a memory cap, per dp x cp (see
cp_attention.experiments.memory_bench).

Usage (from the repo root):
  python scripts/benchmark_memory.py [--configs 1x1 2x1 1x2 2x2 1x4] [--seq-len 1024] [--cap-mib MIB]
                                     [--activation-checkpointing] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse

from cp_attention.experiments import memory_bench
from cp_attention.training.summary import benchmark_summary


def parse_args(argv: "list[str] | None" = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    memory_bench.add_arguments(p)
    return p.parse_args(argv)


if __name__ == "__main__":
    parsed = parse_args()
    memory_bench.run(parsed)
    print(benchmark_summary(parsed.json), flush=True)
