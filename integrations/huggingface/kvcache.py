"""The sharded KV cache of :func:`~cp_attention.integrations.huggingface.generate`: a transformers
``Cache`` whose layers hold only this rank's share of the keys and values.

After the sharded prefill a layer holds, per prompt row, this rank's tokens of that row (the layout's
share, left padding dropped) as ``[B, Hkv, L, D]`` with each key's index in its row (``positions``,
-1 for a slot a shorter row leaves empty). Each decoding step appends the new token's K/V on one rank
in turn, so the shares stay balanced. ``get_seq_length`` is the GLOBAL length (what transformers'
generate counts). Beam search reorders every share alike.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from transformers.cache_utils import Cache, DynamicLayer

__all__ = ["ShardedLayer", "sharded_cache"]


class ShardedLayer(DynamicLayer):
    """One attention layer's share of the cache on this rank. ``owner()`` says, at each decoding step,
    whether this rank keeps the new token (the same answer for every layer of the step)."""

    is_sliding = False  # windows are applied when attending (all of this share is kept)
    is_croppable = False

    def __init__(self, owner: Callable[[], bool]) -> None:
        super().__init__()
        self.owner = owner
        self.positions: torch.Tensor | None = None  # [B, L] long: each key's index in its row, -1 empty
        self.length = 0  # the global sequence length cached so far (every rank alike)
        self.query_position = -1  # the index of the token of the current decoding step
        self.prefill_map: tuple[torch.Tensor, torch.Tensor] | None = None

    def start(self, rows_index: torch.Tensor, positions: torch.Tensor, length: int) -> None:
        """Prepare the prefill: ``rows_index [B, L]`` picks each row's local tokens out of this rank's shard
        of the packed prompt (any index where ``positions`` is -1), ``positions [B, L]`` their indices in
        their rows; ``length`` the prompt's (padded) length."""
        self.prefill_map = (rows_index, positions)
        self.length = length

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill: keep this rank's share, return the shard's K/V for the ring. Decoding: add the new
        token's K/V if this rank keeps it, return the whole share. The other arguments are what
        transformers hands every cache layer (the layer's kwargs); a dynamic layer, as
        ``DynamicLayer`` itself, reads none of them."""
        if self.prefill_map is not None:
            index, self.positions = self.prefill_map
            self.prefill_map = None
            # [1, Hkv, n, D] -> [B, Hkv, L, D]: each row's own tokens of this shard
            self.keys = key_states[0][:, index].transpose(0, 1)
            self.values = value_states[0][:, index].transpose(0, 1)
            self.device, self.is_initialized = key_states.device, True
            return key_states, value_states
        if key_states.shape[-2] != 1:
            raise NotImplementedError(f"the sharded KV cache decodes one token per step, got {key_states.shape[-2]}")
        self.query_position = self.length
        self.length += 1
        keys, values, positions = self._held()
        if self.owner():
            keys = self.keys = torch.cat([keys, key_states], dim=-2)
            values = self.values = torch.cat([values, value_states], dim=-2)
            new = positions.new_full((positions.shape[0], 1), self.query_position)
            self.positions = torch.cat([positions, new], dim=1)
        return keys, values

    def _held(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This share's keys, values and positions, which the prefill sets; ``RuntimeError`` before it."""
        if self.keys is None or self.values is None or self.positions is None:
            raise RuntimeError("the sharded KV cache holds nothing before its sharded prefill: decode through "
                               "cp_attention's generate(), which runs the prefill first")
        return self.keys, self.values, self.positions

    def visible(self, left: int | None) -> torch.Tensor:
        """``[B, L]``: which held keys the current query sees (its row's, at most ``left`` tokens back)."""
        positions = self._held()[2]
        seen = positions >= 0
        if left is not None:
            seen &= positions >= self.query_position - left
        return seen

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int | torch.Tensor) -> tuple[int, int]:
        """(kv length, kv offset) for ``query_length`` queries; transformers before 5.4 passes the queries'
        ``cache_position`` (``[q_length]``) instead, whose length is read (its shape: no host sync)."""
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[0]
        return self.length + query_length, 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            super().reorder_cache(beam_idx)
            positions = self._held()[2]
            self.positions = positions.index_select(0, beam_idx.to(positions.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            super().batch_repeat_interleave(repeats)
            self.positions = self._held()[2].repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            super().batch_select_indices(indices)
            self.positions = self._held()[2][indices]

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("the sharded KV cache cannot be cropped (assisted or speculative decoding); "
                                  "generate without an assistant model")

    def reset(self) -> None:
        super().reset()
        self.positions, self.length, self.query_position, self.prefill_map = None, 0, -1, None


def sharded_cache(num_layers: int, owner: Callable[[], bool]) -> Cache:
    """A transformers ``Cache`` of ``num_layers`` :class:`ShardedLayer`."""
    return Cache(layers=[ShardedLayer(owner) for _ in range(num_layers)])
