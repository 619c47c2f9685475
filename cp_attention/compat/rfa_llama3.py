"""ring-flash-attention 0.1.8's llama3 varlen API on cp_attention: ``llama3_flash_attn_prepare_cu_seqlens``,
``llama3_flash_attn_varlen_func`` and its ``_kvpacked_func`` / ``_qkvpacked_func`` variants, with the original's
names, signatures, defaults and return values (re-exported by :mod:`.rfa_varlen`).

Placement: rank r holds the contiguous slice ``[r*T/N, (r+1)*T/N)`` of the whole packed batch (documents cut
anywhere): our ``contiguous`` layout with the GLOBAL ``cu_seqlens``; K/V travel by our ``all_gather`` strategy,
as the original's. The calls get only this rank's view (``cu_seqlens_q``, ``cu_seqlens_k``, ``local_k_slice``),
so the global boundaries come from:

- the :func:`llama3_flash_attn_prepare_cu_seqlens` call that made them (it remembers its input against its
  ``cu_seqlens_q``/``cu_seqlens_k`` tensors, matched by identity): no communication, the usual path (the HF
  adapter's ``update_ring_flash_attn_params`` and callers that prepare once per batch);
- otherwise, one all-gather of every rank's view per call (two small collectives and a host read), from which
  every rank rebuilds the same boundaries and checks every rank's view against them, raising alike.

Differences from the original: windows are exact (the original's non-causal windows are aligned to each
rank's key slice, not to positions); ``heads_k_stride`` is checked as the original asserts it but K/V heads are
gathered at once (more memory); ``dropout_p``/``alibi_slopes`` raise ``NotImplementedError``; the LSE (fp32
``[heads, total_local]``) is differentiable; a view that does not match ``causal`` raises ``ValueError``.
"""

from __future__ import annotations

import bisect
import weakref
from typing import TYPE_CHECKING

import torch

from ..api import ring_attention
from ..layouts.documents import cu_seqlens_tuple
from .rfa_batch import _refuse_unsupported

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["llama3_flash_attn_prepare_cu_seqlens", "llama3_flash_attn_varlen_func",
           "llama3_flash_attn_varlen_kvpacked_func", "llama3_flash_attn_varlen_qkvpacked_func"]

Result = torch.Tensor | tuple[torch.Tensor, torch.Tensor, None]
View = tuple[tuple[int, ...], tuple[int, ...], int, int, slice]

# id(cu_seqlens_q) -> (weakref to it, weakref to its cu_seqlens_k, global boundaries, causal, world size)
_PREPARED: dict[int, tuple] = {}


def _view(cu: tuple[int, ...], causal: bool, rank: int, world_size: int) -> View:
    """``llama3_flash_attn_prepare_cu_seqlens`` on host boundaries: (cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k, local_k_slice). The documents overlapping this rank's slice ``[start, end)`` are
    ``cu[left:right+1]``; q's boundaries are clipped to the slice, k's start at the first one's start and end
    at the slice's end (causal: later keys are never needed) or at the last one's end."""
    total = cu[-1]
    if total % world_size:
        raise ValueError(f"llama3_flash_attn_prepare_cu_seqlens: the packed length {total} must be divisible by "
                         f"world_size={world_size}; pad the batch (cp_attention.pad_cu_seqlens(cu_seqlens, "
                         f"{world_size}))")
    per = total // world_size
    start, end = rank * per, (rank + 1) * per
    left = bisect.bisect_left(cu, start)
    if cu[left] != start:
        left -= 1
    right = bisect.bisect_left(cu, end)
    docs = cu[left:right + 1]
    q = (0, *(b - start for b in docs[1:-1]), per)
    k_end = end if causal else cu[right]
    k = tuple(b - cu[left] for b in docs[:-1]) + (k_end - cu[left],)
    return (q, k, max(b - a for a, b in zip(q, q[1:])), max(b - a for a, b in zip(k, k[1:])),
            slice(cu[left], k_end))


def llama3_flash_attn_prepare_cu_seqlens(cu_seqlens: torch.Tensor, causal: bool, rank: int, world_size: int
                                         ) -> tuple[torch.Tensor, torch.Tensor, int, int, slice]:
    """This rank's view of packed ``cu_seqlens`` (the whole batch's, the same on every rank), as the original:
    ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, local_k_slice)``, the tensors with
    ``cu_seqlens``'s dtype and device. Raises ``ValueError`` if the packed length does not split over
    ``world_size`` ranks (the original asserts) or ``rank`` is outside ``[0, world_size)``."""
    if not 0 <= rank < world_size:
        raise ValueError(f"llama3_flash_attn_prepare_cu_seqlens: rank must be in [0, world_size={world_size}), "
                         f"got {rank}")
    cu = cu_seqlens_tuple(cu_seqlens)
    q, k, max_q, max_k, local_k_slice = _view(cu, causal, rank, world_size)
    cu_q = torch.tensor(q, dtype=cu_seqlens.dtype, device=cu_seqlens.device)
    cu_k = torch.tensor(k, dtype=cu_seqlens.dtype, device=cu_seqlens.device)
    key = id(cu_q)
    _PREPARED[key] = (weakref.ref(cu_q), weakref.ref(cu_k), cu, bool(causal), world_size)
    weakref.finalize(cu_q, _PREPARED.pop, key, None)
    return cu_q, cu_k, max_q, max_k, local_k_slice


def _group_size_rank(group: ProcessGroup | None) -> tuple[int, int]:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _gathered(name: str, view: View, total_local: int, causal: bool, group, device, world_size: int
              ) -> tuple[int, ...]:
    """The global boundaries rebuilt from every rank's view (one all-gather), each rank's view checked against
    them: the same result, or the same ``ValueError``, on every rank."""
    import torch.distributed as dist

    q, k, _, _, sl = view
    mine = [total_local, sl.start, sl.stop, len(q), *q, *k]
    size = torch.tensor([len(mine)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world_size)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s) for s in sizes)
    payload = torch.tensor(mine + [0] * (longest - len(mine)), dtype=torch.int64, device=device)
    gathered = [torch.empty_like(payload) for _ in range(world_size)]
    dist.all_gather(gathered, payload, group=group)
    rows = [r.tolist() for r in gathered]
    lengths = sorted({r[0] for r in rows})
    if len(lengths) != 1:
        raise ValueError(f"{name}: every rank must hold an equal contiguous slice of the packed batch, got local "
                         f"lengths {[r[0] for r in rows]}")
    per = lengths[0]
    bounds = {0, per * world_size}
    for r, row in enumerate(rows):
        n = row[3]
        bounds.add(row[1])
        bounds.update(b + r * per for b in row[5:3 + n])  # q's inner boundaries
    cu = tuple(sorted(bounds))
    for r, row in enumerate(rows):
        n = row[3]
        given = (tuple(row[4:4 + n]), tuple(row[4 + n:4 + 2 * n]), row[1], row[2])
        try:
            eq, ek, _, _, es = _view(cu, causal, r, world_size)
        except ValueError:
            eq = None
        if eq is None or given != (eq, ek, es.start, es.stop):
            raise ValueError(f"{name}: rank {r}'s cu_seqlens_q, cu_seqlens_k and local_k_slice are not "
                             f"llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, causal={causal}, rank={r}, "
                             f"world_size={world_size}) of one packed batch; prepare them with the causal of the "
                             f"call, from the same cu_seqlens on every rank")
    return cu


def _global_cu_seqlens(name: str, cu_seqlens_q, cu_seqlens_k, local_k_slice: slice, causal: bool, total_local: int,
                       group, device) -> tuple[int, ...]:
    world_size, rank = _group_size_rank(group)
    entry = _PREPARED.get(id(cu_seqlens_q))
    if entry is not None and entry[0]() is cu_seqlens_q and entry[1]() is cu_seqlens_k:
        _, _, cu, prepared_causal, prepared_size = entry
        if prepared_causal != bool(causal) or prepared_size != world_size or cu[-1] != total_local * world_size:
            raise ValueError(f"{name}: cu_seqlens_q/cu_seqlens_k were prepared with causal={prepared_causal}, "
                             f"world_size={prepared_size} for {cu[-1]} tokens, called with causal={causal} on "
                             f"{world_size} ranks holding {total_local} tokens each; call "
                             f"llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, causal={causal}, rank, "
                             f"world_size={world_size}) for this call")
        return cu
    if not isinstance(local_k_slice, slice) or not all(isinstance(x, int) for x in (local_k_slice.start,
                                                                                   local_k_slice.stop)):
        raise ValueError(f"{name}: local_k_slice must be the slice llama3_flash_attn_prepare_cu_seqlens returns, "
                         f"got {local_k_slice!r}")
    q, k = cu_seqlens_tuple(cu_seqlens_q), cu_seqlens_tuple(cu_seqlens_k)
    if len(q) != len(k) or len(q) < 2:
        raise ValueError(f"{name}: cu_seqlens_q and cu_seqlens_k must have one entry per document boundary "
                         f"each (equal lengths >= 2), got {len(q)} and {len(k)}")
    view = (q, k, 0, 0, local_k_slice)
    if world_size == 1:
        if q[-1] != total_local or view[:2] + (local_k_slice,) != (q, q, slice(0, q[-1])):
            raise ValueError(f"{name}: on one rank cu_seqlens_q and cu_seqlens_k must be the whole batch's "
                             f"boundaries ending at {total_local} and local_k_slice slice(0, {total_local})")
        return q
    return _gathered(name, view, total_local, causal, group, device, world_size)


def _llama3(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q, cu_seqlens_k,
            heads_k_stride: int, local_k_slice: slice, dropout_p: float, softmax_scale: float | None, causal: bool,
            window_size: tuple[int, int], alibi_slopes: torch.Tensor | None, return_attn_probs: bool,
            group: ProcessGroup | None) -> Result:
    _refuse_unsupported(name, dropout_p, alibi_slopes)
    for what, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: {what} must be [total_local, heads, head_dim] (flash-attn's varlen), "
                             f"got {shape}")
    if type(heads_k_stride) is not int or heads_k_stride < 1 or k.shape[1] % heads_k_stride:
        raise ValueError(f"{name}: heads_k_stride must be a positive int dividing the {k.shape[1]} K/V heads, got "
                         f"{heads_k_stride!r}")
    cu = _global_cu_seqlens(name, cu_seqlens_q, cu_seqlens_k, local_k_slice, causal, q.shape[0], group, q.device)
    window = tuple(window_size) if isinstance(window_size, list) else window_size
    want_lse = bool(return_attn_probs)
    result = ring_attention(q[None], k[None], v[None], group, "contiguous", causal=causal, softmax_scale=softmax_scale,
                            cu_seqlens=cu, window_size=window, return_lse=want_lse, cp_comm_type="all_gather")
    if not want_lse:
        return result[0]
    out, lse = result
    return out[0], lse[0].float(), None  # flash-attn varlen's LSE: fp32 [heads, total_local]


def llama3_flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                  cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                                  heads_k_stride: int, local_k_slice: slice, dropout_p: float = 0.0,
                                  softmax_scale: float | None = None, causal: bool = False,
                                  window_size: tuple[int, int] = (-1, -1), alibi_slopes: torch.Tensor | None = None,
                                  deterministic: bool = False, return_attn_probs: bool = False,
                                  group: ProcessGroup | None = None) -> Result:
    """Attention over a packed batch held in contiguous slices (rank r: tokens ``[r*T/N, (r+1)*T/N)``).

    ``q [T/N, H, D]``, ``k``/``v [T/N, Hkv, D]``; ``cu_seqlens_q`` ... ``local_k_slice`` from
    :func:`llama3_flash_attn_prepare_cu_seqlens` (``max_seqlen_*`` are kernel hints and unused). Returns
    ``out [T/N, H, D]`` or, with ``return_attn_probs``, ``(out, softmax_lse [H, T/N] fp32, None)``. Raises
    ``NotImplementedError`` for ``dropout_p != 0`` or ``alibi_slopes``, ``ValueError`` for bad shapes, a bad
    ``heads_k_stride`` or a view prepared for another ``causal``, batch or group.
    """
    return _llama3("llama3_flash_attn_varlen_func", q, k, v, cu_seqlens_q, cu_seqlens_k, heads_k_stride,
                   local_k_slice, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_attn_probs, group)


def _unpack(name: str, what: str, packed: torch.Tensor, count: int) -> tuple[torch.Tensor, ...]:
    if not isinstance(packed, torch.Tensor) or packed.dim() != 4 or packed.shape[1] != count:
        shape = tuple(packed.shape) if isinstance(packed, torch.Tensor) else type(packed).__name__
        raise ValueError(f"{name}: {what} must be [total, {count}, heads, head_dim], got {shape}; pack with "
                         f"torch.stack([...], dim=1)")
    return packed.unbind(1)


def llama3_flash_attn_varlen_kvpacked_func(q: torch.Tensor, kv: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                                           heads_k_stride: int, local_k_slice: slice, dropout_p: float = 0.0,
                                           softmax_scale: float | None = None, causal: bool = False,
                                           window_size: tuple[int, int] = (-1, -1),
                                           alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                                           return_attn_probs: bool = False, group: ProcessGroup | None = None
                                           ) -> Result:
    """:func:`llama3_flash_attn_varlen_func` with ``kv [T/N, 2, Hkv, D]``."""
    name = "llama3_flash_attn_varlen_kvpacked_func"
    k, v = _unpack(name, "kv", kv, 2)
    return _llama3(name, q, k, v, cu_seqlens_q, cu_seqlens_k, heads_k_stride, local_k_slice, dropout_p, softmax_scale,
                   causal, window_size, alibi_slopes, return_attn_probs, group)


def llama3_flash_attn_varlen_qkvpacked_func(qkv: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                                            max_seqlen_q: int, max_seqlen_k: int, heads_k_stride: int,
                                            local_k_slice: slice, dropout_p: float = 0.0,
                                            softmax_scale: float | None = None, causal: bool = False,
                                            window_size: tuple[int, int] = (-1, -1),
                                            alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                                            return_attn_probs: bool = False, group: ProcessGroup | None = None
                                            ) -> Result:
    """:func:`llama3_flash_attn_varlen_func` with ``qkv [T/N, 3, H, D]``."""
    name = "llama3_flash_attn_varlen_qkvpacked_func"
    q, k, v = _unpack(name, "qkv", qkv, 3)
    return _llama3(name, q, k, v, cu_seqlens_q, cu_seqlens_k, heads_k_stride, local_k_slice, dropout_p, softmax_scale,
                   causal, window_size, alibi_slopes, return_attn_probs, group)
