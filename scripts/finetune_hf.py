#!/usr/bin/env python
"""Fine-tune a tiny HuggingFace Llama with context parallelism on CPU (gloo), nothing downloaded.

The model is built from ``LlamaConfig`` with random weights, the text is Python's own
``pydoc_data.topics`` as bytes. Every rank holds 1/N of each sequence; gradients are summed over
the CP group, which gives exactly the gradients of the model without CP.

    python scripts/finetune_hf.py                      # spawns 2 ranks itself
    torchrun --nproc-per-node=2 scripts/finetune_hf.py # or under torchrun
    python scripts/finetune_hf.py --world-size 4 --layout interleaved --steps 30
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from cp_attention.training.ranks import run_on_ranks  # noqa: E402


def build_model(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    return LlamaForCausalLM(config)


def train(args: argparse.Namespace) -> list[float]:
    """Run the fine-tuning loop on this rank; returns the loss of every step."""
    from cp_attention.integrations import huggingface as cphf

    from cp_attention.training import load_bytes

    rank = dist.get_rank()
    data = load_bytes("builtin")  # Python's bundled help texts as bytes
    model = cphf.apply_context_parallel(build_model(args.seed), layout=args.layout, kernel=args.kernel)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed)  # the same batches on every rank
    losses = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        starts = torch.randint(0, data.numel() - args.seq_len, (args.batch,), generator=gen)
        ids = torch.stack([data[s: s + args.seq_len] for s in starts.tolist()])
        local = cphf.shard_batch({"input_ids": ids}, layout=args.layout)
        out = model(input_ids=local["input_ids"], position_ids=local["position_ids"])
        loss = cphf.causal_lm_loss(out.logits, local["shift_labels"])
        loss.backward()
        for p in model.parameters():  # each rank holds its share of the gradient: sum them
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            tok_s = (step + 1) * args.batch * args.seq_len / (time.perf_counter() - t0)
            print(f"step {step:4d}  loss {loss.item():.4f}  {tok_s:,.0f} tokens/s", flush=True)
    return losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn when not under torchrun")
    p.add_argument("--layout", default="zigzag")
    p.add_argument("--kernel", default="auto")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=5)
    args = p.parse_args()
    run_on_ranks(train, args.world_size, args)


if __name__ == "__main__":
    main()
