"""Sharded checkpoints of an FSDP2 run, written with ``torch.distributed.checkpoint`` (DCP).

Every rank writes its own shards of the model and optimizer state; a resume on any dp x cp reads them
back resharded to its own mesh (DCP's planner does that). A save goes to ``step_XXXXXXX.tmp/`` first;
rank 0 adds the trainer state (scheduler, data position, RNG: one copy, every rank's is alike), renames
the directory to ``step_XXXXXXX/`` (atomic on POSIX), then writes the manifest with every file's size
and SHA-256 and points ``latest`` at it (:func:`.checkpoint.write_manifest`). A crash at any point
leaves either no ``step_XXXXXXX/`` directory or one without a manifest, which ``resume_from=auto``
skips as incomplete.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .checkpoint import file_digests, write_manifest

__all__ = ["save_sharded_checkpoint", "load_sharded_checkpoint", "TRAINER_STATE"]

TRAINER_STATE = "trainer_state.pt"  # rank 0's torch.save of everything that is not sharded


def _model_and_optimizer(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, opt)  # sharded: each rank's DTensor shards
    return {"model": model_state, "optim": optim_state}


def save_sharded_checkpoint(directory: "str | Path", step: int, model: torch.nn.Module, opt: torch.optim.Optimizer,
                            trainer_state: dict[str, Any], config: dict, world_size: int) -> Path:
    """Every rank calls this (it is collective); returns ``directory/step_XXXXXXX``. ``trainer_state``
    (rank 0's) is what is not sharded: step, scheduler, data position, RNG."""
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    final, tmp = directory / f"step_{step:07d}", directory / f"step_{step:07d}.tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # what a crashed save of this step left
        tmp.mkdir(parents=True)
    dist.barrier()
    dcp.save(_model_and_optimizer(model, opt), checkpoint_id=tmp)  # returns once every rank's shards are written
    if dist.get_rank() == 0:
        with open(tmp / TRAINER_STATE, "wb") as f:
            torch.save(trainer_state, f)
            f.flush()
        shutil.rmtree(final, ignore_errors=True)  # the same step saved before (a re-run from an older one)
        tmp.rename(final)
        write_manifest(final, {"format": 2, "step": step, "sharded": True, "files": file_digests(final),
                               "world_size": world_size, "config": config})
    dist.barrier()
    return final


def load_sharded_checkpoint(path: "str | Path", model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Load a :func:`save_sharded_checkpoint` directory into this rank's shards of ``model`` and ``opt``
    (sharded by FSDP2 on any mesh) and return its trainer state. Every rank calls this. The checkpoint
    is verified against its manifest by the resume (rank 0, :func:`.config.resume_point`) first."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = Path(path)
    state = _model_and_optimizer(model, opt)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=False)
