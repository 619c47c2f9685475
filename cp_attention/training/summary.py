"""What a finished job prints last: where its results are, the loss it reached, its speed, and how to
go on (the training launcher, the example scripts, the benchmarks and the layout comparison all end
with one :class:`Summary`).

The training launcher's run directory also gets ``loss.png`` (loss and learning rate per logged step)
when matplotlib (the ``plots`` extra) is installed; without it the summary says so instead.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

__all__ = ["Summary", "shown", "read_metrics", "loss_rows", "plot_loss", "resume_command", "training_summary",
           "example_summary", "directory_summary", "outputs_summary", "benchmark_summary"]

_PLOTS_MISSING = "not drawn: matplotlib is not installed (pip install 'cp_attention[plots]')"


@dataclass
class Summary:
    """A title line, then ``key  value`` rows with the keys aligned (a key starting with two spaces is
    a file inside the run directory)."""

    title: str
    rows: list[tuple[str, str]] = field(default_factory=list)

    def add(self, key: str, value: str) -> Summary:
        """Append a row (``value`` may hold several lines, aligned under the first); returns self."""
        self.rows.append((key, value))
        return self

    def render(self) -> str:
        """The summary as printed."""
        width = max((len(k) for k, _ in self.rows), default=0)
        lines = [f"== {self.title} =="]
        for key, value in self.rows:
            first, *rest = value.splitlines() or [""]
            lines.append(f"{key.ljust(width)}  {first}".rstrip())
            lines += [f"{'':{width}}  {more}" for more in rest]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()


def shown(path: str | Path) -> str:
    """``path`` relative to the working directory when it lies under it (what a user types), else absolute."""
    path = Path(path).resolve()
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` (a half-written last line is skipped); ``[]`` if there is none."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            pass
    return records


def loss_rows(records: Sequence[dict], tokens_per_s: float | None) -> list[tuple[str, str]]:
    """The ``loss`` (final and best, with their steps) and ``throughput`` rows for ``records`` (dicts
    with ``step`` and ``loss``, in step order)."""
    rows = []
    if records:
        final, best = records[-1], min(records, key=lambda r: r["loss"])
        rows.append(("loss", f"final {final['loss']:.4f} (step {final['step']}), "
                             f"best {best['loss']:.4f} (step {best['step']})"))
    if tokens_per_s:
        rows.append(("throughput", f"{tokens_per_s:,.0f} tokens/s"))
    return rows


def plot_loss(records: Sequence[dict], path: str | Path) -> str | None:
    """Draw the loss (left axis) and the learning rate (right axis) of ``records`` per step into the PNG
    ``path``; returns None when written, or why not (matplotlib missing, nothing logged)."""
    if not records:
        return "not drawn: no step was logged"
    try:
        from matplotlib.figure import Figure  # a bare Figure: no pyplot state, no display backend
    except ImportError:
        return _PLOTS_MISSING
    steps = [r["step"] for r in records]
    fig = Figure(figsize=(6.4, 3.6))
    ax = fig.add_subplot()
    ax.plot(steps, [r["loss"] for r in records], color="C0", label="loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss", color="C0")
    ax.grid(alpha=0.3)
    if any("lr" in r for r in records):
        lr_ax = ax.twinx()
        lr_ax.plot(steps, [r.get("lr", float("nan")) for r in records], color="C1", ls="--", label="learning rate")
        lr_ax.set_ylabel("learning rate", color="C1")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


def resume_command(script: str, overrides: Iterable[str], run_dir: str | Path) -> str:
    """The command that continues the run in ``run_dir``: ``script`` with the run's own Hydra
    ``overrides`` (a resume must keep what a step computes), its directory and
    ``trainer.resume_from=auto``; under torchrun, prefixed with torchrun's ``--nproc-per-node``."""
    dropped = ("hydra.run.dir", "trainer.resume_from", "hydra.output_subdir", "hydra/job_logging",
               "hydra/hydra_logging")
    kept = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in dropped]
    args = [script, *kept, f"hydra.run.dir={shown(run_dir)}", "trainer.resume_from=auto"]
    if "RANK" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
        nodes = int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"])
        launcher = ["torchrun", *([f"--nnodes={nodes}"] if nodes > 1 else []),
                    f"--nproc-per-node={os.environ['LOCAL_WORLD_SIZE']}"]
    else:
        launcher = ["python"]
    return shlex.join(launcher + args)


def _checkpoint_row(ckpt_dir: Path) -> str | None:
    latest = ckpt_dir / "latest"
    if not latest.is_file():
        return None
    name = latest.read_text().strip()
    kept = len([p for p in ckpt_dir.glob("step_*") if p.suffix in (".pt", "")])
    return f"checkpoints/{name} (the latest of {kept})"


def training_summary(run_dir: str | Path, final: dict | None, command: str, total_steps: int, *,
                     setup: str = "", plot: bool = True) -> Summary:
    """The launcher's summary of the run in ``run_dir``: its files (``loss.png`` drawn now unless
    ``plot`` is False), the final and best loss, tokens/s of this launch (``final``: the loop's last
    metrics, None or empty when no step ran), and ``command`` to resume it (to ``total_steps``, the
    configured ``trainer.steps``). ``setup`` (layout, mesh, device) goes in the title."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir / "metrics.jsonl")
    if final and (not records or records[-1]["step"] < final["step"]):
        records.append(final)  # a launch that stopped between two logged steps
    done = records[-1]["step"] if records else 0
    state = "done" if done >= total_steps else "stopped"  # stopped: trainer.stop_after, resumable
    summary = Summary(f"train.py: {state}, step {done} of {total_steps}" + (f" ({setup})" if setup else ""))
    summary.add("run directory", shown(run_dir) + os.sep)
    if (run_dir / "metrics.jsonl").is_file():
        logged = len(read_metrics(run_dir / "metrics.jsonl"))
        summary.add("  metrics", f"metrics.jsonl ({logged} step{'' if logged == 1 else 's'} logged)")
    ckpt = _checkpoint_row(run_dir / "checkpoints")
    if ckpt:
        summary.add("  checkpoint", ckpt)
    if (run_dir / "config.yaml").is_file():
        summary.add("  config", "config.yaml (resolved)" + (", Hydra's own in .hydra/" if (run_dir / ".hydra").is_dir()
                                                              else ""))
    if plot:
        why_not = plot_loss(records, run_dir / "loss.png")
        summary.add("  loss curve", "loss.png (loss and learning rate per logged step)" if why_not is None else why_not)
    log = run_dir / "train.log"
    if log.is_file() and log.stat().st_size:
        summary.add("  log", "train.log")
    for key, value in loss_rows(records, (final or {}).get("tokens_per_s")):
        summary.add(key, value)
    if not final:
        summary.add("note", f"no step ran in this launch (the run was at step {done} already)")
    summary.add("resume", command + ("\n(the run is finished: add trainer.steps=N to train on to step N)"
                                     if done >= total_steps else ""))
    return summary


def example_summary(script: str, losses: Sequence[float], tokens_per_s: float | None,
                    written: str | None = None, steps: Sequence[int] | None = None) -> Summary:
    """An example script's summary: its final and best loss (``losses``: one per step, step 1 first, or
    one per ``steps``), tokens/s, and what it wrote (``written``; default: nothing, the log above is its
    only output)."""
    steps = list(steps) if steps is not None else list(range(1, len(losses) + 1))
    summary = Summary(f"{script}: done, {steps[-1] if steps else 0} steps")
    summary.add("output", written or "printed above (stdout) only: this example writes no files")
    for key, value in loss_rows([{"step": i, "loss": x} for i, x in zip(steps, losses)], tokens_per_s):
        summary.add(key, value)
    return summary


def directory_summary(script: str, directory: str | Path, files: dict[str, str],
                      patterns: dict[str, str]) -> Summary:
    """A job's summary of the folder it wrote: ``files`` (a label -> a file name in it) that exist,
    and how many files match each of ``patterns`` (a label -> a glob, e.g. ``"*.png"``)."""
    directory = Path(directory)
    summary = Summary(f"{script}: done").add("run directory", shown(directory) + os.sep)
    for label, name in files.items():
        if (directory / name).exists():
            summary.add(f"  {label}", name)
    for label, pattern in patterns.items():
        found = sorted(directory.glob(pattern))
        if found:
            summary.add(f"  {label}", f"{len(found)} x {pattern} ({', '.join(p.name for p in found[:3])}"
                                      + (", ..." if len(found) > 3 else "") + ")")
    return summary


def outputs_summary(script: str, outputs: dict[str, str | Path | None], hint: str = "") -> Summary:
    """A benchmark's or experiment's summary: each of ``outputs`` (a label -> the path written, None
    if not asked for) that exists, or that the results went to stdout only (``hint``: how to keep them)."""
    summary = Summary(f"{script}: done")
    written = [(label, Path(p)) for label, p in outputs.items() if p is not None and Path(p).exists()]
    for label, path in written:
        summary.add(label, shown(path) + (os.sep if path.is_dir() else ""))
    if not written:
        summary.add("output", "printed above (stdout) only" + (f"; {hint}" if hint else ""))
    return summary


def benchmark_summary(json_path: str | None, json_option: bool = True) -> Summary:
    """A benchmark script's summary (named after ``sys.argv[0]``): the JSON file it wrote
    (``json_path``, from ``--json``), or that its tables went to stdout only (and, with
    ``json_option``, that ``--json PATH`` keeps them)."""
    return outputs_summary(os.path.basename(sys.argv[0]), {"results (JSON)": json_path},
                           "--json PATH also writes them as JSON" if json_option else "")
