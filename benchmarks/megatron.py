"""A megatron-core GPTModel step with context parallelism on CPU gloo against the model at CP=1.

Rows per sequence length S (the whole model: embedding, layers, output layer, megatron's loss):
  baseline         CP=1, one process with ``world_size`` threads, ring core attention (= the plain kernel)
  cp<N>/<layout>   CP=N over N processes, 1 thread each, built by get_gpt_layer_ring_spec(layout)

Usage (from the repo root):  python benchmarks/megatron.py [--seq-lens 4096 8192] [--repeats 3]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script: `benchmarks` imports from the repository root, and this folder's
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # files never shadow top-level packages

import argparse
import warnings

import torch
import torch.distributed as dist

from benchmarks import args as flags
from benchmarks.measure import Row, measure, memory_method, sweep
from cp_attention import LAYOUT_NAMES
from cp_attention.launch import spawn

__all__ = ["build", "step", "worker", "run"]

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


def worker(args, seq: int) -> dict:
    """One rank: every layout at CP = the group's size, or the CP=1 baseline in a group of one."""
    from megatron.core import parallel_state as ps

    from cp_attention.integrations import megatron as cpm

    cp = dist.get_world_size()
    ps.initialize_model_parallel(context_parallel_size=cp)
    tokens = torch.randint(0, args.vocab, (args.batch, seq + 1), generator=torch.Generator().manual_seed(seq))
    full = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
            "position_ids": torch.arange(seq).expand(args.batch, seq)}
    impls = {}
    for layout in (("contiguous",) if cp == 1 else args.layouts):
        model = build(args, cp, layout)
        impls["baseline" if cp == 1 else f"cp{cp}/{layout}"] = step(
            model, cpm.get_batch_on_this_cp_rank(full, layout=layout))
    try:
        rows = measure(impls, seq, args.repeats, ps.get_context_parallel_group() if cp > 1 else None)
    finally:
        ps.destroy_model_parallel()
    return {"rows": rows, "threads": torch.get_num_threads(), "memory": memory_method()}


def run(args: argparse.Namespace) -> list[Row]:
    """The whole benchmark for parsed command-line ``args``: prints the table and returns the rows."""
    header = (f"torch {torch.__version__}, GPTModel fp32: {args.layers} layers, H={args.heads} Hkv={args.kv_heads} "
              f"D={args.head_dim}, vocab {args.vocab}, B={args.batch}, causal; CP={args.world_size} on gloo; "
              f"median of {args.repeats} (+1 warm-up)")

    def measure_one(seq: int) -> tuple[dict, dict]:  # the same total threads either way
        return (spawn(worker, 1, args, seq, threads=args.world_size, timeout_s=args.timeout),
                spawn(worker, args.world_size, args, seq, threads=1, timeout_s=args.timeout))

    return sweep(header, args.seq_lens, measure_one, "CP", args.world_size)[0]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.add_ring(p, seq_lens=[4096, 8192], world_size=2, layouts=LAYOUT_NAMES, kernel="auto")
    flags.add_model(p, layers=2, vocab=256)
    flags.add_shape(p, heads=8, kv_heads=None, head_dim=64, batch=1)
    flags.add_run(p, repeats=3, timeout=600)  # repeats: timed training steps
    args = p.parse_args(argv)
    flags.resolve_kv_heads(args)
    return args


if __name__ == "__main__":
    from benchmarks.measure import finish

    finish(run, parse_args(), json_option=False)
