"""Start the ranks of a job: a free port, a process group that is torn down on every exit path,
ranks spawned on this machine (gloo), or the ranks torchrun started.

The one bootstrap shared by the training launcher, the example scripts, the benchmarks and the
test worker pools.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import sys
import tempfile
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

__all__ = ["free_port", "process_group", "spawn", "run_on_ranks", "exit_without_finalising"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (for a gloo rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def process_group(backend: str = "gloo", *, rank: int | None = None, world_size: int | None = None,
                  port: int | None = None, timeout_s: float | None = None) -> Iterator[None]:
    """Initialise the default process group for the ``with`` block and destroy it however the block ends
    (after a barrier when it ends normally, at once when it raises).

    With ``rank=None`` the group comes from torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``; NCCL ranks also take ``LOCAL_RANK`` as their CUDA device);
    otherwise ``rank``, ``world_size`` and ``port`` give a TCP rendezvous on 127.0.0.1.
    ``timeout_s`` bounds every collective, so a lost peer fails the job instead of hanging it.
    Raises ``ValueError`` for a rank without ``world_size`` and ``port``.
    """
    kwargs: dict[str, Any] = {}
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    if rank is not None:
        if world_size is None or port is None:
            raise ValueError(f"process_group(rank={rank}) also needs world_size and port, "
                             f"got world_size={world_size}, port={port}")
        kwargs.update(init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    else:
        if backend == "nccl" and "LOCAL_RANK" in os.environ:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        kwargs.update(_torchrun_attempt_store(kwargs.get("timeout")))
    dist.init_process_group(backend, **kwargs)
    try:
        yield
    except BaseException:
        if dist.is_initialized():  # (unless the block destroyed it: keep its error, not ours)
            dist.destroy_process_group()  # peers may be gone: no collective on the way out
        raise
    if not dist.is_initialized():  # the block destroyed the group itself
        return
    # A clean exit waits for every rank first: tearing gloo down while a peer still talks to it
    # can abort the process ("terminate called without an active exception"), and so can a group
    # left alive to interpreter exit (a gloo thread releasing finished work needs the GIL then).
    try:
        dist.barrier()
    except RuntimeError as e:
        raise RuntimeError(f"rank {dist.get_rank()} finished, but a peer rank failed or died before it did "
                           f"(see that rank's error): {str(e).splitlines()[0]}") from e
    finally:
        dist.destroy_process_group()


def _torchrun_attempt_store(timeout: datetime.timedelta | None) -> dict[str, Any]:
    """Under torchrun with restarts: the agent's store, keyed by restart attempt.

    torchrun's agent keeps one store across worker restarts (``TORCHELASTIC_USE_AGENT_STORE``) and
    torch adds no per-attempt prefix, so a restarted rank can read the address a rank of the previous,
    dead attempt published and fail to connect ("Connection refused"), which spends a restart. A
    prefix per attempt keeps the attempts apart. Elsewhere: ``{}`` (torch's ``env://``).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return {}
    from torch.distributed.constants import default_pg_timeout

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout or default_pg_timeout)
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    return {"store": dist.PrefixStore(f"cp_attention/attempt_{attempt}/", store),
            "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}


def _spawned_rank(rank: int, world_size: int, port: int, threads: int, timeout_s: float | None,
                  fn: Callable[..., Any], args: tuple, out_path: str, backend: str = "gloo") -> None:
    """One spawned rank; with a GPU backend, ``cuda:rank`` is made current before its group starts."""
    if backend != "gloo":
        torch.cuda.set_device(rank)
    torch.set_num_threads(threads)
    with process_group(backend, rank=rank, world_size=world_size, port=port, timeout_s=timeout_s):
        result = fn(*args)
    if rank == 0:
        with open(out_path, "wb") as f:
            pickle.dump(result, f)
    exit_without_finalising(0)  # the rank's work is done and its group destroyed


def exit_without_finalising(code: int) -> None:
    """Flush stdout/stderr and end the process with ``code``, skipping interpreter finalisation.

    For a process whose work is done and whose process group is destroyed: a gloo object something
    still references (a user's cache, a library's global; torch's private CP ring registers its
    groups) would be freed during finalisation, with the interpreter half torn down, which can abort
    the process ("terminate called without an active exception") after a successful run.

    multiprocessing's own exit work still runs first (see :func:`_finish_multiprocessing`).
    """
    _finish_multiprocessing()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _finish_multiprocessing() -> None:
    """Run the finalizers a multiprocessing child runs as it exits, which ``os._exit`` skips: those
    that release resources (exit priority >= 0), such as unlinking a named semaphore and unregistering
    it from the resource tracker (tqdm's write lock is one: a progress bar creates a
    ``multiprocessing.RLock``).

    A spawned rank shares its parent's resource tracker; a semaphore left registered there makes the
    parent warn "resource_tracker: There appear to be 1 leaked semaphore objects to clean up at
    shutdown" after a successful job. The negative-priority ones (joining a queue's feeder thread) and
    the join of child processes are left out: they can block when the process on the other end is
    gone, and this exit must not hang. ``multiprocessing.util._run_finalizers`` is private (stable
    since Python 2.6): without it, this does nothing.
    """
    import multiprocessing.util

    run_finalizers = getattr(multiprocessing.util, "_run_finalizers", None)
    if run_finalizers is not None:
        run_finalizers(0)


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, threads: int | None = None,
          timeout_s: float | None = None, backend: str = "gloo") -> Any:
    """Call ``fn(*args)`` on ``world_size`` fresh ranks on this machine; return rank 0's result.

    ``fn`` must be picklable (a module-level function) and so must its result. Each rank runs
    ``threads`` torch threads (default: the machine's cores shared out). ``backend="gloo"`` (CPU);
    ``"nccl"`` gives rank r the GPU ``cuda:r`` (made current before the group starts). Raises
    ``ValueError`` for NCCL with fewer GPUs than ranks, and
    ``torch.multiprocessing.ProcessRaisedException`` if a rank fails.
    """
    import torch.multiprocessing as mp

    if backend != "gloo":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < world_size:
            raise ValueError(f"spawning {world_size} {backend} rank(s) needs one GPU each, but torch sees {gpus}; "
                             "spawn fewer ranks, or use backend='gloo' (CPU)")
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world_size)
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "result.pkl")
        mp.spawn(_spawned_rank, args=(world_size, free_port(), threads, timeout_s, fn, args, out_path, backend),
                 nprocs=world_size, join=True)
        with open(out_path, "rb") as f:
            return pickle.load(f)


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
                 timeout_s: float | None = None) -> Any:
    """Call ``fn(*args)`` on every rank of a job and return this process's (or rank 0's) result.

    Under torchrun (``RANK`` set) it runs here, in a ``backend`` group built from torchrun's
    environment; otherwise on ``world_size`` ranks spawned here with ``backend`` (see :func:`spawn`).
    """
    if "RANK" not in os.environ:
        return spawn(fn, world_size, *args, timeout_s=timeout_s, backend=backend)
    with process_group(backend, timeout_s=timeout_s):
        return fn(*args)
