"""Schedules: for (layout, mask, rank, world size), which block of queries against which block of the
held K/V shard each ring step computes, and their lowering to the engine's tasks. Pure Python and
index math, no communication."""

from .._deprecated import deprecated_names
from .blocks import BlockTask, DocBlock, doc_block_pairs, source_rank, task_pairs
from .causal import ScheduleFn, get_schedule, rank_steps, register_schedule
from .derived import block_schedules, ring_length
from .lowering import BatchSpec, VarlenSpec, lower_steps, split_doc_block
from .needs import needed_keys, rank_needs, traffic_model
from .windows import Window, check_window_size, normalize_window
from .work import work_model

__all__ = ["BlockTask", "DocBlock", "doc_block_pairs", "source_rank", "task_pairs", "ScheduleFn", "get_schedule",
           "rank_steps", "register_schedule", "block_schedules", "ring_length", "BatchSpec", "VarlenSpec",
           "lower_steps", "split_doc_block", "Window", "check_window_size", "normalize_window", "work_model",
           "needed_keys", "rank_needs", "traffic_model"]

# Deprecated names (one release): the package answers them with a DeprecationWarning.
__getattr__ = deprecated_names(__name__, {"rank_plan": "rank_steps", "rank_traffic": "rank_needs"}, globals())
