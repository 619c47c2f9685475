"""The kernel protocol: one local attention block with its log-sum-exp, forward and backward.

Tensors are bshd: ``q [B, Sq, H, D]``, ``k [B, Sk, Hkv, D]``, ``v [B, Sk, Hkv, Dv]`` with
``H % Hkv == 0`` (GQA/MQA: the kernel broadcasts K/V heads itself, never the caller). Inputs may be
strided views (slices along the sequence, head-major memory), but every tensor a kernel receives has a
unit stride in its last dimension: the engine guarantees it once per call (:func:`unit_stride`), because
the fused ops assume it (PyTorch's CPU flash op silently computes garbage on other strides; the CUDA
ops refuse them). ``causal`` is the top-left-aligned lower triangle.
Nothing here assumes a CPU: a kernel declares the devices and dtypes it supports.
"""

from __future__ import annotations

import functools
import weakref
from typing import Callable, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

__all__ = ["AttentionKernel", "KernelBase", "MaskCache", "VarlenKernel", "accumulation_dtype", "band_mask",
           "pad_last", "positive_scale", "unit_stride"]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype out/LSE/gradients accumulate in: fp32, or fp64 for fp64 inputs (so fp64 stays exact)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def unit_stride(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its last dimension has stride 1, else a contiguous copy of it: the one memory
    property every kernel relies on (other strides, e.g. ``x[..., ::2]`` or a transposed last dim,
    give wrong results on PyTorch's CPU flash op, silently)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def pad_last(x: torch.Tensor, size: int) -> torch.Tensor:
    """``x [..., d]`` zero-padded to ``[..., size]``: zero columns leave every dot product unchanged,
    so ops that need equal (or aligned) head dims compute the same result."""
    return x if x.shape[-1] == size else F.pad(x, (0, size - x.shape[-1]))


def positive_scale(q: torch.Tensor, scale: float) -> tuple[torch.Tensor, float, float]:
    """``(q', scale', sign)`` with ``scale' = |scale|`` and ``q' . k * scale'`` the same score as
    ``q . k * scale``: fused online-softmax ops take the row maximum of the unscaled scores, which a
    negative scale would turn into the minimum (the CPU op returns NaN). Multiply ``dq`` by ``sign``."""
    if scale < 0:
        return -q, -scale, -1.0
    return q, scale, 1.0


@runtime_checkable
class AttentionKernel(Protocol):
    """A local attention backend. Its optional capabilities are attributes every kernel has: inherit
    :class:`KernelBase` for their defaults (off) and override what the kernel does."""

    name: str
    # True if the kernel runs faster on K/V stored head-major ([B, H, S, D] memory). The engine then
    # keeps travelling shards that way and still passes [B, S, H, D]-shaped views.
    head_major_kv: bool
    # True if forward and backward take ``softcap`` (flash-attn's: scores become
    # softcap * tanh(scores / softcap) after scaling, before masking). The engine passes it only
    # when it is non-zero, so a kernel without it keeps the plain signature.
    supports_softcap: bool
    # True if forward and backward take ``mask [B, Sq, Sk]`` (bool, True = may attend, combined with
    # ``causal``). Packed documents then batch many small blocks into one call; without it each
    # document block runs as its own call. Passed only when in use.
    supports_mask: bool
    # True if the kernel has ``forward_varlen``/``backward_varlen`` (variable-length batches of packed
    # documents, one call per mask kind) for the head dims :meth:`supports_shape` takes.
    supports_varlen: bool
    # True if forward and backward take ``band=(lo, hi)`` (query i sees key j iff lo <= j - i <= hi)
    # natively, instead of a materialised mask (flash's window_size_left/right).
    supports_band: bool

    def block_refusal(self, sq: int, sk: int, causal: bool) -> str | None:
        """Why the kernel cannot run a ``[Sq, Sk]`` block (causal: top-left), or None if it can. Judged from
        host ints only: the plan asks once per block shape, so a refused block goes to the next kernel."""
        ...

    def supports_shape(self, head_dim: int, v_head_dim: int | None = None) -> bool:
        """Whether the kernel takes these q/k and v head dims; ``get_kernel(..., head_dim=...)`` consults it."""
        ...

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether this kernel runs on ``device`` with inputs of ``dtype``."""
        ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``out [B, Sq, H, Dv]`` (any float dtype) and ``lse [B, H, Sq]`` (natural log,
        :func:`accumulation_dtype` of q's dtype). Every query row sees at least one key."""
        ...

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients of this block given the FINAL merged ``out [B, Sq, H, Dv]`` and
        ``lse [B, H, Sq]`` of these query rows (so the block's probabilities are exp(s - lse)).

        Returns ``dq [B, Sq, H, D]``, ``dk [B, Sk, Hkv, D]``, ``dv [B, Sk, Hkv, Dv]`` in any float dtype.
        """
        ...


class VarlenKernel(AttentionKernel, Protocol):
    """A kernel with ``supports_varlen``: it also runs variable-length batches of packed sequences
    (see :meth:`~cp_attention.kernels.cuda_flash.FlashKernel.forward_varlen` for the shapes)."""

    def forward_varlen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                       cu_k: torch.Tensor, max_q: int, max_k: int, causal: bool, scale: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """``out [Tq, H, Dv]`` and ``lse [H, Tq]`` of sequences packed along dim 0."""
        ...

    def backward_varlen(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int,
                        max_k: int, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``dq [Tq, H, D]``, ``dk [Tk, Hkv, D]``, ``dv [Tk, Hkv, Dv]`` given the final ``out``/``lse``."""
        ...


class KernelBase:
    """The defaults of :class:`AttentionKernel`'s optional capabilities, all off: every kernel inherits
    them and overrides what it supports."""

    name: str = "kernel"
    head_major_kv: bool = False
    supports_softcap: bool = False
    supports_mask: bool = False
    supports_varlen: bool = False
    supports_band: bool = False

    def supports_shape(self, head_dim: int, v_head_dim: int | None = None) -> bool:
        """Every head dim, unless the kernel says otherwise."""
        return True

    def block_refusal(self, sq: int, sk: int, causal: bool) -> str | None:
        """Every block shape, unless the kernel says otherwise."""
        return None


class MaskCache:
    """A kernel's conversion of the engine's long-lived bool masks (band masks, packed-document batches),
    per dtype: every layer and the backward reuse a mask, so each is converted once. Keyed by the
    mask's id and dropped with the mask (tensors compare elementwise, so no WeakKeyDictionary)."""

    def __init__(self, build: Callable[[torch.Tensor, torch.dtype], torch.Tensor]) -> None:
        self._build = build
        self._store: dict[int, dict[torch.dtype, torch.Tensor]] = {}

    def get(self, mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
        """``build(mask, dtype)``, made once per mask and dtype; None for no mask."""
        if mask is None:
            return None
        per_dtype = self._store.get(id(mask))
        if per_dtype is None:
            per_dtype = self._store[id(mask)] = {}
            weakref.finalize(mask, self._store.pop, id(mask), None)
        if dtype not in per_dtype:
            per_dtype[dtype] = self._build(mask, dtype)
        return per_dtype[dtype]


@functools.lru_cache(maxsize=256)
def band_mask(rows: int, cols: int, lo: int, hi: int, device: torch.device) -> torch.Tensor:
    """``[1, rows, cols]`` bool: query ``i`` may see key ``b`` iff ``lo <= b - i <= hi`` (cached, so
    kernels that convert masks do it once)."""
    offset = torch.arange(cols, device=device)[None, :] - torch.arange(rows, device=device)[:, None]
    return ((offset >= lo) & (offset <= hi))[None]
