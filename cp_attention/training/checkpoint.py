"""Checkpoints that a crash mid-save cannot corrupt, and that a resume can verify.

A checkpoints directory holds, per saved step::

    step_0000006.pt        the payload (torch.save): written to a temporary file, then renamed
    step_0000006.pt.json   its manifest: step, payload size and SHA-256, world size, resolved config
    latest                 the name of the newest checkpoint, written last

or, for a sharded (FSDP) run, a ``step_0000006/`` directory that ``torch.distributed.checkpoint`` wrote
(each rank its own shards) with a manifest ``step_0000006.json`` holding every file's size and SHA-256
(see :mod:`.sharded_checkpoint`).

Each file is written to a temporary name, flushed to disk and renamed (atomic on POSIX), in the
order payload, manifest, ``latest``: a reader sees a checkpoint whole or not at all. A checkpoint is
*complete* when its payload matches its manifest (size and SHA-256); one that does not (truncated,
overwritten, copied in part) is refused with :class:`CorruptCheckpointError` naming the file, and
:func:`find_complete_checkpoint` (``trainer.resume_from=auto``) skips it for the newest one that is
complete. A checkpoint without a manifest (older versions) is checked by loading it.

Every payload is read with ``torch.load(..., weights_only=True)``: tensors and plain Python types only,
so a checkpoint directory cannot run code on resume. A payload holding any other object (a planted
pickle, or state saved as arbitrary objects) is refused with :class:`UnsafeCheckpointError`, unrun.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import pickletools
import re
import zipfile
from pathlib import Path
from typing import Any, Callable, cast

import torch

__all__ = ["save_checkpoint", "load_checkpoint", "is_sharded", "file_digests", "write_manifest", "latest_checkpoint",
           "checkpoint_info", "find_complete_checkpoint", "check_resume_compatible", "CorruptCheckpointError",
           "UnsafeCheckpointError", "safe_torch_load", "RESUMABLE_CHANGES"]

_LATEST = "latest"
_STEP_FILE = re.compile(r"^step_(\d+)(\.pt)?$")  # a file, or a sharded directory


class CorruptCheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated, or differs from its manifest; the message names it."""


class UnsafeCheckpointError(CorruptCheckpointError):
    """A checkpoint file holds objects other than tensors and plain Python types, which only an unsafe
    (code-running) unpickling could rebuild: refused unrun. A kind of corrupt checkpoint: no save of
    this library writes one, and ``resume_from=auto`` skips it like any other it cannot load."""


def _unsafe_reason(e: BaseException) -> str | None:
    """The weights-only unpickler's reason for refusing an object (a GLOBAL it does not allow), or None
    when the failure is something else (a truncated or garbled file)."""
    if not isinstance(e, pickle.UnpicklingError):
        return None
    lines = [part.strip() for part in str(e).split("\n\n") if "GLOBAL" in part]
    return lines[0] if lines else None


_STRING_OPS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING",
                         "BINSTRING", "STRING"})


def _pickle_globals(data: bytes) -> list[str]:
    """``module.name`` of every global the pickles in ``data`` name (a raw pickle, the pickles of torch's
    legacy format one after another, or a zip's ``data.pkl``), read with :mod:`pickletools` (which parses
    the opcodes and runs, imports and builds nothing), up to the first thing that is not a pickle."""
    if zipfile.is_zipfile(io.BytesIO(data)):
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as z:
                pickles = [z.read(n) for n in z.namelist() if n.endswith("data.pkl")]
        except (zipfile.BadZipFile, OSError, ValueError):
            return []
        return [g for blob in pickles for g in _pickle_globals(blob)]
    found: list[str] = []
    stream = io.BytesIO(data)
    while stream.tell() < len(data):
        pushed: list[str | None] = []  # STACK_GLOBAL takes module and name from the two strings just pushed
        memo: dict[int, str | None] = {}
        try:
            for op, arg, _ in pickletools.genops(stream):
                if op.name in ("GLOBAL", "INST"):
                    found.append(str(arg).replace(" ", "."))
                elif op.name == "STACK_GLOBAL":
                    found.append(".".join(s or "?" for s in pushed[-2:]) if len(pushed) > 1 else "?")
                elif op.name in ("EXT1", "EXT2", "EXT4"):
                    found.append(f"copyreg extension {arg}")
                if op.name in _STRING_OPS:
                    pushed.append(str(arg))
                elif op.name == "MEMOIZE":
                    memo[len(memo)] = pushed[-1] if pushed else None
                elif op.name in ("PUT", "BINPUT", "LONG_BINPUT"):  # these opcodes carry an int argument
                    memo[int(cast(int, arg))] = pushed[-1] if pushed else None
                elif op.name in ("GET", "BINGET", "LONG_BINGET"):
                    pushed.append(memo.get(int(cast(int, arg))))
                elif op.name not in ("FRAME", "PROTO", "MARK"):
                    pushed.append(None)
        except Exception:  # noqa: BLE001 - the end of the pickles (a legacy file's raw storage bytes) or garbage
            break
    return found


def _torch_refuses(name: str) -> bool:
    """Whether ``torch.load(weights_only=True)`` refuses the global ``module.name``."""
    try:
        from torch._weights_only_unpickler import _get_allowed_globals, _get_user_allowed_globals
    except ImportError:  # another torch: tensors' own rebuild functions are torch's, plain containers these
        return name.split(".")[0] not in ("torch", "collections", "_codecs")
    return name not in _get_allowed_globals() and name not in _get_user_allowed_globals()


def _refused_global(source: str | Path | io.BytesIO) -> str | None:
    """Why a file the weights-only unpickler stopped on before it reached a global (an opcode of a pickle
    protocol above torch.save's 2, such as a raw ``pickle.dump``'s FRAME) is unsafe: the first global it
    names that ``weights_only=True`` refuses; None when it names none (then it is merely corrupt)."""
    try:
        if isinstance(source, (str, os.PathLike)):
            data = Path(source).read_bytes()
        else:
            source.seek(0)
            data = source.read()
    except Exception:  # noqa: BLE001 - unreadable: reported as corrupt by the caller
        return None
    refused = [g for g in _pickle_globals(data) if _torch_refuses(g)]
    if not refused:
        return None
    return (f"a pickle naming GLOBAL {refused[0]}, found by reading its opcodes, none run: the weights-only "
            "unpickler stopped before it, at an opcode torch.save's pickle protocol 2 never writes")


def safe_torch_load(path: str | Path, source: str | Path | io.BytesIO) -> Any:
    """``torch.load(source, map_location="cpu", weights_only=True)``; ``path`` names the file in errors.

    Raises :class:`UnsafeCheckpointError` for an object outside tensors and plain Python types (its
    pickle is never run; also when the file is a pickle of a protocol torch.save does not write, which the
    weights-only unpickler cannot read, naming such a global) and :class:`CorruptCheckpointError` for a
    file that cannot be unpickled at all.
    """
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the file is not one we wrote
        reason = _unsafe_reason(e)
        if reason is None:
            reason = _refused_global(source)
        if reason is not None:
            raise UnsafeCheckpointError(
                f"checkpoint {str(path)!r} holds an object that is not a tensor or a plain Python type ({reason}), "
                "and was not loaded: rebuilding it would run code from the file (torch.load with "
                "weights_only=False), which a checkpoint must never need. This library's saves write tensors and "
                "plain types only, so the file was written or changed by something else: delete it, or resume "
                "from another checkpoint. If you wrote it yourself and trust it, store such state as tensors, "
                "dicts, lists or strings instead") from None  # None: the unpickler's traceback adds nothing
        raise CorruptCheckpointError(f"checkpoint {str(path)!r} cannot be loaded (truncated or corrupt?): "
                                     f"{type(e).__name__}: {e}") from e


def _atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())  # on disk before the rename makes it visible
    os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one, never half of one


def _manifest_path(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def _sha256(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def save_checkpoint(directory: str | Path, step: int, state: dict[str, Any]) -> Path:
    """Write ``state`` as ``directory/step_XXXXXXX.pt`` with its manifest, and point ``directory/latest``
    at it. ``state["config"]`` and ``state["world_size"]``, when present, are copied into the manifest,
    so a resume can check compatibility without loading the payload."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step_{step:07d}.pt"
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getbuffer()
    _atomic_write(path, lambda tmp: tmp.write_bytes(payload))
    manifest = {"format": 1, "step": step, "file": path.name, "bytes": len(payload), "sha256": _sha256(payload),
                "world_size": state.get("world_size"), "config": state.get("config")}
    write_manifest(path, manifest)
    return path


def latest_checkpoint(path: str | Path) -> Path:
    """Resolve a checkpoint file, or a checkpoint directory to its latest checkpoint.

    Raises ``FileNotFoundError`` with what was looked for.
    """
    path = Path(path)
    if path.is_file() or is_sharded(path):
        return path
    if path.is_dir() and (path / _LATEST).is_file():
        return path / (path / _LATEST).read_text().strip()
    if path.is_dir() and (path / "checkpoints" / _LATEST).is_file():
        return latest_checkpoint(path / "checkpoints")
    raise FileNotFoundError(f"no checkpoint at {str(path)!r}: expected a step_*.pt file, a sharded step_* directory, "
                            "a checkpoints directory "
                            "with a 'latest' file, or a run directory containing one")


def is_sharded(path: str | Path) -> bool:
    """Whether ``path`` is a sharded checkpoint: a ``step_*`` directory (complete or not)."""
    path = Path(path)
    return path.is_dir() and bool(_STEP_FILE.match(path.name)) and not path.name.endswith(".pt")


def file_digests(directory: Path) -> dict[str, list]:
    """``{name: [bytes, SHA-256]}`` of every file in ``directory`` (a sharded checkpoint's manifest)."""
    return {p.name: [p.stat().st_size, _sha256(p.read_bytes())] for p in sorted(directory.iterdir()) if p.is_file()}


def _verify_sharded(path: Path) -> dict:
    """A sharded checkpoint's manifest, once every file it lists is there with its size and SHA-256."""
    if not _manifest_path(path).is_file():
        raise CorruptCheckpointError(f"sharded checkpoint {str(path)!r} has no manifest "
                                     f"({_manifest_path(path).name}): its save did not finish")
    try:
        manifest = json.loads(_manifest_path(path).read_text())
    except ValueError as e:
        raise CorruptCheckpointError(f"checkpoint manifest {str(_manifest_path(path))!r} is unreadable: {e}") from e
    found = file_digests(path)
    for name, (size, digest) in manifest["files"].items():
        if name not in found:
            raise CorruptCheckpointError(f"sharded checkpoint {str(path)!r} lacks {name}, which its manifest lists")
        if found[name][0] != size:
            raise CorruptCheckpointError(f"checkpoint file {str(path / name)!r} is truncated or incomplete: "
                                         f"{found[name][0]} bytes, its manifest records {size}")
        if found[name][1] != digest:
            raise CorruptCheckpointError(f"checkpoint file {str(path / name)!r} is corrupt: its SHA-256 differs "
                                         "from the one its manifest records")
    return manifest


def write_manifest(path: Path, manifest: dict) -> None:
    """Write ``path``'s manifest atomically, then point its directory's ``latest`` at ``path``."""
    text = json.dumps(manifest, indent=1, default=str)
    _atomic_write(_manifest_path(path), lambda tmp: tmp.write_text(text))
    _atomic_write(path.parent / _LATEST, lambda tmp: tmp.write_text(path.name))


def _read_verified(path: Path) -> tuple[bytes, dict | None]:
    """The payload's bytes and its manifest (None for a checkpoint written without one), verified."""
    if not path.is_file():
        raise CorruptCheckpointError(f"checkpoint {str(path)!r} is missing (its directory's 'latest' names it)")
    manifest = None
    if _manifest_path(path).is_file():
        try:
            manifest = json.loads(_manifest_path(path).read_text())
        except ValueError as e:
            raise CorruptCheckpointError(f"checkpoint manifest {str(_manifest_path(path))!r} is unreadable: {e}") from e
    data = path.read_bytes()
    if manifest is not None:
        if len(data) != manifest["bytes"]:
            raise CorruptCheckpointError(
                f"checkpoint {str(path)!r} is truncated or incomplete: {len(data)} bytes, its manifest records "
                f"{manifest['bytes']}")
        if _sha256(data) != manifest["sha256"]:
            raise CorruptCheckpointError(f"checkpoint {str(path)!r} is corrupt: its SHA-256 differs from the "
                                         "one its manifest records")
    return data, manifest


def _load_bytes(path: Path, data: bytes) -> dict[str, Any]:
    return safe_torch_load(path, io.BytesIO(data))


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` (file or directory), verified against its
    manifest, tensors and plain Python types only. Raises ``FileNotFoundError`` (nothing there),
    :class:`CorruptCheckpointError`, or :class:`UnsafeCheckpointError` (an object only code could rebuild)."""
    path = latest_checkpoint(path)
    if is_sharded(path):
        raise ValueError(f"{str(path)!r} is a sharded (FSDP) checkpoint: resume it with trainer.fsdp=true, or read it "
                         "with torch.distributed.checkpoint")
    data, _ = _read_verified(path)
    return _load_bytes(path, data)


def checkpoint_info(path: str | Path) -> dict[str, Any]:
    """Verify one checkpoint file and return its manifest: ``step``, ``world_size`` and ``config``
    (None where the checkpoint did not record them). Raises :class:`CorruptCheckpointError`."""
    path = Path(path)
    if is_sharded(path):
        return _verify_sharded(path)
    data, manifest = _read_verified(path)
    if manifest is None:  # written before manifests existed: loading it is the only check
        state = _load_bytes(path, data)
        manifest = {"step": state["step"], "world_size": state.get("world_size"), "config": state.get("config")}
    return manifest


def find_complete_checkpoint(directory: str | Path) -> tuple[Path | None, dict | None, list[str]]:
    """The newest complete checkpoint in ``directory`` and its :func:`checkpoint_info` (None, None if
    there is none, or no directory), and why each newer one was skipped (one line per file)."""
    directory = Path(directory)
    if not directory.is_dir():
        return None, None, []
    steps = sorted(((int(m.group(1)), p) for p in directory.iterdir() if (m := _STEP_FILE.match(p.name))),
                   key=lambda x: x[0], reverse=True)
    skipped = []
    for _, path in steps:
        try:
            info = checkpoint_info(path)
        except CorruptCheckpointError as e:
            skipped.append(str(e))
            continue
        return path, info, skipped
    return None, None, skipped


# What may differ between a checkpoint's config and the run that resumes from it. Everything else
# must be equal, because it changes what a step computes or which data it sees.
RESUMABLE_CHANGES = ("nproc", "trainer.steps", "trainer.log_every", "trainer.ckpt_every", "trainer.resume_from",
                     "trainer.stop_after", "trainer.dist_timeout_s", "trainer.device", "trainer.backend", "kernel",
                     "cp_comm", "trainer.activation_checkpointing", "trainer.mlp_chunks", "trainer.loss_chunk_tokens",
                     "trainer.offload_optimizer")  # the last four: where memory goes, not what a step computes
# A sharded (trainer.fsdp) checkpoint reshards on load: dp x cp may change too, with the same global batch.
RESHARDABLE_CHANGES = ("cp_size", "trainer.micro_batch")


def _flatten(cfg: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(cfg, dict):
        return {prefix: cfg}
    out: dict[str, Any] = {}
    for key, value in cfg.items():
        out.update(_flatten(value, f"{prefix}{key}." if isinstance(value, dict) else f"{prefix}{key}"))
    return out


def check_resume_compatible(info: dict, cfg: dict, world_size: int, path: str | Path) -> None:
    """Refuse to resume from checkpoint ``path`` (its :func:`checkpoint_info`) with an incompatible config.

    Must match: ``cp_size``, dp (world size / cp_size), and every config field except those in
    :data:`RESUMABLE_CHANGES`: ``trainer.seq_len``, ``micro_batch``, ``grad_accum``, ``seed`` and
    ``grad_clip``, the whole ``model``, ``layout``, ``data`` (source, path, packing) and ``optim``
    groups. May change: ``trainer.steps`` (the cosine schedule then follows the new total),
    ``log_every``, ``ckpt_every``, ``resume_from``, ``stop_after``, ``dist_timeout_s``, ``nproc`` (only
    through dp and cp_size, which must match), ``device`` and ``backend`` (a GPU job may continue on
    the CPU or back), ``kernel`` (exact kernels agree up to rounding, not bit for bit), ``cp_comm``
    (every strategy is exact; they agree up to rounding) and the memory savers
    ``activation_checkpointing``, ``mlp_chunks``, ``loss_chunk_tokens`` and ``offload_optimizer`` (where
    memory goes, not what a step computes; exact up to rounding);
    ``trainer.precision`` must match. A field that only one of the two configs has (a config from
    another version) is not compared. A sharded checkpoint (``trainer.fsdp=true``) is resharded on load:
    ``cp_size``, ``micro_batch`` and so dp may change, as long as the global batch (dp x
    ``micro_batch`` rows) is the same. Raises ``ValueError`` naming every differing field with both values.
    """
    sharded = is_sharded(path)
    if sharded != bool(cfg["trainer"].get("fsdp", False)):
        raise ValueError(f"cannot resume from {str(path)!r}: it is a {'sharded' if sharded else 'single-file'} "
                         f"checkpoint, and this run has trainer.fsdp={not sharded}; resume with "
                         f"trainer.fsdp={sharded}")
    saved = info.get("config")
    if saved is None:
        return
    old, new = _flatten(saved), _flatten(cfg)
    resumable = RESUMABLE_CHANGES + (RESHARDABLE_CHANGES if sharded else ())
    allowed = lambda key: any(key == a or key.startswith(a + ".") for a in resumable)  # noqa: E731
    diffs = [f"{key} (checkpoint: {old[key]!r}, this run: {new[key]!r})"
             for key in old if key in new and not allowed(key) and old[key] != new[key]]
    saved_world = info.get("world_size")
    if sharded and saved_world:
        rows = (saved_world // saved["cp_size"] * saved["trainer"]["micro_batch"],
                world_size // cfg["cp_size"] * cfg["trainer"]["micro_batch"])
        if rows[0] != rows[1]:
            diffs.append(f"the global batch = dp x trainer.micro_batch (checkpoint: {rows[0]} rows, this run: "
                         f"{rows[1]}; dp = world size / cp_size)")
    elif saved_world and "cp_size" in saved and saved_world // saved["cp_size"] != world_size // cfg["cp_size"]:
        diffs.append(f"dp = world size / cp_size (checkpoint: {saved_world} / {saved['cp_size']} = "
                     f"{saved_world // saved['cp_size']}, this run: {world_size} / {cfg['cp_size']} = "
                     f"{world_size // cfg['cp_size']})")
    if diffs:
        raise ValueError(f"cannot resume from {str(path)!r}: the config differs from the checkpoint's in "
                         f"{', '.join(diffs)}. Only {', '.join(resumable)} may change on resume; restore "
                         "these values, or train in a new run directory (hydra.run.dir) without resume_from")
