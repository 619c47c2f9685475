"""Never hang, never silently wrong: rank death, trainer.resume_from=auto, and safe resume.

The end-to-end tests run scripts/train.py on 2 gloo ranks with a tiny model (see test_train.py); the
checkpoint tests call cp_attention.training.checkpoint directly.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs the hf extra")
import torch  # noqa: E402

from cp_attention.training.checkpoint import (  # noqa: E402
    CorruptCheckpointError,
    check_resume_compatible,
    checkpoint_info,
    find_complete_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from tests.system.test_train import ROOT, TINY, _config, weights  # noqa: E402

JOB = ["trainer.steps=8", "trainer.ckpt_every=3", "trainer.resume_from=auto", "trainer.dist_timeout_s=30"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1"]


def steps_logged(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_loss(run_dir: Path) -> float:
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["loss"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, str]:
    """An uninterrupted 8-step torchrun job with checkpoints at 3, 6 and 8, started with resume_from=auto:
    the reference every resumed job must equal bit for bit (same launcher, so the same threads)."""
    run = tmp_path_factory.mktemp("resume") / "base"
    out = _torchrun(run, *JOB)
    assert out.finish(300) == 0, out.text[-4000:]
    return run, out.text


def copy_run(base_dir: Path, to: Path) -> Path:
    shutil.copytree(base_dir, to)
    return to


def run_config(run_dir: Path, **trainer) -> dict:
    """The resolved config a run wrote, as scripts/train.py passes it on, with trainer fields changed."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"), resolve=True)
    cfg["trainer"].update(trainer)
    return cfg


# --------------------------------------------------------------------------- checkpoints, no processes

def _state(step: int, **config) -> dict:
    return {"step": step, "w": torch.full((4,), float(step)), "world_size": 2,
            "config": {"cp_size": 2, "trainer": {"steps": 6, "seq_len": 64}, **config}}


def test_manifest_detects_truncation_and_corruption(tmp_path):
    for step in (3, 6, 9):
        save_checkpoint(tmp_path, step, _state(step))
    assert checkpoint_info(tmp_path / "step_0000009.pt")["config"]["cp_size"] == 2
    last, middle = tmp_path / "step_0000009.pt", tmp_path / "step_0000006.pt"
    last.write_bytes(last.read_bytes()[:100])  # truncated
    data = bytearray(middle.read_bytes())
    data[-30] ^= 0xFF  # same size, one byte flipped
    middle.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"step_0000009\.pt' is truncated or incomplete: 100 bytes"):
        load_checkpoint(tmp_path)  # 'latest' points at step 9
    with pytest.raises(CorruptCheckpointError, match=r"step_0000006\.pt' is corrupt: its SHA-256 differs"):
        load_checkpoint(middle)
    path, info, skipped = find_complete_checkpoint(tmp_path)
    assert path == tmp_path / "step_0000003.pt" and info["step"] == 3 and len(skipped) == 2, skipped
    assert torch.equal(load_checkpoint(path)["w"], torch.full((4,), 3.0))
    assert find_complete_checkpoint(tmp_path / "none") == (None, None, [])


def test_checkpoint_without_manifest_is_checked_by_loading(tmp_path):
    save_checkpoint(tmp_path, 2, _state(2))
    path = tmp_path / "step_0000002.pt"
    (tmp_path / "step_0000002.pt.json").unlink()  # as written before manifests existed
    assert checkpoint_info(path)["step"] == 2
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CorruptCheckpointError, match=r"step_0000002\.pt' cannot be loaded"):
        load_checkpoint(path)


@pytest.mark.parametrize("change,field", [
    ({"cp_size": 1}, "cp_size (checkpoint: 2, this run: 1)"),
    ({"trainer": {"steps": 6, "seq_len": 128}}, "trainer.seq_len (checkpoint: 64, this run: 128)"),
    ({"trainer": {"steps": 6, "seq_len": 64, "micro_batch": 4}}, "trainer.micro_batch (checkpoint: 2"),
    ({"trainer": {"steps": 6, "seq_len": 64, "grad_accum": 2}}, "trainer.grad_accum"),
    ({"model": {"hidden_size": 64}}, "model.hidden_size"),
    ({"layout": {"name": "interleaved"}}, "layout.name (checkpoint: 'zigzag'"),
    ({"data": {"source": "builtin", "packing": True}}, "data.packing (checkpoint: False, this run: True)"),
])
def test_incompatible_configs_are_refused_by_field(change, field):
    saved = {"cp_size": 2, "trainer": {"steps": 6, "seq_len": 64, "micro_batch": 2, "grad_accum": 1},
             "model": {"hidden_size": 32}, "layout": {"name": "zigzag"},
             "data": {"source": "builtin", "packing": False}, "kernel": {"name": "auto"}}
    info = {"world_size": 2, "config": saved}
    with pytest.raises(ValueError, match="the config differs") as e:
        check_resume_compatible(info, {**saved, **change}, 2, "ckpt.pt")
    assert field in str(e.value)
    with pytest.raises(ValueError, match=r"dp = world size / cp_size \(checkpoint: 2 / 2 = 1, this run: 4 / 2 = 2\)"):
        check_resume_compatible(info, saved, 4, "ckpt.pt")  # more ranks: a larger global batch
    allowed = {**saved, "trainer": {**saved["trainer"], "steps": 10, "log_every": 7}, "kernel": {"name": "math"},
               "nproc": 8}
    check_resume_compatible(info, allowed, 2, "ckpt.pt")


def test_memory_savers_may_change_on_resume():
    """Where memory goes is no part of what a step computes: the savers may change on resume."""
    trainer = {"steps": 6, "seq_len": 64, "activation_checkpointing": False, "mlp_chunks": None,
               "loss_chunk_tokens": 1024, "offload_optimizer": False}
    saved = {"cp_size": 2, "trainer": trainer}
    changed = {"cp_size": 2, "trainer": {**trainer, "activation_checkpointing": "offload", "mlp_chunks": 4,
                                         "loss_chunk_tokens": None, "offload_optimizer": True}}
    check_resume_compatible({"world_size": 2, "config": saved}, changed, 2, "ckpt.pt")


def test_a_killed_spawned_rank_is_named():
    from torch.multiprocessing import ProcessExitedException

    from cp_attention.training.loop import _died_message

    e = ProcessExitedException("process 1 terminated with signal SIGKILL", error_index=1, error_pid=1,
                               exit_code=-9, signal_name="SIGKILL")
    assert _died_message(e, "/nowhere").startswith("rank 1 died (SIGKILL); the other ranks were stopped")


@pytest.mark.parametrize("error,says", [
    ("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1", "a peer rank died or failed"),
    ("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer", "a peer rank died or failed"),
    ("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 30000ms for recv operation to complete",
     "a peer rank did not answer within trainer.dist_timeout_s=30 s"),
    ("mat1 and mat2 shapes cannot be multiplied", None),  # this rank's own failure: raised as it is
])
def test_communication_failures_are_reported_as_a_peer_failing(error, says):
    from cp_attention.training.loop import _as_peer_error

    got = _as_peer_error(RuntimeError(error), 1, "during step 4 of 8", 30)
    if says is None:
        assert got is None
    else:
        assert str(got).startswith(f"rank 1: {says}") and "during step 4 of 8" in str(got), got


# --------------------------------------------------------------------------- scripts/train.py

@pytest.mark.slow
def test_auto_without_a_checkpoint_starts_fresh(base):
    run, output = base
    assert f"no complete checkpoint in {run / 'checkpoints'}; starting fresh" in output
    assert steps_logged(run) == list(range(1, 9))
    assert checkpoint_info(run / "checkpoints" / "step_0000003.pt")["world_size"] == 2


def test_resume_with_changed_cp_size_and_seq_len_names_the_fields(base):
    """What scripts/train.py checks before any rank starts (test_train checks that it reports it)."""
    from cp_attention.training.loop import validate_config

    cfg = {**run_config(base[0], resume_from=str(base[0]), seq_len=128), "cp_size": 1}
    with pytest.raises(ValueError) as e:
        validate_config(cfg, 2)
    for field in ("cp_size (checkpoint: 2, this run: 1)", "trainer.seq_len (checkpoint: 64, this run: 128)",
                  "dp = world size / cp_size (checkpoint: 2 / 2 = 1, this run: 2 / 1 = 2)"):
        assert field in str(e.value)


def test_resume_may_change_the_strategy(base):
    """cp_comm changes only how K/V travel (every strategy is exact): a resume may switch it."""
    from cp_attention.training.loop import validate_config

    cfg = run_config(base[0], resume_from=str(base[0]))
    assert cfg["cp_comm"] == {"name": "p2p", "inner": None}
    validate_config({**cfg, "cp_comm": {"name": "all_gather", "inner": None}}, 2)


@pytest.mark.slow
def test_corrupt_latest_checkpoint(base, tmp_path):
    """Explicit resume refuses it naming the file; auto falls back to the previous one, and the job
    ends exactly where the uninterrupted one did, each step logged once."""
    from cp_attention.training.loop import validate_config

    run = copy_run(base[0], tmp_path / "run")
    bad = run / "checkpoints" / "step_0000008.pt"
    bad.write_bytes(bad.read_bytes()[:1000])
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 9, "loss": 1.0}\n{"step": 10, "lo')  # as if a crashed attempt had gone further
    with pytest.raises(CorruptCheckpointError, match=f"checkpoint '{bad}' is truncated or incomplete"):
        validate_config(run_config(run, resume_from=str(run)), 2)

    out = _torchrun(run, *JOB)
    assert out.finish(300) == 0, out.text[-4000:]
    assert f"resume_from=auto: skipping checkpoint '{bad}' is truncated" in out.text
    assert f"resuming from {run / 'checkpoints' / 'step_0000006.pt'} (step 6)" in out.text
    assert steps_logged(run) == list(range(1, 9))
    assert final_loss(run) == final_loss(base[0])
    a, b = weights(base[0]), weights(run)
    assert all(torch.equal(a[k], b[k]) for k in a)


class _Output:
    """A process's merged output, read as it comes, with the time each marker first appeared."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.text, self._times, self._proc = "", [], proc
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while chunk := os.read(self._proc.stdout.fileno(), 65536):
            self.text += chunk.decode(errors="replace")
            self._times.append((time.monotonic(), len(self.text)))

    def when(self, marker: str) -> float | None:
        at = self.text.find(marker)
        return next(t for t, end in self._times if end > at) if at >= 0 else None

    def finish(self, timeout: float) -> int:
        rc = self._proc.wait(timeout)
        self._thread.join(10)
        return rc


def _torchrun(run_dir: Path, *overrides: str, kill: str | None = None) -> _Output:
    """scripts/train.py under torchrun; ``kill="RANK:STEP"``: through tests/support/core/train_killing_a_rank.py,
    whose ``before_step`` callback SIGKILLs rank RANK as it starts step STEP (torchrun's first attempt only)."""
    env = {**os.environ, "HYDRA_FULL_ERROR": "1"}
    keys = {o.split("=", 1)[0] for o in overrides}
    tiny = [o for o in TINY if o.split("=", 1)[0] not in keys]
    script = ["tests/support/core/train_killing_a_rank.py", kill] if kill else ["scripts/train.py"]
    cmd = [*TORCHRUN, *script, *tiny, *overrides, f"hydra.run.dir={run_dir}"]
    return _Output(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))


@pytest.mark.slow
def test_torchrun_restarts_after_a_rank_is_killed(base, tmp_path):
    """Rank 1 SIGKILLs itself at step 5 (checkpoint at 3, step 4 already logged); torchrun restarts
    both ranks, they resume from step 3, and the job ends exactly as the uninterrupted one."""
    out = _torchrun(tmp_path / "run", *JOB, kill="1:5")
    rc = out.finish(300)
    assert rc == 0, out.text[-4000:]
    killed = out.when("train_killing_a_rank: rank 1 SIGKILLs itself at step 5")
    resumed = out.when(f"resuming from {tmp_path / 'run' / 'checkpoints' / 'step_0000003.pt'} (step 3)")
    assert killed is not None and resumed is not None, out.text[-4000:]
    # the survivor raises at once, unless torchrun's agent (polling every 0.1 s) stops it first
    noticed = out.when("rank 0: a peer rank died or failed during step 5 of 8")
    print(f"\nkill -> surviving rank's PeerRankError: "
          f"{'(stopped by torchrun first)' if noticed is None else f'{noticed - killed:.2f} s'}; "
          f"kill -> resumed after the restart: {resumed - killed:.2f} s")
    assert steps_logged(tmp_path / "run") == list(range(1, 9))
    assert final_loss(tmp_path / "run") == final_loss(base[0])
    a, b = weights(base[0]), weights(tmp_path / "run")
    assert all(torch.equal(a[k], b[k]) for k in a)


def _before_step_calls(rank: int, world_size: int, cfg: dict, run_dir: str) -> dict:
    """train()'s ``before_step`` on a pool rank: ``(step, steps logged so far)`` of each call in a run
    stopped after 2 of 4 steps and in its resume, and what a hook that raises at step 2 makes train() do."""
    from cp_attention.training import loop

    metrics, calls = Path(run_dir) / "metrics.jsonl", {"fresh": [], "resumed": []}

    def record(name: str):
        def hook(step: int) -> None:  # only rank 0 writes metrics.jsonl: read it there
            logged = None if rank else len(metrics.read_text().splitlines()) if metrics.is_file() else 0
            calls[name].append((step, logged))
        return hook

    loop.train(cfg, run_dir, before_step=record("fresh"))
    whole = {**cfg, "trainer": {**cfg["trainer"], "stop_after": None}}
    loop.train(whole, run_dir, resume=Path(run_dir) / "checkpoints", before_step=record("resumed"))

    def refuse(step: int) -> None:
        if step == 2:
            raise ValueError(f"the hook refuses step {step}")

    try:
        loop.train(whole, os.path.join(run_dir, "refused"), before_step=refuse)
    except ValueError as e:
        calls["raised"] = str(e)
    return calls


@pytest.mark.slow
def test_before_step_is_called_as_each_step_starts(pools, tmp_path):
    """The callback the kill test passes in: called on every rank with each step's number (1-based, from
    the checkpoint's step + 1 on resume), before the step runs; what it raises stops train() as raised."""
    cfg = _config(*TINY, "cp_size=2", "trainer.steps=4", "trainer.stop_after=2")
    (tmp_path / "refused").mkdir()
    for rank, calls in enumerate(pools(2).run(_before_step_calls, cfg=cfg, run_dir=str(tmp_path), timeout=240)):
        logged = (lambda n: n) if rank == 0 else (lambda n: None)
        assert calls["fresh"] == [(1, logged(0)), (2, logged(1))], (rank, calls)
        assert calls["resumed"] == [(3, logged(2)), (4, logged(3))], (rank, calls)
        assert calls.get("raised") == "the hook refuses step 2", (rank, calls)
    assert steps_logged(tmp_path) == [1, 2, 3, 4] and steps_logged(tmp_path / "refused") == [1]


@pytest.mark.slow
def test_a_dead_peer_fails_the_survivor_within_the_timeout(tmp_path):
    """Two ranks started as torchrun would, with no agent to restart or stop them: SIGKILL rank 1
    and rank 0 exits non-zero on its own, saying that a peer died and at which step."""
    from cp_attention.launch import free_port

    timeout_s = 30
    port, run = free_port(), tmp_path / "run"
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(
            [sys.executable, "scripts/train.py", *TINY, "trainer.steps=100000", f"trainer.dist_timeout_s={timeout_s}",
             f"hydra.run.dir={run}"], cwd=ROOT, env=env, stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
            stderr=subprocess.STDOUT if rank == 0 else subprocess.DEVNULL))
    survivor = _Output(procs[0])
    try:
        start = time.monotonic()
        while not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().count("\n") >= 3):
            assert procs[0].poll() is None and time.monotonic() - start < 240, survivor.text[-3000:]
            time.sleep(0.05)
        killed = time.monotonic()
        procs[1].send_signal(signal.SIGKILL)
        rc = survivor.finish(timeout_s + 30)
        took = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    print(f"\nSIGKILL of rank 1 -> rank 0 exited (rc={rc}) after {took:.2f} s")
    assert rc != 0 and took < timeout_s
    assert "PeerRankError: rank 0: a peer rank died or failed during step" in survivor.text, survivor.text[-3000:]
