"""benchmarks/gpu_record.py: the markdown record of a GPU run, from a JSON shaped like
benchmarks/gpu.py's (the first H200 run's figures, with the packed replay and the auto row added)."""

from __future__ import annotations

import json
import re

import pytest

from benchmarks.gpu_record import device_slug, main, record

_MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:root|home|Users|work|tmp|opt|usr|var)/")
PICKS = {"causal": "cudnn", "full": "cudnn", "window": "flash", "varlen": "flash", "masked": "efficient"}


def _kernel(n, name, fwd, fb, ratio, picks=None, error=None):
    return {"world_size": n, "seq": n * 8192, "kernel": name, "fwd_ms": fwd, "fwdbwd_ms": fb, "fwd_tflops": 580.0,
            "fwdbwd_tflops": 536.0, "fwd_vs_sdpa": ratio, "fwdbwd_vs_sdpa": ratio, "error": error, "picks": picks}


def sample_run(complete: bool = True) -> dict:
    args = {"device": "cuda", "heads": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bfloat16",
            "world_sizes": [8], "tokens_per_rank": 8192, "kernels": ["auto", "cudnn", "flash_attn"],
            "kernel": "auto", "repeats": 7, "packed": True, "doc_mean": 2048.0, "json": "/tmp/x/run.json"}
    row = lambda lay, eff: {"world_size": 8, "seq": 65536, "layout": lay, "ideal_fwd_ms": 7.42,  # noqa: E731
                            "ideal_fwdbwd_ms": 28.77, "busiest_fwd_ms": 14.97, "busiest_fwdbwd_ms": 54.49,
                            "fwd_efficiency": 0.496, "fwdbwd_efficiency": eff, "peak_mib_per_rank": 914.0,
                            "sent_mib_per_rank": 864.0, "model_mib_per_rank": 864.0, "error": None}
    packed = lambda lay, needs, ms: {"world_size": 8, "tokens": 65536, "layout": lay, "needs_only": needs,  # noqa: E731
                                     "ideal_fwd_ms": 1.5, "ideal_fwdbwd_ms": 5.0, "busiest_fwd_ms": 3.0,
                                     "busiest_fwdbwd_ms": ms, "busiest_rank": 3, "fwd_efficiency": 0.5,
                                     "fwdbwd_efficiency": 5.0 / ms, "sent_mib": 557.8, "model_mib": 557.8,
                                     "error": None}
    return {
        "device": "NVIDIA H200", "torch": "2.11.0+cu130", "complete": complete, "wall_s": 123.4,
        "command": "python benchmarks/attention.py --device cuda --world-sizes 8 --json run.json", "args": args,
        "sdpa": [{"world_size": 8, "seq": 65536, "fwd_ms": 59.35, "fwdbwd_ms": 230.17}],
        "kernels": [_kernel(8, "auto", 60.7, 229.8, 0.978, PICKS), _kernel(8, "cudnn", 60.71, 229.8, 0.978),
                    _kernel(8, "flash_attn", None, None, None, error="ValueError: kernel 'flash_attn' does not "
                            "support device cuda")],
        "schedules": [row("zigzag", 0.528), row("balanced", 0.5281)],
        "packed_baselines": [{"world_size": 8, "tokens": 65536, "documents": 38, "longest": 10439,
                              "kernel": "aten._flash_attention_forward/backward (varlen, whole batch)",
                              "fwd_ms": 12.0, "fwdbwd_ms": 40.0, "error": None}],
        "packed": [packed("balanced", True, 13.9), packed("balanced", False, 14.36)],
    }


def test_device_slug():
    assert device_slug("NVIDIA H200") == "nvidia-h200"
    assert device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert device_slug(" NVIDIA  H100 (PCIe) ") == "nvidia-h100-pcie"
    assert device_slug("???") == "unknown"


def test_the_record_says_where_it_was_measured_and_holds_every_table():
    md = record(sample_run(), commit="abc1234", date="2026-11-28", tests="155 passed in 48.65s")
    head = md.splitlines()
    assert head[0] == "# GPU benchmark, 2026-11-28: NVIDIA H200"
    assert head[2].startswith("measured on NVIDIA H200, commit abc1234, torch 2.11.0+cu130; bfloat16")
    assert "gpu-marked tests: 155 passed in 48.65s" in md
    assert "`python benchmarks/attention.py --device cuda --world-sizes 8 --json run.json`" in md
    assert "| 8 | `auto` | 60.70 | 580 | 0.98 | 229.80 | 536 | 0.98 |" in md
    assert ("`auto` picks: causal → `cudnn`, full → `cudnn`, window → `flash`, varlen → `flash`, "
            "masked → `efficient`.") in md
    assert "- `flash_attn` at N=8: `ValueError: kernel 'flash_attn' does not support device cuda`" in md
    assert "| 8 | zigzag | 14.97 | 49.6% | 54.49 | 52.8% | 914 | 864.0 |" in md
    assert "| 8 | 65536 | 38 | 10439 | aten._flash_attention_forward/backward (varlen, whole batch) | 12.00 | 40.00 |" in md  # noqa: E501 - a table row as printed
    assert "| 8 | balanced | yes | 3.00 | 50.0% | 13.90 | 36.0% | 557.8 | 557.8 |" in md
    assert "| 8 | balanced | no | 3.00 | 50.0% | 14.36 | 34.8% | 557.8 | 557.8 |" in md
    assert "Incomplete" not in md and "```" not in md  # no fence: the docs test would run a bash block
    assert not _MACHINE_PATH.search(md)


def test_an_incomplete_run_or_one_without_packed_rows_says_so():
    run = sample_run(complete=False)
    run["packed"], run["packed_baselines"] = [], []
    md = record(run)
    assert "**Incomplete**" in md and "Packed replay" not in md and "commit unknown" in md


def test_main_writes_the_record_beside_the_json(tmp_path):
    src = tmp_path / "2026-11-28-gpu-nvidia-h200.json"
    src.write_text(json.dumps(sample_run()))
    log = tmp_path / "pytest.log"
    log.write_text("....F\nFAILED x\n1 failed, 4 passed in 3.00s\n\n")
    out = main([str(src), "--commit", "abc1234", "--tests", str(log)])
    assert out == src.with_suffix(".md")
    assert "gpu-marked tests: 1 failed, 4 passed in 3.00s" in out.read_text(encoding="utf-8")


@pytest.mark.parametrize("name", [None, "ampere"])
def test_picks_missing_or_partial(name):
    run = sample_run()
    run["kernels"][0]["picks"] = None if name is None else {"varlen": None, "causal": "flash"}
    md = record(run)
    assert ("`auto` picks" in md) == (name is not None)
    if name:
        assert "varlen → none, causal → `flash`" in md
