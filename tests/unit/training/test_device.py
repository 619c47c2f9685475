"""Where training runs (cp_attention.training.device), checked on the CPU: device and backend
resolution, the device every collective of the training loops takes its tensors on, bf16 autocast,
and ``use_cache=False`` in HF training forwards. tests/system/test_train_gpu.py runs the scripts on CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import cp_attention.transport
from cp_attention.launch import free_port, process_group
from cp_attention.training.device import (
    Placement,
    all_reduce_,
    autocast,
    backend_device_type,
    backend_for,
    collective_device,
    placement,
    rank_device,
)

ROOT = Path(__file__).resolve().parents[3]
TRAINING = ROOT / "cp_attention" / "training"
NO_CUDA = not torch.cuda.is_available()


def test_backend_follows_the_device():
    assert backend_for("cuda") == "nccl" and backend_for("cpu") == "gloo"
    with pytest.raises(ValueError, match="no process-group backend for device type 'mps'; expected cpu or cuda"):
        backend_for("mps")
    assert [backend_device_type(b) for b in ("nccl", "NCCL", "gloo", "cpu:gloo,cuda:nccl")] == \
        ["cuda", "cuda", "cpu", "cpu"]


@pytest.mark.parametrize("device,backend,ranks,gpus,cp,expected", [
    ("auto", "auto", 2, 0, 2, Placement("cpu", "gloo")),
    ("auto", "auto", 2, 2, 2, Placement("cuda", "nccl")),
    ("auto", "auto", 1, 8, 1, Placement("cuda", "nccl")),
    ("cpu", "auto", 2, 8, 2, Placement("cpu", "gloo")),
    ("cuda", "auto", 4, 4, 2, Placement("cuda", "nccl")),
    ("cuda", "gloo", 2, 2, 1, Placement("cuda", "gloo")),  # cp=1: no CUDA tensor crosses the ring
    ("cpu", "gloo", 2, 0, 2, Placement("cpu", "gloo")),
    ("auto", "gloo", 2, 2, 2, Placement("cpu", "gloo")),  # auto follows an explicit backend
    ("auto", "nccl", 2, 2, 2, Placement("cuda", "nccl")),
])
def test_placement(device, backend, ranks, gpus, cp, expected):
    assert placement(device, backend, local_ranks=ranks, cp_size=cp, cuda_devices=gpus) == expected


def test_auto_with_fewer_gpus_than_ranks_runs_on_the_cpu_and_says_why():
    where = placement("auto", local_ranks=4, cp_size=2, cuda_devices=2, prefix="trainer.")
    assert where[:2] == ("cpu", "gloo")
    assert "trainer.device=auto: 4 ranks on this machine but 2 GPU(s)" in where.note
    assert "Use at most 2 ranks here" in where.note


@pytest.mark.parametrize("kwargs,message", [
    ({"device": "tpu"}, "trainer.device must be one of auto, cpu, cuda; got 'tpu'"),
    ({"backend": "mpi"}, "trainer.backend must be one of auto, gloo, nccl; got 'mpi'"),
    ({"precision": "fp16"}, "trainer.precision must be one of fp32, bf16; got 'fp16'"),
    ({"device": "cuda", "cuda_devices": 0}, "trainer.device=cuda, but torch sees no CUDA device"),
    ({"device": "cuda", "cuda_devices": 1, "local_ranks": 2},
     r"trainer.device=cuda needs one GPU per rank: 2 ranks on this machine, but it has 1 GPU\(s\). Start at most 1"),
    ({"device": "cpu", "backend": "nccl"}, "trainer.backend=nccl needs trainer.device=cuda"),
    ({"backend": "nccl", "cuda_devices": 0}, "trainer.backend=nccl, but torch sees no CUDA device"),
    ({"device": "cuda", "backend": "gloo", "cuda_devices": 2, "local_ranks": 2, "cp_size": 2},
     r"trainer.backend=gloo cannot carry the ring's CUDA tensors \(cp_size=2"),
])
def test_placement_refuses_what_cannot_run(kwargs, message):
    with pytest.raises(ValueError, match=message):
        placement(**{"cuda_devices": 2, "prefix": "trainer.", **kwargs})


def _config(*overrides: str) -> dict:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        return OmegaConf.to_container(compose(config_name="train", overrides=list(overrides)), resolve=True)


def test_config_defaults_resolve_to_this_machine():
    from cp_attention.training.loop import trainer_placement, validate_config

    cfg = _config()
    assert {k: cfg["trainer"][k] for k in ("device", "backend", "precision")} == \
        {"device": "auto", "backend": "auto", "precision": "fp32"}
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    expected = ("cuda", "nccl") if gpus >= cfg["nproc"] else ("cpu", "gloo")
    assert trainer_placement(cfg, cfg["nproc"])[:2] == expected
    validate_config(_config("trainer.precision=bf16"), 2)  # bf16 is allowed on the CPU (autocast)
    with pytest.raises(ValueError, match="trainer.precision must be one of fp32, bf16; got 'fp16'"):
        validate_config(_config("trainer.precision=fp16"), 2)


@pytest.mark.dist
@pytest.mark.skipif(not NO_CUDA, reason="checks the refusal on a machine without CUDA")
def test_cuda_without_a_gpu_fails_fast():
    from cp_attention.training.loop import validate_config

    with pytest.raises(ValueError, match="trainer.device=cuda, but torch sees no CUDA device"):
        validate_config(_config("trainer.device=cuda"), 2)
    for script in ("finetune_hf.py", "pretrain_megatron.py"):
        proc = subprocess.run([sys.executable, f"examples/{script}", "--device", "cuda", "--precision", "bf16"],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "--device=cuda, but torch sees no CUDA device" in proc.stderr, proc.stderr


@pytest.mark.dist
def test_collective_device_follows_the_backend(monkeypatch):
    with process_group("gloo", rank=0, world_size=1, port=free_port()):
        assert collective_device() == torch.device("cpu") and rank_device("auto") == torch.device("cpu")
        t = torch.arange(3.0)
        assert all_reduce_(t) is t and torch.equal(t, torch.arange(3.0))
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
        assert collective_device() == torch.device("cuda", 3)


def test_autocast_contexts():
    with autocast(torch.device("cpu"), "fp32"):
        assert not torch.is_autocast_enabled("cpu")
    with autocast(torch.device("cpu"), "bf16"):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="precision must be one of fp32, bf16; got 'fp8'"):
        autocast(torch.device("cpu"), "fp8")


# --- every collective of the training loops, recorded on 2 gloo ranks ---------------------------------

TRANSPORT = str(Path(cp_attention.transport.__file__).parent)
DYNAMO = os.sep + os.path.join("torch", "_dynamo") + os.sep  # torch.compiler.disable's wrapper frames
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter_tensor",
                "reduce", "all_to_all_single")


def _record_collectives_and_forwards(run) -> dict:
    """Run ``run()`` with every tensor collective of ``torch.distributed`` and every HF causal LM
    forward wrapped: what called each collective, its tensor's device and the device its group needs,
    and the ``use_cache`` of every forward."""
    import transformers

    calls, use_cache, saved = [], [], {}

    def wrap(name, original):
        def recorded(tensor, *args, **kwargs):
            group = kwargs.get("group")
            caller = sys._getframe(1)
            # the transport runs it for its caller (through torch.compiler.disable's wrapper frames)
            while caller.f_code.co_filename.startswith(TRANSPORT) or DYNAMO in caller.f_code.co_filename:
                caller = caller.f_back
            outer = caller.f_back
            first = tensor[0] if isinstance(tensor, (list, tuple)) else tensor
            calls.append({"fn": name, "file": caller.f_code.co_filename, "caller": caller.f_code.co_name,
                          "outer": outer.f_code.co_filename if outer else "", "device": str(first.device),
                          "needs": str(collective_device(group))})
            return original(tensor, *args, **kwargs)
        return recorded

    def forward(self, *args, **kwargs):
        use_cache.append(kwargs.get("use_cache", "absent"))
        return saved["forward"](self, *args, **kwargs)

    for name in _COLLECTIVES:
        saved[name] = getattr(dist, name)
        setattr(dist, name, wrap(name, saved[name]))
    saved["forward"] = transformers.LlamaForCausalLM.forward
    transformers.LlamaForCausalLM.forward = forward
    try:
        run()
    finally:
        for name in _COLLECTIVES:
            setattr(dist, name, saved[name])
        transformers.LlamaForCausalLM.forward = saved["forward"]
    return {"calls": calls, "use_cache": use_cache}


def loop_collectives(rank: int, world_size: int, cfgs: list, run_dir: str) -> list:
    """The Hydra loop (one step per config), then the HF example (and Megatron's when installed)."""
    import argparse
    import importlib.util

    from cp_attention.training import loop
    from examples import finetune_hf as hf_example

    example = argparse.Namespace(layout="zigzag", kernel="auto", seq_len=32, batch=2, steps=1, lr=1e-3, seed=0,
                                 log_every=1, device="auto", precision="fp32", tp_size=1, cp_size=2,
                                 world_size=world_size, dtype="float32")
    out = []
    for i, cfg in enumerate(cfgs):
        os.makedirs(os.path.join(run_dir, str(i)), exist_ok=True)  # Hydra's run directory
        out.append(_record_collectives_and_forwards(
            lambda cfg=cfg, i=i: loop.train(cfg, os.path.join(run_dir, str(i)))))
    out.append(_record_collectives_and_forwards(lambda: hf_example.train(example)))
    if importlib.util.find_spec("megatron.core") is not None:
        from megatron.core import parallel_state as ps

        from examples import pretrain_megatron as megatron_example

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        out.append(_record_collectives_and_forwards(lambda: megatron_example.train(example)))
    return out


def test_every_training_collective_is_on_the_device_its_backend_needs(pools, tmp_path):
    """On gloo that is the CPU; what makes it hold on NCCL too is that each collective of
    cp_attention/training goes through ``all_reduce_``, which moves its tensor to ``collective_device``
    (checked above with a pretend NCCL group). Also: every HF training forward passes use_cache=False."""
    pytest.importorskip("transformers", reason="needs the hf extra")
    tiny = ["trainer.seq_len=32", "trainer.micro_batch=2", "trainer.steps=1", "trainer.ckpt_every=0",
            "model.hidden_size=32", "model.intermediate_size=64", "trainer.device=cpu"]
    cfgs = [_config(*tiny, "cp_size=2"), _config(*tiny, "cp_size=1", "data.packing=true")]  # cp, then dp
    results = pools(2).run(loop_collectives, cfgs=cfgs, run_dir=str(tmp_path), timeout=240)
    for rank, runs in enumerate(results):
        for run in runs:
            assert all(c["device"] == c["needs"] for c in run["calls"]), (rank, run["calls"])
        ours = [c for run in runs for c in run["calls"] if c["file"].startswith(str(TRAINING))]
        assert ours and all(c["file"] == str(TRAINING / "device.py") and c["caller"] == "all_reduce_"
                            for c in ours), (rank, ours)
        callers = {Path(c["outer"]).name for c in ours}
        assert {"loop.py", "steps.py"} <= callers, callers  # the step's loss, the CP and DP gradient sums
        forwards = [u for run in runs for u in run["use_cache"]]
        assert len(forwards) >= 3 and all(u is False for u in forwards), forwards


# --- bf16 on the CPU, end to end ------------------------------------------------------------------------

def _train(run_dir: Path, *overrides: str, check: bool = True):
    from tests.system.test_train import train

    return train(run_dir, "trainer.steps=2", "trainer.device=cpu", "trainer.precision=bf16", *overrides, check=check)


@pytest.mark.dist
@pytest.mark.slow
def test_bf16_on_cpu_trains_without_cp(tmp_path):
    import json

    pytest.importorskip("transformers", reason="needs the hf extra")
    proc = _train(tmp_path, "nproc=1", "cp_size=1")
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and all(0 < x < 10 for x in losses), losses
    assert "cpu bf16" in proc.stderr


@pytest.mark.dist
@pytest.mark.slow
def test_bf16_on_cpu_trains_with_cp(tmp_path):
    pytest.importorskip("transformers", reason="needs the hf extra")
    # Under autocast RoPE leaves q and k in fp32 and v in bf16: the adapter runs attention in bf16.
    proc = _train(tmp_path, "nproc=2", "cp_size=2", check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
