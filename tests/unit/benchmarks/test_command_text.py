"""Records name their command as anyone can run it from a checkout (benchmarks/measure.py's command_text),
never with the recording machine's own paths."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from benchmarks.measure import command_text, script_name

ROOT = Path(__file__).resolve().parents[3]
# An absolute path of the recording machine: a home, a checkout, a temporary file, an interpreter.
_MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:root|home|Users|work|tmp|opt|usr|var)/")


def test_the_command_names_python_and_paths_relative_to_the_repository():
    argv = [str(ROOT / "benchmarks" / "attention.py"), "--json", "/tmp/run/full.json",
            f"--out={ROOT / 'docs' / 'x.md'}", "--seq-lens", "4096", "relative/path.json"]
    assert command_text(argv) == ("python benchmarks/attention.py --json full.json --out=docs/x.md --seq-lens 4096 "
                                  "relative/path.json")


def test_a_package_run_with_dash_m_is_named_by_its_module():
    """``python -m studies.memory`` puts its package's ``__main__.py`` in argv[0]: the record names the module."""
    argv = [str(ROOT / "studies" / "memory" / "__main__.py"), "--quick", "--json", "/tmp/run/q.json"]
    assert command_text(argv) == "python -m studies.memory --quick --json q.json"
    assert command_text([str(ROOT / "benchmarks" / "plan.py")]) == "python benchmarks/plan.py"
    # and its summary is named by the package, not by "__main__.py"
    assert script_name(argv[0]) == "studies.memory"
    assert script_name(str(ROOT / "benchmarks" / "plan.py")) == "plan.py"


def test_the_command_defaults_to_this_process_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(ROOT / "benchmarks" / "window.py"), "--repeats", "3"])
    assert command_text() == "python benchmarks/window.py --repeats 3"
    assert sys.executable not in command_text()


@pytest.mark.parametrize("record", sorted((ROOT / "docs" / "benchmarks").glob("*.md")), ids=lambda p: p.name)
def test_records_hold_no_path_of_the_recording_machine(record):
    found = [line for line in record.read_text(encoding="utf-8").splitlines() if _MACHINE_PATH.search(line)]
    assert not found, f"{record.name} names the recording machine's paths: {found[:3]}"
