"""The per-batch layout ``"balanced"``: packed documents placed by a deterministic solver.

Without ``cu_seqlens`` it is zigzag (same positions, same causal schedule). With ``cu_seqlens`` the
solver (to come) keeps short documents whole on one rank and splits long ones head-tail over ranks
that are consecutive in ring order.
"""

from __future__ import annotations

import torch

from .builtin import ZigzagLayout

__all__ = ["BalancedLayout"]


class BalancedLayout(ZigzagLayout):
    """Zigzag without packed documents; with them, a per-batch placement (see the module docstring)."""

    name = "balanced"
    aliases = ()

    def _packed_positions(self, cu_seqlens: tuple[int, ...], rank: int, world_size: int) -> torch.Tensor:
        return super()._packed_positions(cu_seqlens, rank, world_size)
