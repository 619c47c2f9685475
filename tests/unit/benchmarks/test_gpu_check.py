"""benchmarks/gpu_check.sh, the one prepared device check: valid bash, every flag it passes accepted by the
parser of the script it calls (renaming a flag fails here, not on a lent GPU), and every gpu-marked test
file among the ones it runs."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from benchmarks import gpu_record
from benchmarks.attention import parse_args

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
# Not run by default (it needs hydra-core and two GPUs for half its cases, and ~150 s): GPU_CHECK_TRAIN=1.
OPT_IN = {"tests/system/test_train_gpu.py"}


def _array(name: str) -> list[str]:
    """The words of the script's bash array ``name=(...)``, its ``"$VAR"`` words as ``1``."""
    found = re.search(rf"^\s*{name}=\((.*?)\)", SCRIPT.read_text(), re.S | re.M)
    assert found, f"gpu_check.sh has no {name}=(...) array"
    return ["1" if w.startswith("$") else w for w in shlex.split(found.group(1))]


@pytest.mark.dist  # runs bash
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_script_is_valid_bash_and_executable():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)
    assert SCRIPT.stat().st_mode & 0o111


def test_the_benchmark_flags_are_the_parsers():
    words = _array("BENCH")
    assert words[0] == "benchmarks/attention.py"
    args = parse_args(words[1:])
    assert args.device == "cuda" and args.world_sizes == [2, 4, 8] and args.packed is True
    assert args.kernels[0] == "auto" and {"cudnn", "flash", "efficient"} <= set(args.kernels)
    assert args.json == "1" and args.repeats == 1


def test_the_record_flags_are_the_parsers():
    words = _array("RECORD")
    assert words[:2] == ["-m", "benchmarks.gpu_record"]
    args = gpu_record.parse_args(words[2:])
    assert (args.json, args.commit, args.date, args.tests) == ("1", "1", "1", "1")


def test_every_gpu_marked_test_file_is_run():
    listed = set(_array("TEST_FILES"))
    assert all((ROOT / f).is_file() for f in listed | OPT_IN), sorted(listed | OPT_IN)
    marked = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
              if re.search(r"pytest\.mark\.gpu\b", p.read_text(encoding="utf-8"))}
    assert marked - OPT_IN == listed, f"gpu-marked files not in TEST_FILES: {sorted(marked - OPT_IN - listed)}"
