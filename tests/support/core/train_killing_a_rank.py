"""scripts/train.py with one rank SIGKILLing itself: the rank death of tests/system/test_resume.py.

    torchrun --nproc-per-node=2 --max-restarts=1 tests/support/core/train_killing_a_rank.py 1:5 trainer.steps=8 ...

The first argument, ``RANK:STEP``, makes rank RANK SIGKILL itself as it starts step STEP, on torchrun's
first attempt only (``TORCHELASTIC_RESTART_COUNT`` unset or 0, so the restarted ranks run through);
the other arguments are scripts/train.py's, which runs unchanged. The kill is the ``before_step``
callback this script hands to :func:`cp_attention.training.loop.launch`: the library holds no test hook.
"""

from __future__ import annotations

import functools
import os
import runpy
import signal
import sys
import time
from pathlib import Path

import torch.distributed as dist

from cp_attention.training import loop

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "train.py"


def kill_self(rank: int, at: int, step: int) -> None:
    """SIGKILL this process if it is rank ``rank`` starting step ``at`` on torchrun's first attempt."""
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and (dist.get_rank(), step) == (rank, at):
        print(f"train_killing_a_rank: rank {rank} SIGKILLs itself at step {step} (t={time.time():.3f})",
              file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    rank, at = map(int, sys.argv.pop(1).split(":"))  # before scripts/train.py (and Hydra) read sys.argv
    # scripts/train.py calls loop.launch(cfg, run_dir): hand it the callback there
    loop.launch = functools.partial(loop.launch, before_step=functools.partial(kill_self, rank, at))
    sys.argv[0] = str(SCRIPT)
    runpy.run_path(str(SCRIPT), run_name="__main__")
