"""The communication strategies on CPU gloo: every ``cp_comm_type``
against one process, forward and forward+backward, causal, packed and windowed, at world size 4; the
per-rank peak memory of each; and how often ``"auto"`` (the cost model) picks a strategy within 10% of
the best measured one.

Each case runs all strategies round-robin on 4 spawned gloo ranks (``a2a+p2p`` over a 2 x 2 DeviceMesh:
a ring across 2 pairs, all-to-all inside each): the fastest of the repeats of the slowest rank
(:func:`.measure.measure`; a shared machine's load only ever adds time); the one-process baseline is plain attention on the whole sequence, in this
process, measured in the same run. The cost model is calibrated in the same run (the ranks' attention
FLOP/s, gloo's bandwidth and latency, the cost of a kernel call) and asked for each case.

Usage (from the repo root):
  python benchmarks/strategies.py [--seq-lens 2048 8192] [--heads 8/2 8/8] [--masks causal packed window]
                                         [--repeats 5] [--quick] [--json out.json]
"""  # noqa: E501 - printed verbatim by --help (RawDescriptionHelpFormatter)

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script: `benchmarks` imports from the repository root, and this folder's
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # files never shadow top-level packages

import argparse
import json
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from benchmarks import args as flags
from benchmarks.measure import (
    Stopwatch,
    call_times_ms,
    command_text,
    limit_malloc_caching,
    measure,
    memory_method,
    sent_bytes,
)
from cp_attention.launch import run_on_ranks

__all__ = ["Case", "add_arguments", "cases", "run"]

STRATEGIES = ("p2p", "all_gather", "a2a", "a2a+p2p")
WORLD, INNER = 4, 2


@dataclass(frozen=True)
class Case:
    seq: int
    heads: int
    kv_heads: int
    mask: str  # causal | packed | window
    head_dim: int = 64

    def cu_seqlens(self) -> tuple[int, ...] | None:
        """Packed: documents of lengths S/4, S/8, 3S/16, S/16, ... cycling, the last filling up."""
        if self.mask != "packed":
            return None
        parts, cu, i = (4, 8, 16 / 3, 16), [0], 0
        while cu[-1] < self.seq:
            cu.append(min(self.seq, cu[-1] + int(self.seq / parts[i % len(parts)]) + 1))
            i += 1
        return tuple(cu)

    def window(self) -> tuple[int, int]:
        return (self.seq // 8, 0) if self.mask == "window" else (-1, -1)

    def label(self) -> str:
        return f"S={self.seq} H={self.heads}/{self.kv_heads} {self.mask}"


def cases(seq_lens: list[int], heads: list[tuple[int, int]], masks: list[str]) -> list[Case]:
    return [Case(s, h, kv, m) for s in seq_lens for h, kv in heads for m in masks]


def add_arguments(p: argparse.ArgumentParser) -> None:
    flags.add_ring(p, seq_lens=[2048, 8192], layout="zigzag")
    flags.add_shape(p, head_pairs=["8/2", "8/8"])
    p.add_argument("--masks", nargs="+", default=["causal", "packed", "window"])
    flags.add_run(p, repeats=5, quick="one small case, one repeat (a smoke test)", json="the results")


def _tensors(case: Case, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    shapes = ((case.heads, case.head_dim), (case.kv_heads, case.head_dim), (case.kv_heads, case.head_dim),
              (case.heads, case.head_dim))
    return tuple(torch.randn(1, case.seq, h, d, generator=g) for h, d in shapes)


def _calls(q, k, v, dout, **kwargs) -> tuple:
    import cp_attention as cpa

    def fwd():
        with torch.no_grad():
            cpa.ring_attention(q, k, v, **kwargs)

    def fwdbwd():
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        cpa.ring_attention(qg, kg, vg, **kwargs).backward(dout)

    return fwd, fwdbwd


def _mask_kwargs(case: Case, layout: str) -> dict:
    cu = case.cu_seqlens()
    return dict(layout=layout, causal=True, window_size=case.window(),
                cu_seqlens=None if cu is None else torch.tensor(cu))


def _calibrate(group) -> dict:
    """This group's per-rank attention FLOP/s, gloo bandwidth and latency, and kernel-call cost (the
    ranks' mean, so every rank holds the same numbers)."""
    import cp_attention as cpa
    from cp_attention.transport.loopback import LoopbackGroup
    from cp_attention.transport.process_group import transport_for

    n, h, d = 2048, 8, 64
    q = torch.randn(1, n, h, d)

    def best(fn, repeats=3) -> float:
        """The fastest of ``repeats`` calls, in seconds."""
        dist.barrier(group)
        return min(call_times_ms(fn, repeats, warmup=0)) / 1e3

    alone = LoopbackGroup(1).rank(0)  # plain local attention on this rank (None would be the default group)
    with torch.no_grad():
        attn = best(lambda: cpa.ring_attention(q, q, q, group=alone))
        tiny = torch.randn(1, 16, h, d)
        call = best(lambda: [cpa.ring_attention(tiny, tiny, tiny, group=alone) for _ in range(20)]) / 20
    flops = 4 * (n * (n + 1) / 2) * d * h / attn
    transport = transport_for(group)
    big, small = torch.randn(2 << 20), torch.zeros(1)  # 8 MiB: the shards the cases pass round
    bw = big.numel() * 4 / best(lambda: transport.exchange([big], [torch.empty_like(big)]).wait(), repeats=5)
    latency = best(lambda: transport.exchange([small], [torch.empty_like(small)]).wait(), repeats=20)
    stats = torch.tensor([flops, bw, latency, call], dtype=torch.float64)
    dist.all_reduce(stats, group=group)
    flops, bw, latency, call = (stats / dist.get_world_size(group)).tolist()
    return {"flops": flops, "bw": bw, "latency_s": latency, "kernel_call_s": call}


def _worker(args: argparse.Namespace, todo: list[Case]) -> dict:
    """One rank: calibrate, then every case's strategies (round-robin, slowest rank per call)."""
    from torch.distributed.device_mesh import init_device_mesh

    import cp_attention as cpa
    from cp_attention.transport.process_group import transport_for

    mesh = init_device_mesh("cpu", (WORLD // INNER, INNER))
    rank, lay = dist.get_rank(), cpa.get_layout(args.layout)
    calibration = _calibrate(None)
    # one transport per group, passed as the group, so that its sent_bytes counts the calls (plans are
    # cached per group: a second transport of the same group would get the first one's plan)
    flat, two_level = transport_for(None), transport_for(mesh)
    transports = {s: two_level if s == "a2a+p2p" else flat for s in STRATEGIES}
    results = []
    for case in todo:
        q, k, v, dout = _tensors(case)
        cu = case.cu_seqlens()
        shard = lambda t, cu=cu: lay.shard(t, 1, rank, WORLD, cu_seqlens=cu)  # noqa: E731
        ql, kl, vl, dl = (shard(t) for t in (q, k, v, dout))
        impls = {s: _calls(ql, kl, vl, dl, group=transports[s], cp_comm_type=s, **_mask_kwargs(case, args.layout))
                 for s in STRATEGIES}
        rows = measure(impls, case.seq, args.repeats, dist.group.WORLD)  # the slowest rank per call
        results.append({"case": asdict(case), "rows": [asdict(r) for r in rows],
                        "bytes": sent_bytes(impls, transports, dist.group.WORLD)})
    return {"calibration": calibration, "results": results}


def _baseline(case: Case, repeats: int, layout: str) -> dict:
    q, k, v, dout = _tensors(case)
    rows = measure({"baseline": _calls(q, k, v, dout, **_mask_kwargs(case, layout))}, case.seq, repeats, None)
    return asdict(rows[0])


def _workload(case: Case, backward: bool, layout: str, strategy: str = "auto"):
    from cp_attention.strategies.cost import Workload

    return Workload(WORLD, 1, case.seq, case.heads, case.kv_heads, case.head_dim, case.head_dim, 4, True,
                    case.window(), case.cu_seqlens(), layout, INNER if strategy in ("auto", "a2a+p2p") else 1,
                    backward)


def _pick(case: Case, backward: bool, hardware, layout: str) -> str:
    from cp_attention.strategies.cost import choose

    return choose(_workload(case, backward, layout), hardware)


def _fastest(row: dict, key: str) -> float:
    """The fastest repeat of ``key`` ("fwd_ms" or "fwdbwd_ms") of a :class:`.measure.Row` as a dict."""
    return min(row[key.replace("_ms", "_runs_ms")] or [row[key]])


def run(args: argparse.Namespace) -> dict:
    """Measure, print the tables, return everything (also written to ``--json``)."""
    from cp_attention.strategies.cost import HARDWARE, Hardware, estimate

    if args.quick:
        args.seq_lens, args.heads, args.masks, args.repeats = [512], ["4/2"], ["causal", "packed"], 1
    heads = [tuple(int(x) for x in h.split("/")) for h in args.heads]
    todo = cases(args.seq_lens, heads, args.masks)
    print(f"command: {command_text()}")
    print(f"world {WORLD} gloo ranks on this machine (a2a+p2p: a {WORLD // INNER} x {INNER} mesh); fp32; layout "
          f"{args.layout}; head_dim 64; the fastest of {args.repeats} repeats of the slowest rank; peak memory: "
          f"{memory_method()}", flush=True)
    limit_malloc_caching()
    clock = Stopwatch()
    base = {c: _baseline(c, args.repeats, args.layout) for c in todo}
    out = run_on_ranks(_worker, WORLD, args, todo, timeout_s=3600)
    cal = out["calibration"]
    measured = Hardware("cpu_measured", cal["flops"], cal["bw"], cal["bw"], WORLD, cal["latency_s"],
                        cal["kernel_call_s"])
    print(f"calibrated: {cal['flops'] / 1e9:.1f} GFLOP/s per rank, {cal['bw'] / 1e9:.2f} GB/s, latency "
          f"{cal['latency_s'] * 1e6:.0f} us, kernel call {cal['kernel_call_s'] * 1e6:.0f} us "
          f"(after {clock.seconds():.0f} s)\n")
    hits = {"calibrated": 0, "preset": 0}
    report = []
    head = f"{'case':<26}{'mode':<9}" + "".join(f"{s:>14}" for s in STRATEGIES) + f"{'best':>12}{'auto':>12}{'':>4}"
    print(head + "\n" + "-" * len(head))
    for item, case in zip(out["results"], todo):
        b = {key: _fastest(base[case], key) for key in ("fwd_ms", "fwdbwd_ms")}
        for mode, key in (("fwd", "fwd_ms"), ("fwd+bwd", "fwdbwd_ms")):
            times = {r["impl"]: _fastest(r, key) for r in item["rows"]}
            best = min(times, key=times.get)
            picks = {name: _pick(case, mode != "fwd", hw, args.layout)
                     for name, hw in (("calibrated", measured), ("preset", HARDWARE["cpu_gloo"]))}
            ok = {name: times[p] <= 1.1 * times[best] for name, p in picks.items()}
            for name in hits:
                hits[name] += ok[name]
            cells = "".join(f"{times[s]:>8.1f} {times[s] / b[key]:>4.2f}x" for s in STRATEGIES)
            print(f"{case.label():<26}{mode:<9}{cells}{best:>12}{picks['calibrated']:>12}"
                  f"{'ok' if ok['calibrated'] else 'MISS':>4}")
            report.append({"case": case.label(), "mode": mode, "times_ms": times, "baseline_ms": b[key], "best": best,
                           "picks": picks, "within_10pct": ok})
    total = len(report)
    print("\ncells: ms of the slowest rank (its fastest repeat), and the ratio to one process on the whole sequence")
    print(f"auto within 10% of the best measured: {hits['calibrated']}/{total} "
          f"({100 * hits['calibrated'] / total:.0f}%) with the calibrated profile, {hits['preset']}/{total} with "
          f"the cpu_gloo preset")
    print("\nper-rank peak memory (MiB, fwd+bwd, max over ranks), measured / the cost model's K/V held at once:")
    for item, case in zip(out["results"], todo):
        peaks = {r["impl"]: r["fwdbwd_peak_mib"] for r in item["rows"]}
        kv = {s: _workload(case, True, args.layout, s) for s in STRATEGIES}
        print(f"{case.label():<26}"
              + "".join(f"{s}={peaks[s]:.1f}/{estimate(kv[s], s, measured).peak_kv_bytes / 2**20:.1f}  "
                        for s in STRATEGIES)
              + f"one process={base[case]['fwdbwd_peak_mib']:.1f}")
    print("\nbytes sent per forward+backward call, all ranks (MB), measured (transport.sent_bytes after minus "
          "before) / the cost model's (the sum of extra['rank_bytes'], or comm_bytes x N):")
    for item, case in zip(out["results"], todo):
        model = {s: estimate(_workload(case, True, args.layout, s), s, measured) for s in STRATEGIES}
        model = {s: sum(e.extra.get("rank_bytes", (e.comm_bytes,) * WORLD)) for s, e in model.items()}
        got = item.get("bytes") or {}
        print(f"{case.label():<26}" + "".join(
            f"{s}={'-' if got.get(s) is None else f'{got[s] / 1e6:.2f}'}/{model[s] / 1e6:.2f}  " for s in STRATEGIES))
    print(f"\ntotal {clock.seconds():.0f} s")
    result = {"setup": vars(args), "calibration": cal, "report": report, "hits": hits, "total": total,
              "raw": out["results"], "baseline": {c.label(): base[c] for c in todo}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return result


if __name__ == "__main__":
    from benchmarks.measure import command_line

    command_line(__doc__, add_arguments, run)
