"""The GPU benchmark (``benchmarks/attention.py --device cuda``): kernels and ring schedules on one GPU.

Shapes default to Llama-3-8B attention: 32 query heads, 8 K/V heads, head_dim 128, bf16, 8K tokens
per rank, causal, world sizes N in {2, 4, 8, 16}. For each N, on the full sequence S = N x 8K:

- **kernels**: each CUDA kernel of ours (forward, and forward+backward) on the full sequence, its
  TFLOP/s and the ratio to ``F.scaled_dot_product_attention`` on the same inputs, measured in the
  same run;
- **schedule efficiency** per layout: ideal / the busiest rank's time for its whole schedule, where
  ideal = SDPA's time on the full sequence / N (ring-flash-attention's "% of theoretical flash_attn").
  A rank's schedule is replayed alone on the GPU with its real plan, kernels and merges; its ring
  exchanges become local copies, so this is compute only (on NCCL the transfers overlap it);
- **peak memory per rank**: the most any rank's forward+backward replay allocated beyond its inputs;
- **packed replay** (``--packed``, the default; benchmarks/gpu_packed.py): lognormal documents of mean
  ``--doc-mean`` in T = N x tokens per rank, every layout with needs-only rows on and off, the busiest
  rank against the single-GPU varlen kernel on the whole batch / N.

The ``auto`` kernel row names the kernel ``auto`` picked for each block kind (``picks`` in the JSON).

Timings are CUDA-event medians after a warm-up. FLOPs count causal pairs only: 4·B·H·D·S(S+1)/2 for
the forward, 2.5x that for the backward.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from benchmarks import args as flags
from benchmarks.gpu_common import ReplayTransport, fmt, fwd_and_fwdbwd
from benchmarks.gpu_packed import packed_rows, print_packed
from benchmarks.measure import Stopwatch, time_cuda
from benchmarks.modelled import AttentionShape, comm_bytes_per_rank, flops_per_pair, min_pairs
from cp_attention.kernels import get_kernel
from cp_attention.kernels.dtypes import DTYPES
from cp_attention.layouts import get_layout
from cp_attention.schedules import rank_steps

__all__ = ["add_arguments", "resolve_defaults", "KernelRow", "ScheduleRow", "ReplayTransport", "causal_flops",
           "time_cuda", "fwd_and_fwdbwd", "fmt", "kernel_picks", "run"]

CUDA_KERNELS = ("auto", "flash", "cudnn", "efficient", "flash_attn")
# Defaults that differ by device: (CPU, CUDA). The CUDA ones are Llama-3-8B's attention.
_DEVICE_DEFAULTS = {"heads": (8, 32), "kv_heads": (None, 8), "head_dim": (64, 128), "dtype": ("float32", "bfloat16")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``benchmarks/attention.py``'s device switch, the shape options (None until :func:`resolve_defaults`
    fills them by device) and the CUDA-only options."""
    flags.add_ring(p, device="cpu")  # cpu: gloo ranks as processes; cuda: kernels and per-rank schedules on one GPU
    shape = p.add_argument_group("the attention's shape", "unset, by --device: 8 heads (K/V: --heads), head_dim 64, "
                                 "float32 on CPU; 32 heads, 8 K/V heads, head_dim 128, bfloat16 on CUDA")
    flags.add_shape(shape, heads=None, kv_heads=None, head_dim=None, dtype=None)
    cuda = p.add_argument_group("--device cuda only")
    flags.add_ring(cuda, world_sizes=[2, 4, 8, 16], tokens_per_rank=8192)
    cuda.add_argument("--kernels", nargs="+", default=list(CUDA_KERNELS),
                      help="kernels timed on the full sequence (auto: also the kernel it picks per block kind)")
    cuda.add_argument("--packed", action=argparse.BooleanOptionalAction, default=True,
                      help="the packed replay (lognormal documents, every layout, needs-only on and off)")
    cuda.add_argument("--doc-mean", type=float, default=2048.0, help="packed replay: mean document length (tokens)")


def resolve_defaults(args: argparse.Namespace) -> None:
    """Fill the shape options left at None with the device's defaults."""
    for name, defaults in _DEVICE_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, defaults[args.device == "cuda"])


@dataclass
class KernelRow:
    world_size: int
    seq: int
    kernel: str
    fwd_ms: float | None = None
    fwdbwd_ms: float | None = None
    fwd_tflops: float | None = None
    fwdbwd_tflops: float | None = None
    fwd_vs_sdpa: float | None = None  # our TFLOP/s / SDPA's (> 1: faster)
    fwdbwd_vs_sdpa: float | None = None
    error: str | None = None
    picks: dict | None = None  # auto only: block kind -> the kernel it runs


@dataclass
class ScheduleRow:
    world_size: int
    seq: int
    layout: str
    ideal_fwd_ms: float
    ideal_fwdbwd_ms: float
    busiest_fwd_ms: float | None = None
    busiest_fwdbwd_ms: float | None = None
    fwd_efficiency: float | None = None
    fwdbwd_efficiency: float | None = None
    peak_mib_per_rank: float | None = None
    sent_mib_per_rank: float | None = None  # the busiest sender's bytes in one fwd+bwd (ReplayTransport.sent_bytes)
    model_mib_per_rank: float | None = None  # the model's: whole shards (the replay runs without a needs index)
    error: str | None = None


def causal_flops(batch: int, heads: int, head_dim: int, seq: int, backward: bool) -> float:
    """FLOPs of causal attention over its S(S+1)/2 pairs, by the work model's per-pair count
    (:func:`~benchmarks.modelled.flops_per_pair`): forward, or forward+backward (3.5x for equal head dims)."""
    shape = AttentionShape(batch=batch, heads=heads, kv_heads=heads, head_dim=head_dim)
    per_pair = flops_per_pair(shape, False) + (flops_per_pair(shape, True) if backward else 0.0)
    return per_pair * batch * heads * min_pairs(seq, True)


def _inputs(args, seq: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = getattr(torch, args.dtype)
    mk = lambda h: torch.randn(1, seq, h, args.head_dim, device="cuda", dtype=dt, generator=g)  # noqa: E731
    return mk(args.heads), mk(args.kv_heads), mk(args.kv_heads), mk(args.heads)


def _sdpa(q, k, v):
    # bshd -> bhsd, K/V heads repeated for GQA (enable_gqa where this torch has it)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True).transpose(1, 2)


def kernel_picks(kernel) -> dict:
    """Block kind -> the kernel name ``kernel`` runs for it: an ``auto`` kernel's ``picks``; a kernel
    without them runs every block itself (``{"all": name}``)."""
    picks = getattr(kernel, "picks", None)
    return dict(picks) if picks is not None else {"all": kernel.name}


def _kernel_call(kernel, scale: float) -> Callable[..., torch.Tensor]:

    class _One(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse = kernel.forward(q, k, v, True, scale)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse = ctx.saved_tensors
            return kernel.backward(dout.contiguous(), q, k, v, out, lse, True, scale)

    return _One.apply


def _kernel_rows(args, n: int, seq: int, sdpa_ms: tuple[float, float]) -> list[KernelRow]:
    q, k, v, dout = _inputs(args, seq)
    rows = []
    scale = args.head_dim ** -0.5
    for name in args.kernels:
        row = KernelRow(n, seq, name)
        try:
            kernel = get_kernel(name, "cuda", q.dtype, head_dim=args.head_dim, v_head_dim=args.head_dim)
            if name == "auto":
                row.picks = kernel_picks(kernel)
            fwd, fwdbwd = fwd_and_fwdbwd(_kernel_call(kernel, scale), q, k, v, dout)
            row.fwd_ms, row.fwdbwd_ms = time_cuda(fwd, args.repeats), time_cuda(fwdbwd, args.repeats)
            for key, ms, back, base in (("fwd", row.fwd_ms, False, sdpa_ms[0]), ("fwdbwd", row.fwdbwd_ms, True,
                                                                                     sdpa_ms[1])):
                setattr(row, f"{key}_tflops", causal_flops(1, args.heads, args.head_dim, seq, back) / ms / 1e9)
                setattr(row, f"{key}_vs_sdpa", base / ms)
        except Exception as e:  # noqa: BLE001 - a kernel that cannot run here is reported, not fatal
            row.error = f"{type(e).__name__}: {e}"[:200]
        rows.append(row)
    return rows


def _replay(args, layout, rank: int, n: int, kernel) -> tuple[float, float, float, float]:
    """(fwd ms, fwd+bwd ms, peak MiB beyond the inputs, MiB sent in one fwd+bwd) of rank ``rank``'s
    whole schedule."""
    from cp_attention.engine.function import AttentionFunction  # the engine's internals: CUDA path only
    from cp_attention.engine.ring import RingSource
    from cp_attention.engine.tasks import KernelSettings

    local = args.tokens_per_rank
    q, k, v, dout = _inputs(args, local, seed=rank)
    transport = ReplayTransport(rank, n)
    source = RingSource(transport, rank_steps(layout, True, rank, n, local),
                        KernelSettings.of(kernel, args.head_dim ** -0.5))
    call = lambda a, b, c: AttentionFunction.apply(a, b, c, source, None)[0]  # noqa: E731
    fwd, fwdbwd = fwd_and_fwdbwd(call, q, k, v, dout)
    t_fwd, t_fb = time_cuda(fwd, args.repeats), time_cuda(fwdbwd, args.repeats)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    sent = transport.sent_bytes
    fwdbwd()
    torch.cuda.synchronize()
    return t_fwd, t_fb, (torch.cuda.max_memory_allocated() - base) / 2**20, (transport.sent_bytes - sent) / 2**20


def _schedule_rows(args, n: int, seq: int, sdpa_ms: tuple[float, float]) -> list[ScheduleRow]:
    kernel = get_kernel(args.kernel, "cuda", getattr(torch, args.dtype), head_dim=args.head_dim)
    rows = []
    for name in args.layouts:
        row = ScheduleRow(n, seq, name, sdpa_ms[0] / n, sdpa_ms[1] / n)
        try:
            per_rank = [_replay(args, get_layout(name), r, n, kernel) for r in range(n)]
            row.busiest_fwd_ms = max(p[0] for p in per_rank)
            row.busiest_fwdbwd_ms = max(p[1] for p in per_rank)
            row.fwd_efficiency = row.ideal_fwd_ms / row.busiest_fwd_ms
            row.fwdbwd_efficiency = row.ideal_fwdbwd_ms / row.busiest_fwdbwd_ms
            row.peak_mib_per_rank = max(p[2] for p in per_rank)
            row.sent_mib_per_rank = max(p[3] for p in per_rank)
            shape = AttentionShape(1, args.heads, args.kv_heads, args.head_dim, elem_bytes=DTYPES[args.dtype].itemsize)
            row.model_mib_per_rank = sum(comm_bytes_per_rank(seq, n, shape)) / 2**20
        except Exception as e:  # noqa: BLE001 - reported in the table
            row.error = f"{type(e).__name__}: {e}"[:200]
        rows.append(row)
    return rows


def run(args: argparse.Namespace) -> dict:
    """Measure and print every table; returns (and with ``args.json`` writes, after every N) the rows as
    JSON: ``device`` (the GPU's name), ``torch``, ``command``, ``args``, ``complete``, ``wall_s``, ``sdpa``,
    ``kernels``, ``schedules``, ``packed_baselines`` and ``packed``."""
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA device; run without it for the CPU benchmark")
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  {args.dtype}  heads {args.heads}/"
          f"{args.kv_heads}  head_dim {args.head_dim}  {args.tokens_per_rank} tokens per rank  causal")
    from benchmarks.measure import command_text

    clock = Stopwatch()
    kernel_rows, schedule_rows, sdpa, packed, bases = [], [], [], [], []
    for n in args.world_sizes:
        seq = n * args.tokens_per_rank
        q, k, v, dout = _inputs(args, seq)
        sdpa_ms = tuple(time_cuda(f, args.repeats) for f in fwd_and_fwdbwd(_sdpa, q, k, v, dout))
        del q, k, v, dout
        sdpa.append({"world_size": n, "seq": seq, "fwd_ms": sdpa_ms[0], "fwdbwd_ms": sdpa_ms[1]})
        print(f"\nN={n}  S={seq}  SDPA fwd {sdpa_ms[0]:.2f} ms "
              f"({causal_flops(1, args.heads, args.head_dim, seq, False) / sdpa_ms[0] / 1e9:.0f} TFLOP/s), "
              f"fwd+bwd {sdpa_ms[1]:.2f} ms "
              f"({causal_flops(1, args.heads, args.head_dim, seq, True) / sdpa_ms[1] / 1e9:.0f} TFLOP/s)")
        rows = _kernel_rows(args, n, seq, sdpa_ms)
        print(f"{'kernel':<11}{'fwd ms':>9}{'TFLOP/s':>9}{'xSDPA':>7}{'f+b ms':>9}{'TFLOP/s':>9}{'xSDPA':>7}")
        for r in rows:
            print(f"{r.kernel:<11}{fmt(r.fwd_ms, '9.2f')}{fmt(r.fwd_tflops, '9.0f')}{fmt(r.fwd_vs_sdpa, '7.2f')}"
                  f"{fmt(r.fwdbwd_ms, '9.2f')}{fmt(r.fwdbwd_tflops, '9.0f')}{fmt(r.fwdbwd_vs_sdpa, '7.2f')}"
                  + (f"  {r.error}" if r.error else ""))
            if r.picks:
                print(f"{'':<11}auto picks: "
                      + ", ".join(f"{kind} -> {name or 'none'}" for kind, name in r.picks.items()))
        kernel_rows += rows
        rows = _schedule_rows(args, n, seq, sdpa_ms)
        print(f"{'layout':<12}{'ideal fwd':>10}{'busiest':>9}{'eff':>7}{'ideal f+b':>10}{'busiest':>9}{'eff':>7}"
              f"{'peak MiB/rank':>15}{'sent MiB/rank':>15}{'model MiB':>11}")
        for r in rows:
            print(f"{r.layout:<12}{r.ideal_fwd_ms:10.2f}{fmt(r.busiest_fwd_ms, '9.2f')}"
                  f"{fmt(r.fwd_efficiency, '7.1%')}{r.ideal_fwdbwd_ms:10.2f}{fmt(r.busiest_fwdbwd_ms, '9.2f')}"
                  f"{fmt(r.fwdbwd_efficiency, '7.1%')}{fmt(r.peak_mib_per_rank, '15.0f')}"
                  f"{fmt(r.sent_mib_per_rank, '15.1f')}{fmt(r.model_mib_per_rank, '11.1f')}"
                  + (f"  {r.error}" if r.error else ""))
        schedule_rows += rows
        if args.packed:
            base, rows = packed_rows(args, n)
            print_packed(base, rows)
            bases.append(base)
            packed += rows
        # written after every N, so a run cut short (a time limit) still leaves what it measured
        result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "command": command_text(),
                  "args": vars(args), "complete": n == args.world_sizes[-1], "wall_s": clock.seconds(),
                  "sdpa": sdpa, "kernels": [asdict(r) for r in kernel_rows],
                  "schedules": [asdict(r) for r in schedule_rows], "packed_baselines": [asdict(b) for b in bases],
                  "packed": [asdict(r) for r in packed]}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    return result
