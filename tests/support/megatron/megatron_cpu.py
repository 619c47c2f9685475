"""Running megatron-core's CP=1 reference path on a machine with no GPU: it hard-codes CUDA in a few
places, patched here and only here, for the ``with`` block of :func:`megatron_cuda_hardcodes_on_cpu`.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["megatron_cuda_hardcodes_on_cpu", "cuda_hardcodes_unpatched"]


@contextlib.contextmanager
def megatron_cuda_hardcodes_on_cpu() -> Iterator[None]:
    """Patch exactly the CUDA hard-codes megatron-core's CP=1 path hits on a machine with no GPU.

    - ``torch.cuda.current_device``: RoPE's ``get_emb`` moves ``inv_freq`` there, and the global
      memory buffer the local ``DotProductAttention`` uses allocates there. It returns ``"cpu"``.
    - ``fused_softmax.get_default_causal_mask``: builds its mask with ``device="cuda"``.
    - ``fused_softmax.get_sliding_window_causal_mask``: likewise; megatron's own function runs, with
      its ``device="cuda"`` factory calls made on the CPU (:class:`_CudaFactoriesOnCpu`).
    - ``tensor_parallel.get_cuda_rng_tracker`` (as the local ``DotProductAttention`` sees it): its
      ``fork()`` needs CUDA RNG state; with dropout 0 a no-op fork is exact.
    """
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.transformer.dot_product_attention as dpa

    class _NoCudaRngTracker:
        def fork(self, *args, **kwargs):
            return contextlib.nullcontext()

        def is_initialized(self) -> bool:
            return False

    saved = (torch.cuda.current_device, fused_softmax.get_default_causal_mask,
             fused_softmax.get_sliding_window_causal_mask, dpa.tensor_parallel.get_cuda_rng_tracker)
    megatron_window_mask = saved[2]

    def window_mask_on_cpu(sq, skv, window_size):
        with _CudaFactoriesOnCpu():
            return megatron_window_mask(sq, skv, window_size)

    torch.cuda.current_device = lambda: "cpu"
    fused_softmax.get_default_causal_mask = lambda sq: torch.ones(sq, sq, dtype=torch.bool).triu(1)
    fused_softmax.get_sliding_window_causal_mask = window_mask_on_cpu
    dpa.tensor_parallel.get_cuda_rng_tracker = lambda *a, **k: _NoCudaRngTracker()
    try:
        yield
    finally:
        (torch.cuda.current_device, fused_softmax.get_default_causal_mask,
         fused_softmax.get_sliding_window_causal_mask, dpa.tensor_parallel.get_cuda_rng_tracker) = saved


class _CudaFactoriesOnCpu(torch.overrides.TorchFunctionMode):
    """Torch calls with ``device="cuda"`` run on the CPU instead (megatron's mask builders hard-code it)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device")) == "cuda":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def cuda_hardcodes_unpatched() -> bool:
    """True if none of the patches of :func:`megatron_cuda_hardcodes_on_cpu` is in effect."""
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.transformer.dot_product_attention as dpa

    return (torch.cuda.current_device.__module__ == "torch.cuda"
            and fused_softmax.get_default_causal_mask.__module__ == "megatron.core.transformer.utils"
            and fused_softmax.get_sliding_window_causal_mask.__module__ == "megatron.core.transformer.utils"
            and dpa.tensor_parallel.get_cuda_rng_tracker.__module__ == "megatron.core.tensor_parallel.random")
