"""The GPU benchmark (benchmarks/attention.py --device cuda): runs end to end on a GPU (gpu-marked), and
says what is missing without one."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch


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
                    "--tokens-per-rank", "1024", "--repeats", "2", "--json", str(out)], check=True, timeout=600)
    result = json.loads(out.read_text())
    flash = [r for r in result["kernels"] if r["kernel"] == "flash"]
    assert flash and all(r["error"] is None and r["fwd_tflops"] > 0 for r in flash)
    for row in result["schedules"]:
        assert row["error"] is None, row
        # A rank does 1/N of the causal work at best: it cannot beat the ideal by much (timing noise).
        assert 0 < row["fwdbwd_efficiency"] < 1.2 and row["peak_mib_per_rank"] > 0
