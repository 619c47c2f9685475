"""Local attention kernels and the registry that picks one by name, device, dtype and shape.

| name | device | dtypes | op |
|---|---|---|---|
| ``cpu_flash`` (alias ``sdpa``) | CPU | all float | ``aten._scaled_dot_product_flash_attention_for_cpu`` |
| ``flash`` | CUDA | fp16, bf16 | ``aten._flash_attention_forward/backward`` (head dim <= 256) |
| ``flash_attn`` | CUDA | fp16, bf16 | the flash-attn package, when importable (softcap) |
| ``efficient`` | CUDA | fp16, bf16, fp32 | ``aten._efficient_attention_forward/backward`` (any head dim, masks) |
| ``cudnn`` | CUDA | fp16, bf16 | ``aten._scaled_dot_product_cudnn_attention(_backward)`` (head dim <= 128) |
| ``math`` | any | all float | plain PyTorch, the reference |

``auto`` routes each block to the fastest kernel that takes it, by the declared table in
:mod:`.choice` (cuDNN for dense blocks from sm90 on, FA2's varlen op for packed documents, FA2's
native windows, ...).
"""

from __future__ import annotations

import torch

from ._cuda import device_capability
from .base import AttentionKernel, KernelBase, accumulation_dtype
from .choice import AUTO_TABLE, BLOCK_KINDS, KernelChoice, table_row
from .cpu_flash import CpuFlashKernel
from .cuda_cudnn import CudnnKernel
from .cuda_efficient import EfficientKernel
from .cuda_flash import FlashKernel
from .cuda_flash_attn import FlashAttnKernel
from .reference import MathKernel

SdpaCpuKernel = CpuFlashKernel  # the old class name (``cp_attention.kernels.sdpa`` is gone)

__all__ = ["AUTO_TABLE", "AttentionKernel", "BLOCK_KINDS", "KernelBase", "KernelChoice", "accumulation_dtype",
           "check_kernel_name", "CpuFlashKernel", "CudnnKernel", "EfficientKernel", "FlashAttnKernel", "FlashKernel",
           "get_kernel", "KERNEL_NAMES", "MathKernel", "resolve_kernel_name", "SdpaCpuKernel"]

_KERNELS: dict[str, AttentionKernel] = {k.name: k for k in (
    CpuFlashKernel(), FlashKernel(), FlashAttnKernel(), EfficientKernel(), CudnnKernel(), MathKernel())}
# Old names still accepted; each resolves to the kernel it names.
_ALIASES: dict[str, str] = {"sdpa": "cpu_flash"}
# Every accepted name, aliases included: validation encodes a kernel as an index into this tuple.
KERNEL_NAMES: tuple[str, ...] = ("auto", *_KERNELS, *_ALIASES)


def check_kernel_name(name: str) -> str:
    """Return ``name`` if it names a kernel (or ``"auto"``); raise ``ValueError`` listing the names otherwise."""
    if name not in KERNEL_NAMES:
        raise ValueError(f"unknown kernel {name!r}; expected one of: {', '.join(KERNEL_NAMES)}")
    return name


def resolve_kernel_name(name: str) -> str:
    """The registered kernel name ``name`` stands for (an alias resolved; ``"auto"`` stays ``"auto"``).

    Raises ``ValueError`` for an unknown name.
    """
    name = check_kernel_name(name)
    return _ALIASES.get(name, name)


def _shape_ok(kernel: AttentionKernel, head_dim: int | None, v_head_dim: int | None) -> bool:
    return head_dim is None or kernel.supports_shape(head_dim, v_head_dim or head_dim)


def get_kernel(name: str, device: torch.device | str, dtype: torch.dtype, softcap: bool = False,
               mask: bool = False, head_dim: int | None = None, v_head_dim: int | None = None
               ) -> AttentionKernel:
    """The kernel called ``name`` for ``device`` and ``dtype``, with ``softcap`` logit softcapping, with
    ``mask`` sliding windows, and q/k and v head dims ``head_dim``/``v_head_dim`` (None: not considered).

    ``"auto"`` returns a :class:`~cp_attention.kernels.choice.KernelChoice`: each block runs on the
    fastest kernel of :data:`~cp_attention.kernels.choice.AUTO_TABLE` that takes it (its ``picks`` name
    them per block kind). Needs no CUDA: ``get_kernel("auto", "cuda", torch.bfloat16)`` resolves on any
    machine (as the newest GPU row until CUDA is initialised).

    Raises ``ValueError`` for an unknown name, or a kernel that does not support the device, dtype,
    softcapping, windows or head dims (the message names one that does).
    """
    device = torch.device(device)

    def fits(kernel: AttentionKernel) -> bool:
        return (kernel.supports(device, dtype) and (not softcap or kernel.supports_softcap)
                and _shape_ok(kernel, head_dim, v_head_dim))

    def windowed(kernel: AttentionKernel) -> bool:
        return not mask or kernel.supports_mask or kernel.supports_band

    if name == "auto":
        return KernelChoice(_KERNELS, device, dtype, softcap, head_dim, v_head_dim, fits)
    kernel = _KERNELS[resolve_kernel_name(name)]
    row = table_row(device, dtype, device_capability(device))
    able = next((n for n in row.order("window" if mask else "causal")
                 if fits(_KERNELS[n]) and windowed(_KERNELS[n])), "math")
    if not kernel.supports(device, dtype):
        raise ValueError(
            f"kernel {name!r} does not support device {device.type} with dtype {dtype} (on this GPU); "
            f"use kernel={able!r} (or kernel='auto')"
        )
    if not (fits(kernel) and windowed(kernel)):
        if softcap and not kernel.supports_softcap:
            problem = "cannot apply softcap"
        elif not windowed(kernel):
            problem = "cannot apply sliding windows (masks)"
        else:
            problem = f"does not take head dim {head_dim}" + (f" with v head dim {v_head_dim}" if v_head_dim else "")
        raise ValueError(f"kernel {name!r} {problem}; use kernel={able!r} (or kernel='auto')")
    return kernel
