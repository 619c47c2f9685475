#!/usr/bin/env python
"""Fine-tune a tiny HuggingFace Llama with context parallelism on CPU (gloo), nothing downloaded.

The model is built from ``LlamaConfig`` with random weights, the text is Python's own
``pydoc_data.topics`` as bytes. Every rank holds 1/N of each sequence; gradients are summed over
the CP group, which gives exactly the gradients of the model without CP.

    python scripts/finetune_hf.py                      # spawns 2 ranks itself
    torchrun --nproc-per-node=2 scripts/finetune_hf.py # or under torchrun
    python scripts/finetune_hf.py --world-size 4 --layout interleaved --steps 30
"""

from cp_attention.launch import run_on_ranks
from cp_attention.training import hf_example
from cp_attention.training.cli import example_parser

if __name__ == "__main__":
    args = example_parser(__doc__).parse_args()
    run_on_ranks(hf_example.train, args.world_size, args)
