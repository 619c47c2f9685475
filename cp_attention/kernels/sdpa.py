"""Old home of the CPU flash kernel, kept so ``cp_attention.kernels.sdpa`` imports keep working.

The kernel is :class:`~cp_attention.kernels.cpu_flash.CpuFlashKernel`, registered as ``cpu_flash``
(``sdpa`` stays accepted as an alias of that name).
"""

from __future__ import annotations

from .cpu_flash import CpuFlashKernel

SdpaCpuKernel = CpuFlashKernel

__all__ = ["SdpaCpuKernel"]
