"""Checkpoints that a crash mid-save cannot corrupt: write to a temporary file, then rename."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint"]

_LATEST = "latest"


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one, never half of one


def save_checkpoint(directory: "str | Path", step: int, state: dict[str, Any]) -> Path:
    """Write ``state`` as ``directory/step_XXXXXXX.pt`` and point ``directory/latest`` at it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step_{step:07d}.pt"
    _atomic_write(path, lambda tmp: torch.save(state, tmp))
    _atomic_write(directory / _LATEST, lambda tmp: tmp.write_text(path.name))
    return path


def latest_checkpoint(path: "str | Path") -> Path:
    """Resolve a checkpoint file, or a checkpoint directory to its latest checkpoint.

    Raises ``FileNotFoundError`` with what was looked for.
    """
    path = Path(path)
    if path.is_file():
        return path
    if path.is_dir() and (path / _LATEST).is_file():
        return path / (path / _LATEST).read_text().strip()
    if path.is_dir() and (path / "checkpoints" / _LATEST).is_file():
        return latest_checkpoint(path / "checkpoints")
    raise FileNotFoundError(f"no checkpoint at {str(path)!r}: expected a step_*.pt file, a checkpoints directory "
                            "with a 'latest' file, or a run directory containing one")


def load_checkpoint(path: "str | Path") -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` (file or directory)."""
    return torch.load(latest_checkpoint(path), map_location="cpu", weights_only=False)
