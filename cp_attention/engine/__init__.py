"""The engine: the one autograd Function every strategy runs (its K/V source: the ring's, or a
strategy's), the kernel settings, the LSE merge, packed-document batches, failure containment, and
the per-batch plan."""

from .._deprecated import deprecated_names
from .doc_batch import DocBatch
from .fault import RingFault
from .function import AttentionFunction, KVSource
from .merge import merge_at, merge_block
from .plan import AttentionPlan, build_plan
from .ring import RingSource
from .tasks import KernelSettings
from .varlen_batch import VarlenBatch

__all__ = ["DocBatch", "RingFault", "merge_at", "merge_block", "AttentionPlan", "build_plan",
           "AttentionFunction", "KVSource", "KernelSettings", "RingSource", "VarlenBatch"]

# Deprecated names (one release): the package answers them with a DeprecationWarning.
__getattr__ = deprecated_names(__name__, {"RingSchedule": "RingSource"}, globals())
