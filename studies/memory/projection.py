"""From the measured peaks at the small shape (``studies/memory/longest_context.py``) to Llama-3-8B and -70B
on 80 GB GPUs.

The measured step is linear in the local tokens T. For each region of the step (the forward, the backward of
the head and loss, the backward of each layer) the bytes live at that region's peak are fitted, per term, to
a line alpha + beta * T through two measured lengths; the peak is the largest region's line. The same lines,
scaled per term, give the target model's per-GPU peak:

  peak(T) = states + buffers + max over regions [ sum over terms (alpha_t + beta_t * T) * scale_t ]

  scale_t = r * l_t      for the width-sized terms (attention, MLP, norms, checkpoints, other, the loss's
                         hidden-sized part): r = hidden_target / hidden_small (8 for 8B, 16 for 70B; the small
                         shape is 1/8 of 8B in every width, 1/16 of 70B's except K/V, which is 1/8: conservative);
                         l_t = layers_target / layers_small for the per-layer terms the step keeps for every
                         layer (all of them without checkpointing; the checkpoints with checkpointing on the
                         device), else 1 (one layer's working set)
  scale_t = 1            for the vocab-sized blocks of the loss (the vocab is the same: 128,256)
  params+grads           replaced by the target's: states = 16 bytes x params / GPUs (FSDP2 over every GPU:
                         fp32 params, fp32 grads, AdamW's two fp32 moments), 0 on the GPU when the optimizer
                         is offloaded (FSDP2's CPUOffloadPolicy); buffers = two layers' bf16 params (the one
                         running and the prefetched one) + one layer's bf16 grads + the unsharded bf16 embedding
                         and head and their bf16 grads (the root group stays unsharded through the step)

The longest T per GPU solves peak(T) = capacity - reserve, the reserve being CUDA's context and NCCL's buffers
(``--reserve-gib``) plus the allocator's fragmentation (``--fragmentation`` of the capacity). CP runs over
every GPU, so the sequence is GPUs x T. With offload the host holds every layer's checkpoint (the offloaded
bytes' line, x r x layers ratio) and the optimizer's state (16 bytes x params / GPUs): where that exceeds
``--host-gb-per-node`` / 8 per GPU, the host binds instead.
"""

from __future__ import annotations

import argparse

from studies.memory.peak import MIB, OFFLOADED

__all__ = ["MODELS", "ALST", "add_arguments", "fit", "predict", "project", "report", "vocab_report", "goals"]

GB, GIB = 1e9, 1024 ** 3
MODELS = {"Llama-3-8B": dict(hidden=4096, intermediate=14336, heads=32, kv_heads=8, layers=32, vocab=128256),
          "Llama-3-70B": dict(hidden=8192, intermediate=28672, heads=64, kv_heads=8, layers=80, vocab=128256)}
# ALST's published figures (tokens per sequence), the paper (arXiv 2506.13996) for 8B; the 70B figures are the
# max_length of ArcticTraining's recipes projects/sequence-parallelism/run-h100-sp{8,32,64}-llama-70b.yml
# (8 GPUs without checkpoint offload; 32 "at the brink of cpu-oom").
ALST = {("Llama-3-8B", 8): "3.7M", ("Llama-3-8B", 32): "15M", ("Llama-3-8B", 64): "unknown",
        ("Llama-3-70B", 8): "200K (recipe)", ("Llama-3-70B", 32): "4M (recipe)", ("Llama-3-70B", 64): "10M (recipe)"}
PER_LAYER = ("attention", "MLP", "norms")
OFFLOADING = ("offload", "all")
CHECKPOINTING = ("checkpoint", "offload", "on_device", "all")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu-gb", type=float, default=80.0, help="GPU memory, decimal GB (80 GB: an H100)")
    p.add_argument("--reserve-gib", type=float, default=3.0, help="CUDA context + NCCL buffers per GPU")
    p.add_argument("--fragmentation", type=float, default=0.05, help="allocator fragmentation, share of the GPU")
    p.add_argument("--gpus", type=int, nargs="+", default=[8, 32, 64])
    p.add_argument("--host-gb-per-node", type=float, default=1900.0,
                   help="host memory per node of 8 GPUs, decimal GB (ALST's H100 nodes: 1.9 TB): it bounds the "
                        "offloaded checkpoints and optimizer state")


def _params(h: int, inter: int, heads: int, kv_heads: int, layers: int, vocab: int) -> tuple[int, int, int]:
    """(total, per layer, embedding) parameters of an untied Llama."""
    hd = h // heads
    layer = h * (h + 2 * kv_heads * hd) + h * h + 3 * h * inter + 2 * h
    return 2 * vocab * h + layers * layer + h, layer, vocab * h


def _term_lines(r1: dict, r2: dict, region: str) -> dict:
    """term -> (alpha, beta) over two rows' snapshots at ``region``'s peak; the vocab-sized part of the loss
    apart as ``vocab``."""
    s1, s2 = r1["regions"][region], r2["regions"][region]
    t1, t2 = r1["tokens"], r2["tokens"]
    out = {}
    for term in set(s1["terms"]) | set(s2["terms"]):
        v1, v2 = s1["terms"].get(term, 0), s2["terms"].get(term, 0)
        if term == "logits/loss":
            out["vocab"] = _ab(s1["vocab_bytes"], s2["vocab_bytes"], t1, t2)
            v1, v2 = v1 - s1["vocab_bytes"], v2 - s2["vocab_bytes"]
        out[term] = _ab(v1, v2, t1, t2)
    return out


def _ab(v1: float, v2: float, t1: int, t2: int) -> tuple[float, float]:
    b = (v2 - v1) / (t2 - t1)
    return v1 - b * t1, b


def fit(rows: list[dict], longest: bool = False) -> dict:
    """Per region, per term lines through two rows of one saver: the two shortest (the check: they predict
    the longer ones), or with ``longest`` the two longest (the projection: what is live at a region's peak
    settles as T grows, e.g. the loss's fixed chunk stops mattering)."""
    ordered = sorted(rows, key=lambda r: r["tokens"])
    r1, r2 = ordered[-2:] if longest else ordered[:2]
    return {reg: _term_lines(r1, r2, reg) for reg in r1["regions"] if reg in r2["regions"]}


def _scales(saver: str, r: float, lam: float) -> dict:
    ckpt = saver in CHECKPOINTING
    s = {"vocab": 1.0, "logits/loss": r, "other": r, OFFLOADED: r * lam,
         "checkpoints": r * (lam if saver not in OFFLOADING else 1.0)}
    s.update({t: r * (1.0 if ckpt else lam) for t in PER_LAYER})
    if not ckpt:
        s["checkpoints"] = r * lam
    return s


def predict(lines: dict, saver: str, tokens: float, r: float = 1.0, lam: float = 1.0,
            params_grads: bool = True) -> tuple[float, str, float, float]:
    """(device peak, its region, its alpha, its beta) at ``tokens``; ``params_grads=False`` leaves that term
    out (the projection replaces it)."""
    sc = _scales(saver, r, lam)
    best = (-1.0, "", 0.0, 0.0)
    for region, terms in lines.items():
        a = sum(ab[0] * sc.get(t, 1.0) for t, ab in terms.items() if t != OFFLOADED and
                (params_grads or t != "params+grads"))
        b = sum(ab[1] * sc.get(t, 1.0) for t, ab in terms.items() if t != OFFLOADED and
                (params_grads or t != "params+grads"))
        if a + b * tokens > best[0]:
            best = (a + b * tokens, region, a, b)
    return best


def project(lines: dict, saver: str, model: str, gpus: int, small: dict, args: argparse.Namespace) -> dict:
    """The longest sequence of ``model`` on ``gpus`` GPUs (see the module docstring)."""
    m = MODELS[model]
    r, lam = m["hidden"] / small["hidden"], m["layers"] / small["layers"]
    total, layer, embed = _params(m["hidden"], m["intermediate"], m["heads"], m["kv_heads"], m["layers"],
                                   m["vocab"])
    off_opt = saver in OFFLOADING
    states = 0.0 if off_opt else 16.0 * total / gpus
    buffers = 2 * 2 * layer + 2 * layer + 2 * 2 * embed + 2 * 2 * embed
    budget = args.gpu_gb * GB * (1 - args.fragmentation) - args.reserve_gib * GIB
    sc = _scales(saver, r, lam)
    t_max, where, alpha, beta = float("inf"), "", 0.0, 0.0
    for region, terms in lines.items():
        a = sum(ab[0] * sc.get(t, 1.0) for t, ab in terms.items() if t not in (OFFLOADED, "params+grads"))
        b = sum(ab[1] * sc.get(t, 1.0) for t, ab in terms.items() if t not in (OFFLOADED, "params+grads"))
        t = (budget - states - buffers - a) / b if b > 0 else float("inf")
        if t < t_max:
            t_max, where, alpha, beta = t, region, a, b
    if budget - states - buffers <= 0:
        t_max, where, alpha, beta = 0.0, "the model states alone", 0.0, 0.0
    t_max = max(0.0, t_max)
    # the host: the offloaded checkpoints (all layers' inputs) and, offloaded, the optimizer's state
    host_b = max((terms.get(OFFLOADED, (0, 0))[1] * sc[OFFLOADED] for terms in lines.values()), default=0.0)
    host_fixed = 16.0 * total / gpus if off_opt else 0.0
    host_cap = args.host_gb_per_node * GB / 8
    if host_b > 0 and host_fixed + host_b * t_max > host_cap:  # the host binds first
        t_max, where = max(0.0, (host_cap - host_fixed) / host_b), "host memory"
    host = host_fixed + host_b * t_max
    return {"model": model, "gpus": gpus, "saver": saver, "tokens_per_gpu": t_max, "sequence": t_max * gpus,
            "states": states, "buffers": buffers, "alpha": alpha, "beta": beta, "budget": budget, "region": where,
            "host_per_gpu": host, "host_per_node": 8 * host, "optimizer_offloaded": off_opt, "r": r, "lam": lam}


def _m(x: float) -> str:
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.0f}K"


def report(args: argparse.Namespace, rows: list[dict], n_params: int) -> dict:
    """Print the formula's check at the small shape and the projection table; returns the fits."""
    small = dict(hidden=args.hidden, layers=args.layers)
    fits, savers = {}, list(dict.fromkeys(r["saver"] for r in rows))
    print("\nformula check at the small shape: lines through the first two lengths predict the others")
    for saver in savers:
        own = sorted((r for r in rows if r["saver"] == saver), key=lambda r: r["tokens"])
        if len(own) < 2:
            continue
        lines = fit(own)
        fits[saver] = fit(own, longest=True)
        _, region, a, b = predict(lines, saver, own[0]["tokens"])
        print(f"  {saver:<11} T={own[0]['tokens']} and {own[1]['tokens']}: per token {b:,.0f} B (at its peak region, "
              f"{region}), fixed {a / MIB:,.1f} MiB")
        for r in own[2:]:
            p = predict(lines, saver, r["tokens"])[0]
            print(f"    T={r['tokens']}: predicted {p / MIB:,.1f} MiB, measured {r['peak'] / MIB:,.1f} MiB "
                  f"({(p / r['peak'] - 1) * 100:+.2f}%)")
    print("\nprojection: from the lines through each saver's two longest lengths (" + ", ".join(
        f"{s} {sorted(r['tokens'] for r in rows if r['saver'] == s)[-2]}/"
        f"{max(r['tokens'] for r in rows if r['saver'] == s)}" for s in fits) + ")")
    print(f"  GPU {args.gpu_gb:g} GB; reserve {args.reserve_gib:g} GiB (CUDA context, NCCL buffers) + "
          f"{args.fragmentation:.0%} of the GPU (fragmentation); CP and FSDP2 over every GPU, bf16 compute, AdamW; "
          f"the optimizer offloaded (FSDP2 CPUOffloadPolicy) for {', '.join(OFFLOADING)}")
    print("  T_max per GPU = (budget - states - buffers - alpha) / beta, the smallest over the regions of the step;"
          " sequence = GPUs x T_max\n  (alpha, beta: the measured lines of the region that binds, scaled per term: "
          "x r for width, x layers ratio for what every layer keeps, x 1 for vocab-sized blocks)")
    head = (f"  {'model':<12}{'GPUs':>5} {'saver':<11}{'sequence':>10}{'per GPU':>9}{'states GB':>10}"
            f"{'buffers GB':>11}{'alpha GB':>9}{'beta KB/tok':>12}{'host/node GB':>13}  binds at / ALST")
    print(head + "\n  " + "-" * (len(head) - 2))
    table = []
    for model in MODELS:
        for gpus in args.gpus:
            for saver in fits:
                p = project(fits[saver], saver, model, gpus, small, args)
                table.append(p)
                print(f"  {model:<12}{gpus:>5} {saver:<11}{_m(p['sequence']):>10}{_m(p['tokens_per_gpu']):>9}"
                      f"{p['states'] / GB:>10.1f}{p['buffers'] / GB:>11.1f}{p['alpha'] / GB:>9.2f}"
                      f"{p['beta'] / 1e3:>12.1f}{p['host_per_node'] / GB:>13.0f}  {p['region']} / "
                      f"{ALST[(model, gpus)]}")
    print("  what is live at the binding region's peak on 8 GPUs, at each saver's longest T, by term (KB per token "
          "of T, scaled to the target; params+grads left out):")
    for model in MODELS:
        for saver in fits:
            p = next(q for q in table if q["model"] == model and q["saver"] == saver and q["gpus"] == args.gpus[0])
            longest = max((r for r in rows if r["saver"] == saver), key=lambda r: r["tokens"])
            snap = longest["regions"].get(p["region"])
            if snap:
                sc = _scales(saver, p["r"], p["lam"])
                terms = dict(snap["terms"], vocab=snap["vocab_bytes"])
                terms["logits/loss"] = terms.get("logits/loss", 0) - snap["vocab_bytes"]
                parts = sorted(((t, b * sc.get(t, 1.0) / longest["tokens"]) for t, b in terms.items()
                                if t not in (OFFLOADED, "params+grads") and b > 0), key=lambda x: -x[1])
                print(f"    {model:<12}{saver:<11}{p['region']:<20}"
                      + ", ".join(f"{t} {b / 1e3:.1f}" for t, b in parts))
    fits["projection"] = table
    return fits


def vocab_report(args: argparse.Namespace, rows: list[dict]) -> dict | None:
    """Doubling the vocab: how far it moves the peak with the full logits and with lm_loss."""
    print("\nvocab doubled (measured; the peak with the parameters, MiB):")
    moves: dict = {}
    for saver in ("baseline", "lm_loss"):
        for t in sorted({r["tokens"] for r in rows}):
            p = {r["vocab"]: r["peak"] for r in rows if r["saver"] == saver and r["tokens"] == t}
            if len(p) == 2:
                v1, v2 = sorted(p)
                moves[(saver, t)] = p[v2] - p[v1]
                print(f"  {saver:<9} T={t}: vocab {v1:,} {p[v1] / MIB:9.1f}, vocab {v2:,} {p[v2] / MIB:9.1f}: "
                      f"moves {moves[(saver, t)] / MIB:9.1f}")
    for t in sorted({t for _, t in moves}):
        if ("baseline", t) in moves and ("lm_loss", t) in moves:
            print(f"  T={t}: lm_loss's move / the baseline's = {moves[('lm_loss', t)] / moves[('baseline', t)]:.3f}"
                  " (goal < 0.25)")
    ts = sorted({t for _, t in moves})[-2:]
    if len(ts) >= 2:  # lines through the two longest lengths give the moves at the second --tokens length too
        t_at = args.tokens[1] if len(args.tokens) > 1 else args.tokens[0]
        mv = {s: moves[(s, ts[0])] + (moves[(s, ts[1])] - moves[(s, ts[0])]) / (ts[1] - ts[0]) * (t_at - ts[0])
              for s in ("baseline", "lm_loss")}
        print(f"  at T={t_at} by the lines: baseline moves {mv['baseline'] / MIB:.1f}, "
              f"lm_loss {mv['lm_loss'] / MIB:.1f}"
              f" MiB: ratio {mv['lm_loss'] / mv['baseline']:.3f}")
        return {"tokens": t_at, "ratio": mv["lm_loss"] / mv["baseline"], "how": "the lines through two measured T"}
    if ts and ("baseline", ts[-1]) in moves and ("lm_loss", ts[-1]) in moves:
        return {"tokens": ts[-1], "ratio": moves[("lm_loss", ts[-1])] / moves[("baseline", ts[-1])], "how": "measured"}
    return None


def _sequence(fits: dict, model: str, gpus: int, saver: str) -> float | None:
    return next((p["sequence"] for p in fits.get("projection", ()) if p["model"] == model and p["gpus"] == gpus
                 and p["saver"] == saver), None)


def goals(args: argparse.Namespace, rows: list[dict], fits: dict, vocab: dict | None = None) -> None:
    """Issue 34's goals against what was measured and projected."""
    print("\ngoals (issue 34):")

    def line(what: str, value: float | None, goal: float, fmt) -> None:
        verdict = "n/a" if value is None else ("met" if value >= goal else "NOT met")
        print(f"  {what:<62} {'-' if value is None else fmt(value):>10}  goal >= {fmt(goal):<8} {verdict}")

    line("Llama-3-8B on 8 x 80 GB, every saver (all)", _sequence(fits, "Llama-3-8B", 8, "all"), 4e6, _m)
    line("Llama-3-8B on 32 x 80 GB, every saver (all)", _sequence(fits, "Llama-3-8B", 32, "all"), 16e6, _m)
    line("Llama-3-8B on 8 x 80 GB, the chunked loss alone (lm_loss)", _sequence(fits, "Llama-3-8B", 8, "lm_loss"),
         1e6, _m)
    line("Llama-3-8B on 8 x 80 GB, the chunked loss + checkpoint", _sequence(fits, "Llama-3-8B", 8, "checkpoint"),
         1e6, _m)
    line("Llama-3-8B on 8 x 80 GB, every saver but the offloads", _sequence(fits, "Llama-3-8B", 8, "on_device"),
         1e6, _m)
    t = args.tokens[1] if len(args.tokens) > 1 else args.tokens[0]
    lm = [r["peak"] for r in rows if r["saver"] == "lm_loss" and r["tokens"] == t]
    base = [r["peak"] for r in rows if r["saver"] == "baseline" and r["tokens"] == t]
    how = "measured"
    if not base and "baseline" in fits:
        base, how = [predict(fits["baseline"], "baseline", t)[0]], "the baseline's line"
    if lm and base:
        ratio = lm[0] / base[0]
        print(f"  small shape, T={t}: lm_loss (chunk_tokens={args.chunk_tokens}) {lm[0] / MIB:,.1f} MiB / baseline "
              f"{base[0] / MIB:,.1f} MiB ({how}) = {ratio:.3f}  goal <= 0.25 {'met' if ratio <= 0.25 else 'NOT met'}")
    if vocab:
        r = vocab["ratio"]
        print(f"  vocab doubled, T={vocab['tokens']} ({vocab['how']}): lm_loss's move / the baseline's = {r:.3f}  "
              f"goal < 0.25 {'met' if r < 0.25 else 'NOT met'}")


