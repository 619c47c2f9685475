"""Pictures for the layout comparison (matplotlib, Agg backend, PNG).

Every function draws from the same records that are written as the figure's CSV, so the data
behind each picture is on disk next to it. matplotlib is imported on first use.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from benchmarks.modelled import imbalance, step_sync_efficiency
from cp_attention._extras import require_extra

Records = list[dict]
_LAYOUT_COLORS = {"contiguous": "C3", "zigzag": "C0", "interleaved": "C2"}
# zigzag and interleaved often coincide: zigzag is drawn as a wide pale band under a thin interleaved line.
_LAYOUT_WIDTH = {"zigzag": (4.0, 0.45)}


def _plt():
    require_extra("plots", ("matplotlib",), "the layout comparison's pictures")
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster or in CI
    import matplotlib.pyplot as plt
    return plt


def _color(layout: str) -> str:
    return _LAYOUT_COLORS.get(layout, "C4")


def _line(layout: str) -> dict:
    lw, alpha = _LAYOUT_WIDTH.get(layout, (1.5, 1.0))
    return {"color": _color(layout), "lw": lw, "alpha": alpha}


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)


def placeholder(path: Path, message: str) -> None:
    """A small picture that says why there is nothing to draw, so every expected file exists."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 1.2))
    ax.axis("off")
    ax.text(0.5, 0.5, message, ha="center", va="center", wrap=True)
    _save(fig, path)


def _matrix(rows: Records, key: str = "pairs") -> list[list[float]]:
    """``m[rank][step]`` from records with rank, step and ``key``."""
    n = 1 + max(r["rank"] for r in rows)
    m = [[0.0] * n for _ in range(n)]
    for r in rows:
        m[r["rank"]][r["step"]] = r[key]
    return m


def _by_layout(rows: Records) -> tuple[dict[str, Records], int, int]:
    """Records grouped by layout (in order), and the world size and S of the first (rows share them)."""
    by_layout: dict[str, Records] = defaultdict(list)
    for r in rows:
        by_layout[r["layout"]].append(r)
    return by_layout, rows[0]["world_size"], rows[0]["seq_len"]


def mask_atlas(rows: Records, path: Path, mask: str = "causal") -> None:
    """One row per layout, one column per ring step plus all steps: every computed (query, key)
    pair in global positions, coloured by the rank that computes it."""
    plt = _plt()
    import numpy as np
    from matplotlib.colors import ListedColormap
    by_layout, ws, seq = _by_layout(rows)
    cmap = ListedColormap([plt.get_cmap("tab10")(i % 10) for i in range(ws)])
    cmap.set_bad("white")
    fig, axes = plt.subplots(len(by_layout), ws + 1, figsize=(2.3 * (ws + 1), 2.45 * len(by_layout) + 0.5),
                             squeeze=False)
    for i, (lay, pairs) in enumerate(by_layout.items()):
        grids = np.full((ws + 1, seq, seq), np.nan)
        for p in pairs:
            grids[p["step"], p["q"], p["k"]] = p["rank"]
            grids[ws, p["q"], p["k"]] = p["rank"]
        for s in range(ws + 1):
            ax = axes[i][s]
            im = ax.imshow(np.ma.masked_invalid(grids[s]), cmap=cmap, vmin=-0.5, vmax=ws - 0.5,
                           interpolation="nearest")
            ax.set_title(f"{lay}: " + (f"step {s}" if s < ws else "all steps"), fontsize=9)
            ax.set_xticks([0, seq - 1])
            ax.set_yticks([0, seq - 1])
            ax.tick_params(labelsize=7)
            if s == 0:
                ax.set_ylabel("query position", fontsize=8)
            if i == len(by_layout) - 1:
                ax.set_xlabel("key position", fontsize=8)
    cbar = fig.colorbar(im, ax=axes, ticks=range(ws), shrink=0.6, pad=0.01)
    cbar.set_label("computing rank")
    fig.suptitle(f"Which rank computes each (query, key) pair at each ring step ({mask}, N={ws}, S={seq})")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def work_bars(rows: Records, path: Path, mask: str = "causal") -> None:
    """Per-rank score pairs (over the mean rank), stacked by ring step, one panel per layout."""
    plt = _plt()
    by_layout, ws, seq = _by_layout(rows)
    fig, axes = plt.subplots(1, len(by_layout), figsize=(4.2 * len(by_layout), 3.6), sharey=True, squeeze=False)
    cmap = plt.get_cmap("viridis")
    for ax, (lay, recs) in zip(axes[0], by_layout.items()):
        m = _matrix(recs)
        mean = sum(map(sum, m)) / ws
        bottom = [0.0] * ws
        for s in range(ws):
            h = [m[r][s] / mean for r in range(ws)]
            ax.bar(range(ws), h, bottom=bottom, color=cmap(s / max(1, ws - 1)), edgecolor="white", linewidth=0.3,
                   label=f"step {s}" if ws <= 8 else None)
            bottom = [b + x for b, x in zip(bottom, h)]
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_title(f"{lay}\nimbalance {imbalance(m):.3f}, step-sync eff. {step_sync_efficiency(m):.3f}",
                     fontsize=9)
        ax.set_xlabel("rank")
        ax.set_xticks(range(ws))
    axes[0][0].set_ylabel("score pairs / mean rank")
    if ws <= 8:
        axes[0][-1].legend(fontsize=7, loc="upper left", ncol=2)
    fig.suptitle(f"Work per rank, stacked by ring step ({mask}, N={ws}, S={seq})", fontsize=10)
    _save(fig, path)


def _efficiency_panel(ax, rows: Records, x: str) -> None:
    for lay in dict.fromkeys(r["layout"] for r in rows):
        model = sorted((r[x], r["efficiency"]) for r in rows if r["layout"] == lay and r["source"] == "modelled")
        if model:
            ax.plot(*zip(*model), "-", label=f"{lay} (modelled)", **_line(lay))
        for p, marker in (("fwd", "o"), ("bwd", "^")):
            pts = sorted((r[x], r["efficiency"]) for r in rows
                         if r["layout"] == lay and r["source"] == "measured" and r["pass"] == p)
            if pts:
                ax.plot(*zip(*pts), marker, color=_color(lay), mfc="none" if p == "bwd" else _color(lay),
                        label=f"{lay} (measured {p})")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)


def efficiency_vs_world(rows: Records, path: Path, mask: str = "causal") -> None:
    """Efficiency against world size: modelled lines, measured kernel-time points."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    _efficiency_panel(ax, rows, "world_size")
    ax.set_ylabel("step-synchronous efficiency")
    seqs = {src: ", ".join(map(str, sorted({r["seq_len"] for r in rows if r["source"] == src})))
            for src in ("modelled", "measured")}
    ax.set_xlabel("world size N (ranks)")
    ax.set_title(f"Efficiency vs world size ({mask}); modelled at S = {seqs['modelled'] or '-'}, "
                 f"measured at S = {seqs['measured'] or '-'}", fontsize=9)
    ax.legend(fontsize=7, loc="lower left")
    _save(fig, path)


def efficiency_vs_seq(rows: Records, path: Path, mask: str = "causal") -> None:
    """Efficiency against sequence length, one panel per world size."""
    plt = _plt()
    sizes = sorted({r["world_size"] for r in rows})
    if not sizes:
        return
    fig, axes = plt.subplots(1, len(sizes), figsize=(4.3 * len(sizes), 3.8), sharey=True, squeeze=False)
    for ax, ws in zip(axes[0], sizes):
        _efficiency_panel(ax, [r for r in rows if r["world_size"] == ws], "seq_len")
        ax.set_xlabel("sequence length S (tokens)")
        ax.set_title(f"N = {ws}", fontsize=9)
    axes[0][0].legend(fontsize=7, loc="lower right")
    axes[0][0].set_ylabel("step-synchronous efficiency")
    fig.suptitle(f"Efficiency vs sequence length ({mask})", fontsize=10)
    _save(fig, path)


def measured_steps(rows: Records, path: Path, mask: str = "causal") -> None:
    """Measured kernel time per rank and step (forward and backward), one panel per layout."""
    plt = _plt()
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    if not layouts:
        return
    ws, seq = rows[0]["world_size"], rows[0]["seq_len"]
    fig, axes = plt.subplots(2, len(layouts), figsize=(4 * len(layouts), 5.6), sharey="row", squeeze=False)
    width = 0.8 / ws
    for j, lay in enumerate(layouts):
        for i, p in enumerate(("fwd", "bwd")):
            ax = axes[i][j]
            m = _matrix([r for r in rows if r["layout"] == lay and r["pass"] == p], "ms")
            for r in range(ws):
                ax.bar([s + (r - (ws - 1) / 2) * width for s in range(ws)], m[r], width,
                       color=f"C{r % 10}", label=f"rank {r}")
            ax.set_title(f"{lay} {p}: step-sync eff. {step_sync_efficiency(m):.3f}", fontsize=9)
            ax.set_xticks(range(ws))
            ax.set_xlabel("ring step")
    for i, p in enumerate(("fwd", "bwd")):
        axes[i][0].set_ylabel(f"{p} kernel ms")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"Measured per-rank kernel time per ring step ({mask}, N={ws}, S={seq}, CPU gloo)", fontsize=10)
    _save(fig, path)


def projection(rows: Records, path: Path, mask: str = "causal", seq_len: int | None = None,
               world_size: int | None = None) -> None:
    """Projected efficiency (ideal over projected fwd+bwd time) vs N at the largest S and vs S at the
    largest N; solid with compute/communication overlap, dashed without."""
    plt = _plt()
    if not rows:
        return
    seq_len = seq_len or max(r["seq_len"] for r in rows)
    world_size = world_size or max(r["world_size"] for r in rows)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, x, fixed, val in ((axes[0], "world_size", "seq_len", seq_len),
                              (axes[1], "seq_len", "world_size", world_size)):
        for lay in dict.fromkeys(r["layout"] for r in rows):
            pts = sorted((r[x], r["efficiency_overlap"], r["efficiency_serial"]) for r in rows
                         if r["layout"] == lay and r[fixed] == val)
            if not pts:
                continue
            xs, over, serial = zip(*pts)
            ax.plot(xs, over, "-o", ms=3, label=f"{lay}, overlap", **_line(lay))
            ax.plot(xs, serial, "--", label=f"{lay}, no overlap", **_line(lay))
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        ax.set_xlabel("world size N" if x == "world_size" else "sequence length S")
        ax.set_title(f"{'S' if fixed == 'seq_len' else 'N'} = {val}", fontsize=9)
    axes[0].set_ylabel("projected efficiency (fwd+bwd)")
    axes[1].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"Projection on {rows[0]['cluster']} ({mask})", fontsize=10)
    _save(fig, path)


def doc_lengths(rows: Records, path: Path, mask: str = "causal") -> None:
    """The packed workload's document lengths: a histogram on log-spaced bins, and each document's
    share of the attention work (its pairs), largest first."""
    plt = _plt()
    import numpy as np
    lengths = [r["length"] for r in rows if not r["padding"]]
    if not lengths:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    bins = np.logspace(0, np.log10(max(lengths)) + 0.05, 30)
    axes[0].hist(lengths, bins=bins, color="C0", edgecolor="white")
    axes[0].set_xscale("log")
    axes[0].set_xlabel("document length (tokens)")
    axes[0].set_ylabel("documents")
    axes[0].set_title(f"{len(lengths)} documents, {sum(lengths)} tokens, median {int(np.median(lengths))}, "
                      f"max {max(lengths)}", fontsize=9)
    share = sorted((n * (n + 1) // 2 for n in lengths), reverse=True)  # causal pairs per document
    total = sum(share)
    axes[1].plot(range(1, len(share) + 1), np.cumsum(share) / total, "-o", ms=2, color="C0")
    axes[1].set_xscale("log")
    axes[1].set_ylim(0, 1.02)
    axes[1].grid(alpha=0.3)
    axes[1].set_xlabel("documents, largest first")
    axes[1].set_ylabel("cumulative share of causal pairs")
    axes[1].set_title(f"Largest document: {share[0] / total:.0%} of the attention pairs", fontsize=9)
    fig.suptitle(f"Packed workload (seed {rows[0]['seed']}, {mask})", fontsize=10)
    _save(fig, path)
