"""Where a training rank runs: its device, the process-group backend that goes with it, the device a
collective's tensors must be on, and mixed precision.

- ``device``: ``auto`` (CUDA when this machine has a GPU for each of its ranks, else CPU; an explicit
  backend decides it: nccl CUDA, gloo CPU), ``cpu`` or ``cuda``. A CUDA rank computes on
  ``cuda:LOCAL_RANK`` (torchrun), or ``cuda:RANK`` for ranks spawned on this machine.
- ``backend``: ``auto`` (NCCL on CUDA, gloo on CPU), or ``gloo`` / ``nccl`` to override. NCCL moves
  CUDA tensors only; gloo moves CPU tensors, so the ring's send/recv of CUDA K/V needs NCCL.
- ``precision``: ``fp32`` (default) or ``bf16``: the forward and loss run under
  ``torch.autocast(device, bfloat16)``; parameters, gradients and optimizer state stay fp32, and no
  loss scaling is needed. On CPU bf16 runs under CPU autocast (slow; for trying the mixed-precision
  path without a GPU; megatron-core's layers support autocast on CUDA only).

Every collective of the training loops goes through :func:`all_reduce_`, which reduces on
:func:`collective_device` and leaves the result where the tensor was.
"""

from __future__ import annotations

import contextlib
import os
from typing import ContextManager, NamedTuple

import torch
import torch.distributed as dist

from ..transport import transport_for

__all__ = ["DEVICES", "BACKENDS", "PRECISIONS", "Placement", "backend_for", "backend_device_type", "placement",
           "rank_device", "collective_device", "all_reduce_", "autocast"]

DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "gloo", "nccl")
PRECISIONS = ("fp32", "bf16")


class Placement(NamedTuple):
    """A resolved placement: ``device`` is ``"cpu"`` or ``"cuda"``, ``backend`` ``"gloo"`` or ``"nccl"``;
    ``note`` says why ``auto`` chose the CPU on a machine with a GPU (else empty)."""

    device: str
    backend: str
    note: str = ""


def backend_for(device_type: str) -> str:
    """The process-group backend for a device type: ``cuda`` -> ``nccl``, ``cpu`` -> ``gloo``."""
    backends = {"cuda": "nccl", "cpu": "gloo"}
    if device_type not in backends:
        raise ValueError(f"no process-group backend for device type {device_type!r}; expected cpu or cuda")
    return backends[device_type]


def backend_device_type(backend: str) -> str:
    """The device type a backend's collectives need: ``cuda`` for ``nccl``, ``cpu`` for any other
    (gloo, or a per-device mix such as ``cpu:gloo,cuda:nccl`` which takes CPU tensors too)."""
    return "cuda" if str(backend).lower() == "nccl" else "cpu"


def _cuda_devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def placement(device: str = "auto", backend: str = "auto", *, local_ranks: int = 1, cp_size: int = 1,
              precision: str = "fp32", cuda_devices: int | None = None, prefix: str = "") -> Placement:
    """Resolve the ``device`` and ``backend`` options for ``local_ranks`` ranks on this machine.

    ``device="auto"`` follows an explicit backend (nccl: cuda, gloo: cpu), else takes CUDA when there
    is a GPU for every local rank (``note`` says so when there are GPUs, but too few).
    ``cuda_devices`` defaults to the GPUs torch sees; ``prefix`` goes before option names in errors
    (``"trainer."`` or ``"--"``). Raises ``ValueError`` saying what to change for an unknown value,
    ``cuda`` without a GPU for each local rank, ``nccl`` on CPU, or ``gloo`` with CUDA and ``cp_size > 1``.
    """
    for name, value, allowed in (("device", device, DEVICES), ("backend", backend, BACKENDS),
                                 ("precision", precision, PRECISIONS)):
        if value not in allowed:
            raise ValueError(f"{prefix}{name} must be one of {', '.join(allowed)}; got {value!r}")
    gpus = _cuda_devices() if cuda_devices is None else cuda_devices
    note, asked = "", f"{prefix}device={device}"
    if device == "auto" and backend != "auto":
        device, asked = backend_device_type(backend), f"{prefix}backend={backend}"
    if device == "auto":
        device = "cuda" if 0 < local_ranks <= gpus else "cpu"
        if 0 < gpus < local_ranks:
            note = (f"{prefix}device=auto: {local_ranks} ranks on this machine but {gpus} GPU(s), one needed per "
                    f"rank: running on the CPU (gloo). Use at most {gpus} ranks here to train on the GPU(s)")
    elif device == "cuda" and gpus == 0:
        raise ValueError(f"{asked}, but torch sees no CUDA device (torch {torch.__version__}, CUDA "
                         f"{torch.version.cuda or 'not built in'}); use {prefix}device=cpu or auto, or a "
                         "CUDA build of torch on a machine with a GPU")
    elif device == "cuda" and gpus < local_ranks:
        raise ValueError(f"{asked} needs one GPU per rank: {local_ranks} ranks on this machine, but "
                         f"it has {gpus} GPU(s). Start at most {gpus} ranks here (nproc, --world-size or "
                         f"--nproc-per-node), or use {prefix}device=cpu")
    if backend == "auto":
        backend = backend_for(device)
    elif backend == "nccl" and device != "cuda":
        raise ValueError(f"{prefix}backend=nccl needs {prefix}device=cuda (NCCL moves CUDA tensors only), "
                         f"but the device is {device}; use {prefix}backend=gloo or auto")
    elif backend == "gloo" and device == "cuda" and cp_size > 1:
        raise ValueError(f"{prefix}backend=gloo cannot carry the ring's CUDA tensors (cp_size={cp_size} "
                         f"sends K/V between GPUs, and gloo moves CPU tensors only); use {prefix}backend=nccl "
                         f"or auto, or cp_size=1, or {prefix}device=cpu")
    return Placement(device, backend, note)


def rank_device(device: str = "auto") -> torch.device:
    """This rank's device, made current: ``cpu``, or ``cuda:i`` with ``i`` = ``LOCAL_RANK`` (torchrun),
    else this rank in the default group (ranks spawned on one machine). ``auto``: what the default
    group's backend needs (CPU when there is no group and no GPU). Raises ``ValueError`` when ``i``
    names no GPU."""
    if device == "auto":
        if dist.is_available() and dist.is_initialized():
            device = backend_device_type(dist.get_backend())
        else:
            device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cuda":
        return torch.device(device)
    if "LOCAL_RANK" in os.environ:
        index = int(os.environ["LOCAL_RANK"])
    else:
        index = dist.get_rank() if dist.is_available() and dist.is_initialized() else torch.cuda.current_device()
    if index >= _cuda_devices():
        raise ValueError(f"rank with local index {index} needs its own GPU, but torch sees {_cuda_devices()}; "
                         "start at most one rank per GPU, or train on the CPU (device cpu)")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def collective_device(group=None) -> torch.device:
    """The device a collective over ``group`` (None: the default group) takes its tensors on: this rank's
    current CUDA device for NCCL, the CPU for gloo."""
    if backend_device_type(dist.get_backend(group)) == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_(tensor: torch.Tensor, group=None, op=None) -> torch.Tensor:
    """``dist.all_reduce`` (``op`` default: sum) on :func:`collective_device`, in place on ``tensor``
    wherever it lives (a copy only when the two devices differ); returns ``tensor``. A sum goes
    through the group's transport (:meth:`~cp_attention.transport.base.Transport.all_reduce_sum_`)."""
    if op is None:
        return transport_for(group).all_reduce_sum_(tensor)
    on = tensor.to(collective_device(group))
    dist.all_reduce(on, op=dist.ReduceOp.SUM if op is None else op, group=group)
    if on is not tensor:
        tensor.copy_(on)
    return tensor


def autocast(device: torch.device, precision: str = "fp32") -> ContextManager:
    """The context a forward and loss run in: nothing for ``fp32``, ``torch.autocast`` to bfloat16 for
    ``bf16``. Raises ``ValueError`` for another precision, or bf16 on a GPU without it."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision != "bf16":
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"precision=bf16 needs a GPU with bfloat16 (compute capability 8.0+, e.g. A100, H100); "
                         f"{torch.cuda.get_device_name(device)} has none: use precision fp32")
    return torch.autocast(device.type, dtype=torch.bfloat16)
