"""Which kernel runs which block: ``auto``'s declared table, ordered by measured speed.

A call's blocks come in five kinds (:data:`BLOCK_KINDS`):

| kind | what | example |
|---|---|---|
| ``causal`` | a dense block, top-left causal | a ring's diagonal step |
| ``full`` | a dense block, no mask | a past shard's keys |
| ``window`` | a dense block with a sliding-window band | Mistral-style layers |
| ``varlen`` | a step's packed-document blocks as one variable-length call | ``cu_seqlens`` without a window |
| ``masked`` | packed-document blocks batched with a mask | ``cu_seqlens`` with a window |

:data:`AUTO_TABLE` lists, per device type, GPU generation and dtype, the kernels each kind tries in
order. The CUDA rows come from one H200 (2026-11-27, torch 2.11, bf16, 32/8 heads of 128, causal,
S = 16K-64K; issue 41): cuDNN ran dense causal blocks at 0.88-0.98x SDPA forward and 0.87-1.00x
forward+backward where torch's FA2 op ran 0.47-0.61x, so from sm90 on cuDNN comes first for dense
blocks; packed documents go to the only variable-length kernel (FA2's), windows to FA2's native
``window_size_left/right`` (no mask in memory), masked batches to the memory-efficient op. Below sm90
nothing was measured, so the order stays what it was (FA2 first).

:class:`KernelChoice` is ``auto`` for one call shape (device, dtype, head dims, softcap): it routes
each block to the first kernel of its kind's list that takes the block, asking each kernel's
:meth:`~cp_attention.kernels.base.AttentionKernel.block_refusal` (host ints: no sync). A refused block
(cuDNN and a one-token side) goes to the next kernel; ``math`` ends every list and refuses nothing,
so ``auto`` never fails where any kernel can run the block. The decision per block shape is made
once, and is the same on every rank (it reads only the table and the shape).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, cast

import torch

from ._cuda import device_capability
from .base import AttentionKernel, KernelBase, VarlenKernel, band_mask
from .dtypes import FLOAT_DTYPES

__all__ = ["AUTO_TABLE", "BLOCK_KINDS", "KernelChoice", "TableRow", "table_row"]

BLOCK_KINDS: tuple[str, ...] = ("causal", "full", "window", "varlen", "masked")


@dataclass(frozen=True)
class TableRow:
    """The kernels each block kind tries, in order, on ``device`` from ``min_capability`` on (None: any)
    for ``dtypes``."""

    device: str
    min_capability: tuple[int, int] | None
    dtypes: tuple[torch.dtype, ...]
    causal: tuple[str, ...]
    full: tuple[str, ...]
    window: tuple[str, ...]
    varlen: tuple[str, ...]
    masked: tuple[str, ...]

    def order(self, kind: str) -> tuple[str, ...]:
        return getattr(self, kind)


_HALF = (torch.float16, torch.bfloat16)
# flash_attn (the package) runs the same FA2 kernels as flash and is the one with softcap: with
# softcap every other fused kernel drops out of its lists.
AUTO_TABLE: tuple[TableRow, ...] = (
    TableRow("cuda", (9, 0), _HALF,
             causal=("cudnn", "flash", "flash_attn", "efficient", "math"),
             full=("cudnn", "flash", "flash_attn", "efficient", "math"),
             window=("flash", "efficient", "math"),
             varlen=("flash",),
             masked=("efficient", "math")),
    TableRow("cuda", (8, 0), _HALF,
             causal=("flash", "flash_attn", "efficient", "cudnn", "math"),
             full=("flash", "flash_attn", "efficient", "cudnn", "math"),
             window=("flash", "efficient", "math"),
             varlen=("flash",),
             masked=("efficient", "math")),
    TableRow("cuda", None, FLOAT_DTYPES,
             causal=("efficient", "math"), full=("efficient", "math"), window=("efficient", "math"),
             varlen=(), masked=("efficient", "math")),
    TableRow("cpu", None, FLOAT_DTYPES,
             causal=("cpu_flash", "math"), full=("cpu_flash", "math"), window=("cpu_flash", "math"),
             varlen=(), masked=("cpu_flash", "math")),
)
# Any other device: the reference.
_ANYWHERE = TableRow("*", None, FLOAT_DTYPES, ("math",), ("math",), ("math",), (), ("math",))


def table_row(device: torch.device, dtype: torch.dtype, capability: tuple[int, int] | None) -> TableRow:
    """The row of :data:`AUTO_TABLE` for ``device`` and ``dtype``; ``capability`` None (CUDA not yet
    initialised: a plan built ahead in a loader) takes the newest row."""
    for row in AUTO_TABLE:
        if row.device == device.type and dtype in row.dtypes and (
                row.min_capability is None or capability is None or capability >= row.min_capability):
            return row
    return _ANYWHERE


class KernelChoice(KernelBase):
    """``auto`` for one call shape: an :class:`~cp_attention.kernels.base.AttentionKernel` that runs each
    block on the first kernel of :data:`AUTO_TABLE` able to run it. ``picks`` names, per block kind, the
    kernel an ordinary block of that kind runs on (None: the kind is not available, e.g. ``varlen`` on
    a CPU, where packed documents run as batched or per-document blocks)."""

    name = "auto"

    def __init__(self, kernels: dict[str, AttentionKernel], device: torch.device, dtype: torch.dtype,
                 softcap: bool, head_dim: int | None, v_head_dim: int | None,
                 fits: Callable[[AttentionKernel], bool]) -> None:
        self.row = table_row(device, dtype, device_capability(device))
        self._head_dims = (head_dim, v_head_dim)

        def able(kind: str, kernel: AttentionKernel) -> bool:
            if kind == "varlen":
                return kernel.supports_varlen
            if kind == "window":
                return kernel.supports_band or kernel.supports_mask
            return kind != "masked" or kernel.supports_mask

        self.candidates: dict[str, tuple[AttentionKernel, ...]] = {
            kind: tuple(kernels[n] for n in self.row.order(kind) if fits(kernels[n]) and able(kind, kernels[n]))
            for kind in BLOCK_KINDS}
        self.picks: dict[str, str | None] = {
            kind: (found[0].name if found else None) for kind, found in self.candidates.items()}
        dense = self.candidates["causal"]
        if not dense:
            raise ValueError(f"no attention kernel supports device {device.type} with dtype {dtype}"
                             + (" and softcap" if softcap else ""))
        self.head_major_kv = dense[0].head_major_kv
        self.supports_softcap = softcap
        self.supports_mask = bool(self.candidates["masked"])
        self.supports_varlen = bool(self.candidates["varlen"])
        self.supports_band = bool(self.candidates["window"])
        self._routes: dict[tuple, AttentionKernel] = {}

    def __repr__(self) -> str:
        return f"KernelChoice({', '.join(f'{k}={v}' for k, v in self.picks.items())})"

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        return True  # built for one device and dtype

    def supports_shape(self, head_dim: int, v_head_dim: int | None = None) -> bool:
        """True for the head dims it was chosen for (its candidates were filtered by them; None: any)."""
        chosen, v_chosen = self._head_dims
        return chosen is None or (head_dim, v_head_dim or head_dim) == (chosen, v_chosen or chosen)

    def block_refusal(self, sq: int, sk: int, causal: bool) -> str | None:
        return None  # math, last in every list, runs every block

    def route(self, kind: str, sq: int, sk: int, causal: bool) -> AttentionKernel:
        """The kernel a ``[Sq, Sk]`` block of ``kind`` runs on: the first candidate that does not refuse
        it, decided once per shape."""
        key = (kind, sq, sk, causal)
        found = self._routes.get(key)
        if found is None:
            found = next((k for k in self.candidates[kind] if k.block_refusal(sq, sk, causal) is None), None)
            if found is None:
                raise ValueError(f"no kernel of auto's {kind!r} list ({', '.join(self.row.order(kind))}) can run a "
                                 f"{sq}x{sk} block")
            self._routes[key] = found
        return found

    def _dispatch(self, q: torch.Tensor, k: torch.Tensor, causal: bool, kwargs: dict
                  ) -> tuple[AttentionKernel, dict]:
        if "mask" in kwargs:
            kind = "masked"
        elif "band" in kwargs:
            kind = "window"
        else:
            kind = "causal" if causal else "full"
        kernel = self.route(kind, q.shape[1], k.shape[1], causal)
        if kind == "window" and not kernel.supports_band:
            band = kwargs["band"]
            kwargs = {**{n: v for n, v in kwargs.items() if n != "band"},
                      "mask": band_mask(q.shape[1], k.shape[1], *band, q.device)}
        return kernel, kwargs

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, **kwargs
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed kernel's forward (see :class:`~cp_attention.kernels.base.AttentionKernel`)."""
        kernel, kwargs = self._dispatch(q, k, causal, kwargs)
        return kernel.forward(q, k, v, causal, scale, **kwargs)

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, causal: bool, scale: float, **kwargs
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The routed kernel's backward: the same kernel as the block's forward (the route is per shape)."""
        kernel, kwargs = self._dispatch(q, k, causal, kwargs)
        return kernel.backward(dout, q, k, v, out, lse, causal, scale, **kwargs)

    def forward_varlen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                       cu_k: torch.Tensor, max_q: int, max_k: int, causal: bool, scale: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``varlen`` kernel's ``forward_varlen`` (see :class:`~cp_attention.kernels.cuda_flash.FlashKernel`)."""
        return self._varlen().forward_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)

    def backward_varlen(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int,
                        max_k: int, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The ``varlen`` kernel's ``backward_varlen``."""
        return self._varlen().backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale)

    def _varlen(self) -> VarlenKernel:
        # the "varlen" candidates were kept for their supports_varlen, so each is a VarlenKernel
        return cast(VarlenKernel, self.candidates["varlen"][0])
