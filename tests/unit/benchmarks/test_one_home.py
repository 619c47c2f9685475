"""benchmarks/ and studies/ keep one home per idea: each file name once, every clock in benchmarks/measure.py,
every shared flag declared once in benchmarks/args.py (and read the same way wherever it is added), and one word
per idea: the library's current names, none of those issue 43 renamed (deprecated aliases included)."""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import re
import warnings
from collections import defaultdict
from pathlib import Path

import pytest

from benchmarks import args as flags

ROOT = Path(__file__).resolve().parents[3]
FILES = sorted(p for folder in ("benchmarks", "studies") for p in (ROOT / folder).rglob("*.py"))
PACKAGE_FILES = {"__init__.py", "__main__.py"}  # Python's own names: every package has them
# A clock or a /proc read: only measure.py reads them. stress.py counts its runs' seconds itself: it imports the
# standard library only (tests/conftest.py imports it), and it times subprocesses, not the library.
CLOCK = re.compile(r"perf_counter|process_time|time\.time\(|monotonic|cuda\.Event|elapsed_time|/proc/self/status")
CLOCK_EXEMPT = {"benchmarks/measure.py", "benchmarks/stress.py"}
# A script's own flag that shares a shared flag's name but not its meaning: the memory study's --tokens are
# local tokens per rank (a list), not a packed length T.
OWN_MEANING = {("studies/memory/longest_context.py", "--tokens")}


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_no_file_name_twice():
    where = defaultdict(list)
    for p in FILES:
        if p.name not in PACKAGE_FILES:
            where[p.name].append(_rel(p))
    twice = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not twice, f"one name, several files (name each after what it holds): {twice}"


def test_every_clock_is_in_measure():
    found = [f"{_rel(p)}:{n}: {line.strip()}" for p in FILES if _rel(p) not in CLOCK_EXEMPT
             for n, line in enumerate(p.read_text().splitlines(), 1) if CLOCK.search(line)]
    assert not found, f"time through benchmarks/measure.py (Stopwatch, call_ms, elapsed_ms, ...): {found}"


def _declared(path: Path) -> list[str]:
    """The ``--flags`` a file declares with ``add_argument``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            out += [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
    return out


def _shared() -> set[str]:
    """Every flag benchmarks/args.py declares: each group called with every keyword."""
    p = argparse.ArgumentParser()
    flags.add_ring(p, seq_lens=[1], world_size=1, world_sizes=[1], tokens_per_rank=1, layouts=["zigzag"],
                   layout="zigzag", kernel="auto", device="cpu")
    flags.add_shape(p, batch=1, heads=1, kv_heads=1, head_dim=1, dtype="float32")
    flags.add_model(p, layers=1, hidden=1, intermediate=1, vocab=1)
    flags.add_documents(p, tokens=1, documents=1, sigma=1.0, seed=0)
    flags.add_run(p, repeats=1, timeout=1, quick="a smoke run", json="the rows")
    return {s for a in p._actions for s in a.option_strings if s.startswith("--")}


def test_shared_flags_are_declared_only_in_args():
    shared = _shared()
    assert {"--heads", "--kv-heads", "--repeats", "--json", "--seq-lens", "--world-sizes", "--dtype"} <= shared
    again = [(_rel(p), f) for p in FILES if _rel(p) != "benchmarks/args.py" for f in _declared(p)
             if f in shared and (_rel(p), f) not in OWN_MEANING]
    assert not again, f"declare these through benchmarks/args.py: {again}"


def test_a_group_adds_only_what_it_is_given():
    p = argparse.ArgumentParser()
    flags.add_shape(p, heads=8, kv_heads=None)
    flags.add_documents(p, documents=[1000, 8000])
    flags.add_run(p, repeats=3)
    assert {a.dest for a in p._actions} == {"help", "heads", "kv_heads", "documents", "repeats"}
    args = p.parse_args([])
    assert (args.heads, args.kv_heads, args.documents, args.repeats) == (8, None, [1000, 8000], 3)
    flags.resolve_kv_heads(args)
    assert args.kv_heads == 8
    args = p.parse_args(["--documents", "10", "20", "30", "--kv-heads", "2"])  # a list default takes several
    assert args.documents == [10, 20, 30] and args.kv_heads == 2
    with pytest.raises(SystemExit):
        p.parse_args(["--batch", "2"])  # not given to add_shape: not a flag of this script


def test_the_library_names_are_the_choices():
    from cp_attention import KERNEL_NAMES, LAYOUT_NAMES

    p = argparse.ArgumentParser()
    flags.add_ring(p, layouts=LAYOUT_NAMES, kernel="auto")
    assert p.parse_args([]).layouts == list(LAYOUT_NAMES) and p.parse_args([]).kernel == "auto"
    with pytest.raises(SystemExit):
        p.parse_args(["--layouts", "no_such_layout"])
    assert set(KERNEL_NAMES) >= {p.parse_args(["--kernel", k]).kernel for k in KERNEL_NAMES}
    with pytest.raises(ValueError, match="not both"):
        flags.add_shape(argparse.ArgumentParser(), heads=8, head_pairs=["8/2"])


def test_args_imports_the_standard_library_only():
    """benchmarks/stress.py (imported by tests/conftest.py) declares its flags here: no torch at import."""
    tree = ast.parse((ROOT / "benchmarks" / "args.py").read_text())
    top = {a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    top |= {n.module.split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom) and n.module}
    assert top <= {"__future__", "argparse", "typing"}, top


# Issue 43's renames ("one word per idea"): the old words, as identifiers, keys or in docstrings, and the new ones.
OLD_WORDS = {"rank_plan": "rank_steps", "rank_traffic": "rank_needs", "RingSchedule": "RingSource",
             "CompositeSchedule": "CompositeSource", "step_rows": "step_needs", "StepRows": "StepNeeds",
             "ReplayComm": "ReplayTransport", "ring_steps": "ring_length (a column, key or parameter)",
             "fault_comm": "fault_transport"}
OLD_IDENTIFIERS = {"comm": "transport", "comms": "transports"}  # only as names: "comm" in text means communication


def _old_words(path: Path) -> list[str]:
    """``line: old -> new`` for each old word of issue 43 in ``path``'s code: an identifier (name, attribute,
    argument, keyword, import, definition), a ``.traffic(...)`` call on a plan, or a string that holds one."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = [getattr(node, a, None) for a in ("id", "attr", "arg", "name", "asname")]
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            names += [w for w in OLD_WORDS if w in node.value]
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "traffic":
            found.append(f"{node.lineno}: .traffic() -> .needs_index()")
        found += [f"{getattr(node, 'lineno', '?')}: {n} -> {OLD_WORDS.get(n) or OLD_IDENTIFIERS[n]}" for n in names
                  if isinstance(n, str) and (n in OLD_WORDS or n in OLD_IDENTIFIERS)]
    return found


def test_no_old_word_of_issue_43():
    old = {_rel(p): hits for p in FILES if (hits := _old_words(p))}
    assert not old, f"benchmarks/ and studies/ use the library's current words (CHANGELOG, Deprecated): {old}"


def test_the_old_word_check_sees_each_kind_of_use(tmp_path):
    src = tmp_path / "old.py"
    src.write_text("from cp_attention.schedules import rank_plan\n"
                   "def f(comm, plan):\n    plan.traffic(1, 'cpu', 2)\n    return {'ring_steps': comm.sent_bytes}\n")
    assert sorted(_old_words(src)) == sorted([
        "1: rank_plan -> rank_steps", "2: comm -> transport", "3: .traffic() -> .needs_index()",
        "4: ring_steps -> ring_length (a column, key or parameter)", "4: comm -> transport"])


def _answers_old_names(module: str) -> bool:
    """Whether ``module``'s source defines a module ``__getattr__`` (PEP 562), the only way a name imported
    from it can warn; read, not imported, so that no dependency's import runs."""
    spec = importlib.util.find_spec(module)
    if spec is None or not (spec.origin or "").endswith(".py"):
        return False
    for node in ast.parse(Path(spec.origin).read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            return True
        if isinstance(node, ast.Assign) and any(getattr(x, "id", None) == "__getattr__" for x in node.targets):
            return True
    return False


def test_every_name_imported_from_the_library_is_current():
    """Each ``from cp_attention... import name`` in benchmarks/ and studies/ (in functions too) resolves without
    the DeprecationWarning of an old name (cp_attention/_deprecated.py)."""
    imported = {(node.module, a.name, _rel(p)) for p in FILES for node in ast.walk(ast.parse(p.read_text()))
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "cp_attention"
                for a in node.names}
    assert len(imported) > 20  # the check reads the imports it should
    hooked = {m for m in {m for m, _, _ in imported} if _answers_old_names(m)}
    assert {"cp_attention", "cp_attention.schedules"} <= hooked  # where rank_plan was imported from
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for module, name, where in sorted(x for x in imported if x[0] in hooked):
            try:
                getattr(importlib.import_module(module), name)
            except DeprecationWarning as e:
                pytest.fail(f"{where}: from {module} import {name}: {e}")
