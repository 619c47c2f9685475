"""HuggingFace transformers glue (the ``hf`` extra): ring attention for a causal LM, its batches and
loss, generation over a sharded KV cache, FSDP2 x CP and the CP Trainer. See the modules:
``attention`` (the patch), ``batch``, ``generation``, ``fsdp``, ``trainer``."""

from .attention import ATTN_IMPLEMENTATION, apply_context_parallel, causal_lm_loss, gather_sequence
from .batch import model_inputs, shard_batch
from .fsdp import parallelize
from .generation import generate
from .lm_loss import lm_loss
from .savers import checkpoint_activations, save_memory
from .trainer import context_parallel_trainer

__all__ = ["apply_context_parallel", "generate", "parallelize", "checkpoint_activations", "context_parallel_trainer",
           "shard_batch", "model_inputs", "causal_lm_loss", "lm_loss", "save_memory", "gather_sequence",
           "ATTN_IMPLEMENTATION"]
