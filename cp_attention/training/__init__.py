"""Context-parallel training: data, checkpoints, the shared step and the DP x CP loop.

Driven by ``scripts/train.py`` (Hydra configs in ``configs/``) and the example scripts. This layer
sits above the adapters (``cp_attention.integrations``) and needs the ``train`` extra
(hydra-core, tqdm): ``pip install 'cp_attention[train]'``.
"""

from .._extras import require_extra

require_extra("train", ("hydra", "tqdm"), "cp_attention.training")

from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint  # noqa: E402
from .data import ByteBatches, load_bytes  # noqa: E402
from .steps import progress_line, reduce_gradients, train_step  # noqa: E402

__all__ = ["ByteBatches", "load_bytes", "save_checkpoint", "load_checkpoint", "latest_checkpoint",
           "reduce_gradients", "train_step", "progress_line"]
