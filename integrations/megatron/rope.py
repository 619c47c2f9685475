"""Rotary embeddings at each token's global position under a CP layout, for megatron-core models.

megatron's ``RotaryEmbedding.forward`` builds the table for the whole sequence and keeps the rows of
the zigzag layout (``get_pos_emb_on_this_cp_rank``, which also moves indices with ``.cuda()``).
:class:`LayoutRotaryEmbedding` wraps one and keeps the rows of any layout instead, on any device.
Used by :func:`cp_attention.integrations.megatron.apply_context_parallel`.

Packed (THD) batches: megatron applies RoPE to them in ``_apply_rotary_pos_emb_thd``, which cuts
every document of the local tokens into ``2 * cp_size`` equal pieces, TransformerEngine's own split,
and so is wrong for any other sharding (and for documents whose length ``2 * cp_size`` does not
divide). Under :func:`~cp_attention.integrations.megatron.apply_context_parallel` the wrapper
therefore returns no table for packed batches, megatron's attention skips RoPE, and
``RingDotProductAttention`` rotates q and k itself with the rows of :meth:`LayoutRotaryEmbedding.packed_rows`:
each token's position WITHIN its document, through megatron's own (unpacked) ``apply_rotary_pos_emb``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

import cp_attention as cpa
from cp_attention.layouts.documents import CuSeqlens, check_cu_seqlens, document_position_ids, longest_document
from cp_attention.transport import group_rank_and_size

if TYPE_CHECKING:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

__all__ = ["LayoutRotaryEmbedding"]

_CACHE_SIZE = 32  # megatron's own lru_cache size


def _is_thd(packed_seq_params: Any) -> bool:
    return packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", None) == "thd"


class LayoutRotaryEmbedding(torch.nn.Module):
    """A megatron ``RotaryEmbedding`` whose rows are this rank's global positions under ``layout``.

    ``forward(max_seq_len, offset=0, packed_seq=False, cp_group=None)`` takes megatron's arguments
    (``max_seq_len`` is the GLOBAL length, local length x CP size) and returns
    ``[max_seq_len // cp_size, 1, 1, dim]``: row i is row ``positions[i]`` of the full table that
    ``RotaryEmbedding.get_emb`` builds. For packed (THD) batches it returns ``None`` once
    ``applies_in_attention`` is set (by ``apply_context_parallel``): the ring attention then applies
    :meth:`packed_rows` itself. Other attributes (``inv_freq``, ...) are the wrapped module's.
    """

    def __init__(self, rope: torch.nn.Module, layout: str | cpa.Layout, group) -> None:
        super().__init__()
        self.rope: RotaryEmbedding = rope  # megatron's (or a subclass): its inv_freq and table methods
        self.layout = cpa.get_layout(layout)
        self.group = group
        self.rank, self.world_size = group_rank_and_size(group)
        # Set by apply_context_parallel once every RingDotProductAttention of the model applies
        # packed_rows to packed batches.
        self.applies_in_attention = False
        self._cache: dict[tuple, torch.Tensor] = {}

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["rope"], name)

    def extra_repr(self) -> str:
        return f"layout={self.layout.name}, cp_rank={self.rank}, cp_size={self.world_size}"

    def _device(self) -> torch.device:
        rope = self.rope
        if rope.inv_freq.device.type == "cpu" and torch.cuda.is_available():
            # Where megatron's get_emb moves it, without failing on a machine with no GPU.
            rope.inv_freq = rope.inv_freq.to(torch.cuda.current_device())
        return rope.inv_freq.device

    def _rows(self, positions: torch.Tensor, table_len: int, offset: int) -> torch.Tensor:
        """Rows ``positions`` of megatron's table of ``table_len`` rows, ``[len(positions), 1, 1, dim]``."""
        rope = self.rope
        # Rows of megatron's own frequency table, so they are bit-identical to the table without CP.
        freqs = rope.get_freqs_non_repeated(table_len, offset).index_select(0, positions.to(rope.inv_freq.device))
        if not rope.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        return emb[:, None, None, :]

    def _cached(self, key: tuple, make) -> torch.Tensor:
        if key not in self._cache:
            if len(self._cache) >= _CACHE_SIZE:
                self._cache.clear()
            self._cache[key] = make()
        return self._cache[key]

    def packed_rows(self, cu_seqlens: CuSeqlens) -> torch.Tensor:
        """Rotary angles ``[T // cp_size, 1, 1, dim]`` of this rank's tokens of a packed stream.

        ``cu_seqlens`` are the document boundaries ``[0, l1, l1+l2, ..., T]`` of the FULL packed
        stream, as the ring attends with them; this rank holds the tokens
        ``layout.positions(T, rank, cp_size, cu_seqlens)`` and row i is row ``p`` of megatron's
        table, ``p`` being that token's position within its document (a document restarts at
        row 0, as if it were a sequence of its own). Raises ``ValueError`` for bad ``cu_seqlens`` or a
        ``T`` the layout cannot split.
        """
        cu = check_cu_seqlens(cu_seqlens)
        device = self._device()

        def make() -> torch.Tensor:
            positions = self.layout.positions(cu[-1], self.rank, self.world_size, cu)
            longest = longest_document(cu, cu[-1])
            return self._rows(document_position_ids(positions, cu), longest, 0)

        return self._cached(("packed", cu, device), make)

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        """megatron's ``RotaryEmbedding.get_rotary_seq_len``, except for packed (THD) batches that the
        ring attention rotates itself: their table is never built, so ``max_seqlen_q``/``max_seqlen_kv``
        may be left unset (returns them when set, else 0)."""
        psp = kwargs.get("packed_seq_params", args[4] if len(args) > 4 else None)
        if self.applies_in_attention and psp is not None and _is_thd(psp):
            given = [n for n in (psp.max_seqlen_q, psp.max_seqlen_kv) if n is not None]
            return int(max(given)) if given else 0
        return self.rope.get_rotary_seq_len(*args, **kwargs)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False,
                cp_group=None) -> torch.Tensor | None:
        """Rotary angles ``[max_seq_len // cp_size, 1, 1, dim]`` for this rank's tokens.

        For a packed (THD) batch (``packed_seq=True``) returns ``None``: the ring attention applies
        RoPE within documents itself. ``cp_group`` is ignored (the wrapper's group is the CP group).

        Raises ``NotImplementedError`` for a packed batch when the model's ring attention does not
        apply RoPE (``apply_context_parallel`` was not called on the model), ``ValueError`` if the
        layout cannot split ``max_seq_len``.
        """
        if packed_seq:
            if not self.applies_in_attention:
                raise NotImplementedError(
                    "packed sequences (THD) with context-parallel RoPE are rotated by RingDotProductAttention; "
                    "call cp_attention.integrations.megatron.apply_context_parallel(model), which links this "
                    "rotary embedding to the model's ring attentions")
            return None
        device = self._device()

        def make() -> torch.Tensor:
            positions = self.layout.positions(max_seq_len, self.rank, self.world_size)
            return self._rows(positions, max_seq_len, offset)

        return self._cached((max_seq_len, offset, device), make)
