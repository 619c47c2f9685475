"""Measurement machinery shared by the benchmark scripts: inputs, implementations, timing, peak
memory and worker processes over gloo.

Used by ``scripts/benchmark.py`` and ``scripts/compare_layouts.py``. Workers receive an ``args``
namespace with: world_size, layouts, batch, heads, kv_heads, head_dim, dtype, kernel, repeats,
torch_ring, timeout.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pickle
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # time this checkout, installed or not

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from cp_attention import get_layout, ring_attention  # noqa: E402
from cp_attention.training.ranks import free_port  # noqa: E402,F401 - re-exported to the scripts

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


def ours(q, k, v, dout, group, layout: str, kernel: str, causal: bool = True) -> tuple[Callable, Callable]:
    """Forward-only and forward+backward closures for cp_attention.ring_attention."""
    def fwd():
        with torch.no_grad():
            return ring_attention(q, k, v, group, layout=layout, causal=causal, kernel=kernel)

    def fwdbwd():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]  # fresh leaves: no grad accumulation
        ring_attention(*leaves, group, layout=layout, causal=causal, kernel=kernel).backward(dout)
        return leaves
    return fwd, fwdbwd


def torch_ring(q, k, v, dout, group, causal: bool = True) -> tuple[Callable, Callable]:
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
            return ta._templated_ring_attention(group, 2, fop, q, k, v, is_causal=causal, **kw)[:2]

    def fwdbwd():
        with torch.no_grad():
            out, lse = fwd()
            return ta._templated_ring_attention_backward(group, 2, bop, dout, "grad_out", q, k, v, out, lse,
                                                         causal, **kw)[:3]
    return fwd, fwdbwd


def check_seq(ws: int) -> int:
    """The length of the torch-ring check: CHECK_SEQ rounded down to what zigzag can split."""
    return max(2 * ws, CHECK_SEQ - CHECK_SEQ % (2 * ws))


def check_torch_ring(args, group, rank: int, ws: int) -> float:
    """Max abs difference (fp32, S=check_seq) between torch's ring and ours: output and dq, dk, dv."""
    small = argparse.Namespace(**{**vars(args), "dtype": "float32"})
    lay = get_layout("zigzag")
    q, k, v, dout = (lay.shard(t, 1, rank, ws) for t in make_inputs(small, check_seq(ws)))
    fwd, fwdbwd = ours(q, k, v, dout, group, "zigzag", args.kernel, args.causal)
    tfwd, tfwdbwd = torch_ring(q, k, v, dout, group, args.causal)
    mine = [fwd()] + [t.grad for t in fwdbwd()]
    theirs = [tfwd()[0]] + list(tfwdbwd())
    err = max((a - b.transpose(1, 2)).abs().max().item() for a, b in zip(mine, theirs))
    err_t = torch.tensor([err], dtype=torch.float64)
    dist.all_reduce(err_t, op=dist.ReduceOp.MAX, group=group)
    return err_t.item()


# ---------------------------------------------------------------- worker processes

def baseline_worker(_: int, args, seq: int, out_path: str) -> None:
    """World size 1 (no process group): ring_attention runs the kernel on the full sequence."""
    torch.set_num_threads(args.world_size)  # the same total thread count as the ring
    q, k, v, dout = make_inputs(args, seq)
    base = ours(q, k, v, dout, None, "contiguous", args.kernel, args.causal)
    rows = measure({"baseline": base}, seq, args.repeats, None)
    with open(out_path, "wb") as f:
        pickle.dump({"rows": rows, "threads": torch.get_num_threads(), "memory": memory_method()}, f)


def ring_worker(rank: int, args, seq: int, port: int, extra: Optional[Callable], out_path: str) -> None:
    """One rank of the ring: every layout, and torch's ring, at one S; 1 thread per rank.

    ``extra(args, group, rank, world_size, seq) -> dict``, a module-level function (it is pickled),
    runs on every rank after the timings; rank 0's dict joins the result.
    """
    torch.set_num_threads(1)
    ws = args.world_size
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ws,
                            timeout=datetime.timedelta(seconds=args.timeout))
    group = dist.group.WORLD  # torch's ring insists on a ProcessGroup object, not None
    meta = {"threads_per_rank": torch.get_num_threads(), "memory": memory_method()}
    torch_error = None if args.torch_ring else "disabled"
    if torch_error is None and seq % get_layout("zigzag").divisor(ws):
        torch_error = f"zigzag (head-tail) cannot split S={seq} over {ws} ranks"
    if torch_error is None:
        try:  # fails alike on every rank if the private API moved, so no rank is left waiting
            meta["torch_ring_check_max_abs_err"] = err = check_torch_ring(args, group, rank, ws)
            if err > 1e-5:
                torch_error = f"disagrees with ours: max abs err {err:.2e} at S={check_seq(ws)} fp32"
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
    needed = {*args.layouts, *(() if torch_error else ("zigzag",))}
    shard = {lay: [get_layout(lay).shard(t, 1, rank, ws) for t in full] for lay in needed}
    impls = {f"ring/{lay}": ours(*shard[lay], group, lay, args.kernel, args.causal) for lay in args.layouts}
    if torch_error is None:
        impls["torch_ring/zigzag"] = torch_ring(*shard["zigzag"], group, args.causal)
    rows = measure(impls, seq, args.repeats, group)
    if torch_error is not None:
        rows.append(Row(seq, "torch_ring/zigzag", error=torch_error))
    if extra is not None:
        meta.update(extra(args, group, rank, ws, seq))
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




def limit_malloc_caching() -> None:
    """Make freed memory go back to the OS at once, so a call's RSS peak shows what it allocates.

    glibc otherwise keeps freed blocks of up to 32 MiB mapped for reuse. Call before spawning:
    workers inherit the environment.
    """
    for var in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        os.environ.setdefault(var, str(128 * 1024))
