#!/usr/bin/env python
"""Pre-train a tiny megatron-core GPTModel with context parallelism on CPU (gloo), nothing downloaded.

The model is megatron's own ``GPTModel`` built from ``get_gpt_layer_ring_spec`` (ring attention in
the ``core_attention`` slot, any layout); the text is Python's ``pydoc_data.topics`` as bytes.
Ranks are laid out by megatron's ``parallel_state`` as TP x CP x DP.

    python scripts/pretrain_megatron.py                          # spawns 2 ranks, CP=2
    python scripts/pretrain_megatron.py --layout interleaved --world-size 4 --cp-size 2   # CP=2 x DP=2
    python scripts/pretrain_megatron.py --world-size 4 --tp-size 2 --cp-size 2            # TP=2 x CP=2
    torchrun --nproc-per-node=2 scripts/pretrain_megatron.py     # or under torchrun
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from cp_attention.training.ranks import run_on_ranks  # noqa: E402

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).* not installed")


def build_model(args: argparse.Namespace):
    """A tiny GPTModel with ring attention, prepared for CP (RoPE at global positions)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from cp_attention.integrations import megatron as cpm

    config = TransformerConfig(
        num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=256,
        normalization="RMSNorm", attention_dropout=0.0, hidden_dropout=0.0, use_cpu_initialization=True,
        tensor_model_parallel_size=args.tp_size, context_parallel_size=args.cp_size,
        params_dtype=getattr(torch, args.dtype))
    torch.manual_seed(args.seed)
    spec = cpm.get_gpt_layer_ring_spec(args.layout, kernel=args.kernel, normalization="RMSNorm")
    model = GPTModel(config, spec, vocab_size=256, max_sequence_length=args.seq_len,
                     position_embedding_type="rope").to(getattr(torch, args.dtype))
    return cpm.apply_context_parallel(model)


def batches(args: argparse.Namespace):
    """Full-sequence megatron batch dicts (the same on every rank), shifted labels and a loss mask."""
    from cp_attention.training import load_bytes

    data = load_bytes("builtin")  # Python's bundled help texts as bytes
    gen = torch.Generator().manual_seed(args.seed)
    positions = torch.arange(args.seq_len).expand(args.batch, args.seq_len)
    while True:
        starts = torch.randint(0, data.numel() - args.seq_len - 1, (args.batch,), generator=gen)
        window = torch.stack([data[s: s + args.seq_len + 1] for s in starts.tolist()])
        yield {"tokens": window[:, :-1], "labels": window[:, 1:], "position_ids": positions,
               "loss_mask": torch.ones(args.batch, args.seq_len)}


def train(args: argparse.Namespace) -> list[float]:
    """Run the pre-training loop on this rank; returns the global mean loss of every step."""
    from megatron.core import parallel_state as ps

    from cp_attention.integrations import megatron as cpm

    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp_size, context_parallel_size=args.cp_size)
    cp_group = ps.get_context_parallel_group()
    dp_cp_group = ps.get_data_parallel_group(with_context_parallel=True)
    dp_size = ps.get_data_parallel_world_size()
    model = build_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = batches(args)
    losses = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        full = [next(data) for _ in range(dp_size)][ps.get_data_parallel_rank()]  # one batch per DP replica
        local = cpm.get_batch_on_this_cp_rank(full, layout=args.layout)
        per_token = model(local["tokens"], local["position_ids"], None, labels=local["labels"])
        stats = torch.stack([(per_token * local["loss_mask"]).sum().detach(), local["loss_mask"].sum()])
        dist.all_reduce(stats, group=cp_group)
        # This rank's share of the sequence's mean loss: summed over CP it is the full gradient.
        ((per_token * local["loss_mask"]).sum() / stats[1]).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=dp_cp_group)
            p.grad /= dp_size
        opt.step()
        opt.zero_grad()
        losses.append((stats[0] / stats[1]).item())
        if dist.get_rank() == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            tok_s = (step + 1) * args.batch * args.seq_len * dp_size / (time.perf_counter() - t0)
            print(f"step {step:4d}  loss {losses[-1]:.4f}  {tok_s:,.0f} tokens/s", flush=True)
    ps.destroy_model_parallel()
    return losses


def parse_args(argv: "list[str] | None" = None) -> argparse.Namespace:
    """Command-line arguments, with ``world_size`` from torchrun's environment when present.

    Exits with a usage error if the sizes do not fit together or the layout cannot split ``seq_len``.
    """
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn when not under torchrun")
    p.add_argument("--cp-size", type=int, default=None, help="default: world size / tp size")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--layout", default="zigzag")
    p.add_argument("--kernel", default="auto")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64", "bfloat16"))
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=5)
    args = p.parse_args(argv)
    if "RANK" in os.environ:
        args.world_size = int(os.environ["WORLD_SIZE"])
    args.cp_size = args.cp_size or args.world_size // args.tp_size
    if args.cp_size < 1 or args.world_size % (args.tp_size * args.cp_size):
        p.error(f"--world-size {args.world_size} must be a multiple of tp_size x cp_size = "
                f"{args.tp_size} x {args.cp_size}")
    try:  # fail here, not on every rank
        import cp_attention as cpa

        cpa.get_layout(args.layout).check(args.seq_len, args.cp_size)
    except ValueError as e:
        p.error(str(e))
    return args


def main() -> None:
    args = parse_args()
    run_on_ranks(train, args.world_size, args)


if __name__ == "__main__":
    main()
