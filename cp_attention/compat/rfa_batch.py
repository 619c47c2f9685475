"""ring-flash-attention 0.1.8's batch API on cp_attention's ring: ``ring_flash_attn_func``,
``zigzag_ring_flash_attn_func``, ``stripe_flash_attn_func`` and their ``_kvpacked_func`` /
``_qkvpacked_func`` variants, with the original's names, signatures, defaults and return values.

Shard placement is the original's, which is one of our layouts (sequence dim 1 of ``[B, S, H, D]``):

- ``ring_flash_attn_*``: ``contiguous`` (rank r holds ``x.chunk(N, dim=1)[r]``);
- ``zigzag_ring_flash_attn_*``: ``zigzag`` (2N chunks, rank r holds chunks r and 2N-1-r);
- ``stripe_flash_attn_*``: ``interleaved`` (token t on rank t mod N: stripes of one token).

What differs from the original, on purpose:

- the result is exact for every option the call accepts. The original applies ``window_size`` inside every
  ring block, aligned to the block rather than to global positions, so its windowed result is not
  windowed attention; here a query at global position i sees key j iff ``i - left <= j <= i + right``
  (flash-attn's convention over the whole sequence).
- ``causal=False`` runs on zigzag and stripe placements too (the original asserts ``causal``).
- ``dropout_p`` other than 0 and ``alibi_slopes`` raise ``NotImplementedError`` naming the argument (the
  original asserts ``alibi_slopes is None`` and drops out inside each ring block).
- ``softmax_lse`` (``return_attn_probs=True``) is differentiable; the original's backward ignores its gradient.
- ``deterministic`` is accepted and has no effect: this ring's backward is deterministic.

Each call plans itself (one small all-gather of its settings on the first call of a configuration);
nothing here imports ring-flash-attention or flash-attn.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..api import ring_attention

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "ring_flash_attn_func", "ring_flash_attn_kvpacked_func", "ring_flash_attn_qkvpacked_func",
    "zigzag_ring_flash_attn_func", "zigzag_ring_flash_attn_kvpacked_func", "zigzag_ring_flash_attn_qkvpacked_func",
    "stripe_flash_attn_func", "stripe_flash_attn_kvpacked_func", "stripe_flash_attn_qkvpacked_func",
]

Result = torch.Tensor | tuple[torch.Tensor, torch.Tensor, None]


def _refuse_unsupported(name: str, dropout_p: float, alibi_slopes: torch.Tensor | None) -> None:
    """What the ring cannot honour exactly, refused before any communication (plain arguments: every
    rank checks its own, as every rank passes the same)."""
    if dropout_p != 0:
        raise NotImplementedError(
            f"{name}: dropout_p={dropout_p!r} is not supported; cp_attention computes exact attention without "
            "attention dropout: pass dropout_p=0.0 (as in eval), or set the model's attention_dropout to 0")
    if alibi_slopes is not None:
        raise NotImplementedError(
            f"{name}: alibi_slopes is not supported; cp_attention has no ALiBi bias: pass alibi_slopes=None "
            "(models with ALiBi cannot run on cp_attention's ring)")


def _unpack(name: str, what: str, packed: torch.Tensor, count: int) -> tuple[torch.Tensor, ...]:
    """Views of a packed ``[B, S, count, H, D]`` tensor (gradients flow back to it)."""
    if packed.dim() != 5 or packed.shape[2] != count:
        raise ValueError(f"{name}: {what} must be [batch, seq, {count}, heads, head_dim], got shape "
                         f"{tuple(packed.shape)}; pack with torch.stack([...], dim=2)")
    return packed.unbind(2)


def _attend(name: str, layout: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
            softmax_scale: float | None, causal: bool, window_size: tuple[int, int],
            alibi_slopes: torch.Tensor | None, return_attn_probs: bool, group: ProcessGroup | None) -> Result:
    _refuse_unsupported(name, dropout_p, alibi_slopes)
    window = tuple(window_size) if isinstance(window_size, list) else window_size
    want_lse = bool(return_attn_probs)
    result = ring_attention(q, k, v, group, layout, causal=causal, softmax_scale=softmax_scale, window_size=window,
                            return_lse=want_lse)
    if not want_lse:
        return result
    out, lse = result
    # the original's softmax_lse is flash-attn's: fp32 [batch, heads, local_seq] (ours is fp64 for fp64 inputs)
    return out, lse.float(), None


_ARGS = """

    Args are ring-flash-attention 0.1.8's: ``q [B, S/N, H, D]``, ``k``/``v [B, S/N, Hkv, D]`` (``H`` a
    multiple of ``Hkv``), this rank's shard in the function's placement (the module docstring lists them);
    ``softmax_scale`` defaults to ``D ** -0.5``; ``window_size=(left, right)`` over global positions (-1
    unbounded); ``group`` a process group (None: the default group; without one, plain attention).

    Returns ``out [B, S/N, H, D]`` in q's dtype, or with ``return_attn_probs=True`` ``(out, softmax_lse,
    None)``, ``softmax_lse [B, H, S/N]`` fp32 (natural log), differentiable.

    Raises ``NotImplementedError`` for ``dropout_p != 0`` or ``alibi_slopes``; ``ValueError`` (every rank
    alike, before any communication) for what the ring refuses, e.g. a sequence the placement cannot split.
"""


def ring_flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                         softmax_scale: float | None = None, causal: bool = False,
                         window_size: tuple[int, int] = (-1, -1), alibi_slopes: torch.Tensor | None = None,
                         deterministic: bool = False, return_attn_probs: bool = False,
                         group: ProcessGroup | None = None) -> Result:
    """Attention over a sequence split in N contiguous pieces (rank r holds ``x.chunk(N, dim=1)[r]``)."""
    return _attend("ring_flash_attn_func", "contiguous", q, k, v, dropout_p, softmax_scale, causal, window_size,
                   alibi_slopes, return_attn_probs, group)


def ring_flash_attn_kvpacked_func(q: torch.Tensor, kv: torch.Tensor, dropout_p: float = 0.0,
                                  softmax_scale: float | None = None, causal: bool = False,
                                  window_size: tuple[int, int] = (-1, -1),
                                  alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                                  return_attn_probs: bool = False, group: ProcessGroup | None = None) -> Result:
    """:func:`ring_flash_attn_func` with ``kv [B, S/N, 2, Hkv, D]``."""
    name = "ring_flash_attn_kvpacked_func"
    k, v = _unpack(name, "kv", kv, 2)
    return _attend(name, "contiguous", q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                   return_attn_probs, group)


def ring_flash_attn_qkvpacked_func(qkv: torch.Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
                                   causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                                   alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                                   return_attn_probs: bool = False, group: ProcessGroup | None = None) -> Result:
    """:func:`ring_flash_attn_func` with ``qkv [B, S/N, 3, H, D]``."""
    name = "ring_flash_attn_qkvpacked_func"
    q, k, v = _unpack(name, "qkv", qkv, 3)
    return _attend(name, "contiguous", q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                   return_attn_probs, group)


def zigzag_ring_flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                                softmax_scale: float | None = None, causal: bool = False,
                                window_size: tuple[int, int] = (-1, -1), alibi_slopes: torch.Tensor | None = None,
                                deterministic: bool = False, return_attn_probs: bool = False,
                                group: ProcessGroup | None = None) -> Result:
    """Attention over a sequence in 2N chunks, rank r holding chunks r and 2N-1-r (S divisible by 2N)."""
    return _attend("zigzag_ring_flash_attn_func", "zigzag", q, k, v, dropout_p, softmax_scale, causal, window_size,
                   alibi_slopes, return_attn_probs, group)


def zigzag_ring_flash_attn_kvpacked_func(q: torch.Tensor, kv: torch.Tensor, dropout_p: float = 0.0,
                                         softmax_scale: float | None = None, causal: bool = False,
                                         window_size: tuple[int, int] = (-1, -1),
                                         alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                                         return_attn_probs: bool = False,
                                         group: ProcessGroup | None = None) -> Result:
    """:func:`zigzag_ring_flash_attn_func` with ``kv [B, S/N, 2, Hkv, D]``."""
    name = "zigzag_ring_flash_attn_kvpacked_func"
    k, v = _unpack(name, "kv", kv, 2)
    return _attend(name, "zigzag", q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                   return_attn_probs, group)


def zigzag_ring_flash_attn_qkvpacked_func(qkv: torch.Tensor, dropout_p: float = 0.0,
                                          softmax_scale: float | None = None, causal: bool = False,
                                          window_size: tuple[int, int] = (-1, -1),
                                          alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                                          return_attn_probs: bool = False,
                                          group: ProcessGroup | None = None) -> Result:
    """:func:`zigzag_ring_flash_attn_func` with ``qkv [B, S/N, 3, H, D]``."""
    name = "zigzag_ring_flash_attn_qkvpacked_func"
    q, k, v = _unpack(name, "qkv", qkv, 3)
    return _attend(name, "zigzag", q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                   return_attn_probs, group)


def stripe_flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                           softmax_scale: float | None = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), alibi_slopes: torch.Tensor | None = None,
                           deterministic: bool = False, return_attn_probs: bool = False,
                           group: ProcessGroup | None = None) -> Result:
    """Attention over a striped sequence: token t on rank t mod N (S divisible by N)."""
    return _attend("stripe_flash_attn_func", "interleaved", q, k, v, dropout_p, softmax_scale, causal, window_size,
                   alibi_slopes, return_attn_probs, group)


def stripe_flash_attn_kvpacked_func(q: torch.Tensor, kv: torch.Tensor, dropout_p: float = 0.0,
                                    softmax_scale: float | None = None, causal: bool = False,
                                    window_size: tuple[int, int] = (-1, -1),
                                    alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                                    return_attn_probs: bool = False, group: ProcessGroup | None = None) -> Result:
    """:func:`stripe_flash_attn_func` with ``kv [B, S/N, 2, Hkv, D]``."""
    name = "stripe_flash_attn_kvpacked_func"
    k, v = _unpack(name, "kv", kv, 2)
    return _attend(name, "interleaved", q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                   return_attn_probs, group)


def stripe_flash_attn_qkvpacked_func(qkv: torch.Tensor, dropout_p: float = 0.0,
                                     softmax_scale: float | None = None, causal: bool = False,
                                     window_size: tuple[int, int] = (-1, -1),
                                     alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                                     return_attn_probs: bool = False, group: ProcessGroup | None = None) -> Result:
    """:func:`stripe_flash_attn_func` with ``qkv [B, S/N, 3, H, D]``."""
    name = "stripe_flash_attn_qkvpacked_func"
    q, k, v = _unpack(name, "qkv", qkv, 3)
    return _attend(name, "interleaved", q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                   return_attn_probs, group)


for _f in (ring_flash_attn_func, ring_flash_attn_kvpacked_func, ring_flash_attn_qkvpacked_func,
           zigzag_ring_flash_attn_func, zigzag_ring_flash_attn_kvpacked_func, zigzag_ring_flash_attn_qkvpacked_func,
           stripe_flash_attn_func, stripe_flash_attn_kvpacked_func, stripe_flash_attn_qkvpacked_func):
    if _f.__doc__:  # None under python -OO
        _f.__doc__ += _ARGS  # one statement of the shared arguments, on every function's help()
del _f
