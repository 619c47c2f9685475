"""cp_attention: exact context-parallel (ring) attention for PyTorch.

Each rank of a process group holds 1/N of every sequence, sharded by a :class:`Layout`;
:func:`ring_attention` computes exact attention over the whole sequence, forward and backward.
Build one :func:`plan` per batch and pass it to every layer's call.

``cp_comm_type`` picks how K/V travel (the ring, all-gather, Ulysses all-to-all, or both on a 2-D mesh).

The rooms, from the bottom up: ``kernels``, ``transport`` and ``memory``, ``layouts``, ``schedules``, ``checks``,
``engine``, ``strategies``; then this API, the adapters (``integrations``) and ``training``. The
benchmarks and examples live outside the package, in ``benchmarks/`` and ``examples/`` of a checkout.
"""

from __future__ import annotations

from ._deprecated import deprecated_names
from .api import plan, plan_ahead, ring_attention
from .engine.plan import AttentionPlan
from .kernels import KERNEL_NAMES, get_kernel
from .layouts import (
                      LAYOUT_NAMES,
                      BalancedLayout,
                      ContiguousLayout,
                      InterleavedLayout,
                      Layout,
                      ZigzagLayout,
                      document_position_ids,
                      get_layout,
                      pad_cu_seqlens,
                      register_layout,
)
from .schedules import BlockTask, get_schedule, rank_steps, register_schedule, ring_length, traffic_model, work_model
from .strategies import CP_COMM_TYPES, check_comm_type_name

__version__ = "0.1.0"

__all__ = [
    "ring_attention",
    "plan",
    "plan_ahead",
    "AttentionPlan",
    "get_layout",
    "register_layout",
    "Layout",
    "ContiguousLayout",
    "ZigzagLayout",
    "InterleavedLayout",
    "BalancedLayout",
    "LAYOUT_NAMES",
    "KERNEL_NAMES",
    "CP_COMM_TYPES",
    "check_comm_type_name",
    "BlockTask",
    "get_schedule",
    "register_schedule",
    "rank_steps",
    "work_model",
    "traffic_model",
    "ring_length",
    "get_kernel",
    "document_position_ids",
    "pad_cu_seqlens",
]

# Deprecated names (one release): the package answers them with a DeprecationWarning.
__getattr__ = deprecated_names(__name__, {"rank_plan": "rank_steps"}, globals())
