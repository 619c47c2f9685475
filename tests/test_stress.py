"""The stress script's verdicts (the runs themselves are long: scripts/stress.py runs them)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("stress", Path(__file__).parent.parent / "scripts" / "stress.py")
stress = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stress)


def test_an_abort_is_told_from_a_failure():
    assert stress.classify(0, "ok") == "ok"
    assert stress.classify(-6, "") == "aborted"
    assert stress.classify(134, "") == "aborted"
    assert stress.classify(0, "terminate called without an active exception") == "aborted"
    assert stress.classify(1, "AssertionError") == "failed"


def test_every_target_is_a_command_that_exists():
    root = Path(stress.__file__).parent.parent
    for name, cmd in stress.TARGETS.items():
        assert all((root / part).exists() for part in cmd if part.endswith(".py")), name
