"""The longest context per GPU: the true peak memory of one training step, per term and per memory saver,
the longest sequence under a cap, and a projection to Llama-3-8B and -70B on 80 GB GPUs.

One training step (forward and backward, no optimizer step) of a random-weight bf16 Llama shaped like
Llama-3-8B but 1/8 as wide (hidden 512, intermediate 1792, 8/2 heads of 64, vocab 128,256, 4 layers), CP over
``--cp`` gloo ranks (zigzag), per rank, for each saver:

  baseline      ``causal_lm_loss(model(**model_inputs(local)).logits, ...)``: the full logits, no saver
  lm_loss       ``cphf.lm_loss(model, local, group=..., chunk_tokens=C)``: the chunked head and loss
  checkpoint    lm_loss + ``cphf.save_memory(model, checkpoint=True)``
  offload       lm_loss + ``save_memory(model, checkpoint="offload")``
  mlp_chunks    lm_loss + ``save_memory(model, checkpoint=False, mlp_chunks=M)``
  on_device     lm_loss + ``save_memory(model, checkpoint=True, mlp_chunks=M)``: every saver but the offloads
  all           lm_loss + ``save_memory(model, checkpoint="offload", mlp_chunks=M)``

The peak is the peak of live tensor bytes through the allocator (``studies/memory/peak.py``: the profiler's
allocation events replayed in order on CPU; ``torch.cuda.max_memory_allocated`` on a GPU), the parameters
included, the maximum over ranks; the bytes live at the peak are attributed to terms by the op that
allocated them. On CPU the offloaded checkpoints are host memory on a GPU: they are counted apart, not in the
device peak. Everything is linear in the local tokens T: each saver is measured at several T; a line through
the first two predicts the others (the formula's check), and feeds the projection (``studies/memory/projection.py``).

Usage (from the repo root):
  python -m studies.memory [--tokens 2048 4096 8192] [--baseline-tokens 1024 2048 4096]
                           [--savers baseline lm_loss checkpoint offload mlp_chunks all] [--chunk-tokens 256]
                           [--cap-gib 1.0 --cap-saver all] [--vocab-check 1024] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
from dataclasses import asdict
from typing import Iterator

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from benchmarks import args as flags
from benchmarks.measure import Stopwatch, command_text, elapsed_ms, rss_peak_delta
from cp_attention.launch import run_on_ranks
from studies.memory import projection
from studies.memory.peak import MIB, OFFLOAD_SCOPE, OFFLOADED, TERMS, measure_step

__all__ = ["SAVERS", "add_arguments", "build_model", "measure_one", "worker", "run"]

GIB = 1024 ** 3
SAVERS = ("baseline", "lm_loss", "checkpoint", "offload", "mlp_chunks", "on_device", "all")
# The quick smoke run: the same shape 1/8 as wide again, and a small vocab.
QUICK = {"hidden": 64, "intermediate": 224, "heads": 8, "kv_heads": 2, "vocab": 4096, "layers": 2,
         "tokens": [256, 512, 1024], "baseline_tokens": [256, 512, 1024], "chunk_tokens": 128, "vocab_check": 256,
         "cap_gib": 14 / 1024, "cap_saver": "lm_loss"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192],
                   help="local tokens per rank for the savers; the first two fit the line, the rest check it")
    p.add_argument("--baseline-tokens", type=int, nargs="+", default=[1024, 2048, 4096],
                   help="local tokens for the baseline (full logits: ~1.5 GB per rank per 1K tokens)")
    p.add_argument("--savers", nargs="+", default=list(SAVERS), choices=SAVERS)
    p.add_argument("--chunk-tokens", type=int, default=256, help="lm_loss's chunk_tokens")
    p.add_argument("--mlp-chunks", type=int, default=4)
    p.add_argument("--cp", type=int, default=2, help="CP ranks (gloo, spawned here)")
    # --device cuda: one GPU per rank (NCCL), the peak from torch.cuda.max_memory_allocated
    flags.add_ring(p, layout="zigzag", device="cpu")
    flags.add_model(p, layers=4, hidden=512, intermediate=1792, vocab=128256)
    flags.add_shape(p, heads=8, kv_heads=2)
    p.add_argument("--vocab-check", type=int, default=1024, metavar="T",
                   help="measure baseline and lm_loss at twice the vocab at T and T/2 local tokens (0: skip)")
    p.add_argument("--cap-gib", type=float, default=None, help="find the longest T whose measured peak fits this")
    p.add_argument("--cap-saver", default="all", choices=SAVERS)
    p.add_argument("--rss-check", action=argparse.BooleanOptionalAction, default=True,
                   help="cross-check the meter against the process's peak RSS once (lm_loss at the first T)")
    projection.add_arguments(p)
    flags.add_run(p, quick="a tiny model and short lengths: a smoke test", json="every measurement and the setup")
    p.add_argument("--from-json", nargs="+", default=None, metavar="PATH",
                   help="measure nothing: report the rows of these --json files (a later file's row replaces an "
                        "earlier one's), with this command's projection settings")


def build_model(args: argparse.Namespace, vocab: int) -> torch.nn.Module:
    """The benchmark's Llama: random weights, seeded alike on every rank, bf16, untied head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=1 << 22, use_cache=False,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.bfloat16).train()


def _saver_kwargs(saver: str, args: argparse.Namespace) -> dict | None:
    return {"checkpoint": dict(checkpoint=True, mlp_chunks=None),
            "offload": dict(checkpoint="offload", mlp_chunks=None),
            "mlp_chunks": dict(checkpoint=False, mlp_chunks=args.mlp_chunks),
            "on_device": dict(checkpoint=True, mlp_chunks=args.mlp_chunks),
            "all": dict(checkpoint="offload", mlp_chunks=args.mlp_chunks)}.get(saver)


@contextlib.contextmanager
def _offload_marked() -> Iterator[None]:
    """Mark the offload's copies to the host (``memory.offload.HostStash``) with the profiler range the meter
    counts as host memory (``peak.OFFLOAD_SCOPE``); what the copy does is unchanged."""
    from cp_attention.memory import offload

    init = offload.HostStash.__init__

    def marked(self, tensor: torch.Tensor) -> None:
        with record_function(OFFLOAD_SCOPE):
            init(self, tensor)

    offload.HostStash.__init__ = marked
    try:
        yield
    finally:
        offload.HostStash.__init__ = init


def measure_one(args: argparse.Namespace, saver: str, tokens: int, vocab: int, rss: bool = False) -> dict:
    """One rank: one training step of ``saver`` at ``tokens`` local tokens; its :class:`peak.Peak` as a dict,
    the maximum over ranks (the whole dict of the rank with the larger peak)."""
    from cp_attention.integrations import huggingface as cphf

    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    model = cphf.apply_context_parallel(build_model(args, vocab).to(device), layout=args.layout)
    if _saver_kwargs(saver, args) is not None:
        model = cphf.save_memory(model, **_saver_kwargs(saver, args))
    g = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, vocab, (1, tokens * dist.get_world_size()), generator=g)
    local = {k: v.to(device) if torch.is_tensor(v) else v
             for k, v in cphf.shard_batch({"input_ids": ids}, layout=args.layout).items()}

    def forward_loss() -> torch.Tensor:
        if saver == "baseline":
            return cphf.causal_lm_loss(model(**cphf.model_inputs(local)).logits, local["shift_labels"])
        return cphf.lm_loss(model, local, chunk_tokens=args.chunk_tokens)

    with _offload_marked():
        peak, step_ms = elapsed_ms(lambda: measure_step(model, forward_loss, vocab))
    row = {"saver": saver, "tokens": tokens, "vocab": vocab, "step_s": step_ms / 1e3,
           **asdict(peak), "rank": dist.get_rank()}
    if rss:  # the same step again, without the profiler: the process's peak RSS above its RSS before
        model.zero_grad(set_to_none=True)
        gc.collect()
        row["rss_delta"] = rss_peak_delta(lambda: forward_loss().backward())
    model = local = None  # drop the step's model and batch (the closures share these cells) before collecting
    gc.collect()
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    return max(rows, key=lambda r: r["peak"])


def _line(points: list[tuple[int, int]]) -> tuple[float, float]:
    (t1, p1), (t2, p2) = points[:2]
    b = (p2 - p1) / (t2 - t1)
    return p1 - b * t1, b


def longest_under_cap(args: argparse.Namespace, saver: str, cap: float, fit: tuple[float, float],
                      step: int) -> dict:
    """The longest local T (a multiple of ``step``) whose MEASURED peak is at most ``cap``: from the line's
    guess, steps of 1/16 until the cap is bracketed, then bisection down to 1% (every probe a measured step)."""
    a, b = fit
    if b <= 0 or cap <= a:
        raise SystemExit(f"--cap-gib {cap / GIB:g}: the {saver} line (fixed {a / MIB:.1f} MiB + {b:.0f} B per token) "
                         "never reaches it or starts above it; pick a cap above the fixed part")
    guess = max(step, int((cap - a) / b) // step * step)
    probes: list = []
    lo, hi, t = 0, None, guess

    def fits(t: int) -> bool:
        r = measure_one(args, saver, t, args.vocab)
        probes.append((t, r["peak"]))
        if dist.get_rank() == 0:
            print(f"    cap {cap / GIB:.3f} GiB: T={t} peak {r['peak'] / MIB:.1f} MiB", flush=True)
        return r["peak"] <= cap  # the same on every rank: the peak is the maximum over ranks

    while hi is None or lo == 0:  # bracket
        if fits(t):
            lo, t = t, (t + max(step, t // 16)) // step * step
        else:
            hi, t = t, max(step, (t - max(step, t // 16)) // step * step)
            if t == hi or (lo == 0 and t == step and hi == step):
                break
        if len(probes) >= 8:
            break
    while hi is not None and lo and hi - lo > max(step, lo // 100) and len(probes) < 12:  # bisect
        mid = (lo + hi) // 2 // step * step
        if mid in (lo, hi):
            break
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return {"saver": saver, "cap_bytes": cap, "longest_tokens": lo, "first_over": hi, "guess": guess,
            "probes": probes}


def worker(args: argparse.Namespace, clock: Stopwatch) -> dict:
    """One rank of the spawned job: every measurement, one at a time (the previous model freed first)."""
    out: dict = {"rows": [], "cap": None}
    say = print if dist.get_rank() == 0 else (lambda *a, **k: None)
    for saver in args.savers:
        for i, tokens in enumerate(args.baseline_tokens if saver == "baseline" else args.tokens):
            rss = args.rss_check and saver == args.savers[min(1, len(args.savers) - 1)] and i == 0
            out["rows"].append(measure_one(args, saver, tokens, args.vocab, rss=rss))
            say(f"  {saver} T={tokens}: peak {out['rows'][-1]['peak'] / MIB:.1f} MiB "
                f"({clock.seconds():.0f} s)", flush=True)
    if args.vocab_check:
        for saver in ("baseline", "lm_loss"):
            for tokens in (args.vocab_check // 2, args.vocab_check):
                for vocab in (args.vocab, 2 * args.vocab):
                    out["rows"].append(dict(measure_one(args, saver, tokens, vocab), vocab_check=True))
            say(f"  vocab check {saver} done ({clock.seconds():.0f} s)", flush=True)
    if args.cap_gib:
        pts = [(r["tokens"], r["peak"]) for r in out["rows"]
               if r["saver"] == args.cap_saver and r["vocab"] == args.vocab and not r.get("vocab_check")]
        if len(pts) < 2:
            pts = [(t, measure_one(args, args.cap_saver, t, args.vocab)["peak"]) for t in args.tokens[:2]]
        out["cap"] = longest_under_cap(args, args.cap_saver, args.cap_gib * GIB, _line(pts),
                                       step=2 * args.cp)
    return out


def _table(rows: list[dict], title: str) -> None:
    terms = list(TERMS) + [OFFLOADED]
    print(f"\n{title}\n(MiB per rank, the rank with the larger peak; the terms are the bytes live at the peak)")
    head = (f"{'saver':<11}{'T':>6}{'peak':>9}" + "".join(f"{t[:12]:>13}" for t in terms)
            + f"{'host peak':>11}  where the peak is")
    print(head + "\n" + "-" * len(head))
    for r in rows:
        snap = r["at_peak"]["terms"]
        print(f"{r['saver']:<11}{r['tokens']:>6}{r['peak'] / MIB:>9.1f}"
              + "".join(f"{snap.get(t, 0) / MIB:>13.1f}" for t in terms)
              + f"{r['host_peak'] / MIB:>11.1f}  {_where(r)}")


def _where(r: dict) -> str:
    regions = r["regions"]
    return max(regions, key=lambda k: regions[k]["total"]) if regions else "-"


def _phases(rows: list[dict]) -> None:
    print("\npeak of each phase (MiB; backward split by where the allocating op belongs)")
    for r in rows:
        fwd = max((s["total"] for k, s in r["regions"].items() if k.startswith("forward")), default=0)
        loss = max((s["total"] for k, s in r["regions"].items() if k == "backward head+loss"), default=0)
        lay = max((s["total"] for k, s in r["regions"].items() if k.startswith("backward layer")), default=0)
        print(f"  {r['saver']:<11} T={r['tokens']:<6} forward {fwd / MIB:9.1f}   backward of the head+loss "
              f"{loss / MIB:9.1f}   backward of the layers {lay / MIB:9.1f}")


def run(args: argparse.Namespace) -> dict:
    """Measure every saver (spawned ranks), or read earlier measurements (``--from-json``); print the tables,
    the checks, the goals and the projection. Returns what ``--json`` writes."""
    from benchmarks.measure import limit_malloc_caching

    if args.quick:  # the quick sizes, except where the command line gave its own
        defaults = argparse.ArgumentParser()
        add_arguments(defaults)
        for key, value in QUICK.items():
            if getattr(args, key) == defaults.get_default(key):
                setattr(args, key, value)
    print(f"command: {command_text()}")
    if args.from_json:
        return report(args, *_read(args))
    if "RANK" in os.environ:
        raise SystemExit("run this benchmark as a plain python script, not under torchrun: it starts its own ranks")
    for name in ("tokens", "baseline_tokens"):
        if len(getattr(args, name)) < 2 or any(t % (2 * args.cp) for t in getattr(args, name)):
            raise SystemExit(f"--{name.replace('_', '-')}: at least two lengths, each a multiple of {2 * args.cp} "
                             f"(the zigzag split at cp={args.cp}), got {getattr(args, name)}")
    limit_malloc_caching()  # the RSS cross-check: freed blocks go back to the OS at once
    clock = Stopwatch()
    _print_setup(args, "gloo" if args.device == "cpu" else "nccl")
    out = run_on_ranks(worker, args.cp, args, clock, timeout_s=3600,
                       backend="nccl" if args.device == "cuda" else "gloo")
    result = report(args, out["rows"], out["cap"])
    print(f"total {clock.seconds():.0f} s")
    return result


_SHAPE = ("hidden", "intermediate", "heads", "kv_heads", "layers", "vocab", "cp", "layout", "chunk_tokens",
          "mlp_chunks", "tokens", "device")


def _read(args: argparse.Namespace) -> tuple[list, dict | None]:
    """The rows of ``--from-json`` files (a later file's row replaces an earlier one's for the same saver, T,
    vocab); the shape is the first file's."""
    rows: dict = {}
    cap = None
    for i, path in enumerate(args.from_json):
        with open(path) as f:
            data = json.load(f)
        if i == 0:
            for key in _SHAPE:
                setattr(args, key, data["setup"].get(key, getattr(args, key)))
        for r in data["rows"]:
            rows[(r["saver"], r["tokens"], r["vocab"], bool(r.get("vocab_check")))] = r
        cap = data.get("cap") or cap
    print(f"measurements read from {', '.join(args.from_json)}")
    _print_setup(args, "gloo" if args.device == "cpu" else "nccl")
    return list(rows.values()), cap


def _print_setup(args: argparse.Namespace, backend: str) -> None:
    n_params = sum(p.numel() for p in build_model(args, args.vocab).parameters())
    args.params_count = n_params
    print(f"model: Llama, {n_params:,} parameters, hidden {args.hidden}, intermediate {args.intermediate}, heads "
          f"{args.heads}/{args.kv_heads}, {args.layers} layers, vocab {args.vocab:,}, bf16, untied head; CP={args.cp} "
          f"{args.layout} ({backend}), one training step (fwd+bwd) per row; lm_loss chunk_tokens={args.chunk_tokens}, "
          f"mlp_chunks={args.mlp_chunks}", flush=True)


def report(args: argparse.Namespace, rows: list[dict], cap: dict | None) -> dict:
    """Print every table and check from measured rows; returns what ``--json`` writes."""
    main = sorted((r for r in rows if not r.get("vocab_check")), key=lambda r: (SAVERS.index(r["saver"]), r["tokens"]))
    _table(main, "peak memory per saver and local tokens T")
    _phases(main)
    for r in main:
        if r.get("rss_delta") is not None:
            print(f"\ncross-check ({r['saver']}, T={r['tokens']}): the meter's peak of the bytes allocated in the step "
                  f"{r['window_peak'] / MIB:.1f} MiB; the process's peak RSS above its RSS at the step's start "
                  f"{r['rss_delta'] / MIB:.1f} MiB ({(r['rss_delta'] / r['window_peak'] - 1) * 100:+.2f}%)")
        if r.get("allocator_peak") is not None:  # CUDA: the allocator's own peak against the replay's
            print(f"  {r['saver']} T={r['tokens']}: max_memory_allocated {r['allocator_peak'] / MIB:.1f} MiB, "
                  f"replayed events {r['peak'] / MIB:.1f} MiB")
    for saver in dict.fromkeys(r["saver"] for r in main):  # what binds a wider model: the layers' backward
        longest = max((r for r in main if r["saver"] == saver), key=lambda r: r["tokens"])
        if longest.get("top_layers"):
            print(f"\n{saver}, T={longest['tokens']}: the largest groups live at the layers' backward peak (MiB):\n  "
                  + "; ".join(f"{t} {b / MIB:.1f} ({op})" for t, op, b, _n in longest["top_layers"][:6]))
    fits = projection.report(args, main, args.params_count)
    checks = [r for r in rows if r.get("vocab_check")]
    vocab = projection.vocab_report(args, checks) if checks else None
    if cap:
        print(f"\nlongest local T under {cap['cap_bytes'] / GIB:.3f} GiB ({cap['saver']}), by the measured peak: "
              f"{cap['longest_tokens']} (global {cap['longest_tokens'] * args.cp}); first over: {cap['first_over']}; "
              f"the line's guess {cap['guess']}; probes (T, MiB): "
              + ", ".join(f"({t}, {p / MIB:.1f})" for t, p in cap["probes"]))
    projection.goals(args, main, fits, vocab)
    result = {"setup": {k: v for k, v in vars(args).items() if k not in ("json", "from_json")},
              "rows": rows, "cap": cap, "fits": fits}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result

