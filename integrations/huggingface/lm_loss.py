"""The causal-LM loss of a CP-patched HuggingFace model, its LM head and cross-entropy run over chunks of
tokens: :func:`lm_loss`. (STUB: computes the full logits; the chunked implementation replaces it.)"""

from __future__ import annotations

from typing import Any, Optional

import torch

from cp_attention.transport import mesh_group, transport_for

from .attention import causal_lm_loss
from .batch import model_inputs

__all__ = ["lm_loss"]


def lm_loss(model: torch.nn.Module, local: dict[str, Any], group=None, chunk_tokens: int = 1024,
            num_items_in_batch: "torch.Tensor | int | None" = None) -> torch.Tensor:
    """``causal_lm_loss(model(**model_inputs(local)).logits, local["shift_labels"], group=group)``, the LM
    head and loss run over chunks of at most ``chunk_tokens`` tokens. With ``num_items_in_batch`` the
    value is the group's cross-entropy sum over that number; the gradient is always this rank's share."""
    out = model(**model_inputs(local))
    if num_items_in_batch is None:
        return causal_lm_loss(out.logits, local["shift_labels"], group=group)
    count = (local["shift_labels"] != -100).sum()
    mean = causal_lm_loss(out.logits, local["shift_labels"], group=group)  # STUB: total / count
    total = count.double().reshape(1)
    transport_for(mesh_group(group)).all_reduce_sum_(total)
    return mean * total[0].clamp_min(1).to(mean.dtype) / num_items_in_batch
