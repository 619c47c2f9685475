#!/usr/bin/env python
"""Run the spawned examples and the distributed tests many times and count the runs that aborted
(SIGABRT, or "terminate called" in the output) apart from other failures
(see cp_attention.experiments.stress).

    python scripts/stress.py --runs 100                  # the cheap set (examples + dist), ~1 hour
    python scripts/stress.py --runs 20 --targets ring    # one target
"""

import sys
from pathlib import Path

from cp_attention.experiments import stress

if __name__ == "__main__":
    sys.exit(stress.main(root=Path(__file__).resolve().parent.parent))
