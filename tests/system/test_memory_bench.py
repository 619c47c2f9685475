"""The memory study (``python -m studies.memory``) end to end at its quick size: the chunked loss and the
savers lower the measured peak in the order they should, the line through two lengths predicts the third,
the offload's bytes are counted on the host, and the longest length under the cap really fits while the
next probe does not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_memory_benchmark_quick(tmp_path):
    out = tmp_path / "memory.json"
    proc = subprocess.run([sys.executable, "-m", "studies.memory", "--quick", "--no-rss-check", "--vocab-check", "0",
                           "--savers", "baseline", "lm_loss", "checkpoint", "all", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {(r["saver"], r["tokens"]): r for r in result["rows"]}
    t = max(tok for _, tok in rows)
    peak = {saver: rows[(saver, t)]["peak"] for saver in ("baseline", "lm_loss", "checkpoint", "all")}
    assert peak["baseline"] > 2 * peak["lm_loss"] > 2 * peak["checkpoint"] >= 2 * peak["all"], peak
    for r in result["rows"]:  # the terms live at the peak add up to it; the parameters are always live
        assert sum(v for k, v in r["at_peak"]["terms"].items() if k != "offloaded (host)") == r["peak"], r["saver"]
        assert r["at_peak"]["terms"]["params+grads"] >= r["before"] > 0
    assert rows[("all", t)]["host_peak"] > 0 and rows[("checkpoint", t)]["host_peak"] == 0
    assert "T=1024: predicted" in proc.stdout and "Llama-3-8B" in proc.stdout and "Llama-3-70B" in proc.stdout
    for line in proc.stdout.splitlines():  # the formula's check at the third length
        if "predicted" in line:
            assert abs(float(line.split("(")[-1].rstrip("%)"))) < 5.0, line
    cap = result["cap"]
    probes = dict(cap["probes"])
    assert probes[cap["longest_tokens"]] <= cap["cap_bytes"] < probes[cap["first_over"]], cap
