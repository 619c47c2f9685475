"""What the fused CUDA kernels share: head-dim padding, GQA head expansion, and the one place that
turns our top-left causal blocks into calls a bottom-right-aligned op computes correctly.

Flash attention (PyTorch's and the flash-attn package's) aligns its causal mask to the BOTTOM-RIGHT
corner when ``Sq != Sk`` (query i sees key j iff j <= i + Sk - Sq); our protocol means TOP-LEFT
(j <= i). The two agree on square blocks, so :meth:`FusedKernel._pieces` splits a non-square causal
block into square-causal and full calls only:

- ``Sq < Sk``: keys ``j >= Sq`` are seen by no query; the block is ``q x k[:Sq]``, causal, square,
  and those keys get zero gradients.
- ``Sq > Sk``: rows ``[0, Sk)`` are ``q[:Sk] x k``, causal, square; rows ``[Sk, Sq)`` see every key,
  a full (non-causal) block.

Flash's ``window_size_right = Sq - Sk`` would express the same mask in one call, but flash clamps a
window ``>= Sk`` to "unbounded", which is wrong exactly when ``Sq >= 2 Sk``; squares avoid relying on it.
None of this touches CUDA at import or in :meth:`FusedKernel.supports`, so ``get_kernel("auto",
"cuda", ...)`` resolves on a CPU-only machine.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .base import KernelBase, band_mask, pad_last, positive_scale
from .reference import MathKernel

_BF16_CAPABILITY = (8, 0)

__all__ = ["FusedKernel", "band_pieces", "device_capability", "fold_heads", "pad_head", "repeat_heads", "round_up"]


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """``device``'s CUDA compute capability, or None for a non-CUDA device or while CUDA is not
    initialised (asked only once tensors live there, so resolving a kernel never initialises CUDA)."""
    if device.type != "cuda" or not torch.cuda.is_initialized():
        return None
    try:
        major, minor = torch.cuda.get_device_capability(device)
        return major, minor
    except (RuntimeError, AssertionError, ValueError):
        return None


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def pad_head(x: torch.Tensor, size: int) -> torch.Tensor:
    """``x [..., d]`` zero-padded to ``[..., size]`` (zero columns leave every dot product unchanged),
    with a unit last stride and a 16-byte aligned start, as the fused ops' vector loads need."""
    if x.shape[-1] != size:
        return pad_last(x, size)
    if x.stride(-1) != 1 or (x.device.type == "cuda" and x.data_ptr() % 16):
        return x.contiguous()
    return x


def repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``x [B, S, Hkv, D]`` -> ``[B, S, heads, D]``, each K/V head repeated for its query-head group
    (for ops without GQA; query head h reads K/V head h // (heads // Hkv))."""
    b, s, hkv, d = x.shape
    if hkv == heads:
        return x
    return x[:, :, :, None].expand(b, s, hkv, heads // hkv, d).reshape(b, s, heads, d)


def fold_heads(dx: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Gradients ``[B, S, H, D]`` of repeated K/V heads summed back to ``[B, S, kv_heads, D]`` (in fp32)."""
    b, s, h, d = dx.shape
    if h == kv_heads:
        return dx
    return dx.reshape(b, s, kv_heads, h // kv_heads, d).float().sum(3)


def band_pieces(sq: int, sk: int, lo: int, hi: int) -> list[tuple[slice, slice, int, int]]:
    """``(query rows, key rows, window_left, window_right)`` calls of a bottom-right-aligned windowed op
    (flash's: query i sees key j iff i + Sk - Sq - left <= j <= i + Sk - Sq + right, -1 unbounded, a
    side >= Sk clamped to unbounded) that compute the band ``lo <= j - i <= hi`` of a ``[Sq, Sk]``
    block exactly. Every query row must see a key (the kernel protocol's promise).

    Keys no row sees are cut off first; then the band's offsets straddle the block's bottom-right
    diagonal, so both windows are >= 0. A side that restricts nothing is passed unbounded. The one
    case the op's clamp would break (a right window >= the keys left, with rows past it that it
    restricts) splits the rows in two pieces, each of which is exact."""
    k0, k1 = max(0, lo), min(sk, sq - 1 + hi + 1)
    n = k1 - k0
    d = n - sq  # the op's diagonal offset on the cut keys
    left = -1 if lo - k0 <= -(sq - 1) else d - (lo - k0)
    right = -1 if hi - k0 >= n - 1 else (hi - k0) - d
    if right >= n:  # clamped to unbounded: split where the right side starts restricting nothing
        r = k1 - 1 - hi  # rows i >= r see every key up to k1 - 1
        top = band_pieces(r, sk, lo, hi)
        bottom = band_pieces(sq - r, sk, lo + r, hi + r)
        return top + [(slice(rows.start + r, rows.stop + r), keys, wl, wr) for rows, keys, wl, wr in bottom]
    return [(slice(0, sq), slice(k0, k1), left, right)]


def _slice_kwargs(kwargs: dict, rows: slice, keys: slice) -> dict:
    mask = kwargs.get("mask")
    return kwargs if mask is None else {**kwargs, "mask": mask[:, rows, keys]}


def _abstract_hook(self: Any, *args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


class FusedKernel(KernelBase):
    """Base of the CUDA kernels: subclasses implement ``_fwd``/``_bwd`` for blocks whose causal mask,
    if any, is square (unless ``top_left_native``); this class handles the rest of the protocol.

    A negative scale runs as ``(-q) . k * |scale|`` (online-softmax kernels take the row maximum of
    the unscaled scores, which a negative scale would turn into the minimum). Shapes beyond
    ``max_head_dim`` (after padding to a multiple of 8; e.g. backward's extra LSE-gradient column on a
    head dim of 256) run on the memory-efficient kernel, or on ``math`` with softcapping.
    """

    name = "fused"
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
    max_head_dim: int | None = None  # largest padded head dim the op takes; None: any
    top_left_native = False  # True: the op itself masks causal blocks top-left
    # The smallest block side the op runs exactly (after causal blocks are cut into squares): cuDNN's
    # is 2 (see cuda_cudnn).
    min_block = 1
    min_capability: tuple[int, int] | None = (8, 0)  # flash and cuDNN attention need Ampere or newer

    def supports(self, device: torch.device | str, dtype: torch.dtype) -> bool:
        device = torch.device(device)
        return device.type == "cuda" and dtype in self.dtypes and self._capable(device, dtype)

    def _capable(self, device: torch.device, dtype: torch.dtype) -> bool:
        # bf16 needs Ampere in every fused op (PyTorch's CUTLASS kernels have no bf16 below sm80: "no
        # kernel found to launch"), whatever the op's own minimum.
        need = max(self.min_capability or (0, 0), _BF16_CAPABILITY if dtype == torch.bfloat16 else (0, 0))
        have = device_capability(device)
        return need == (0, 0) or have is None or have >= need

    def supports_shape(self, head_dim: int, v_head_dim: int | None = None) -> bool:
        """Whether the op takes q/k head dim ``head_dim`` and v head dim ``v_head_dim`` (default: the same)."""
        if self.max_head_dim is None:
            return True
        return round_up(max(head_dim, v_head_dim or head_dim), 8) <= self.max_head_dim

    def block_refusal(self, sq: int, sk: int, causal: bool) -> str | None:
        """Why a ``[Sq, Sk]`` block cannot run here: a call of it (a square piece of a causal block)
        with a side shorter than :attr:`min_block`."""
        pieces = self._pieces(sq, sk, causal) or [(slice(0, sq), slice(0, sk), causal)]
        for rows, keys, _ in pieces:
            if min(rows.stop - rows.start, keys.stop - keys.start) < self.min_block:
                return (f"kernel {self.name!r} cannot run a {sq}x{sk} block: it needs at least {self.min_block} "
                        f"query rows and keys per call")
        return None

    def _refuse(self, sq: int, sk: int, causal: bool) -> None:
        # A block the op cannot run exactly is an error, never a crash or NaN inside the op: ``auto``
        # routes such blocks elsewhere, and validation refuses a call that names this kernel for them.
        if self.min_block > 1:
            problem = self.block_refusal(sq, sk, causal)
            if problem is not None:
                raise ValueError(f"{problem}; use kernel='auto', which runs such blocks on the next kernel")

    # The op's calls: ``_fwd(q, k, v, causal, scale, **op_keywords) -> (out, lse)`` and
    # ``_bwd(dout, q, k, v, out, lse, causal, scale, **op_keywords) -> (dq, dk, dv)``. Each op takes its
    # own keywords (mask, window, softcap), so the hooks are typed as callables of any arguments.
    _fwd: Callable[..., tuple[torch.Tensor, torch.Tensor]] = _abstract_hook
    _bwd: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = _abstract_hook

    def _pieces(self, sq: int, sk: int, causal: bool) -> list[tuple[slice, slice, bool]] | None:
        """``(query rows, key rows, causal)`` calls that compute a top-left causal block with square
        causal blocks only, or None when the block runs as one call."""
        if not causal or sq == sk or self.top_left_native:
            return None
        if sq < sk:
            return [(slice(0, sq), slice(0, sq), True)]
        return [(slice(0, sk), slice(0, sk), True), (slice(sk, sq), slice(0, sk), False)]

    # The kernel that runs head dims beyond max_head_dim (the memory-efficient one, which takes any):
    # set by the subclasses that have a limit, so this module needs none of them.
    wide_fallback: FusedKernel | None = None

    def _fallback(self, kwargs: dict):
        return MathKernel() if kwargs.get("softcap") else self.wide_fallback

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, **kwargs
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``out [B, Sq, H, Dv]`` (q's dtype) and ``lse [B, H, Sq]`` (fp32, natural log)."""
        kwargs = self._band_as_mask(q, k, kwargs)
        if not self.supports_shape(q.shape[-1], v.shape[-1]):
            return self._fallback(kwargs).forward(q, k, v, causal, scale, **kwargs)
        q, scale, _ = positive_scale(q, scale)
        band = kwargs.pop("band", None)
        if band is not None:
            return self._band_forward(q, k, v, band, scale, kwargs)
        self._refuse(q.shape[1], k.shape[1], causal)
        pieces = self._pieces(q.shape[1], k.shape[1], causal)
        if pieces is None:
            return self._fwd(q, k, v, causal, scale, **kwargs)
        outs, lses = [], []
        for rows, keys, square_causal in pieces:
            o, lse = self._fwd(q[:, rows], k[:, keys], v[:, keys], square_causal, scale,
                               **_slice_kwargs(kwargs, rows, keys))
            outs.append(o)
            lses.append(lse)
        return torch.cat(outs, 1), torch.cat(lses, 2)

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, causal: bool, scale: float, **kwargs
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``dq [B, Sq, H, D]``, ``dk [B, Sk, Hkv, D]``, ``dv [B, Sk, Hkv, Dv]`` given the final ``out``/``lse``."""
        kwargs = self._band_as_mask(q, k, kwargs)
        if not self.supports_shape(q.shape[-1], v.shape[-1]):
            return self._fallback(kwargs).backward(dout, q, k, v, out, lse, causal, scale, **kwargs)
        q, scale, sign = positive_scale(q, scale)
        band = kwargs.pop("band", None)
        pieces = self._pieces(q.shape[1], k.shape[1], causal)
        if band is None:
            self._refuse(q.shape[1], k.shape[1], causal)
        if band is not None:
            dq, dk, dv = self._band_backward(dout, q, k, v, out, lse, band, scale, kwargs)
        elif pieces is None:
            dq, dk, dv = self._bwd(dout, q, k, v, out, lse, causal, scale, **kwargs)
        else:
            dqs = []
            dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
            dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
            for rows, keys, square_causal in pieces:
                g = self._bwd(dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows], lse[:, :, rows],
                              square_causal, scale, **_slice_kwargs(kwargs, rows, keys))
                dqs.append(g[0])
                dk[:, keys] += g[1]
                dv[:, keys] += g[2]
            dq = torch.cat(dqs, 1)
        return (dq if sign > 0 else -dq), dk, dv

    def _band_as_mask(self, q: torch.Tensor, k: torch.Tensor, kwargs: dict) -> dict:
        """``kwargs`` with a ``band`` this kernel (or the shape's fallback) cannot take natively as a mask."""
        band = kwargs.get("band")
        if band is None or (self.supports_band and self.supports_shape(q.shape[-1])):
            return kwargs
        rest = {key: value for key, value in kwargs.items() if key != "band"}
        return {**rest, "mask": band_mask(q.shape[1], k.shape[1], *band, q.device)}

    # ---- native windows (supports_band): the op's window_size_left/right, one call per band piece
    def _band_forward(self, q, k, v, band: tuple[int, int], scale: float, kwargs: dict):
        outs, lses = [], []
        for rows, keys, left, right in band_pieces(q.shape[1], k.shape[1], *band):
            o, lse = self._fwd(q[:, rows], k[:, keys], v[:, keys], False, scale, window=(left, right), **kwargs)
            outs.append(o)
            lses.append(lse)
        return (outs[0], lses[0]) if len(outs) == 1 else (torch.cat(outs, 1), torch.cat(lses, 2))

    def _band_backward(self, dout, q, k, v, out, lse, band: tuple[int, int], scale: float, kwargs: dict):
        pieces = band_pieces(q.shape[1], k.shape[1], *band)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        dqs = []
        for rows, keys, left, right in pieces:
            g = self._bwd(dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows], lse[:, :, rows], False,
                          scale, window=(left, right), **kwargs)
            dqs.append(g[0])
            dk[:, keys] += g[1]
            dv[:, keys] += g[2]
        return (dqs[0] if len(dqs) == 1 else torch.cat(dqs, 1)), dk, dv
