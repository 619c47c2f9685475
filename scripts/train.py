#!/usr/bin/env python
"""Train a causal LM with context parallelism; every setting comes from the Hydra configs in configs/.

    python scripts/train.py                                   # 2 gloo ranks spawned here, cp_size=2
    python scripts/train.py layout=interleaved trainer.steps=200
    python scripts/train.py -m layout=contiguous,zigzag,interleaved
    python scripts/train.py layout=balanced data.packing=true   # packed documents placed per batch
    torchrun --nproc-per-node=4 scripts/train.py cp_size=2    # dp=2 x cp=2 (NCCL on GPU, gloo on CPU)
    torchrun --nproc-per-node=8 scripts/train.py cp_size=4 trainer.device=cuda trainer.precision=bf16

trainer.device=auto trains on the GPUs (NCCL, rank i on cuda:LOCAL_RANK) when this machine has one per
rank, else on the CPU (gloo); trainer.backend overrides the backend, trainer.precision=bf16 autocasts.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

_RANK = os.environ.get("RANK", "0")
if _RANK != "0":
    # Under torchrun only rank 0 makes a Hydra run directory; the others use it (broadcast) and stay quiet.
    sys.argv += ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=disabled",
                 "hydra/hydra_logging=disabled"]


@hydra.main(config_path="../configs", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from cp_attention.training.loop import launch
    from cp_attention.training.summary import resume_command, training_summary

    hydra_cfg = HydraConfig.get()
    run_dir = hydra_cfg.runtime.output_dir
    if _RANK == "0":
        Path(run_dir, "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    resolved = OmegaConf.to_container(cfg, resolve=True)
    final = launch(resolved, run_dir)
    if _RANK == "0":  # where the results went, the loss reached, how to go on
        world = int(os.environ.get("WORLD_SIZE", resolved["nproc"]))
        setup = f"{resolved['layout']['name']}, dp={world // resolved['cp_size']} x cp={resolved['cp_size']}"
        command = resume_command(sys.argv[0], hydra_cfg.overrides.task, run_dir)
        print(training_summary(run_dir, final, command, resolved["trainer"]["steps"], setup=setup), flush=True)


if __name__ == "__main__":
    main()
