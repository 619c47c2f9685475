#!/usr/bin/env python
"""Fine-tune a tiny Llama with transformers' Trainer (or TRL's SFTTrainer) and context parallelism.

Nothing is downloaded: random weights, Python's bundled help topics as bytes. Run without torchrun,
it starts itself under torchrun with --nproc ranks (gloo on CPU).

    python scripts/finetune_trainer.py                         # 2 ranks: dp=1 x cp=2
    python scripts/finetune_trainer.py --nproc 4 --cp-size 2   # dp=2 x cp=2
    python scripts/finetune_trainer.py --packing               # DataCollatorWithFlattening
    python scripts/finetune_trainer.py --sft                   # TRL's SFTTrainer with packing
"""

import os
import sys

from cp_attention.training import trainer_example

if __name__ == "__main__":
    args = trainer_example.parser(__doc__).parse_args()
    if "RANK" not in os.environ:  # start the ranks under torchrun, as a user would
        os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  f"--nproc-per-node={args.nproc}", __file__, *sys.argv[1:]])
    last = trainer_example.train(args)
    if int(os.environ["RANK"]) == 0:
        print(f"done: {last}")
