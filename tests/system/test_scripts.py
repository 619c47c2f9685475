"""Scripts run end to end at tiny sizes: the benchmarks (every row, torch's ring included) and the examples."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import cp_attention as cpa

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_benchmark_smoke(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/attention.py", "--seq-lens", "256", "--repeats", "1", "--heads", "2",
         "--head-dim", "16", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    impls = {r["impl"] for r in rows}
    assert impls == {"baseline", *(f"ring/{name}" for name in cpa.LAYOUT_NAMES), "torch_ring/zigzag"}
    for r in rows:
        # torch's ring may disappear in a future torch; then its row must say why instead of timing.
        assert (r["fwdbwd_ms"] or 0) > 0 or (r["impl"].startswith("torch_ring") and r["error"]), r
    assert "fwd+bwd x" in proc.stdout
    assert proc.stdout.splitlines()[-2:] == ["== attention.py: done ==", f"results (JSON)  {out}"], proc.stdout[-500:]


@pytest.mark.slow
def test_benchmark_packed_smoke():
    proc = subprocess.run(
        [sys.executable, "benchmarks/packed.py", "--tokens", "512", "--documents", "20", "--heads", "2",
         "--head-dim", "16", "--repeats", "1", "--rounds", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rounds: 2, baseline and ring alternating" in proc.stdout
    for impl in ("varlen/1 rank", "ring/contiguous", "ring/zigzag", "ring/interleaved"):
        line = next(x for x in proc.stdout.splitlines() if x.strip().startswith(impl))
        assert len(line.split()) == len(impl.split()) + 4, line  # two rounds' ratios, "median", the median
        table = next(x for x in proc.stdout.splitlines()
                     if x.split()[1:2] == impl.split()[:1] and x.split()[0] == "512")
        assert float(table.split()[-3]) > 0, table  # fwd+bwd ms


@pytest.mark.slow
def test_benchmark_window_smoke(tmp_path):
    import cp_attention as cpa

    out = tmp_path / "window.json"
    proc = subprocess.run([sys.executable, "benchmarks/window.py", "--quick", "--layouts", "contiguous",
                           "zigzag", "--windows", "8", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["layout"], r["window"]) for r in rows] == [  # the no-window reference is always measured
        ("contiguous", "none"), ("contiguous", "S/8"), ("zigzag", "none"), ("zigzag", "S/8")]
    for r in rows:
        seq, n, ws = r["seq_len"], r["world_size"], (r["window_left"], r["window_right"])
        assert r["fwdbwd_ms"] > 0 and (r["window"] != "none" or r["time_x_none"] == 1.0)
        assert ws == ((-1, -1) if r["window"] == "none" else (seq // 8 - 1, 0))  # hf: W = S/8 keys
        busiest = max(map(sum, cpa.work_model(r["layout"], True, seq, n, window_size=ws)))
        assert r["model_busiest_x_none"] == busiest / max(map(sum, cpa.work_model(r["layout"], True, seq, n)))
        assert r["ring_length"] == cpa.ring_length(r["layout"], True, seq, n, ws) == 2
    assert "time x none" in proc.stdout and "model x none" in proc.stdout
    bad = subprocess.run([sys.executable, "benchmarks/window.py", "--windows", "-1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--windows" in bad.stderr


@pytest.mark.slow
@pytest.mark.parametrize("script,needs", [("finetune_hf.py", "transformers"),
                                          ("pretrain_megatron.py", "megatron.core")])
def test_example_smoke(script, needs):
    pytest.importorskip(needs, reason=f"{script} needs {needs}")
    proc = subprocess.run(
        [sys.executable, f"examples/{script}", "--steps", "3", "--seq-len", "64", "--batch", "2",
         "--log-every", "1", "--layout", "interleaved"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(line.split()[3]) for line in proc.stdout.splitlines() if line.startswith("step")]
    assert len(losses) == 3 and all(l == l and 0 < l < 10 for l in losses), proc.stdout
    summary = proc.stdout[proc.stdout.index(f"== {script}: done, 3 steps =="):].splitlines()
    assert summary[1:3] == ["output      printed above (stdout) only: this example writes no files",
                            f"loss        final {losses[-1]:.4f} (step 3), best {min(losses):.4f} "
                            f"(step {losses.index(min(losses)) + 1})"], summary
    assert not [line for line in proc.stderr.splitlines() if "warn" in line.lower()], proc.stderr[-3000:]


@pytest.mark.slow
def test_trainer_example_smoke():
    """examples/finetune_trainer.py starts itself under torchrun and trains with TRL's SFTTrainer, packed."""
    pytest.importorskip("trl", reason="finetune_trainer.py --sft needs the trainer extra")
    proc = subprocess.run([sys.executable, "examples/finetune_trainer.py", "--sft", "--steps", "5", "--seq-len", "64",
                           "--layout", "interleaved"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = next(line for line in proc.stdout.splitlines() if line.startswith("done: "))
    assert "train_loss" in done and 0 < float(done.split("'train_loss': ")[1].split(",")[0].strip("'")) < 10, done
    assert "== finetune_trainer.py: done, 5 steps ==" in proc.stdout and "nothing saved" in proc.stdout, proc.stdout


@pytest.mark.slow
def test_hf_example_bf16_on_cpu():
    """--precision bf16 on the CPU runs under CPU autocast (one rank: no ring, see test_train_device)."""
    pytest.importorskip("transformers", reason="finetune_hf.py needs transformers")
    proc = subprocess.run([sys.executable, "examples/finetune_hf.py", "--steps", "2", "--seq-len", "64", "--batch", "2",
                           "--log-every", "1", "--world-size", "1", "--device", "cpu", "--precision", "bf16"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(line.split()[3]) for line in proc.stdout.splitlines() if line.startswith("step")]
    assert len(losses) == 2 and all(0 < l < 10 for l in losses), proc.stdout


def test_megatron_example_refuses_bf16_on_cpu():
    pytest.importorskip("megatron.core", reason="needs the megatron extra")
    bad = subprocess.run([sys.executable, "examples/pretrain_megatron.py", "--device", "cpu", "--precision", "bf16"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--precision bf16 (autocast) needs --device cuda for megatron-core" in bad.stderr


def test_megatron_example_fails_fast_on_an_unsplittable_length():
    pytest.importorskip("megatron.core", reason="needs the megatron extra")
    bad = subprocess.run([sys.executable, "examples/pretrain_megatron.py", "--seq-len", "66"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "zigzag layout needs seq_len divisible by 2*world_size=4, got 66" in bad.stderr


@pytest.mark.slow
def test_megatron_benchmark_smoke():
    pytest.importorskip("megatron.core", reason="needs the megatron extra")
    proc = subprocess.run([sys.executable, "benchmarks/megatron.py", "--seq-lens", "256", "--repeats", "1",
                           "--layers", "1", "--heads", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split()[1]: line.split() for line in proc.stdout.splitlines() if line.strip().startswith("256")}
    assert sorted(rows) == sorted(["baseline", *(f"cp2/{name}" for name in cpa.LAYOUT_NAMES)]), proc.stdout
    for impl, cols in rows.items():  # fwd ms, fwd x, fwd+bwd ms, fwd+bwd x, peak MiB
        assert all(float(c) > 0 for c in cols[2:6]), (impl, cols)


def test_trainer_example_passes_its_options_through_torchrun(capsys):
    """finetune_trainer.py restarts itself under torchrun: every option but --nproc reaches the ranks, and
    torchrun's parser takes the command (``--nproc`` after the script's name, forwarded, made torchrun
    refuse it as an ambiguous abbreviation of its --nproc-per-node / --nproc_per_node)."""
    from torch.distributed.run import get_args_parser

    from examples.finetune_trainer import parser, torchrun_command

    options = [a for a in parser("").parse_args([]).__dict__]
    argv = ["--nproc", "1", "--cp-size", "1", "--steps", "2", "--nproc=3", "--activation-checkpointing", "offload",
            "--mlp-chunks", "2", "--loss-chunk-tokens", "0", "--sft", "--packing", "--seq-len", "64"]
    command = torchrun_command(argv, 1)
    parsed = get_args_parser().parse_args(command[3:])
    assert parsed.nproc_per_node == "1" and parsed.training_script.endswith("examples/finetune_trainer.py")
    assert parsed.training_script_args == argv[2:6] + argv[7:], parsed.training_script_args
    mine = parser("").parse_args(parsed.training_script_args)
    assert (mine.cp_size, mine.steps, mine.activation_checkpointing, mine.mlp_chunks, mine.loss_chunk_tokens) == (
        1, 2, "offload", 2, 0)
    for option in options:  # none of the script's options is an abbreviation torchrun's parser trips on
        flag = "--" + option.replace("_", "-")
        if flag != "--nproc":
            get_args_parser().parse_args(command[3:6] + [flag])
    with pytest.raises(SystemExit):  # what the script did before: the option forwarded as given
        get_args_parser().parse_args(command[3:6] + ["--nproc", "1"])
    assert "ambiguous option: --nproc could match" in capsys.readouterr().err
