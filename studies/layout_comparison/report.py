"""Write the layout comparison's results: one CSV per table and picture, the PNGs, and report.md."""

from __future__ import annotations

import csv
import os
import platform
from pathlib import Path
from typing import Callable

from studies.layout_comparison import plots
from studies.layout_comparison.balance import packed_bytes_section
from studies.layout_comparison.comm_strategies import strategies_section
from studies.layout_comparison.sliding_windows import window_figures, window_section

Records = list[dict]
NOISY = 0.25  # a row whose repeats spread more than this is flagged in the report

# Projection assumptions, stated once here and in studies/layout_comparison/analysis.py (project).
ASSUMPTIONS = (
    "A ring step waits for its slowest rank: step compute = the busiest rank's score pairs at that step "
    "x batch x heads x flops per pair / throughput.",
    "Flops per (query, key) pair and head: forward 2(D + Dv) (QKᵀ and PV); backward 2(3D + 2Dv) "
    "(scores recomputed, then dV, dP, dQ, dK): 2.5x the forward for D = Dv.",
    "The attention kernel runs at the configured throughput on every block, however small or masked "
    "(no launch overhead, no small-tile penalty); merges and accumulations are free.",
    "Forward: each of the first N-1 steps sends one K/V shard (B x S/N x Hkv x (D+Dv) x element bytes) "
    "to the next rank; hop time = bytes / link bandwidth + latency. Links are full duplex and all hops run at once.",
    "Backward (the engine's order): the steps in reverse, from the K/V shard the forward held last, so K/V make "
    "N-2 hops; a rank's own dK/dV contribution stays home, and the fp32 accumulator filled at step s+1 travels "
    "(N-1 hops in all) while step s computes, sharing its link with the K/V for step s-1; no hop follows step 0. "
    "Under a sliding window only the ring steps that run are counted.",
    "With overlap a step takes max(compute, communication); without, their sum. Ideal = total work / N "
    "at full throughput with free communication; efficiency = ideal / projected forward+backward time.",
    "Not modelled: other layers, memory bandwidth, congestion between rings sharing a link, stragglers.",
)


def write_csv(path: Path, rows: Records) -> None:
    """Rows as CSV, columns in first-seen order (an empty table still gets its file)."""
    cols = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)


def _fmt(x, spec: str = ".3f") -> str:
    if x is None or x == "":
        return "-"
    return format(x, spec) if isinstance(x, float) else str(x)


def md_table(headers: list[str], rows: list[list]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(lines)


def _pick(rows: Records, **eq) -> Records:
    return [r for r in rows if all(r[k] == v for k, v in eq.items())]


def _one(rows: Records, **eq) -> dict | None:
    found = _pick(rows, **eq)
    return found[0] if found else None


# ---------------------------------------------------------------- figure data

def figure_data(cfg: dict, res: dict) -> dict[str, Records]:
    """The records behind each picture, keyed by the picture's file stem."""
    m, meas = cfg["model"], res["measured_summary"]
    modelled = res["modelled"]
    eff = [{"source": "modelled", "pass": "", "layout": r["layout"], "world_size": r["world_size"],
            "seq_len": r["seq_len"], "efficiency": r["step_sync_efficiency"]} for r in modelled]
    measured = [{"source": "measured", "pass": r["pass"], "layout": r["layout"], "world_size": r["world_size"],
                 "seq_len": r["seq_len"], "efficiency": r["step_sync_efficiency"]} for r in meas]
    longest: dict[int, int] = {}
    for r in measured:
        longest[r["world_size"]] = max(longest.get(r["world_size"], 0), r["seq_len"])
    seq_sizes = sorted(set(m["seq_plot_world_sizes"]) | set(longest))
    steps = res["measured_steps"]
    shown = sorted({(r["world_size"], -r["seq_len"]) for r in steps if r["world_size"] > 1})
    if shown:
        ws, neg = shown[0]  # the smallest real ring at its longest S
        steps = _pick(steps, world_size=ws, seq_len=-neg)
    proj = res["projection"]
    s_max = max((r["seq_len"] for r in proj), default=0)
    n_max = max((r["world_size"] for r in proj), default=0)
    packed = {}
    if res.get("packed"):
        bars = cfg["packed"]["bars_world_size"]
        packed = {"packed_work_bars": _pick(res["packed"]["packed_work_per_rank_step"], world_size=bars),
                  "packed_doc_lengths": res["packed"]["packed_documents"]}
    return {
        **packed, **window_figures(cfg, res),
        "mask_atlas": res["mask_atlas"],
        "work_bars": _pick(res["work_per_rank_step"], world_size=cfg["bars"]["world_size"]),
        "efficiency_vs_world": [r for r in eff if r["seq_len"] == m["seq_len"]]
                               + [r for r in measured if r["seq_len"] == longest[r["world_size"]]],
        "efficiency_vs_seq": [r for r in eff if r["world_size"] in seq_sizes] + measured,
        "measured_steps": steps,
        "projection_efficiency": [r for r in proj if r["seq_len"] == s_max or r["world_size"] == n_max],
    }


_DRAW: dict[str, Callable] = {
    "mask_atlas": plots.mask_atlas,
    "work_bars": plots.work_bars,
    "efficiency_vs_world": plots.efficiency_vs_world,
    "efficiency_vs_seq": plots.efficiency_vs_seq,
    "measured_steps": plots.measured_steps,
    "projection_efficiency": plots.projection,
    "packed_work_bars": plots.work_bars,
    "packed_doc_lengths": plots.doc_lengths,
    "window_work_bars": plots.work_bars,
}


# ---------------------------------------------------------------- report sections

def _modelled_section(cfg: dict, res: dict) -> str:
    seq, lays = cfg["model"]["seq_len"], cfg["layouts"]
    rows = _pick(res["modelled"], seq_len=seq)
    sizes = sorted({r["world_size"] for r in rows})
    bal, waste = [], []
    for n in sizes:
        cells = [_one(rows, layout=lay, world_size=n) for lay in lays]
        bal.append([n] + [f"{_fmt(c['imbalance'])} / {_fmt(c['step_sync_efficiency'])}" if c else "skipped"
                          for c in cells])
        some = next((c for c in cells if c), None)
        mib = [_fmt(some[k] / 2**20, ".1f") if some else "-" for k in ("fwd_bytes_per_rank", "bwd_bytes_per_rank")]
        waste.append([n] + [f"{_fmt(c['redundant_fraction'], '.2f')} / {_fmt(c['idle_fraction'], '.3f')}"
                            if c else "skipped" for c in cells] + mib)
    kv = cfg["kv_heads"] or cfg["heads"]
    return "\n\n".join([
        "## Modelled (the schedule's work model, exact pair counts)",
        f"Causal: {cfg['causal']}, S = {seq} tokens. Each cell: **imbalance** (busiest rank's score pairs over the "
        "mean rank's) / **step-synchronous efficiency** (total work / N over the sum, over ring steps, of the "
        "slowest rank's work: a ring step waits for its slowest member). Data: `modelled.csv` (every S in "
        "`model.seq_lens`), per rank and step: `work_per_rank_step.csv`.",
        md_table(["N"] + [f"{lay} imb / eff" for lay in lays], bal),
        "Closed forms for causal attention with n = S/N local tokens: contiguous rank r computes r·n² + n(n+1)/2 "
        "pairs, so imbalance → (2N−1)/N and efficiency → N/(2N−1) (at most 2/3 at N = 2, tending to 1/2); zigzag "
        "gives every rank the same work at every step (1 / 1); interleaved is balanced in total up to one diagonal "
        "and its efficiency is (Nn+1)/(N(n+1)), which reaches 1 as n grows.",
        f"Waste: **redundant** = (pairs computed − S(S+1)/2) / S(S+1)/2 (masked blocks are skipped, so 0 for every "
        "layout); **idle** = rank-time spent waiting at step barriers, over the minimum work. Communication per rank "
        f"(the same for every layout; B={cfg['batch']}, Hkv={kv}, D={cfg['head_dim']}, {cfg['dtype']}): forward "
        "sends K/V N−1 times, backward K/V N−1 times plus fp32 dK/dV N−1 times (a rank's own contribution stays home).",
        md_table(["N"] + [f"{lay} redundant / idle" for lay in lays] + ["fwd MiB/rank", "bwd MiB/rank"], waste),
        "![mask atlas](mask_atlas.png)\n\n"
        "Every (query, key) pair in global positions, coloured by the rank that computes it, per ring step "
        "(`mask_atlas.csv`). Contiguous leaves the upper ranks all the work of late steps; zigzag pairs an early "
        "and a late chunk on each rank; interleaved spreads every rank over the whole triangle.",
        "![work per rank](work_bars.png)\n\n(`work_bars.csv`)",
        "![efficiency vs N](efficiency_vs_world.png)\n\n(`efficiency_vs_world.csv`)",
        "![efficiency vs S](efficiency_vs_seq.png)\n\n(`efficiency_vs_seq.csv`)",
    ])


def _measured_section(cfg: dict, res: dict, meta: dict) -> str:
    wall, summ = res["measured_wall"], res["measured_summary"]
    if not wall:
        return "## Measured\n\nNot measured (`measure.world_sizes` or `measure.seq_lens` is empty)."
    cores = os.cpu_count() or 1
    sizes = sorted({r["world_size"] for r in wall})
    notes = [f"CPU gloo on 127.0.0.1, {cores} cores, one process per rank with one thread each; the baseline "
             "is single-process attention on the full sequence with the same kernel and as many threads as the "
             "ring has ranks, measured in the same run. Times are the median over "
             f"{cfg['repeats']} timed call(s), after one warm-up, of the slowest rank; ratios are to the baseline "
             "at the same N and S; peak is the most any rank's RSS rose during one forward+backward call."]
    over = [n for n in sizes if n > cores]
    if over:
        notes.append(f"**Oversubscribed:** world size {', '.join(map(str, over))} runs more ranks than this "
                     f"machine has cores ({cores}), so ranks time-share cores: their wall and step times include "
                     "waiting for a core. Compare layouts within one world size, not across.")
    rows = []
    for r in wall:
        if r["error"]:
            rows.append([r["world_size"], r["seq_len"], r["impl"], "n/a: " + r["error"]] + [""] * 5)
            continue
        rows.append([r["world_size"], r["seq_len"], r["impl"], _fmt(r["fwd_ms"], ".1f"), _fmt(r["fwd_x_baseline"]),
                     _fmt(r["fwdbwd_ms"], ".1f"), _fmt(r["fwdbwd_x_baseline"]), _fmt(r["fwdbwd_peak_mib"], ".1f"),
                     _fmt(r["fwdbwd_spread"] and max(r["fwd_spread"], r["fwdbwd_spread"]), ".0%")])
    noisy = [r for r in wall if max(r["fwd_spread"] or 0, r["fwdbwd_spread"] or 0) > NOISY]
    notes.append("**spread** = (slowest − fastest) / median of the timed calls (needs `repeats` ≥ 2).")
    if noisy:
        notes.append(f"**Noisy:** {len(noisy)} row(s) spread more than {NOISY:.0%} between repeats; another "
                     "process probably competed for the cores. Rerun on an idle machine (or raise `repeats`) "
                     "before reading much into their ratios.")
    srows = []
    for r in _pick(summ, **{"pass": "fwd"}):
        b = _one(summ, layout=r["layout"], world_size=r["world_size"], seq_len=r["seq_len"], **{"pass": "bwd"})
        srows.append([r["world_size"], r["seq_len"], r["layout"], _fmt(r["modelled_efficiency"]),
                      _fmt(r["step_sync_efficiency"]), _fmt(b and b["step_sync_efficiency"]),
                      _fmt(r["modelled_imbalance"]), _fmt(r["imbalance"]), _fmt(b and b["imbalance"])])
    errs = {k: v["torch_ring_check_max_abs_err"] for k, v in meta.items() if v.get("torch_ring_check_max_abs_err")}
    torch_note = ("PyTorch's ring (`_templated_ring_attention` with head-tail load balancing = zigzag, on "
                  "`aten._scaled_dot_product_flash_attention_for_cpu`) is checked against ours before timing "
                  "(fp32, output and all gradients): max abs difference "
                  + ", ".join(f"{e:.1e} ({k})" for k, e in errs.items()) + "." if errs else
                  "PyTorch's ring did not run here; its rows say why.")
    return "\n\n".join([
        "## Measured (this machine)", *notes,
        md_table(["N", "S", "impl", "fwd ms", "fwd × baseline", "fwd+bwd ms", "fwd+bwd × baseline",
                  "peak MiB/rank", "spread"], rows),
        torch_note + " Data: `measured_wall.csv` (with every repeat).",
        "Per-rank compute per ring step: on every rank, the kernel calls of its own schedule at each step, the "
        "ranks starting each step together (a barrier), median over the repeats. This is the compute the ring "
        "engine does at that step, without LSE merges and communication. Efficiency and imbalance as in the "
        "model, but over milliseconds instead of pairs. Data: `measured_step_times.csv`, `measured_summary.csv`. "
        "A kernel's cost is not exactly proportional to pairs: a causal diagonal block is computed in tiles, so "
        "partly masked tiles cost nearly as much as full ones, and small blocks carry fixed overheads; that is where "
        "measured efficiency departs from the model.",
        md_table(["N", "S", "layout", "modelled eff", "measured eff fwd", "measured eff bwd", "modelled imb",
                  "measured imb fwd", "measured imb bwd"], srows),
        "![measured steps](measured_steps.png)\n\n(`measured_steps.csv`)",
    ])


def _projection_section(cfg: dict, res: dict) -> str:
    p, proj = cfg["projection"], res["projection"]
    if not proj:
        return "## Projection\n\nNothing to project (every combination was skipped)."
    c, sh = p["cluster"], p["shape"]
    s_max, n_max = max(r["seq_len"] for r in proj), max(r["world_size"] for r in proj)

    def rows_for(**eq) -> list[list]:
        out = []
        for r in _pick(proj, **eq):
            out.append([r["world_size"], r["seq_len"], r["layout"],
                        _fmt(r["fwd_overlap_ms"] + r["bwd_overlap_ms"], ".2f"),
                        _fmt(r["fwd_serial_ms"] + r["bwd_serial_ms"], ".2f"), _fmt(r["ideal_fwdbwd_ms"], ".2f"),
                        _fmt(r["efficiency_overlap"]), _fmt(r["efficiency_serial"]),
                        f"{r['comm_bound_fwd_steps']}/{r['world_size']}"])
        return out
    heads = ["N", "S", "layout", "fwd+bwd ms, overlap", "fwd+bwd ms, no overlap", "ideal ms", "eff overlap",
             "eff no overlap", "comm-bound fwd steps"]
    return "\n\n".join([
        f"## Projection: {c['name']}",
        f"Link {c['link_gbytes_per_s']} GB/s per direction, {c['link_latency_us']} µs per hop, "
        f"{c['attention_tflops']} TFLOP/s attention throughput per device; attention B={sh['batch']}, "
        f"H={sh['heads']}, Hkv={sh['kv_heads']}, D={sh['head_dim']}, {sh['elem_bytes']}-byte elements; causal: "
        f"{cfg['causal']}. One attention call, forward and backward. Assumptions:",
        "\n".join(f"- {a}" for a in ASSUMPTIONS),
        md_table(heads, rows_for(seq_len=s_max)),
        md_table(heads, rows_for(world_size=n_max)),
        "![projection](projection_efficiency.png)\n\n(`projection_efficiency.csv`; every N and S: `projection.csv`)",
    ])


def _packed_section(cfg: dict, res: dict) -> str:
    p, pk = cfg["packed"], res["packed"]
    rows, te, docs = pk["packed"], pk["packed_te_padding"], pk["packed_documents"]
    lays, seed0, bars = cfg["layouts"], p["seeds"][0], p["bars_world_size"]
    real = sorted(d["length"] for d in docs if not d["padding"])
    if not rows:
        return "## Packed documents\n\nNo layout here supports packed documents (see Skipped)."
    first = rows[0]
    med = real[len(real) // 2] if real else 0
    fit = ("the document crossing T is trimmed" if p["fit"] == "trim" else
           "the document crossing T is left out and one padding document (`pad_cu_seqlens`) makes the stream split")
    intro = (f"Documents with lognormal lengths (mean {p['mean_doc_len']} tokens, sigma {p['sigma']}, clipped to "
             f"[{p['min_doc_len']}, {p['max_doc_len'] or 'T'}]) packed into one stream of T = {first['seq_len']} "
             f"tokens ({fit}); {len(p['seeds'])} seed(s) {p['seeds']}. Seed {seed0}: {first['documents']} documents, "
             f"median {med}, longest {real[-1] if real else 0} tokens, {first['pad_tokens']} padding tokens. "
             "Every layout splits the packed stream as `cu_seqlens` says (zigzag cuts every document into 2N chunks "
             "of near-equal size; interleaved deals the stream round robin; contiguous cuts it into N pieces) and "
             "the work model counts only pairs within a document. Each cell: **imbalance** (busiest rank's score "
             "pairs over the mean rank's, over the whole ring: the same definition as above) / **step-synchronous "
             f"efficiency** for seed {seed0}, and in brackets the worst imbalance over all seeds. Data: "
             "`packed.csv` (every seed, with per-rank pairs), `packed_work_per_rank_step.csv`, `packed_documents.csv`.")
    bal = []
    for n in sorted({r["world_size"] for r in rows}):
        cells = []
        for lay in lays:
            here = _pick(rows, layout=lay, world_size=n)
            c = _one(here, seed=seed0)
            cells.append(f"{_fmt(c['imbalance'], '.4f')} / {_fmt(c['step_sync_efficiency'])} "
                         f"({_fmt(max(r['imbalance'] for r in here), '.4f')})" if c else "skipped")
        bal.append([n] + cells)
    parts = ["## Packed documents (cu_seqlens)", intro,
             md_table(["N"] + [f"{lay} imb / eff (worst imb)" for lay in lays], bal)]
    at = [r for r in rows if r["world_size"] == bars and r["layout"] in ("zigzag", "interleaved")]
    if at:
        worst = {lay: max(r["imbalance"] for r in at if r["layout"] == lay)
                 for lay in dict.fromkeys(r["layout"] for r in at)}
        verdict = " (met)." if all(v <= 1.05 for v in worst.values()) else " (**missed**)."
        parts.append(f"Target: zigzag and interleaved imbalance ≤ 1.05 at N = {bars}: worst over the seeds "
                     + ", ".join(f"{lay} {v:.4f}" for lay, v in worst.items()) + verdict)
    per = [r for r in rows if r["world_size"] == bars and r["seed"] == seed0]
    if per:
        prow = []
        for r in per:
            tot = list(map(int, r["rank_pairs"].split()))
            mean = sum(tot) / len(tot)
            prow.append([r["layout"]] + [_fmt(t / mean, ".4f") for t in tot])
        parts += [f"Per-rank score pairs over the mean rank at N = {bars}, seed {seed0} (the pair counts are in "
                  "`packed.csv`, column `rank_pairs`):",
                  md_table(["layout"] + [f"rank {i}" for i in range(len(prow[0]) - 1)], prow)]
    sh = cfg["projection"]["shape"]
    trows = []
    for n in sorted({r["world_size"] for r in te}):
        here = _pick(te, world_size=n)
        c = _one(here, seed=seed0)

        def rng(key: str) -> str:
            vals = [r[key] for r in here]  # noqa: B023 - rng is called within the iteration
            return f"{min(vals):.2f}–{max(vals):.2f}" if len(vals) > 1 else "-"
        trows.append([n, c["multiple"], f"{c['te_pad_tokens']} ({c['te_pad_tokens_pct']:.2f}%)",
                      rng("te_pad_tokens_pct"), c["our_pad_tokens"],
                      f"{c['extra_pairs']:.3e} ({c['extra_pairs_pct']:.3f}%)",
                      rng("extra_pairs_pct"), _fmt(c["extra_fwdbwd_tflop"], ".3f"),
                      _fmt(c["te_zigzag_imbalance"], ".4f")])
    parts += [
        "### Against TransformerEngine-style per-document padding",
        "TransformerEngine's THD context parallelism and ring-flash-attention's varlen zigzag cut every document "
        "into 2N equal chunks, so every document must be padded to a multiple of 2N: `-L mod 2N` tokens each. "
        "Ours needs only the whole stream to split (at most one padding document of fewer than the layouts' "
        "divisor tokens). **Tokens**: the padding tokens TE-style adds, as a share of the real tokens; every "
        "other layer of the model (embeddings, MLPs, norms, the loss) pays this share too. **Pairs**: the pairs of "
        "the padded documents (causal triangles when causal) minus ours (share of ours), counting the padding as "
        "attended: an upper bound on the attention cost, as a kernel told the real lengths (TE's `cu_seqlens` "
        f"beside `cu_seqlens_padded`) may skip padded rows. TFLOP: those pairs forward + backward for the "
        f"projection's shape (B={sh['batch']}, H={sh['heads']}, D={sh['head_dim']}). The last column is the work "
        f"model's imbalance of zigzag on the padded documents (TE's split). Seed {seed0}; ranges over all seeds. "
        "Data: `packed_te_padding.csv`.",
        md_table(["N", "2N", "TE pad tokens (% of real)", "% range", "our pad tokens", "TE extra pairs (% of ours)",
                  "% range", "extra TFLOP fwd+bwd", "TE zigzag imb"], trows),
        packed_bytes_section(rows, lays),
        f"![packed work per rank](packed_work_bars.png)\n\n(`packed_work_bars.csv`, N = {bars}, seed {seed0})",
        "![packed document lengths](packed_doc_lengths.png)\n\n(`packed_doc_lengths.csv`)",
    ]
    meas = pk.get("packed_measured") or []
    if meas:
        mrows = []
        for r in meas:
            if r["error"]:
                mrows.append([r["world_size"], r["seq_len"], r["impl"], "n/a: " + r["error"]] + [""] * 6)
                continue
            spread = r["fwdbwd_spread"] and max(r["fwd_spread"], r["fwdbwd_spread"])
            mrows.append([r["world_size"], r["seq_len"], r["impl"], r["tokens_computed"], _fmt(r["fwd_ms"], ".1f"),
                          _fmt(r["fwd_x_baseline"]), _fmt(r["fwdbwd_ms"], ".1f"), _fmt(r["fwdbwd_x_baseline"]),
                          _fmt(r["modelled_imbalance"], ".4f"), _fmt(spread, ".0%")])
        parts += [
            "### Measured (this machine)",
            f"`ring_attention(cu_seqlens=)` on CPU gloo, one process per rank with one thread each, the first "
            f"seed's documents in a stream of {p['measure']['total_tokens']} tokens (batch 1, H={cfg['heads']}, "
            f"D={cfg['head_dim']}, {cfg['dtype']}, kernel {cfg['kernel']}); the baseline is one process on the whole "
            "stream with as many threads as the ring has ranks. Median of the slowest rank over "
            f"{cfg['repeats']} call(s) after one warm-up. `ring/zigzag, TE-padded` runs our zigzag on the stream "
            "with every document padded to a multiple of 2N (the padding attended): the TE-style split and its "
            "extra tokens. **spread** = (slowest − fastest) / median of the timed calls; a row that spreads more "
            f"than {NOISY:.0%} was probably disturbed by another process. Data: `packed_measured.csv`.",
            md_table(["N", "T", "impl", "tokens computed", "fwd ms", "fwd × baseline", "fwd+bwd ms",
                      "fwd+bwd × baseline", "modelled imb", "spread"], mrows),
        ]
    return "\n\n".join(parts)


def _skipped_section(res: dict) -> str:
    sk = res["skipped"]
    if not sk:
        return "## Skipped\n\nNothing: every layout could split every requested S at every world size."
    rows = [[r["part"], r["layout"], r["world_size"], r["seq_len"], r["reason"]] for r in sk]
    return "## Skipped\n\nA layout that cannot split S evenly over N ranks is skipped there, not padded:\n\n" + \
        md_table(["part", "layout", "N", "S", "reason"], rows)


def write_results(out: Path, cfg: dict, res: dict, meta: dict, log: Callable[[str], None]) -> Path:
    """Write every table's CSV, every picture (PNG + its CSV) and report.md into ``out``."""
    import torch
    from omegaconf import OmegaConf

    for name in ("modelled", "work_per_rank_step", "measured_wall", "measured_summary", "projection", "skipped"):
        write_csv(out / f"{name}.csv", res[name])
    write_csv(out / "measured_step_times.csv", res["measured_steps"])
    for name, rows in {**(res.get("packed") or {}), **(res.get("window") or {}),
                       **(res.get("strategies") or {})}.items():
        write_csv(out / f"{name}.csv", rows)
    for name, rows in figure_data(cfg, res).items():
        write_csv(out / f"{name}.csv", rows)
        mask = "causal" if cfg["causal"] else "non-causal"
        mask += ", packed documents" if name.startswith("packed") else ""
        if name.startswith("window"):
            mask += f", sliding window S/{min(cfg['window']['fractions'])}"
        if rows:
            _DRAW[name](rows, out / f"{name}.png", mask=mask)
        else:
            plots.placeholder(out / f"{name}.png", f"{name}: no data for this configuration (see report.md)")
    log("wrote the CSVs and pictures")
    (out / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(cfg)))
    files = sorted(p.name for p in out.iterdir() if p.suffix in (".png", ".csv", ".yaml"))
    head = [
        "# Layout comparison: " + ", ".join(cfg["layouts"]),
        f"Layouts {', '.join(cfg['layouts'])}; causal: {cfg['causal']}. torch {torch.__version__}, "
        f"Python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} cores. Config: `config.yaml`; "
        "rerun with `python -m studies.layout_comparison` and the same overrides.",
    ]
    tail = ["## Files", ", ".join(f"`{f}`" for f in files)]
    extra = ([_packed_section(cfg, res)] if res.get("packed") else []) + \
        ([window_section(cfg, res)] if res.get("window") else []) + \
        ([strategies_section(cfg, res, md_table)] if res.get("strategies") else [])
    text = "\n\n".join(head + [_modelled_section(cfg, res), _measured_section(cfg, res, meta),
                               _projection_section(cfg, res)] + extra + [_skipped_section(res)] + tail) + "\n"
    path = out / "report.md"
    path.write_text(text)
    return path
