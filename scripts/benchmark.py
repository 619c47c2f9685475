#!/usr/bin/env python
"""Time causal ring attention (forward, forward+backward) on CPU gloo against full attention.

Rows per sequence length S:
  baseline           one process, full sequence, the same kernel, ``world_size`` threads
  ring/<layout>      cp_attention.ring_attention over ``world_size`` processes, 1 thread each
  torch_ring/zigzag  PyTorch's private templated ring (head-tail load balancing) on the same CPU flash op

Usage (from the repo root):  python scripts/benchmark.py [--quick] [--seq-lens 8192 16384] [--json out.json]
"""

from __future__ import annotations

import argparse

from cp_attention import KERNEL_NAMES, LAYOUT_NAMES
from cp_attention.dtypes import DTYPES
from cp_attention.experiments import attention_bench


def parse_args(argv: "list[str] | None" = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384, 32768],
                   help="global sequence lengths S")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUT_NAMES), choices=LAYOUT_NAMES)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--kernel", default="auto", choices=KERNEL_NAMES,
                   help="cp_attention kernel (torch's ring always uses the flash op)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per measurement, after 1 warm-up")
    p.add_argument("--no-torch-ring", dest="torch_ring", action="store_false", help="skip torch's ring row")
    p.add_argument("--quick", action="store_true", help="smoke test: S = 1024 2048")
    p.add_argument("--timeout", type=int, default=600, help="gloo timeout (s): a hang fails instead of waiting")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    args.kv_heads = args.kv_heads or args.heads
    args.causal = True
    if args.quick:
        args.seq_lens = [1024, 2048]
    return args


if __name__ == "__main__":
    attention_bench.run(parse_args())
