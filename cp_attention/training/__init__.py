"""Context-parallel training: data, checkpoints, the shared step and the DP x CP loop.

Driven by ``scripts/train.py`` (Hydra configs in ``configs/``) and the example scripts. This layer
sits above the adapters (``cp_attention.integrations``, imported only inside functions). What this
``__init__`` exports (the shared step with ``reduce_gradients``, checkpoints, data) needs torch only,
so a training loop of one's own can use it without Hydra; the Hydra-driven loop (:mod:`.loop`) needs
the ``train`` extra (hydra-core, tqdm): ``pip install 'cp_attention[train]'``, and names it when missing.
"""

from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .data import ByteBatches, load_bytes
from .steps import progress_line, reduce_gradients, train_step

__all__ = ["ByteBatches", "load_bytes", "save_checkpoint", "load_checkpoint", "latest_checkpoint",
           "reduce_gradients", "train_step", "progress_line"]
