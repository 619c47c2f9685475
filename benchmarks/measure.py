"""Measurement machinery shared by the benchmarks and the studies: result rows, peak memory, the
clocks (every timing of ``benchmarks/`` and ``studies/`` reads one of them: :class:`Stopwatch`,
:func:`call_ms`, :func:`call_times_ms`, :func:`elapsed_ms`, :func:`wall_and_cpu_ms`, :func:`time_cuda`),
and median timings of the slowest rank.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from cp_attention import ring_attention
from cp_attention.kernels.dtypes import dtype_from_name
from cp_attention.layouts import Layout

__all__ = ["Row", "memory_method", "rss_peak_delta", "Stopwatch", "call_ms", "call_times_ms", "elapsed_ms",
           "wall_and_cpu_ms", "time_cuda", "measure", "limit_malloc_caching", "print_table", "sweep", "sent_bytes",
           "print_bytes", "command_text", "script_name", "make_inputs", "ours"]

_REPOSITORY = Path(__file__).resolve().parents[1]


@dataclass
class Row:
    """One table row: an implementation at one global sequence length S."""

    seq: int
    impl: str
    fwd_ms: float | None = None
    fwdbwd_ms: float | None = None
    fwd_peak_mib: float | None = None
    fwdbwd_peak_mib: float | None = None
    fwd_runs_ms: list | None = None  # every timed repeat (max over ranks), to judge the noise
    fwdbwd_runs_ms: list | None = None
    error: str | None = None


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
    """How peak memory is measured on this machine, for the report."""
    return "VmHWM after clear_refs, minus RSS before the call" if _reset_peak() else \
        "clear_refs not writable: process-lifetime VmHWM minus RSS before the call (an upper bound)"


def rss_peak_delta(fn: Callable[[], object]) -> int | None:
    """Peak RSS during ``fn()`` above the RSS just before it, in bytes (VmHWM after ``clear_refs``); ``None``
    where ``/proc/self/clear_refs`` is not writable. Set ``MALLOC_MMAP_THRESHOLD_`` low before the process
    starts (:func:`limit_malloc_caching`), so freed blocks go back to the OS at once."""
    if not _reset_peak():
        fn()
        return None
    rss0 = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - rss0) * 1024


# ---------------------------------------------------------------- clocks

class Stopwatch:
    """Seconds since it was made: a run's progress lines and its total. Picklable: a spawned rank it is
    passed to counts from the same start (``time.perf_counter`` is the machine's monotonic clock)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def seconds(self) -> float:
        return time.perf_counter() - self.start


def elapsed_ms(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()``'s result and the wall milliseconds it took."""
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e3


def wall_and_cpu_ms(fn: Callable[[], object]) -> tuple[float, float]:
    """Wall and this process's CPU milliseconds of ``fn()`` (on a shared machine the wall time carries
    other processes' load; the CPU time does not)."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3


def call_ms(fn: Callable[[], object], group=None) -> float:
    """Wall milliseconds of one call of ``fn``; with a process ``group``, its ranks start it together
    (a barrier), so the slowest rank's time is the step's time."""
    if group is not None:
        dist.barrier(group)
    return elapsed_ms(fn)[1]


def call_times_ms(fn: Callable[[], object], repeats: int, warmup: int = 1, group=None) -> list[float]:
    """The milliseconds of each of ``repeats`` calls of ``fn`` (:func:`call_ms`), after ``warmup`` untimed
    ones."""
    for _ in range(warmup):
        call_ms(fn, group)
    return [call_ms(fn, group) for _ in range(repeats)]


def time_cuda(fn: Callable[[], object], repeats: int) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` calls after one warm-up, timed with CUDA events."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


# ---------------------------------------------------------------- timing

def _one_call(fn: Callable[[], object], group) -> tuple[float, float]:
    """Wall time (ms) of one call and its peak RSS above the RSS just before it (MiB)."""
    _reset_peak()
    rss0 = _status_kib("VmRSS")
    ms = call_ms(fn, group)
    return ms, (_status_kib("VmHWM") - rss0) / 1024


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


_MALLOC_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_MAX_")


def limit_malloc_caching() -> None:
    """Make freed memory go back to the OS at once, so a call's RSS peak shows what it allocates.

    glibc otherwise keeps freed blocks of up to 32 MiB mapped for reuse. Call before spawning:
    workers inherit the environment.
    """
    for var in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        os.environ.setdefault(var, str(128 * 1024))


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(rows: list[Row]) -> None:
    """Print one line per (S, impl), with time ratios against the row named ``baseline`` at the same S."""
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


def command_text(argv: Sequence[str] | None = None) -> str:
    """The command that produced a record, as anyone can run it from a checkout: ``python`` for the
    interpreter, a package's ``__main__.py`` as ``-m package`` (how ``python -m studies.memory`` was started),
    paths inside the repository relative to its root, paths outside it (a ``--json`` file in /tmp, say) by
    their file name; the recording machine's own paths would mean nothing elsewhere."""

    def portable(arg: str) -> str:
        key, eq, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
        if not os.path.isabs(value):
            return arg
        path = Path(value).resolve()
        shown = str(path.relative_to(_REPOSITORY)) if path.is_relative_to(_REPOSITORY) else path.name
        return f"{key}{eq}{shown}"

    words = [portable(a) for a in (sys.argv if argv is None else argv)]
    if words and words[0].endswith("/__main__.py") and not os.path.isabs(words[0]):
        words[0:1] = ["-m", words[0][:-len("/__main__.py")].replace("/", ".")]
    return " ".join(["python", *words])


def sweep(header: str, seq_lens: Sequence[int], measure_one: Callable[[int], tuple[dict, dict]], label: str,
          world_size: int, notes: Callable[[dict], list[str]] = lambda parallel: []
          ) -> tuple[list[Row], dict, dict]:
    """Run a benchmark over ``seq_lens`` and print its report: the command, ``header``, one table row
    per (S, impl) with ratios against the baseline, and the total time.

    ``measure_one(seq)`` measures the baseline and the parallel run at one S, back to back so they see
    the same machine, and returns their results: dicts with ``rows``, ``threads`` and ``memory``.
    ``notes(parallel)`` adds lines under the setup. Returns all rows and the last S's two results.
    """
    print(f"command: {command_text()}")
    print(header, flush=True)
    limit_malloc_caching()
    clock = Stopwatch()
    rows: list[Row] = []
    for seq in seq_lens:
        base, parallel = measure_one(seq)
        rows += base["rows"] + parallel["rows"]
        print(f"  S={seq} done after {clock.seconds():.0f} s", flush=True)
    print(f"threads: baseline {base['threads']} (1 process), {label} {parallel['threads']} per rank x {world_size}")
    print(f"peak memory: {parallel['memory']}; max over ranks, during fwd+bwd; "
          + " ".join(f"{var}={os.environ[var]}" for var in _MALLOC_VARS if var in os.environ))
    for line in notes(parallel):
        print(line)
    print()
    print_table(rows)
    print(f"\ntotal {clock.seconds():.0f} s")
    return rows, base, parallel


def script_name(argv0: str | None = None) -> str:
    """The running command's name for its summary: the script's file name, or for a package run with
    ``python -m`` (its ``__main__.py``) the package (``studies.memory``)."""
    path = Path(sys.argv[0] if argv0 is None else argv0).resolve()
    if path.name != "__main__.py":
        return path.name
    package = path.parent
    return ".".join(package.relative_to(_REPOSITORY).parts) if package.is_relative_to(_REPOSITORY) else package.name


def finish(run: Callable[[argparse.Namespace], object], args: argparse.Namespace, json_option: bool = True) -> None:
    """The end of a benchmark's command line: ``run(args)``, then its summary (named by :func:`script_name`):
    the JSON file it wrote (``--json``), or that its tables went to stdout only (and, with ``json_option``,
    that ``--json PATH`` keeps them)."""
    from cp_attention.training.summary import outputs_summary  # the train extra; only the command line needs it

    run(args)
    print(outputs_summary(script_name(), {"results (JSON)": args.json if json_option else None},
                          "--json PATH also writes them as JSON" if json_option else ""), flush=True)


def command_line(doc: str, add_arguments: Callable[[argparse.ArgumentParser], None],
                 run: Callable[[argparse.Namespace], object], json_option: bool = True) -> None:
    """A benchmark's whole command line: its arguments (``add_arguments``, ``doc`` as the help), then
    :func:`finish`."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    finish(run, p.parse_args(), json_option)


# ---------------------------------------------------------------- traffic

def _counted(transport) -> int | None:
    """``transport.sent_bytes`` plus its levels' (a 2-D mesh's dims count their own exchanges); None if the
    transport has no counter."""
    own = getattr(transport, "sent_bytes", None)
    if own is None:
        return None
    return own + sum(getattr(t, "sent_bytes", 0) for t in (getattr(transport, "levels", None) or ()))


def sent_bytes(impls: dict[str, tuple[Callable, Callable]], transports: dict[str, object], group
               ) -> dict[str, int | None]:
    """Bytes all ranks sent in one forward+backward call of each impl, measured from the counter of the
    transport it runs on (``transports[name]``: its ``sent_bytes`` after minus before, levels included),
    summed over the ranks of ``group`` (None: this process alone). An impl without a transport in
    ``transports``, or one without a counter, gets None."""
    out: dict[str, int | None] = {}
    for name, (_, fwdbwd) in impls.items():
        transport = transports.get(name)
        before = None if transport is None else _counted(transport)
        fwdbwd()
        out[name] = None if before is None else _counted(transport) - before
    known = [n for n, b in out.items() if b is not None]
    if group is not None and known:
        total = torch.tensor([out[n] for n in known], dtype=torch.float64)
        dist.all_reduce(total, group=group)
        out.update({n: int(b) for n, b in zip(known, total.tolist())})
    return out


def print_bytes(measured: dict[str, int | None], model: dict[str, tuple[float | None, float | None]]) -> None:
    """The bytes table: per impl, what its transports sent in one forward+backward call (all ranks,
    :func:`sent_bytes`) next to the model's needs-only figure and whole shards'."""
    print("\nK/V + dK/dV bytes per forward+backward call, all ranks (measured: transport.sent_bytes after minus "
          "before; model: needs-only / whole shards):")
    head = f"{'impl':<24}{'measured MB':>13}{'model MB':>10}{'whole MB':>10}{'measured / model':>18}"
    print(head + "\n" + "-" * len(head))
    for name, got in measured.items():
        want, whole = model.get(name, (None, None))
        ratio = got / want if got is not None and want else None
        mb = lambda x: _fmt(None if x is None else x / 1e6, ".2f")  # noqa: E731
        print(f"{name:<24}{mb(got):>13}{mb(want):>10}{mb(whole):>10}{_fmt(ratio, '.3f'):>18}")
    if any(b is None for b in measured.values()):
        print("(-: the transport has no sent_bytes counter)")


def make_inputs(args, seq: int) -> tuple[torch.Tensor, ...]:
    """Full-sequence q, k, v, dout ``[B, S, H, D]``; the same on every rank (seeded)."""
    g = torch.Generator().manual_seed(1234 + seq)
    dt = dtype_from_name(args.dtype)
    b, h, hkv, d = args.batch, args.heads, args.kv_heads, args.head_dim
    shapes = ((b, seq, h, d), (b, seq, hkv, d), (b, seq, hkv, d), (b, seq, h, d))
    return tuple(torch.randn(s, generator=g).to(dt) for s in shapes)


def ours(q, k, v, dout, group, layout: str | Layout, kernel: str, causal: bool = True, cu_seqlens=None,
         window_size: tuple[int, int] = (-1, -1)) -> tuple[Callable, Callable]:
    """Forward-only and forward+backward closures for cp_attention.ring_attention (packed documents
    with ``cu_seqlens``, a sliding window with ``window_size``)."""
    kw = dict(layout=layout, causal=causal, kernel=kernel, window_size=window_size,
              cu_seqlens=None if cu_seqlens is None else torch.as_tensor(cu_seqlens))

    def fwd():
        with torch.no_grad():
            return ring_attention(q, k, v, group, **kw)

    def fwdbwd():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]  # fresh leaves: no grad accumulation
        ring_attention(*leaves, group, **kw).backward(dout)
        return leaves
    return fwd, fwdbwd
