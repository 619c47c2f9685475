"""Persistent pools of gloo worker processes for distributed tests.

A pool of N processes is started once per test session and kept; each test sends a case (a
module-level function and its arguments) to every rank and waits with a timeout. A case that hangs
kills the pool and fails its test instead of stalling CI; the next case starts a fresh pool.
"""

from __future__ import annotations

import queue
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

from cp_attention.launch import free_port, process_group


class CaseError(RuntimeError):
    """A case raised on at least one rank; the message holds every failing rank's traceback."""


class CaseTimeout(RuntimeError):
    """A case did not finish on every rank within its timeout (a hang)."""


def _worker_main(rank: int, world_size: int, port: int, inbox, outbox) -> None:
    import torch

    torch.set_num_threads(1)
    with process_group("gloo", rank=rank, world_size=world_size, port=port):
        while True:
            item = inbox.get()
            if item is None:
                break
            case_id, fn, args, kwargs = item
            try:
                outbox.put((case_id, rank, True, fn(rank, world_size, *args, **kwargs)))
            except BaseException:  # noqa: BLE001 - every failure must reach the test
                outbox.put((case_id, rank, False, traceback.format_exc()))


class WorkerPool:
    """``world_size`` gloo processes that run cases ``fn(rank, world_size, *args)`` together."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._procs: list = []
        self._next_id = 0

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(self.world_size)]
        port = free_port()
        self._procs = [
            ctx.Process(target=_worker_main, args=(r, self.world_size, port, self._inboxes[r], self._outbox),
                        daemon=True)
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[Any]:
        """Run ``fn`` on every rank; return the per-rank results in rank order.

        Raises :class:`CaseError` if any rank raised, :class:`CaseTimeout` if any rank did not answer.
        """
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        self._next_id += 1
        case_id = self._next_id
        for box in self._inboxes:
            box.put((case_id, fn, args, kwargs))
        results: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(results) < self.world_size:
            try:
                cid, rank, ok, value = self._outbox.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted(set(range(self.world_size)) - set(results))
                self.close(kill=True)
                raise CaseTimeout(f"{fn.__name__} timed out after {timeout}s; ranks {missing} never answered")
            if cid == case_id:
                results[rank] = (ok, value)
        failed = {r: v for r, (ok, v) in results.items() if not ok}
        if failed:
            raise CaseError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items())))
        return [results[r][1] for r in range(self.world_size)]

    def close(self, kill: bool = False) -> None:
        """Stop the workers (politely, or at once with ``kill``)."""
        for p, box in zip(self._procs, getattr(self, "_inboxes", [])):
            if p.is_alive() and not kill:
                box.put(None)
        for p in self._procs:
            p.join(timeout=0 if kill else 10)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []
