"""scripts/train.py with trainer.fsdp=true: FSDP2 over dp x cp, sharded checkpoints (each rank its own
shards, torch.distributed.checkpoint) that a resume on another dp x cp reads back resharded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs the hf extra")

from cp_attention.training.checkpoint import (  # noqa: E402
    CorruptCheckpointError,
    check_resume_compatible,
    checkpoint_info,
    file_digests,
    find_complete_checkpoint,
    write_manifest,
)
from tests.system.test_train import train  # noqa: E402

JOB = ["trainer.steps=4", "trainer.ckpt_every=2", "trainer.fsdp=true"]
FP32 = 2e-6  # relative: the same sums in another order (another dp x cp), fp32


def losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def _close(a: dict[int, float], b: dict[int, float], steps) -> None:
    for s in steps:
        assert abs(a[s] - b[s]) <= FP32 * abs(b[s]), f"step {s}: {a[s]} != {b[s]}"


@pytest.mark.slow
def test_fsdp_checkpoints_are_sharded_and_resume_on_another_mesh(tmp_path):
    train(tmp_path / "fsdp", "nproc=2", "cp_size=2", *JOB)  # dp=1 x cp=2, 2 rows per step
    ckpt = tmp_path / "fsdp" / "checkpoints"
    assert (ckpt / "latest").read_text() == "step_0000004"
    for step in (2, 4):  # each rank wrote its own shards; the manifest covers every file
        files = {p.name for p in (ckpt / f"step_{step:07d}").iterdir()}
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "trainer_state.pt"} <= files, files
        assert set(checkpoint_info(ckpt / f"step_{step:07d}")["files"]) == files
    # resharded: dp=2 x cp=1 with 1 row each (the same global batch), activations recomputed
    train(tmp_path / "resharded", "nproc=2", "cp_size=1", "trainer.micro_batch=1", *JOB,
          "trainer.activation_checkpointing=true", f"trainer.resume_from={ckpt / 'step_0000002'}")
    resumed = losses(tmp_path / "resharded")
    assert sorted(resumed) == [3, 4]
    _close(resumed, losses(tmp_path / "fsdp"), (3, 4))
    # another global batch cannot continue the same run
    bad = train(tmp_path / "bad", "nproc=2", "cp_size=1", *JOB, f"trainer.resume_from={ckpt}", check=False)
    assert bad.returncode != 0 and "global batch" in bad.stderr, bad.stderr[-2000:]


def _fake_sharded(directory: Path, step: int, config: dict) -> Path:
    path = directory / f"step_{step:07d}"
    path.mkdir(parents=True)
    for name in ("__0_0.distcp", "__1_0.distcp", ".metadata", "trainer_state.pt"):
        (path / name).write_bytes(bytes([step]) * 64)
    write_manifest(path, {"format": 2, "step": step, "sharded": True, "files": file_digests(path),
                          "world_size": 2, "config": config})
    return path


CONFIG = {"cp_size": 2, "trainer": {"micro_batch": 2, "fsdp": True, "seq_len": 64}}


def test_auto_skips_incomplete_and_corrupt_sharded_checkpoints(tmp_path):
    _fake_sharded(tmp_path, 2, CONFIG)
    corrupt = _fake_sharded(tmp_path, 4, CONFIG)
    (corrupt / "__1_0.distcp").write_bytes(b"\0" * 64)  # same size, other bytes
    (tmp_path / "step_0000006").mkdir()  # a save that died before its manifest
    path, info, skipped = find_complete_checkpoint(tmp_path)
    assert path == tmp_path / "step_0000002" and info["step"] == 2
    assert len(skipped) == 2 and "no manifest" in skipped[0] and "__1_0.distcp" in skipped[1], skipped
    (tmp_path / "step_0000002" / "__0_0.distcp").unlink()
    with pytest.raises(CorruptCheckpointError, match="lacks __0_0.distcp"):
        checkpoint_info(tmp_path / "step_0000002")


@pytest.mark.parametrize("world,cfg,words", [
    (4, {"cp_size": 2, "trainer": {"micro_batch": 1, "fsdp": True, "seq_len": 64}}, None),  # 2x2, 1 row each
    (4, {"cp_size": 4, "trainer": {"micro_batch": 2, "fsdp": True, "seq_len": 64}}, None),  # 1x4
    (4, {"cp_size": 2, "trainer": {"micro_batch": 2, "fsdp": True, "seq_len": 64}}, "global batch"),
    (2, {"cp_size": 2, "trainer": {"micro_batch": 2, "fsdp": False, "seq_len": 64}}, "trainer.fsdp=True"),
    (2, {"cp_size": 2, "trainer": {"micro_batch": 2, "fsdp": True, "seq_len": 128}}, "trainer.seq_len"),
])
def test_sharded_resume_may_change_dp_x_cp_only(tmp_path, world, cfg, words):
    path = _fake_sharded(tmp_path, 2, CONFIG)
    if words is None:
        check_resume_compatible(checkpoint_info(path), cfg, world, path)
    else:
        with pytest.raises(ValueError, match=words.replace(".", r"\.")):
            check_resume_compatible(checkpoint_info(path), cfg, world, path)
