#!/usr/bin/env python
"""Time ring attention under sliding windows on CPU gloo: per layout and window, forward and
forward+backward time, its ratio to the same layout without a window (same run), and the work
model's ratio (see cp_attention.experiments.window_bench).

Usage (from the repo root):
  python scripts/benchmark_window.py [--seq-lens 16384] [--layouts contiguous zigzag] [--windows 0 64 8]
  python scripts/benchmark_window.py --quick          # smoke test
"""

from __future__ import annotations

import argparse

from cp_attention import KERNEL_NAMES, LAYOUT_NAMES
from cp_attention.kernels.dtypes import DTYPES
from cp_attention.experiments import window_bench
from cp_attention.training.summary import benchmark_summary


def parse_args(argv: "list[str] | None" = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[16384], help="global sequence lengths S")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUT_NAMES), choices=LAYOUT_NAMES)
    p.add_argument("--windows", type=int, nargs="+", default=[0, 64, 8],
                   help="window W = S/d for each d (0 = no window, always measured: the ratios' reference)")
    p.add_argument("--convention", choices=window_bench.CONVENTIONS, default="hf",
                   help="hf: left = W-1 (W keys, HF sliding_window=W); flash: left = W (W+1 keys)")
    p.add_argument("--non-causal", dest="causal", action="store_false", help="a symmetric band (left, left)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--kernel", default="auto", choices=KERNEL_NAMES)
    p.add_argument("--repeats", type=int, default=3, help="timed calls per measurement, after 1 warm-up")
    p.add_argument("--quick", action="store_true", help="smoke test: S = 1024, H = 2, D = 16, 1 repeat")
    p.add_argument("--timeout", type=int, default=600, help="gloo timeout (s): a hang fails instead of waiting")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    args.kv_heads = args.kv_heads or args.heads
    if args.quick:
        args.seq_lens, args.heads, args.kv_heads, args.head_dim, args.repeats = [1024], 2, 2, 16, 1
    try:
        window_bench.check_fractions(args.windows, allow_none=True)
        for seq in args.seq_lens:
            for d in args.windows:
                window_bench.window_size(seq, d, args.causal, args.convention)
    except ValueError as e:
        p.error(f"--windows: {e}")
    return args


if __name__ == "__main__":
    parsed = parse_args()
    window_bench.run(parsed)
    print(benchmark_summary(parsed.json), flush=True)
