"""The packed-documents benchmark: many short documents in one long packed sequence, causal, forward and forward+backward, on CPU gloo.

Rows (the sequence length column is the packed length T):
  baseline         one process, ``world_size`` threads: every document on its own through the same
                   CPU flash kernel, forward and backward ops called directly and the results
                   concatenated into full tensors (no CP, no packing machinery;
                   ``F.scaled_dot_product_attention``'s autograd per document is ~20x slower in
                   backward on CPU, so it would flatter the ring)
  varlen/1 rank    one process, ``world_size`` threads: ``ring_attention(cu_seqlens=)`` at world size 1
  ring/<layout>    ``ring_attention(cu_seqlens=)`` over ``world_size`` processes, 1 thread each

Usage (from the repo root):  python benchmarks/packed.py [--tokens 65536] [--documents 1000]
"""  # noqa: E501 - printed verbatim by --help (RawDescriptionHelpFormatter)

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script: `benchmarks` imports from the repository root, and this folder's
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # files never shadow top-level packages

import argparse
import os
import statistics
from typing import Callable

import torch
import torch.distributed as dist

from benchmarks import args as flags
from benchmarks.attention import make_inputs, ours
from benchmarks.measure import Row, measure, memory_method, print_bytes, sent_bytes, sweep
from cp_attention import LAYOUT_NAMES
from cp_attention.kernels import get_kernel
from cp_attention.kernels.dtypes import DTYPES
from cp_attention.launch import spawn
from cp_attention.layouts import get_layout
from cp_attention.layouts.documents import cu_seqlens_from_lengths, pad_cu_seqlens

__all__ = ["document_lengths", "run"]


def document_lengths(total: int, documents: int, sigma: float, seed: int) -> list[int]:
    """``documents`` lognormal lengths (median ~ total/documents, long tail ``sigma``) summing to ``total``."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.exp(torch.randn(documents, generator=g, dtype=torch.float64) * sigma)
    lengths = (raw / raw.sum() * (total - documents)).floor().long() + 1  # every document >= 1 token
    lengths[torch.argmax(lengths)] += total - int(lengths.sum())
    return lengths.tolist()


def _cu(args) -> tuple[int, ...]:
    lengths = document_lengths(args.tokens, args.documents, args.sigma, args.seed)
    cu, pad = pad_cu_seqlens(cu_seqlens_from_lengths(lengths), 2 * args.world_size)
    if pad:
        raise ValueError(f"--tokens {args.tokens} must be a multiple of 2*world_size={2 * args.world_size}")
    return cu


def _per_document(q, k, v, dout, cu, kernel_name: str) -> tuple[Callable, Callable]:
    """Every document through the kernel on its own, assembled into full tensors as a user would (the
    ring returns the full local output and gradients too)."""
    kern = get_kernel(kernel_name, q.device, q.dtype)
    scale = q.shape[-1] ** -0.5
    docs = list(zip(cu, cu[1:]))

    def parts():
        return [kern.forward(q[:, a:b], k[:, a:b], v[:, a:b], True, scale) for a, b in docs]

    def fwd():
        with torch.no_grad():
            return torch.cat([o for o, _ in parts()], 1)

    def fwdbwd():
        with torch.no_grad():
            grads = [kern.backward(dout[:, a:b], q[:, a:b], k[:, a:b], v[:, a:b], o, lse, True, scale)
                     for (a, b), (o, lse) in zip(docs, parts())]
            return [torch.cat(g, 1) for g in zip(*grads)]
    return fwd, fwdbwd


def baseline_worker(args, seq: int) -> dict:
    """One process: the per-document loop and our varlen path at world size 1."""
    cu = _cu(args)
    q, k, v, dout = make_inputs(args, seq)
    impls = {"baseline": _per_document(q, k, v, dout, cu, args.kernel),
             "varlen/1 rank": ours(q, k, v, dout, None, "contiguous", args.kernel, cu_seqlens=cu)}
    return {"rows": measure(impls, seq, args.repeats, None), "threads": torch.get_num_threads(),
            "memory": memory_method()}


def ring_worker(args, seq: int) -> dict:
    """One rank: every layout's ring over the packed documents, and the bytes each sent in one
    forward+backward call (the transport's ``sent_bytes``; one transport, so the counter is the ring's)."""
    from cp_attention.transport.process_group import transport_for

    cu = _cu(args)
    rank, ws = dist.get_rank(), dist.get_world_size()
    full = make_inputs(args, seq)
    transport = transport_for(dist.group.WORLD)
    impls = {}
    for name in args.layouts:
        lay = get_layout(name)
        shard = [lay.shard(t, 1, rank, ws, cu_seqlens=cu) for t in full]
        impls[f"ring/{lay.name}"] = ours(*shard, transport, lay, args.kernel, cu_seqlens=cu)
    rows = measure(impls, seq, args.repeats, dist.group.WORLD)
    return {"rows": rows, "threads": torch.get_num_threads(), "memory": memory_method(),
            "bytes": sent_bytes(impls, {name: transport for name in impls}, dist.group.WORLD)}


def model_bytes(args) -> dict[str, tuple[float, float]]:
    """Per ring impl, the model's K/V + dK/dV bytes of one forward+backward call (all ranks):
    needs-only (what the engine sends) and whole shards."""
    from benchmarks.modelled import AttentionShape
    from benchmarks.modelled import model_bytes as bytes_of

    shape = AttentionShape(1, args.heads, args.kv_heads, args.head_dim, elem_bytes=DTYPES[args.dtype].itemsize)
    return {f"ring/{get_layout(name).name}": bytes_of(name, args.tokens, args.world_size, shape, _cu(args))
            for name in args.layouts}


def run(args: argparse.Namespace) -> list[Row]:
    """The whole benchmark for parsed ``args`` (tokens, documents, sigma, seed, world_size, layouts,
    heads, kv_heads, head_dim, dtype, kernel, repeats, rounds, timeout); prints the table, returns the
    rows."""
    args.batch, args.seq_lens = 1, [args.tokens]
    lengths = document_lengths(args.tokens, args.documents, args.sigma, args.seed)
    header = (f"torch {torch.__version__}, world size {args.world_size}, gloo, causal, {args.dtype}, kernel "
              f"{args.kernel}, H={args.heads} Hkv={args.kv_heads} D={args.head_dim}; {args.documents} documents in "
              f"T={args.tokens} tokens (lognormal sigma={args.sigma}, seed {args.seed}: median "
              f"{sorted(lengths)[len(lengths) // 2]}, max {max(lengths)}); median of {args.repeats} (+1 warm-up) "
              f"per round, "
              f"median of {args.rounds} rounds")

    # A speed benchmark: reuse freed memory, as a caching allocator (CUDA's, or the jemalloc/tcmalloc
    # PyTorch's CPU tuning guide recommends) does. sweep() would otherwise make every allocation over
    # 128 KiB a fresh mapping, and glibc maps anything over 32 MiB afresh anyway: at T=64K one rank's
    # [1, 32K, 8, 64] fp32 shard is 64 MiB, and each fresh one costs ~30 ms of page faults here,
    # more than a ring step's kernels. MALLOC_MMAP_MAX_=0 keeps every block on the heap, for the
    # baseline and the ring alike. Peak memory columns then count only newly mapped pages.
    for var, value in (("MALLOC_MMAP_THRESHOLD_", 32 << 20), ("MALLOC_TRIM_THRESHOLD_", 1 << 30),
                       ("MALLOC_MMAP_MAX_", 0)):
        os.environ.setdefault(var, str(value))

    per_round: list[tuple[dict, dict]] = []

    def both(seq: int) -> tuple[dict, dict]:
        # Rounds alternate the baseline and the ring, so a slow phase of the shared machine lands on
        # both; each impl's time is the median of its per-round medians.
        per_round.clear()  # this S's rounds only
        for _ in range(args.rounds):
            base = spawn(baseline_worker, 1, args, seq, threads=args.world_size)
            per_round.append((base, spawn(ring_worker, args.world_size, args, seq, threads=1, timeout_s=args.timeout)))
        return tuple(_median_of_rounds([r[i] for r in per_round]) for i in (0, 1))

    rows, _, ring = sweep(header, args.seq_lens, both, "ring", args.world_size,
                          notes=lambda parallel: _round_ratios(per_round))
    print_bytes(ring["bytes"], model_bytes(args))
    return rows


def _median_of_rounds(results: list[dict]) -> dict:
    """One worker result from several rounds': per impl the median of the rounds' medians, the largest
    peak, and every timed run."""
    rows = []
    for parts in zip(*(r["rows"] for r in results)):
        med = lambda attr, parts=parts: statistics.median(getattr(p, attr) for p in parts)  # noqa: E731
        rows.append(Row(parts[0].seq, parts[0].impl, med("fwd_ms"), med("fwdbwd_ms"),
                        max(p.fwd_peak_mib for p in parts), max(p.fwdbwd_peak_mib for p in parts),
                        [t for p in parts for t in p.fwd_runs_ms], [t for p in parts for t in p.fwdbwd_runs_ms]))
    return {**results[0], "rows": rows}


def _round_ratios(per_round: list[tuple[dict, dict]]) -> list[str]:
    """A line per impl: its forward+backward time over the baseline of the same round, round by round."""
    lines = [f"rounds: {len(per_round)}, baseline and ring alternating; fwd+bwd over the same round's baseline:"]
    ratios: dict[str, list[float]] = {}
    for base, ring in per_round:
        b = next(r for r in base["rows"] if r.impl == "baseline").fwdbwd_ms
        for r in base["rows"] + ring["rows"]:
            ratios.setdefault(r.impl, []).append(r.fwdbwd_ms / b)
    for impl, xs in ratios.items():
        if impl != "baseline":
            lines.append(f"  {impl:<20}" + " ".join(f"{x:.3f}" for x in xs) + f"   median {statistics.median(xs):.3f}")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.add_documents(p, tokens=65536, documents=1000, sigma=1.0, seed=0)
    flags.add_ring(p, world_size=2, layouts=LAYOUT_NAMES, kernel="auto")
    flags.add_shape(p, heads=8, kv_heads=None, head_dim=64, dtype="float32")
    flags.add_run(p, repeats=3, timeout=600)  # repeats per round
    p.add_argument("--rounds", type=int, default=3,
                   help="baseline and ring measured alternately this many times; each row is the median of rounds")
    args = p.parse_args(argv)
    flags.resolve_kv_heads(args)
    return args


if __name__ == "__main__":
    from benchmarks.measure import finish

    finish(run, parse_args(), json_option=False)
