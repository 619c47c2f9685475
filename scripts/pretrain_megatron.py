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

from cp_attention.launch import run_on_ranks
from cp_attention.training import megatron_example

if __name__ == "__main__":
    args = megatron_example.parse_args(description=__doc__)
    run_on_ranks(megatron_example.train, args.world_size, args)
