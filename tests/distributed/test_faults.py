"""A failure inside the ring (a kernel error, an out-of-memory) on one rank: no rank hangs, every rank
raises in the same call, and the group stays usable and exact."""

from __future__ import annotations

import pytest

from tests.support.core import dist_cases


@pytest.mark.parametrize("phase", ("forward", "backward"))
@pytest.mark.parametrize("world_size,fail_rank,fail_step", [(2, 1, 1), (3, 0, 1), (4, 2, 2), (4, 1, 3), (4, 3, 0)])
def test_failure_at_a_ring_step_is_contained(pools, world_size, fail_rank, fail_step, phase):
    results = pools(world_size).run(dist_cases.injected_failure, fail_rank=fail_rank, fail_step=fail_step,
                                    phase=phase, timeout=60)
    for rank, r in enumerate(results):
        failed, after = r["calls"]
        if rank == fail_rank:
            assert failed["raised"] == ("RuntimeError", "injected kernel failure"), failed
        else:
            kind, message = failed["raised"]
            assert kind == "RuntimeError" and f"ring attention {phase} failed on rank {fail_rank}" in message, message
        assert failed["seconds"] < 20, f"rank {rank} took {failed['seconds']:.1f} s to come back"
        assert after["raised"] == ("", "") and after["err"] < 1e-10, f"rank {rank}: the next call is exact: {after}"
