#!/usr/bin/env python
"""Fine-tune a tiny HuggingFace Llama with context parallelism, nothing downloaded.

The model is built from ``LlamaConfig`` with random weights, the text is Python's own
``pydoc_data.topics`` as bytes. Every rank holds 1/N of each sequence; gradients are summed over
the CP group, which gives exactly the gradients of the model without CP. ``--device auto`` trains on
the GPUs (NCCL, rank i on cuda:LOCAL_RANK) when this machine has one per rank, else on the CPU (gloo).

    python scripts/finetune_hf.py                      # spawns 2 ranks itself
    torchrun --nproc-per-node=2 scripts/finetune_hf.py # or under torchrun
    python scripts/finetune_hf.py --world-size 4 --layout interleaved --steps 30
    python scripts/finetune_hf.py --world-size 4 --cp-comm-type a2a+p2p --cp-a2a-size 2
    torchrun --nproc-per-node=8 scripts/finetune_hf.py --device cuda --precision bf16
"""

from cp_attention.launch import run_on_ranks
from cp_attention.training import hf_example
from cp_attention.training.cli import example_parser, place_example

if __name__ == "__main__":
    args = place_example(example_parser(__doc__).parse_args())
    run_on_ranks(hf_example.train, args.world_size, args, backend=args.backend)
