"""Session-wide gloo worker pools, one per world size, started on first use."""

from __future__ import annotations

import pytest

from .dist_pool import WorkerPool


@pytest.fixture(scope="session")
def pools():
    """``pools(n)``: the session's pool of ``n`` gloo workers."""
    made: dict[int, WorkerPool] = {}

    def get(world_size: int) -> WorkerPool:
        if world_size not in made:
            made[world_size] = WorkerPool(world_size)
        return made[world_size]

    yield get
    for pool in made.values():
        pool.close()
