#!/usr/bin/env python
"""Time causal ring attention (forward, forward+backward) on CPU gloo against full attention.

Rows per sequence length S:
  baseline           one process, full sequence, the same kernel, ``world_size`` threads
  ring/<layout>      cp_attention.ring_attention over ``world_size`` processes, 1 thread each
  torch_ring/zigzag  PyTorch's private templated ring (head-tail load balancing) on the same CPU flash op

Usage (from the repo root):  python scripts/benchmark.py [--quick] [--seq-lens 8192 16384] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # time this checkout, installed or not

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from cp_attention import get_layout, ring_attention  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LAYOUTS = ("contiguous", "zigzag", "interleaved")
CHECK_SEQ = 1024  # the torch-ring correctness check runs once, at this small length


@dataclass
class Row:
    """One table row: an implementation at one global sequence length S."""

    seq: int
    impl: str
    fwd_ms: Optional[float] = None
    fwdbwd_ms: Optional[float] = None
    fwd_peak_mib: Optional[float] = None
    fwdbwd_peak_mib: Optional[float] = None
    fwd_runs_ms: Optional[list] = None  # every timed repeat (max over ranks), to judge the noise
    fwdbwd_runs_ms: Optional[list] = None
    error: Optional[str] = None


# ---------------------------------------------------------------- memory

def _status_kib(field: str) -> int:
    """A ``kB`` field of /proc/self/status (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS; False where /proc/self/clear_refs is not writable."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def memory_method() -> str:
    return "VmHWM after clear_refs, minus RSS before the call" if _reset_peak() else \
        "clear_refs not writable: process-lifetime VmHWM minus RSS before the call (an upper bound)"


# ---------------------------------------------------------------- timing

def _one_call(fn: Callable[[], object], group) -> tuple[float, float]:
    """Wall time (ms) of one call and its peak RSS above the RSS just before it (MiB)."""
    if group is not None:
        dist.barrier(group)  # ranks start together, so the slowest rank's time is the step's time
    _reset_peak()
    rss0 = _status_kib("VmRSS")
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    return dt * 1e3, (_status_kib("VmHWM") - rss0) / 1024


def measure(impls: dict[str, tuple[Callable, Callable]], seq: int, repeats: int, group) -> list[Row]:
    """One row per impl: forward-only and forward+backward, median over repeats of the slowest rank.

    Repeats go round-robin over the impls (after one warm-up call each), so a noisy phase of a
    shared machine hits every impl alike instead of skewing one row.
    """
    names = list(impls)
    times = torch.zeros(len(names), 2, repeats, dtype=torch.float64)
    peaks = torch.zeros(len(names), 2, dtype=torch.float64)
    for mode in (0, 1):  # 0: forward only, 1: forward + backward
        for name in names:
            _one_call(impls[name][mode], group)
        for r in range(repeats):
            for i, name in enumerate(names):
                times[i, mode, r], peak = _one_call(impls[name][mode], group)
                peaks[i, mode] = max(peaks[i, mode].item(), peak)
    stats = torch.cat([times.flatten(), peaks.flatten()])
    if group is not None:
        dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)  # per call: the slowest rank
    times, peaks = stats[:times.numel()].view_as(times), stats[times.numel():].view_as(peaks)
    rows = []
    for i, name in enumerate(names):
        fwd, fb = times[i, 0].tolist(), times[i, 1].tolist()
        rows.append(Row(seq, name, statistics.median(fwd), statistics.median(fb), peaks[i, 0].item(),
                        peaks[i, 1].item(), fwd, fb))
    return rows


# ---------------------------------------------------------------- inputs and implementations

def make_inputs(args, seq: int) -> tuple[torch.Tensor, ...]:
    """Full-sequence q, k, v, dout ``[B, S, H, D]``; the same on every rank (seeded)."""
    g = torch.Generator().manual_seed(1234 + seq)
    dt = DTYPES[args.dtype]
    b, h, hkv, d = args.batch, args.heads, args.kv_heads, args.head_dim
    shapes = ((b, seq, h, d), (b, seq, hkv, d), (b, seq, hkv, d), (b, seq, h, d))
    return tuple(torch.randn(s, generator=g).to(dt) for s in shapes)


def ours(q, k, v, dout, group, layout: str, kernel: str) -> tuple[Callable, Callable]:
    """Forward-only and forward+backward closures for cp_attention.ring_attention."""
    def fwd():
        with torch.no_grad():
            return ring_attention(q, k, v, group, layout=layout, causal=True, kernel=kernel)

    def fwdbwd():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]  # fresh leaves: no grad accumulation
        ring_attention(*leaves, group, layout=layout, causal=True, kernel=kernel).backward(dout)
        return leaves
    return fwd, fwdbwd


def torch_ring(q, k, v, dout, group) -> tuple[Callable, Callable]:
    """Closures for torch's _templated_ring_attention(+_backward) on bhsd shards (zigzag layout).

    torch's CP calls these two from its own op's forward and backward, outside autograd, so both run
    under no_grad here. Raises if the private API is gone.
    """
    from torch.distributed.tensor.experimental._context_parallel import _attention as ta

    ta._cp_options.enable_load_balance = True  # head-tail balancing == our zigzag layout
    fop = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    bop = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    q, k, v, dout = (t.transpose(1, 2).contiguous() for t in (q, k, v, dout))  # its native bhsd
    kw = dict(dropout_p=0.0, scale=q.shape[-1] ** -0.5)

    def fwd():
        with torch.no_grad():
            return ta._templated_ring_attention(group, 2, fop, q, k, v, is_causal=True, **kw)[:2]

    def fwdbwd():
        with torch.no_grad():
            out, lse = fwd()
            return ta._templated_ring_attention_backward(group, 2, bop, dout, "grad_out", q, k, v, out, lse,
                                                         True, **kw)[:3]
    return fwd, fwdbwd


def check_torch_ring(args, group, rank: int, ws: int) -> float:
    """Max abs difference (fp32, S=CHECK_SEQ) between torch's ring and ours: output and dq, dk, dv."""
    small = argparse.Namespace(**{**vars(args), "dtype": "float32"})
    lay = get_layout("zigzag")
    q, k, v, dout = (lay.shard(t, 1, rank, ws) for t in make_inputs(small, CHECK_SEQ))
    fwd, fwdbwd = ours(q, k, v, dout, group, "zigzag", args.kernel)
    tfwd, tfwdbwd = torch_ring(q, k, v, dout, group)
    mine = [fwd()] + [t.grad for t in fwdbwd()]
    theirs = [tfwd()[0]] + list(tfwdbwd())
    err = max((a - b.transpose(1, 2)).abs().max().item() for a, b in zip(mine, theirs))
    err_t = torch.tensor([err], dtype=torch.float64)
    dist.all_reduce(err_t, op=dist.ReduceOp.MAX, group=group)
    return err_t.item()


# ---------------------------------------------------------------- worker processes

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def baseline_worker(_: int, args, seq: int, out_path: str) -> None:
    """World size 1 (no process group): ring_attention runs the kernel on the full sequence."""
    torch.set_num_threads(args.world_size)  # the same total thread count as the ring
    q, k, v, dout = make_inputs(args, seq)
    rows = measure({"baseline": ours(q, k, v, dout, None, "contiguous", args.kernel)}, seq, args.repeats, None)
    with open(out_path, "wb") as f:
        pickle.dump({"rows": rows, "threads": torch.get_num_threads(), "memory": memory_method()}, f)


def ring_worker(rank: int, args, seq: int, port: int, out_path: str) -> None:
    """One rank of the ring: every layout, and torch's ring, at one S; 1 thread per rank."""
    torch.set_num_threads(1)
    ws = args.world_size
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ws,
                            timeout=datetime.timedelta(seconds=args.timeout))
    group = dist.group.WORLD  # torch's ring insists on a ProcessGroup object, not None
    meta = {"threads_per_rank": torch.get_num_threads(), "memory": memory_method()}
    torch_error = None if args.torch_ring else "disabled (--no-torch-ring)"
    if torch_error is None:
        try:  # fails alike on every rank if the private API moved, so no rank is left waiting
            meta["torch_ring_check_max_abs_err"] = err = check_torch_ring(args, group, rank, ws)
            if err > 1e-5:
                torch_error = f"disagrees with ours: max abs err {err:.2e} at S={CHECK_SEQ} fp32"
        except Exception as e:  # noqa: BLE001 -- report any failure of the private API as the row's reason
            torch_error = f"{type(e).__name__}: {e}".splitlines()[0][:200]
        failed = torch.tensor([float(torch_error is not None)])
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)  # all ranks must time the same impls
        if failed.item() and torch_error is None:
            torch_error = "failed on another rank"
        if torch_error is None:
            from torch.distributed.tensor.experimental._context_parallel import _attention as ta
            meta["torch_cp_options"] = repr(ta._cp_options)
    full = make_inputs(args, seq)
    shard = {lay: [get_layout(lay).shard(t, 1, rank, ws) for t in full] for lay in {*args.layouts, "zigzag"}}
    impls = {f"ring/{lay}": ours(*shard[lay], group, lay, args.kernel) for lay in args.layouts}
    if torch_error is None:
        impls["torch_ring/zigzag"] = torch_ring(*shard["zigzag"], group)
    rows = measure(impls, seq, args.repeats, group)
    if torch_error is not None:
        rows.append(Row(seq, "torch_ring/zigzag", error=torch_error))
    if rank == 0:
        with open(out_path, "wb") as f:
            pickle.dump({"rows": rows, **meta}, f)
    dist.barrier(group)
    dist.destroy_process_group()


def spawn(fn: Callable, nprocs: int, *args) -> dict:
    """Run ``fn`` in ``nprocs`` fresh processes; return what rank 0 pickled."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.pkl")
        mp.spawn(fn, args=(*args, path), nprocs=nprocs, join=True)
        with open(path, "rb") as f:
            return pickle.load(f)


# ---------------------------------------------------------------- report

def _fmt(x: Optional[float], spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(rows: list[Row]) -> None:
    """One line per (S, impl); ratios are against the baseline at the same S."""
    base = {r.seq: r for r in rows if r.impl == "baseline"}
    head = f"{'S':>6}  {'impl':<20}{'fwd ms':>10}{'fwd x':>8}{'fwd+bwd ms':>12}{'fwd+bwd x':>11}{'peak MiB':>10}"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        b = base.get(r.seq)
        if r.error:
            print(f"{r.seq:>6}  {r.impl:<20}n/a: {r.error}")
            continue
        fr = r.fwd_ms / b.fwd_ms if b and b.fwd_ms else None
        br = r.fwdbwd_ms / b.fwdbwd_ms if b and b.fwdbwd_ms else None
        print(f"{r.seq:>6}  {r.impl:<20}{_fmt(r.fwd_ms, '10.1f')}{_fmt(fr, '8.3f')}"
              f"{_fmt(r.fwdbwd_ms, '12.1f')}{_fmt(br, '11.3f')}{_fmt(r.fwdbwd_peak_mib, '10.1f')}")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384, 32768],
                   help="global sequence lengths S")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--kernel", default="auto", help="cp_attention kernel (torch's ring always uses the flash op)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per measurement, after 1 warm-up")
    p.add_argument("--no-torch-ring", dest="torch_ring", action="store_false", help="skip torch's ring row")
    p.add_argument("--quick", action="store_true", help="smoke test: S = 1024 2048")
    p.add_argument("--timeout", type=int, default=600, help="gloo timeout (s): a hang fails instead of waiting")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    args.kv_heads = args.kv_heads or args.heads
    if args.quick:
        args.seq_lens = [1024, 2048]
    return args


def main() -> None:
    args = parse_args()
    ws = args.world_size
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    print(f"torch {torch.__version__}, world size {ws}, gloo on 127.0.0.1, causal, dtype {args.dtype}, "
          f"kernel {args.kernel}, B={args.batch} H={args.heads} Hkv={args.kv_heads} D={args.head_dim}, "
          f"median of {args.repeats} (+1 warm-up)", flush=True)
    # glibc otherwise keeps freed blocks of up to 32 MiB mapped for reuse, so a call's RSS peak would
    # not show the memory it allocates; a fixed mmap threshold returns them at once (workers inherit it).
    for var in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        os.environ.setdefault(var, str(128 * 1024))
    t0 = time.perf_counter()
    rows = []
    for seq in args.seq_lens:  # baseline and ring back to back per S, so they see the same machine
        base = spawn(baseline_worker, 1, args, seq)
        ring = spawn(ring_worker, ws, args, seq, _free_port())
        rows += base["rows"] + ring["rows"]
        print(f"  S={seq} done after {time.perf_counter() - t0:.0f} s", flush=True)
    print(f"threads: baseline {base['threads']} (1 process), ring {ring['threads_per_rank']} per rank x {ws}")
    print(f"peak memory: {ring['memory']}; max over ranks, during fwd+bwd; "
          f"MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']}")
    if "torch_ring_check_max_abs_err" in ring:
        print(f"torch ring vs ours (zigzag, S={CHECK_SEQ}, fp32, out+grads): "
              f"max abs err {ring['torch_ring_check_max_abs_err']:.2e}; {ring.get('torch_cp_options', '')}")
    print()
    print_table(rows)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if args.json:
        meta = {"argv": sys.argv, "torch": torch.__version__, "args": vars(args),
                **{k: v for k, v in ring.items() if k != "rows"}, "baseline_threads": base["threads"]}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=2)


if __name__ == "__main__":
    main()
