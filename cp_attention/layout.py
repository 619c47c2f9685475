"""Sequence layouts: which rank holds which token.

Index math only; the single piece of communication here is :meth:`Layout.gather`, a thin
all-gather followed by :meth:`Layout.unshard`. Every operation derives from one index map,
:meth:`Layout.positions`, so shard, unshard and positions cannot disagree.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .documents import CuSeqlens, cached_zigzag_chunks, check_cu_seqlens

__all__ = [
    "Layout",
    "ContiguousLayout",
    "ZigzagLayout",
    "InterleavedLayout",
    "get_layout",
    "register_layout",
    "LAYOUT_NAMES",
]


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
            f"{type(self).__name__}._packed_positions or use one of {', '.join(LAYOUT_NAMES)}")

    def check(self, seq_len: int, world_size: int) -> None:
        """Raise ``ValueError`` if this layout cannot split ``seq_len`` over ``world_size`` ranks."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        d = self.divisor(world_size)
        if seq_len <= 0 or seq_len % d != 0:
            hint = "pad the sequence" + ("" if self.name == "contiguous" else " or use layout='contiguous'")
            raise ValueError(
                f"{self.name} layout needs seq_len divisible by {self._divisor_expr}={d}, "
                f"got {seq_len}; {hint}"
            )

    def _check_rank(self, rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")

    def positions(self, seq_len: int, rank: int, world_size: int, cu_seqlens: "CuSeqlens | None" = None
                  ) -> torch.Tensor:
        """Global token indices held by ``rank``, in local (increasing) order.

        Returns a ``LongTensor`` of shape ``[seq_len // world_size]``. Without ``cu_seqlens`` use it as
        ``position_ids`` so rotary embeddings see global positions. With ``cu_seqlens`` (packed
        documents, ``[0, l1, l1+l2, ..., seq_len]``) the indices are into the packed stream; RoPE then
        wants :func:`~cp_attention.documents.document_position_ids` of them.

        Raises ``ValueError`` for a rank outside ``[0, world_size)``, a length the layout cannot split
        or bad ``cu_seqlens``; ``NotImplementedError`` if the layout cannot split packed documents.
        """
        self._check_rank(rank, world_size)
        self.check(seq_len, world_size)
        if cu_seqlens is None:
            return self._positions(seq_len, rank, world_size)
        cu = check_cu_seqlens(cu_seqlens, total=seq_len)
        return self._packed_positions(cu, rank, world_size)

    def shard(self, x: torch.Tensor, dim: int, rank: int, world_size: int,
              cu_seqlens: "CuSeqlens | None" = None) -> torch.Tensor:
        """This rank's tokens of a full tensor ``x`` along ``dim`` (a copy); see :meth:`positions`."""
        dim = dim % x.dim()
        idx = self.positions(x.shape[dim], rank, world_size, cu_seqlens).to(x.device)
        return x.index_select(dim, idx)

    def unshard(self, shards: Sequence[torch.Tensor], dim: int, cu_seqlens: "CuSeqlens | None" = None
                ) -> torch.Tensor:
        """Exact inverse of :meth:`shard`: the full tensor from the shards of ranks 0..N-1, in order."""
        world_size = len(shards)
        if world_size == 0:
            raise ValueError("unshard needs at least one shard, got an empty list")
        dim = dim % shards[0].dim()
        local = shards[0].shape[dim]
        if any(s.shape[dim] != local for s in shards):
            sizes = [s.shape[dim] for s in shards]
            raise ValueError(f"unshard needs equal shard lengths along dim {dim}, got {sizes}")
        seq_len = local * world_size
        order = torch.cat([self.positions(seq_len, r, world_size, cu_seqlens) for r in range(world_size)])
        inverse = torch.argsort(order).to(shards[0].device)
        return torch.cat(list(shards), dim=dim).index_select(dim, inverse)

    def gather(self, x_local: torch.Tensor, dim: int, group=None, cu_seqlens: "CuSeqlens | None" = None
               ) -> torch.Tensor:
        """All-gather every rank's shard over ``group`` and unshard: the full tensor on each rank.

        Not differentiable. With no initialised process group, or world size 1, returns ``x_local``.
        """
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return x_local
        world_size = dist.get_world_size(group)
        if world_size == 1:
            return x_local
        x_local = x_local.contiguous()
        parts = [torch.empty_like(x_local) for _ in range(world_size)]
        dist.all_gather(parts, x_local, group=group)
        return self.unshard(parts, dim, cu_seqlens)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)


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
    aliases = ("dualchunkswap", "head_tail")
    _divisor_expr = "2*world_size"

    def divisor(self, world_size: int) -> int:
        return 2 * world_size

    def _positions(self, seq_len: int, rank: int, world_size: int) -> torch.Tensor:
        c = seq_len // (2 * world_size)
        tail = 2 * world_size - 1 - rank
        return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange(tail * c, (tail + 1) * c)])

    def _packed_positions(self, cu_seqlens: tuple[int, ...], rank: int, world_size: int) -> torch.Tensor:
        # Every document is cut into 2N near-equal chunks and rank r takes chunks r and 2N-1-r of each,
        # so each document's causal work is balanced on its own (see documents.zigzag_chunks).
        starts, sizes = cached_zigzag_chunks(cu_seqlens, world_size)
        cols = [rank, 2 * world_size - 1 - rank]
        starts, sizes = starts[:, cols].flatten(), sizes[:, cols].flatten()
        first = torch.cumsum(sizes, 0) - sizes
        total = int(sizes.sum())
        return torch.repeat_interleave(starts - first, sizes, output_size=total) + torch.arange(total)


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


# Every known layout, built-in first, then those added with register_layout, in that order.
_LAYOUTS: list[Layout] = [ContiguousLayout(), ZigzagLayout(), InterleavedLayout()]
LAYOUT_NAMES: tuple[str, ...] = tuple(lay.name for lay in _LAYOUTS)  # the built-in layouts
_BY_NAME: dict[str, Layout] = {n: lay for lay in _LAYOUTS for n in (lay.name, *lay.aliases)}


def register_layout(layout: Layout) -> None:
    """Make a user-defined layout resolvable by its name and aliases (``get_layout("mine")``).

    Registering an equal layout again is a no-op, so a module that registers on import may be
    imported twice (spawned worker processes re-import it). Raises ``TypeError`` for a non-Layout
    and ``ValueError`` for a name that is empty or already taken by a different layout.
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"register_layout needs a Layout instance, got {type(layout).__name__}")
    names = [n.lower() for n in (layout.name, *layout.aliases)]
    if not layout.name:
        raise ValueError(f"{type(layout).__name__} has an empty name; set the class attribute `name`")
    for n in names:
        taken = _BY_NAME.get(n)
        if taken is not None and type(taken) is not type(layout):
            raise ValueError(f"layout name {n!r} is already taken by {taken!r}; choose another name")
    if layout.name.lower() not in _BY_NAME:
        _LAYOUTS.append(layout)
    _BY_NAME.update({n: layout for n in names})


def get_layout(layout: "str | Layout") -> Layout:
    """Resolve a layout name (or alias, case-insensitive) or pass a :class:`Layout` through.

    Raises ``ValueError`` for an unknown name, listing the known ones (built-in and registered).
    """
    if isinstance(layout, Layout):
        return layout
    if not isinstance(layout, str):
        raise TypeError(f"layout must be a str or Layout, got {type(layout).__name__}")
    try:
        return _BY_NAME[layout.lower()]
    except KeyError:
        known = ", ".join(f"{lay.name} (aliases: {', '.join(lay.aliases)})" if lay.aliases else lay.name
                          for lay in _LAYOUTS)
        raise ValueError(f"unknown layout {layout!r}; expected one of: {known}") from None
