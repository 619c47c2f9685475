"""The HuggingFace adapter's data checks, once per model forward and agreed across the CP group.

What depends on a rank's own data (its position ids, padding in its mask, the document boundaries it
was given) is checked in a forward pre-hook on the patched model, and the verdict is all-gathered in
one small collective, so every rank raises the same error before any layer runs, instead of one rank
raising while the others wait in the ring. The attention layers then recognise the checked tensors
by identity and skip their own per-layer checks (no ``torch.equal`` or ``.tolist()`` per layer).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

import cp_attention as cpa
from cp_attention.checks.agreement import AgreedScope
from cp_attention.checks.verdicts import SHAPE_DIMS, agree, documents_header, shape_header, show_shape
from cp_attention.engine.plan import AttentionPlan
from cp_attention.layouts.documents import check_cu_seqlens, cu_seqlens_tuple, document_position_ids, longest_document
from cp_attention.transport import transport_for

from .gen_state import active_generation

__all__ = ["ForwardChecks", "documents", "expected_positions", "check_positions"]

_KINDS = (ValueError, NotImplementedError)
# The forwards' KV cache argument: transformers before 5.24 names it past_key_values, 5.24 on cache (the old
# name still taken, renamed inside the forward, after this check sees the call).
CACHE_ARGUMENTS = ("past_key_values", "cache")


def documents(cu_q, cu_k, max_q, max_k, total: int) -> tuple[int, ...] | None:
    """The packed-document boundaries from transformers' attention kwargs, checked; None if unpacked.

    Raises ``ValueError`` (or ``NotImplementedError`` for differing query and key boundaries).
    """
    if cu_q is None and cu_k is None:
        if max_q is not None or max_k is not None:
            raise ValueError("max_length_q/k were given without cu_seq_lens_q/k; pass the batch from shard_batch")
        return None
    if cu_q is None or cu_k is None:
        raise ValueError("packed documents need both cu_seq_lens_q and cu_seq_lens_k (equal: self-attention); "
                         "pass the batch from shard_batch")
    cu = check_cu_seqlens(cu_q, total=total)
    if cu_seqlens_tuple(cu_k) != cu:
        raise NotImplementedError("cu_seq_lens_k differs from cu_seq_lens_q: context-parallel attention is "
                                  "self-attention over one packed stream; pass equal boundaries")
    longest = longest_document(cu, total)
    for name, val in (("max_length_q", max_q), ("max_length_k", max_k)):
        if val is not None and int(val) != longest:
            raise ValueError(f"{name}={int(val)} disagrees with cu_seq_lens (longest document {longest}); "
                             "pass the batch from shard_batch")
    return cu


@functools.lru_cache(maxsize=16)
def expected_positions(layout: cpa.Layout, total: int, rank: int, world_size: int,
                       cu: tuple[int, ...] | None) -> torch.Tensor:
    """This rank's position ids under ``layout``: global positions, or positions within documents."""
    positions = layout.positions(total, rank, world_size, cu)
    return positions if cu is None else document_position_ids(positions, cu)


def check_positions(position_ids: torch.Tensor, layout: cpa.Layout, total: int, rank: int, world_size: int,
                    cu: tuple[int, ...] | None) -> None:
    """Raise ``ValueError`` unless ``position_ids`` are this rank's positions (see :func:`expected_positions`)."""
    expected = expected_positions(layout, total, rank, world_size, cu).to(position_ids.device)
    if position_ids.shape[-1] != expected.numel() or not torch.equal(position_ids, expected.expand_as(position_ids)):
        what = "GLOBAL positions" if cu is None else "positions within their documents"
        raise ValueError(
            f"position_ids must be this rank's {what} under the {layout.name} layout "
            f"(expected {expected[:4].tolist()}..., got {position_ids.flatten()[:4].tolist()}...), or RoPE is "
            "wrong; pass position_ids (and, for packed or padded batches, cu_seq_lens_q/k) from "
            "cp_attention.integrations.huggingface.shard_batch")


class ForwardChecks:
    """A patched model's forward pre-hook: checks the data of each forward once, agreed over the group,
    and remembers what it accepted so the layers can skip their own checks."""

    def __init__(self, group, layout: cpa.Layout, rank: int, world_size: int) -> None:
        self.group, self.layout, self.rank, self.world_size = group, layout, rank, world_size
        self._positions: weakref.ref | None = None
        self._cu_q: weakref.ref | None = None
        self.cu: tuple[int, ...] | None = None
        self.plan: AttentionPlan | None = None  # this forward's, once its data is agreed
        self._agreed = AgreedScope()
        self.loss: Any = None  # the model's loss_function (.loss.CPModelLoss): checks a forward's labels

    def accepted_positions(self, position_ids: torch.Tensor) -> bool:
        """Whether ``position_ids`` is the tensor this forward's check accepted."""
        return self._positions is not None and self._positions() is position_ids

    def plan_for(self, cu_q, causal: bool, window_size: tuple[int, int]) -> AttentionPlan | None:
        """This forward's plan for a layer called with ``cu_q`` (the tensor the check accepted, or None
        for an unpacked forward), ``causal`` and ``window_size``; None outside a checked forward."""
        if self.plan is None:
            return None
        same = (cu_q is None and self.cu is None) or (cu_q is not None and self.accepted_documents(cu_q)[1])
        return self.plan.variant(causal, window_size) if same else None

    def accepted_documents(self, cu_q) -> tuple[tuple[int, ...] | None, bool]:
        """(the boundaries, True) if ``cu_q`` is the tensor this forward's check accepted, else (None, False)."""
        if cu_q is not None and self._cu_q is not None and self._cu_q() is cu_q:
            return self.cu, True
        return None, False

    def _problem(self, kwargs: dict[str, Any], local: int, own_cache: Any) -> tuple[int, str] | None:
        total = local * self.world_size
        try:
            for name in CACHE_ARGUMENTS:  # generate's own sharded cache (``own_cache``) already holds the prompt
                cache = kwargs.get(name)
                if cache is not None and cache is not own_cache and (
                        not hasattr(cache, "get_seq_length") or cache.get_seq_length() > 0):
                    raise NotImplementedError(
                        f"{name}= got a KV cache that holds tokens: decoding from a KV cache is not supported on a "
                        "CP-patched model's forward (the cache would hold only this rank's shard); call "
                        "cp_attention.integrations.huggingface.generate(model, input_ids, group=..., layout=...), "
                        f"which shards the prompt and the cache, or drop {name}=")
            if self.loss is not None:  # labels: the exact CP loss, or refused here by name
                self.loss.check(kwargs)
            mask = kwargs.get("attention_mask")
            if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all()):
                raise NotImplementedError(
                    "padding (attention_mask with zeros) cannot be given to a context-parallel model; pass "
                    "the padded batch to shard_batch, which packs its rows into documents")
            cu = documents(kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k"), kwargs.get("max_length_q"),
                           kwargs.get("max_length_k"), total)
            positions = kwargs.get("position_ids")
            if positions is None:
                raise ValueError(
                    "position_ids were not given to the context-parallel model, so it would use 0..n-1 on every "
                    "rank (right for the first rank of the contiguous layout only, and RoPE would be wrong "
                    "elsewhere); pass the position_ids from shard_batch: model(**model_inputs(local))")
            check_positions(positions, self.layout, total, self.rank, self.world_size, cu)
        except (*_KINDS, TypeError) as e:  # a TypeError is bad input too (max_length_q=[5]): agree on it
            return (_KINDS.index(type(e)) if type(e) in _KINDS else 0), str(e)
        self.cu = cu
        self._positions = weakref.ref(positions)
        cu_q = kwargs.get("cu_seq_lens_q")
        self._cu_q = weakref.ref(cu_q) if isinstance(cu_q, torch.Tensor) else None
        return None

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]
                 ) -> tuple[tuple, dict[str, Any]] | None:
        """Forward pre-hook (``with_kwargs=True``). Raises the same ``ValueError`` or
        ``NotImplementedError`` on every rank if any rank's data is refused.

        Inside :func:`~.generation.generate`, the prefill's prompt batch is swapped for this rank's
        shard of the packed prompt (then checked as any forward), and a decoding step's forward (the
        same token on every rank) is let through: its layers merge their partial results themselves."""
        self._agreed.leave()  # a forward that ended without its post-hook (not on a normal path)
        self._positions = self._cu_q = self.cu = self.plan = None
        gen = active_generation(getattr(module, "_cp_attention", None))
        if gen is not None:
            if gen.prefilled:
                gen.step += 1
                return None
            args, kwargs = (), gen.prefill_inputs(kwargs)
            self._check(args, kwargs, gen.cache)
            return args, kwargs
        self._check(args, kwargs)
        return None

    def _check(self, args: tuple, kwargs: dict[str, Any], own_cache: Any = None) -> None:
        """Check one forward's data, agreed over the group; on success build the forward's plan.
        ``own_cache``: a generation's sharded cache, which its prefill may be given (under either name)."""
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        problem = None
        if isinstance(ids, torch.Tensor) and ids.dim() >= 2:  # else the layers check what they get
            problem = self._problem(kwargs, ids.shape[1], own_cache)
        # Every rank takes part in the all-gather, whatever it found, so none is left waiting. It also
        # carries the input's shape and a fingerprint of the documents, which must agree across ranks.
        header = shape_header(ids) + documents_header(self.cu if problem is None else None)
        try:
            headers = agree(self.group, self.world_size, problem, _KINDS, "(on rank {first}; ranks refused: {bad})",
                            header)
            if len(set(headers)) > 1:
                shapes = ", ".join(f"{show_shape(h[:SHAPE_DIMS + 1])} with "
                                   f"{h[SHAPE_DIMS + 2] or 'no'} packed tokens on rank {r}"
                                   for r, h in enumerate(headers))
                raise ValueError(f"the ranks hold inputs of different shapes or documents: {shapes}; every rank must "
                                 "hold its shard of the same batch: shard_batch(batch, group=..., layout=...) on "
                                 "every rank")
        except _KINDS:
            self._positions = self._cu_q = None
            raise
        # Decided alike on every rank (from what every rank sent): with checked inputs of agreed shapes,
        # every rank makes the same ring calls, so their validation needs no collective until the
        # forward ends (cp_attention.checks.agreement; post_hook leaves).
        if all(h[0] >= 2 for h in headers):
            self._agreed.enter(self.group)
            # One plan for the whole forward: every layer reuses it (and its built steps).
            self.plan = AttentionPlan(self.layout, transport_for(self.group), True, self.cu, agreed=True)

    def post_hook(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
        """Forward hook (``with_kwargs=True, always_call=True``): the forward is over (or raised).

        The plan stays until the next forward: activation checkpointing runs the layers again in
        backward, on the very tensors this forward accepted, and they reuse it (their calls are then
        validated outside the agreed scope, as any call is). A generation's prefill gets every rank's
        logits of the prompt rows' last tokens."""
        self._agreed.leave()
        gen = active_generation(getattr(module, "_cp_attention", None))
        if gen is not None and not gen.prefilled and output is not None:
            return gen.finish_prefill(output)
        return None
