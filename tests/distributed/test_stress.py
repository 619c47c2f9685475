"""The stress script's verdicts (the runs themselves are long: benchmarks/stress.py runs them), and the
clean exit of the test worker pools on every path (closed, timed out, orphaned)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import stress
from tests.support.core.dist_pool import CaseError, CaseTimeout, WorkerPool

ROOT = Path(__file__).resolve().parents[2]


def test_an_abort_is_told_from_a_failure():
    assert stress.classify(0, "ok") == "ok"
    assert stress.classify(-6, "") == "aborted"
    assert stress.classify(134, "") == "aborted"
    assert stress.classify(0, "terminate called without an active exception") == "aborted"
    assert stress.classify(1, "AssertionError") == "failed"


def test_a_run_sees_what_the_pool_workers_wrote_and_a_sigabrt(tmp_path):
    """The workers' stderr file (named by the environment) is read with the output, so a worker's
    "terminate called" counts even when the run itself exits 0."""
    worker_abort = [sys.executable, "-c", f"import os; open(os.environ[{stress.POOL_STDERR_ENV!r}], 'w')"
                                          ".write('terminate called without an active exception')"]
    verdict, code, output = stress.run_once(worker_abort, tmp_path, timeout=60)
    assert (verdict, code) == ("aborted", 0) and "terminate called" in output
    assert stress.run_once([sys.executable, "-c", "import os; os.abort()"], tmp_path, timeout=60)[:2] == \
        ("aborted", -signal.SIGABRT)
    assert stress.run_once([sys.executable, "-c", "pass"], tmp_path, timeout=60)[:2] == ("ok", 0)
    assert stress.run_once([sys.executable, "-c", "import time; time.sleep(30)"], tmp_path,
                           timeout=1)[:2] == ("timeout", None)


def test_every_target_is_a_command_that_exists():
    """Every script and test file a target names exists, and so does every test function it names."""
    for name, cmd in stress.TARGETS.items():
        for part in cmd:
            path, _, test = part.partition("::")
            if path.endswith(".py"):
                assert (ROOT / path).exists(), (name, part)
                assert not test or f"def {test.split('[')[0]}(" in (ROOT / path).read_text(), (name, part)



def test_the_user_snippet_targets_run_the_readme_block(tmp_path):
    """The snippet targets run the README's HuggingFace block as a file, with and without its
    destroy_process_group(); both variants compile."""
    destroy, keep = (stress._command(t, ROOT, tmp_path)[-1] for t in ("user_snippet", "user_snippet_no_destroy"))
    assert "destroy_process_group()" in Path(destroy).read_text()
    assert "destroy_process_group()" not in Path(keep).read_text()
    assert "huggingface as cphf" in Path(keep).read_text()
    for path in (destroy, keep):
        compile(Path(path).read_text(), path, "exec")


# --- pool workers exit cleanly (issue 12): exit code 0, no "terminate called" in their stderr ---

def _ring_with_a_subgroup(rank: int, world_size: int) -> float:
    """A ring attention call, then an all-reduce on a subgroup: live gloo threads in two groups, and a
    collective just finished when the pool is told to stop."""
    import torch
    import torch.distributed as dist

    from tests.support.core import dist_cases

    errors = dist_cases.attention_errors(rank, world_size, layout="zigzag", causal=True, dtype="float64",
                                         kernel="math", atol=1e-10, rtol=0.0)
    assert all(ok is True or ok <= 0 for ok in errors.values()), errors
    group = dist.new_group(list(range(world_size)))
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=group)
    return t.item()


def _raise_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")


def _rank_1_never_answers(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(300)
    return rank


def _rank_1_dies(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(7)
    return rank


def _reaped(pid: int) -> bool:
    """True if ``pid`` is no child of this process any more (exited and waited for: no zombie)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


def _assert_clean_stderr(path: Path) -> None:
    text = path.read_text()
    assert "terminate called" not in text and "Traceback" not in text, text


@pytest.mark.slow
def test_pool_workers_destroy_their_group_and_exit_0(tmp_path):
    """Closing a pool, politely or at once right after a case, ends every worker with exit code 0 and
    nothing on stderr. A worker whose group is still alive at exit says so and exits 70 instead (left
    to interpreter exit, gloo's threads can abort it: -6, "terminate called without an active
    exception"), so without the destroy on each path this test fails every time."""
    err = tmp_path / "workers.stderr"
    for kill in (False, True):
        pool = WorkerPool(2, stderr_path=err)
        with pytest.raises(CaseError, match="rank 1 fails on purpose"):
            pool.run(_raise_on_rank_1)
        assert pool.run(_ring_with_a_subgroup) == [1.0, 1.0]
        procs = pool.processes
        pool.close(kill=kill)
        assert [p.exitcode for p in procs] == [0, 0], f"close(kill={kill})"
        assert all(_reaped(p.pid) for p in procs)
        assert not pool.processes
    _assert_clean_stderr(err)


@pytest.mark.slow
def test_a_timed_out_case_kills_only_its_pool(tmp_path):
    """The rank that answered leaves cleanly (0), the stuck one is SIGKILLed; both are reaped, and
    the next case runs on a fresh pool."""
    err = tmp_path / "workers.stderr"
    pool = WorkerPool(2, stderr_path=err)
    try:
        assert pool.run(_ring_with_a_subgroup) == [1.0, 1.0]
        old = pool.processes
        with pytest.raises(CaseTimeout, match=r"ranks \[1\] never answered"):
            pool.run(_rank_1_never_answers, timeout=2)
        assert [p.exitcode for p in old] == [0, -signal.SIGKILL]
        assert all(_reaped(p.pid) for p in old) and not pool.processes
        assert pool.run(_ring_with_a_subgroup) == [1.0, 1.0]
        new = pool.processes
        assert not {p.pid for p in new} & {p.pid for p in old}
    finally:
        pool.close()
    assert [p.exitcode for p in new] == [0, 0]
    _assert_clean_stderr(err)


def test_a_dead_worker_fails_its_case_at_once(tmp_path):
    """A rank that dies mid-case fails the case now (not at its timeout), naming its exit code; the
    rank that answered leaves cleanly, both are reaped, and the next case gets a fresh pool."""
    err = tmp_path / "workers.stderr"
    pool = WorkerPool(2, stderr_path=err)
    try:
        assert pool.run(_ring_with_a_subgroup) == [1.0, 1.0]
        old = pool.processes
        t0 = time.monotonic()
        with pytest.raises(CaseError, match=r"died before answering, exit codes \{1: 7\}"):
            pool.run(_rank_1_dies, timeout=120)
        assert time.monotonic() - t0 < 60
        assert [p.exitcode for p in old] == [0, 7] and all(_reaped(p.pid) for p in old)
        assert pool.run(_ring_with_a_subgroup) == [1.0, 1.0]
    finally:
        pool.close()
    _assert_clean_stderr(err)


_ORPHAN_SCRIPT = """
import ctypes, json, os, signal, subprocess, sys


def parent(stderr_path):  # start a pool, run a case, then die without closing it
    from tests.support.core.dist_pool import WorkerPool
    from tests.distributed.test_stress import _ring_with_a_subgroup

    pool = WorkerPool(2, stderr_path=stderr_path)
    pool.run(_ring_with_a_subgroup, timeout=60)
    os.kill(os.getpid(), signal.SIGKILL)


def reaper(stderr_path):  # adopts the orphaned workers, waits for every descendant, reports exit codes
    assert ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    first = subprocess.Popen([sys.executable, __file__, "parent", stderr_path], stdout=subprocess.DEVNULL)
    codes = {}
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        codes[pid] = os.waitstatus_to_exitcode(status)
    print(json.dumps({"parent": codes.pop(first.pid), "others": sorted(codes.values())}))


if __name__ == "__main__":
    {"parent": parent, "reaper": reaper}[sys.argv[1]](sys.argv[2])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs prctl(PR_SET_CHILD_SUBREAPER)")
def test_workers_of_a_dead_parent_leave_cleanly(tmp_path):
    """The parent is SIGKILLed with its pool open: the idle workers notice, destroy their group and
    exit 0 on their own (before, they waited for a case forever)."""
    script, err = tmp_path / "orphans.py", tmp_path / "workers.stderr"
    script.write_text(_ORPHAN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(script), "reaper", str(err)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    codes = json.loads(proc.stdout.strip().splitlines()[-1])
    assert codes["parent"] == -signal.SIGKILL
    # the two workers (and multiprocessing's resource tracker), every one exiting 0
    assert len(codes["others"]) >= 2 and set(codes["others"]) == {0}, codes
    _assert_clean_stderr(err)


def test_conftest_needs_no_hydra():
    """tests/conftest.py takes POOL_STDERR_ENV from benchmarks/stress.py (the standard library only), so a
    pure schedule test runs without the train extra."""
    code = ("import sys\nfor m in ('hydra', 'omegaconf', 'tqdm'):\n    sys.modules[m] = None\n"
            "import tests.conftest, benchmarks.stress\n"
            "assert tests.conftest.POOL_STDERR_ENV == benchmarks.stress.POOL_STDERR_ENV")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
