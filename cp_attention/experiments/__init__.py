"""Experiments and benchmarks: measurement, the layout comparison (modelled, measured, projected,
reported and drawn) and the benchmark runners behind ``scripts/``.

This layer sits above the core and the adapters, next to ``cp_attention.training``, and needs the
``train`` extra (hydra-core, tqdm): ``pip install 'cp_attention[train]'``; its pictures also need
the ``plots`` extra.
"""

from .._extras import require_extra

require_extra("train", ("hydra", "tqdm"), "cp_attention.experiments")
