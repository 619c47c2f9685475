"""``ring_flash_attn.adapters`` on cp_attention: the original package's two names, and its ``hf_adapter``
module (:mod:`.rfa_hf_adapter`)."""

from __future__ import annotations

from . import rfa_hf_adapter as hf_adapter
from .rfa_hf_adapter import substitute_hf_flash_attn, update_ring_flash_attn_params

__all__ = ["hf_adapter", "substitute_hf_flash_attn", "update_ring_flash_attn_params"]
