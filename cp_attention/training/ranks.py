"""Run a function on every rank of a job: under torchrun on the ranks it started, otherwise on gloo
ranks spawned here. Shared by the training launcher and the example scripts."""

from __future__ import annotations

import os
import socket
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["free_port", "spawn_gloo", "run_on_ranks"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (for a gloo rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_rank(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # ranks share the machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        fn(*args)
    finally:
        dist.destroy_process_group()


def spawn_gloo(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Call ``fn(*args)`` on ``world_size`` gloo ranks spawned on this machine, and wait for them.

    ``fn`` must be picklable (a module-level function). Raises ``ProcessRaisedException`` if a rank fails.
    """
    import torch.multiprocessing as mp

    mp.spawn(_gloo_rank, args=(world_size, free_port(), fn, args), nprocs=world_size)


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Call ``fn(*args)`` on every rank: under torchrun (``RANK`` set) on this process with gloo and
    torchrun's rendezvous, otherwise on ``world_size`` gloo ranks spawned here."""
    if "RANK" not in os.environ:
        spawn_gloo(fn, world_size, *args)
        return
    dist.init_process_group("gloo")
    try:
        fn(*args)
    finally:
        dist.destroy_process_group()
