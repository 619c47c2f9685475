"""Compare layouts (the built-in three, or any registered one): modelled, measured and projected.

Writes report.md, the PNG pictures and one CSV per table and picture into the output folder.
A (layout, world size, S) the layout cannot split is skipped and listed in the report. With a
``packed`` config section it also models (and measures, small) a packed-documents workload and sets it
against TransformerEngine-style per-document padding (:mod:`.packed_documents`); with a ``window`` section,
sliding windows against no window (:mod:`.sliding_windows`); with a ``strategies`` section, every
``cp_comm_type`` (:mod:`.comm_strategies`).

    python -m studies.layout_comparison                          # configs/experiment/default.yaml
    python -m studies.layout_comparison experiment=smoke         # tiny, for tests
    python -m studies.layout_comparison measure.world_sizes=[1,2,4] heads=16 dtype=bfloat16 causal=false
    python -m studies.layout_comparison out_dir=results/layouts  # default: outputs/compare_layouts/<time>
    python -m studies.layout_comparison plugins=[my_layouts] layouts=[zigzag,my_layout]   # a registered layout
    python -m studies.layout_comparison window.fractions=[64,8,2] window.convention=flash  # windows W = S/d
    python -m studies.layout_comparison packed=none window=none  # leave out the packed / windowed workloads
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from benchmarks.measure import Stopwatch
from benchmarks.modelled import AttentionShape
from cp_attention.kernels import check_kernel_name
from cp_attention.kernels.dtypes import DTYPES
from cp_attention.layouts import get_layout
from studies.layout_comparison import tables
from studies.layout_comparison.analysis import ClusterSpec

__all__ = ["check_config", "import_plugins", "run", "main"]


def import_plugins(cfg: dict) -> None:
    """Import the modules named in ``cfg["plugins"]``: user-defined layouts register themselves
    (``register_schedule(MyLayout(), fn)``) when their module is imported.

    Raises ``ValueError`` naming a module that cannot be imported.
    """
    for name in cfg.get("plugins") or ():
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ValueError(f"config plugins={name!r}: cannot import it ({e}); expected an importable "
                             "module that registers a layout (override with plugins=[...])") from None


def check_config(cfg: dict) -> None:
    """Raise ``ValueError`` naming the key, what it got and what it accepts, before any work."""
    def fail(key: str, got, want: str) -> None:
        raise ValueError(f"config {key}={got!r}: expected {want} (override with {key}=...)")

    if not cfg["layouts"]:
        fail("layouts", cfg["layouts"], "a non-empty list of layout names")
    for lay in cfg["layouts"]:
        try:
            get_layout(lay)
        except ValueError as e:
            fail("layouts", lay, str(e).split("expected ", 1)[-1])
    if not isinstance(cfg["causal"], bool):
        fail("causal", cfg["causal"], "true or false")
    if cfg["dtype"] not in DTYPES:
        fail("dtype", cfg["dtype"], " or ".join(DTYPES))
    try:
        check_kernel_name(cfg["kernel"])
    except ValueError as e:
        fail("kernel", cfg["kernel"], str(e).split("expected one of: ", 1)[-1])
    for key in ("batch", "heads", "head_dim", "repeats"):
        if not isinstance(cfg[key], int) or cfg[key] < 1:
            fail(key, cfg[key], "a positive integer")
    kv = cfg["kv_heads"] or cfg["heads"]
    if cfg["heads"] % kv:
        fail("kv_heads", cfg["kv_heads"], f"a divisor of heads={cfg['heads']}")
    for key in ("model.world_sizes", "model.seq_lens", "model.seq_plot_world_sizes", "measure.world_sizes",
                "measure.seq_lens", "projection.world_sizes", "projection.seq_lens"):
        part, name = key.split(".")
        vals = cfg[part][name]
        if not isinstance(vals, list) or not all(isinstance(v, int) and v >= 1 for v in vals):
            fail(key, vals, "a list of positive integers, e.g. [1,2,4]")
    for key in ("model.seq_len", "atlas.world_size", "atlas.seq_len", "bars.world_size"):
        part, name = key.split(".")
        if not isinstance(cfg[part][name], int) or cfg[part][name] < 1:
            fail(key, cfg[part][name], "a positive integer")
    if cfg["atlas"]["seq_len"] > 256:
        fail("atlas.seq_len", cfg["atlas"]["seq_len"], "at most 256 (the atlas draws every token pair)")
    if cfg.get("packed") is not None:
        from studies.layout_comparison.packed_documents import check_packed

        check_packed(cfg["packed"])
    if cfg.get("window") is not None:
        from studies.layout_comparison.sliding_windows import check_window

        check_window(cfg["window"])
    if cfg.get("strategies") is not None:
        from studies.layout_comparison.comm_strategies import check_strategies

        check_strategies(cfg["strategies"])


def run(cfg: dict, out: Path) -> Path:
    """The whole comparison for a resolved config dict, written into ``out``; returns the report's path.

    Raises ``ValueError`` naming the config key for a config that cannot run, before any work.
    """
    from studies.layout_comparison.report import write_results

    import_plugins(cfg)
    check_config(cfg)
    cfg = {**cfg, "layouts": list(dict.fromkeys(get_layout(x).name for x in cfg["layouts"]))}  # aliases -> names
    out.mkdir(parents=True, exist_ok=True)
    clock = Stopwatch()

    def log(msg: str) -> None:
        print(f"[{clock.seconds():6.1f} s] {msg}", flush=True)

    lays, causal, m = cfg["layouts"], cfg["causal"], cfg["model"]
    shape = AttentionShape(cfg["batch"], cfg["heads"], cfg["kv_heads"] or cfg["heads"], cfg["head_dim"],
                           elem_bytes=DTYPES[cfg["dtype"]].itemsize)
    # The pictures need their own world sizes modelled too, whatever model.world_sizes says.
    sizes = sorted({*m["world_sizes"], *m["seq_plot_world_sizes"], cfg["bars"]["world_size"]})
    skipped: list[dict] = []
    res = {
        "modelled": tables.modelled(lays, causal, sizes, sorted({*m["seq_lens"], m["seq_len"]}), shape, skipped),
        "work_per_rank_step": tables.work_rows(lays, causal, sizes, m["seq_len"], skipped),
        "mask_atlas": tables.atlas_rows(lays, causal, cfg["atlas"]["seq_len"], cfg["atlas"]["world_size"], skipped),
    }
    p = cfg["projection"]
    res["projection"] = tables.projection_rows(lays, causal, p["world_sizes"], p["seq_lens"],
                                               AttentionShape(**p["shape"]), ClusterSpec(**p["cluster"]), skipped)
    log(f"modelled {len(res['modelled'])} (layout, N, S) combinations and the projection")

    measured = {"wall": [], "steps": [], "summary": [], "skipped": [], "meta": {}}
    if cfg["measure"]["world_sizes"] and cfg["measure"]["seq_lens"]:
        from benchmarks.measure import limit_malloc_caching
        from studies.layout_comparison.timings import measure_all

        limit_malloc_caching()
        keys = ("batch", "heads", "kv_heads", "head_dim", "dtype", "kernel", "repeats")
        measured = measure_all({**cfg["measure"], **{k: cfg[k] for k in keys}}, lays, causal, log)
    res["measured_wall"] = measured["wall"]
    res["measured_steps"] = measured["steps"]
    res["measured_summary"] = tables.with_modelled_efficiency(measured["summary"], causal)
    res["packed"] = None
    if cfg.get("packed") is not None:
        from studies.layout_comparison.packed_documents import measure_packed, packed_tables

        pk = cfg["packed"]
        res["packed"] = packed_tables(pk, lays, causal, AttentionShape(**p["shape"]), skipped)
        log(f"modelled the packed workload: {len(pk['seeds'])} seed(s), N in {pk['world_sizes']}")
        keys = ("heads", "kv_heads", "head_dim", "dtype", "kernel", "repeats")
        res["packed"]["packed_measured"] = (
            measure_packed(pk, {**{k: cfg[k] for k in keys}, "timeout": cfg["measure"]["timeout"]}, lays, causal, log)
            if pk["measure"]["world_sizes"] else [])
    res["window"] = None
    if cfg.get("window") is not None:
        from studies.layout_comparison.sliding_windows import measure_window, window_tables

        w = cfg["window"]
        res["window"] = window_tables(w, lays, causal, shape, AttentionShape(**p["shape"]), ClusterSpec(**p["cluster"]),
                                      skipped)
        log(f"modelled sliding windows S/{w['fractions']} at S={w['seq_len']}, N in {w['world_sizes']}")
        keys = ("batch", "heads", "kv_heads", "head_dim", "dtype", "kernel", "repeats")
        res["window"]["window_measured"] = measure_window(
            w, {**{k: cfg[k] for k in keys}, "kv_heads": cfg["kv_heads"] or cfg["heads"],
                "timeout": cfg["measure"]["timeout"]}, lays, causal, log)
    res["strategies"] = None
    if cfg.get("strategies") is not None:
        from studies.layout_comparison.comm_strategies import measure_strategies, strategy_tables

        res["strategies"] = strategy_tables(cfg["strategies"], lays, causal, p["shape"])
        res["strategies"]["strategies_measured"] = measure_strategies(cfg["strategies"], cfg, lays, causal, log)
    res["skipped"] = skipped + measured["skipped"]
    path = write_results(out, cfg, res, measured["meta"], log)
    log(f"wrote {path}")
    return path


def main() -> None:
    """The command line (``python -m studies.layout_comparison``): Hydra composes
    configs/compare_layouts.yaml with the overrides, then :func:`run`."""
    import hydra
    from omegaconf import DictConfig, OmegaConf

    from cp_attention.training.summary import directory_summary

    # An absolute path: Hydra reads a relative one against the package of the module that defines the job
    # (studies.layout_comparison.run under -m), where no configs/ folder is.
    configs = str(Path(__file__).resolve().parents[2] / "configs")

    @hydra.main(version_base="1.3", config_path=configs, config_name="compare_layouts")
    def job(cfg: DictConfig) -> None:
        from hydra.core.hydra_config import HydraConfig

        out = Path(HydraConfig.get().runtime.output_dir)  # == out_dir: the config makes them one folder
        resolved = OmegaConf.to_container(cfg, resolve=True)
        try:
            import_plugins(resolved)
            check_config(resolved)
        except ValueError as e:  # a config mistake: say it plainly instead of a traceback
            sys.exit(f"compare_layouts: {e}")
        report = run(resolved, out)
        print(directory_summary("studies.layout_comparison", out, {"report": report.name, "config": "config.yaml"},
                                {"pictures": "*.png", "tables": "*.csv"}), flush=True)

    job()

