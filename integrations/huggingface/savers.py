"""Memory savers on a HuggingFace causal LM: :func:`save_memory`. (STUB: checkpointing only.)"""

from __future__ import annotations

from typing import Optional, Union

import torch

__all__ = ["save_memory"]


def save_memory(model: torch.nn.Module, checkpoint: Union[bool, str] = True,
                mlp_chunks: Optional[int] = None) -> torch.nn.Module:
    """Checkpoint every decoder layer (``checkpoint=True``), also offload the saved layer inputs to CPU
    memory (``"offload"``), and run each layer's MLP over ``mlp_chunks`` sequence chunks; returns ``model``."""
    from .fsdp import checkpoint_activations

    if checkpoint:
        checkpoint_activations(model)
    return model
