"""How many bad inputs the fuzz tests tried (runs after tests/distributed/test_fuzz_*.py)."""

from __future__ import annotations

import pytest

from tests.support.fuzz_common import TRIED


def test_zz_report(capsys):
    """Print how many bad inputs were tried (runs last in this module)."""
    if not TRIED:
        pytest.skip("no fuzz test ran in this session")
    with capsys.disabled():
        print("\nfuzz: bad inputs tried: " + ", ".join(f"{k}: {v}" for k, v in sorted(TRIED.items()))
              + f"; total bad: {sum(v for k, v in TRIED.items() if 'valid' not in k)}")
