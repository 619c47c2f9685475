"""Layout analysis (closed forms, projection arithmetic) and the comparison script end to end."""

from __future__ import annotations

import csv
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

import cp_attention as cpa
from cp_attention.analysis import (
    AttentionShape, ClusterSpec, comm_bytes_per_rank, flops_per_pair, imbalance, kv_bytes_per_hop, pair_owners,
    project, split_problem, step_sync_efficiency, summarize,
)

ROOT = Path(__file__).resolve().parents[1]
PICTURES = ("mask_atlas", "work_bars", "efficiency_vs_world", "efficiency_vs_seq", "measured_steps",
            "projection_efficiency")
TABLES = ("modelled", "work_per_rank_step", "measured_wall", "measured_step_times", "measured_summary",
          "projection", "skipped")


def contiguous_imbalance(seq_len: int, n_ranks: int) -> Fraction:
    """Closed form: causal contiguous rank r computes r·n² + n(n+1)/2 score pairs."""
    n = seq_len // n_ranks
    per_rank = [r * n * n + n * (n + 1) // 2 for r in range(n_ranks)]
    return Fraction(max(per_rank) * n_ranks, sum(per_rank))


# ---------------------------------------------------------------- analysis: closed forms

@pytest.mark.parametrize("n_ranks", (1, 2, 3, 8, 32, 128))
def test_contiguous_matches_the_closed_form(n_ranks):
    seq = 1024 * n_ranks
    work = cpa.work_model("contiguous", True, seq, n_ranks)
    n = seq // n_ranks
    assert [sum(row) for row in work] == [r * n * n + n * (n + 1) // 2 for r in range(n_ranks)]
    assert imbalance(work) == pytest.approx(float(contiguous_imbalance(seq, n_ranks)), rel=1e-12)
    assert imbalance(work) == pytest.approx((2 * n_ranks - 1) / n_ranks, rel=1e-3)  # long sequences
    # Each step costs a full block on the last rank, the diagonal step a triangle: N/(2N-1) in the limit.
    assert step_sync_efficiency(work) == pytest.approx(n_ranks / (2 * n_ranks - 1), rel=1e-3)


@pytest.mark.parametrize("n_ranks", (1, 2, 3, 8, 128))
def test_zigzag_is_balanced_at_every_step(n_ranks):
    work = cpa.work_model("zigzag", True, 4 * n_ranks * 7, n_ranks)
    assert all(len(set(col)) == 1 for col in zip(*work))
    assert imbalance(work) == 1.0 and step_sync_efficiency(work) == 1.0


@pytest.mark.parametrize("n_ranks,seq", ((2, 16), (4, 64), (8, 1024), (128, 1 << 14)))
def test_interleaved_efficiency_closed_form(n_ranks, seq):
    n = seq // n_ranks
    work = cpa.work_model("interleaved", True, seq, n_ranks)
    assert step_sync_efficiency(work) == pytest.approx((n_ranks * n + 1) / (n_ranks * (n + 1)), rel=1e-12)


@pytest.mark.parametrize("layout", cpa.LAYOUT_NAMES)
@pytest.mark.parametrize("causal", (True, False))
def test_no_redundant_pairs_and_non_causal_is_balanced(layout, causal):
    seq, n_ranks = 96, 4
    s = summarize(cpa.work_model(layout, causal, seq, n_ranks), seq, causal)
    assert s.redundant_fraction == 0 and s.total_pairs == s.min_pairs
    if not causal:
        assert s.imbalance == 1.0 and s.step_sync_efficiency == 1.0 and s.idle_fraction == 0


def test_metrics_on_a_hand_matrix():
    work = [[1, 0], [1, 2]]  # ideal 2 per rank; the steps cost 1 + 2
    assert imbalance(work) == pytest.approx(1.5)
    assert step_sync_efficiency(work) == pytest.approx(2 / 3)
    s = summarize([[3, 0], [3, 4]], 4, True)
    assert s.idle_fraction == pytest.approx((2 * 7 - 10) / 10)
    for bad in ([], [[]], [[1, 2], [3]]):
        with pytest.raises(ValueError, match="rank x step matrix"):
            imbalance(bad)
    with pytest.raises(ValueError, match="zero total work"):
        step_sync_efficiency([[0, 0], [0, 0]])


@pytest.mark.parametrize("layout", cpa.LAYOUT_NAMES)
@pytest.mark.parametrize("causal", (True, False))
def test_pair_owners_cover_the_mask_once(layout, causal):
    seq, n_ranks = 24, 3 if layout != "zigzag" else 2
    pairs = pair_owners(layout, causal, seq, n_ranks)
    got = sorted((q, k) for q, k, _, _ in pairs)
    assert got == sorted((q, k) for q in range(seq) for k in range(seq) if k <= q or not causal)
    pos = [cpa.get_layout(layout).positions(seq, r, n_ranks).tolist() for r in range(n_ranks)]
    assert all(q in pos[r] and k in pos[(r - s) % n_ranks] for q, k, r, s in pairs)


def test_split_problem_names_the_divisor():
    assert split_problem("zigzag", 16, 4) is None
    assert "divisible by 2*world_size=6" in split_problem("zigzag", 16, 3)


# ---------------------------------------------------------------- analysis: communication and projection

def test_comm_bytes_follow_the_engine():
    shape = AttentionShape(batch=2, heads=8, kv_heads=2, head_dim=64, v_head_dim=32, elem_bytes=2)
    hop = 2 * 256 * 2 * (64 + 32) * 2
    assert kv_bytes_per_hop(1024, 4, shape) == hop
    assert comm_bytes_per_rank(1024, 4, shape) == (3 * hop, 3 * hop + 4 * 2 * hop)  # dK/dV in fp32
    assert comm_bytes_per_rank(1024, 1, shape) == (0, 0)
    d128 = AttentionShape(head_dim=128)
    assert flops_per_pair(d128, True) == 2.5 * flops_per_pair(d128, False)


def test_projection_by_hand():
    # S=4 over N=2, contiguous: work [[3, 0], [3, 4]]. Every number is chosen so a pair or a hop takes 1 s:
    # 16-byte hops over 16 B/s, forward 4 flops per pair at 4 flop/s, backward 10 flops per pair.
    shape = AttentionShape(batch=1, heads=1, kv_heads=1, head_dim=1, elem_bytes=4)
    cluster = ClusterSpec("toy", link_gbytes_per_s=16e-9, link_latency_us=0.0, attention_tflops=4e-12)
    work = cpa.work_model("contiguous", True, 4, 2)
    assert work == [[3, 0], [3, 4]]
    p = project(work, 4, shape, cluster)
    assert (p.fwd_overlap_s, p.fwd_serial_s) == pytest.approx((3 + 4, 3 + 1 + 4))
    assert (p.bwd_overlap_s, p.bwd_serial_s) == pytest.approx((7.5 + 10 + 1, 8.5 + 11 + 1))  # + the hop home
    assert (p.ideal_fwd_s, p.ideal_bwd_s) == pytest.approx((5, 12.5))
    assert p.slowest_fwd_step_s == pytest.approx(4) and p.comm_bound_steps == 0
    assert p.efficiency_overlap == pytest.approx(17.5 / 25.5)


def test_projection_regimes():
    shape = AttentionShape(heads=32, kv_heads=8, head_dim=128, elem_bytes=2)
    cluster = ClusterSpec()
    seq, n = 1 << 20, 128
    zig = project(cpa.work_model("zigzag", True, seq, n), seq, shape, cluster)
    con = project(cpa.work_model("contiguous", True, seq, n), seq, shape, cluster)
    assert zig.comm_bound_steps == 0 and zig.efficiency_overlap > 0.99  # long sequence: compute hides the hops
    assert con.efficiency_overlap == pytest.approx(n / (2 * n - 1), rel=0.01)
    assert zig.efficiency_serial < zig.efficiency_overlap
    short = project(cpa.work_model("zigzag", True, 1 << 15, n), 1 << 15, shape, cluster)
    assert short.comm_bound_steps == n - 1  # short sequence: every hop outlasts its step's compute
    with pytest.raises(ValueError, match="positive bandwidth"):
        ClusterSpec(link_gbytes_per_s=0)


# ---------------------------------------------------------------- the script end to end

def _run(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/compare_layouts.py", f"out_dir={tmp_path}", *overrides],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)


def _csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_smoke_end_to_end(tmp_path):
    proc = _run(tmp_path, "experiment=smoke")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in PICTURES:
        png = tmp_path / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert (tmp_path / f"{name}.csv").stat().st_size > 0, name
    for name in TABLES:
        assert (tmp_path / f"{name}.csv").exists(), name
    report = (tmp_path / "report.md").read_text()
    assert all(f"({name}.png)" in report for name in PICTURES)

    modelled = _csv(tmp_path / "modelled.csv")
    assert {r["layout"] for r in modelled} == set(cpa.LAYOUT_NAMES)
    for r in modelled:
        s, n = int(r["seq_len"]), int(r["world_size"])
        if r["layout"] == "contiguous":
            assert float(r["imbalance"]) == pytest.approx(float(contiguous_imbalance(s, n)), rel=1e-12)
            if s >= 4096:
                assert float(r["imbalance"]) == pytest.approx((2 * n - 1) / n, rel=2e-3)
        if r["layout"] == "zigzag":
            assert float(r["imbalance"]) == 1.0 and float(r["step_sync_efficiency"]) == 1.0
        assert float(r["redundant_fraction"]) == 0.0

    wall = _csv(tmp_path / "measured_wall.csv")
    impls = {r["impl"] for r in wall}
    assert impls == {"baseline", "torch_ring/zigzag", *(f"ring/{lay}" for lay in cpa.LAYOUT_NAMES)}
    for r in wall:  # torch's ring may vanish in a future torch; then its row says why
        assert float(r["fwdbwd_ms"] or 0) > 0 or (r["impl"].startswith("torch_ring") and r["error"]), r
    steps = _csv(tmp_path / "measured_step_times.csv")
    assert len(steps) == 3 * 2 * 2 * 2  # layouts x passes x ranks x steps at N=2


def test_skips_what_a_layout_cannot_split_and_models_non_causal(tmp_path):
    proc = _run(tmp_path, "experiment=smoke", "measure.world_sizes=[]", "causal=false",
                "model.world_sizes=[2,3]", "model.seq_lens=[1024]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    skipped = _csv(tmp_path / "skipped.csv")
    assert {(r["layout"], r["world_size"]) for r in skipped if r["part"] == "modelled"} == \
        {(lay, "3") for lay in cpa.LAYOUT_NAMES}
    assert all("divisible by" in r["reason"] for r in skipped)
    for r in _csv(tmp_path / "modelled.csv"):
        assert float(r["imbalance"]) == 1.0 and float(r["step_sync_efficiency"]) == 1.0
    report = (tmp_path / "report.md").read_text()
    assert "## Skipped" in report and "Not measured" in report
    assert all((tmp_path / f"{name}.png").exists() for name in PICTURES)


def test_bad_config_fails_fast_with_the_key(tmp_path):
    proc = _run(tmp_path, "experiment=smoke", "layouts=[contiguous,nope]")
    assert proc.returncode != 0
    assert "config layouts='nope'" in proc.stderr and "zigzag" in proc.stderr
    assert not (tmp_path / "report.md").exists()
