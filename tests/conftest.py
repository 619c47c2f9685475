"""Session-wide gloo worker pools, one per world size, started on first use.

``CP_ATTENTION_POOL_STDERR=PATH`` sends the workers' stderr (C++ output included) to PATH instead of
the terminal: pytest's own capture can swallow what a worker writes as it exits, so
``benchmarks/stress.py`` sets it to see every "terminate called".
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:  # benchmarks/ and examples/ (not installed) import as packages from the repository root
    sys.path.insert(0, _ROOT)

from benchmarks.stress import POOL_STDERR_ENV  # noqa: E402  (the standard library only: no hydra)

from .support.dist_pool import WorkerPool

_ABORTED = (-6, 134)  # SIGABRT: "terminate called without an active exception"


@pytest.fixture(scope="session")
def pools():
    """``pools(n)``: the session's pool of ``n`` gloo workers.

    At the end of the session every pool is closed, and a worker that aborted (SIGABRT) or left its
    process group alive at exit fails the session's last test."""
    made: dict[int, WorkerPool] = {}

    def get(world_size: int) -> WorkerPool:
        if world_size not in made:
            made[world_size] = WorkerPool(world_size, stderr_path=os.environ.get(POOL_STDERR_ENV) or None)
        return made[world_size]

    yield get
    WorkerPool.close_all(made.values())
    unclean = [(n, rank, code) for n, pool in sorted(made.items()) for rank, code in pool.exit_codes
               if code in _ABORTED or code == WorkerPool.LIVE_GROUP_AT_EXIT]
    if unclean:
        pytest.fail("pool worker aborted or left its process group alive at exit "
                    f"(world size, rank, exit code): {unclean}", pytrace=False)
