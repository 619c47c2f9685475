"""ring-flash-attention 0.1.8's HF adapter (``ring_flash_attn.adapters.hf_adapter``) on cp_attention: the names
its callers import (Axolotl, OpenRLHF, LLaMA-Factory forks), with the original's signatures and its pattern.
A model loaded with ``attn_implementation="flash_attention_2"``, then::

    substitute_hf_flash_attn(group, heads_k_stride=1)     # once
    update_ring_flash_attn_params(cu_seqlens, group)      # per batch: the WHOLE packed batch's boundaries
    model(input_ids=ids[:, r*T/N:(r+1)*T/N], position_ids=...)   # rank r: its contiguous slice

runs every flash-attention layer as cp_attention's ``contiguous`` layout over ``group`` with the batch's
documents, K/V all-gathered (the original's llama3 varlen path). transformers itself is imported only when
these functions run (the ``hf`` extra).

Like the original, :func:`substitute_hf_flash_attn` replaces
``transformers.modeling_flash_attention_utils._flash_attention_forward`` (behind :func:`use_ring_attn`'s switch)
and registers :func:`flash_attention_forward`, which calls that attribute, as ``"flash_attention_2"``; so a
caller that swaps in its own ``_flash_attention_forward`` keeps working. Differences, on purpose:

- exact where the original is not: sliding windows are transformers' own (query i sees ``i - W < j <= i``;
  the original's reach one key further), non-causal layers, logit softcap and attention sinks (``s_aux``) are
  honoured instead of asserted away;
- what cannot be honoured is refused by name instead of ignored: a padding ``attention_mask``, attention
  dropout, ``cu_seq_lens_q/k`` from a collator (the documents come from :func:`update_ring_flash_attn_params`),
  a layer run before :func:`update_ring_flash_attn_params`, a batch whose length is not the prepared one, and
  any attention argument it does not implement;
- the first layer of each forward checks ``position_ids`` against the prepared documents (RoPE would be
  silently wrong otherwise) and agrees the verdict and the documents over the group, so a bad batch raises
  the same error on every rank instead of hanging: one small all-gather per forward;
- transformers 5 only (the original's import fails there); ``heads_k_stride`` is checked but K/V heads
  travel at once, as in :mod:`.rfa_llama3`.
"""

from __future__ import annotations

import inspect
import weakref
from typing import TYPE_CHECKING, Any, Callable, cast

import torch

from ..api import ring_attention
from ..layouts.documents import longest_document
from .rfa_llama3 import _global_cu_seqlens, _group_size_rank, llama3_flash_attn_prepare_cu_seqlens

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["DATA_PARAMS", "RING_ATTN_SWITCH", "check_params", "update_ring_flash_attn_params", "use_ring_attn",
           "create_ring_flash_attention_forward", "flash_attention_forward", "substitute_hf_flash_attn"]

DATA_PARAMS: dict = {}
RING_ATTN_SWITCH = True
_use_top_left_mask = False
_PARAM_KEYS = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "local_k_slice")
_NAME = "ring_flash_attn's HF adapter"
# transformers' own _flash_attention_forward, saved by the first substitute_hf_flash_attn (a second call must
# not take the first one's switch for it).
_ORIGINAL: dict = {}
def check_params(f1: Callable, f2: Callable) -> bool:
    """Whether ``f1`` and ``f2`` take the same number of parameters (the original's signature test)."""
    return len(inspect.signature(f1).parameters) == len(inspect.signature(f2).parameters)


def update_ring_flash_attn_params(cu_seqlens: torch.Tensor, process_group: ProcessGroup) -> None:
    """Set the documents of the next batch: ``cu_seqlens`` are the WHOLE packed batch's boundaries (int, from 0 to
    the total length T, the same on every rank), each rank holding tokens ``[r*T/N, (r+1)*T/N)``. Stores this
    rank's view in :data:`DATA_PARAMS` as the original does. Raises ``ValueError`` if T does not split over the
    group (pad the batch)."""
    import torch.distributed as dist

    world_size = dist.get_world_size(group=process_group)
    rank = dist.get_rank(group=process_group)
    DATA_PARAMS.update(zip(_PARAM_KEYS, llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, True, rank, world_size)))


def use_ring_attn(flag: bool) -> None:
    """Switch the substituted ``_flash_attention_forward`` between the ring (True) and transformers' own."""
    global RING_ATTN_SWITCH
    RING_ATTN_SWITCH = flag


class _Accepted:
    """The position ids and prepared documents the group last agreed on (weakly held): later layers of the same
    forward skip the check."""

    positions: weakref.ref | None = None
    cu_q: weakref.ref | None = None

    @classmethod
    def covers(cls, position_ids: torch.Tensor | None, cu_q: torch.Tensor) -> bool:
        same_cu = cls.cu_q is not None and cls.cu_q() is cu_q
        if position_ids is None:
            return same_cu
        return same_cu and cls.positions is not None and cls.positions() is position_ids

    @classmethod
    def accept(cls, position_ids: torch.Tensor | None, cu_q: torch.Tensor) -> None:
        cls.positions = None if position_ids is None else weakref.ref(position_ids)
        cls.cu_q = weakref.ref(cu_q)


def _agree_batch(position_ids: torch.Tensor | None, cu: tuple[int, ...], total: int, group,
                 world_size: int, rank: int) -> None:
    """Check this rank's ``position_ids`` against the documents and agree the verdict and the documents over the
    group (one all-gather): the same ``ValueError`` on every rank, or none."""
    from cp_attention.checks.verdicts import agree, documents_header
    from cp_attention.integrations.huggingface.checks import expected_positions
    from cp_attention.layouts import get_layout

    problem = None
    if position_ids is not None:
        expected = expected_positions(get_layout("contiguous"), total, rank, world_size, cu).to(position_ids.device)
        if position_ids.shape[-1] != expected.numel() or not torch.equal(position_ids,
                                                                           expected.expand_as(position_ids)):
            problem = (0, f"{_NAME}: position_ids must be this rank's contiguous slice of positions within the "
                          f"documents given to update_ring_flash_attn_params (expected {expected[:4].tolist()}..., "
                          f"got {position_ids.flatten()[:4].tolist()}...), or RoPE is wrong; slice position_ids "
                          "like input_ids, and call update_ring_flash_attn_params with this batch's cu_seqlens")
    headers = agree(group, world_size, problem, (ValueError,), "(rank {first} first; refusing ranks: {bad})",
                    header=documents_header(cu))
    if len(set(headers)) != 1:
        raise ValueError(f"{_NAME}: the ranks were given different documents (update_ring_flash_attn_params "
                         "must get the same whole-batch cu_seqlens on every rank of the group)")


def _refuse(attention_mask, dropout: float, use_top_left_mask: bool, cu_seq_lens_q, cu_seq_lens_k,
            others: dict) -> None:
    """What the ring cannot honour, by name, before any communication (every rank runs the same model)."""
    # The switches and loss arguments transformers hands every attention call, which cannot change it: the HF
    # adapter's own lists.
    from cp_attention.integrations.huggingface.attention import _LOSS_ONLY, _OUTPUT_FLAGS

    harmless = _OUTPUT_FLAGS | _LOSS_ONLY
    unknown = sorted(n for n, v in others.items() if v is not None and n not in harmless
                     and not (n == "output_attentions" and not v))
    if unknown:
        raise NotImplementedError(f"{_NAME} got attention argument(s) it does not implement: {', '.join(unknown)}; "
                                  "refusing rather than ignoring them (a silently wrong result)")
    if attention_mask is not None:
        raise NotImplementedError(f"{_NAME}: a padding attention_mask cannot be honoured (the documents come from "
                                  "update_ring_flash_attn_params); pack the batch without padding, or make the "
                                  "padding a document of its own in cu_seqlens")
    if dropout:
        raise NotImplementedError(f"{_NAME}: attention dropout ({dropout}) is not supported; set "
                                  "config.attention_dropout=0.0")
    if use_top_left_mask:
        raise NotImplementedError(f"{_NAME}: use_top_left_mask=True (flash-attn < 2.1's causal alignment) is not "
                                  "supported")
    if cu_seq_lens_q is not None or cu_seq_lens_k is not None:
        raise NotImplementedError(f"{_NAME}: cu_seq_lens_q/cu_seq_lens_k (a flattening collator's) cannot be "
                                  "honoured: pass the whole batch's boundaries to update_ring_flash_attn_params "
                                  "instead, and do not return flash-attention kwargs from the collator")


def create_ring_flash_attention_forward(process_group: ProcessGroup, heads_k_stride: int) -> list[Callable]:
    """The candidates for ``transformers.modeling_flash_attention_utils._flash_attention_forward``, as the
    original's (one here: transformers 5's parameters). Each takes ``[B=1, T/N, H, D]`` q and ``[1, T/N, Hkv, D]``
    k/v and returns ``[1, T/N, H, Dv]``; raises ``NotImplementedError``/``ValueError`` for what it refuses."""

    def _flash_attention_forward(query_states: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor,
                                 attention_mask: torch.Tensor | None, query_length: int, is_causal: bool,
                                 dropout: float = 0.0, position_ids: torch.Tensor | None = None,
                                 softmax_scale: float | None = None, sliding_window: int | None = None,
                                 use_top_left_mask: bool = False, softcap: float | None = None,
                                 deterministic: bool | None = None, cu_seq_lens_q: torch.Tensor | None = None,
                                 cu_seq_lens_k: torch.Tensor | None = None, max_length_q: int | None = None,
                                 max_length_k: int | None = None, target_dtype: torch.dtype | None = None,
                                 attn_implementation: str | None = None, layer_idx: int | None = None,
                                 s_aux: torch.Tensor | None = None, **others: Any) -> torch.Tensor:
        _refuse(attention_mask, dropout, use_top_left_mask, cu_seq_lens_q, cu_seq_lens_k, others)
        if query_states.dim() != 4 or query_states.shape[0] != 1:
            raise ValueError(f"{_NAME}: the batch must be one packed row [1, T/N, heads, head_dim] (varlen data is "
                             f"packed in advance), got {tuple(query_states.shape)}")
        if key_states.shape[1] != query_states.shape[1]:
            raise NotImplementedError(f"{_NAME}: {query_states.shape[1]} queries but {key_states.shape[1]} keys "
                                      "(a KV cache) is not supported; generate without the ring (use_ring_attn(False))")
        hkv = key_states.shape[2]
        if type(heads_k_stride) is not int or heads_k_stride < 1 or hkv % heads_k_stride:
            raise ValueError(f"{_NAME}: heads_k_stride must be a positive int dividing the {hkv} K/V heads, got "
                             f"{heads_k_stride!r}")
        if not DATA_PARAMS:
            raise RuntimeError(f"{_NAME}: no documents; call update_ring_flash_attn_params(cu_seqlens, "
                               "process_group) with each batch before running the model")
        local = query_states.shape[1]
        world_size, rank = _group_size_rank(process_group)
        cu = _global_cu_seqlens(_NAME, DATA_PARAMS["cu_seqlens_q"], DATA_PARAMS["cu_seqlens_k"],
                                DATA_PARAMS["local_k_slice"], True, local, process_group, query_states.device)
        if not _Accepted.covers(position_ids, DATA_PARAMS["cu_seqlens_q"]):
            _agree_batch(position_ids, cu, local * world_size, process_group, world_size, rank)
            _Accepted.accept(position_ids, DATA_PARAMS["cu_seqlens_q"])
        causal = bool(is_causal)
        window: dict[str, Any] = {} if sliding_window is None or sliding_window >= longest_document(cu, cu[-1]) else {
            "window_size": (sliding_window - 1, -1 if causal else sliding_window - 1)}
        q, k, v = query_states, key_states, value_states
        if target_dtype is not None and q.dtype == torch.float32:  # transformers' fa_peft_integration_check
            q, k, v = (t.to(target_dtype) for t in (q, k, v))
        return ring_attention(q, k, v, process_group, "contiguous", causal=causal, softmax_scale=softmax_scale,
                              sinks=s_aux, softcap=softcap or 0.0, cu_seqlens=cu, cp_comm_type="all_gather",
                              **window)

    return [_flash_attention_forward]


def flash_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0,
                            scaling: float | None = None, sliding_window: int | None = None,
                            softcap: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` entry registered as ``"flash_attention_2"``: q ``[B, H, n, D]``, k/v
    ``[B, Hkv, n, D]`` -> ``([B, n, H, Dv], None)`` through ``transformers.modeling_flash_attention_utils.
    _flash_attention_forward`` (looked up per call, as the original: whatever is substituted there runs).
    ``kwargs`` go on to it, which refuses those it does not implement."""
    import transformers.modeling_flash_attention_utils as fa_utils
    from transformers.integrations.flash_attention import get_target_dtype

    seq_len = query.shape[2]
    query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    is_causal = kwargs.pop("is_causal", None)
    is_causal = cast(bool, module.is_causal) if is_causal is None else is_causal  # a plain attribute of HF's
    original_dtype = query.dtype
    out = fa_utils._flash_attention_forward(query, key, value, attention_mask, query_length=seq_len,
                                            is_causal=is_causal, dropout=dropout, softmax_scale=scaling,
                                            sliding_window=sliding_window, softcap=softcap,
                                            use_top_left_mask=_use_top_left_mask,
                                            target_dtype=get_target_dtype(query, module), **kwargs)
    return out.to(original_dtype), None


def _accepts(fn: Callable, names: list[str]) -> bool:
    params = inspect.signature(fn).parameters
    return any(p.kind is p.VAR_KEYWORD for p in params.values()) or all(n in params for n in names)


def substitute_hf_flash_attn(process_group: ProcessGroup, heads_k_stride: int) -> None:
    """Run transformers' ``"flash_attention_2"`` attention as ring attention over ``process_group`` (see the module
    docstring), switchable with :func:`use_ring_attn`. Raises ``RuntimeError`` on a transformers older than
    cp_attention's floor, ``ValueError`` if no candidate of :func:`create_ring_flash_attention_forward` takes
    transformers' ``_flash_attention_forward`` arguments."""
    from cp_attention._extras import require_extra
    from cp_attention.versions import require_version

    require_extra("hf", ("transformers",), "substitute_hf_flash_attn")
    require_version("transformers", "substitute_hf_flash_attn")
    import transformers.modeling_flash_attention_utils as fa_utils
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    old = _ORIGINAL.setdefault("forward", fa_utils._flash_attention_forward)
    names = [n for n, p in inspect.signature(old).parameters.items() if p.kind is not p.VAR_KEYWORD]
    new = next((f for f in create_ring_flash_attention_forward(process_group, heads_k_stride)
                if _accepts(f, names)), None)
    if new is None:
        raise ValueError(f"substitute_hf_flash_attn: no ring forward takes this transformers' "
                         f"_flash_attention_forward arguments ({', '.join(names)})")

    def switched(*args: Any, **kwargs: Any) -> torch.Tensor:
        return new(*args, **kwargs) if RING_ATTN_SWITCH else old(*args, **kwargs)

    fa_utils._flash_attention_forward = switched
    ALL_ATTENTION_FUNCTIONS["flash_attention_2"] = flash_attention_forward
