"""A user-defined layout (tests/support/core/custom_layouts.py: reversed zigzag) works end to end: the mask
oracle, ring_attention on real ranks (by name and as an object), work_model and the layout comparison."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cp_attention as cpa
from cp_attention.layouts import register_layout
from tests.distributed.test_ring import _assert_within
from tests.support.core import custom_layouts
from tests.support.core.reference import tolerance
from tests.unit.schedules.test_causal import allowed, coverage

ROOT = Path(__file__).resolve().parents[3]
NAME = custom_layouts.ReversedZigzagLayout.name


def test_it_resolves_by_name_and_alias_and_holds_the_reversed_zigzag_chunks():
    lay = cpa.get_layout("RZigzag")
    assert isinstance(lay, custom_layouts.ReversedZigzagLayout) and cpa.get_layout(NAME) is lay
    zig = cpa.get_layout("zigzag")
    for n in (1, 2, 3, 4):
        for r in range(n):
            assert torch.equal(lay.positions(8 * n, r, n), zig.positions(8 * n, n - 1 - r, n))
    with pytest.raises(ValueError, match=r"reversed_zigzag layout needs seq_len divisible by 2\*world_size=6"):
        lay.check(9, 3)
    assert cpa.LAYOUT_NAMES == ("contiguous", "zigzag", "interleaved", "balanced")  # the built-ins are unchanged


def test_registration_is_idempotent_and_refuses_a_taken_name():
    register_layout(custom_layouts.ReversedZigzagLayout())  # a second import of the module: a no-op

    class Impostor(cpa.Layout):
        name = "zigzag"

    with pytest.raises(ValueError, match="layout name 'zigzag' is already taken"):
        register_layout(Impostor())
    with pytest.raises(TypeError, match="needs a Layout instance"):
        register_layout("zigzag")
    assert type(cpa.get_layout("zigzag")) is cpa.ZigzagLayout


@pytest.mark.parametrize("causal", (True, False))
@pytest.mark.parametrize("n", range(1, 7))
@pytest.mark.parametrize("multiple", (1, 2, 3))
def test_every_allowed_pair_exactly_once(causal, n, multiple):
    seq_len = multiple * 2 * n
    assert torch.equal(coverage(NAME, causal, seq_len, n), allowed(seq_len, causal))


def test_work_model_is_balanced_like_zigzag():
    for n in (2, 3, 8):
        work = cpa.work_model(NAME, True, 64 * n, n)
        assert all(len(set(col)) == 1 for col in zip(*work)), work
        assert sum(map(sum, work)) == sum(map(sum, cpa.work_model("zigzag", True, 64 * n, n)))


@pytest.mark.parametrize("world_size", (1, 2, 3, 4))
@pytest.mark.parametrize("as_object", (False, True))
@pytest.mark.parametrize("causal", (True, False))
def test_ring_attention_matches_the_reference(pools, world_size, as_object, causal):
    errors = pools(world_size).run(
        custom_layouts.custom_layout_errors, as_object=as_object, causal=causal, dtype="float64", kernel="sdpa",
        heads=4, kv_heads=2, local_len=6, seed=world_size, **tolerance(torch.float64, True))
    _assert_within(errors, f"{NAME} ws={world_size} causal={causal}")


def _csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.dist
@pytest.mark.slow
def test_compare_layouts_end_to_end(tmp_path):
    """The Hydra CLI imports the module named in `plugins`; the spawned workers get the layout by pickle."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "studies.layout_comparison", "experiment=smoke", f"out_dir={tmp_path}",
         "plugins=[tests.support.core.custom_layouts]", f"layouts=[zigzag,{NAME}]", "model.world_sizes=[2,4]",
         "model.seq_lens=[1024]", "projection.world_sizes=[8]", "projection.seq_lens=[32768]"],
        cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    modelled = [r for r in _csv(tmp_path / "modelled.csv") if r["layout"] == NAME]
    assert {r["world_size"] for r in modelled} >= {"2", "4"}, modelled
    assert all(float(r["imbalance"]) == 1.0 and float(r["redundant_fraction"]) == 0.0 for r in modelled), modelled
    wall = {r["impl"]: r for r in _csv(tmp_path / "measured_wall.csv")}
    assert float(wall[f"ring/{NAME}"]["fwdbwd_ms"]) > 0, wall
    steps = [r for r in _csv(tmp_path / "measured_step_times.csv") if r["layout"] == NAME]
    assert len(steps) == 2 * 2 * 2  # passes x ranks x steps at N=2
    assert NAME in (tmp_path / "report.md").read_text()


@pytest.mark.dist
def test_compare_layouts_names_an_unimportable_plugin(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "studies.layout_comparison", "experiment=smoke", f"out_dir={tmp_path}",
                           "plugins=[no_such_module]"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "config plugins='no_such_module': cannot import it" in proc.stderr
