"""Fine-tune a tiny HuggingFace Llama with context parallelism, nothing downloaded.

The model is built from ``LlamaConfig`` with random weights, the text is Python's own
``pydoc_data.topics`` as bytes. Every rank holds 1/N of each sequence; gradients are summed over
the CP group, which gives exactly the gradients of the model without CP. ``--device auto`` trains on
the GPUs (NCCL, rank i on cuda:LOCAL_RANK) when this machine has one per rank, else on the CPU (gloo).

    python examples/finetune_hf.py                      # spawns 2 ranks itself
    torchrun --nproc-per-node=2 examples/finetune_hf.py # or under torchrun
    python examples/finetune_hf.py --world-size 4 --layout interleaved --steps 30
    python examples/finetune_hf.py --world-size 4 --cp-comm-type a2a+p2p --cp-a2a-size 2
    python examples/finetune_hf.py --activation-checkpointing offload --mlp-chunks 4
    torchrun --nproc-per-node=8 examples/finetune_hf.py --device cuda --precision bf16

The loss runs the LM head and cross-entropy over chunks of ``--loss-chunk-tokens`` tokens (``cphf.lm_loss``:
the ``[tokens, vocab]`` logits never exist at once); ``--activation-checkpointing`` and ``--mlp-chunks`` put
``cphf.save_memory``'s savers on the model. None changes the result.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script: `examples` imports from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import time

import torch
import torch.distributed as dist

from cp_attention.launch import run_on_ranks
from cp_attention.training.cli import example_parser, memory_options, memory_savers, place_example
from cp_attention.training.data import load_bytes
from cp_attention.training.device import autocast, rank_device
from cp_attention.training.steps import progress_line, train_step
from cp_attention.training.summary import example_summary

__all__ = ["build_model", "train"]


def build_model(seed: int):
    """The example's tiny Llama (2 layers, GQA 4/2, byte vocabulary), seeded random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    return LlamaForCausalLM(config)


def train(args: argparse.Namespace) -> list[float]:
    """Run the fine-tuning loop on this rank (the process group is initialised); returns every step's loss.

    ``args``: layout, kernel, seq_len, batch, steps, lr, seed, log_every, device (``cpu``, ``cuda``: this
    rank's GPU, or ``auto``: what the group's backend needs), precision, cp_comm_type and cp_a2a_size
    (see ``example_parser``; a2a size: every rank's CP group is a 2-D DeviceMesh, the ring across
    dim 0 and all-to-all inside dim 1), and the memory savers (``memory_options``; absent: the loss in
    chunks of 1024 tokens, no savers).
    """
    from cp_attention.integrations import huggingface as cphf

    device = rank_device(getattr(args, "device", "auto"))
    precision = autocast(device, getattr(args, "precision", "fp32"))
    data = load_bytes("builtin")  # Python's bundled help texts as bytes
    model = build_model(args.seed).to(device)
    model.config.use_cache = False  # training never reads the KV cache HF would build each step
    chunk_tokens, checkpoint, mlp_chunks = memory_savers(args)
    group = None  # the default group: every rank
    a2a = getattr(args, "cp_a2a_size", None)
    if a2a:  # a two-level CP group; its CP rank (shard_batch's) is the flattened mesh rank
        from torch.distributed.device_mesh import init_device_mesh

        group = init_device_mesh(device.type, (dist.get_world_size() // a2a, a2a))
    model = cphf.apply_context_parallel(model, group=group, layout=args.layout, kernel=args.kernel,
                                        cp_comm_type=getattr(args, "cp_comm_type", "p2p"))
    if checkpoint or mlp_chunks is not None:
        cphf.save_memory(model, checkpoint=checkpoint, mlp_chunks=mlp_chunks)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed)  # the same batches on every rank

    def loss_fn(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        local = cphf.shard_batch({"input_ids": ids.to(device)}, group=group, layout=args.layout)
        with precision:  # the LM head and loss too: under autocast, as the layers
            if chunk_tokens is None:  # the full [tokens, vocab] logits at once
                loss = cphf.causal_lm_loss(model(**cphf.model_inputs(local)).logits, local["shift_labels"])
            else:
                loss = cphf.lm_loss(model, local, chunk_tokens=chunk_tokens)
        return loss, loss.detach()

    losses, tok_s = [], None
    t0 = time.perf_counter()
    for step in range(args.steps):
        starts = torch.randint(0, data.numel() - args.seq_len, (args.batch,), generator=gen)
        ids = torch.stack([data[s: s + args.seq_len] for s in starts.tolist()])
        losses.append(train_step(model, opt, [ids], loss_fn).item())
        if dist.get_rank() == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            tok_s = (step + 1) * args.batch * args.seq_len / (time.perf_counter() - t0)
            print(progress_line(step, losses[-1], tok_s), flush=True)
    if dist.get_rank() == 0:
        print(example_summary("finetune_hf.py", losses, tok_s), flush=True)
    return losses


if __name__ == "__main__":
    args = place_example(memory_options(example_parser(__doc__)).parse_args())
    run_on_ranks(train, args.world_size, args, backend=args.backend)
