"""Sharded checkpoints of an FSDP2 run, written with ``torch.distributed.checkpoint`` (DCP).

Every rank writes its own shards of the model and optimizer state; a resume on any dp x cp reads them
back resharded to its own mesh (DCP's planner does that). A save goes to ``step_XXXXXXX.tmp/`` first;
rank 0 adds the trainer state (scheduler, data position, RNG: one copy, every rank's is alike), renames
the directory to ``step_XXXXXXX/`` (atomic on POSIX), then writes the manifest with every file's size
and SHA-256 and points ``latest`` at it (:func:`.checkpoint.write_manifest`). A crash at any point
leaves either no ``step_XXXXXXX/`` directory or one without a manifest, which ``resume_from=auto``
skips as incomplete.

Nothing in it is unpickled unsafely: the trainer state is read with ``weights_only=True``, DCP's
``.metadata`` pickle with an unpickler that rebuilds only the classes DCP's ``Metadata`` is made of
(never a writer, reader or planner), and DCP's non-tensor items (the optimizer's hyperparameters) with
``weights_only=True`` too, where DCP's own reader and planner would unpickle both unrestricted. A file
holding anything else is refused with :class:`.checkpoint.UnsafeCheckpointError`, its pickle unrun.
"""

from __future__ import annotations

import io
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .checkpoint import UnsafeCheckpointError, file_digests, safe_torch_load, write_manifest

__all__ = ["save_sharded_checkpoint", "load_sharded_checkpoint", "TRAINER_STATE"]

TRAINER_STATE = "trainer_state.pt"  # rank 0's torch.save of everything that is not sharded


def _model_and_optimizer(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, opt)  # sharded: each rank's DTensor shards
    return {"model": model_state, "optim": optim_state}


def save_sharded_checkpoint(directory: str | Path, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer,
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


# What DCP's .metadata pickle may name: the classes a ``Metadata`` that FileSystemWriter writes is made
# of (metadata.py's dataclasses and its memory-format enum; the filesystem's per-item storage record),
# and the torch, pathlib and container values those hold. Nothing else in DCP's modules (a writer, a
# planner, a loader) is ever looked up, so the pickle cannot construct one.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": ("Metadata", "StorageMeta", "TensorStorageMetadata",
                                              "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                                              "_MEM_FORMAT_ENCODING", "MetadataIndex"),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
}
_OTHER_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                  ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
                  ("pathlib", "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """Rebuilds a DCP ``Metadata`` and nothing else: any other global is refused before it is looked up."""

    def __init__(self, file, path: Path) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            import importlib

            found = getattr(importlib.import_module(module), name, None)  # None in a torch without it
            if isinstance(found, type) and found.__module__ == module:
                return found
        elif (module, name) in _OTHER_GLOBALS:
            return super().find_class(module, name)
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"sharded checkpoint {str(self._path)!r}: its DCP metadata names {module}.{name}, which is not one of "
            "torch.distributed.checkpoint's metadata types (the classes its Metadata is made of), and was not "
            "loaded: rebuilding it would run code from the file. torch.distributed.checkpoint never writes one, "
            "so the file was written or changed by something else: delete the checkpoint, or resume from another "
            "one")


def _read_dcp_metadata(path: Path):
    """``path``'s DCP ``Metadata``, unpickled by :class:`_MetadataUnpickler` (DCP's reader unpickles it
    unrestricted). Raises :class:`.checkpoint.UnsafeCheckpointError` or ``CorruptCheckpointError``."""
    from torch.distributed.checkpoint.metadata import Metadata

    from .checkpoint import CorruptCheckpointError

    try:
        with open(path / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - a missing, truncated or garbled file: not a DCP checkpoint
        raise CorruptCheckpointError(f"sharded checkpoint {str(path)!r}: its DCP metadata (.metadata) cannot be "
                                     f"read: {type(e).__name__}: {e}") from e
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"sharded checkpoint {str(path)!r}: its .metadata holds a "
                                     f"{type(metadata).__name__}, not torch.distributed.checkpoint's Metadata")
    return metadata


def _safe_dcp_reader_and_planner(path: Path, metadata):
    """A DCP reader that returns ``metadata`` (read safely, once) and a load planner that unpickles DCP's
    non-tensor items with ``weights_only=True``: DCP's own unpickle both unrestricted."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self):  # no rank argument: DCP then never looks for per-rank metadata files
            if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            obj = safe_torch_load(f"{path}: item {read_item.dest_index.fqn}", value)
            if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes does, minus the unsafe load
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeReader(path), SafePlanner()


def load_sharded_checkpoint(path: str | Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Load a :func:`save_sharded_checkpoint` directory into this rank's shards of ``model`` and ``opt``
    (sharded by FSDP2 on any mesh) and return its trainer state. Every rank calls this. The checkpoint
    is verified against its manifest by the resume (rank 0, :func:`.config.resume_point`) first. Raises
    :class:`.checkpoint.UnsafeCheckpointError` for a file holding anything only code could rebuild."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = Path(path)
    state = _model_and_optimizer(model, opt)
    # both read on every rank before DCP's collectives, so a refusal is every rank's alike
    trainer_state = safe_torch_load(path / TRAINER_STATE, path / TRAINER_STATE)
    reader, planner = _safe_dcp_reader_and_planner(path, _read_dcp_metadata(path))
    try:
        dcp.load(state, storage_reader=reader, planner=planner)
    except dcp.CheckpointException as e:  # DCP gathers every rank's failure: all raise the lowest rank's
        refused = [exc for _, (exc, _) in sorted(e.failures.items()) if isinstance(exc, UnsafeCheckpointError)]
        if refused:
            raise refused[0] from None
        raise
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return trainer_state
