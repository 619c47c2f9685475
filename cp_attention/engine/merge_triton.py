"""The ring's out/LSE merge as one Triton kernel: read, merge and write each row once, in one launch.

Imported by :mod:`cp_attention.engine.merge` on the first merge of CUDA fp32 accumulators, never by
``import cp_attention``; triton is optional (not a dependency): without it :func:`available` is False
and nothing here runs. The kernel is defined only when triton imports.

Per (batch ``b``, block row ``r``, head ``h``), with ``row`` = ``r`` (a slice: the views carry the
offset and step) or ``rows[r]`` (an int64 index; the rows must be distinct), in the accumulator's
dtype (fp32), the block read in its own dtype and widened:

    la = lse_acc[b, h, row]; lb = lse_blk[b, h, r]; d = lb - la; w = sigmoid(d)
    out_acc[b, row, h, :] = lerp(out_acc[b, row, h, :], out_blk[b, r, h, :], w)   # torch.lerp's formula
    lse_acc[b, h, row] = max(la, lb) + log1p(exp(-|d|))                           # = logaddexp(la, lb)

A row whose accumulator is empty (``la = -inf``) gets ``w = 1`` and ``log1p(0) = 0``: it takes the
block's output and LSE exactly. Block rows must be non-empty (finite ``lb``), as for the torch path.
"""

from __future__ import annotations

import contextlib
import functools

import torch

__all__ = ["available", "fused_merge"]

try:  # optional: the module imports without triton, and then never launches
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

# Rows of a program's tile, and the widest Dv one tile spans (wider heads loop over Dv).
_ROWS, _MAX_D = 16, 256


@functools.cache
def available() -> bool:
    """Whether triton imported (checked once)."""
    return triton is not None


if triton is not None:
    @triton.jit
    def _merge_kernel(out_ptr, lse_ptr, ob_ptr, lb_ptr, idx_ptr, n_rows, R, H, D,
                      so_b, so_s, so_h, so_d, sl_b, sl_h, sl_s,
                      sob_b, sob_r, sob_h, sob_d, slb_b, slb_h, slb_r,
                      HAS_INDEX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        # One tile: BLOCK_M flattened (b, r, h) rows (h fastest, so a contiguous accumulator's rows
        # are adjacent in memory) by BLOCK_D of Dv; offsets in int64 (accumulators pass 2**31 elements).
        n = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        live = n < n_rows
        h = n % H
        r = (n // H) % R
        b = n // (H * R)
        if HAS_INDEX:
            row = tl.load(idx_ptr + r, mask=live, other=0).to(tl.int64)
        else:
            row = r
        la_ptrs = lse_ptr + b * sl_b + h * sl_h + row * sl_s
        la = tl.load(la_ptrs, mask=live, other=0.0)
        lb = tl.load(lb_ptr + b * slb_b + h * slb_h + r * slb_r, mask=live, other=0.0).to(la.dtype)
        d = lb - la
        w = tl.sigmoid(d)
        # log1p(e) from log(1 + e) without losing a tiny e (Goldberg's correction): e == 0 when la = -inf.
        e = tl.exp(-tl.abs(d))
        u = 1.0 + e
        l1p = tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))
        tl.store(la_ptrs, tl.maximum(la, lb) + l1p, mask=live)
        w2 = w[:, None]
        o_row = out_ptr + (b * so_b + row * so_s + h * so_h)[:, None]
        b_row = ob_ptr + (b * sob_b + r * sob_r + h * sob_h)[:, None]
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D).to(tl.int64)
            m = live[:, None] & (cols < D)[None, :]
            o_ptrs = o_row + cols[None, :] * so_d
            o = tl.load(o_ptrs, mask=m, other=0.0)
            ob = tl.load(b_row + cols[None, :] * sob_d, mask=m, other=0.0).to(o.dtype)
            # torch.lerp's two-sided formula: exact at w = 0 and w = 1 (an empty accumulator row).
            lo = o + w2 * (ob - o)
            hi = ob - (ob - o) * (1.0 - w2)
            tl.store(o_ptrs, tl.where(w2 < 0.5, lo, hi), mask=m)


def fused_merge(out_acc: torch.Tensor, lse_acc: torch.Tensor, out_blk: torch.Tensor, lse_blk: torch.Tensor,
                rows: slice | torch.Tensor) -> bool:
    """Merge a block into the accumulators in place, in one kernel launch; see the module docstring.

    ``out_acc [B, S, H, Dv]`` and ``lse_acc [B, H, S]`` (fp32, any strides); ``out_blk [B, R, H, Dv]``
    and ``lse_blk [B, H, R]`` (any float dtype and strides) for the rows ``rows``: a slice, or an int64
    tensor of R distinct rows on the accumulators' device. Returns False, touching nothing, when triton
    is missing (the caller then merges in torch); True once launched. Never reads device data on the host.
    """
    if not available():
        return False
    if isinstance(rows, slice):
        out_acc, lse_acc, idx = out_acc[:, rows], lse_acc[:, :, rows], None
    else:
        idx = rows
    b, r, h, d = out_blk.shape
    _check(out_acc, lse_acc, lse_blk, idx, (b, r, h, d))
    n_rows = b * r * h
    if n_rows == 0 or d == 0:
        return True
    block_d = min(triton.next_power_of_2(d), _MAX_D)
    grid = (triton.cdiv(n_rows, _ROWS),)
    device = out_acc.device
    # Triton launches on the current device; keep a tensor on another GPU from being launched wrongly.
    guard = device.type == "cuda" and device.index != torch.cuda.current_device()
    with torch.cuda.device(device) if guard else contextlib.nullcontext():
        _merge_kernel[grid](out_acc, lse_acc, out_blk, lse_blk, out_acc if idx is None else idx, n_rows, r, h, d,
                            *out_acc.stride(), *lse_acc.stride(), *out_blk.stride(), *lse_blk.stride(),
                            HAS_INDEX=idx is not None, BLOCK_M=_ROWS, BLOCK_D=block_d)
    return True



def _check(out_acc: torch.Tensor, lse_acc: torch.Tensor, lse_blk: torch.Tensor, idx: torch.Tensor | None,
           blk: tuple[int, int, int, int]) -> None:
    """Shapes the kernel relies on (it reads by strides, so a mismatch would read out of bounds)."""
    b, r, h, d = blk
    s = out_acc.shape[1]
    rows_ok = s == r if idx is None else (idx.shape == (r,) and idx.dtype == torch.int64
                                          and idx.device == out_acc.device)
    if (out_acc.dim() != 4 or out_acc.shape[0] != b or tuple(out_acc.shape[2:]) != (h, d)
            or tuple(lse_acc.shape) != (b, h, s) or tuple(lse_blk.shape) != (b, h, r) or not rows_ok):
        raise ValueError(
            f"merge: block out {tuple(blk)} / lse {tuple(lse_blk.shape)} does not fit accumulators out "
            f"{tuple(out_acc.shape)} / lse {tuple(lse_acc.shape)} at "
            f"{'a slice' if idx is None else f'rows {tuple(idx.shape)} {idx.dtype} on {idx.device}'}; expected "
            f"out_blk [B, R, H, Dv], lse_blk [B, H, R] and rows selecting R rows (an int64 tensor on the "
            f"accumulators' device); pass the block computed for exactly those rows")
