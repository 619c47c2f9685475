"""Rotary embeddings at each token's global position under a CP layout, for megatron-core models.

megatron's ``RotaryEmbedding.forward`` builds the table for the whole sequence and keeps the rows of
the zigzag layout (``get_pos_emb_on_this_cp_rank``, which also moves indices with ``.cuda()``).
:class:`LayoutRotaryEmbedding` wraps one and keeps the rows of any layout instead, on any device.
Used by :func:`cp_attention.integrations.megatron.apply_context_parallel`.
"""

from __future__ import annotations

from typing import Any

import torch

import cp_attention as cpa
from cp_attention.comm import group_rank_and_size

__all__ = ["LayoutRotaryEmbedding"]


class LayoutRotaryEmbedding(torch.nn.Module):
    """A megatron ``RotaryEmbedding`` whose rows are this rank's global positions under ``layout``.

    ``forward(max_seq_len, offset=0, packed_seq=False, cp_group=None)`` takes megatron's arguments
    (``max_seq_len`` is the GLOBAL length, local length x CP size) and returns
    ``[max_seq_len // cp_size, 1, 1, dim]``: row i is row ``positions[i]`` of the full table that
    ``RotaryEmbedding.get_emb`` builds. Other attributes (``get_rotary_seq_len``, ``inv_freq``, ...)
    are the wrapped module's.
    """

    def __init__(self, rope: torch.nn.Module, layout: "str | cpa.Layout", group) -> None:
        super().__init__()
        self.rope = rope
        self.layout = cpa.get_layout(layout)
        self.group = group
        self.rank, self.world_size = group_rank_and_size(group)
        self._cache: dict[tuple, torch.Tensor] = {}

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["rope"], name)

    def extra_repr(self) -> str:
        return f"layout={self.layout.name}, cp_rank={self.rank}, cp_size={self.world_size}"

    def _table_rows(self, max_seq_len: int, offset: int) -> torch.Tensor:
        rope = self.rope
        positions = self.layout.positions(max_seq_len, self.rank, self.world_size).to(rope.inv_freq.device)
        # Rows of megatron's own frequency table, so they are bit-identical to the table without CP.
        freqs = rope.get_freqs_non_repeated(max_seq_len, offset).index_select(0, positions)
        if not rope.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        return emb[:, None, None, :]

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None) -> torch.Tensor:
        """Rotary angles ``[max_seq_len // cp_size, 1, 1, dim]`` for this rank's tokens.

        Raises ``NotImplementedError`` for packed sequences and ``ValueError`` if the layout cannot
        split ``max_seq_len``.
        """
        if packed_seq:
            raise NotImplementedError("packed sequences are not supported with context-parallel ring attention "
                                      "until varlen support lands")
        rope = self.rope
        if rope.inv_freq.device.type == "cpu" and torch.cuda.is_available():
            # Where megatron's get_emb moves it, without failing on a machine with no GPU.
            rope.inv_freq = rope.inv_freq.to(torch.cuda.current_device())
        key = (max_seq_len, offset, rope.inv_freq.device)
        if key not in self._cache:
            if len(self._cache) >= 32:  # megatron's own lru_cache size
                self._cache.clear()
            self._cache[key] = self._table_rows(max_seq_len, offset)
        return self._cache[key]
