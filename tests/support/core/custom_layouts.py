"""A user-defined layout, as a researcher would write one: a ``Layout`` subclass and its schedule,
registered when this module is imported (spawned workers re-import it when they unpickle a case or
a layout from here).

Reversed zigzag: rank r holds chunks N-1-r and N+r of 2N equal chunks, i.e. the zigzag shard of
rank N-1-r. So the K/V of a LATER rank (j > r) plays zigzag's "earlier" role and vice versa.
"""

from __future__ import annotations

import torch

import cp_attention as cpa
from cp_attention.schedules import BlockTask, register_schedule, source_rank

from . import dist_cases


class ReversedZigzagLayout(cpa.Layout):
    """Rank r holds chunks N-1-r and N+r of 2N equal chunks, in that order."""

    name = "reversed_zigzag"
    aliases = ("rzigzag",)
    _divisor_expr = "2*world_size"

    def divisor(self, world_size: int) -> int:
        return 2 * world_size

    def _positions(self, seq_len: int, rank: int, world_size: int) -> torch.Tensor:
        c = seq_len // (2 * world_size)
        head, tail = world_size - 1 - rank, world_size + rank
        return torch.cat([torch.arange(head * c, (head + 1) * c), torch.arange(tail * c, (tail + 1) * c)])


def reversed_zigzag_schedule(causal: bool, rank: int, world_size: int, step: int, n: int
                             ) -> tuple[BlockTask, ...]:
    j = source_rank(rank, world_size, step)
    if not causal:
        return (BlockTask(0, n, 0, n, False),)
    if j == rank:
        return (BlockTask(0, n, 0, n, True),)
    if j > rank:  # j's head chunk N-1-j precedes both of ours, its tail chunk N+j follows both
        return (BlockTask(0, n, 0, n // 2, False),)
    # j < r: both of j's chunks lie between our head chunk N-1-r and our tail chunk N+r
    return (BlockTask(n // 2, n, 0, n, False),)


register_schedule(ReversedZigzagLayout(), reversed_zigzag_schedule)


def custom_layout_errors(rank: int, world_size: int, *, as_object: bool, **kwargs) -> dict:
    """``dist_cases.attention_errors`` with the custom layout, by name or as a Layout object."""
    layout = ReversedZigzagLayout() if as_object else "reversed_zigzag"
    return dist_cases.attention_errors(rank, world_size, layout=layout, **kwargs)
