"""The check of a ``cp_comm_type`` name (the names live in :mod:`cp_attention.transport.comm_types`)."""

from __future__ import annotations

from ..transport.comm_types import CP_COMM_TYPES, STRATEGIES

__all__ = ["CP_COMM_TYPES", "STRATEGIES", "check_comm_type_name"]


def check_comm_type_name(cp_comm_type: object) -> str:
    """``cp_comm_type`` if it names a strategy or ``"auto"``; else ``ValueError`` listing the names."""
    if isinstance(cp_comm_type, str) and cp_comm_type in CP_COMM_TYPES:
        return cp_comm_type
    raise ValueError(f"unknown cp_comm_type {cp_comm_type!r}; expected one of {', '.join(map(repr, CP_COMM_TYPES))} "
                     "('a2a+p2p' takes a 2-D DeviceMesh as group: outer dim the ring, inner dim the all-to-all)")
