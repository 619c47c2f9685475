#!/usr/bin/env python
"""Time a megatron-core GPTModel step with context parallelism on CPU gloo against the model at CP=1.

Rows per sequence length S (the whole model: embedding, layers, output layer, megatron's loss):
  baseline         CP=1, one process with ``world_size`` threads, ring core attention (= the plain kernel)
  cp<N>/<layout>   CP=N over N processes, 1 thread each, built by get_gpt_layer_ring_spec(layout)

Usage (from the repo root):  python scripts/benchmark_megatron.py [--seq-lens 4096 8192] [--repeats 3]
"""

from __future__ import annotations

import argparse

from cp_attention import KERNEL_NAMES, LAYOUT_NAMES
from cp_attention.experiments import megatron_bench
from cp_attention.training.summary import benchmark_summary


def parse_args(argv: "list[str] | None" = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192], help="global sequence lengths S")
    p.add_argument("--world-size", type=int, default=2, help="the CP size")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUT_NAMES), choices=LAYOUT_NAMES)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--kernel", default="auto", choices=KERNEL_NAMES)
    p.add_argument("--repeats", type=int, default=3, help="timed steps per measurement, after 1 warm-up")
    p.add_argument("--timeout", type=int, default=600, help="gloo timeout (s): a hang fails instead of waiting")
    args = p.parse_args(argv)
    args.kv_heads = args.kv_heads or args.heads
    return args


if __name__ == "__main__":
    megatron_bench.run(parse_args())
    print(benchmark_summary(None, json_option=False), flush=True)
