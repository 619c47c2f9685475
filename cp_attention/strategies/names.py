"""The communication strategies' names (megatron-core's ``cp_comm_type`` values) and their check."""

from __future__ import annotations

__all__ = ["CP_COMM_TYPES", "STRATEGIES", "check_comm_type_name"]

# What runs: the ring, all-gather of K/V, Ulysses all-to-all, and all-to-all inside a 2-D mesh's inner
# dim with a ring across its outer dim.
STRATEGIES = ("p2p", "all_gather", "a2a", "a2a+p2p")
# What a caller may ask for: a strategy, or "auto" (the cost model picks one per call shape).
CP_COMM_TYPES = STRATEGIES + ("auto",)


def check_comm_type_name(cp_comm_type: object) -> str:
    """``cp_comm_type`` if it names a strategy or ``"auto"``; else ``ValueError`` listing the names."""
    if isinstance(cp_comm_type, str) and cp_comm_type in CP_COMM_TYPES:
        return cp_comm_type
    raise ValueError(f"unknown cp_comm_type {cp_comm_type!r}; expected one of {', '.join(map(repr, CP_COMM_TYPES))} "
                     "('a2a+p2p' takes a 2-D DeviceMesh as group: outer dim the ring, inner dim the all-to-all)")
