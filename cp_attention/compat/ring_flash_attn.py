"""ring-flash-attention 0.1.8's public functions with the same names, signatures, argument defaults,
shard placement and return values, running on cp_attention (``import cp_attention.compat.ring_flash_attn
as ring_flash_attn``, or :func:`cp_attention.compat.install_ring_flash_attn` for callers that import
``ring_flash_attn`` themselves). Nothing here imports ring-flash-attention or flash-attn (nor
transformers, until the HF adapter's functions run)."""

from __future__ import annotations

# ring_flash_attn.adapters, as the original package's submodule attribute (install_ring_flash_attn registers it).
from . import rfa_adapters as adapters  # noqa: F401
from .rfa_adapters import substitute_hf_flash_attn, update_ring_flash_attn_params
from .rfa_batch import *  # noqa: F401,F403
from .rfa_batch import __all__ as _BATCH
from .rfa_varlen import *  # noqa: F401,F403
from .rfa_varlen import __all__ as _VARLEN

__all__ = [*_BATCH, *_VARLEN, "substitute_hf_flash_attn", "update_ring_flash_attn_params"]
