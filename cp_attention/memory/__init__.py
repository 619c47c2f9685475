"""Memory savers for a model's layers, torch only: the tiled MLP (``tiled``: a per-token function over
sequence chunks, recomputed chunk by chunk in backward) and activation checkpointing whose saved input
waits in host memory (``offload``: copied out on a side stream, brought back for the recompute)."""

from .offload import HostStash, offload_checkpoint
from .tiled import TiledFunction, chunk_bounds, tiled_apply

__all__ = ["HostStash", "offload_checkpoint", "TiledFunction", "chunk_bounds", "tiled_apply"]
