"""The one bootstrap (cp_attention.launch) and the shared gradient convention (reduce_gradients)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing import ProcessRaisedException

from cp_attention.launch import free_port, process_group, spawn
from tests.support.core import dist_cases


def _where_am_i(tag: str) -> tuple:
    return tag, dist.get_rank(), dist.get_world_size(), torch.get_num_threads()


def _fail_on_rank_1() -> None:
    if dist.get_rank() == 1:  # rank 0 finishes normally, so this is the only failure to report
        raise RuntimeError("rank 1 fails on purpose")


def _rank_1_stalls() -> None:
    if dist.get_rank() == 1:
        time.sleep(120)
    dist.barrier()


@pytest.mark.slow
def test_a_stalled_peer_fails_the_job_within_the_timeout():
    """The timeout reaches the process group: a peer that never arrives fails the job, it does not hang it."""
    t0 = time.monotonic()
    with pytest.raises(ProcessRaisedException):
        spawn(_rank_1_stalls, 2, threads=1, timeout_s=3)
    assert time.monotonic() - t0 < 60


def test_spawn_returns_rank_0s_result_with_the_threads_asked_for():
    assert spawn(_where_am_i, 3, "x", threads=1) == ("x", 0, 3, 1)


def test_spawn_reports_a_failing_rank():
    """The job fails, not hangs; torch reports whichever rank it sees first: the failing one, or a
    finished one that names its peer's failure."""
    reports = "rank 1 fails on purpose|rank 0 finished, but a peer rank failed"
    with pytest.raises(ProcessRaisedException, match=reports):
        spawn(_fail_on_rank_1, 2, threads=1, timeout_s=30)


def test_process_group_is_destroyed_when_the_block_raises():
    with pytest.raises(ZeroDivisionError):
        with process_group("gloo", rank=0, world_size=1, port=free_port()):
            assert dist.is_initialized() and dist.get_world_size() == 1
            _ = 1 / 0
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"process_group\(rank=0\) also needs world_size and port"):
        with process_group("gloo", rank=0):
            pass


def test_process_group_is_destroyed_when_the_block_ends_or_destroyed_it_itself():
    with process_group("gloo", rank=0, world_size=1, port=free_port()):
        assert dist.is_initialized()
    assert not dist.is_initialized()
    with process_group("gloo", rank=0, world_size=1, port=free_port()):
        dist.destroy_process_group()  # no barrier on a destroyed group, no second destroy
    with pytest.raises(ZeroDivisionError):  # the block's own error, not one from the teardown
        with process_group("gloo", rank=0, world_size=1, port=free_port()):
            dist.destroy_process_group()
            _ = 1 / 0
    assert not dist.is_initialized()


def test_reduce_gradients_sums_over_cp_and_averages_over_dp(pools):
    results = pools(4).run(dist_cases.reduced_gradients)
    # per dp replica: the sum over its two cp ranks; then the mean over the two replicas
    a = sum(torch.arange(3.0) + 10 * r for r in range(4)) / 2
    b = torch.full((2, 2), sum(r * r for r in range(4)) / 2, dtype=torch.float64)
    for rank, got in enumerate(results):
        assert torch.equal(got["a"], a), (rank, got["a"])
        assert torch.equal(got["b"], b) and got["b"].dtype == torch.float64, (rank, got["b"])
        assert got["frozen"] is None
