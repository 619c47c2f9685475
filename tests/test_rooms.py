"""The core's rooms: no import cycles (function-level imports included), and each room imports only
the rooms below it: kernels and transport < layouts < schedules < checks < engine < strategies < the API."""

from __future__ import annotations

from pathlib import Path

import pytest

from .import_graph import imported_names

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "cp_attention"
# Room -> its level; a module may import rooms of its own level or lower only.
LEVELS = {"kernels": 0, "transport": 0, "layouts": 1, "schedules": 2, "checks": 3, "engine": 4, "strategies": 5,
          "api": 6, "__init__": 6, "_extras": 0, "launch": 0}
ROOMS = ("kernels", "transport", "layouts", "schedules", "checks", "engine", "strategies")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")
            if p.relative_to(PACKAGE).parts[0] not in ("training", "experiments")}


def _imports(name: str, source: str, is_package: bool, known: set[str]) -> set[str]:
    """The cp_attention modules ``name`` imports anywhere in its ``source`` (function bodies too); a
    name imported from a package counts as the package unless it is a submodule."""
    package = name if is_package else name.rpartition(".")[0]
    targets = {t if t in known else t.rpartition(".")[0] for t in imported_names(source, package)}
    return {t for t in targets if t in known and t != name}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {name: _imports(name, path.read_text(), path.name == "__init__.py", known) for name, path in mods.items()}


def _cycle(graph: dict[str, set[str]]) -> "list[str] | None":
    """One import cycle of ``graph``, or None (depth-first search with colours)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> "list[str] | None":
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
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle)


def test_rooms_import_only_rooms_below():
    wrong = [(m, dep) for m, deps in _graph().items() for dep in deps
             if LEVELS[_room(dep)] > LEVELS[_room(m)]]
    assert not wrong, wrong


def test_every_core_module_is_in_a_room():
    loose = sorted(m for m in _modules() if _room(m) not in LEVELS)
    assert not loose, f"modules outside the rooms: {loose}"
    assert all((PACKAGE / room / "__init__.py").exists() for room in ROOMS)


def test_the_checkers_can_fail():
    """The checkers themselves: a cycle through a function-level import, and an upward import, are found."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    source = "def f():\n    from ..engine.ring import RingPlan\n"
    name = "cp_attention.schedules.probe"
    assert _imports(name, source, False, set(_modules())) == {"cp_attention.engine.ring"}
    assert LEVELS[_room("cp_attention.engine.ring")] > LEVELS[_room(name)]


@pytest.mark.parametrize("room", ROOMS)
def test_rooms_import_on_their_own(room):
    """Each room imports in a fresh interpreter by itself (no hidden reliance on import order)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", f"import cp_attention.{room}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
