#!/usr/bin/env python
"""Compare the contiguous, zigzag and interleaved layouts: modelled, measured and projected.

    python scripts/compare_layouts.py                                  # configs/experiment/default.yaml
    python scripts/compare_layouts.py experiment=smoke                 # tiny, for tests
    python scripts/compare_layouts.py measure.world_sizes=[1,2,4] heads=16 dtype=bfloat16 causal=false
    python scripts/compare_layouts.py out_dir=results/layouts          # default: outputs/compare_layouts/<time>
    python scripts/compare_layouts.py plugins=[my_layouts] layouts=[zigzag,my_layout]   # a registered layout
    python scripts/compare_layouts.py window.fractions=[64,8,2] window.convention=flash  # sliding windows W = S/d
    python scripts/compare_layouts.py packed=none window=none      # leave out the packed / windowed workloads

Writes report.md, the PNG pictures and one CSV per table and picture into the output folder.
A (layout, world size, S) the layout cannot split is skipped and listed in the report.
"""

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from cp_attention.experiments import compare_layouts
from cp_attention.training.summary import directory_summary


@hydra.main(version_base="1.3", config_path="../configs", config_name="compare_layouts")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    out = Path(HydraConfig.get().runtime.output_dir)  # == out_dir: the config makes them one folder
    resolved = OmegaConf.to_container(cfg, resolve=True)
    try:
        compare_layouts.import_plugins(resolved)
        compare_layouts.check_config(resolved)
    except ValueError as e:  # a config mistake: say it plainly instead of a traceback
        sys.exit(f"compare_layouts: {e}")
    report = compare_layouts.run(resolved, out)
    print(directory_summary("compare_layouts.py", out, {"report": report.name, "config": "config.yaml"},
                            {"pictures": "*.png", "tables": "*.csv"}), flush=True)


if __name__ == "__main__":
    main()
