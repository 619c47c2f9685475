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
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_common import (  # noqa: E402
    DTYPES, LAYOUTS, Row, baseline_worker, check_seq, free_port, limit_malloc_caching, ring_worker, spawn,
)

# ---------------------------------------------------------------- report

def _fmt(x: Optional[float], spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(rows: list[Row]) -> None:
    """One line per (S, impl); ratios are against the baseline at the same S."""
    base = {r.seq: r for r in rows if r.impl == "baseline"}
    head = f"{'S':>6}  {'impl':<20}{'fwd ms':>10}{'fwd x':>8}{'fwd+bwd ms':>12}{'fwd+bwd x':>11}{'peak MiB':>10}"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        b = base.get(r.seq)
        if r.error:
            print(f"{r.seq:>6}  {r.impl:<20}n/a: {r.error}")
            continue
        fr = r.fwd_ms / b.fwd_ms if b and b.fwd_ms else None
        br = r.fwdbwd_ms / b.fwdbwd_ms if b and b.fwdbwd_ms else None
        print(f"{r.seq:>6}  {r.impl:<20}{_fmt(r.fwd_ms, '10.1f')}{_fmt(fr, '8.3f')}"
              f"{_fmt(r.fwdbwd_ms, '12.1f')}{_fmt(br, '11.3f')}{_fmt(r.fwdbwd_peak_mib, '10.1f')}")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384, 32768],
                   help="global sequence lengths S")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--kernel", default="auto", help="cp_attention kernel (torch's ring always uses the flash op)")
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


def main() -> None:
    args = parse_args()
    ws = args.world_size
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    print(f"torch {torch.__version__}, world size {ws}, gloo on 127.0.0.1, causal, dtype {args.dtype}, "
          f"kernel {args.kernel}, B={args.batch} H={args.heads} Hkv={args.kv_heads} D={args.head_dim}, "
          f"median of {args.repeats} (+1 warm-up)", flush=True)
    limit_malloc_caching()
    t0 = time.perf_counter()
    rows = []
    for seq in args.seq_lens:  # baseline and ring back to back per S, so they see the same machine
        base = spawn(baseline_worker, 1, args, seq)
        ring = spawn(ring_worker, ws, args, seq, free_port(), None)
        rows += base["rows"] + ring["rows"]
        print(f"  S={seq} done after {time.perf_counter() - t0:.0f} s", flush=True)
    print(f"threads: baseline {base['threads']} (1 process), ring {ring['threads_per_rank']} per rank x {ws}")
    print(f"peak memory: {ring['memory']}; max over ranks, during fwd+bwd; "
          f"MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']}")
    if "torch_ring_check_max_abs_err" in ring:
        print(f"torch ring vs ours (zigzag, S={check_seq(ws)}, fp32, out+grads): "
              f"max abs err {ring['torch_ring_check_max_abs_err']:.2e}; {ring.get('torch_cp_options', '')}")
    print()
    print_table(rows)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if args.json:
        meta = {"argv": sys.argv, "torch": torch.__version__, "args": vars(args),
                **{k: v for k, v in ring.items() if k != "rows"}, "baseline_threads": base["threads"]}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=2)


if __name__ == "__main__":
    main()
