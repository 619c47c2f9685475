"""The package's levels point one way (core <- integrations <- training <- scripts, and
core <- integrations <- compat; benchmarks/, studies/ and
examples/ sit outside the package, and nothing in it imports them),
scripts are thin entry points, and the optional rooms name their extra when it is missing."""

from __future__ import annotations

import ast
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.core.import_graph import imported_names

ROOT = Path(__file__).resolve().parents[3]
CORE = "core"
# Level -> the rooms above it it must not import, written once (cp_attention/rooms.py, read by path).
FORBIDDEN_ABOVE = runpy.run_path(str(ROOT / "cp_attention" / "rooms.py"))["FORBIDDEN_ABOVE"]


def _level(path: Path) -> str:
    rel = path.relative_to(ROOT).parts
    if rel[0] == "integrations":
        return "integrations"
    return rel[1] if rel[1] in ("training", "compat") else CORE


def _package(path: Path) -> str:
    parts = path.relative_to(ROOT).parent.parts
    if parts[0] == "integrations":
        return ".".join(("cp_attention", *parts))  # installed as cp_attention.integrations
    return ".".join(parts)


def _imported_rooms(source: str, package: str) -> set[str]:
    """The optional cp_attention rooms (and the checkout's folders) a module of ``package`` imports,
    absolutely or relatively."""
    found = set()
    for name in imported_names(source, package):
        parts = name.split(".")
        if parts[0] == "cp_attention" and len(parts) > 1 and parts[1] in ("integrations", "training", "compat"):
            found.add(parts[1])
        elif parts[0] in ("benchmarks", "studies", "examples"):  # the checkout's folders, never installed
            found.add(parts[0])
    return found


MODULES = sorted([*(ROOT / "cp_attention").rglob("*.py"), *(ROOT / "integrations").rglob("*.py")])


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(ROOT)) for p in MODULES])
def test_dependencies_point_down(path):
    level = _level(path)
    wrong = _imported_rooms(path.read_text(), _package(path)) & FORBIDDEN_ABOVE[level]
    assert not wrong, f"{path.relative_to(ROOT)} ({level}) imports {sorted(wrong)}"


def test_the_checker_sees_relative_and_absolute_imports():
    """The checker itself: it must find upward imports, or the test above could not fail."""
    assert _imported_rooms("from .training import steps\nimport benchmarks.measure\nfrom examples import finetune_hf\n"
                           "from studies.memory import peak\n", "cp_attention") == {"training", "benchmarks", "studies",
                                                                                    "examples"}
    assert _imported_rooms("from ..training.steps import train_step\n", "cp_attention.kernels") == {"training"}
    assert _imported_rooms("from . import huggingface\n", "cp_attention.integrations") == {"integrations"}
    assert _imported_rooms("from ...training import steps\n", "cp_attention.integrations.megatron") == {"training"}
    assert _package(ROOT / "integrations" / "huggingface" / "fsdp.py") == "cp_attention.integrations.huggingface"
    assert _imported_rooms("from ..layouts import get_layout\nimport torch\n", "cp_attention.training") == set()


SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_scripts_are_thin_entry_points(path):
    source = path.read_text()
    assert "sys.path" not in source, f"{path.name} touches sys.path"
    tree = ast.parse(source)
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    siblings = {p.stem for p in SCRIPTS}
    assert not imported & siblings, f"{path.name} imports another script: {imported & siblings}"
    assert len(source.splitlines()) <= 60, f"{path.name} holds more than an entry point"


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.dist
def test_the_core_needs_only_torch():
    """Importing the core adds none of the optional packages to what torch itself imports (torch may load tqdm)."""
    proc = _python("import sys, torch, torch.distributed\nbefore = set(sys.modules)\n"
                   "import cp_attention, cp_attention.launch\n"
                   "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
                   "bad = new & {'hydra', 'omegaconf', 'tqdm', 'transformers', 'megatron', 'matplotlib'}\n"
                   "assert not bad, bad")
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("module,blocked,extra", [
    ("cp_attention.training.loop", "hydra", "train"),
    ("cp_attention.integrations.huggingface.attention", "transformers", "hf"),
    ("cp_attention.integrations.megatron", "megatron.core", "megatron"),
])
@pytest.mark.dist
def test_a_missing_extra_is_named(module, blocked, extra):
    """Without the extra's packages (blocked here by a None entry in sys.modules) the import says what to install."""
    proc = _python(f"import sys\nsys.modules[{blocked!r}] = None\n"
                   f"import importlib\nm = importlib.import_module({module!r})\n"
                   f"getattr(m, '_transformers', lambda: None)()")
    assert proc.returncode != 0
    assert f"install the '{extra}' extra: pip install 'cp_attention[{extra}]'" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.dist
def test_reduce_gradients_needs_no_hydra():
    """The README's HuggingFace example: ``reduce_gradients`` (and the rest of ``cp_attention.training``'s
    exports) import with torch alone, the train extra's packages blocked."""
    proc = _python("import sys\nfor m in ('hydra', 'omegaconf'):\n    sys.modules[m] = None\n"
                   "from cp_attention.training import reduce_gradients, train_step\n"
                   "from cp_attention.integrations import huggingface\n"
                   "assert callable(reduce_gradients) and callable(huggingface.apply_context_parallel)")
    assert proc.returncode == 0, proc.stderr[-2000:]
