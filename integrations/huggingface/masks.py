"""The HuggingFace adapter's masks: what a patched model asks transformers' mask interface for, and
the sliding window each attention layer then runs with. No mask tensor is ever built: the ring applies
causal masks, windows and document boundaries itself, and refuses what it cannot honour exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .gen_state import decoding

__all__ = ["RingMask", "layer_window", "ring_mask"]


@dataclass(frozen=True)
class RingMask:
    """What a patched model asked the mask interface for, handed to its attention calls in place of a
    mask (the ring builds none): ``causal`` False for transformers' bidirectional masks, ``window`` the
    sliding window (transformers' size W: keys ``i - W < j <= i``) or None."""

    causal: bool
    window: int | None


def layer_window(mask, sliding_window: int | None, causal: bool) -> int | None:
    """The layer's sliding window (transformers' size), from its ``sliding_window`` argument and the
    mask its model built for it (a :class:`RingMask`, or None for the plain causal mask); None if none.

    The argument is what transformers' flash-attention path honours, the mask what its sdpa and eager
    paths honour. Models pass both (Mistral, Qwen2/3, Gemma2/3, GPT-OSS) or only the mask (Qwen2-MoE,
    PhiMoE). Where they disagree transformers' own backends disagree, so that is refused.
    """
    if mask is not None and not isinstance(mask, RingMask):
        raise NotImplementedError("context-parallel attention does not support custom 4D attention masks; "
                                  "pass no attention_mask (padding is not supported either)")
    if mask is not None and mask.causal != causal:
        raise NotImplementedError(
            f"the model built a {'causal' if mask.causal else 'bidirectional'} mask for a "
            f"{'causal' if causal else 'non-causal'} attention layer (e.g. Gemma2's use_bidirectional_attention, "
            "whose masks stay causal); transformers' sdpa/eager paths follow the mask, flash attention the "
            "layer, so context-parallel attention refuses it")
    if mask is not None and not mask.causal and mask.window is not None:
        raise NotImplementedError(
            "bidirectional sliding-window masks (config.is_causal=False with a sliding window) are not "
            "supported: transformers' sdpa/eager masks (|i - j| <= W) and flash attention (|i - j| < W) disagree")
    window = sliding_window
    if mask is not None and mask.window is not None:
        if window is not None and window != mask.window:
            raise NotImplementedError(
                f"the layer's sliding_window argument ({window}) and its sliding mask (window {mask.window}) "
                "disagree; transformers' attention backends would disagree too, so context-parallel "
                "attention refuses it")
        window = mask.window
    if window is not None and (isinstance(window, bool) or int(window) != window or window < 1):
        raise ValueError(f"sliding_window must be a positive int (the number of keys a query sees, itself "
                         f"included), got {window!r}")
    return None if window is None else int(window)


# What transformers' mask creators pass besides the mask's meaning (sdpa's and eager's own options).
_MASK_OPTIONS = frozenset({"allow_is_causal_skip", "dtype", "device", "mask_function"})
_ABSENT = object()


def ring_mask(batch_size: int, q_length: int | None = None, kv_length: Any = None, q_offset: Any = 0,
              kv_offset: Any = 0, attention_mask: torch.Tensor | None = None, local_size: int | None = None,
              allow_is_bidirectional_skip: Any = _ABSENT, config: Any = None, use_vmap: bool = False,
              cache_position: torch.Tensor | None = None, **options: Any) -> RingMask | None:
    """``AttentionMaskInterface`` entry: the ring applies its masks itself, so no mask is built.

    transformers >= 5.4 describes the queries as ``q_length``/``q_offset``, 5.0-5.3 as ``cache_position``
    (``[q_length]``: the queries' indices in the cache); exactly one form must come (else ``TypeError``).
    Neither is read beyond that: both only place the queries in a KV cache (see ``q_offset`` below).

    Returns None for transformers' plain causal mask, and a :class:`RingMask` naming a sliding window
    (``create_sliding_window_causal_mask``, ``local_size`` = the window) or a bidirectional mask (its
    creators pass ``allow_is_bidirectional_skip``), which the model hands to the attention calls of
    the layers it is meant for, and which
    :func:`~cp_attention.integrations.huggingface.attention._ring_attention_forward` honours or refuses. The kind
    of mask is read from those arguments, not from ``mask_function`` (a closure per creator); anything
    laid over the standard functions is caught by ``use_vmap``. What cannot be honoured is refused
    rather than dropped: padding (a mask with zeros), a model's own mask functions laid over the standard
    ones (transformers sets ``use_vmap`` exactly then: image tokens, bidirectional windows), chunked
    attention (``local_size`` = ``config.attention_chunk_size``), and any argument other than
    :data:`_MASK_OPTIONS` (named in the error). ``q_offset``/``kv_offset`` describe the KV cache's
    layout (a sliding layer's cache shifts them even in a first forward); decoding from a cache, the
    only case where they change what a query sees, is refused by the model's forward check and by the
    attention layer. Inside :func:`~.generation.generate`'s decoding steps the left padding is allowed:
    the sharded cache holds no padding.
    """
    if (q_length is None) == (cache_position is None):
        given = ("both q_length and cache_position" if q_length is not None
                 else "neither q_length (transformers >= 5.4) nor cache_position (5.0-5.3)")
        raise TypeError(f"the attention mask was asked with {given}; expected exactly one: a transformers version "
                        "cp_attention does not know")
    unknown = sorted(name for name, val in options.items() if val is not None and name not in _MASK_OPTIONS)
    if unknown:
        raise NotImplementedError(f"the attention mask was asked with argument(s) context-parallel attention does "
                                  f"not implement: {', '.join(unknown)}; refusing rather than ignoring them")
    if attention_mask is not None and not decoding() and not bool(attention_mask.all()):
        raise NotImplementedError("padding (attention_mask with zeros) is not supported by context-parallel "
                                  "attention yet; pack or trim the batch so that every token is real")
    if use_vmap:
        raise NotImplementedError("the model lays its own mask functions over transformers' standard masks "
                                  "(or_mask_function/and_mask_function: image tokens, bidirectional windows); "
                                  "context-parallel attention does not support them")
    if local_size is not None and local_size == getattr(config, "attention_chunk_size", None):
        raise NotImplementedError(f"chunked attention (attention_chunk_size={local_size}) is not supported by "
                                  "context-parallel attention")
    if allow_is_bidirectional_skip is not _ABSENT:
        return RingMask(causal=False, window=local_size)
    return None if local_size is None else RingMask(causal=True, window=local_size)
