"""The summary a finished job prints (cp_attention.training.summary), the loss curve with and without
matplotlib, and a clean exit of spawned ranks (no leaked semaphore). End to end: test_train.py's
test_outputs_and_falling_loss and test_scripts.py."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from cp_attention.training import summary as sm

ROOT = Path(__file__).resolve().parents[3]


def _run_dir(tmp_path: Path, losses=(5.6, 4.0, 4.5)) -> Path:
    """A run directory as the launcher leaves it (metrics, a checkpoint, the resolved config)."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": 2 * i + 2, "loss": x, "lr": 1e-3 / (i + 1), "tokens_per_s": 100.0}) + "\n"
        for i, x in enumerate(losses)))
    (run / "checkpoints" / "step_0000006.pt").write_bytes(b"x")
    (run / "checkpoints" / "step_0000006.pt.json").write_text("{}")
    (run / "checkpoints" / "latest").write_text("step_0000006.pt")
    (run / "config.yaml").write_text("cp_size: 2\n")
    return run


def test_training_summary_names_its_files_and_losses(tmp_path):
    pytest.importorskip("matplotlib")
    run = _run_dir(tmp_path)
    text = sm.training_summary(run, {"step": 6, "loss": 4.5, "tokens_per_s": 12345.6}, "python train.py", 6).render()
    lines = text.splitlines()
    assert lines[0] == "== train.py: done, step 6 of 6 =="
    assert f"run directory  {run}/" in lines
    assert "  checkpoint   checkpoints/step_0000006.pt (the latest of 1)" in lines
    assert "  metrics      metrics.jsonl (3 steps logged)" in lines
    assert "loss           final 4.5000 (step 6), best 4.0000 (step 4)" in lines
    assert "throughput     12,346 tokens/s" in lines
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "  loss curve   loss.png (loss and learning rate per logged step)" in lines
    assert "resume         python train.py" in lines and "train on to step N" in text


def test_a_launch_that_stopped_between_logged_steps_counts_its_last_step(tmp_path):
    run = _run_dir(tmp_path)
    text = sm.training_summary(run, {"step": 7, "loss": 3.9, "tokens_per_s": 1.0}, "cmd", 10, plot=False).render()
    assert "final 3.9000 (step 7), best 3.9000 (step 7)" in text
    assert "stopped, step 7 of 10" in text and "train on to step N" not in text  # unfinished: the command finishes it


def test_without_matplotlib_the_summary_says_so(tmp_path, monkeypatch):
    """The plots extra missing (its import made to fail): no loss.png, and a line naming the extra."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    run = _run_dir(tmp_path)
    text = sm.training_summary(run, {"step": 6, "loss": 4.5, "tokens_per_s": 1.0}, "cmd", 6).render()
    assert "  loss curve   not drawn: matplotlib is not installed (pip install 'cp_attention[plots]')" in text
    assert not (run / "loss.png").exists()


def test_resume_command_keeps_the_runs_overrides(monkeypatch, tmp_path):
    for key in ("RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    overrides = ["layout=interleaved", "hydra.run.dir=old", "trainer.resume_from=x", "data.path=a b.txt"]
    cmd = shlex.split(sm.resume_command("scripts/train.py", overrides, tmp_path / "r"))
    assert cmd == ["python", "scripts/train.py", "layout=interleaved", "data.path=a b.txt",
                   f"hydra.run.dir={tmp_path / 'r'}", "trainer.resume_from=auto"]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert sm.resume_command("t.py", [], "r").startswith("torchrun --nnodes=2 --nproc-per-node=4 t.py ")


def test_outputs_and_examples_summaries(tmp_path):
    out = tmp_path / "rows.json"
    assert "printed above (stdout) only; --json" in sm.outputs_summary("b.py", {"rows": None}, "--json").render()
    out.write_text("{}")
    assert f"rows  {out}" in sm.outputs_summary("b.py", {"rows": out}).render().splitlines()
    text = sm.example_summary("ex.py", [5.0, 3.0, 4.0], 1500.0).render()
    assert "best 3.0000 (step 2)" in text and "final 4.0000 (step 3)" in text and "writes no files" in text
    (tmp_path / "a.png").write_bytes(b"")
    (tmp_path / "report.md").write_text("")
    text = sm.directory_summary("c.py", tmp_path, {"report": "report.md", "missing": "nope.md"},
                                {"pictures": "*.png"}).render()
    assert "  report       report.md" in text and "nope" not in text and "1 x *.png (a.png)" in text


_SPAWN_A_LOCK = """
import torch.multiprocessing as mp
from cp_attention.launch import exit_without_finalising

def rank(i):
    import multiprocessing
    lock = multiprocessing.RLock()  # a named semaphore, as tqdm's progress bar makes one
    exit_without_finalising(0)

if __name__ == "__main__":
    mp.spawn(rank, nprocs=1, join=True)
"""


@pytest.mark.dist
def test_a_spawned_rank_leaves_no_semaphore_behind(tmp_path):
    """exit_without_finalising (os._exit) still runs multiprocessing's finalizers: the parent's resource
    tracker has no leaked semaphore to warn about at shutdown."""
    script = tmp_path / "spawn_a_lock.py"
    script.write_text(_SPAWN_A_LOCK)
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "leaked" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr[-2000:]


def test_matplotlib_may_build_its_font_cache_under_the_process_guard():
    """On a fresh machine (a new HOME or MPLCONFIGDIR) matplotlib's first figure runs ``fc-list`` in a
    subprocess to build its font cache: a library's tool, which the suite's no-process guard
    (tests/conftest.py) lets through in a test not marked dist."""
    font_manager = pytest.importorskip("matplotlib.font_manager")
    fontconfig = getattr(font_manager, "_get_fontconfig_fonts", None)
    if fontconfig is None or not hasattr(fontconfig, "cache_clear"):
        pytest.skip("this matplotlib finds its fonts without the cached fc-list call")
    fontconfig.cache_clear()  # as in a new process: the call below runs fc-list again
    assert isinstance(font_manager.FontManager().ttflist, list)


@pytest.mark.dist
def test_the_summary_tests_pass_with_an_empty_matplotlib_cache(tmp_path):
    """The summary tests in a new process whose matplotlib has no font cache yet, as on a fresh machine."""
    pytest.importorskip("matplotlib")
    env = {**os.environ, "MPLCONFIGDIR": str(tmp_path / "mpl")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                           "-m", "not dist"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert (tmp_path / "mpl").is_dir(), "the run did not use the empty matplotlib cache"
