"""The GPU benchmark's packed replay (``benchmarks/attention.py --device cuda``, on by default; ``--no-packed``
leaves it out): packed documents through every layout's ring, rank by rank, on one GPU.

For each N, one packed batch of T = N x ``--tokens-per-rank`` tokens: seeded lognormal documents of mean
``--doc-mean`` (sigma 1.5, the last one trimmed: the layout comparison's
:func:`~benchmarks.documents.lognormal_lengths`). Measured in the same run:

- **the whole batch**: the single-GPU varlen kernel, ``aten._flash_attention_forward/backward`` with
  ``cu_seqlens`` over all T tokens (what ``torch.nn.attention.varlen.varlen_attn`` calls; its Python
  signature differs between torch releases, the op's does not), forward and forward+backward;
- **per layout, needs-only rows on and off** (the plan's ``needs_only=``): each rank's schedule replayed
  alone, ``ring_attention(q, k, v, plan=plan)`` with the rank's real packed plan and
  ``--kernel``, its exchanges local copies (:class:`~benchmarks.gpu_common.ReplayTransport`); the busiest rank's
  forward and forward+backward time, and **efficiency** = (whole batch / N) / busiest rank;
- the K/V + dK/dV bytes all ranks send in one forward+backward, counted by the replay, and the work
  model's figure for them (:func:`~benchmarks.modelled.model_bytes`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

import torch

from benchmarks.documents import fit_lengths, lognormal_lengths
from benchmarks.gpu_common import ReplayTransport, fmt, fwd_and_fwdbwd
from benchmarks.measure import time_cuda
from benchmarks.modelled import AttentionShape, model_bytes
from cp_attention import ring_attention
from cp_attention.engine.plan import AttentionPlan, build_plan
from cp_attention.kernels.dtypes import DTYPES

__all__ = ["BASELINE", "PackedBaseline", "PackedRow", "packed_documents", "efficiency", "replay_plan",
           "replay_rank", "layout_row", "whole_batch", "packed_rows", "print_packed"]

BASELINE = "aten._flash_attention_forward/backward (varlen, whole batch)"
SEED = 0  # the documents' seed: every run measures the same batch per (T, mean)
Timer = Callable[[Callable[[], object], int], float]


@dataclass
class PackedBaseline:
    world_size: int
    tokens: int
    documents: int
    longest: int
    kernel: str = BASELINE
    fwd_ms: float | None = None
    fwdbwd_ms: float | None = None
    error: str | None = None


@dataclass
class PackedRow:
    world_size: int
    tokens: int
    layout: str
    needs_only: bool
    ideal_fwd_ms: float | None = None  # the whole batch's time / N
    ideal_fwdbwd_ms: float | None = None
    busiest_fwd_ms: float | None = None
    busiest_fwdbwd_ms: float | None = None
    busiest_rank: int | None = None  # the rank with the longest forward+backward
    fwd_efficiency: float | None = None
    fwdbwd_efficiency: float | None = None
    sent_mib: float | None = None  # K/V + dK/dV all ranks sent in one fwd+bwd (ReplayTransport.sent_bytes)
    model_mib: float | None = None  # the work model's figure for the same traffic
    error: str | None = None


def packed_documents(tokens: int, doc_mean: float, seed: int = SEED) -> tuple[int, ...]:
    """``cu_seqlens`` of ``tokens`` tokens of seeded lognormal documents of mean ``doc_mean`` (sigma 1.5),
    the last one trimmed so they end at ``tokens`` exactly. Raises ``ValueError`` for a non-positive
    ``tokens`` or ``doc_mean``."""
    if tokens < 1 or doc_mean <= 0:
        raise ValueError(f"packed documents need tokens >= 1 and a mean document length > 0, got tokens={tokens}, "
                         f"doc_mean={doc_mean}; pass --tokens-per-rank and --doc-mean as positive numbers")
    return fit_lengths(lognormal_lengths(tokens, doc_mean, 1.5, seed), tokens)


def efficiency(whole_ms: float | None, world_size: int, busiest_ms: float | None) -> float | None:
    """(``whole_ms`` / ``world_size``) / ``busiest_ms``: the share of a perfect split of the whole batch's
    time that the busiest rank keeps (1.0: no overhead, no imbalance). None when either time is missing."""
    if whole_ms is None or busiest_ms is None or busiest_ms <= 0:
        return None
    return whole_ms / world_size / busiest_ms


def replay_plan(layout: str, rank: int, world_size: int, cu_seqlens: tuple[int, ...], needs_only: bool
                ) -> tuple[AttentionPlan, ReplayTransport]:
    """Rank ``rank``'s causal plan of the packed batch on a :class:`ReplayTransport` (its agreement answers at
    once): the plan a real group's rank builds, and the transport that counts what it sends."""
    transport = ReplayTransport(rank, world_size)
    return build_plan(layout, transport, True, cu_seqlens, needs_only=needs_only), transport


def _inputs(args, local: int, device: torch.device | str, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device=device).manual_seed(seed)
    dt = getattr(torch, args.dtype)
    mk = lambda h: torch.randn(1, local, h, args.head_dim, device=device, dtype=dt, generator=g)  # noqa: E731
    return mk(args.heads), mk(args.kv_heads), mk(args.kv_heads), mk(args.heads)


def replay_rank(args, layout: str, rank: int, world_size: int, cu_seqlens: tuple[int, ...], needs_only: bool,
                device: torch.device | str = "cuda", timer: Timer = time_cuda) -> tuple[float, float, int]:
    """(fwd ms, fwd+bwd ms, bytes sent in one fwd+bwd) of rank ``rank``'s whole packed schedule, replayed
    alone through ``ring_attention`` with ``args.kernel``; ``timer(fn, args.repeats)`` times a call."""
    plan, transport = replay_plan(layout, rank, world_size, cu_seqlens, needs_only)
    q, k, v, dout = _inputs(args, cu_seqlens[-1] // world_size, device, seed=rank)
    call = lambda a, b, c: ring_attention(a, b, c, plan=plan, kernel=args.kernel)  # noqa: E731
    fwd, fwdbwd = fwd_and_fwdbwd(call, q, k, v, dout)
    t_fwd, t_fb = timer(fwd, args.repeats), timer(fwdbwd, args.repeats)
    sent = transport.sent_bytes
    fwdbwd()
    return t_fwd, t_fb, transport.sent_bytes - sent


def layout_row(args, world_size: int, cu_seqlens: tuple[int, ...], layout: str, needs_only: bool,
               whole: tuple[float | None, float | None], device: torch.device | str = "cuda",
               timer: Timer = time_cuda) -> PackedRow:
    """One layout's row: every rank replayed, the busiest rank's times and their efficiency against
    ``whole`` = the whole batch's (fwd ms, fwd+bwd ms). An error is reported in the row, not raised."""
    tokens = cu_seqlens[-1]
    row = PackedRow(world_size, tokens, layout, needs_only)
    if whole[0] is not None and whole[1] is not None:
        row.ideal_fwd_ms, row.ideal_fwdbwd_ms = whole[0] / world_size, whole[1] / world_size
    try:
        per_rank = [replay_rank(args, layout, r, world_size, cu_seqlens, needs_only, device, timer)
                    for r in range(world_size)]
        row.busiest_fwd_ms = max(p[0] for p in per_rank)
        row.busiest_rank = max(range(world_size), key=lambda r: per_rank[r][1])
        row.busiest_fwdbwd_ms = per_rank[row.busiest_rank][1]
        row.fwd_efficiency = efficiency(whole[0], world_size, row.busiest_fwd_ms)
        row.fwdbwd_efficiency = efficiency(whole[1], world_size, row.busiest_fwdbwd_ms)
        row.sent_mib = sum(p[2] for p in per_rank) / 2**20
        shape = AttentionShape(1, args.heads, args.kv_heads, args.head_dim, elem_bytes=DTYPES[args.dtype].itemsize)
        row.model_mib = model_bytes(layout, tokens, world_size, shape, cu_seqlens)[0 if needs_only else 1] / 2**20
    except Exception as e:  # noqa: BLE001 - reported in the table
        row.error = f"{type(e).__name__}: {e}"[:200]
    return row


def whole_batch(args, cu_seqlens: tuple[int, ...], timer: Timer = time_cuda, device: torch.device | str = "cuda",
                ops=None) -> PackedBaseline:
    """The single-GPU varlen kernel over the whole packed batch: forward, forward+backward (``ops``:
    ``torch.ops.aten``, or a stand-in with its two ops)."""
    lengths = [b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])]
    base = PackedBaseline(0, cu_seqlens[-1], len(lengths), max(lengths))
    op = torch.ops.aten if ops is None else ops
    try:
        q, k, v, dout = (t[0] for t in _inputs(args, cu_seqlens[-1], device, seed=0))  # [T, H, D]
        cu = torch.tensor(cu_seqlens, dtype=torch.int32, device=device)
        top, scale = base.longest, args.head_dim ** -0.5

        def fwd():
            return op._flash_attention_forward(q, k, v, cu, cu, top, top, 0.0, True, False, scale=scale)

        def fwdbwd():
            out, lse, *_ = fwd()
            rng, unused = torch.zeros(2, dtype=torch.uint64, device=device), torch.empty(0, device=device)
            return op._flash_attention_backward(dout, q, k, v, out, lse, cu, cu, top, top, 0.0, True, rng, unused,
                                                scale=scale)

        base.fwd_ms, base.fwdbwd_ms = timer(fwd, args.repeats), timer(fwdbwd, args.repeats)
    except Exception as e:  # noqa: BLE001 - reported; the rows then have no efficiency
        base.error = f"{type(e).__name__}: {e}"[:200]
    return base


def packed_rows(args: argparse.Namespace, world_size: int) -> tuple[PackedBaseline, list[PackedRow]]:
    """The whole-batch baseline and every (layout, needs_only) row at ``world_size`` ranks (CUDA)."""
    cu = packed_documents(world_size * args.tokens_per_rank, args.doc_mean)
    base = whole_batch(args, cu)
    base.world_size = world_size
    rows = [layout_row(args, world_size, cu, layout, needs, (base.fwd_ms, base.fwdbwd_ms))
            for layout in args.layouts for needs in (True, False)]
    return base, rows


def print_packed(base: PackedBaseline, rows: list[PackedRow]) -> None:
    """The packed replay's table at one N, as the benchmark prints it."""
    print(f"packed: T={base.tokens}, {base.documents} lognormal documents (longest {base.longest}); whole batch, "
          f"{base.kernel}: fwd {fmt(base.fwd_ms, '.2f')} ms, fwd+bwd {fmt(base.fwdbwd_ms, '.2f')} ms"
          + (f"  {base.error}" if base.error else ""))
    print(f"{'layout':<12}{'needs':>6}{'ideal fwd':>10}{'busiest':>9}{'eff':>7}{'ideal f+b':>10}{'busiest':>9}"
          f"{'eff':>7}{'sent MiB':>10}{'model MiB':>11}")
    for r in rows:
        print(f"{r.layout:<12}{'yes' if r.needs_only else 'no':>6}{fmt(r.ideal_fwd_ms, '10.2f')}"
              f"{fmt(r.busiest_fwd_ms, '9.2f')}{fmt(r.fwd_efficiency, '7.1%')}{fmt(r.ideal_fwdbwd_ms, '10.2f')}"
              f"{fmt(r.busiest_fwdbwd_ms, '9.2f')}{fmt(r.fwdbwd_efficiency, '7.1%')}{fmt(r.sent_mib, '10.1f')}"
              f"{fmt(r.model_mib, '11.1f')}" + (f"  {r.error}" if r.error else ""))
