"""Local attention kernels and the registry that picks one by name, device and dtype."""

from __future__ import annotations

import torch

from .base import AttentionKernel, accumulation_dtype
from .math import MathKernel
from .sdpa import SdpaCpuKernel

__all__ = ["AttentionKernel", "accumulation_dtype", "check_kernel_name", "get_kernel", "KERNEL_NAMES", "MathKernel",
           "SdpaCpuKernel"]

_KERNELS: dict[str, AttentionKernel] = {k.name: k for k in (SdpaCpuKernel(), MathKernel())}
# "auto" tries these in order: fastest first, the reference last.
_AUTO_ORDER = ("sdpa", "math")
KERNEL_NAMES: tuple[str, ...] = ("auto", *_KERNELS)


def check_kernel_name(name: str) -> str:
    """Return ``name`` if it names a kernel (or ``"auto"``); raise ``ValueError`` listing the names otherwise."""
    if name not in KERNEL_NAMES:
        raise ValueError(f"unknown kernel {name!r}; expected one of: {', '.join(KERNEL_NAMES)}")
    return name


def get_kernel(name: str, device: "torch.device | str", dtype: torch.dtype, softcap: bool = False,
               mask: bool = False) -> AttentionKernel:
    """The kernel called ``name`` ("auto" = the fastest that supports ``device``, ``dtype`` and, with
    ``softcap``, logit softcapping, with ``mask``, masked blocks (sliding windows)).

    Raises ``ValueError`` for an unknown name, or a kernel that does not support the device, dtype,
    softcapping or masks (the message names one that does).
    """
    device = torch.device(device)

    def fits(kernel: AttentionKernel) -> bool:
        return (kernel.supports(device, dtype) and (not softcap or getattr(kernel, "supports_softcap", False))
                and (not mask or getattr(kernel, "supports_mask", False)))

    if name == "auto":
        for n in _AUTO_ORDER:
            if fits(_KERNELS[n]):
                return _KERNELS[n]
        raise ValueError(f"no attention kernel supports device {device.type} with dtype {dtype}"
                         + (" and softcap" if softcap else "") + (" and sliding windows" if mask else ""))
    kernel = _KERNELS[check_kernel_name(name)]
    if not kernel.supports(device, dtype):
        raise ValueError(
            f"kernel {name!r} does not support device {device.type} with dtype {dtype}; "
            f"use kernel='auto' or kernel='math'"
        )
    if not fits(kernel):
        able = next((n for n in _AUTO_ORDER if fits(_KERNELS[n])), "auto")
        what = "softcap" if softcap and not getattr(kernel, "supports_softcap", False) else "sliding windows (masks)"
        raise ValueError(f"kernel {name!r} cannot apply {what}; use kernel={able!r} (or kernel='auto')")
    return kernel
