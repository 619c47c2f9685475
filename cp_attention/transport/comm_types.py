"""The communication strategies' names: megatron-core's ``cp_comm_type`` values (constants only, so
every room can name them: validation encodes them in a call's signature)."""

from __future__ import annotations

__all__ = ["CP_COMM_TYPES", "STRATEGIES"]

# What runs: the ring, all-gather of K/V, Ulysses all-to-all, and all-to-all inside a 2-D mesh's inner
# dim with a ring across its outer dim.
STRATEGIES = ("p2p", "all_gather", "a2a", "a2a+p2p")
# What a caller may ask for: a strategy, or "auto" (the cost model picks one per call shape).
CP_COMM_TYPES = STRATEGIES + ("auto",)
