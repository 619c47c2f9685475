"""Input validation that raises the same error on every rank, before any ring communication.

Each rank encodes what it was called with as a short integer signature. The ranks all-gather the
signatures (one tiny collective) and every rank checks the whole table with the same pure function,
so a bad input on any one rank raises the same ``ValueError`` on all of them instead of leaving
the others waiting in a receive. The encoding is :mod:`.signature`'s; the judging is here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..kernels import KERNEL_NAMES, get_kernel
from ..kernels.dtypes import FLOAT_DTYPES
from ..layouts.base import Layout
from ..layouts.registry import get_layout, layout_names
from ..transport.base import Transport
from ..transport.comm_types import CP_COMM_TYPES
from .agreement import VERDICTS, cache_enabled, digests_agree
from .blocks import named_kernel_problem
from .codec import Codec, Field, agree_rows, decode_text, raise_differing, raise_first

# the rows this module judges: encoded by .signature, re-exported here where they have always been
from .signature import (
    _DEVICE_TYPES,
    _NOT_A_TENSOR,
    _UNKNOWN,
    CALL_FIELDS,
    GATHERED_FIELDS,
    PLAN_FIELDS,
    TENSOR_FIELDS,
    _bits_float,
    layout_code,
    plan_codes,
    sink_values_code,
    tensor_codes,
    trusted_plan_key,
)

__all__ = ["CallSpec", "plan_codes", "tensor_codes", "check_plan_table", "check_table", "validate_call", "agree_plan",
           "agree_bound_plan",
           "TENSOR_FIELDS", "PLAN_FIELDS", "CALL_FIELDS", "GATHERED_FIELDS", "trusted_plan_key"]


@dataclass(frozen=True)
class CallSpec:
    """What a rank was called with, decoded from its signature."""

    shapes: tuple[tuple[int, ...] | None, ...]  # q's, k's and v's; None: not a tensor
    dtype: int  # index into FLOAT_DTYPES, or -1 when not one float dtype shared by q, k, v
    device: int  # index into _DEVICE_TYPES, -1 other, -2 when q, k, v are on different devices
    layout: int  # index into the registered schedules, -1 unknown
    kernel: int  # index into KERNEL_NAMES, -1 unknown
    causal: bool | int  # -1 when bool(causal) raised
    scale: float | None  # None: a value float() cannot convert
    needs_grad: bool
    sinks: int = 0  # 0: none; their length when a 1-D floating tensor on q's device; -1 otherwise
    softcap: float | None = 0.0  # None: a value float() cannot convert
    comm_type: int = 0  # index into CP_COMM_TYPES, -1 unknown
    documents: int = 0  # packed documents: 0 without cu_seqlens, their count, -1 for bad cu_seqlens
    packed_len: int = 0  # cu_seqlens[-1]
    cu_hash: int = 0  # a fingerprint of cu_seqlens, so ranks that pass different boundaries are caught
    window: tuple[int, int] = (-1, -1)  # window_size as given; (-2, -2) when not two ints >= -1
    # A fingerprint of the sinks' values (0: none, or not read): gathered with the signature when the
    # group agrees a call, never part of its cache key (trained sinks change every step).
    sink_values: int = 0
    return_lse: bool | int = False  # -1 when not a bool
    needs_only: bool | int = True  # the plan's traffic: only the needed rows, or whole shards; -1 not a bool
    given: str = ""  # the first argument this rank could not encode, as repr() shows it (see tensor_codes)
    plan_given: str = ""  # the same for the plan's arguments (see plan_codes)


def _layout_label(code: int) -> str:
    """The name behind a :func:`layout_code`, for messages (the code itself for an unregistered one)."""
    return next((n for n in layout_names() if layout_code(n) == code), f"a layout of code {code}")


def _spec(row: dict) -> CallSpec:
    """A decoded :data:`GATHERED_FIELDS` row as the :class:`CallSpec` the checks read."""
    shapes = tuple(None if row[n][0] == _NOT_A_TENSOR else
                   row[n][1:5] if row[n][0] == 4 else (-1,) * row[n][0] for n in "qkv")
    causal = row["causal"] if row["causal"] == _UNKNOWN else bool(row["causal"])
    return CallSpec(shapes, row["dtype"], row["device"], row["layout"], row["kernel"], causal,
                    _bits_float(row["scale"]), bool(row["needs_grad"]), row["sinks"], _bits_float(row["softcap"]),
                    row["comm_type"], row["documents"], row["packed_len"], row["cu_hash"], row["window"],
                    row["sink_values"], return_lse=_causal(row["return_lse"]), needs_only=_causal(row["needs_only"]),
                    given=decode_text(row["given"]), plan_given=decode_text(row["plan_given"]))


def _tensor_shapes(c: CallSpec) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """``c.shapes`` of a call whose q, k and v are tensors (:func:`_local_problem` refuses any other first)."""
    q, k, v = c.shapes
    if q is None or k is None or v is None:
        raise ValueError(f"ring_attention: q, k and v must be tensors [batch, seq, heads, head_dim], got "
                         f"shapes {c.shapes} (None: not a tensor)")
    return q, k, v


def _local_problem(c: CallSpec, world_size: int) -> str | None:
    """What is wrong with one rank's call on its own, or None."""
    if any(s is None for s in c.shapes):
        names = ", ".join(n for n, s in zip("qkv", c.shapes) if s is None)
        return f"q, k and v must be tensors [batch, seq, heads, head_dim], got something else for {names}"
    shapes = _tensor_shapes(c)
    if any(len(s) != 4 for s in shapes):
        dims = ", ".join(f"{n}.dim()={len(s)}" for n, s in zip("qkv", shapes))
        return f"q, k and v must be 4-D [batch, seq, heads, head_dim], got {dims}"
    (bq, sq, hq, dq), (bk, sk, hk, dk), (bv, sv, hv, dv) = shapes
    if not bq == bk == bv:
        return f"q, k and v must share the batch size, got {bq}, {bk}, {bv}"
    if not sq == sk == sv:
        return (f"q, k and v must have the same local sequence length (this rank's shard), "
                f"got {sq}, {sk}, {sv}")
    if min(bq, sq, hq, hk, dq, dv) == 0:
        return f"q, k and v must be non-empty (every dimension > 0), got shapes {c.shapes}"
    if hk != hv:
        return f"k and v must have the same number of heads, got {hk} and {hv}"
    if hq % hk != 0:
        return (f"the number of query heads must be a multiple of the K/V heads (GQA/MQA), "
                f"got {hq} query heads and {hk} K/V heads")
    if dq != dk:
        return f"q and k must have the same head_dim, got {dq} and {dk} (v may differ)"
    if c.dtype == _UNKNOWN:
        return f"q, k and v must share one floating dtype among {', '.join(str(d) for d in FLOAT_DTYPES)}"
    if c.device == -2:
        return "q, k and v must be on the same device"
    if c.device == _UNKNOWN:
        return f"unsupported device type; expected one of {', '.join(_DEVICE_TYPES)}"
    problem = _plan_problem(c.layout, c.causal, c.documents, c.window, c.needs_only, c.plan_given)
    if problem is not None:
        return problem
    if c.kernel == _UNKNOWN:
        return f"unknown kernel {c.given}; expected one of {', '.join(KERNEL_NAMES)}"
    if c.comm_type == _UNKNOWN:
        return (f"unknown cp_comm_type {c.given}; expected one of {', '.join(CP_COMM_TYPES)} ('a2a+p2p' takes a "
                "2-D DeviceMesh as group: outer dim the ring, inner dim the all-to-all)")
    if c.scale is None:
        return (f"softmax_scale must be a finite non-zero float or None (head_dim ** -0.5), got {c.given}, which "
                "float() cannot convert")
    if not math.isfinite(c.scale) or c.scale == 0.0:
        return f"softmax_scale must be a finite non-zero float, got {c.scale}"
    if c.sinks == _UNKNOWN:
        return "sinks must be a non-empty 1-D floating tensor [heads] on the device of q"
    if c.sinks and c.sinks != hq:
        return f"sinks must hold one logit per query head: expected shape [{hq}], got [{c.sinks}]"
    if c.documents and bq != 1:
        return (f"packed documents (cu_seqlens) need batch size 1 (q, k, v [1, T/N, heads, dim]), got batch {bq}; "
                "pack the rows into one sequence")
    if c.documents and c.packed_len != sq * world_size:
        return (f"cu_seqlens must end at the packed length T = local length {sq} x world_size {world_size} = "
                f"{sq * world_size}, got {c.packed_len}")
    if c.softcap is None:
        return (f"softcap must be a finite float >= 0 (0 or None disables it), got {c.given}, which float() "
                "cannot convert")
    if not math.isfinite(c.softcap) or c.softcap < 0:
        return f"softcap must be a finite float >= 0 (0 or None disables it), got {c.softcap}"
    if c.return_lse == _UNKNOWN:
        return f"return_lse must be a bool (True or False), got {c.given}"
    try:
        get_kernel(KERNEL_NAMES[c.kernel], _DEVICE_TYPES[c.device], FLOAT_DTYPES[c.dtype],
                   softcap=c.softcap > 0, mask=c.window != (-1, -1), head_dim=dq, v_head_dim=dv)
    except ValueError as e:
        return str(e)
    return None


def _plan_problem(layout: int, causal: bool | int, documents: int, window: tuple[int, int],
                  needs_only: bool | int, given: str) -> str | None:
    """What is wrong with the fields of a call that a plan fixes, or None (``given``: the refused
    argument as this rank's :func:`plan_codes` saw it)."""
    if layout == _UNKNOWN:
        return f"unknown layout {given}; expected one of {', '.join(layout_names())} (or an alias)"
    if causal == _UNKNOWN:
        return f"causal must be a bool (True or False), got {given}; pass causal=True or causal=False"
    if documents == _UNKNOWN:
        return ("cu_seqlens must be a 1-D integer tensor, numpy array or sequence [0, l1, l1+l2, ..., T] of document "
                f"boundaries: starting at 0 and strictly increasing (no empty document), got {given}")
    if window == (-2, -2):
        return ("window_size must be (left, right), two ints >= -1 (flash-attn's convention: -1 = unbounded, "
                f"(-1, -1) = no window), got {given}")
    if needs_only == _UNKNOWN:
        return ("needs_only must be a bool (True: send only the K/V rows each rank needs; False: whole shards), got "
                f"{given}; pass cp_attention.plan(..., needs_only=True or False)")
    return None


def _name_at(names: tuple, code: int, what: str) -> str:
    return str(names[code]) if 0 <= code < len(names) else f"an unknown {what}"


def _show(field: str, value) -> str:
    """A signature field's value as a person names it (a dtype, not its index)."""
    if field == "layout":
        return _layout_label(value)
    if field == "dtype":
        return _name_at(FLOAT_DTYPES, value, "dtype (or q, k, v of different dtypes)")
    if field == "device":
        return "q, k, v on different devices" if value == -2 else _name_at(_DEVICE_TYPES, value, "device type")
    if field == "kernel":
        return repr(KERNEL_NAMES[value]) if 0 <= value < len(KERNEL_NAMES) else "an unknown kernel"
    if field == "comm_type":
        return repr(CP_COMM_TYPES[value]) if 0 <= value < len(CP_COMM_TYPES) else "an unknown cp_comm_type"
    if field == "sinks":
        return {0: "none", _UNKNOWN: "not a 1-D float tensor"}.get(value, f"[{value}]")
    if field == "sink_values":
        return f"fingerprint {value}"
    if field in ("return_lse", "needs_only"):
        return "not a bool" if value == _UNKNOWN else str(bool(value))
    return str(value)


def check_plan_table(rows: list[dict], layout: Layout | None) -> None:
    """Check every rank's decoded :data:`PLAN_FIELDS` row; raise one deterministic ``ValueError`` for the
    whole group when any rank's are bad, they differ, or the layout cannot split the packed length."""
    world_size = len(rows)
    raise_first("cp_attention.plan", [_plan_problem(r["layout"], _causal(r["causal"]), r["documents"], r["window"],
                                                    _causal(r["needs_only"]), decode_text(r["plan_given"]))
                                      for r in rows])
    raise_differing("cp_attention.plan", rows, _labels(PLAN_FIELDS, _PLAN_FIELDS), _show)
    if rows[0]["documents"]:
        layout = layout if layout is not None else get_layout(_layout_label(rows[0]["layout"]))
        try:
            layout.check(rows[0]["packed_len"], world_size)
        except ValueError as e:
            raise ValueError(f"cp_attention.plan: cu_seqlens of {rows[0]['packed_len']} tokens over world_size "
                             f"{world_size}: {e}") from None


def agree_plan(transport: Transport, codes: tuple[int, ...], layout: Layout | None) -> None:
    """Agree a plan's :func:`plan_codes` across the group (:func:`~cp_attention.engine.plan.build_plan`'s
    agreement); raise the same ``ValueError`` on every rank for bad or differing ones.

    One all-gather, skipped when the group agreed on the same codes before; on gloo and the loopback
    only once their fingerprints, compared over P2P as :func:`validate_call` compares a call's, show
    every rank holding the same codes: a rank that agreed its codes before must not skip the
    all-gather that a rank holding others (one rank's ``needs_only``, say) waits in.
    """
    key = ("plan", transport.token, tuple(codes), layout) if cache_enabled() else None
    same = True
    if key is not None and transport.world_size > 1 and transport.host_agreement:
        same = digests_agree(transport, _digest(list(codes)))
    if key is not None and same and key in VERDICTS:
        return
    check_plan_table(agree_rows(transport, PLAN_FIELDS, PLAN_FIELDS.decode(codes)), layout)
    if key is not None:
        VERDICTS.add(key)


# What AttentionPlan.bind agrees besides a plan's fields: whether the plan was built for its place in the
# group, and the (rank, world size) it was built for.
_SEAT_FIELDS = Codec(Field("seat_ok"), Field("seat", 2))


def agree_bound_plan(transport: Transport, codes: tuple[int, ...], seat: tuple[int, int],
                     layout: Layout | None) -> None:
    """:meth:`~cp_attention.engine.plan.AttentionPlan.bind`'s agreement, in one all-gather (none on a
    group of one): every rank's plan :func:`plan_codes` and whether its plan was built for its place in
    the group (``seat``: the plan's ``(rank, world_size)``). Raises the same ``ValueError`` on every rank
    if any rank's plan was built for another place, or as :func:`check_plan_table` does."""
    ok = int(tuple(seat) == (transport.rank, transport.world_size))
    rows = agree_rows(transport, PLAN_FIELDS + _SEAT_FIELDS, {**PLAN_FIELDS.decode(codes), "seat_ok": ok, "seat": seat})
    raise_first("AttentionPlan.bind", [None if r["seat_ok"] else
                                       f"the plan was built for rank {r['seat'][0]} of {r['seat'][1]}, not for its "
                                       f"place in the group; build it with plan_ahead(rank=, world_size=) of the group"
                                       for r in rows])
    check_plan_table(rows, layout)


_PLAN_FIELDS = ("layout", "causal", "documents", "cu_hash", "window", "needs_only")
# What a call's ranks must agree on, in the order differences are reported: the CallSpec's fields.
_CALL_FIELDS = ("shapes", "dtype", "device", "layout", "kernel", "causal", "scale", "needs_grad", "sinks", "softcap",
                "comm_type", "documents", "cu_hash", "window", "sink_values", "return_lse", "needs_only")


def _labels(codec: Codec, names: tuple) -> dict[str, str]:
    return {n: ("tensor shapes" if n == "shapes" else codec.field(n).label) for n in names}


def _causal(code: int) -> bool | int:
    return code if code == _UNKNOWN else bool(code)


def check_table(rows: list[dict], layout: Layout | None = None) -> None:
    """Check every rank's decoded :data:`GATHERED_FIELDS` row; raise one deterministic ``ValueError`` for
    the whole group.

    ``layout`` is the caller's resolved layout (it may be user-defined and known to no registry);
    ``None`` resolves the agreed layout by name. It is consulted only once every rank is known to
    pass the same layout and shapes, so every rank reaches the same verdict.
    """
    world_size = len(rows)
    specs = [_spec(r) for r in rows]
    raise_first("ring_attention", [_local_problem(c, world_size) for c in specs])
    raise_differing("ring_attention", specs, _labels(GATHERED_FIELDS, _CALL_FIELDS), _show)
    q_shape, _, v_shape = _tensor_shapes(specs[0])
    sq = q_shape[1]
    if layout is None:
        layout = get_layout(_layout_label(specs[0].layout))
    try:
        layout.check(sq * world_size, world_size)
    except ValueError as e:
        raise ValueError(f"ring_attention: local sequence length {sq} x world_size {world_size} = "
                         f"{sq * world_size} tokens: {e}") from None
    c = specs[0]
    if KERNEL_NAMES[c.kernel] != "auto":
        kernel = get_kernel(KERNEL_NAMES[c.kernel], _DEVICE_TYPES[c.device], FLOAT_DTYPES[c.dtype],
                            softcap=c.softcap is not None and c.softcap > 0,  # None: refused above
                            mask=c.window != (-1, -1), head_dim=q_shape[3], v_head_dim=v_shape[3])
        problem = named_kernel_problem(KERNEL_NAMES[c.kernel], kernel, layout, bool(c.causal), world_size, sq,
                                       bool(c.documents), c.window != (-1, -1), CP_COMM_TYPES[c.comm_type])
        if problem is not None:
            raise ValueError(f"ring_attention: {problem}")


def validate_call(sig: list[int], layout: Layout | None, transport: Transport, in_forward: bool = False,
                  trusted: tuple | None = None, sinks: torch.Tensor | None = None) -> None:
    """Validate a call across the whole group from its signature ``sig`` (:func:`tensor_codes` +
    :func:`plan_codes`); raise the same ``ValueError`` on every rank.

    The all-gather runs once per distinct signature (see :mod:`cp_attention.checks.agreement`): a call
    the group already agreed on, or one inside an adapter's :func:`agreed_forward` (``in_forward``), is
    judged without a collective. On gloo and the loopback ranks first compare signature fingerprints
    by P2P, so ranks calling with different arguments are caught even when each rank's own call was
    agreed before. ``trusted``: a shorter cache key for a call whose plan part the group already agreed
    on (a plan's calls), so a new batch's document boundaries do not make a new signature.
    ``layout`` is the caller's resolved layout (it may be user-defined and known to no registry).
    ``sinks``: their values are compared whenever the signatures are gathered (on CUDA one small
    device read, at a moment the gather already blocks), not on the cached calls.
    """
    world_size = transport.world_size
    cached = cache_enabled()
    same = True
    if world_size > 1 and cached and transport.host_agreement:
        same = digests_agree(transport, _digest(sig))
    key = (transport.token, tuple(sig) if trusted is None else trusted, layout) if cached else None
    if same and key is not None and key in VERDICTS:
        return
    values = CALL_FIELDS.decode(sig)
    if world_size > 1 and same and in_forward:  # agreed by the adapter: judged here, not remembered
        check_table([{**values, "sink_values": 0}] * world_size, layout)
        return
    # the sinks' values too: they must be the same on every rank, like a weight
    check_table(agree_rows(transport, GATHERED_FIELDS,
                           {**values, "sink_values": sink_values_code(sinks) if world_size > 1 else 0}), layout)
    if key is not None:
        VERDICTS.add(key)


def _digest(sig: list[int]) -> int:
    # A fingerprint of the signature that every process computes alike (ints and tuples of ints
    # hash deterministically, unlike strings).
    return hash(tuple(sig)) & ((1 << 62) - 1)
