"""The benchmarks: one module per benchmark, each with its command line (``python benchmarks/X.py``),
the measurement they share (``measure.py``) and the layout comparison (``layout_comparison/``).

Not part of the installed library: run them from a checkout. They need the ``train`` extra for their
summaries (and hydra-core for the layout comparison), the ``plots`` extra for its pictures, and the
``hf``/``megatron`` extras for the benchmarks of those adapters.
"""
