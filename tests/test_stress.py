"""The stress script's verdicts (the runs themselves are long: scripts/stress.py runs them)."""

from __future__ import annotations

from pathlib import Path

from cp_attention.experiments import stress

ROOT = Path(__file__).parent.parent


def test_an_abort_is_told_from_a_failure():
    assert stress.classify(0, "ok") == "ok"
    assert stress.classify(-6, "") == "aborted"
    assert stress.classify(134, "") == "aborted"
    assert stress.classify(0, "terminate called without an active exception") == "aborted"
    assert stress.classify(1, "AssertionError") == "failed"


def test_every_target_is_a_command_that_exists():
    for name, cmd in stress.TARGETS.items():
        assert all((ROOT / part).exists() for part in cmd if part.endswith(".py")), name
