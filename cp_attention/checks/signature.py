"""What a rank holds, as the rows of ints the group compares: a call's tensors and per-call arguments
(:func:`tensor_codes`) and a batch's plan (:func:`plan_codes`), in the codecs :mod:`.validation` judges.

Encoding never raises: whatever is wrong with an argument is encoded (an unknown code, and the value as
given in a short text), so the rank still takes part in the all-gather and every rank reaches the
same verdict with the same message.
"""

from __future__ import annotations

import struct
import zlib

import torch
from torch._subclasses.fake_tensor import is_fake

from ..kernels import KERNEL_NAMES
from ..kernels.dtypes import FLOAT_DTYPES
from ..layouts.documents import check_cu_seqlens
from ..layouts.registry import get_layout
from ..schedules.windows import check_window_size
from ..transport.comm_types import CP_COMM_TYPES
from .codec import Codec, Field, encode_text

__all__ = ["TENSOR_FIELDS", "PLAN_FIELDS", "CALL_FIELDS", "GATHERED_FIELDS", "plan_codes", "tensor_codes",
           "trusted_plan_key", "layout_code", "sink_values_code"]

_DEVICE_TYPES = ("cpu", "cuda")
_UNKNOWN = -1
_NOT_A_TENSOR = -1  # in place of a tensor's dim
# The bits of a float argument that float() cannot convert (a quiet NaN with a payload of its own).
_NOT_A_FLOAT = 0x7FF8_0000_DEAD_BEEF
# Window sides beyond this are all "no bound" to any real sequence: clamped, so the int64 signature
# holds them (two ranks that pass different such sides get the same result anyway).
_HUGE = 1 << 62
# Int64 words of the "given" texts: the repr of the first argument of a call (an unknown kernel, a scale
# float() cannot convert...) or of a plan (a causal that is no bool...) this rank could not encode, so
# the message names it on every rank.
_GIVEN_WIDTH = 6
_PLAN_GIVEN_WIDTH = 8


def _documents_trusted(documents: int) -> int:
    return min(documents, 1)  # packed or not: an agreed plan's new batch may hold other documents


# The rows ranks compare (see :mod:`.codec`): a call's tensors and per-call arguments, a plan's fields,
# and the sinks' values' fingerprint, gathered with them but never part of a cache key.
TENSOR_FIELDS = Codec(
    Field("q", 5, "tensor shapes"), Field("k", 5, "tensor shapes"), Field("v", 5, "tensor shapes"),
    Field("dtype", label="dtype"), Field("device", label="device type"), Field("kernel", label="kernel"),
    Field("scale", label="softmax_scale"), Field("needs_grad", label="requires_grad of q, k, v"),
    Field("sinks", label="sinks (given or not, and their length)"), Field("softcap", label="softcap"),
    Field("comm_type", label="cp_comm_type"),
    Field("return_lse", label="return_lse (an all-to-all strategy sends the LSE back only when it is asked for)"),
    Field("given", _GIVEN_WIDTH, label="arguments"))
PLAN_FIELDS = Codec(
    Field("layout", label="layout"), Field("causal", label="causal"),
    Field("documents", label="cu_seqlens (given or not, and how many documents)", trusted=_documents_trusted),
    Field("packed_len", label="cu_seqlens (packed length)"),
    Field("cu_hash", label="cu_seqlens (document boundaries)", trusted=None),
    Field("window", 2, label="window_size"),
    Field("needs_only", label="plan needs_only (cp_attention.plan(..., needs_only=) or plan.needs_only, "
                              "set alike on every rank)"),
    Field("plan_given", _PLAN_GIVEN_WIDTH, label="plan arguments", trusted=None))
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


def _bits_float(b: int) -> float | None:
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


def plan_codes(layout, causal, cu_seqlens=None, window_size=None, needs_only=True) -> list[int]:
    """What is fixed for a batch, as ints: layout, causal, packed documents (count, length,
    fingerprint), window and whether only the needed K/V rows travel. Never raises (see
    :func:`tensor_codes`)."""
    try:
        code = layout_code(get_layout(layout).name)
    except (ValueError, TypeError):
        code = _UNKNOWN
    documents, packed_len, cu_hash = _cu_codes(cu_seqlens)
    window = _window_codes(window_size)
    values = dict(layout=code, causal=_bool_code(causal), documents=documents, packed_len=packed_len,
                  cu_hash=cu_hash, window=window, needs_only=_bool_code(needs_only))
    # in the order _plan_problem checks them, so the text is that of the argument it refuses
    values["plan_given"] = _given_text(_PLAN_GIVEN_WIDTH, (layout, code), (causal, values["causal"]),
                                       (cu_seqlens, documents), (window_size, _UNKNOWN if window[0] == -2 else 0),
                                       (needs_only, values["needs_only"]))
    return PLAN_FIELDS.encode(values)


def _bool_code(flag) -> int:
    """0 or 1 for a bool (or the int 0 or 1), else unknown: a truthy string such as ``"no"`` is not a
    choice (``bool("no")`` is True), nor is a tensor (reading it would sync the device)."""
    if isinstance(flag, bool) or (type(flag) is int and flag in (0, 1)):
        return int(flag)
    return _UNKNOWN


def _given_text(width: int, *named) -> list[int]:
    """``width`` words of the repr of the first ``(value, code)`` of ``named`` whose code is unknown (an
    argument this rank could not encode), cut to fit; zeros if none: only a refused call pays the repr."""
    for value, code in named:
        if code in (_UNKNOWN, _NOT_A_FLOAT):
            try:
                text = repr(value)
            except Exception:  # noqa: BLE001 - a broken __repr__ still gets a message
                text = f"a {type(value).__name__}"
            text = " ".join(text.split())  # a tensor's or an array's repr spans lines
            if getattr(value, "dtype", None) is not None:  # first: a long repr is cut, and may not show it
                text = f"{value.dtype} values {text}"
            if len(text.encode()) > 8 * width:
                text = text.encode()[:8 * width - 3].decode(errors="ignore") + "..."
            return encode_text(text, width)
    return [0] * width


def tensor_codes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, kernel: str,
                 sinks: torch.Tensor | None = None, softcap: float | None = 0.0, cp_comm_type: str = "p2p",
                 return_lse: bool = False) -> list[int]:
    """This rank's tensors and per-call arguments as a fixed-length list of ints (see :class:`CallSpec`).
    ``softcap=None`` is 0 (no softcap), as transformers and flash-attn pass it.

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
    given_scale = scale
    if scale is None:
        scale = q.shape[-1] ** -0.5 if tensors and q.dim() == 4 and q.shape[-1] > 0 else float("nan")
    values["scale"] = _float_code(scale)
    values["needs_grad"] = int(torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                                               for t in (q, k, v)))
    values["sinks"] = _sinks_code(q, sinks)
    values["softcap"] = _float_code(0.0 if softcap is None else softcap)
    values["comm_type"] = (CP_COMM_TYPES.index(cp_comm_type)
                           if isinstance(cp_comm_type, str) and cp_comm_type in CP_COMM_TYPES else _UNKNOWN)
    values["return_lse"] = _bool_code(return_lse)
    # in the order _local_problem checks them, so the text is that of the argument it refuses
    values["given"] = _given_text(_GIVEN_WIDTH, (kernel, values["kernel"]), (cp_comm_type, values["comm_type"]),
                                  (given_scale, values["scale"]), (softcap, values["softcap"]),
                                  (return_lse, values["return_lse"]))
    return TENSOR_FIELDS.encode(values)
