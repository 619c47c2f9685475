"""One codec for every row of integers the ranks of a group compare, and the one agreement that
gathers them.

A check that must reach the same verdict on every rank (a call's arguments, a plan's fields, a
gather's shards, an adapter's batch) encodes what this rank holds as a fixed-length row of int64s
whose fields declare their name, width and how a person names them; every rank takes part in one
all-gather of the rows (:func:`agree_rows`) and judges the whole table by field name with the same
pure functions (:func:`raise_first`, :func:`raise_differing`). Nothing reads a row by offset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

__all__ = ["Field", "Codec", "agree_rows", "raise_first", "raise_differing", "encode_text", "decode_text"]


@dataclass(frozen=True)
class Field:
    """One field of a row: ``width`` ints (a field of width 1 decodes to an int, wider ones to a tuple).

    ``label`` is how an error names it ("every rank must pass the same {label}"). ``trusted`` says what
    the field contributes to a codec's :meth:`Codec.trusted_key` (the cache key of a call whose plan
    the group already agreed): the value itself (the default), a function of it, or nothing (None)."""

    name: str
    width: int = 1
    label: str = ""
    trusted: Callable[[Any], Any] | None = lambda value: value


class Codec:
    """An ordered set of :class:`Field` s: encodes a mapping of values to a row and decodes a row back to
    a dict by name. Codecs concatenate (``a + b``) into the row of both."""

    def __init__(self, *fields: Field) -> None:
        names = [f.name for f in fields]
        if len(set(names)) != len(names):
            raise ValueError(f"a codec's field names must be distinct, got {names}")
        self.fields = fields
        self.size = sum(f.width for f in fields)
        self._by_name = {f.name: f for f in fields}

    def __add__(self, other: Codec) -> Codec:
        return Codec(*self.fields, *other.fields)

    def field(self, name: str) -> Field:
        """The field called ``name`` (``KeyError`` if none is)."""
        return self._by_name[name]

    def encode(self, values: Mapping[str, Any]) -> list[int]:
        """The row of ``values`` (every field by name; an int, or a sequence of ``width`` ints).

        Raises ``KeyError`` for a missing field, ``ValueError`` for a value of the wrong width: both are
        the caller's bugs, never a user's (encode what is wrong about an input as a value instead)."""
        row: list[int] = []
        for f in self.fields:
            value = values[f.name]
            ints = [int(value)] if f.width == 1 else [int(v) for v in value]
            if len(ints) != f.width:
                raise ValueError(f"field {f.name!r} takes {f.width} ints, got {len(ints)}")
            row += ints
        return row

    def decode(self, row: Sequence[int]) -> dict[str, Any]:
        """``row`` (at least :attr:`size` ints; what follows is ignored) as ``{name: value}``."""
        out: dict[str, Any] = {}
        at = 0
        for f in self.fields:
            part = tuple(int(v) for v in row[at:at + f.width])
            out[f.name] = part[0] if f.width == 1 else part
            at += f.width
        return out

    def trusted_key(self, values: Mapping[str, Any]) -> tuple:
        """The fields' contributions to a trusted cache key (see :class:`Field`), in field order."""
        return tuple(f.trusted(values[f.name]) for f in self.fields if f.trusted is not None)


def agree_rows(transport: Any, codec: Codec, values: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every rank's ``values`` in rank order, from ONE all-gather of their :class:`Codec` rows over
    ``transport`` (blocking; every rank must call it). A group of one gathers nothing."""
    row = codec.encode(values)
    rows = transport.all_gather_ints(row) if transport.world_size > 1 else [row]
    return [codec.decode(r) for r in rows]


def raise_first(what: str, problems: Sequence[str | None]) -> None:
    """Raise ``ValueError`` with the lowest rank's problem, naming every rank that has one, if any has."""
    bad = [(r, p) for r, p in enumerate(problems) if p is not None]
    if bad:
        ranks = [r for r, _ in bad]
        raise ValueError(f"{what}: {bad[0][1]} (on rank {bad[0][0]}; ranks with bad input: {ranks})")


def raise_differing(what: str, rows: Sequence[Any], labels: Mapping[str, str],
                    show: Callable[[str, Any], str] = lambda name, value: str(value),
                    advice: str = "shard every tensor with the same layout and call with the same arguments on "
                                  "all ranks") -> None:
    """Raise ``ValueError`` for the first field of ``labels`` (in its order) whose value differs between
    ``rows`` (decoded rows, or objects with those attributes), naming it by its label and each rank's
    value as ``show(name, value)`` shows it."""
    for name, label in labels.items():
        values = [row[name] if isinstance(row, Mapping) else getattr(row, name) for row in rows]
        if any(v != values[0] for v in values):
            per_rank = ", ".join(f"rank {r}: {show(name, v)}" for r, v in enumerate(values))
            raise ValueError(f"{what}: every rank of the group must pass the same {label}, got {per_rank}; {advice}")


def encode_text(text: str, width: int) -> list[int]:
    """``text`` as ``width`` int64 words of its UTF-8 bytes (cut to ``8 * width`` bytes, zero-padded)."""
    data = text.encode()[:8 * width].ljust(8 * width, b"\0")
    return [int.from_bytes(data[i:i + 8], "little", signed=True) for i in range(0, len(data), 8)]


def decode_text(words: Sequence[int]) -> str:
    """The text :func:`encode_text` encoded (a cut multi-byte character is replaced)."""
    data = b"".join(int(w).to_bytes(8, "little", signed=True) for w in words)
    return data.rstrip(b"\0").decode(errors="replace")
