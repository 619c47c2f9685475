"""ring-flash-attention 0.1.8's varlen API on cp_attention's ring: ``ring_flash_attn_varlen_func``,
``zigzag_ring_flash_attn_varlen_func`` and their ``_kvpacked_func`` / ``_qkvpacked_func`` variants, with the
original's names, signatures, defaults, return values and shard placement (the llama3 functions live in
:mod:`.rfa_llama3`). Tensors are flash-attn's varlen ``[total_local, heads, head_dim]``; ``cu_seqlens`` is the
LOCAL boundaries, the same on every rank, as the original takes them:

- ``ring_flash_attn_varlen_*``: every sequence is cut into N equal contiguous parts and rank r holds part r of
  each, in order (local ``cu_seqlens`` = global / N). No built-in layout cuts per sequence, so this runs on
  :class:`PerDocumentContiguousLayout` (positions only: its ring blocks derive from them).
- ``zigzag_ring_flash_attn_varlen_*``: every sequence is cut into 2N equal chunks and rank r holds chunks r and
  2N-1-r of each (local ``cu_seqlens`` = global / N): exactly our ``zigzag`` layout's packed placement.

What differs from the original, on purpose (as in :mod:`.rfa_batch`):

- the result is exact for every option accepted. The original applies ``window_size`` inside each ring block,
  aligned to the block, so its windowed result is not windowed attention; here windows are over positions
  within each sequence (flash-attn's convention on the unsharded sequences).
- ``causal=False`` runs on the zigzag placement too (the original asserts ``causal``).
- ``dropout_p`` other than 0 and ``alibi_slopes`` raise ``NotImplementedError`` naming the argument.
- ``softmax_lse`` (``return_attn_probs=True``, fp32 ``[heads, total_local]`` as the original's) is
  differentiable; ``deterministic`` and ``max_seqlen`` (a kernel hint) have no effect.
- local ``cu_seqlens`` that are not the original's convention (not ending at the local length, a zigzag
  sequence of odd local length) raise ``ValueError`` where the original would silently mis-slice.

Each call reads ``cu_seqlens`` to the host (as the original's zigzag does) and plans itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..api import ring_attention
from ..layouts.base import Layout
from ..layouts.builtin import ContiguousLayout
from ..layouts.documents import cu_seqlens_tuple
from .rfa_batch import _refuse_unsupported
from .rfa_llama3 import (
    llama3_flash_attn_prepare_cu_seqlens,
    llama3_flash_attn_varlen_func,
    llama3_flash_attn_varlen_kvpacked_func,
    llama3_flash_attn_varlen_qkvpacked_func,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "ring_flash_attn_varlen_func", "ring_flash_attn_varlen_kvpacked_func", "ring_flash_attn_varlen_qkvpacked_func",
    "zigzag_ring_flash_attn_varlen_func", "zigzag_ring_flash_attn_varlen_kvpacked_func",
    "zigzag_ring_flash_attn_varlen_qkvpacked_func",
    "llama3_flash_attn_prepare_cu_seqlens", "llama3_flash_attn_varlen_func", "llama3_flash_attn_varlen_kvpacked_func",
    "llama3_flash_attn_varlen_qkvpacked_func",
]

Result = torch.Tensor | tuple[torch.Tensor, torch.Tensor, None]


class PerDocumentContiguousLayout(ContiguousLayout):
    """ring-flash-attention's varlen ring placement: every document of the packed stream is cut into N equal
    contiguous parts and rank r holds part r of each, documents in order. Without documents it is
    ``contiguous``. Needs every document's length divisible by N."""

    name = "rfa_per_document_contiguous"

    def _packed_positions(self, cu_seqlens: tuple[int, ...], rank: int, world_size: int) -> torch.Tensor:
        cu = torch.tensor(cu_seqlens, dtype=torch.int64)
        lengths = cu[1:] - cu[:-1]
        if bool((lengths % world_size).any()):
            bad = int(torch.nonzero(lengths % world_size)[0])
            raise ValueError(f"{self.name} layout needs every document's length divisible by world_size="
                             f"{world_size}, got document {bad} of {int(lengths[bad])} tokens; pad each document "
                             f"to a multiple of {world_size}")
        part = lengths // world_size
        starts = cu[:-1] + rank * part
        first = torch.cumsum(part, 0) - part  # where each document's part starts locally
        total = int(part.sum())
        return torch.repeat_interleave(starts - first, part, output_size=total) + torch.arange(total)


RING_VARLEN_LAYOUT = PerDocumentContiguousLayout()


def _unpack(name: str, what: str, packed: torch.Tensor, count: int) -> tuple[torch.Tensor, ...]:
    """Views of a packed ``[total, count, heads, head_dim]`` tensor (gradients flow back to it)."""
    if not isinstance(packed, torch.Tensor) or packed.dim() != 4 or packed.shape[1] != count:
        shape = tuple(packed.shape) if isinstance(packed, torch.Tensor) else type(packed).__name__
        raise ValueError(f"{name}: {what} must be [total, {count}, heads, head_dim], got {shape}; pack with "
                         f"torch.stack([...], dim=1)")
    return packed.unbind(1)


def _global_cu_seqlens(name: str, cu_seqlens, total: int, world_size: int, halves: bool) -> tuple[int, ...]:
    """The packed stream's boundaries from the original's local ones (the same on every rank): global = local
    * N. Raises ``ValueError`` for local boundaries that do not describe ``total`` local tokens (or, with
    ``halves``, a sequence of odd local length: the zigzag placement holds two equal chunks of each)."""
    local = cu_seqlens_tuple(cu_seqlens)
    if len(local) < 2 or local[0] != 0 or local[-1] != total or any(b <= a for a, b in zip(local, local[1:])):
        raise ValueError(f"{name}: cu_seqlens must be this rank's local boundaries [0, l1/N, ..., {total}] (strictly "
                         f"increasing, ending at the local length {total}), got {list(local[:8])}"
                         f"{'...' if len(local) > 8 else ''}")
    if halves:
        odd = next((i for i, (a, b) in enumerate(zip(local, local[1:])) if (b - a) % 2), None)
        if odd is not None:
            raise ValueError(f"{name}: sequence {odd} has odd local length {local[odd + 1] - local[odd]}; the zigzag "
                             f"varlen placement holds two equal chunks of every sequence (its length a multiple of "
                             f"2*world_size={2 * world_size}): pad each sequence")
    return tuple(x * world_size for x in local)


def _world_size(group: ProcessGroup | None) -> int:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _varlen(name: str, layout: str | Layout, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens,
            dropout_p: float, softmax_scale: float | None, causal: bool, window_size: tuple[int, int],
            alibi_slopes: torch.Tensor | None, return_attn_probs: bool, group: ProcessGroup | None) -> Result:
    _refuse_unsupported(name, dropout_p, alibi_slopes)
    for what, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: {what} must be [total_local, heads, head_dim] (flash-attn's varlen), "
                             f"got {shape}")
    n = _world_size(group)
    cu = _global_cu_seqlens(name, cu_seqlens, q.shape[0], n, halves=layout == "zigzag")
    window = tuple(window_size) if isinstance(window_size, list) else window_size
    want_lse = bool(return_attn_probs)
    result = ring_attention(q[None], k[None], v[None], group, layout, causal=causal, softmax_scale=softmax_scale,
                            cu_seqlens=cu, window_size=window, return_lse=want_lse)
    if not want_lse:
        return result[0]
    out, lse = result
    # the original's softmax_lse is flash-attn varlen's: fp32 [heads, total_local]
    return out[0], lse[0].float(), None


def ring_flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                                max_seqlen: int, dropout_p: float = 0.0, softmax_scale: float | None = None,
                                causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                                alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                                return_attn_probs: bool = False, group: ProcessGroup | None = None) -> Result:
    """Attention over packed sequences, every sequence split in N contiguous parts (rank r holds part r of each).

    ``q [total_local, H, D]``, ``k``/``v [total_local, Hkv, D]``, ``cu_seqlens`` the local boundaries (global / N,
    the same on every rank). Returns ``out [total_local, H, D]`` or, with ``return_attn_probs``,
    ``(out, softmax_lse [H, total_local] fp32, None)``. Raises ``NotImplementedError`` for ``dropout_p != 0`` or
    ``alibi_slopes``, ``ValueError`` for bad shapes or ``cu_seqlens`` (on every rank alike when all pass the same).
    """
    return _varlen("ring_flash_attn_varlen_func", RING_VARLEN_LAYOUT, q, k, v, cu_seqlens, dropout_p, softmax_scale,
                   causal, window_size, alibi_slopes, return_attn_probs, group)


def ring_flash_attn_varlen_kvpacked_func(q: torch.Tensor, kv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                                         dropout_p: float = 0.0, softmax_scale: float | None = None,
                                         causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                                         alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                                         return_attn_probs: bool = False, group: ProcessGroup | None = None
                                         ) -> Result:
    """:func:`ring_flash_attn_varlen_func` with ``kv [total_local, 2, Hkv, D]``."""
    name = "ring_flash_attn_varlen_kvpacked_func"
    k, v = _unpack(name, "kv", kv, 2)
    return _varlen(name, RING_VARLEN_LAYOUT, q, k, v, cu_seqlens, dropout_p, softmax_scale, causal, window_size,
                   alibi_slopes, return_attn_probs, group)


def ring_flash_attn_varlen_qkvpacked_func(qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                                          dropout_p: float = 0.0, softmax_scale: float | None = None,
                                          causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                                          alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                                          return_attn_probs: bool = False, group: ProcessGroup | None = None
                                          ) -> Result:
    """:func:`ring_flash_attn_varlen_func` with ``qkv [total_local, 3, H, D]``."""
    name = "ring_flash_attn_varlen_qkvpacked_func"
    q, k, v = _unpack(name, "qkv", qkv, 3)
    return _varlen(name, RING_VARLEN_LAYOUT, q, k, v, cu_seqlens, dropout_p, softmax_scale, causal, window_size,
                   alibi_slopes, return_attn_probs, group)


def zigzag_ring_flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                                       max_seqlen: int, dropout_p: float = 0.0, softmax_scale: float | None = None,
                                       causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                                       alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                                       return_attn_probs: bool = False, group: ProcessGroup | None = None
                                       ) -> Result:
    """Attention over packed sequences, every sequence cut in 2N chunks (rank r holds chunks r and 2N-1-r of each).

    Shapes, ``cu_seqlens`` (local, global / N: every local length even) and returns as
    :func:`ring_flash_attn_varlen_func`; raises as it does.
    """
    return _varlen("zigzag_ring_flash_attn_varlen_func", "zigzag", q, k, v, cu_seqlens, dropout_p, softmax_scale,
                   causal, window_size, alibi_slopes, return_attn_probs, group)


def zigzag_ring_flash_attn_varlen_kvpacked_func(q: torch.Tensor, kv: torch.Tensor, cu_seqlens: torch.Tensor,
                                                max_seqlen: int, dropout_p: float = 0.0,
                                                softmax_scale: float | None = None, causal: bool = False,
                                                window_size: tuple[int, int] = (-1, -1),
                                                alibi_slopes: torch.Tensor | None = None,
                                                deterministic: bool = False, return_attn_probs: bool = False,
                                                group: ProcessGroup | None = None) -> Result:
    """:func:`zigzag_ring_flash_attn_varlen_func` with ``kv [total_local, 2, Hkv, D]``."""
    name = "zigzag_ring_flash_attn_varlen_kvpacked_func"
    k, v = _unpack(name, "kv", kv, 2)
    return _varlen(name, "zigzag", q, k, v, cu_seqlens, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                   return_attn_probs, group)


def zigzag_ring_flash_attn_varlen_qkvpacked_func(qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                                                 dropout_p: float = 0.0, softmax_scale: float | None = None,
                                                 causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                                                 alibi_slopes: torch.Tensor | None = None,
                                                 deterministic: bool = False, return_attn_probs: bool = False,
                                                 group: ProcessGroup | None = None) -> Result:
    """:func:`zigzag_ring_flash_attn_varlen_func` with ``qkv [total_local, 3, H, D]``."""
    name = "zigzag_ring_flash_attn_varlen_qkvpacked_func"
    q, k, v = _unpack(name, "qkv", qkv, 3)
    return _varlen(name, "zigzag", q, k, v, cu_seqlens, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                   return_attn_probs, group)
