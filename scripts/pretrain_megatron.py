#!/usr/bin/env python
"""Pre-train a tiny megatron-core GPTModel with context parallelism, nothing downloaded.

The model is megatron's own ``GPTModel`` built from ``get_gpt_layer_ring_spec`` (ring attention in
the ``core_attention`` slot, any layout); the text is Python's ``pydoc_data.topics`` as bytes.
Ranks are laid out by megatron's ``parallel_state`` as TP x CP x DP. ``--device auto`` trains on the
GPUs (NCCL, rank i on cuda:LOCAL_RANK) when this machine has one per rank, else on the CPU (gloo).

    python scripts/pretrain_megatron.py                          # spawns 2 ranks, CP=2
    python scripts/pretrain_megatron.py --layout interleaved --world-size 4 --cp-size 2   # CP=2 x DP=2
    python scripts/pretrain_megatron.py --world-size 4 --tp-size 2 --cp-size 2            # TP=2 x CP=2
    python scripts/pretrain_megatron.py --cp-comm-type a2a,all_gather     # one strategy per layer
    torchrun --nproc-per-node=2 scripts/pretrain_megatron.py     # or under torchrun
    torchrun --nproc-per-node=8 scripts/pretrain_megatron.py --cp-size 4 --device cuda --precision bf16
"""

from cp_attention.launch import run_on_ranks
from cp_attention.training import megatron_example
from cp_attention.training.cli import place_example

if __name__ == "__main__":
    args = megatron_example.parse_args(description=__doc__)
    args = place_example(args, cp_size=args.cp_size, refuse=megatron_example.unsupported_precision,
                         layers=megatron_example.NUM_LAYERS)
    run_on_ranks(megatron_example.train, args.world_size, args, backend=args.backend)
