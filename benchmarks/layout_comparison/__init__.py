"""The layout comparison, modelled, measured, projected, reported and drawn:
``python benchmarks/layout_comparison/run.py`` (configs/compare_layouts.yaml and its groups).

``analysis.py`` holds its arithmetic (imbalance, step-synchronous efficiency, waste, the cluster
projection, needs-only and whole-shard bytes) on top of the library's performance model,
:mod:`cp_attention.strategies.cost`. ``python -m benchmarks.layout_comparison.balance`` compares the
layouts per packed batch (``traffic.py``: imbalance, bytes, kernel calls, the cost model's projected
time; lognormal, giant-document and standard-library batches).
"""
