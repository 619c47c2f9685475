"""The built-in layouts: contiguous, zigzag (DualChunkSwap) and interleaved (striped, modulo-CP)."""

from __future__ import annotations

import torch

from .base import Layout
from .documents import zigzag_chunks

__all__ = ["ContiguousLayout", "ZigzagLayout", "InterleavedLayout"]


class ContiguousLayout(Layout):
    """Rank r holds tokens [r*S/N, (r+1)*S/N)."""

    name = "contiguous"

    def divisor(self, world_size: int) -> int:
        return world_size

    def _positions(self, seq_len: int, rank: int, world_size: int) -> torch.Tensor:
        n = seq_len // world_size
        return torch.arange(rank * n, (rank + 1) * n)

    def _packed_positions(self, cu_seqlens: tuple[int, ...], rank: int, world_size: int) -> torch.Tensor:
        # The packed stream is cut into N equal pieces, straight through documents.
        return self._positions(cu_seqlens[-1], rank, world_size)


class ZigzagLayout(Layout):
    """Rank r holds chunks r and 2N-1-r of 2N equal chunks, in that order (DualChunkSwap)."""

    name = "zigzag"
    aliases: tuple[str, ...] = ("dualchunkswap", "head_tail")  # balanced, a zigzag, has none
    _divisor_expr = "2*world_size"

    def divisor(self, world_size: int) -> int:
        return 2 * world_size

    def _positions(self, seq_len: int, rank: int, world_size: int) -> torch.Tensor:
        c = seq_len // (2 * world_size)
        tail = 2 * world_size - 1 - rank
        return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange(tail * c, (tail + 1) * c)])

    def _packed_positions(self, cu_seqlens: tuple[int, ...], rank: int, world_size: int) -> torch.Tensor:
        # A plan's build asks for every rank's positions of one batch in turn: one zigzag_chunks serves
        # them all (matched by the boundaries' identity, as documents.check_cu_seqlens does).
        seen, size, every = _LAST_PACKED[0]
        if seen is not cu_seqlens or size != world_size:
            every = _zigzag_packed_positions(cu_seqlens, world_size)
            if type(cu_seqlens) is tuple:
                _LAST_PACKED[0] = (cu_seqlens, world_size, every)
        return every[rank].clone()


# (boundaries, world size, every rank's positions) of the last packed zigzag call; one object,
# replaced whole, so threads never mix two batches.
_LAST_PACKED: list = [(None, 0, ())]


def _zigzag_packed_positions(cu_seqlens: tuple[int, ...], world_size: int) -> tuple[torch.Tensor, ...]:
    """Every rank's packed zigzag positions. Every document is cut into 2N near-equal chunks and rank r
    takes chunks r and 2N-1-r of each, so each document's causal work is balanced on its own (see
    documents.zigzag_chunks)."""
    starts, sizes = zigzag_chunks(cu_seqlens, world_size)
    ranks = torch.arange(world_size)
    cols = torch.stack([ranks, 2 * world_size - 1 - ranks], 1)  # [N, 2]
    # [N, D, 2] -> per rank, its two chunks of each document in document order
    starts, sizes = starts[:, cols].transpose(0, 1).flatten(), sizes[:, cols].transpose(0, 1).flatten()
    first = torch.cumsum(sizes, 0) - sizes
    total = int(cu_seqlens[-1])
    every = torch.repeat_interleave(starts - first, sizes, output_size=total) + torch.arange(total)
    return every.split(total // world_size)


class InterleavedLayout(Layout):
    """Rank r holds tokens t with t mod N == r, in order (striped, modulo-CP)."""

    name = "interleaved"
    aliases = ("striped", "modulo")

    def divisor(self, world_size: int) -> int:
        return world_size

    def _positions(self, seq_len: int, rank: int, world_size: int) -> torch.Tensor:
        return torch.arange(rank, seq_len, world_size)

    def _packed_positions(self, cu_seqlens: tuple[int, ...], rank: int, world_size: int) -> torch.Tensor:
        # The packed stream is dealt round-robin, straight through documents.
        return self._positions(cu_seqlens[-1], rank, world_size)
