"""scripts/train.py and the example scripts on CUDA with NCCL and bf16 autocast, a couple of steps each:
one rank (a single-process NCCL group, under torchrun and spawned), and two ranks (CP=2 over NCCL)
when the machine has two GPUs. gpu-marked; skipped without CUDA."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
CUDA = ["trainer.seq_len=64", "trainer.micro_batch=2", "trainer.log_every=1", "trainer.ckpt_every=0",
        "model.hidden_size=32", "model.intermediate_size=64", "trainer.device=cuda", "nproc=1", "cp_size=1"]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def _run(cmd: list, timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "HYDRA_FULL_ERROR": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def train(run_dir: Path, *overrides: str, ranks: int | None = 1) -> subprocess.CompletedProcess:
    """scripts/train.py under torchrun with ``ranks`` processes, or spawned by itself (``ranks=None``)."""
    launcher = [sys.executable] if ranks is None else TORCHRUN + [f"--nproc-per-node={ranks}"]
    keys = {o.split("=", 1)[0] for o in overrides}
    base = [o for o in CUDA if o.split("=", 1)[0] not in keys]  # an explicit override replaces the default
    return _run(launcher + ["scripts/train.py", *base, f"hydra.run.dir={run_dir}", *overrides])


def losses(run_dir: Path) -> list:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_train_bf16_under_torchrun_with_nccl(tmp_path):
    proc = train(tmp_path / "bf16", "trainer.steps=3", "trainer.precision=bf16")
    assert "cuda bf16" in proc.stderr  # the progress bar names where it trained
    got = losses(tmp_path / "bf16")
    assert len(got) == 3 and all(math.isfinite(x) and 0 < x < 10 for x in got), got
    from cp_attention.training import load_checkpoint

    state = load_checkpoint(tmp_path / "bf16" / "checkpoints")
    assert all(v.dtype == torch.float32 for v in state["model"].values())  # autocast: fp32 weights
    assert state["rng"]["cuda_device"] == 0 and state["config"]["trainer"]["precision"] == "bf16"
    train(tmp_path / "fp32", "trainer.steps=1")  # the same first batch in fp32: bf16 is close to it
    assert losses(tmp_path / "fp32")[0] == pytest.approx(got[0], rel=2e-2)


def test_train_resumes_on_cuda(tmp_path):
    train(tmp_path / "straight", "trainer.steps=4", "trainer.precision=bf16")
    train(tmp_path / "resumed", "trainer.steps=4", "trainer.precision=bf16", "trainer.stop_after=2")
    proc = train(tmp_path / "resumed", "trainer.steps=4", "trainer.precision=bf16", "trainer.resume_from=auto")
    assert "(step 2)" in proc.stderr
    a, b = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert len(b) == 4 and b == pytest.approx(a, abs=2e-2), (a, b)  # CUDA atomics: close, not bit for bit


def test_train_spawns_a_cuda_rank_without_torchrun(tmp_path):
    """trainer.device=auto with one rank on a GPU machine: cuda, a single spawned NCCL rank."""
    proc = train(tmp_path, "trainer.steps=2", "trainer.device=auto", "data.packing=true", ranks=None)
    assert "cuda fp32" in proc.stderr and len(losses(tmp_path)) == 2


@two_gpus
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_train_cp2_over_nccl(tmp_path, precision):
    """Two ranks, CP=2: the ring runs on CUDA over NCCL; the loss matches CP=1 on one GPU."""
    train(tmp_path / "cp2", "trainer.steps=1", "nproc=2", "cp_size=2", f"trainer.precision={precision}", ranks=2)
    train(tmp_path / "cp1", "trainer.steps=1", f"trainer.precision={precision}")
    assert losses(tmp_path / "cp2")[0] == pytest.approx(losses(tmp_path / "cp1")[0], rel=1e-4 if precision ==
                                                        "fp32" else 2e-2)


def _example(script: str, *extra: str, ranks: int | None = None) -> list:
    launcher = [sys.executable] if ranks is None else TORCHRUN + [f"--nproc-per-node={ranks}"]
    size = [] if ranks is not None else ["--world-size", "1"]
    proc = _run(launcher + [f"examples/{script}", "--steps", "3", "--seq-len", "64", "--batch", "2", "--log-every",
                            "1", "--device", "cuda", "--precision", "bf16", *size, *extra])
    got = [float(line.split()[3]) for line in proc.stdout.splitlines() if line.startswith("step")]
    assert len(got) == 3 and all(math.isfinite(x) and 0 < x < 10 for x in got), proc.stdout
    return got


@pytest.mark.parametrize("ranks", [None, 1], ids=["spawned", "torchrun"])
def test_hf_example_bf16(ranks):
    pytest.importorskip("transformers", reason="finetune_hf.py needs transformers")
    _example("finetune_hf.py", ranks=ranks)


@pytest.mark.parametrize("ranks", [None, 1], ids=["spawned", "torchrun"])
def test_megatron_example_bf16(ranks):
    """At CP=1 megatron still runs its core attention through ring_attention: the CUDA kernels, bf16."""
    pytest.importorskip("megatron.core", reason="pretrain_megatron.py needs megatron-core")
    _example("pretrain_megatron.py", ranks=ranks)


@two_gpus
@pytest.mark.parametrize("script,needs", [("finetune_hf.py", "transformers"),
                                          ("pretrain_megatron.py", "megatron.core")])
def test_examples_cp2_over_nccl(script, needs):
    pytest.importorskip(needs)
    _example(script, "--layout", "interleaved", ranks=2)


def test_collectives_on_a_single_process_nccl_group():
    from cp_attention.launch import free_port, process_group
    from cp_attention.training.device import all_reduce_, collective_device, rank_device

    torch.cuda.set_device(0)
    with process_group("nccl", rank=0, world_size=1, port=free_port()):
        assert rank_device("auto") == torch.device("cuda", 0) == collective_device()
        cpu = torch.arange(3.0)
        assert all_reduce_(cpu) is cpu and cpu.device.type == "cpu" and torch.equal(cpu, torch.arange(3.0))
