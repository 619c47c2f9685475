"""Persistent pools of gloo worker processes for distributed tests.

A pool of N processes is started once per test session and kept; each test sends a case (a
module-level function and its arguments) to every rank and waits with a timeout. A case that hangs
kills the pool and fails its test instead of stalling CI; the next case starts a fresh pool.

Every way a worker ends destroys its process group before the interpreter exits (a gloo group
still alive at exit can abort the process: "terminate called without an active exception"):

- ``close()``: each worker leaves its ``process_group`` block normally (barrier, destroy) and exits 0.
  Also run at interpreter exit for a pool nobody closed, before multiprocessing would SIGTERM the
  (daemonic) workers.
- a case timeout: the ranks that answered are told to leave at once (destroy, no barrier: a peer is
  stuck) and exit 0; a rank still stuck after a short grace is SIGKILLed (no destructors run, so
  nothing can abort) and every worker is reaped. A rank that died mid-case fails the case at once.
- a worker that died: the rest of its pool is stopped the same way before a fresh pool starts.
- the parent dies (SIGKILL, a crash): an idle worker sees it within ``_POLL_S`` and leaves at once
  (destroy, no barrier); a worker stuck in a case is ended by a watchdog thread with ``os._exit``
  after ``_ORPHAN_GRACE_S``. Workers ignore SIGINT: Ctrl-C reaches the parent, which closes them.
"""

from __future__ import annotations

import atexit
import multiprocessing.connection as mp_connection
import os
import queue
import signal
import threading
import time
import traceback
from typing import Any, Callable, Iterable

import torch.multiprocessing as mp

from cp_attention.launch import exit_without_finalising, free_port, process_group

_POLL_S = 0.5  # how often an idle worker checks that its parent is alive
_ORPHAN_GRACE_S = 30.0  # how long a worker stuck in a case may outlive its parent
_LEAVE_S = 10.0  # how long an idle worker gets to leave before SIGKILL
_STUCK_GRACE_S = 2.0  # how long a worker stuck in a case gets to leave before SIGKILL
_LIVE_GROUP_AT_EXIT = 70  # a worker's exit code if its process group was still alive at exit
_STOP, _LEAVE = "stop", "leave"  # inbox messages: leave after a barrier / leave at once


class CaseError(RuntimeError):
    """A case raised on at least one rank; the message holds every failing rank's traceback."""


class CaseTimeout(RuntimeError):
    """A case did not finish on every rank within its timeout (a hang)."""


class _Leave(Exception):
    """Raised inside a worker's process group block to leave it without a barrier."""


def _exit_when_orphaned(parent: Any, grace: float) -> None:
    parent.join()  # returns when the parent has died
    time.sleep(grace)  # the main thread leaves cleanly if it is idle; it is stuck in a case if not
    os._exit(3)  # no destructors run, so no gloo thread is finalised


def _worker_main(rank: int, world_size: int, port: int, inbox, answers, stderr_path: str | None = None) -> None:
    if stderr_path is not None:  # fd 2, so C++ messages ("terminate called ...") land there too
        fd = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = mp.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_when_orphaned, args=(parent, _ORPHAN_GRACE_S), daemon=True).start()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        with process_group("gloo", rank=rank, world_size=world_size, port=port):
            while True:
                try:
                    item = inbox.get(timeout=_POLL_S)
                except queue.Empty:
                    if parent is not None and not parent.is_alive():
                        raise _Leave from None
                    continue
                if item == _STOP:
                    break
                if item == _LEAVE:
                    raise _Leave
                case_id, fn, args, kwargs = item
                try:
                    answer = (case_id, rank, True, fn(rank, world_size, *args, **kwargs))
                except BaseException:  # noqa: BLE001 - every failure must reach the test
                    answer = (case_id, rank, False, traceback.format_exc())
                try:
                    answers.send(answer)
                except (BrokenPipeError, ConnectionResetError):  # the parent is gone
                    raise _Leave from None
                except Exception:  # noqa: BLE001 - an unpicklable result (nothing was written)
                    answers.send((case_id, rank, False, traceback.format_exc()))
    except _Leave:  # process_group destroyed the group on the way out
        pass
    if dist.is_initialized():  # never finalise live gloo threads: say so and leave without finalising
        os.write(2, f"pool worker rank {rank}: its process group is still alive at exit\n".encode())
        os._exit(_LIVE_GROUP_AT_EXIT)
    exit_without_finalising(0)  # destroyed, but something may still reference it


class WorkerPool:
    """``world_size`` gloo processes that run cases ``fn(rank, world_size, *args)`` together.

    ``stderr_path``: append the workers' stderr (file descriptor 2, C++ output included) to this file
    instead of inheriting the parent's. ``exit_codes`` lists ``(rank, exit code)`` of every worker
    the pool has ended: 0 for a clean exit, ``-9`` for one killed after a timeout,
    ``LIVE_GROUP_AT_EXIT`` for one whose process group was still alive when it exited.
    """

    LIVE_GROUP_AT_EXIT = _LIVE_GROUP_AT_EXIT

    def __init__(self, world_size: int, stderr_path: str | os.PathLike[str] | None = None) -> None:
        self.world_size = world_size
        self.stderr_path = None if stderr_path is None else os.fspath(stderr_path)
        self._procs: list = []
        self._inboxes: list = []
        self._answers: list = []
        self._next_id = 0
        self.exit_codes: list[tuple[int, int]] = []

    @property
    def processes(self) -> list:
        """The live pool's worker processes (empty when none is started)."""
        return list(self._procs)

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._inboxes = [ctx.Queue() for _ in range(self.world_size)]
        # One answer pipe per worker, no queue shared between workers: a worker that dies holding a
        # shared queue's lock would leave the others unable to answer (or to exit).
        pipes = [ctx.Pipe(duplex=False) for _ in range(self.world_size)]
        self._answers = [reader for reader, _ in pipes]
        port = free_port()
        self._procs = [
            ctx.Process(target=_worker_main, daemon=True,
                        args=(r, self.world_size, port, self._inboxes[r], pipes[r][1], self.stderr_path))
            for r in range(self.world_size)
        ]
        for p, (_, writer) in zip(self._procs, pipes):
            p.start()
            writer.close()  # the worker holds the only writer: a dead parent is a broken pipe to it
        atexit.register(self.close)  # before multiprocessing's own exit hook SIGTERMs daemonic workers

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
            missing = [r for r in range(self.world_size) if r not in results]
            left = deadline - time.monotonic()
            watched = [self._answers[r] for r in missing] + [self._procs[r].sentinel for r in missing]
            ready = mp_connection.wait(watched, timeout=max(0.0, left))
            dead = {}
            for r in missing:
                if self._answers[r] not in ready and self._procs[r].sentinel not in ready:
                    continue
                try:  # an answer first, even from a worker that exited since
                    if self._answers[r].poll():
                        cid, rank, ok, value = self._answers[r].recv()
                        if cid == case_id:
                            results[rank] = (ok, value)
                        continue
                except EOFError:  # its end of the pipe closed: the worker is exiting
                    self._procs[r].join(timeout=_LEAVE_S)
                if not self._procs[r].is_alive():
                    dead[r] = self._procs[r].exitcode
            if dead:  # a rank that died cannot answer: fail now, not at the timeout
                self._stop(kill=True, stuck=[r for r in missing if r not in results])
                raise CaseError(f"{fn.__name__}: worker rank(s) died before answering, exit codes {dead}")
            if not ready and len(results) < self.world_size:
                missing = [r for r in range(self.world_size) if r not in results]
                self._stop(kill=True, stuck=missing)
                raise CaseTimeout(f"{fn.__name__} timed out after {timeout}s; ranks {missing} never answered")
        failed = {r: v for r, (ok, v) in results.items() if not ok}
        if failed:
            raise CaseError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items())))
        return [results[r][1] for r in range(self.world_size)]

    def close(self, kill: bool = False) -> None:
        """Stop the workers and reap them.

        Politely by default (every idle worker passes a barrier, destroys its group and exits 0). With
        ``kill`` (a rank is stuck or gone) the workers leave at once without a barrier. A worker still
        alive 10 s later is SIGKILLed.
        """
        self._stop(kill, stuck=())

    @staticmethod
    def close_all(pools: Iterable[WorkerPool]) -> None:
        """Close several pools politely, their workers leaving all at once rather than pool by pool."""
        pools = list(pools)
        for pool in pools:
            pool._tell_to_stop(kill=False)
        for pool in pools:
            pool._reap(stuck=())

    def _stop(self, kill: bool, stuck: Iterable[int]) -> None:
        """Stop the workers: the idle ones get 10 s to leave, the ``stuck`` ranks a short grace."""
        self._tell_to_stop(kill)
        self._reap(stuck)

    def _tell_to_stop(self, kill: bool) -> None:
        atexit.unregister(self.close)
        kill = kill or not all(p.is_alive() for p in self._procs)  # a missing rank fails the barrier
        for p, box in zip(self._procs, self._inboxes):
            if p.is_alive():
                box.put(_LEAVE if kill else _STOP)

    def _reap(self, stuck: Iterable[int]) -> None:
        stuck = set(stuck)
        now = time.monotonic()
        for rank, p in sorted(enumerate(self._procs), key=lambda rp: rp[0] in stuck):  # idle ranks first
            p.join(timeout=max(0.0, now + (_STUCK_GRACE_S if rank in stuck else _LEAVE_S) - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
            p.join()  # reaped: no zombie is left behind
        self.exit_codes += [(rank, p.exitcode) for rank, p in enumerate(self._procs)]
        for q in self._inboxes:
            q.close()
            q.cancel_join_thread()  # a dead reader must not block this process's exit
        for reader in self._answers:
            reader.close()
        self._procs, self._inboxes, self._answers = [], [], []
