"""Sequence layouts: which rank holds which token.

Index math only; the single piece of communication here is :meth:`Layout.gather`, a thin
all-gather followed by :meth:`Layout.unshard`. Every operation derives from one index map,
:meth:`Layout.positions`, so shard, unshard and positions cannot disagree.
"""

from __future__ import annotations

import operator
import zlib
from typing import Sequence

import torch

from .documents import CuSeqlens, cached_zigzag_chunks, check_cu_seqlens, cu_seqlens_tuple

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
        seq_len, world_size = _as_int("seq_len", seq_len), _as_int("world_size", world_size)
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
        rank, world_size = _as_int("rank", rank), _as_int("world_size", world_size)
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
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
        seq_len, rank, world_size = int(seq_len), int(rank), int(world_size)
        if cu_seqlens is None:
            return self._positions(seq_len, rank, world_size)
        cu = check_cu_seqlens(cu_seqlens, total=seq_len)
        return self._packed_positions(cu, rank, world_size)

    def shard(self, x: torch.Tensor, dim: int, rank: int, world_size: int,
              cu_seqlens: "CuSeqlens | None" = None) -> torch.Tensor:
        """This rank's tokens of a full tensor ``x`` along ``dim`` (a copy); see :meth:`positions`."""
        dim = _check_dim(dim, x.dim(), "shard")
        idx = self.positions(x.shape[dim], rank, world_size, cu_seqlens).to(x.device)
        return x.index_select(dim, idx)

    def unshard(self, shards: Sequence[torch.Tensor], dim: int, cu_seqlens: "CuSeqlens | None" = None
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
        dim = _check_dim(dim, shards[0].dim(), "unshard")
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
            sizes = [tuple(s.shape) for s in shards]
            raise ValueError(f"unshard needs shards of one shape, got {sizes}")
        seq_len = local * world_size
        order = torch.cat([self.positions(seq_len, r, world_size, cu_seqlens) for r in range(world_size)])
        inverse = torch.argsort(order).to(first.device)
        return torch.cat(shards, dim=dim).index_select(dim, inverse)

    def gather(self, x_local: torch.Tensor, dim: int, group=None, cu_seqlens: "CuSeqlens | None" = None
               ) -> torch.Tensor:
        """All-gather every rank's shard over ``group`` and unshard: the full tensor on each rank.

        Not differentiable. With no initialised process group, or world size 1, returns ``x_local``
        (after the same checks). Raises ``ValueError`` on every rank alike, before the all-gather, if
        any rank passes a ``dim`` out of range, bad ``cu_seqlens``, or a shard whose shape, dtype, device
        type, ``dim`` or ``cu_seqlens`` differ from another rank's (an all-gather of mismatched shards
        would abort or hang the processes).
        """
        import torch.distributed as dist

        if not isinstance(x_local, torch.Tensor):
            raise ValueError(f"gather needs this rank's shard as a tensor, got {type(x_local).__name__}")
        distributed = dist.is_available() and dist.is_initialized()
        world_size = dist.get_world_size(group) if distributed else 1
        if world_size == 1:
            dim = _check_dim(dim, x_local.dim(), "gather")
            if cu_seqlens is not None:
                self.positions(x_local.shape[dim], 0, 1, cu_seqlens)
            return x_local
        sig = torch.tensor(_gather_signature(x_local, dim, cu_seqlens), dtype=torch.int64)
        device = x_local.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        sigs = [torch.empty_like(sig, device=device) for _ in range(world_size)]
        dist.all_gather(sigs, sig.to(device), group=group)
        _check_gather([t.tolist() for t in sigs], self)
        dim = _check_dim(dim, x_local.dim(), "gather")
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


def _as_int(name: str, value) -> int:
    """``value`` as an int (Python, numpy or 0-d integer tensor), else ``ValueError`` (bools too)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None


def _check_dim(dim, ndim: int, what: str) -> int:
    """``dim`` of an ``ndim``-D tensor, made non-negative; ``ValueError`` if there is no such dimension."""
    if ndim == 0:
        raise ValueError(f"{what} needs a tensor with a sequence dimension, got a 0-D tensor")
    dim = _as_int("dim", dim)
    if not -ndim <= dim < ndim:
        raise ValueError(f"{what}: dim {dim} is out of range for a {ndim}-D tensor (expected {-ndim} <= dim < {ndim})")
    return dim % ndim


# The shard each rank passes to Layout.gather, as ints every rank can compare: a problem code, the
# tensor's rank, the dim, the local length, a fingerprint of everything else about the shard, and the
# packed documents' end and fingerprint.
_GATHER_OK, _GATHER_BAD_DIM, _GATHER_BAD_CU = 0, 1, 2


def _fingerprint(value) -> int:
    return zlib.crc32(repr(value).encode())


def _gather_signature(x: torch.Tensor, dim, cu_seqlens) -> list[int]:
    ndim = x.dim()
    try:
        d = _check_dim(dim, ndim, "gather")
    except ValueError:
        return [_GATHER_BAD_DIM, ndim, 0, 0, 0, 0, 0]
    others = tuple(n for i, n in enumerate(x.shape) if i != d)
    sig = [_GATHER_OK, ndim, d, x.shape[d], _fingerprint((others, str(x.dtype), x.device.type)), 0, 0]
    if cu_seqlens is not None:
        try:
            cu = check_cu_seqlens(cu_seqlens_tuple(cu_seqlens))
        except ValueError:
            sig[0] = _GATHER_BAD_CU
            return sig
        sig[5:] = [min(cu[-1], 1 << 62), _fingerprint(cu)]
    return sig


def _check_gather(table: list[list[int]], layout: Layout) -> None:
    """One verdict on every rank's :func:`_gather_signature`: ``ValueError`` if any is bad or they differ."""
    world_size = len(table)
    for code in (_GATHER_BAD_DIM, _GATHER_BAD_CU):
        bad = [r for r, sig in enumerate(table) if sig[0] == code]
        if bad:
            ndim = table[bad[0]][1]
            what = (f"dim is out of range for its {ndim}-D shard (expected {-ndim} <= dim < {ndim})"
                    if code == _GATHER_BAD_DIM else
                    "cu_seqlens are not document boundaries [0, l1, l1+l2, ..., T] (1-D integers, from 0, increasing)")
            raise ValueError(f"Layout.gather: {what} on rank(s) {bad}")
    for i, label in ((1, "number of dimensions"), (2, "dim to gather along"), (3, "length along dim"),
                     (4, "shape (but along dim), dtype and device type"), (5, "cu_seqlens"), (6, "cu_seqlens")):
        values = [sig[i] for sig in table]
        if any(v != values[0] for v in values):
            shown = (", ".join(f"rank {r}: {v}" for r, v in enumerate(values)) if i < 4 else
                     f"rank(s) {[r for r, v in enumerate(values) if v != values[0]]} differ from rank 0")
            raise ValueError(f"Layout.gather: every rank must pass a shard with the same {label}, got {shown}; "
                             "gather the shards of one tensor, sharded by this layout")
    ndim, dim, local, _, end, _ = table[0][1:]
    total = local * world_size
    layout.check(total, world_size)
    if end and end != total:
        raise ValueError(f"Layout.gather: cu_seqlens must end at the gathered length {local} x world_size "
                         f"{world_size} = {total}, got {end}")


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
