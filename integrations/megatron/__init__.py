"""Megatron-core glue (the ``megatron`` extra): ring attention in the ``core_attention`` slot, layout
RoPE, batch sharding and THD packed sequences. See the modules: ``attention`` (the slot and
``apply_context_parallel``; it names the extra when megatron-core is missing), ``batch``, ``packed``,
``rope``."""

from .attention import (
                        RingDotProductAttention,
                        apply_context_parallel,
                        get_gpt_layer_ring_spec,
                        ring_core_attention,
                        use_ring_attention,
)
from .batch import DEFAULT_LAYOUT, get_batch_on_this_cp_rank
from .packed import packed_documents
from .rope import LayoutRotaryEmbedding

__all__ = ["RingDotProductAttention", "ring_core_attention", "use_ring_attention", "get_gpt_layer_ring_spec",
           "apply_context_parallel", "get_batch_on_this_cp_rank", "packed_documents", "LayoutRotaryEmbedding",
           "DEFAULT_LAYOUT"]
