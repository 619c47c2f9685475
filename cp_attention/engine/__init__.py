"""The engine: the autograd Function that executes a plan's schedule with a kernel over a transport,
the LSE merge, packed-document batches, failure containment, and the per-batch plan."""

from .doc_batch import DocBatch
from .fault import RingFault
from .merge import merge_at, merge_block
from .plan import AttentionPlan, build_plan
from .ring import RingAttentionFunction, RingPlan
from .varlen_batch import VarlenBatch

__all__ = ["DocBatch", "RingFault", "merge_at", "merge_block", "AttentionPlan", "build_plan",
           "RingAttentionFunction", "RingPlan", "VarlenBatch"]
