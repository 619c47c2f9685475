#!/usr/bin/env python
"""Time a megatron-core GPTModel step with context parallelism on CPU gloo against the model at CP=1.

Rows per sequence length S (the whole model: embedding, layers, output layer, megatron's loss):
  baseline         CP=1, one process with ``world_size`` threads, ring core attention (= the plain kernel)
  cp<N>/<layout>   CP=N over N processes, 1 thread each, built by get_gpt_layer_ring_spec(layout)

Usage (from the repo root):  python scripts/benchmark_megatron.py [--seq-lens 4096 8192] [--repeats 3]
"""

from __future__ import annotations

import argparse
import datetime
import os
import pickle
import sys
import time
import warnings
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench_common import LAYOUTS, free_port, limit_malloc_caching, measure, memory_method, spawn  # noqa: E402
from benchmark import print_table  # noqa: E402

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).* not installed")


def build(args, cp: int, layout: str):
    """The benchmark GPTModel (seeded, fp32) with ring core attention, prepared for CP."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from cp_attention.integrations import megatron as cpm

    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.heads * args.head_dim, num_attention_heads=args.heads,
        num_query_groups=args.kv_heads, normalization="RMSNorm", attention_dropout=0.0, hidden_dropout=0.0,
        use_cpu_initialization=True, context_parallel_size=cp)
    torch.manual_seed(0)
    spec = cpm.get_gpt_layer_ring_spec(layout, kernel=args.kernel, normalization="RMSNorm")
    model = GPTModel(config, spec, vocab_size=args.vocab, max_sequence_length=max(args.seq_lens),
                     position_embedding_type="rope")
    return cpm.apply_context_parallel(model)


def step(model, batch) -> tuple:
    """Forward-only and forward+backward closures of one training step (megatron's own loss)."""
    def loss():
        return model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).sum()

    def fwd():
        with torch.no_grad():
            return loss()

    def fwdbwd():
        loss().backward()
        model.zero_grad(set_to_none=True)
    return fwd, fwdbwd


def worker(rank: int, args, seq: int, cp: int, port: int, out_path: str) -> None:
    """One rank: every layout at CP=``cp`` (or the CP=1 baseline with ``world_size`` threads)."""
    from megatron.core import parallel_state as ps

    from cp_attention.integrations import megatron as cpm

    torch.set_num_threads(args.world_size if cp == 1 else 1)  # the same total threads either way
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cp,
                            timeout=datetime.timedelta(seconds=args.timeout))
    ps.initialize_model_parallel(context_parallel_size=cp)
    tokens = torch.randint(0, args.vocab, (args.batch, seq + 1), generator=torch.Generator().manual_seed(seq))
    full = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
            "position_ids": torch.arange(seq).expand(args.batch, seq)}
    impls = {}
    for layout in (("contiguous",) if cp == 1 else args.layouts):
        model = build(args, cp, layout)
        impls["baseline" if cp == 1 else f"cp{cp}/{layout}"] = step(
            model, cpm.get_batch_on_this_cp_rank(full, layout=layout))
    rows = measure(impls, seq, args.repeats, ps.get_context_parallel_group() if cp > 1 else None)
    if rank == 0:
        with open(out_path, "wb") as f:
            pickle.dump({"rows": rows, "threads": torch.get_num_threads(), "memory": memory_method()}, f)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192], help="global sequence lengths S")
    p.add_argument("--world-size", type=int, default=2, help="the CP size")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--kernel", default="auto")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per measurement, after 1 warm-up")
    p.add_argument("--timeout", type=int, default=600, help="gloo timeout (s): a hang fails instead of waiting")
    args = p.parse_args(argv)
    args.kv_heads = args.kv_heads or args.heads
    return args


def main() -> None:
    args = parse_args()
    ws = args.world_size
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    print(f"torch {torch.__version__}, GPTModel fp32: {args.layers} layers, H={args.heads} Hkv={args.kv_heads} "
          f"D={args.head_dim}, vocab {args.vocab}, B={args.batch}, causal; CP={ws} on gloo; "
          f"median of {args.repeats} (+1 warm-up)", flush=True)
    limit_malloc_caching()
    t0 = time.perf_counter()
    rows = []
    for seq in args.seq_lens:  # baseline and CP back to back per S, so they see the same machine
        base = spawn(worker, 1, args, seq, 1, free_port())
        cp = spawn(worker, ws, args, seq, ws, free_port())
        rows += base["rows"] + cp["rows"]
        print(f"  S={seq} done after {time.perf_counter() - t0:.0f} s", flush=True)
    print(f"threads: baseline {base['threads']} (1 process), CP {cp['threads']} per rank x {ws}")
    print(f"peak memory: {cp['memory']}; max over ranks, during fwd+bwd; "
          f"MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']}\n")
    print_table(rows)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
