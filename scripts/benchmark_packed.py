#!/usr/bin/env python
"""Time causal ring attention over packed documents (cu_seqlens) on CPU gloo against attention run
document by document in one process (see cp_attention.experiments.packed_bench).

Usage (from the repo root):  python scripts/benchmark_packed.py [--tokens 65536] [--documents 1000]
"""

from __future__ import annotations

import argparse

from cp_attention import KERNEL_NAMES, LAYOUT_NAMES
from cp_attention.kernels.dtypes import DTYPES
from cp_attention.experiments import packed_bench
from cp_attention.training.summary import benchmark_summary


def parse_args(argv: "list[str] | None" = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=65536, help="packed length T")
    p.add_argument("--documents", type=int, default=1000)
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal spread of the document lengths")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUT_NAMES), choices=LAYOUT_NAMES)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--kernel", default="auto", choices=KERNEL_NAMES)
    p.add_argument("--repeats", type=int, default=3, help="timed calls per round (after one warm-up)")
    p.add_argument("--rounds", type=int, default=3,
                   help="baseline and ring measured alternately this many times; each row is the median of rounds")
    p.add_argument("--timeout", type=int, default=600)
    args = p.parse_args(argv)
    args.kv_heads = args.kv_heads or args.heads
    return args


if __name__ == "__main__":
    packed_bench.run(parse_args())
    print(benchmark_summary(None, json_option=False), flush=True)
