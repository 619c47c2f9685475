"""One small all-gather that agrees a verdict across a process group, shared by the adapters' checks
(``cp_attention.integrations``) and the compat layer.

Every rank encodes what it found (nothing, or an error kind and message, plus a few integers the
caller wants to compare across ranks, such as a local shape) in a fixed-size row of the library's one
codec (:mod:`.codec`) and takes part in ONE all-gather, whatever it found, so no
rank is ever left waiting. If any rank
refused, every rank raises the same error: the lowest refusing rank's, naming every refusing rank.
"""

from __future__ import annotations

import functools
import zlib
from typing import Any, Sequence

import torch

from ..transport.process_group import transport_for
from .codec import Codec, Field, agree_rows, decode_text, encode_text

__all__ = ["MESSAGE_BYTES", "SHAPE_DIMS", "agree", "exchange", "raise_refusal", "documents_header", "shape_header",
           "show_shape"]

MESSAGE_BYTES = 1024  # a longer message is cut (the kind and the refusing ranks always come through)
SHAPE_DIMS = 4  # dims of a shape carried in the agreement (ndim too, so longer shapes still differ)

# One rank's row, decoded: (error kind + 1, or 0 for none; its message; its header integers).
Verdict = tuple[int, str, tuple[int, ...]]


@functools.cache
def _codec(headers: int) -> Codec:
    """A verdict's row: the error kind + 1 (0: none), ``headers`` ints, the message as text."""
    header = (Field("header", headers),) if headers else ()
    return Codec(Field("kind"), *header, Field("message", MESSAGE_BYTES // 8))


def exchange(group, world_size: int, problem: tuple[int, str] | None, header: Sequence[int] = ()
             ) -> list[Verdict]:
    """Every rank's ``(kind + 1 or 0, message, header)`` in rank order, from one all-gather over
    ``group`` (a process group, ``None`` or a transport; see
    :func:`~cp_attention.checks.codec.agree_rows`). ``problem`` is this rank's
    ``(kind index, message)`` or None; ``header`` a few integers, the same count on every rank.
    ``world_size`` is the group's (kept for the callers; the transport knows it)."""
    codec = _codec(len(header))
    kind, message = (0, "") if problem is None else (problem[0] + 1, problem[1])
    values = {"kind": kind, "message": encode_text(message, MESSAGE_BYTES // 8)}
    if header:
        values["header"] = header[0] if len(header) == 1 else list(header)
    rows = agree_rows(transport_for(group), codec, values)
    return [(row["kind"], decode_text(row["message"]), _ints(row.get("header", ()))) for row in rows]


def _ints(value) -> tuple[int, ...]:
    return value if isinstance(value, tuple) else (value,)


def raise_refusal(verdicts: Sequence[Verdict], kinds: Sequence[type], note: str,
                  cause: BaseException | None = None) -> None:
    """Raise, on every rank alike, the error of the lowest rank that refused (``kinds[kind]`` with its
    message and ``note.format(first=..., bad=[...])`` appended), if any did; ``cause`` (this rank's
    own exception) is chained for its traceback."""
    bad = [r for r, (kind, _, _) in enumerate(verdicts) if kind]
    if bad:
        kind, message, _ = verdicts[bad[0]]
        raise kinds[kind - 1](f"{message} {note.format(first=bad[0], bad=bad)}") from cause


def agree(group, world_size: int, problem: tuple[int, str] | None, kinds: Sequence[type], note: str,
          header: Sequence[int] = (), cause: BaseException | None = None) -> list[tuple[int, ...]]:
    """:func:`exchange` then :func:`raise_refusal`; returns every rank's ``header`` when none refused."""
    verdicts = exchange(group, world_size, problem, header)
    raise_refusal(verdicts, kinds, note, cause)
    return [ints for _, _, ints in verdicts]


def documents_header(documents: tuple[int, ...] | None) -> list[int]:
    """[packed, total tokens, fingerprint of the boundaries] of a packed call (zeros if unpacked)."""
    if documents is None:
        return [0, 0, 0]
    return [1, documents[-1], zlib.crc32(repr(documents).encode())]


def shape_header(t: Any) -> list[int]:
    """[ndim (-1: not a tensor), the first SHAPE_DIMS dims padded with -1] of ``t``."""
    shape = tuple(t.shape) if isinstance(t, torch.Tensor) else ()
    dims = shape[:SHAPE_DIMS]
    return [len(shape) if isinstance(t, torch.Tensor) else -1, *dims, *[-1] * (SHAPE_DIMS - len(dims))]


def show_shape(ints: Sequence[int]) -> str:
    """A :func:`shape_header` as text."""
    ndim, dims = ints[0], [d for d in ints[1:] if d >= 0]
    return "None" if ndim < 0 else str(tuple(dims)) + (" + more dims" if ndim > SHAPE_DIMS else "")
