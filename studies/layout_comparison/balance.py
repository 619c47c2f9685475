"""The layouts on packed batches, per batch: causal work imbalance, K/V + dK/dV bytes per training
step (needs-only and whole shards), kernel calls per rank and step, and the cost model's projected
H100 time, at N = 8..128, for lognormal mixes, mixes with one giant document and a real corpus
(:mod:`studies.layout_comparison.traffic`). Prints the tables; ``--out`` writes them (CSV and
markdown) too.

    python -m studies.layout_comparison.balance                          # the record's settings
    python -m studies.layout_comparison.balance --world-sizes 8 --seeds 2 --giants 1 --corpus 1
    python -m studies.layout_comparison.balance --tokens-per-rank 8192 --calls-up-to 32
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path
from statistics import mean
from typing import Sequence

if not __package__:  # run as a script: `studies` and `benchmarks` import from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from benchmarks import args as flags
from benchmarks.measure import Stopwatch
from studies.layout_comparison.traffic import (
    Batch,
    batch_figures,
    corpus_batches,
    giant_batch,
    lognormal_batch,
    pick,
    ratio,
    stdlib_lengths,
)

__all__ = ["batches", "sweep", "summary_rows", "goal_lines", "win_rows", "markdown", "packed_bytes_section", "main"]

LAYOUTS = ("zigzag", "interleaved", "contiguous", "balanced")
Records = list[dict]


def batches(total: int, seeds: int, giants: int, corpus: int) -> tuple[list[Batch], str]:
    """The batches of ``total`` tokens: ``seeds`` lognormal mixes (mean 1,024, sigma 1.5), ``giants``
    with one document of 60% of the tokens, ``corpus`` of the standard library's sources; and the
    corpus's description."""
    out = [lognormal_batch(total, s) for s in range(seeds)] + [giant_batch(total, s) for s in range(giants)]
    what, lengths = stdlib_lengths()
    return out + (corpus_batches(lengths, total, corpus) if corpus else []), what


def sweep(world_sizes: Sequence[int], layouts: Sequence[str], total: int | None, per_rank: int | None,
          seeds: int, giants: int, corpus: int, calls_up_to: int, log=print) -> tuple[Records, str]:
    """Every (batch, N, layout) record (:func:`batch_figures`); T = ``total``, or ``per_rank * N``."""
    rows: Records = []
    what = ""
    for n in world_sizes:
        clock = Stopwatch()
        found, what = batches(total or per_rank * n, seeds, giants, corpus)
        for b in found:
            rows += [batch_figures(lay, b, n, calls=n <= calls_up_to) for lay in layouts]
        log(f"N = {n}: {len(found)} batches of T = {found[0].tokens} in {clock.seconds():.1f} s")
    return rows, what


def _cell(vals: Sequence[float], spec: str) -> str:
    vals = [v for v in vals if v is not None]
    if not vals:
        return "-"
    return f"{mean(vals):{spec}} ({max(vals):{spec}})" if len(vals) > 1 else f"{vals[0]:{spec}}"


def summary_rows(rows: Records, layouts: Sequence[str]) -> list[list]:
    """Per (source, N, layout): means over the batches and (worst) of imbalance, GB per step
    (needs-only), its ratio to zigzag needs-only and to zigzag whole shards (today), kernel calls per
    rank and step (varlen, batched), projected ms (needs-only, whole shards)."""
    out = []
    for src in dict.fromkeys(r["source"] for r in rows):
        for n in sorted({r["world_size"] for r in rows}):
            here = pick(rows, source=src, world_size=n)
            for lay in layouts:
                mine = pick(here, layout=lay)
                if not mine:
                    continue
                out.append([src, n, lay, _cell([r["imbalance"] for r in mine], ".3f"),
                            _cell([r["bytes_needs"] / 1e9 for r in mine], ".2f"),
                            _cell(ratio(here, lay, "zigzag", "bytes_needs"), ".0%"),
                            _cell(ratio(here, lay, "zigzag", "bytes_needs", "bytes_whole"), ".0%"),
                            _cell([r["calls_varlen"] for r in mine], ".2f"),
                            _cell([r["calls_batched"] for r in mine], ".1f"),
                            _cell([r["step_ms"] for r in mine], ".2f"),
                            _cell([r["step_ms_whole"] for r in mine], ".2f")])
    return out


SUMMARY_HEADS = ["source", "N", "layout", "imbalance mean (worst)", "GB/step needs-only", "× zigzag needs-only",
                 "× zigzag whole (today)", "calls/rank/step varlen", "calls batched", "proj. ms", "proj. ms whole"]


def win_rows(rows: Records, layouts: Sequence[str]) -> list[list]:
    """Per (source, N): on how many batches each layout's projected time is the least, and balanced's
    time over the best other layout's (mean, worst)."""
    out = []
    for src in dict.fromkeys(r["source"] for r in rows):
        for n in sorted({r["world_size"] for r in rows}):
            here = pick(rows, source=src, world_size=n)
            names = sorted({r["batch"] for r in here})
            wins = {lay: 0 for lay in layouts}
            rel = []
            for b in names:
                per = {r["layout"]: r["step_ms"] for r in pick(here, batch=b)}
                wins[min(per, key=per.get)] += 1
                others = [v for k, v in per.items() if k != "balanced"]
                if "balanced" in per and others:
                    rel.append(per["balanced"] / min(others))
            out.append([src, n, len(names)] + [wins[lay] for lay in layouts] + [_cell(rel, ".2f")])
    return out


def goal_lines(rows: Records, n: int = 8) -> list[str]:
    """The issue's goals at ``n`` ranks on the lognormal batches, those with a giant document included
    (and each kind on its own line)."""
    lines = []
    for label, sources in (("lognormal mixes (giant-document batches included)", ("lognormal", "giant")),
                           ("lognormal without a giant document", ("lognormal",)), ("giant document", ("giant",)),
                           ("standard library (not a goal)", ("stdlib",))):
        here = [r for r in rows if r["source"] in sources and r["world_size"] == n]
        mine, zig = pick(here, layout="balanced"), pick(here, layout="zigzag")
        if not mine or not zig:
            continue
        imb = max(r["imbalance"] for r in mine)
        today = ratio(here, "balanced", "zigzag", "bytes_needs", "bytes_whole")
        needs = ratio(here, "balanced", "zigzag", "bytes_needs")
        calls = [b["calls_varlen"] <= z["calls_varlen"] + 1e-12 for b, z in zip(mine, zig)
                 if b["calls_varlen"] is not None]
        ok_bytes = mean(today) <= 0.30 and max(today) <= 0.50
        lines.append(
            f"{label}, N = {n}, {len(today)} batches: balanced's worst imbalance {imb:.4f} (goal <= 1.05: "
            f"{'met' if imb <= 1.05 else 'MISSED'}); K/V + dK/dV bytes over zigzag's today (whole shards): mean "
            f"{mean(today):.1%}, worst {max(today):.1%} (goal <= 30% mean, <= 50% any: "
            f"{'met' if ok_bytes else 'MISSED'}); "
            f"over zigzag's needs-only: mean {mean(needs):.1%}, worst {max(needs):.1%}; varlen kernel calls per rank "
            f"and "
            f"step not above zigzag's on {sum(calls)} of {len(calls)} batches")
    return lines


def packed_bytes_section(rows: Records, layouts: Sequence[str]) -> str:
    """The layout comparison's packed rows (``packed_tables``) as a bytes table: per N and layout, the
    K/V + dK/dV bytes of one training step with needs-only traffic, as a share of whole shards and of
    zigzag's needs-only bytes (mean over the seeds, worst in brackets)."""
    out = []
    for n in sorted({r["world_size"] for r in rows}):
        here = [{**r, "source": "packed", "batch": r["seed"], "bytes_needs": r["kv_dkv_bytes_needs_only"],
                 "bytes_whole": r["kv_dkv_bytes_whole"]} for r in rows if r["world_size"] == n]
        cells = []
        for lay in layouts:
            mine = pick(here, layout=lay)
            if not mine:
                cells.append("skipped")
                continue
            whole = [r["bytes_needs"] / r["bytes_whole"] for r in mine if r["bytes_whole"]]
            cells.append(f"{_cell(whole, '.0%')} / {_cell(ratio(here, lay, 'zigzag', 'bytes_needs'), '.0%')}"
                         if "zigzag" in layouts else _cell(whole, ".0%"))
        out.append([n] + cells)
    return "\n\n".join([
        "### Bytes: needs-only traffic",
        "K/V + dK/dV bytes of one training step (forward + backward, all ranks) when only the rows a rank needs "
        "travel (the engine's default), as a share of whole shards (today's ring) / of zigzag's needs-only bytes; "
        "mean over the seeds (worst). Data: `packed.csv`, columns `kv_dkv_bytes_needs_only`, `kv_dkv_bytes_whole`. "
        "Per batch at N = 8..128 with kernel calls and the projected time: "
        "`python -m studies.layout_comparison.balance`.",
        md_table(["N"] + [f"{lay}: × whole / × zigzag" for lay in layouts], out)])


def md_table(heads: list[str], rows: list[list]) -> str:
    """A GitHub markdown table."""
    return "\n".join(["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
                     + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def markdown(rows: Records, layouts: Sequence[str], corpus: str) -> str:
    """The tables and the goal lines as markdown."""
    win_heads = ["source", "N", "batches"] + [f"{lay} fastest" for lay in layouts] + ["balanced ms / best other"]
    return "\n\n".join([md_table(SUMMARY_HEADS, summary_rows(rows, layouts)),
                        md_table(win_heads, win_rows(rows, layouts)),
                        "\n".join(f"- {g}" for g in goal_lines(rows)), f"Corpus: {corpus}."])


def main(argv: Sequence[str] | None = None) -> Records:
    """The command line (see the module's docstring); returns the records."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    flags.add_ring(ap, world_sizes=[8, 16, 32, 64, 128], layouts=LAYOUTS, tokens_per_rank=None)  # T = N x this
    flags.add_documents(ap, tokens=65536)  # T of every batch, unless --tokens-per-rank
    ap.add_argument("--seeds", type=int, default=6, help="lognormal batches")
    ap.add_argument("--giants", type=int, default=3, help="lognormal batches with one document of 60%% of T")
    ap.add_argument("--corpus", type=int, default=6, help="batches of the standard library's sources")
    ap.add_argument("--calls-up-to", type=int, default=128, help="count kernel calls up to this N (slow at large N)")
    ap.add_argument("--out", type=Path, default=None, help="write balance.csv and balance.md here")
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # small index tensors: threads only add synchronisation
    rows, corpus = sweep(a.world_sizes, a.layouts, None if a.tokens_per_rank else a.tokens, a.tokens_per_rank,
                         a.seeds, a.giants, a.corpus, a.calls_up_to)
    text = markdown(rows, a.layouts, corpus)
    print(text, flush=True)
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        with open(a.out / "balance.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        (a.out / "balance.md").write_text(text + "\n")
    return rows


if __name__ == "__main__":
    main()
