"""The supported versions are written once (cp_attention/versions.py) and every other place agrees:
setup.py's requirements, the README's install table, ``make test-floor``; ``make train`` installs what its
loss picture needs; and :func:`require_version` refuses an installed version below its floor."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest
import setuptools

from cp_attention import versions

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def setup_kwargs() -> dict:
    """What setup.py hands to setuptools.setup, read without building anything."""
    seen: dict = {}
    patch = pytest.MonkeyPatch()
    patch.setattr(setuptools, "setup", lambda **kwargs: seen.update(kwargs))
    patch.chdir(ROOT)
    try:
        runpy.run_path(str(ROOT / "setup.py"), run_name="__main__")
    finally:
        patch.undo()
    return seen


def _floors_in(requirements) -> dict[str, str]:
    found = {}
    for req in requirements:
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?>=([0-9.]+)", req)
        if match and match.group(1) in versions.FLOORS:
            found[match.group(1)] = match.group(2)
    return found


def test_setup_requires_the_floors(setup_kwargs):
    extras = setup_kwargs["extras_require"]
    assert _floors_in(setup_kwargs["install_requires"]) == {"torch": versions.FLOORS["torch"]}
    every = [req for name, reqs in extras.items() for req in reqs]
    assert _floors_in(every) == {k: v for k, v in versions.FLOORS.items() if k != "torch"}
    assert not [r for r in every if re.match(r"(transformers|accelerate|trl|megatron-core)\b", r)
                and _floors_in([r]) == {}], "a requirement of a supported package without its floor"


def test_the_readme_table_gives_each_floor_and_the_newest_tested():
    rows = {m.group(1): (m.group(2), m.group(3)) for m in re.finditer(
        r"^\| `?([a-z\-]+)`? \| ([0-9.]+) \| ([0-9.]+) \|", (ROOT / "README.md").read_text(), re.M)}
    assert rows == {name: (versions.FLOORS[name], versions.TESTED[name]) for name in versions.FLOORS}


def test_make_test_floor_installs_the_floors_as_constraints(capsys):
    target = (ROOT / "Makefile").read_text().split("\ntest-floor:", 1)[1]
    assert "$(PYTHON) cp_attention/versions.py > $(FLOOR_VENV)/floors.txt" in target
    assert '-c $(FLOOR_VENV)/floors.txt -e ".[all]"' in target
    runpy.run_path(str(ROOT / "cp_attention" / "versions.py"), run_name="__main__")
    assert capsys.readouterr().out.split() == [f"{k}=={v}" for k, v in versions.FLOORS.items()]


def test_make_train_installs_what_the_loss_picture_needs(setup_kwargs):
    install = re.search(r"^install-train:\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    names = re.search(r'-e "\.\[([a-z,]+)\]"', install).group(1).split(",")
    needs = [req for name in names for req in setup_kwargs["extras_require"][name]]
    assert any(req.startswith("matplotlib") for req in needs), f"make train installs {names}: no matplotlib"
    assert any(req.startswith("hydra-core") for req in needs)


@pytest.mark.parametrize("installed, refused", [("5.0.0", False), ("99.1", False), ("0.1.0", True)])
def test_require_version_refuses_only_below_the_floor(monkeypatch, installed, refused):
    monkeypatch.setitem(versions.FLOORS, "transformers", "1.2.3")
    if not refused:
        versions.require_version("transformers", "the adapter", installed=installed)
        return
    with pytest.raises(RuntimeError, match=r"the adapter needs transformers >= 1\.2\.3 .*transformers 0\.1\.0 is "
                                           r"installed; upgrade it: pip install 'transformers>=1\.2\.3'"):
        versions.require_version("transformers", "the adapter", installed=installed)


def test_a_missing_package_is_left_to_its_import(monkeypatch):
    monkeypatch.setattr(versions, "installed_version", lambda package: None)
    versions.require_version("megatron-core", "the Megatron adapter")


@pytest.mark.parametrize("text, parsed", [("2.13.0+cpu", (2, 13, 0)), ("5.0.0rc1", (5, 0, 0)), ("0.16", (0, 16)),
                                          ("1.10.0.dev20260101", (1, 10, 0))])
def test_parse_version_reads_the_release_numbers(text, parsed):
    assert versions.parse_version(text) == parsed
    assert versions.parse_version("2.6.0") < versions.parse_version("2.13.0")


def test_parse_version_refuses_text_without_a_number():
    with pytest.raises(ValueError, match="cannot read a version number from 'abc'"):
        versions.parse_version("abc")
