"""The rooms and the levels above the core, read from the source (pure AST, nothing imported):

- no import cycle anywhere in ``cp_attention/``, ``integrations/`` (installed as
  ``cp_attention.integrations``), ``benchmarks/``, ``studies/`` or ``examples/``, function-level imports included;
- the core's rooms import only the rooms below them: kernels, transport and memory < layouts < schedules <
  checks < engine < strategies < the API;
- each adapter (``cp_attention.integrations.huggingface``, ``.megatron``) imports only the core (the
  verdict both share is the core's ``cp_attention/checks/verdicts.py``) and its own sub-package: never
  the other adapter, never ``cp_attention.training``; its ``__init__`` only re-exports;
- every agreement lives in ``cp_attention/checks/``: nothing else calls the agreeing collective;
- ``cp_attention.training`` and ``cp_attention.compat`` import the adapters inside functions only (never
  at module level), so they import without the ``hf`` or ``megatron`` extra."""

from __future__ import annotations

import ast
import runpy
from pathlib import Path

import pytest

from tests.support.core.import_graph import imported_names

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "cp_attention"
ADAPTERS = ROOT / "integrations"  # installed as cp_attention.integrations (setup.py's package_dir)
INTEGRATIONS = "cp_attention.integrations"
ADAPTER_PACKAGES = (f"{INTEGRATIONS}.huggingface", f"{INTEGRATIONS}.megatron")
# The rooms and their levels, written once (cp_attention/rooms.py, read by path: nothing is imported).
_ROOMS = runpy.run_path(str(ROOT / "cp_attention" / "rooms.py"))
ROOMS, LEVELS, ABOVE_CORE = _ROOMS["CORE_ROOMS"], _ROOMS["LEVELS"], _ROOMS["ABOVE_CORE"]
CHECKOUT_ROOMS, PACKAGE_ROOMS = _ROOMS["CHECKOUT_ROOMS"], _ROOMS["PACKAGE_ROOMS"]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "integrations":
        parts.insert(0, "cp_attention")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _every_module() -> dict[str, Path]:
    """Every module of the package and its adapters, by installed name, and of the benchmarks, studies and examples."""
    checkout = [p for room in CHECKOUT_ROOMS for p in (ROOT / room).rglob("*.py")]
    return {_module_name(p): p for p in [*PACKAGE.rglob("*.py"), *ADAPTERS.rglob("*.py"), *checkout]}


def _modules() -> dict[str, Path]:
    """The core's modules."""
    return {name: path for name, path in _every_module().items() if not _outside_core(name)}


def _outside_core(module: str) -> bool:
    parts = module.split(".")
    return parts[0] in CHECKOUT_ROOMS or (len(parts) > 1 and parts[1] in ABOVE_CORE)


def _imports(name: str, source: str, is_package: bool, known: set[str]) -> set[str]:
    """The cp_attention modules ``name`` imports anywhere in its ``source`` (function bodies too); a
    name imported from a package counts as the package unless it is a submodule."""
    package = name if is_package else name.rpartition(".")[0]
    targets = {t if t in known else t.rpartition(".")[0] for t in imported_names(source, package)}
    return {t for t in targets if t in known and t != name}


def _graph(mods: dict[str, Path] | None = None) -> dict[str, set[str]]:
    mods = _modules() if mods is None else mods
    known = set(mods)
    return {name: _imports(name, path.read_text(), path.name == "__init__.py", known) for name, path in mods.items()}


def _adapter(module: str) -> str | None:
    return next((a for a in ADAPTER_PACKAGES if module == a or module.startswith(a + ".")), None)


def _adapter_may_import(module: str, dep: str) -> bool:
    """An adapter module may import the core and its own sub-package; the rest of integrations/ (its
    __init__) the core only."""
    own = _adapter(module)
    return not _outside_core(dep) or (own is not None and _adapter(dep) == own)


def _module_level_source(source: str) -> str:
    """The import statements of ``source`` that run when it is imported (not those inside functions)."""
    found: list[ast.stmt] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            visit(child)

    visit(ast.parse(source))
    return ast.unparse(ast.Module(body=found, type_ignores=[]))


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph``, or None (depth-first search with colours)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_no_import_cycles():
    """Anywhere in cp_attention/, integrations/, benchmarks/, studies/ and examples/: the core, the adapters,
    training, the benchmarks, the studies and the examples."""
    cycle = _cycle(_graph(_every_module()))
    assert cycle is None, " -> ".join(cycle)


def test_adapters_import_only_the_core_and_their_own_package():
    graph = _graph(_every_module())
    adapters = [m for m in graph if m == INTEGRATIONS or m.startswith(INTEGRATIONS + ".")]
    assert {_adapter(m) for m in adapters} >= set(ADAPTER_PACKAGES), "the adapters' sub-packages are missing"
    wrong = [(m, dep) for m in adapters for dep in sorted(graph[m]) if not _adapter_may_import(m, dep)]
    assert not wrong, wrong


@pytest.mark.parametrize("package", ADAPTER_PACKAGES)
def test_adapter_init_only_re_exports(package):
    """An adapter package's ``__init__``: its docstring, imports from its own modules and ``__all__``,
    which names exactly what it imports."""
    path = _every_module()[package]
    tree = ast.parse(path.read_text())
    imported = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            imported |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module == "__future__":
            continue
        elif isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]:
            exported = set(ast.literal_eval(node.value))
        else:
            assert isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant), \
                f"{path.relative_to(ROOT)}:{node.lineno} does more than re-export"
    assert exported == imported


@pytest.mark.parametrize("room", ["cp_attention.training", "cp_attention.compat"])
def test_rooms_above_the_adapters_import_none_at_module_level(room):
    known = set(_every_module())
    wrong = [(name, dep) for name, path in _every_module().items() if name.startswith(room)
             for dep in _imports(name, _module_level_source(path.read_text()), path.name == "__init__.py", known)
             if dep.startswith(INTEGRATIONS)]
    assert not wrong, wrong


def test_rooms_import_only_rooms_below():
    wrong = [(m, dep) for m, deps in _graph().items() for dep in deps
             if LEVELS[_room(dep)] > LEVELS[_room(m)]]
    assert not wrong, wrong


def _agreeing_calls(source: str) -> list[int]:
    """The lines of ``source`` that use a transport's ``all_gather_ints``, the collective every agreement runs."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr == "all_gather_ints"]


def test_agreement_lives_in_the_checks():
    """Agreement has one home: outside ``cp_attention/checks/`` (and the transports that implement the
    collective), nothing in the package or the adapters gathers rows to agree on; they call the checks."""
    wrong = [f"{name}:{line}" for name, path in _every_module().items()
             if name.split(".")[0] not in CHECKOUT_ROOMS and _room(name) not in ("checks", "transport")
             for line in _agreeing_calls(path.read_text())]
    assert not wrong, wrong


def test_every_core_module_is_in_a_room():
    loose = sorted(m for m in _modules() if _room(m) not in LEVELS)
    assert not loose, f"modules outside the rooms: {loose}"
    assert all((PACKAGE / room / "__init__.py").exists() for room in ROOMS)


def test_setup_installs_every_room():
    """setup.py's ROOMS (the sub-packages it installs) name every sub-package of cp_attention/: one left
    out imports from a checkout but is missing from an installed wheel."""
    source = (ROOT / "setup.py").read_text()
    assert 'runpy.run_path(str(Path(__file__).resolve().parent / "cp_attention" / "rooms.py"))["PACKAGE_ROOMS"]' \
        in source, "setup.py must install cp_attention/rooms.py's PACKAGE_ROOMS"
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert packages == set(PACKAGE_ROOMS), \
        f"rooms.py's PACKAGE_ROOMS misses {sorted(packages - set(PACKAGE_ROOMS))}, " \
        f"names no package {sorted(set(PACKAGE_ROOMS) - packages)}"


def test_the_checkers_can_fail():
    """The checkers themselves: a cycle through a function-level import, and an upward import, are found."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    source = "def f():\n    from ..engine.ring import RingPlan\n"
    name = "cp_attention.schedules.probe"
    assert _imports(name, source, False, set(_modules())) == {"cp_attention.engine.ring"}
    assert LEVELS[_room("cp_attention.engine.ring")] > LEVELS[_room(name)]
    hf, megatron = ADAPTER_PACKAGES
    assert _module_name(ADAPTERS / "huggingface" / "fsdp.py") == f"{hf}.fsdp"
    assert _module_name(ADAPTERS / "megatron" / "__init__.py") == megatron
    assert _adapter_may_import(f"{hf}.fsdp", f"{hf}.attention")
    assert _adapter_may_import(f"{hf}.fsdp", "cp_attention.checks.verdicts")
    assert not _adapter_may_import(f"{hf}.fsdp", f"{INTEGRATIONS}.agree")  # shared glue belongs in the core
    assert _adapter_may_import(f"{megatron}.batch", "cp_attention.layouts.documents")
    assert not _adapter_may_import(f"{hf}.fsdp", f"{megatron}.packed")
    assert not _adapter_may_import(f"{megatron}.attention", "cp_attention.training.steps")
    assert not _adapter_may_import(INTEGRATIONS, f"{hf}.batch")
    assert _agreeing_calls("def f(t):\n    return t.all_gather_ints([1])\n") == [2]
    lazy = "import torch\ndef f():\n    from cp_attention.integrations import huggingface\n"
    assert "huggingface" not in _module_level_source(lazy)
    assert "huggingface" in _module_level_source("from cp_attention.integrations import huggingface\n")


@pytest.mark.dist
@pytest.mark.parametrize("room", ROOMS)
def test_rooms_import_on_their_own(room):
    """Each room imports in a fresh interpreter by itself (no hidden reliance on import order)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", f"import cp_attention.{room}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
