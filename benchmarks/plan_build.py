"""Host time to build one rank's packed plan from scratch: its ring steps' document blocks, their
lowering to kernel tasks, and the index tensors the tasks run with.

Each build is timed on a fresh plan of rank ``r`` of ``N`` (a seat: no process group, no
communication) with a fresh copy of the boundaries, so nothing of an earlier build is reused:
``plan.steps(n, kernel, "cpu", D, Dv)`` and the needs-only rows (``plan.needs_index``), the work of a
batch's first attention call. The phases are
timed apart by running the same three calls ``_build_steps`` makes, one after another: ``blocks``
(``block_schedules`` for this rank: the layout's positions and each step's blocks), ``lowering``
(``lower_steps``) and ``index`` (the batches' index tensors: ``DocBatch``/``VarlenBatch``).

Lowering modes: ``batched`` (a kernel that takes masks: small blocks as padded batches, CPU math or
flash), ``varlen`` (a kernel that takes variable-length batches, as CUDA flash: one call per mask
kind and step; a stand-in kernel with ``supports_varlen``, index tensors on the CPU).

Document lengths: ``lognormal`` (``--documents`` lognormal lengths, sigma ``--sigma``, scaled to T),
``uniform`` (``--documents - 1`` cuts drawn uniformly: many short documents).

Printed: the median of ``--repeats`` builds per phase and for the whole build, the whole build's
fastest, and the median of the CPU time the build process used (on a shared machine the wall time
carries other processes' load; the CPU time does not). ``--threads 1``: as in a data loader's worker.
``ahead``: what is left on the step's critical path when the plan was built ahead of it
(``cp_attention.plan_ahead`` in a worker, then ``plan.bind(group, device)``): bind's own work, median
of 3, with the agreement answered at once (a real group adds one small all-gather, and on a GPU the
index tensors' non-blocking uploads); batched mode only, as no CPU kernel takes variable-length batches.

Usage (from the repo root):
  python benchmarks/plan_build.py [--tokens 65536] [--world-size 8] [--documents 1000 8000]
      [--layouts zigzag contiguous interleaved balanced] [--modes batched varlen]
      [--lengths lognormal uniform] [--repeats 7] [--rank 0] [--threads 1]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script: `benchmarks` imports from the repository root, and this folder's
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # files never shadow top-level packages

import argparse
import json
import random
import statistics
from typing import Callable

import torch

from benchmarks import args as flags
from benchmarks.measure import elapsed_ms, wall_and_cpu_ms
from benchmarks.packed import document_lengths
from cp_attention.engine import plan as plan_mod
from cp_attention.engine.plan import AttentionPlan, plan_ahead
from cp_attention.kernels import get_kernel
from cp_attention.layouts.documents import cu_seqlens_from_lengths
from cp_attention.layouts.registry import get_layout
from cp_attention.schedules.derived import block_schedules
from cp_attention.schedules.lowering import lower_steps
from cp_attention.strategies.dispatch import _Seat

__all__ = ["add_arguments", "boundaries", "build_phases", "run"]

_CPU = torch.device("cpu")
_HEAD_DIM = 64


class _VarlenKernel:
    """Stands in for a kernel that takes variable-length batches (CUDA flash): what a plan asks of it."""

    supports_varlen = True
    supports_mask = False

    @staticmethod
    def supports_shape(head_dim: int, v_head_dim: int) -> bool:
        return True


def add_arguments(p: argparse.ArgumentParser) -> None:
    flags.add_documents(p, tokens=65536, documents=[1000, 8000], sigma=1.5, seed=0)
    flags.add_ring(p, world_size=8, layouts=["zigzag", "contiguous", "interleaved", "balanced"])
    p.add_argument("--rank", type=int, default=0, help="the rank whose plan is built")
    p.add_argument("--modes", nargs="+", default=["batched", "varlen"], choices=["batched", "varlen"])
    p.add_argument("--lengths", nargs="+", default=["lognormal", "uniform"], choices=["lognormal", "uniform"])
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    flags.add_run(p, repeats=7, json="the rows")  # repeats: timed builds per row (their median)


def boundaries(kind: str, tokens: int, documents: int, sigma: float, seed: int) -> tuple[int, ...]:
    """``cu_seqlens`` of ``documents`` documents over ``tokens``: lognormal lengths or uniform cuts."""
    if kind == "lognormal":
        return cu_seqlens_from_lengths(document_lengths(tokens, documents, sigma, seed))
    cuts = sorted(random.Random(seed).sample(range(1, tokens), documents - 1))
    return (0, *cuts, tokens)


def _kernel(mode: str):
    return _VarlenKernel() if mode == "varlen" else get_kernel("math", _CPU, torch.float32)


def _forget_batches() -> None:
    """Drop what a layout caches per batch (balanced's placement, by value), so each build solves it."""
    try:
        from cp_attention.layouts import balanced
    except ImportError:
        return
    placement = getattr(balanced, "_placement", None)
    if hasattr(placement, "cache_clear"):
        placement.cache_clear()


def _fresh_plan(layout: str, cu: tuple[int, ...], rank: int, world_size: int) -> AttentionPlan:
    # A copy of the boundaries: nothing cached on the tuple's identity survives from an earlier build.
    _forget_batches()
    return AttentionPlan(layout, _Seat(rank, world_size), True, tuple(list(cu)), agreed=True)


def build_phases(layout: str, cu: tuple[int, ...], rank: int, world_size: int, mode: str) -> dict[str, float]:
    """One build from scratch, phase by phase as ``AttentionPlan._build_steps`` runs them (ms)."""
    plan = _fresh_plan(layout, cu, rank, world_size)
    n = cu[-1] // world_size
    window = plan.window(n)
    blocks, blocks_ms = elapsed_ms(lambda: block_schedules(plan.layout, True, world_size, cu[-1], plan.cu_seqlens,
                                                           window, rank=rank))
    lowered, lowering_ms = elapsed_ms(lambda: lower_steps(blocks, batched=mode == "batched", tiled=window is None,
                                                          local_len=n, varlen=mode == "varlen"))
    steps, index_ms = elapsed_ms(lambda: tuple(tuple(plan_mod._ready(t, _CPU) for t in step) for step in lowered))
    assert len(steps) == world_size
    return {"blocks": blocks_ms, "lowering": lowering_ms, "index": index_ms}


def _whole_ms(layout: str, cu: tuple[int, ...], rank: int, world_size: int, mode: str) -> tuple[float, float]:
    """(wall, this process's CPU) ms of one whole build."""
    plan = _fresh_plan(layout, cu, rank, world_size)
    kernel = _kernel(mode)
    n = cu[-1] // world_size

    def build() -> None:
        steps = plan.steps(n, kernel, _CPU, _HEAD_DIM, _HEAD_DIM)
        plan.needs_index(n, _CPU, len(steps))  # the needs-only rows are part of the plan too

    return wall_and_cpu_ms(build)


class _Agreed:
    """A group whose agreement answers at once with this rank's own row on every rank (what a group
    that agrees returns), so ``bind``'s own work is timed without other ranks' arrival."""

    host_agreement, token, sent_bytes = False, None, 0

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def all_gather_ints(self, values) -> list:
        return [list(values)] * self.world_size

    def exchange(self, send, recv, hop: int = 1):
        raise NotImplementedError("bind only agrees")


def _bound_ms(layout: str, cu: tuple[int, ...], rank: int, world_size: int, mode: str) -> float:
    """What stays on the step's critical path when the plan was built ahead (``cp_attention.plan_ahead``,
    as a loader worker would): ``bind``'s own work, the agreement answered at once (a real group adds
    one small all-gather); batched mode only (no CPU kernel takes variable-length batches)."""
    if mode != "batched":
        return float("nan")
    ahead = plan_ahead(layout, rank, world_size, True, tuple(list(cu)), local_len=cu[-1] // world_size,
                       kernel="math", device="cpu", dtype=torch.float32, head_dim=_HEAD_DIM)
    return elapsed_ms(lambda: ahead.bind(_Agreed(rank, world_size), "cpu"))[1]


def _median(fn: Callable[[], object], repeats: int) -> list:
    fn()  # warm: imports, allocator, lazily built tables
    return [fn() for _ in range(repeats)]


def run(args: argparse.Namespace) -> list[dict]:
    """Measure and print one row per (lengths, documents, layout, mode); returns the rows."""
    if args.threads:
        torch.set_num_threads(args.threads)
    layouts = []
    for name in args.layouts:
        try:
            get_layout(name)
            layouts.append(name)
        except ValueError:
            print(f"layout {name!r} is not registered here: skipped")
    n = args.world_size
    print(f"one rank's packed plan built from scratch: T={args.tokens}, N={n}, rank {args.rank}, "
          f"{torch.get_num_threads()} torch threads, median of {args.repeats} builds (ms)")
    print(f"{'lengths':>9} {'docs':>5} {'layout':>11} {'mode':>7} | {'whole':>7} {'(min)':>7} {'cpu':>7} | "
          f"{'blocks':>7} {'lowering':>8} {'index':>7} | {'ahead':>6}")
    rows = []
    for kind in args.lengths:
        for docs in args.documents:
            cu = boundaries(kind, args.tokens, docs, args.sigma, args.seed)
            for layout in layouts:
                for mode in args.modes:
                    # _median calls each closure right away, within this iteration (hence the B023 noqa)
                    whole = _median(lambda: _whole_ms(layout, cu, args.rank, n, mode), args.repeats)  # noqa: B023
                    phases = _median(lambda: build_phases(layout, cu, args.rank, n, mode), args.repeats)  # noqa: B023
                    bound = _median(lambda: _bound_ms(layout, cu, args.rank, n, mode), 3)  # noqa: B023
                    row = {"lengths": kind, "documents": docs, "layout": layout, "mode": mode, "world_size": n,
                           "tokens": args.tokens, "whole_ms": statistics.median(w for w, _ in whole),
                           "whole_min_ms": min(w for w, _ in whole),
                           "whole_cpu_ms": statistics.median(c for _, c in whole),
                           **{f"{k}_ms": statistics.median(p[k] for p in phases) for k in phases[0]},
                           "bound_ms": statistics.median(bound)}
                    rows.append(row)
                    print(f"{kind:>9} {docs:>5} {layout:>11} {mode:>7} | {row['whole_ms']:>7.1f} "
                          f"{row['whole_min_ms']:>7.1f} {row['whole_cpu_ms']:>7.1f} | "
                          f"{row['blocks_ms']:>7.1f} {row['lowering_ms']:>8.1f} {row['index_ms']:>7.1f} | "
                          f"{row['bound_ms']:>6.2f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    from benchmarks.measure import command_line

    command_line(__doc__, add_arguments, run, json_option=False)
