"""The studies: questions answered with the library's models and measurements, each a package with its
command line (``python -m studies.<name>``), beside the timings of ``benchmarks/`` (whose measurement,
flags and modelled figures they share: ``benchmarks/measure.py``, ``args.py``, ``modelled.py``).

- ``layout_comparison/``: the layouts modelled, measured, projected, reported and drawn
  (``python -m studies.layout_comparison``, Hydra, configs/compare_layouts.yaml), and per packed batch
  (``python -m studies.layout_comparison.balance``);
- ``memory/``: the longest context per GPU, the true peak memory of a training step per memory saver and
  its projection to Llama-3-8B and -70B (``python -m studies.memory``).

Not part of the installed library: run them from a checkout's root. They need what the benchmarks need
(``benchmarks/__init__.py``): the ``train`` extra (hydra-core for the layout comparison), ``plots`` for its
pictures, ``hf`` for the memory study.
"""
