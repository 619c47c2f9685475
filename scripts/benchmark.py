#!/usr/bin/env python
"""Time causal ring attention (forward, forward+backward) against full attention, on CPU or one GPU.

CPU (default), rows per sequence length S:
  baseline           one process, full sequence, the same kernel, ``world_size`` threads
  ring/<layout>      cp_attention.ring_attention over ``world_size`` processes, 1 thread each
  torch_ring/zigzag  PyTorch's private templated ring (head-tail load balancing) on the same CPU flash op

GPU (``--device cuda``, see cp_attention/experiments/gpu_bench.py): Llama-3-8B attention shapes
(32/8 heads, head_dim 128, bf16), 8K tokens per rank, N in {2, 4, 8, 16}: each CUDA kernel's TFLOP/s
against F.scaled_dot_product_attention, each layout's schedule efficiency (ideal / busiest rank), and
the peak memory per rank.

Usage (from the repo root):  python scripts/benchmark.py [--quick] [--seq-lens 8192 16384] [--json out.json]
                             python scripts/benchmark.py --device cuda [--world-sizes 2 4 8 16]
"""

from __future__ import annotations

import argparse

from cp_attention import KERNEL_NAMES, LAYOUT_NAMES
from cp_attention.experiments import attention_bench, gpu_bench
from cp_attention.training.summary import benchmark_summary


def parse_args(argv: "list[str] | None" = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384, 32768],
                   help="global sequence lengths S")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUT_NAMES), choices=LAYOUT_NAMES)
    p.add_argument("--batch", type=int, default=1)
    gpu_bench.add_arguments(p)
    p.add_argument("--kernel", default="auto", choices=KERNEL_NAMES,
                   help="cp_attention kernel (torch's ring always uses the flash op)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per measurement, after 1 warm-up")
    p.add_argument("--no-torch-ring", dest="torch_ring", action="store_false", help="skip torch's ring row")
    p.add_argument("--quick", action="store_true", help="smoke test: S = 1024 2048")
    p.add_argument("--timeout", type=int, default=600, help="gloo timeout (s): a hang fails instead of waiting")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    gpu_bench.resolve_defaults(args)
    args.kv_heads = args.kv_heads or args.heads
    args.causal = True
    if args.quick:
        args.seq_lens = [1024, 2048]
    return args


if __name__ == "__main__":
    parsed = parse_args()
    (gpu_bench if parsed.device == "cuda" else attention_bench).run(parsed)
    print(benchmark_summary(parsed.json), flush=True)
