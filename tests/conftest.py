"""The suite's shared fixtures, its markers, and the fuzz report.

Layout (docs/design.md, "Testing"): ``tests/unit/<room>/`` tests that start no process (the loopback ring
runs its ranks as threads in one process), ``tests/distributed/`` the core on gloo processes,
``tests/adapters/{hf,megatron}/``, ``tests/system/`` end-to-end runs (scripts, examples, benchmarks,
studies, the docs), ``tests/support/`` helpers and cases (no tests).

Markers, applied here at collection (``pytest.ini`` registers them):

- ``dist``: the test starts processes or a process group. Every test under ``tests/distributed/`` or
  ``tests/system/``, every test that uses the ``pools`` fixture, and the tests marked ``dist`` by hand
  (a subprocess, torchrun, a one-rank gloo group). A test not marked ``dist`` that starts a subprocess,
  a multiprocessing process or a process group fails (:func:`_no_process_unless_dist`), so the mark
  cannot go stale.
- ``slow``: over ~5 s on 2 cores, marked by hand; ``gpu``: needs CUDA, marked by hand.

``make test-fast`` runs ``-m "not dist and not slow and not gpu"``.

``CP_ATTENTION_POOL_STDERR=PATH`` sends the workers' stderr (C++ output included) to PATH instead of
the terminal: pytest's own capture can swallow what a worker writes as it exits, so
``benchmarks/stress.py`` sets it to see every "terminate called".
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:  # benchmarks/, studies/, examples/ (not installed) import as packages from the root
    sys.path.insert(0, _ROOT)

from benchmarks.stress import POOL_STDERR_ENV  # noqa: E402  (the standard library only: no hydra)

from .support.core.dist_pool import WorkerPool  # noqa: E402 - kept with the import above, after the sys.path setup

_ABORTED = (-6, 134)  # SIGABRT: "terminate called without an active exception"
_TESTS = Path(__file__).resolve().parent
_DIST_DIRS = (_TESTS / "distributed", _TESTS / "system")


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(str(item.path)).resolve()
        if "pools" in getattr(item, "fixturenames", ()) or any(path.is_relative_to(d) for d in _DIST_DIRS):
            item.add_marker(pytest.mark.dist)


# Libraries that run a tool in a subprocess, not a rank: inductor's C++ compiler under torch.compile, and
# matplotlib's font cache (``fc-list``), built on first use in a new HOME or MPLCONFIGDIR.
TOOL_CALLERS = (os.sep + os.path.join("torch", "_inductor") + os.sep,
                os.sep + os.path.join("matplotlib", "font_manager.py"))


def _called_from(fragments: tuple[str, ...]) -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if any(fragment in frame.f_code.co_filename for fragment in fragments):
            return True
        frame = frame.f_back
    return False


@pytest.fixture(autouse=True)
def _no_process_unless_dist(request, monkeypatch):
    """A test not marked ``dist`` may not start a process or a process group: it would run in the fast tier."""
    if request.node.get_closest_marker("dist") is not None:
        yield
        return

    def refuse(what, allowed=None):
        def fail(*args, **kwargs):
            if allowed is not None and _called_from(allowed):
                return allowed_call(*args, **kwargs)
            pytest.fail(f"{request.node.nodeid} starts {what} but is not marked dist "
                        "(mark it @pytest.mark.dist: see tests/conftest.py)", pytrace=False)
        return fail

    allowed_call = subprocess.Popen.__init__
    monkeypatch.setattr(subprocess.Popen, "__init__", refuse("a subprocess", allowed=TOOL_CALLERS))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse("a process"))
    dist = sys.modules.get("torch.distributed")
    if dist is not None and hasattr(dist, "init_process_group"):
        monkeypatch.setattr(dist, "init_process_group", refuse("a process group"))
    yield


def pytest_terminal_summary(terminalreporter):
    """How many bad inputs the fuzz tests tried (tests/distributed/test_fuzz_*.py, tests/adapters/test_fuzz_*.py)."""
    common = sys.modules.get("tests.support.core.fuzz_common")
    tried = getattr(common, "TRIED", None)
    if tried:
        terminalreporter.write_line(
            "fuzz: bad inputs tried: " + ", ".join(f"{k}: {v}" for k, v in sorted(tried.items()))
            + f"; total bad: {sum(v for k, v in tried.items() if 'valid' not in k)}")


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
