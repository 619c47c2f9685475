"""Run the spawned examples and the distributed tests many times and count the runs that aborted.

An abort is a run killed by SIGABRT (exit code -6 or 134), or one whose output holds
"terminate called" (a C++ exception escaping gloo's threads at exit), whatever its exit code. Other
failures are counted apart. Nothing is downloaded; every run has a timeout. A pytest target runs
with ``CP_ATTENTION_POOL_STDERR`` set to a file that is read back with its output, so what the
test worker pools write as they exit is seen too (pytest's capture would swallow it).

    python benchmarks/stress.py --runs 100                  # the cheap set (DEFAULT_TARGETS): ~1 hour
    python benchmarks/stress.py --runs 20 --targets ring    # one target
    python benchmarks/stress.py --runs 5 --targets finetune_hf ring --json out.json   # counts also as JSON

Targets, and the seconds one run of each took on the 2-core CPU machine this was written on (other
jobs were running; the times vary by a third either way):

- ``finetune_hf`` (~7 s), ``pretrain_megatron`` (~13 s): the spawned examples, 2 gloo ranks each.
- ``dist`` (~16 s): a cross-section of the distributed tests in one pytest process, chosen to start
  and end a worker pool of world size 2, 3 and 4 with live subgroups in it, and to fail cases on
  purpose: packed documents with sinks and their refusals (tests/distributed/test_packed.py, N = 2, 3),
  gradients reduced over cp x dp subgroups (tests/distributed/test_launch.py, N = 4), and ring failure
  containment (tests/distributed/test_faults.py, N = 2-4). With the two examples this is the set that keeps
  100 runs near an hour (~36 s a run).
- ``dist_adapters`` (~30 s): the adapters inside pool workers: HuggingFace optimizer steps (N = 2)
  and Megatron packed THD batches (N = 2, 3). Dearer because every worker imports transformers
  and megatron-core; the examples exercise both adapters on every run of the cheap set.
- ``ring`` (~30 s): every case of tests/distributed/test_ring.py, test_faults.py and test_validation.py.
- ``pools`` (~35 s): tests/distributed/test_stress.py, the pools' own exit paths (closed, timed out, a worker
  dead, the parent dead), each asserting exit code 0 and no "terminate called".
- ``user_snippet``, ``user_snippet_no_destroy`` (~12 s): the README's HuggingFace snippet as a user
  runs it, ``torchrun --nproc-per-node=2`` on gloo, ending with and without ``destroy_process_group``:
  a user's script has no ``os._exit`` to protect it, so only the library's own clean exits count.
- ``compare_smoke`` (~26 s): ``python -m studies.layout_comparison experiment=smoke packed=smoke``, whose
  four benchmarks spawn ranks that run torch's own CP ring (it keeps groups registered past their
  destroy) and many distinct ``ring_attention`` signatures; CI caught an abort here once.

Whole files cost far more, mostly in pool starts and in the adapters' imports in every worker
(tests/distributed/test_packed.py ~50 s, tests/adapters/hf/test_equivalence.py ~115 s, tests/adapters/megatron/test_equivalence.py ~65 s).

The commands run from the repository root (``root``), where examples/, benchmarks/, studies/ and tests/ live.
"""  # noqa: E501 - printed verbatim by --help (RawDescriptionHelpFormatter)

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a script: this folder's files never shadow top-level packages
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks import args as flags  # noqa: E402  (the standard library only, like this module)

__all__ = ["TARGETS", "DEFAULT_TARGETS", "POOL_STDERR_ENV", "classify", "parse_args", "run_once", "main"]

_PYTEST = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
TARGETS = {
    "finetune_hf": [sys.executable, "examples/finetune_hf.py", "--steps", "3", "--seq-len", "64", "--batch", "2"],
    "pretrain_megatron": [sys.executable, "examples/pretrain_megatron.py", "--steps", "3", "--seq-len", "64",
                          "--batch", "2"],
    "dist": [*_PYTEST,
             "tests/distributed/test_packed.py::test_long_and_short_documents_with_sinks_and_lse_gradient",
             "tests/distributed/test_packed.py::test_bad_packed_calls_raise_on_every_rank",
             "tests/distributed/test_launch.py::test_reduce_gradients_sums_over_cp_and_averages_over_dp",
             "tests/distributed/test_faults.py"],
    "dist_adapters": [*_PYTEST,
                      "tests/adapters/hf/test_equivalence.py::test_optimizer_steps_stay_together[zigzag]",
                      *(f"tests/adapters/megatron/test_equivalence.py::test_packed_thd_batch_matches_each_document_alone"
                        f"[cp{n}-zigzag]" for n in (2, 3))],
    "ring": [*_PYTEST, "tests/distributed/test_ring.py", "tests/distributed/test_faults.py",
             "tests/distributed/test_validation.py"],
    # the layout comparison's smoke run: four benchmarks' spawned ranks, torch's own CP ring among them
    "compare_smoke": [sys.executable, "-m", "studies.layout_comparison", "experiment=smoke", "packed=smoke",
                      f"out_dir={os.path.join(tempfile.gettempdir(), 'cp_attention_stress_compare')}"],
    "pools": [*_PYTEST, "tests/distributed/test_stress.py"],
    # a user's script under torchrun: the README's HuggingFace block, written out by _snippet_file
    "user_snippet": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                     "{snippet:destroy}"],
    "user_snippet_no_destroy": [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                "--nproc-per-node=2", "{snippet:keep}"],
}
_SNIPPET_MARK = "huggingface as cphf"  # the README block to run
_DESTROY = "dist.destroy_process_group()\n"
DEFAULT_TARGETS = ("finetune_hf", "pretrain_megatron", "dist")  # 100 runs: about an hour on 2 cores
POOL_STDERR_ENV = "CP_ATTENTION_POOL_STDERR"  # tests/conftest.py imports it


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=100, help="runs per target")
    p.add_argument("--targets", nargs="+", default=list(DEFAULT_TARGETS), choices=list(TARGETS),
                   help=f"default: {' '.join(DEFAULT_TARGETS)}")
    flags.add_run(p, timeout=900, json="the counts (after every run)")  # timeout: per run
    return p.parse_args(argv)


def classify(returncode: int, output: str) -> str:
    """'aborted', 'failed' or 'ok' for one run."""
    if returncode in (-6, 134) or "terminate called" in output:
        return "aborted"
    return "ok" if returncode == 0 else "failed"


def run_once(cmd: list[str], root: str | Path, timeout: float) -> tuple[str, int | None, str]:
    """Run ``cmd`` once from ``root``: (verdict, exit code, output). The verdict is
    :func:`classify`'s, or 'timeout' (exit code None). The output includes what the test worker
    pools wrote to stderr."""
    with tempfile.TemporaryDirectory() as tmp:
        pool_stderr = Path(tmp) / "pool_workers.stderr"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", POOL_STDERR_ENV: str(pool_stderr)}
        try:
            proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            return "timeout", None, _text(e.stdout) + _text(e.stderr) + _read(pool_stderr)
        output = proc.stdout + proc.stderr + _read(pool_stderr)
        return classify(proc.returncode, output), proc.returncode, output


def _snippet_file(root: str | Path, variant: str, directory: str | Path) -> str:
    """The README's HuggingFace block written to ``directory``, ending with ``destroy_process_group()``
    (``variant`` 'destroy') or without it ('keep'). Raises ``ValueError`` if the README has no such block."""
    text = (Path(root) / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    block = next((b for b in blocks if _SNIPPET_MARK in b), None)
    if block is None or _DESTROY not in block:
        raise ValueError(f"README.md has no python block with {_SNIPPET_MARK!r} ending in destroy_process_group()")
    path = Path(directory) / f"user_snippet_{variant}.py"
    path.write_text(block if variant == "destroy" else block.replace(_DESTROY, ""))
    return str(path)


def _command(target: str, root: str | Path, directory: str | Path) -> list[str]:
    """The target's command, a snippet placeholder replaced by its file."""
    return [_snippet_file(root, arg[9:-1], directory) if arg.startswith("{snippet:") else arg
            for arg in TARGETS[target]]


def _text(data: str | bytes | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def main(argv: list[str] | None = None, root: str | Path = ".") -> int:
    """Run every target ``--runs`` times from ``root``; print each non-ok run and the running counts.
    Returns 1 if any run aborted, failed or timed out, else 0."""
    args = parse_args(argv)
    counts = {t: {"ok": 0, "aborted": 0, "failed": 0, "timeout": 0, "seconds": 0.0} for t in args.targets}
    t_start = time.perf_counter()
    snippets = tempfile.mkdtemp(prefix="cp_attention_stress_")
    commands = {t: _command(t, root, snippets) for t in args.targets}
    for i in range(args.runs):
        for target in args.targets:
            t0 = time.perf_counter()
            verdict, code, output = run_once(commands[target], root, args.timeout)
            if verdict == "timeout":
                print(f"  run {i + 1} {target}: timed out after {args.timeout} s", flush=True)
            elif verdict != "ok":
                tail = output.strip().splitlines()[-5:]
                print(f"  run {i + 1} {target}: {verdict} (exit {code}): " + " | ".join(tail), flush=True)
            counts[target][verdict] += 1
            counts[target]["seconds"] += time.perf_counter() - t0
        done = ", ".join(f"{t}: {c['ok']} ok / {c['aborted']} aborted / {c['failed'] + c['timeout']} failed"
                         for t, c in counts.items())
        print(f"run {i + 1}/{args.runs} ({time.perf_counter() - t_start:.0f} s): {done}", flush=True)
        if args.json:  # after every run, so an interrupted stress keeps its counts
            Path(args.json).write_text(json.dumps(counts, indent=2))
    return 1 if any(c["aborted"] or c["failed"] or c["timeout"] for c in counts.values()) else 0


if __name__ == "__main__":
    sys.exit(main(root=Path(__file__).resolve().parents[1]))
