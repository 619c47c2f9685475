"""The FSDP2 x CP memory benchmark end to end at its quick size: what each rank holds falls with the
ranks that share it, and the longest sequence under the cap grows with cp and really fits."""

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
    # the 4-rank shapes only (one spawned job; the 2-rank ones would start ranks once more)
    proc = subprocess.run([sys.executable, "benchmarks/memory.py", "--quick", "--configs", "2x2", "1x4",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["1x1", "2x2", "1x4"]
    base = rows["1x1"]
    # Model states shard over every rank (dp x cp); 10% slack for FSDP's padding of uneven shards.
    for config in ("2x2", "1x4"):
        assert rows[config]["state_bytes"] <= base["state_bytes"] / 4 * 1.1, (config, rows[config])
    # Activations shard over cp only (each dp rank has its own batch of S tokens).
    assert rows["2x2"]["act_bytes"] <= 0.6 * base["act_bytes"], rows["2x2"]
    assert rows["1x4"]["act_bytes"] <= 0.35 * base["act_bytes"], rows["1x4"]
    assert rows["1x4"]["longest_seq"] > rows["2x2"]["longest_seq"] > base["longest_seq"] > 0
    for config, r in rows.items():
        assert r["verified"] and r["verify_total_bytes"] <= r["cap_bytes"], (config, r)
        assert r["tokens_per_s"] > 0, (config, r)
    assert "not a scaling measure" in proc.stdout
