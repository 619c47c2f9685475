"""The layout comparison, modelled, measured, projected, reported and drawn:
``python -m studies.layout_comparison`` (configs/compare_layouts.yaml and its groups; ``run.py``).

``analysis.py`` holds its arithmetic (waste, summaries, the cluster projection) on top of the figures the
benchmarks share (:mod:`benchmarks.modelled`: imbalance, step-synchronous efficiency, needs-only and
whole-shard bytes) and the library's performance model, :mod:`cp_attention.strategies.cost`;
``tables.py`` the modelled tables, ``timings.py`` the measured ones, ``packed_documents.py``,
``sliding_windows.py`` and ``comm_strategies.py`` the config groups' workloads, ``report.py`` and
``plots.py`` what is written. ``python -m studies.layout_comparison.balance`` compares the layouts per
packed batch (``traffic.py``: imbalance, bytes, kernel calls, the cost model's projected time; lognormal,
giant-document and standard-library batches).
"""
