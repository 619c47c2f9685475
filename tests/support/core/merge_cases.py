"""Cases for the out/LSE merge (``cp_attention.engine.merge``) and an independent fp64 reference, shared
by ``tests/unit/engine/test_merge.py`` and its Triton run: ``python -m tests.support.core.merge_cases``
with ``TRITON_INTERPRET=1`` (set before triton is imported: triton 3.x decides at ``@triton.jit`` time
whether a kernel is interpreted, and its own ``tl`` helpers are jitted when triton is imported) runs
every case through ``merge_block``/``merge_at`` with the fused kernel on CPU tensors, counting launches.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch

NEG_INF = float("-inf")


class Case(NamedTuple):
    name: str
    b: int = 2
    s: int = 12
    h: int = 3
    dv: int = 8
    rows: slice | tuple[int, ...] = slice(2, 7)
    blk_dtype: torch.dtype = torch.float32
    empty: tuple[int, ...] = ()  # accumulator rows whose LSE is -inf (nothing merged yet)
    strided: bool = False  # accumulators and block as non-contiguous views
    lse_scale: float = 3.0


CASES = [
    Case("slice"),
    Case("slice with step", rows=slice(1, 12, 3)),
    Case("all rows", rows=slice(0, 12)),
    Case("index rows", rows=(9, 0, 4, 11, 2)),
    Case("empty accumulator rows, slice", empty=(2, 3, 6)),
    Case("empty accumulator rows, index", rows=(5, 1, 8), empty=(1, 8, 10)),
    Case("bf16 block", blk_dtype=torch.bfloat16, empty=(4,)),
    Case("fp16 block, index", blk_dtype=torch.float16, rows=(3, 7, 0)),
    Case("strided", strided=True, empty=(3,)),
    Case("strided, index", strided=True, rows=(6, 2, 10)),
    Case("Dv 40 (not a power of 2)", dv=40, h=2),
    Case("Dv 300 (several column tiles)", dv=300, b=1, h=2, rows=(1, 5)),
    Case("LSE gaps of ~1000", lse_scale=500.0, rows=(0, 3, 4, 9)),
    Case("one row", rows=slice(5, 6), b=1, h=1),
]


def rows_arg(case: Case) -> slice | torch.Tensor:
    return case.rows if isinstance(case.rows, slice) else torch.tensor(case.rows, dtype=torch.int64)


def make(case: Case, acc_dtype: torch.dtype = torch.float32, seed: int = 0):
    """(out_acc [B,S,H,Dv], lse_acc [B,H,S], out_blk [B,R,H,Dv], lse_blk [B,H,R]) for ``case``."""
    g = torch.Generator().manual_seed(seed)
    r = len(range(case.s)[case.rows]) if isinstance(case.rows, slice) else len(case.rows)
    out = torch.randn(case.b, case.s, case.h, case.dv, generator=g, dtype=acc_dtype)
    lse = torch.randn(case.b, case.h, case.s, generator=g, dtype=acc_dtype) * case.lse_scale
    ob = torch.randn(case.b, r, case.h, case.dv, generator=g).to(case.blk_dtype)
    lb = torch.randn(case.b, case.h, r, generator=g) * case.lse_scale
    if case.empty:
        rows = list(case.empty)
        out[:, rows] = 0.0  # an empty accumulator holds zeros, as merge_rows allocates it
        lse[:, :, rows] = NEG_INF
    if case.strided:  # same values, other memory orders: [B,H,S,Dv] / [B,S,H] storage, a padded Dv
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
        lse = lse.transpose(1, 2).contiguous().transpose(1, 2)
        padded = torch.zeros(*ob.shape[:3], ob.shape[3] * 2, dtype=ob.dtype)
        padded[..., ::2] = ob
        ob = padded[..., ::2]
        lb = lb.transpose(1, 2).contiguous().transpose(1, 2)
        assert not (out.is_contiguous() or lse.is_contiguous() or ob.is_contiguous() or lb.is_contiguous())
    return out, lse, ob, lb


def reference(out, lse, ob, lb, rows):
    """The merge in fp64, by the logaddexp formula (not the sigmoid/lerp form the code uses)."""
    out, lse = out.double().clone(), lse.double().clone()
    idx = torch.arange(out.shape[1])[rows] if isinstance(rows, slice) else rows
    la = lse[:, :, idx]
    lb = lb.double()
    m = torch.logaddexp(la, lb)
    wa, wb = torch.exp(la - m), torch.exp(lb - m)  # exactly 0 and 1 for an empty accumulator row
    out[:, idx] = wa.transpose(1, 2)[..., None] * out[:, idx] + wb.transpose(1, 2)[..., None] * ob.double()
    lse[:, :, idx] = m
    return out, lse


def check(case: Case, out, lse, ob, lb, got_out, got_lse) -> None:
    """``got_*`` (the merged accumulators) against the reference: close everywhere, equal bit for bit on
    rows not merged, and exactly the block's values on rows whose accumulator was empty."""
    rows = rows_arg(case)
    ref_out, ref_lse = reference(out, lse, ob, lb, rows)
    tol = dict(rtol=2e-6, atol=2e-6) if got_out.dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_out.double(), ref_out, **tol, msg=lambda m: f"{case.name}: out: {m}")
    lse_tol = dict(rtol=2e-7, atol=2e-6) if got_lse.dtype == torch.float32 else tol
    torch.testing.assert_close(got_lse.double(), ref_lse, **lse_tol, msg=lambda m: f"{case.name}: lse: {m}")
    idx = torch.arange(case.s)[rows] if isinstance(rows, slice) else rows
    untouched = torch.ones(case.s, dtype=torch.bool)
    untouched[idx] = False
    assert torch.equal(got_out[:, untouched], out[:, untouched]), f"{case.name}: a row not merged changed"
    assert torch.equal(got_lse[:, :, untouched], lse[:, :, untouched]), f"{case.name}: an LSE not merged changed"
    for j, row in enumerate(idx.tolist()):
        if row in case.empty:
            assert torch.equal(got_out[:, row], ob[:, j].to(got_out.dtype)), f"{case.name}: empty row {row} out"
            assert torch.equal(got_lse[:, :, row], lb[:, :, j].to(got_lse.dtype)), f"{case.name}: empty row {row} lse"


def run(case: Case, acc_dtype: torch.dtype = torch.float32) -> None:
    """Merge ``case`` with the library's entry point for its rows and check it."""
    from cp_attention.engine.merge import merge_at, merge_block

    out, lse, ob, lb = make(case, acc_dtype)
    got_out, got_lse = out.clone(), lse.clone()
    if case.strided:  # clone keeps strides of a dense tensor; keep the views' layout explicitly
        got_out = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype).copy_(out)
        got_lse = torch.empty_strided(lse.shape, lse.stride(), dtype=lse.dtype).copy_(lse)
        assert got_out.stride() == out.stride() and got_lse.stride() == lse.stride()
    rows = rows_arg(case)
    (merge_block if isinstance(rows, slice) else merge_at)(got_out, got_lse, ob, lb, rows)
    check(case, out, lse, ob, lb, got_out, got_lse)


def main() -> int:
    """Every case through the fused kernel on CPU (triton's interpreter), one launch per merge."""
    import triton.runtime.interpreter  # noqa: F401 - fails here, clearly, if the interpreter cannot load

    from cp_attention.engine import merge, merge_triton

    assert type(merge_triton._merge_kernel).__name__ == "InterpretedFunction", "set TRITON_INTERPRET=1"
    calls = []

    def counted(*args):
        calls.append(args)
        return merge_triton.fused_merge(*args)

    merge._FUSED_DEVICE, merge._fused_merge = "cpu", counted
    failed = 0
    for case in CASES:
        calls.clear()
        try:
            run(case)
            assert len(calls) == 1, f"{case.name}: {len(calls)} fused launches, expected 1"
            print(f"ok {case.name}")
        except AssertionError as e:
            failed += 1
            print(f"FAIL {case.name}: {e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
