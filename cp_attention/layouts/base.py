"""The layout base class: one index map, :meth:`Layout.positions`, from which shard, unshard and
gather derive, so they cannot disagree. Index math only; :meth:`Layout.gather` delegates its one
collective, through :mod:`.gather`, to the checks (:mod:`cp_attention.checks.gather`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .args import as_int, check_dim
from .documents import CuSeqlens, check_cu_seqlens
from .gather import gather_shards

__all__ = ["Layout"]

class Layout:
    """Base class: a permutation of a sequence split evenly over ``world_size`` ranks.

    Subclasses define :attr:`name`, :attr:`aliases`, :meth:`divisor` and :meth:`_positions`, and
    :meth:`_packed_positions` to support packed documents (``cu_seqlens``). Positions must be in
    increasing order on every rank: the packed-sequence schedules rely on it.
    """

    name: str = ""
    aliases: tuple[str, ...] = ()
    _divisor_expr: str = "world_size"  # how divisor() reads in error messages

    def divisor(self, world_size: int) -> int:
        """The number the global sequence length must be a multiple of."""
        raise NotImplementedError

    def _positions(self, seq_len: int, rank: int, world_size: int) -> torch.Tensor:
        raise NotImplementedError

    def _packed_positions(self, cu_seqlens: tuple[int, ...], rank: int, world_size: int) -> torch.Tensor:
        raise NotImplementedError(
            f"layout {self.name!r} does not support packed documents (cu_seqlens); implement "
            f"{type(self).__name__}._packed_positions or use contiguous, zigzag or interleaved")

    def check(self, seq_len: int, world_size: int) -> None:
        """Raise ``ValueError`` if this layout cannot split ``seq_len`` over ``world_size`` ranks."""
        seq_len, world_size = as_int("seq_len", seq_len), as_int("world_size", world_size)
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        d = self.divisor(world_size)
        if seq_len <= 0 or seq_len % d != 0:
            padded = max(d, -(-seq_len // d) * d)
            hint = (f"pad the sequence to a multiple of {d} ({padded} tokens; packed documents: "
                    f"cp_attention.pad_cu_seqlens(cu_seqlens, {d}))")
            # contiguous splits any positive multiple of world_size: suggest it only where it does
            if self.name != "contiguous" and seq_len > 0 and seq_len % world_size == 0:
                hint += " or use layout='contiguous'"
            raise ValueError(
                f"{self.name} layout needs seq_len divisible by {self._divisor_expr}={d}, "
                f"got {seq_len}; {hint}"
            )

    def _check_rank(self, rank: int, world_size: int) -> None:
        rank, world_size = as_int("rank", rank), as_int("world_size", world_size)
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")

    def positions(self, seq_len: int, rank: int, world_size: int, cu_seqlens: CuSeqlens | None = None
                  ) -> torch.Tensor:
        """Global token indices held by ``rank``, in local (increasing) order.

        Returns a ``LongTensor`` of shape ``[seq_len // world_size]``. Without ``cu_seqlens`` use it as
        ``position_ids`` so rotary embeddings see global positions. With ``cu_seqlens`` (packed
        documents, ``[0, l1, l1+l2, ..., seq_len]``) the indices are into the packed stream; RoPE then
        wants :func:`~cp_attention.layouts.documents.document_position_ids` of them.

        Raises ``ValueError`` for a rank outside ``[0, world_size)``, a length the layout cannot split
        or bad ``cu_seqlens``; ``NotImplementedError`` if the layout cannot split packed documents.
        """
        self._check_rank(rank, world_size)
        self.check(seq_len, world_size)
        seq_len, rank, world_size = int(seq_len), int(rank), int(world_size)
        if cu_seqlens is None:
            return self._positions(seq_len, rank, world_size)
        cu = check_cu_seqlens(cu_seqlens, total=seq_len)
        return self._packed_positions(cu, rank, world_size)

    def shard(self, x: torch.Tensor, dim: int, rank: int, world_size: int,
              cu_seqlens: CuSeqlens | None = None) -> torch.Tensor:
        """This rank's tokens of a full tensor ``x`` along ``dim`` (a copy); see :meth:`positions`."""
        dim = check_dim(dim, x.dim(), "shard")
        idx = self.positions(x.shape[dim], rank, world_size, cu_seqlens).to(x.device)
        return x.index_select(dim, idx)

    def unshard(self, shards: Sequence[torch.Tensor], dim: int, cu_seqlens: CuSeqlens | None = None
                ) -> torch.Tensor:
        """Exact inverse of :meth:`shard`: the full tensor from the shards of ranks 0..N-1, in order.

        Raises ``ValueError`` unless the shards are tensors of one dtype and device whose shapes agree
        (along ``dim`` too), for a ``dim`` out of range, and as :meth:`positions` does.
        """
        shards = list(shards)
        world_size = len(shards)
        if world_size == 0:
            raise ValueError("unshard needs at least one shard, got an empty list")
        if not all(isinstance(s, torch.Tensor) for s in shards):
            kinds = sorted({type(s).__name__ for s in shards if not isinstance(s, torch.Tensor)})
            raise ValueError(f"unshard needs a list of tensors (one shard per rank), got {', '.join(kinds)}")
        dim = check_dim(dim, shards[0].dim(), "unshard")
        first = shards[0]
        for r, s in enumerate(shards):
            if s.dim() != first.dim() or s.dtype != first.dtype or s.device != first.device:
                raise ValueError(f"unshard needs shards of one shape, dtype and device: shard 0 is "
                                 f"{tuple(first.shape)} {first.dtype} on {first.device}, shard {r} is "
                                 f"{tuple(s.shape)} {s.dtype} on {s.device}")
        local = first.shape[dim]
        if any(s.shape[dim] != local for s in shards):
            sizes = [s.shape[dim] for s in shards]
            raise ValueError(f"unshard needs equal shard lengths along dim {dim}, got {sizes}")
        if any(s.shape != first.shape for s in shards):
            shapes = [tuple(s.shape) for s in shards]
            raise ValueError(f"unshard needs shards of one shape, got {shapes}")
        seq_len = local * world_size
        order = torch.cat([self.positions(seq_len, r, world_size, cu_seqlens) for r in range(world_size)])
        inverse = torch.argsort(order).to(first.device)
        return torch.cat(shards, dim=dim).index_select(dim, inverse)

    def gather(self, x_local: torch.Tensor, dim: int, group=None, cu_seqlens: CuSeqlens | None = None
               ) -> torch.Tensor:
        """All-gather every rank's shard over ``group`` and unshard: the full tensor on each rank.

        Not differentiable. With no initialised process group, or world size 1, returns ``x_local``
        (after the same checks). Raises ``ValueError`` on every rank alike, before the all-gather, if
        any rank passes a ``dim`` out of range, bad ``cu_seqlens``, or a shard whose shape, dtype, device
        type, ``dim`` or ``cu_seqlens`` differ from another rank's (an all-gather of mismatched shards
        would abort or hang the processes).
        """
        return gather_shards(self, x_local, dim, group, cu_seqlens)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

