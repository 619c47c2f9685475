"""The GPU benchmark (benchmarks/attention.py --device cuda): runs end to end on a GPU (gpu-marked), and
says what is missing without one."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from cp_attention import LAYOUT_NAMES
from cp_attention.kernels import BLOCK_KINDS


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_cuda_benchmark_without_cuda_says_so():
    proc = subprocess.run([sys.executable, "benchmarks/attention.py", "--device", "cuda"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "needs a CUDA device" in proc.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_benchmark_small(tmp_path):
    out = tmp_path / "bench.json"
    subprocess.run([sys.executable, "benchmarks/attention.py", "--device", "cuda", "--world-sizes", "2", "4",
                    "--tokens-per-rank", "1024", "--repeats", "2", "--doc-mean", "256", "--json", str(out)],
                   check=True, timeout=600)
    result = json.loads(out.read_text())
    assert result["device"] == torch.cuda.get_device_name() and result["complete"]
    flash = [r for r in result["kernels"] if r["kernel"] == "flash"]
    assert flash and all(r["error"] is None and r["fwd_tflops"] > 0 for r in flash)
    auto = [r for r in result["kernels"] if r["kernel"] == "auto"]  # in the default --kernels, with its picks
    assert len(auto) == 2 and all(r["error"] is None and r["fwd_tflops"] > 0 for r in auto)
    assert all(set(r["picks"]) == set(BLOCK_KINDS) and r["picks"]["causal"] for r in auto)
    for row in result["schedules"]:
        assert row["error"] is None, row
        # A rank does 1/N of the causal work at best: it cannot beat the ideal by much (timing noise).
        assert 0 < row["fwdbwd_efficiency"] < 1.2 and row["peak_mib_per_rank"] > 0
    # The packed replay: every layout with needs-only rows on and off at each N, against the whole batch.
    assert all(b["error"] is None and b["fwdbwd_ms"] > 0 for b in result["packed_baselines"])
    assert sorted((r["world_size"], r["layout"], r["needs_only"]) for r in result["packed"]) == sorted(
        (n, lay, needs) for n in (2, 4) for lay in LAYOUT_NAMES for needs in (True, False))
    for row in result["packed"]:
        assert row["error"] is None, row
        assert 0 < row["fwdbwd_efficiency"] < 1.2 and 0 < row["fwd_efficiency"] < 1.2
        # what the replay's ranks sent is the work model's figure: needs-only rows, or whole shards
        assert row["sent_mib"] == pytest.approx(row["model_mib"], rel=1e-6)
