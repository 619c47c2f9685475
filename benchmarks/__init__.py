"""The benchmarks (timings): one module per benchmark, each with its command line (``python benchmarks/X.py``),
and what they and the studies (``studies/``) share: the measurement and every clock (``measure.py``), the
flags (``args.py``) and the work model's figures printed beside a measurement (``modelled.py``).
Not part of the installed library: run them from a checkout. They need the ``train`` extra for their
summaries, and the ``hf``/``megatron`` extras for the benchmarks of those adapters.
"""
