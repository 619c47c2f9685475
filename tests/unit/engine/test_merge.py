"""The ring's out/LSE merge (issue 41, item 3): the torch path and the fused Triton kernel against an
independent fp64 reference (``tests/support/core/merge_cases.py``), and which path a merge takes.

The kernel runs here through triton's interpreter on CPU tensors, in a subprocess (``TRITON_INTERPRET``
must be set before triton is imported); without triton (or numpy, which the interpreter needs) that test
skips and says so. On CUDA fp32 accumulators a merge is one launch of that kernel; elsewhere the torch code.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cp_attention.engine import merge
from cp_attention.engine.merge import merge_at, merge_block
from tests.support.core.merge_cases import CASES, Case, check, make, rows_arg, run

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@pytest.mark.parametrize("acc_dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_torch_path_matches_the_reference(case, acc_dtype):
    """CPU tensors take the torch path: fp32 and fp64 accumulators, slices and index rows, empty rows."""
    run(case, acc_dtype)


def test_the_reference_is_not_the_code():
    """The check can fail: a merge that ignores the block's LSE weight (a plain average) is caught."""
    case = Case("slice")
    out, lse, ob, lb = make(case)
    got_out, got_lse = out.clone(), lse.clone()
    rows = rows_arg(case)
    got_out[:, rows] = (out[:, rows] + ob) / 2
    got_lse[:, :, rows] = torch.logaddexp(lse[:, :, rows], lb)
    with pytest.raises(AssertionError, match="out"):
        check(case, out, lse, ob, lb, got_out, got_lse)


# ------------------------------------------------------------------------------------- dispatch
@pytest.fixture
def fused_on_cpu(monkeypatch):
    """CPU stands in for CUDA, and a recorder for the Triton launch (which then merges nothing)."""
    calls = []

    def launch(*args):
        calls.append(args)
        return True

    monkeypatch.setattr(merge, "_FUSED_DEVICE", "cpu")
    monkeypatch.setattr(merge, "_fused_merge", launch)
    return calls


@pytest.mark.parametrize("rows", [slice(2, 7), torch.tensor([9, 0, 4, 11, 2])], ids=["slice", "index"])
def test_fp32_on_the_fused_device_is_one_launch(fused_on_cpu, rows):
    """CUDA (here: CPU standing in) + fp32 + triton: one fused launch with the caller's tensors, no torch op."""
    case = Case("x", rows=rows if isinstance(rows, slice) else tuple(rows.tolist()))
    out, lse, ob, lb = make(case)
    before = out.clone(), lse.clone()
    (merge_block if isinstance(rows, slice) else merge_at)(out, lse, ob, lb, rows)
    assert len(fused_on_cpu) == 1
    assert all(a is b for a, b in zip(fused_on_cpu[0], (out, lse, ob, lb, rows)))
    assert torch.equal(out, before[0]) and torch.equal(lse, before[1])  # the recorder merged nothing


@pytest.mark.parametrize("why", ["fp64 accumulator", "fp32 out, fp64 lse", "block on another device",
                                 "tensor subclass", "autograd tracks the block"])
def test_what_stays_on_the_torch_path(fused_on_cpu, why):
    """Anything the kernel does not take exactly merges in torch (and correctly)."""
    case = Case("x")
    out, lse, ob, lb = make(case, torch.float64 if why == "fp64 accumulator" else torch.float32)
    if why == "fp32 out, fp64 lse":
        lse = lse.double()
    if why == "block on another device":
        ob = ob.to("meta")
    if why == "tensor subclass":
        out = out.as_subclass(_Sub)
    if why == "autograd tracks the block":
        ob.requires_grad_(True)
    assert merge._fused(out, lse, ob, lb) is None
    if why not in ("block on another device", "fp32 out, fp64 lse"):  # the torch path refuses those too
        got_out, got_lse = out.clone(), lse.clone()
        merge_block(got_out, got_lse, ob, lb, rows_arg(case))
        check(case, out, lse, ob.detach(), lb, got_out.detach(), got_lse.detach())
    assert not fused_on_cpu


class _Sub(torch.Tensor):
    pass


def test_int32_rows_are_not_launched(fused_on_cpu):
    """The kernel reads int64 rows; other index tensors meet torch's own check, as before the kernel."""
    case = Case("x", rows=(3, 7, 0))
    out, lse, ob, lb = make(case)
    with pytest.raises(RuntimeError, match="long tensor"):
        merge_at(out, lse, ob, lb, rows_arg(case).int())
    assert all(isinstance(call[4], slice) for call in fused_on_cpu)  # the kernel never got the int32 index


def test_a_failed_launch_falls_back(monkeypatch):
    """A fused merge that declines (returns False) leaves the merge to torch, which still merges."""
    monkeypatch.setattr(merge, "_FUSED_DEVICE", "cpu")
    monkeypatch.setattr(merge, "_fused_merge", lambda *args: False)
    case = Case("x", rows=(3, 7, 0))
    out, lse, ob, lb = make(case)
    got_out, got_lse = out.clone(), lse.clone()
    merge_at(got_out, got_lse, ob, lb, rows_arg(case))
    check(case, out, lse, ob, lb, got_out, got_lse)


def test_without_triton_the_torch_path_runs(monkeypatch):
    """With triton missing the first eligible merge imports merge_triton, which says so, and torch merges."""
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    monkeypatch.delitem(sys.modules, "cp_attention.engine.merge_triton", raising=False)
    monkeypatch.setattr(merge, "_FUSED_DEVICE", "cpu")
    monkeypatch.setattr(merge, "_fused_merge", None)
    run(Case("empty accumulator rows, index", rows=(5, 1, 8), empty=(1, 8, 10)))
    assert merge._fused_merge is False
    assert not sys.modules["cp_attention.engine.merge_triton"].available()


@pytest.mark.dist
def test_importing_the_library_never_imports_triton():
    """``import cp_attention`` (and a CPU merge) imports neither the kernel module nor triton beyond what
    torch imports itself (``torch._dynamo`` imports triton when it is installed)."""
    code = ("import sys, torch, torch._dynamo\nbefore = set(sys.modules)\nimport cp_attention\n"
            "from tests.support.core.merge_cases import CASES, run\nrun(CASES[0])\n"
            "new = {m for m in set(sys.modules) - before if m.split('.')[0] == 'triton'}\n"
            "new |= {'cp_attention.engine.merge_triton'} & set(sys.modules)\nassert not new, new")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


# ------------------------------------------------------------------------------------ the kernel
@pytest.mark.dist
def test_the_fused_merge_can_be_switched_off():
    """CP_ATTENTION_FUSED_MERGE=0: no merge goes to the fused kernel, on any device."""
    code = "from cp_attention.engine import merge\nprint(merge._FUSED_DEVICE)"
    env = {**os.environ, "CP_ATTENTION_FUSED_MERGE": "0"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "None", proc.stderr
    env["CP_ATTENTION_FUSED_MERGE"] = "1"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "cuda", proc.stderr


@pytest.mark.parametrize("wrong", ["block rows", "heads", "lse rows", "index length"])
def test_the_kernel_refuses_shapes_it_would_read_out_of_bounds(wrong):
    """The kernel reads by strides, so ``fused_merge`` checks the shapes first and names the mismatch."""
    from cp_attention.engine.merge_triton import _check

    case = Case("x", rows=(3, 7, 0))
    out, lse, ob, lb = make(case)
    idx = rows_arg(case)
    b, r, h, d = ob.shape
    _check(out, lse, lb, idx, (b, r, h, d))  # the right shapes pass
    blk = {"block rows": (b, r + 1, h, d), "heads": (b, r, h + 1, d)}.get(wrong, (b, r, h, d))
    lb = lb[:, :, :2] if wrong == "lse rows" else lb
    idx = idx[:2] if wrong == "index length" else idx
    with pytest.raises(ValueError, match=r"does not fit accumulators out \(2, 12, 3, 8\).*pass the block"):
        _check(out, lse, lb, idx, blk)


def _interpreter_missing() -> str | None:
    missing = [m for m in ("triton", "numpy") if importlib.util.find_spec(m) is None]
    return f"triton's interpreter needs {' and '.join(missing)}: pip install triton numpy" if missing else None


@pytest.mark.dist
@pytest.mark.slow
def test_the_triton_kernel_matches_the_reference():
    """Every case through merge_block/merge_at with the fused kernel on CPU (triton's interpreter): one
    launch per merge, close to the fp64 reference, empty rows exact, other rows untouched."""
    reason = _interpreter_missing()
    if reason:
        pytest.skip(reason)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "tests.support.core.merge_cases"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("ok ") == len(CASES), proc.stdout
