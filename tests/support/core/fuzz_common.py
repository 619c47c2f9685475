"""Shared pieces of the fuzz tests (tests/distributed/test_fuzz_*.py, tests/adapters/test_fuzz_adapters.py):
the count of bad inputs tried, the Hypothesis settings, and the agreed-refusal assertions."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# Bad inputs tried, per target (printed at the end of the session by tests/conftest.py's pytest_terminal_summary).
TRIED: Counter = Counter()

CASE_TIMEOUT = 60  # seconds per distributed case: a hang fails the test instead of CI
EXPECTED = ("ValueError", "NotImplementedError")


def _settings(examples: int):
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


def assert_same_refusal(results, what):
    """Every rank raised the same ValueError/NotImplementedError with the same message."""
    kinds = {kind for kind, _ in results}
    assert len(set(results)) == 1, f"{what}: ranks disagree: {results}"
    assert kinds <= set(EXPECTED), f"{what}: expected ValueError or NotImplementedError on every rank, got {results}"


def judge(target: str, kind: str, results, what: str) -> None:
    """Count the case for ``target`` and check it: a "valid" case must succeed on every rank, any other
    must raise the same refusal on every rank."""
    if kind == "valid":
        TRIED[f"{target} valid"] += 1
        assert_all_ok(results, f"valid case {what}")
    else:
        TRIED[target] += 1
        assert_same_refusal(results, what)


def assert_all_ok(results, what):
    assert all(r == ("", "") for r in results), f"{what}: a valid call failed: {results}"


def _cu(draw, total: int) -> list:
    """Valid boundaries [0, ..., total]: a few distinct cut points."""
    cuts = draw(st.sets(st.integers(1, max(1, total - 1)), max_size=min(3, max(0, total - 1))))
    return [0, *sorted(c for c in cuts if c < total), total]


def _layout(name: str):
    import cp_attention as cpa

    # reversed_zigzag: registered by fuzz_cases' import of tests.support.core.custom_layouts
    return cpa.get_layout(name)
