"""Walking a megatron-core layer or block spec: the ``core_attention`` slots ring attention goes into."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["replace_core_attention"]


def replace_core_attention(node: Any, builder: type, seen: set) -> int:
    """Put ``builder`` into every ``core_attention`` field of the spec tree ``node`` (dataclasses, lists,
    tuples), in place; returns how many it replaced. ``seen``: ids already visited (pass ``set()``)."""
    if id(node) in seen:
        return 0
    seen.add(id(node))
    if isinstance(node, (list, tuple)):
        return sum(replace_core_attention(item, builder, seen) for item in node)
    if not dataclasses.is_dataclass(node) or isinstance(node, type):
        return 0
    count = 0
    for field in dataclasses.fields(node):
        if field.name == "core_attention":
            setattr(node, field.name, builder)
            count += 1
        else:
            count += replace_core_attention(getattr(node, field.name), builder, seen)
    return count
