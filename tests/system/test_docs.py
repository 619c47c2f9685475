"""Every fenced code block in README.md and docs/**/*.md runs, so no snippet can silently rot.

- A fence must name its language: ``python``, ``bash`` or ``text`` (output, diagrams, anything that is
  not code). Any other fence, or none, fails :func:`test_every_fence_names_a_known_language`.
- ``python`` blocks run. A block that starts a process group (``init_process_group``) is a script for
  torchrun: it is written to a file and launched on 2 gloo ranks with
  ``python -m torch.distributed.run --nproc-per-node=2 --standalone``. Every other python block runs in
  ONE worker process (imports are paid once), each in a fresh namespace, in a scratch directory; a
  multi-rank one runs its ranks on the in-process loopback ring. When a ``text`` block follows a python
  block (nothing but blank lines between), it is the block's output: the printed text must equal it.
- ``bash`` blocks: every command line runs from the repository root, unless :data:`NOT_RUN` lists it
  (comment stripped, whitespace collapsed) with the reason it does not. A listed command that no
  document holds any more fails :func:`test_not_run_lists_only_commands_the_docs_hold`, and the files
  and the checkout's modules (``python -m studies.memory``) a listed command names must exist.

Every run has a timeout, and the process group of a timed-out run is killed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LANGUAGES = ("python", "bash", "text")

_INSTALLS = "installs packages (CI's .ci/run runs `make test`, which installs the same way)"
_TRAIN = "a training run of a minute or more on 2 cores (tests/system/test_train.py and test_resume.py run it small)"
_EXAMPLE = "a training run of a minute or more on 2 cores (tests/system/test_scripts.py runs it small)"
_TORCHRUN = "torchrun with several processes"
_BENCH = "a benchmark: minutes of measurement on every core (tests/system/test_scripts.py runs it small)"
_GPU = "needs CUDA"
# The command lines of the docs' bash blocks that the test does not run, and why.
NOT_RUN: dict[str, str] = {
    # README.md
    "pip install torch==2.13.0": _INSTALLS,
    "pip install -e .": _INSTALLS,
    'pip install -e ".[all]"': _INSTALLS,
    "torchrun --nproc-per-node=2 ring_demo.py":
        "the python block above it, which this test launches itself under torchrun",
    "make train": f"{_INSTALLS}, then {_TRAIN}",
    "make test": f"{_INSTALLS}, then runs the whole suite",
    "make test-fast": "the fast tier (no dist, slow or gpu mark) of the suite this test (dist) is part of",
    "make test-floor": f"{_INSTALLS} (every oldest supported version, torch a CUDA build of ~5 GB), then tests",
    "python -m pytest": "the whole test suite, this test included",
    # docs/guides/training.md (and README.md)
    "python scripts/train.py": _TRAIN,
    "python scripts/train.py layout=interleaved trainer.steps=400 trainer.seq_len=1024": _TRAIN,
    "python scripts/train.py -m layout=contiguous,zigzag,interleaved": f"three training runs; {_TRAIN}",
    "torchrun --nproc-per-node=4 scripts/train.py cp_size=2": f"{_TORCHRUN}; {_TRAIN}",
    "torchrun --max-restarts=3 --nproc-per-node=2 scripts/train.py hydra.run.dir=runs/a trainer.resume_from=auto":
        f"{_TORCHRUN}; {_TRAIN}",
    "torchrun --nproc-per-node=8 scripts/train.py cp_size=4 trainer.precision=bf16": _GPU,
    "python scripts/train.py trainer.fsdp=true cp_size=2 trainer.ckpt_every=2 trainer.steps=4 trainer.seq_len=64 "
    "hydra.run.dir=runs/fsdp": "tests/system/test_train_fsdp.py runs this save and the resharded resume below, smaller",
    "python scripts/train.py trainer.fsdp=true cp_size=1 trainer.micro_batch=2 trainer.steps=6 trainer.seq_len=64 "
    "hydra.run.dir=runs/fsdp trainer.resume_from=auto": "tests/system/test_train_fsdp.py runs it, smaller",
    "python examples/finetune_hf.py --world-size 1 --device cuda --precision bf16": _GPU,
    # docs/guides/huggingface.md, megatron.md
    "python examples/finetune_hf.py": _EXAMPLE,
    "python examples/finetune_trainer.py": f"{_TORCHRUN}; {_EXAMPLE}",
    "python examples/finetune_trainer.py --sft": f"{_TORCHRUN}; {_EXAMPLE}",
    "torchrun --nproc-per-node=2 examples/finetune_hf.py": f"{_TORCHRUN}; {_EXAMPLE}",
    "python examples/pretrain_megatron.py": _EXAMPLE,
    "python examples/pretrain_megatron.py --world-size 4 --tp-size 2 --layout interleaved": _EXAMPLE,
    "torchrun --nproc-per-node=2 examples/pretrain_megatron.py": f"{_TORCHRUN}; {_EXAMPLE}",
    # docs/guides/memory.md (and training.md, trainer.md)
    "python scripts/train.py trainer.activation_checkpointing=offload trainer.mlp_chunks=4": _TRAIN,
    "python scripts/train.py trainer.fsdp=true trainer.offload_optimizer=true": _TRAIN,
    "python examples/finetune_trainer.py --activation-checkpointing offload --mlp-chunks 4": f"{_TORCHRUN}; {_EXAMPLE}",
    # docs/guides/layouts.md
    "python -m studies.layout_comparison": "the full layout comparison: minutes on 2 cores",
    "python -m studies.layout_comparison experiment=smoke measure.world_sizes=[1,2,4] out_dir=results/layouts":
        "the comparison's smoke run at 3 world sizes, ~30 s (tests/system/test_compare_layouts.py runs it at one)",
    "python -m studies.layout_comparison plugins=[my_module] layouts=[zigzag,reversed_zigzag]":
        "my_module stands for the reader's module (tests/unit/layouts/test_custom_layout.py runs it with "
        "tests.support.core.custom_layouts)",
    # docs/README.md
    "python benchmarks/attention.py": _BENCH,
    # docs/benchmarks/2026-11-25-strategies.md, docs/benchmarks/2026-11-25-generate.md
    "python benchmarks/strategies.py --json strategies.json":
        "a benchmark: minutes on every core (tests/system/test_compare_layouts.py measures the strategies small)",
    "python benchmarks/generate.py --json generate.json":
        "a benchmark: minutes on every core (tests/adapters/hf/test_generate.py runs its measurement small)",
    "python benchmarks/attention.py --device cuda": _GPU,
    "python benchmarks/packed.py": _BENCH,
    "python benchmarks/window.py --quick": "a smoke run of ~6 s on 2 cores (tests/system/test_scripts.py runs it)",
    "python benchmarks/megatron.py": _BENCH,
    "python benchmarks/stress.py --runs 100": "about an hour of repeated runs",
    # docs/benchmarks/2026-11-25-plan-build.md
    "python benchmarks/plan_build.py --threads 1 --repeats 7":
        "a benchmark: about two minutes on one core (tests/unit/engine/test_plan_ahead.py and "
        "tests/unit/schedules/test_step_tables.py test what it times)",
}

PYTHON_TIMEOUT_S = 300  # the worker, all in-process blocks together
TORCHRUN_TIMEOUT_S = 240
BASH_TIMEOUT_S = 120
_GRACE_S = 40  # after a timeout's SIGTERM, before SIGKILL


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the block's first code line
    lang: str
    code: str
    output: str | None = None  # the text block that follows a python block

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


_FENCE = re.compile(r"^(`{3,}|~{3,})(.*)$")


def fences(path: Path) -> list[tuple[int, str, str]]:
    """``(first code line, info string, code)`` of every fenced block of a markdown file."""
    found, lines, i = [], path.read_text(encoding="utf-8").splitlines(), 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        marker, info = m.group(1), m.group(2).strip()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(marker)
                    and not lines[j].strip().strip(marker[0])), None)
        if end is None:
            raise AssertionError(f"{path.relative_to(ROOT)}:{i + 1}: a fence that is never closed")
        found.append((i + 2, info, "\n".join(lines[i + 1:end]) + "\n"))
        i = end + 1
    return found


def blocks(path: Path) -> list[Block]:
    raw = fences(path)
    text = path.read_text(encoding="utf-8").splitlines()
    out = []
    for n, (line, info, code) in enumerate(raw):
        lang = info.split()[0] if info else ""
        output = None
        if lang == "python" and n + 1 < len(raw) and raw[n + 1][1].split()[:1] == ["text"]:
            closing = line + code.count("\n")  # the line of this block's closing fence (1-based)
            between = text[closing:raw[n + 1][0] - 2]
            if all(not s.strip() for s in between):
                output = raw[n + 1][2]
        out.append(Block(path, line, lang, code, output))
    return out


ALL = [b for p in DOCS for b in blocks(p)]
TORCHRUN = [b for b in ALL if b.lang == "python" and "init_process_group" in b.code]
IN_PROCESS = [b for b in ALL if b.lang == "python" and b not in TORCHRUN]
BASH = [b for b in ALL if b.lang == "bash"]


def commands(code: str) -> list[str]:
    """A bash block's command lines, comments stripped and whitespace collapsed (continuations joined)."""
    joined = re.sub(r"\\\n", " ", code)
    cmds = []
    for line in joined.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        if line:
            cmds.append(" ".join(line.split()))
    return cmds


def _run(cmd: list[str], timeout: float, cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    """``cmd`` in its own process group; on timeout the group gets SIGTERM (torchrun stops its workers),
    then SIGKILL if it is still there after a grace period."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **kwargs.pop("env", {})}
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True, **kwargs)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # SIGTERM first: torchrun then stops its workers, which run in sessions of their own.
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        out += f"\n[timed out after {timeout} s]"
        return subprocess.CompletedProcess(cmd, -signal.SIGKILL, out, None)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


def _padded(block: Block) -> str:
    """The block's code shifted down to its own line numbers, so tracebacks point into the markdown."""
    return "\n" * (block.line - 1) + block.code


# ---------------------------------------------------------------------------------------------- structure


def test_the_docs_hold_code_blocks():
    assert len(DOCS) >= 8 and IN_PROCESS and TORCHRUN and BASH


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_every_fence_names_a_known_language(path):
    bad = [f"{b.id} ```{b.lang}" for b in blocks(path) if b.lang not in LANGUAGES]
    assert not bad, f"fences must be ```python, ```bash or ```text (output, not code): {bad}"
    indented = [n for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
                if re.match(r"\s+(```|~~~)", line)]
    assert not indented, f"indented fences (this test would not see them) at lines {indented}"


def test_the_readme_is_a_first_screen():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 150


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# The project's shared folder lies outside the repository (spelled so that this file does not match itself).
_OUTSIDE = re.compile(r"\.\./share[d]|share[d]/DESIGN")


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_links_stay_inside_the_repository_and_resolve(path):
    text = path.read_text(encoding="utf-8")
    assert not _OUTSIDE.search(text), "points outside the repository (the project's shared folder)"
    prose = text
    for _, _, code in fences(path):
        prose = prose.replace(code, "")
    prose = re.sub(r"`[^`\n]*`", "", prose)  # inline code is not a link
    broken = []
    for target in _LINK.findall(prose):
        if re.match(r"[a-z]+:", target):
            continue
        name, _, anchor = target.partition("#")
        file = (path.parent / name).resolve() if name else path
        if not file.is_relative_to(ROOT) or not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(target)
    assert not broken, f"links that leave the repository, name no file or no heading: {broken}"


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings (lower case, punctuation dropped, spaces to dashes)."""
    text = path.read_text(encoding="utf-8")
    for _, _, code in fences(path):
        text = text.replace(code, "")
    heads = re.findall(r"^#+\s+(.*?)\s*$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def test_not_run_lists_only_commands_the_docs_hold():
    held = {c for b in BASH for c in commands(b.code)}
    stale = sorted(set(NOT_RUN) - held)
    assert not stale, f"NOT_RUN lists commands no document holds any more: {stale}"


_CHECKOUT = ("scripts", "configs", "tests", "benchmarks", "studies", "examples")  # the folders a command may name


def named_files(cmd: str) -> list[str]:
    """The checkout's files ``cmd`` names, as paths from the root: a path under one of its folders, and a
    module run with ``-m`` from one of them (``-m studies.memory``: ``studies/memory.py`` or its package's
    ``__main__.py``)."""
    words, found = shlex.split(cmd), []
    for before, word in zip(["", *words], words):
        if before == "-m" and word.split(".")[0] in _CHECKOUT:
            path = word.replace(".", "/")
            found.append(f"{path}/__main__.py" if (ROOT / path).is_dir() else f"{path}.py")
        elif re.fullmatch(rf"({'|'.join(_CHECKOUT)})/\S+", word):
            found.append(word)
    return found


def test_named_files_reads_paths_and_modules():
    assert named_files("python benchmarks/attention.py --json x.json") == ["benchmarks/attention.py"]
    assert named_files("python -m studies.layout_comparison.balance --seeds 2") == [
        "studies/layout_comparison/balance.py"]
    assert named_files("python -m studies.memory --quick") == ["studies/memory/__main__.py"]
    assert named_files("python -m studies.no_such_study") == ["studies/no_such_study.py"]
    assert named_files("python -m pytest tests") == []


@pytest.mark.parametrize("cmd", sorted(NOT_RUN))
def test_not_run_commands_name_files_that_exist(cmd):
    missing = [f for f in named_files(cmd) if not (ROOT / f).exists()]
    assert not missing, f"{cmd!r} names files that do not exist: {missing}"


# ---------------------------------------------------------------------------------------------- python

_WORKER = r'''
import contextlib, io, json, os, signal, sys, traceback, warnings
warnings.filterwarnings("ignore")
blocks, out_path, timeout = json.load(open(sys.argv[1])), sys.argv[2], int(sys.argv[3])

def on_alarm(signum, frame):
    raise TimeoutError(f"block ran longer than {timeout} s")

signal.signal(signal.SIGALRM, on_alarm)
results = {}
for b in blocks:
    os.makedirs(b["dir"], exist_ok=True)
    os.chdir(b["dir"])
    printed = io.StringIO()
    signal.alarm(timeout)
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(b["code"], b["file"], "exec"), {"__name__": "__main__"})
        error = None
    except BaseException:
        error = traceback.format_exc()
    finally:
        signal.alarm(0)
    results[b["id"]] = {"error": error, "stdout": printed.getvalue()}
    with open(out_path, "w") as f:  # after every block, so a crash still reports the earlier ones
        json.dump(results, f)
sys.stdout.flush()
os._exit(0)  # a block's stuck loopback thread must not keep the worker alive
'''


@pytest.fixture(scope="module")
def python_results(tmp_path_factory) -> dict:
    """Run every in-process python block in one worker; ``{block id: {"error", "stdout"}}``."""
    tmp = tmp_path_factory.mktemp("docs_python")
    spec = [{"id": b.id, "file": str(b.path), "code": _padded(b), "dir": str(tmp / f"block{i}")}
            for i, b in enumerate(IN_PROCESS)]
    (tmp / "blocks.json").write_text(json.dumps(spec))
    out = tmp / "results.json"
    proc = _run([sys.executable, "-c", _WORKER, str(tmp / "blocks.json"), str(out), str(PYTHON_TIMEOUT_S // 2)],
                PYTHON_TIMEOUT_S, tmp)
    results = json.loads(out.read_text()) if out.exists() else {}
    for b in IN_PROCESS:
        results.setdefault(b.id, {"error": f"the worker ended before this block (exit {proc.returncode}):\n"
                                           f"{proc.stdout[-4000:]}", "stdout": ""})
    return results


@pytest.mark.parametrize("block", IN_PROCESS, ids=[b.id for b in IN_PROCESS])
def test_python_block(block, python_results):
    result = python_results[block.id]
    assert result["error"] is None, f"{block.id} raised:\n{result['error']}"
    if block.output is not None:
        assert result["stdout"] == block.output, (
            f"{block.id} printed\n{result['stdout']}\nbut the text block after it says\n{block.output}")


@pytest.mark.slow
@pytest.mark.parametrize("block", TORCHRUN, ids=[b.id for b in TORCHRUN])
def test_torchrun_block(block, tmp_path):
    script = tmp_path / (block.path.name + ".py")
    script.write_text(_padded(block))
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone", str(script)],
                TORCHRUN_TIMEOUT_S, tmp_path)
    assert proc.returncode == 0, f"{block.id} under torchrun (2 ranks) exited {proc.returncode}:\n{proc.stdout[-6000:]}"


# ---------------------------------------------------------------------------------------------- bash


@pytest.mark.parametrize("block", BASH, ids=[b.id for b in BASH])
def test_bash_block(block):
    cmds = commands(block.code)
    assert cmds, f"{block.id}: an empty bash block"
    run = [c for c in cmds if c not in NOT_RUN]
    for cmd in run:
        proc = _run(["bash", "-c", cmd], BASH_TIMEOUT_S, ROOT)
        assert proc.returncode == 0, (f"{block.id}: `{cmd}` exited {proc.returncode} (a command too long or "
                                      f"impossible to run here belongs in NOT_RUN, with the reason):\n"
                                      f"{proc.stdout[-4000:]}")
    if not run:
        pytest.skip("not run: " + "; ".join(f"`{c}`: {NOT_RUN[c]}" for c in cmds))
