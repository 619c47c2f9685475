"""Communication strategies beyond the ring (megatron-core's ``cp_comm_type``): all-gather of K/V,
Ulysses all-to-all and all-to-all inside a ring, and the cost model that picks one (``"auto"``).

Above the engine, below the API: every strategy runs the same per-rank schedules as the ring (the
layout's exact blocks), so every mask feature holds on every strategy.
"""

from .names import CP_COMM_TYPES, STRATEGIES, check_comm_type_name

__all__ = ["CP_COMM_TYPES", "STRATEGIES", "check_comm_type_name"]
