"""Context-parallel training for HuggingFace causal LMs: data, checkpoints and the DP x CP loop.

Driven by ``scripts/train.py`` and the Hydra configs in ``configs/``.
"""

from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .data import ByteBatches, load_bytes

__all__ = ["ByteBatches", "load_bytes", "save_checkpoint", "load_checkpoint", "latest_checkpoint"]
