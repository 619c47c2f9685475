"""The Megatron adapter's data checks, agreed across the CP group: once per model forward.

What depends on a rank's own data (its ``attention_mask``, the document boundaries of its
``packed_seq_params``, the shape of its inputs) is checked in a forward pre-hook on the model
(:func:`install_forward_checks`, called by ``apply_context_parallel``), and the verdict is agreed in
ONE small all-gather, in which every rank takes part whatever it found: every rank raises the same
error before any layer runs. While that forward runs, the ring attentions recognise the accepted
objects by identity and skip their own checks (no collective, no host sync, no ``torch.equal`` per
layer), and the ring's own call validation needs none either (``cp_attention.checks.agreement.agreed_forward``).
A ring attention called outside a checked forward (directly, or when megatron recomputes it
in backward) checks its own call and agrees on it in one all-gather per call, again with every rank
taking part, whatever its mask (None included).
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any, Callable, Sequence

import torch

import cp_attention as cpa
from cp_attention.checks.agreement import AgreedScope
from cp_attention.checks.verdicts import SHAPE_DIMS, agree, documents_header, shape_header, show_shape
from cp_attention.engine.plan import AttentionPlan
from cp_attention.transport import transport_for

from .packed import (
    check_stream_length,
    packed_config_verdict,
    packed_local_tokens,
    packed_stream_verdict,
    packed_verdict,
)

__all__ = ["ForwardChecks", "install_forward_checks", "check_layer_call", "check_mask", "agreed"]

# A check's exception travels as one of these (anything else as a RuntimeError naming its type).
_KINDS = (ValueError, NotImplementedError, TypeError, RuntimeError)
_NOTE = "(on CP rank {first}; CP ranks with bad input: {bad})"
_CALL_INTS = 3 + 1 + SHAPE_DIMS  # documents_header + shape_header
_MODEL_INPUTS = ("input_ids", "attention_mask", "packed_seq_params")  # a model forward the hook can check
_HOOKS_ATTR = "_cp_forward_checks_hooks"


def _problem(e: Exception) -> tuple[int, str]:
    for i, kind in enumerate(_KINDS[:3]):
        if isinstance(e, kind):
            return i, str(e)
    return len(_KINDS) - 1, f"{type(e).__name__}: {e}"


def agreed(group, cp_size: int, check: Callable[[], Any], header: Callable[[Any], Sequence[int]], headers: int
           ) -> tuple[Any, list[tuple[int, ...]]]:
    """``check()`` and every rank's ``header(result)`` (``headers`` integers; zeros where it raised), agreed
    over ``group`` in one all-gather: an exception on any rank is raised on every rank alike (that of the
    lowest such rank, naming every one). At CP size 1 no collective: the exception itself is raised."""
    try:
        result = check()
        ints = tuple(header(result))
        if len(ints) != headers:  # every rank must send rows of one size
            raise RuntimeError(f"cp_attention internal error: {len(ints)} integers to agree on, expected {headers}")
        problem = cause = None
    except Exception as e:  # noqa: BLE001 - whatever one rank raises, every rank must raise
        result, ints, problem, cause = None, (0,) * headers, _problem(e), e
    if cp_size == 1:
        if cause is not None:
            raise cause
        return result, [ints]
    return result, agree(group, cp_size, problem, _KINDS, _NOTE, ints, cause)


@functools.lru_cache(maxsize=16)
def _expected_mask(layout: cpa.Layout, total: int, rank: int, cp_size: int, causal: bool) -> torch.Tensor:
    """This rank's rows of megatron's causal mask (True = masked out) or of the empty mask, ``[local, total]``."""
    positions = layout.positions(total, rank, cp_size)
    if causal:
        return torch.arange(total)[None, :] > positions[:, None]
    return torch.zeros(len(positions), total, dtype=torch.bool)


def check_mask(mask: torch.Tensor | None, causal: bool, layout: cpa.Layout, rank: int, cp_size: int,
               local: int) -> None:
    """Accept ``None`` or the mask the ring applies anyway: megatron's bool ``[b, 1, local, local * cp_size]``
    causal (or, for ``causal=False``, empty) mask sharded by ``layout``. Raises ``NotImplementedError``."""
    if mask is None:
        return
    total = local * cp_size
    hint = (f"Pass attention_mask=None, or a bool [b, 1, {local}, {total}] mask sharded by "
            f"get_batch_on_this_cp_rank(layout='{layout.name}') (megatron's own get_batch_on_this_cp_rank "
            "shards for zigzag only)")
    if not isinstance(mask, torch.Tensor):
        raise NotImplementedError(f"attention_mask must be None or a bool tensor, got {type(mask).__name__}. {hint}")
    ok = mask.dtype == torch.bool and mask.dim() == 4 and tuple(mask.shape[-2:]) == (local, total)
    if ok:
        expected = _expected_mask(layout, total, rank, cp_size, causal).to(mask.device)
        ok = torch.equal(mask, expected.expand_as(mask))
    if not ok:
        raise NotImplementedError(
            f"ring attention applies the {'causal' if causal else 'empty'} mask over global positions itself "
            f"and cannot honour any other attention_mask (padding, document or custom masks); got "
            f"{tuple(mask.shape)} {mask.dtype}. {hint}")


def _check_consistent(headers: list[tuple[int, ...]], what: str, hint: str) -> None:
    """Raise ``ValueError`` on every rank alike unless every rank's header (``documents`` then shape, as
    made by :func:`_documents_header` and :func:`_shape_header`) agrees: the same packing, the same
    document boundaries, and ``what`` of the same shape."""
    packed = [r for r, h in enumerate(headers) if h[0]]
    if packed and len(packed) != len(headers):
        unpacked = [r for r in range(len(headers)) if r not in packed]
        raise ValueError(f"packed_seq_params were given on CP ranks {packed} but are None on CP ranks {unpacked}; "
                         f"every CP rank must get the same packed_seq_params. {hint}")
    differ = [r for r, h in enumerate(headers) if h[1:3] != headers[0][1:3]]
    if differ:
        totals = [h[1] for h in headers]
        how = (f"their packed streams have {totals} tokens on CP ranks 0..{len(headers) - 1}" if len(set(totals)) > 1
               else f"CP ranks {differ} cut the same {totals[0]} tokens into other documents than CP rank 0")
        raise ValueError(f"packed_seq_params differ across the CP ranks: {how}; every CP rank must get the "
                         f"boundaries of the same full packed stream. {hint}")
    if len({h[3:] for h in headers}) > 1:
        shapes = ", ".join(f"{show_shape(h[3:])} on CP rank {r}" for r, h in enumerate(headers))
        raise ValueError(f"the CP ranks hold {what} of different shapes: {shapes}; every CP rank must hold an "
                         f"equal share of the same batch. {hint}")


def _batch_hint(layout: cpa.Layout) -> str:
    return f"Shard every batch with get_batch_on_this_cp_rank(batch, layout='{layout.name}') on every CP rank"


def check_layer_call(attention, mask: torch.Tensor | None, packed_seq_params, causal: bool,
                     query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[int, ...] | None:
    """The verdict on one call of the ring core ``attention``: its packed documents (None if unpacked).

    Inside a forward checked by :class:`ForwardChecks` that accepted this call's mask and packed
    parameters, no collective: only what follows from the agreed data and the configuration is
    checked, alike on every rank. Otherwise the whole call is checked and agreed in one all-gather, in
    which every rank takes part (with or without a mask), together with the query's shape and the
    documents. Raises ``ValueError``/``NotImplementedError`` (see ``RingDotProductAttention``) on every
    CP rank alike.
    """
    checks = getattr(attention, "forward_checks", None)
    accepted, documents = checks.accepted(mask, packed_seq_params, causal) if checks is not None else (False, None)
    if accepted:
        if documents is not None:
            packed_config_verdict(attention)
            check_stream_length(documents, packed_local_tokens(query, key, value), attention.layout,
                                attention.cp_size)
        return documents

    def check() -> tuple[int, ...] | None:
        if packed_seq_params is not None:
            return packed_verdict(attention, packed_seq_params, mask, query, key, value)
        check_mask(mask, causal, attention.layout, attention.cp_rank, attention.cp_size, query.shape[0])
        return None

    documents, headers = agreed(attention.cp_group, attention.cp_size, check,
                                lambda docs: documents_header(docs) + shape_header(query), _CALL_INTS)
    _check_consistent(headers, "queries", _batch_hint(attention.layout))
    return documents


def _ref(obj: Any) -> tuple[bool, weakref.ref | None]:
    if obj is None:
        return True, None
    try:
        return True, weakref.ref(obj)
    except TypeError:
        return False, None


def _same(ref: weakref.ref | None, obj: Any) -> bool:
    return obj is None if ref is None else ref() is obj


class ForwardChecks:
    """A model's forward pre-hook (:meth:`pre_hook`) and post-hook (:meth:`post_hook`): checks each forward's
    ``attention_mask`` and ``packed_seq_params`` once, agreed over the CP group, and remembers what it
    accepted (by identity, weakly) until the forward ends, so the ring attentions skip their own checks.

    ``causal``: the causal flags of the model's ring attentions (a mask must fit every one of them).
    ``arg_names``: the positional parameter names of the hooked ``forward``.
    """

    def __init__(self, group, layout: cpa.Layout, rank: int, cp_size: int, causal: frozenset,
                 arg_names: Sequence[str]) -> None:
        self.group, self.layout, self.rank, self.cp_size = group, layout, rank, cp_size
        self.causal, self.arg_names = causal, tuple(arg_names)
        self._agreed = AgreedScope()
        self._reset()

    def _reset(self) -> None:
        self._agreed.leave()
        self._active = False
        self._mask: weakref.ref | None = None
        self._params: weakref.ref | None = None
        self._any_mask = False
        self.documents: tuple[int, ...] | None = None
        self.plan: AttentionPlan | None = None

    def accepted(self, mask: torch.Tensor | None, packed_seq_params, causal: bool
                 ) -> tuple[bool, tuple[int, ...] | None]:
        """(True, the documents or None) if this forward's check accepted exactly ``mask`` and
        ``packed_seq_params`` for a layer of this ``causal`` flag, else (False, None). Depends only on
        what every rank agreed on, and on objects the model passes through alike on every rank."""
        if not (self._active and _same(self._mask, mask) and _same(self._params, packed_seq_params)):
            return False, None
        if self._any_mask and causal not in self.causal:  # the masks were checked for other layers
            return False, None
        return True, self.documents

    def _arg(self, args: tuple, kwargs: dict[str, Any], name: str) -> Any:
        if name in kwargs:
            return kwargs[name]
        i = self.arg_names.index(name) if name in self.arg_names else len(args)
        return args[i] if i < len(args) else None

    def _verdict(self, mask: Any, params: Any, local: int | None) -> tuple[int, ...] | None:
        if params is not None:
            return packed_stream_verdict(params, mask, self.layout, self.cp_size, self.group, local)
        if mask is not None and local is not None:
            if len(self.causal) > 1:
                raise NotImplementedError("this model has causal and non-causal ring attention layers, so no one "
                                          "attention_mask fits them all; pass attention_mask=None (each layer "
                                          "applies its own mask type)")
            for causal in self.causal:
                check_mask(mask, causal, self.layout, self.rank, self.cp_size, local)
        return None

    def pre_hook(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        """Forward pre-hook (``with_kwargs=True``): one all-gather. Raises the same ``ValueError`` or
        ``NotImplementedError`` on every CP rank if any rank's mask, packed parameters or input shape
        (``input_ids [b, s]``, else ``decoder_input``) is refused or differs from the other ranks'."""
        self._reset()
        ids, mask, params = (self._arg(args, kwargs, name) for name in _MODEL_INPUTS)
        local = ids.shape[1] if isinstance(ids, torch.Tensor) and ids.dim() >= 2 else None
        shaped = ids if isinstance(ids, torch.Tensor) else self._arg(args, kwargs, "decoder_input")
        ok_mask, mask_ref = _ref(mask)
        ok_params, params_ref = _ref(params)
        # [the objects can be remembered, a mask was given, the local length or -1] + documents + shape
        documents, headers = agreed(
            self.group, self.cp_size, lambda: self._verdict(mask, params, local),
            lambda docs: [int(ok_mask and ok_params), int(mask is not None), -1 if local is None else local]
            + documents_header(docs) + shape_header(shaped), 3 + _CALL_INTS)
        _check_consistent([h[3:] for h in headers], "inputs (input_ids, else decoder_input)",
                          _batch_hint(self.layout))
        # Decided alike on every rank, from what every rank sent: the layers skip their checks only if
        # every rank checked its mask and documents against its local length and can recognise them.
        if all(h[0] and h[2] >= 0 for h in headers):
            self._mask, self._params, self.documents = mask_ref, params_ref, documents
            self._any_mask = any(h[1] for h in headers)
            self._active = True
            # Every rank runs the same ring calls on inputs of agreed shapes: the ring's own validation
            # judges them without a collective until the forward ends (cp_attention.checks.agreement).
            self._agreed.enter(self.group)
            # One plan for the whole forward: every layer reuses it (and its built steps).
            self.plan = AttentionPlan(self.layout, transport_for(self.group), True, documents, agreed=True)

    def plan_for(self, documents: tuple[int, ...] | None, causal: bool, window_size: tuple[int, int]
                 ) -> AttentionPlan | None:
        """This forward's plan for a layer whose call the check accepted with ``documents`` (the very
        tuple it agreed on, or None unpacked), ``causal`` and ``window_size``; None otherwise."""
        if self.plan is None or documents is not self.documents:
            return None
        return self.plan.variant(causal, window_size)

    def post_hook(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        """Forward hook (``with_kwargs=True, always_call=True``): the forward is over, forget what it accepted."""
        self._reset()


def _outermost(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The outermost submodules (``module`` itself first) whose forward takes ``input_ids``,
    ``attention_mask`` and ``packed_seq_params`` (megatron's ``GPTModel`` and its kin)."""
    try:
        names = set(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        names = set()
    if set(_MODEL_INPUTS) <= names:
        return [module]
    return [m for child in module.children() for m in _outermost(child)]


# rings: RingDotProductAttention modules; typed Any because .attention imports this module (no cycle, even
# one for the type checker only).
def install_forward_checks(model: torch.nn.Module, rings: Sequence[Any]) -> int:
    """Hook :class:`ForwardChecks` on the outermost model forwards of ``model`` that hold ring
    attentions (replacing the hooks of an earlier call) and link those rings to it; rings outside
    them check each call themselves. Returns the number of hooked modules."""
    for m in model.modules():
        for handle in getattr(m, _HOOKS_ATTR, ()):
            handle.remove()
        if hasattr(m, _HOOKS_ATTR):
            delattr(m, _HOOKS_ATTR)
    for m in rings:
        m.forward_checks = None
    ring_of = {id(m): m for m in rings}
    hooked = 0
    for module in _outermost(model):
        mine = [ring_of[id(m)] for m in module.modules() if id(m) in ring_of]
        if not mine:
            continue
        flags = set()
        for m in mine:
            try:
                flags.add(m._causal(None))
            except NotImplementedError:  # an unsupported mask type: that layer refuses every call itself
                pass
        params = inspect.signature(module.forward).parameters.values()
        positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        first = mine[0]
        checks = ForwardChecks(first.ring_group, first.layout, first.cp_rank, first.cp_size, frozenset(flags),
                               positional)
        setattr(module, _HOOKS_ATTR, (module.register_forward_pre_hook(checks.pre_hook, with_kwargs=True),
                                      module.register_forward_hook(checks.post_hook, with_kwargs=True,
                                                                   always_call=True)))
        for m in mine:
            m.forward_checks = checks
        hooked += 1
    return hooked
