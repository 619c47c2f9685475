"""Input validation that raises the same error on every rank, before any ring communication.

Each rank encodes what it was called with as a short integer signature. The ranks all-gather the
signatures (one tiny collective) and every rank checks the whole table with the same pure function,
so a bad input on any one rank raises the same ``ValueError`` on all of them instead of leaving
the others waiting in a receive.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import is_fake

from ..kernels import KERNEL_NAMES, get_kernel
from ..kernels.dtypes import FLOAT_DTYPES
from ..layouts.base import Layout
from ..layouts.documents import check_cu_seqlens
from ..layouts.registry import get_layout, layout_names
from ..schedules.windows import check_window_size
from ..transport.base import Transport
from ..transport.comm_types import CP_COMM_TYPES
from .agreement import VERDICTS, cache_enabled, digests_agree
from ..transport.codec import Codec, Field, agree_rows, raise_differing, raise_first

__all__ = ["CallSpec", "plan_codes", "tensor_codes", "check_plan_table", "check_table", "validate_call",
           "TENSOR_FIELDS", "PLAN_FIELDS", "CALL_FIELDS", "GATHERED_FIELDS", "trusted_plan_key"]

_DEVICE_TYPES = ("cpu", "cuda")
_UNKNOWN = -1
_NOT_A_TENSOR = -1  # in place of a tensor's dim
# The bits of a float argument that float() cannot convert (a quiet NaN with a payload of its own).
_NOT_A_FLOAT = 0x7FF8_0000_DEAD_BEEF
# Window sides beyond this are all "no bound" to any real sequence: clamped, so the int64 signature
# holds them (two ranks that pass different such sides get the same result anyway).
_HUGE = 1 << 62


@dataclass(frozen=True)
class CallSpec:
    """What a rank was called with, decoded from its signature."""

    shapes: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
    dtype: int  # index into FLOAT_DTYPES, or -1 when not one float dtype shared by q, k, v
    device: int  # index into _DEVICE_TYPES, -1 other, -2 when q, k, v are on different devices
    layout: int  # index into the registered schedules, -1 unknown
    kernel: int  # index into KERNEL_NAMES, -1 unknown
    causal: "bool | int"  # -1 when bool(causal) raised
    scale: "float | None"  # None: a value float() cannot convert
    needs_grad: bool
    sinks: int = 0  # 0: none; their length when a 1-D floating tensor on q's device; -1 otherwise
    softcap: "float | None" = 0.0  # None: a value float() cannot convert
    comm_type: int = 0  # index into CP_COMM_TYPES, -1 unknown
    documents: int = 0  # packed documents: 0 without cu_seqlens, their count, -1 for bad cu_seqlens
    packed_len: int = 0  # cu_seqlens[-1]
    cu_hash: int = 0  # a fingerprint of cu_seqlens, so ranks that pass different boundaries are caught
    window: tuple[int, int] = (-1, -1)  # window_size as given; (-2, -2) when not two ints >= -1
    # A fingerprint of the sinks' values (0: none, or not read): gathered with the signature when the
    # group agrees a call, never part of its cache key (trained sinks change every step).
    sink_values: int = 0


def _documents_trusted(documents: int) -> int:
    return min(documents, 1)  # packed or not: an agreed plan's new batch may hold other documents


# The rows ranks compare (see :mod:`.codec`): a call's tensors and per-call arguments, a plan's fields,
# and the sinks' values' fingerprint, gathered with them but never part of a cache key.
TENSOR_FIELDS = Codec(
    Field("q", 5, "tensor shapes"), Field("k", 5, "tensor shapes"), Field("v", 5, "tensor shapes"),
    Field("dtype", label="dtype"), Field("device", label="device type"), Field("kernel", label="kernel"),
    Field("scale", label="softmax_scale"), Field("needs_grad", label="requires_grad of q, k, v"),
    Field("sinks", label="sinks (given or not, and their length)"), Field("softcap", label="softcap"),
    Field("comm_type", label="cp_comm_type"))
PLAN_FIELDS = Codec(
    Field("layout", label="layout"), Field("causal", label="causal"),
    Field("documents", label="cu_seqlens (given or not, and how many documents)", trusted=_documents_trusted),
    Field("packed_len", label="cu_seqlens (packed length)"),
    Field("cu_hash", label="cu_seqlens (document boundaries)", trusted=None),
    Field("window", 2, label="window_size"))
CALL_FIELDS = TENSOR_FIELDS + PLAN_FIELDS
GATHERED_FIELDS = CALL_FIELDS + Codec(Field(
    "sink_values", label="sinks values (the same learned logits on every rank, as for any replicated weight)",
    trusted=None))


def sink_values_code(sinks) -> int:
    """A fingerprint of ``sinks``' values that every process computes alike (0 for no sinks, for a
    tensor validation refuses anyway, or one with no values to read, such as a fake tensor). Reads
    the values to the host: called only when the group gathers a new call signature."""
    if not isinstance(sinks, torch.Tensor) or sinks.dim() != 1 or not sinks.is_floating_point():
        return 0
    if is_fake(sinks):
        return 0
    bits = tuple(sinks.detach().double().cpu().view(torch.int64).tolist())  # NaN's hash is per object
    return (hash(bits) & ((1 << 62) - 1)) or 1


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _bits_float(b: int) -> "float | None":
    return None if b == _NOT_A_FLOAT else struct.unpack("<d", struct.pack("<q", b))[0]


def _float_code(x) -> int:
    """The bits of ``float(x)``, or :data:`_NOT_A_FLOAT` when it cannot be converted."""
    try:
        return _float_bits(float(x))
    except Exception:  # noqa: BLE001 - TypeError, ValueError, OverflowError, a tensor of several values...
        return _NOT_A_FLOAT


def _sinks_code(q: torch.Tensor, sinks) -> int:
    if sinks is None:
        return 0
    ok = (isinstance(sinks, torch.Tensor) and sinks.dim() == 1 and sinks.numel() > 0
          and sinks.is_floating_point() and sinks.device == getattr(q, "device", None))
    return sinks.numel() if ok else _UNKNOWN


def _cu_codes(cu_seqlens) -> list[int]:
    if cu_seqlens is None:
        return [0, 0, 0]
    try:
        cu = check_cu_seqlens(cu_seqlens)
    except ValueError:
        return [_UNKNOWN, 0, 0]
    return [len(cu) - 1, cu[-1], hash(cu) & ((1 << 62) - 1)]


def _window_codes(window_size) -> list[int]:
    if window_size is None:
        return [-1, -1]
    try:
        left, right = check_window_size(window_size)
    except ValueError:
        return [-2, -2]
    return [min(left, _HUGE), min(right, _HUGE)]


def trusted_plan_key(codes) -> tuple:
    """The part of a plan's :func:`plan_codes` a call's trusted cache key holds: everything but the
    document boundaries' count and fingerprint (see :class:`~cp_attention.engine.plan.AttentionPlan`)."""
    return PLAN_FIELDS.trusted_key(PLAN_FIELDS.decode(codes))


def layout_code(name: str) -> int:
    """A layout's name as an int every process computes alike: a registered layout and a Layout object
    known to no registry are told apart by name, not by a registry index."""
    return zlib.crc32(name.encode()) & ((1 << 62) - 1)


def _layout_label(code: int) -> str:
    """The name behind a :func:`layout_code`, for messages (the code itself for an unregistered one)."""
    return next((n for n in layout_names() if layout_code(n) == code), f"a layout of code {code}")


def plan_codes(layout, causal, cu_seqlens=None, window_size=None) -> list[int]:
    """What is fixed for a batch, as ints: layout, causal, packed documents (count, length,
    fingerprint) and window. Never raises (see :func:`tensor_codes`)."""
    try:
        code = layout_code(get_layout(layout).name)
    except (ValueError, TypeError):
        code = _UNKNOWN
    documents, packed_len, cu_hash = _cu_codes(cu_seqlens)
    return PLAN_FIELDS.encode(dict(layout=code, causal=_causal_code(causal), documents=documents,
                                   packed_len=packed_len, cu_hash=cu_hash, window=_window_codes(window_size)))


def _causal_code(causal) -> int:
    """0 or 1 for a bool (or the int 0 or 1), else unknown: a truthy string such as ``"no"`` is not a
    mask choice (``bool("no")`` is True), nor is a tensor (reading it would sync the device)."""
    if isinstance(causal, bool) or (type(causal) is int and causal in (0, 1)):
        return int(causal)
    return _UNKNOWN


def tensor_codes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: "float | None", kernel: str,
                 sinks: "torch.Tensor | None" = None, softcap: float = 0.0, cp_comm_type: str = "p2p") -> list[int]:
    """This rank's tensors and per-call arguments as a fixed-length list of ints (see :class:`CallSpec`).

    Never raises: whatever is wrong with the arguments is encoded, so the rank still takes part in
    the all-gather and every rank reaches the same verdict (a rank raising here would leave the
    others waiting in the collective).
    """
    tensors = all(isinstance(t, torch.Tensor) for t in (q, k, v))
    values: dict = {}
    for name, t in zip("qkv", (q, k, v)):
        if not isinstance(t, torch.Tensor):
            values[name] = [_NOT_A_TENSOR, 0, 0, 0, 0]
            continue
        shape = list(t.shape)[:4] if t.dim() == 4 else []
        values[name] = [t.dim(), *(shape + [0] * (4 - len(shape)))]
    values["dtype"] = values["device"] = _UNKNOWN
    if tensors:
        dt = q.dtype
        if dt == k.dtype == v.dtype and dt in FLOAT_DTYPES:
            values["dtype"] = FLOAT_DTYPES.index(dt)
        dev = q.device
        values["device"] = (-2 if not dev == k.device == v.device else
                            _DEVICE_TYPES.index(dev.type) if dev.type in _DEVICE_TYPES else _UNKNOWN)
    values["kernel"] = KERNEL_NAMES.index(kernel) if isinstance(kernel, str) and kernel in KERNEL_NAMES else _UNKNOWN
    if scale is None:
        scale = q.shape[-1] ** -0.5 if tensors and q.dim() == 4 and q.shape[-1] > 0 else float("nan")
    values["scale"] = _float_code(scale)
    values["needs_grad"] = int(torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                                               for t in (q, k, v)))
    values["sinks"] = _sinks_code(q, sinks)
    values["softcap"] = _float_code(softcap)
    values["comm_type"] = (CP_COMM_TYPES.index(cp_comm_type)
                           if isinstance(cp_comm_type, str) and cp_comm_type in CP_COMM_TYPES else _UNKNOWN)
    return TENSOR_FIELDS.encode(values)


def _spec(row: dict) -> CallSpec:
    """A decoded :data:`GATHERED_FIELDS` row as the :class:`CallSpec` the checks read."""
    shapes = tuple(None if row[n][0] == _NOT_A_TENSOR else
                   row[n][1:5] if row[n][0] == 4 else (-1,) * row[n][0] for n in "qkv")
    causal = row["causal"] if row["causal"] == _UNKNOWN else bool(row["causal"])
    return CallSpec(shapes, row["dtype"], row["device"], row["layout"], row["kernel"], causal,
                    _bits_float(row["scale"]), bool(row["needs_grad"]), row["sinks"], _bits_float(row["softcap"]),
                    row["comm_type"], row["documents"], row["packed_len"], row["cu_hash"], row["window"],
                    row["sink_values"])


def _local_problem(c: CallSpec, world_size: int) -> "str | None":
    """What is wrong with one rank's call on its own, or None."""
    if any(s is None for s in c.shapes):
        names = ", ".join(n for n, s in zip("qkv", c.shapes) if s is None)
        return f"q, k and v must be tensors [batch, seq, heads, head_dim], got something else for {names}"
    if any(len(s) != 4 for s in c.shapes):
        dims = ", ".join(f"{n}.dim()={len(s)}" for n, s in zip("qkv", c.shapes))
        return f"q, k and v must be 4-D [batch, seq, heads, head_dim], got {dims}"
    (bq, sq, hq, dq), (bk, sk, hk, dk), (bv, sv, hv, dv) = c.shapes
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
    problem = _plan_problem(c.layout, c.causal, c.documents, c.window)
    if problem is not None:
        return problem
    if c.kernel == _UNKNOWN:
        return f"unknown kernel; expected one of {', '.join(KERNEL_NAMES)}"
    if c.comm_type == _UNKNOWN:
        return (f"unknown cp_comm_type; expected one of {', '.join(CP_COMM_TYPES)} ('a2a+p2p' takes a 2-D "
                "DeviceMesh as group: outer dim the ring, inner dim the all-to-all)")
    if c.scale is None:
        return ("softmax_scale must be a finite non-zero float or None (head_dim ** -0.5), got a value float() "
                "cannot convert")
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
        return "softcap must be a finite float >= 0 (0 disables it), got a value float() cannot convert"
    if not math.isfinite(c.softcap) or c.softcap < 0:
        return f"softcap must be a finite float >= 0 (0 disables it), got {c.softcap}"
    try:
        get_kernel(KERNEL_NAMES[c.kernel], _DEVICE_TYPES[c.device], FLOAT_DTYPES[c.dtype],
                   softcap=c.softcap > 0, mask=c.window != (-1, -1), head_dim=dq, v_head_dim=dv)
    except ValueError as e:
        return str(e)
    return None


def _plan_problem(layout: int, causal: "bool | int", documents: int, window: tuple[int, int]) -> "str | None":
    """What is wrong with the fields of a call that a plan fixes, or None."""
    if layout == _UNKNOWN:
        return f"unknown layout; expected one of {', '.join(layout_names())} (or an alias)"
    if causal == _UNKNOWN:
        return "causal must be a bool (True or False), got another type; pass causal=True or causal=False"
    if documents == _UNKNOWN:
        return ("cu_seqlens must be a 1-D integer tensor [0, l1, l1+l2, ..., T] of document boundaries: "
                "starting at 0 and strictly increasing (no empty document)")
    if window == (-2, -2):
        return ("window_size must be (left, right), two ints >= -1 (flash-attn's convention: -1 = unbounded, "
                "(-1, -1) = no window)")
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
    return str(value)


def check_plan_table(rows: list[dict], layout: "Layout | None") -> None:
    """Check every rank's decoded :data:`PLAN_FIELDS` row; raise one deterministic ``ValueError`` for the
    whole group when any rank's are bad, they differ, or the layout cannot split the packed length."""
    world_size = len(rows)
    raise_first("cp_attention.plan", [_plan_problem(r["layout"], _causal(r["causal"]), r["documents"], r["window"])
                                      for r in rows])
    raise_differing("cp_attention.plan", rows, _labels(PLAN_FIELDS, _PLAN_FIELDS), _show)
    if rows[0]["documents"]:
        layout = layout if layout is not None else get_layout(_layout_label(rows[0]["layout"]))
        try:
            layout.check(rows[0]["packed_len"], world_size)
        except ValueError as e:
            raise ValueError(f"cp_attention.plan: cu_seqlens of {rows[0]['packed_len']} tokens over world_size "
                             f"{world_size}: {e}") from None


_PLAN_FIELDS = ("layout", "causal", "documents", "cu_hash", "window")
# What a call's ranks must agree on, in the order differences are reported: the CallSpec's fields.
_CALL_FIELDS = ("shapes", "dtype", "device", "layout", "kernel", "causal", "scale", "needs_grad", "sinks", "softcap",
                "comm_type", "documents", "cu_hash", "window", "sink_values")


def _labels(codec: Codec, names: tuple) -> dict[str, str]:
    return {n: ("tensor shapes" if n == "shapes" else codec.field(n).label) for n in names}


def _causal(code: int) -> "bool | int":
    return code if code == _UNKNOWN else bool(code)


def check_table(rows: list[dict], layout: "Layout | None" = None) -> None:
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
    sq = specs[0].shapes[0][1]
    if layout is None:
        layout = get_layout(_layout_label(specs[0].layout))
    try:
        layout.check(sq * world_size, world_size)
    except ValueError as e:
        raise ValueError(f"ring_attention: local sequence length {sq} x world_size {world_size} = "
                         f"{sq * world_size} tokens: {e}") from None


def validate_call(sig: list[int], layout: "Layout | None", transport: Transport, in_forward: bool = False,
                  trusted: "tuple | None" = None, sinks: "torch.Tensor | None" = None) -> None:
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
