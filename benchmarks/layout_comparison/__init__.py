"""The layout comparison, modelled, measured, projected, reported and drawn:
``python benchmarks/layout_comparison/run.py`` (configs/compare_layouts.yaml and its groups).

``analysis.py`` holds its arithmetic (imbalance, step-synchronous efficiency, waste, the cluster
projection) on top of the library's performance model, :mod:`cp_attention.strategies.cost`.
"""
