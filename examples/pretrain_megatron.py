"""Pre-train a tiny megatron-core GPTModel with context parallelism, nothing downloaded.

The model is megatron's own ``GPTModel`` built from ``get_gpt_layer_ring_spec`` (ring attention in
the ``core_attention`` slot, any layout); the text is Python's ``pydoc_data.topics`` as bytes.
Ranks are laid out by megatron's ``parallel_state`` as TP x CP x DP.
``--device auto`` trains on the GPUs (NCCL, rank i on cuda:LOCAL_RANK) when this machine has one per
rank, else on the CPU (gloo).

    python examples/pretrain_megatron.py                          # spawns 2 ranks, CP=2
    python examples/pretrain_megatron.py --layout interleaved --world-size 4 --cp-size 2   # CP=2 x DP=2
    python examples/pretrain_megatron.py --world-size 4 --tp-size 2 --cp-size 2            # TP=2 x CP=2
    python examples/pretrain_megatron.py --cp-comm-type a2a,all_gather     # one strategy per layer
    torchrun --nproc-per-node=2 examples/pretrain_megatron.py     # or under torchrun
    torchrun --nproc-per-node=8 examples/pretrain_megatron.py --cp-size 4 --device cuda --precision bf16
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script: `examples` imports from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import importlib.util
import os
import time
import warnings
from typing import Iterator

import torch
import torch.distributed as dist

from cp_attention.kernels.dtypes import DTYPES, dtype_from_name
from cp_attention.launch import run_on_ranks
from cp_attention.layouts import get_layout
from cp_attention.training.cli import comm_problem, example_parser, place_example
from cp_attention.training.data import load_bytes
from cp_attention.training.device import all_reduce_, autocast, rank_device
from cp_attention.training.steps import progress_line, train_step
from cp_attention.training.summary import example_summary

__all__ = ["build_model", "batches", "train", "parse_args", "unsupported_precision", "comm_types", "NUM_LAYERS"]

NUM_LAYERS = 2  # the example model's decoder layers (``--cp-comm-type`` may name one strategy per layer)

# megatron-core on a CPU machine: its optional CUDA extensions are absent by design.
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).* not installed")


def build_model(args: argparse.Namespace):
    """A tiny GPTModel with ring attention, prepared for CP (RoPE at global positions)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from cp_attention.integrations import megatron as cpm

    dtype = dtype_from_name(args.dtype)
    config = TransformerConfig(
        num_layers=NUM_LAYERS, hidden_size=128, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=256,
        normalization="RMSNorm", attention_dropout=0.0, hidden_dropout=0.0, use_cpu_initialization=True,
        tensor_model_parallel_size=args.tp_size, context_parallel_size=args.cp_size, params_dtype=dtype,
        cuda_graph_scope=[])  # what its default "full" becomes, without the deprecation warning it prints
    torch.manual_seed(args.seed)
    spec = cpm.get_gpt_layer_ring_spec(args.layout, kernel=args.kernel, normalization="RMSNorm",
                                       cp_comm_type=comm_types(args))
    model = GPTModel(config, spec, vocab_size=256, max_sequence_length=args.seq_len,
                     position_embedding_type="rope").to(dtype)
    return cpm.apply_context_parallel(model)


def comm_types(args: argparse.Namespace) -> str | tuple[str, ...]:
    """``--cp-comm-type``: one strategy, or a tuple of one per layer (comma-separated)."""
    names = tuple(getattr(args, "cp_comm_type", "p2p").split(","))
    return names[0] if len(names) == 1 else names


def batches(args: argparse.Namespace) -> Iterator[dict]:
    """Full-sequence megatron batch dicts (the same on every rank), shifted labels and a loss mask."""
    data = load_bytes("builtin")  # Python's bundled help texts as bytes
    gen = torch.Generator().manual_seed(args.seed)
    positions = torch.arange(args.seq_len).expand(args.batch, args.seq_len)
    while True:
        starts = torch.randint(0, data.numel() - args.seq_len - 1, (args.batch,), generator=gen)
        window = torch.stack([data[s: s + args.seq_len + 1] for s in starts.tolist()])
        yield {"tokens": window[:, :-1], "labels": window[:, 1:], "position_ids": positions,
               "loss_mask": torch.ones(args.batch, args.seq_len)}


def unsupported_precision(device: str, precision: str) -> str | None:
    """Why megatron cannot train in ``precision`` on ``device`` (None: it can). bf16 autocast needs CUDA:
    megatron-core's linear layers re-enter autocast in their backward for CUDA only
    (``custom_bwd(device_type="cuda")``), so on the CPU their backward mixes bf16 and fp32."""
    if precision == "bf16" and device == "cpu":
        return ("--precision bf16 (autocast) needs --device cuda for megatron-core, whose linear layers restore "
                "autocast in their backward on CUDA only; on the CPU use --precision fp32, with --dtype bfloat16 "
                "for bf16 weights")
    return None


def train(args: argparse.Namespace) -> list[float]:
    """Run the pre-training loop on this rank; returns the global mean loss of every step.

    On ``args.device`` (``cpu``, ``cuda``: this rank's GPU, or ``auto``: what the group's backend
    needs) in ``args.precision`` (``bf16``: autocast; ``--dtype`` sets the weights' dtype).
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from cp_attention.integrations import megatron as cpm

    device = rank_device(getattr(args, "device", "auto"))
    reason = unsupported_precision(device.type, getattr(args, "precision", "fp32"))
    if reason:
        raise ValueError(reason)
    precision = autocast(device, getattr(args, "precision", "fp32"))
    a2a = getattr(args, "cp_a2a_size", None)  # megatron's hierarchical CP groups: a2a+p2p runs over them
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp_size, context_parallel_size=args.cp_size,
                                 hierarchical_context_parallel_sizes=[a2a, args.cp_size // a2a] if a2a else None)
    cp_group, dp_group = ps.get_context_parallel_group(), ps.get_data_parallel_group()
    dp_size = ps.get_data_parallel_world_size()
    if device.type == "cuda":  # megatron's CUDA RNG tracker (TP regions fork it), seeded as its own scripts do
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    model = build_model(args).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = batches(args)

    def loss_fn(full: dict) -> tuple[torch.Tensor, torch.Tensor]:
        local = cpm.get_batch_on_this_cp_rank({k: v.to(device) for k, v in full.items()}, layout=args.layout)
        with precision:
            per_token = model(local["tokens"], local["position_ids"], None, labels=local["labels"])
        local_sum = (per_token * local["loss_mask"]).sum()
        stats = all_reduce_(torch.stack([local_sum.detach(), local["loss_mask"].sum()]), group=cp_group)
        # This rank's share of the sequence's mean loss: summed over CP it is the full gradient.
        return local_sum / stats[1], stats[0] / stats[1]

    losses, tok_s = [], None
    t0 = time.perf_counter()
    try:
        for step in range(args.steps):
            full = [next(data) for _ in range(dp_size)][ps.get_data_parallel_rank()]  # one batch per DP replica
            losses.append(train_step(model, opt, [full], loss_fn, cp_group=cp_group, dp_group=dp_group).item())
            if dist.get_rank() == 0 and (step % args.log_every == 0 or step == args.steps - 1):
                tok_s = (step + 1) * args.batch * args.seq_len * dp_size / (time.perf_counter() - t0)
                print(progress_line(step, losses[-1], tok_s), flush=True)
    finally:
        ps.destroy_model_parallel()
    if dist.get_rank() == 0:
        print(example_summary("pretrain_megatron.py", losses, tok_s), flush=True)
    return losses


def parse_args(argv: list[str] | None = None, description: str = __doc__) -> argparse.Namespace:
    """Command-line arguments, with ``world_size`` from torchrun's environment when present.

    Exits with a usage error if the sizes do not fit together, the layout cannot split ``seq_len``, or
    ``--cp-comm-type``/``--cp-a2a-size`` cannot run (one strategy, or one per layer; a2a size: megatron's
    hierarchical CP groups, which need einops).
    """
    p = example_parser(description)
    p.add_argument("--cp-size", type=int, default=None, help="default: world size / tp size")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    args = p.parse_args(argv)
    if "RANK" in os.environ:
        args.world_size = int(os.environ["WORLD_SIZE"])
    args.cp_size = args.cp_size or args.world_size // args.tp_size
    if args.cp_size < 1 or args.world_size % (args.tp_size * args.cp_size):
        p.error(f"--world-size {args.world_size} must be a multiple of tp_size x cp_size = "
                f"{args.tp_size} x {args.cp_size}")
    try:  # fail here, not on every rank
        get_layout(args.layout).check(args.seq_len, args.cp_size)
    except ValueError as e:
        p.error(str(e))
    problem = comm_problem(args.cp_comm_type, args.cp_a2a_size, args.cp_size, NUM_LAYERS)
    if problem:
        p.error(problem)
    if args.cp_a2a_size and importlib.util.find_spec("einops") is None:
        p.error("--cp-a2a-size builds megatron-core's hierarchical CP groups, which need einops: pip install einops")
    return args


if __name__ == "__main__":
    args = parse_args(description=__doc__)
    args = place_example(args, cp_size=args.cp_size, refuse=unsupported_precision, layers=NUM_LAYERS)
    run_on_ranks(train, args.world_size, args, backend=args.backend)
