"""The attention benchmark: causal ring attention (forward, forward+backward) on CPU gloo against
full attention, with PyTorch's own ring as a peer row.

Rows per sequence length S:
  baseline           one process, full sequence, the same kernel, ``world_size`` threads
  ring/<layout>      cp_attention.ring_attention over ``world_size`` processes, 1 thread each
  torch_ring/zigzag  PyTorch's private templated ring (head-tail load balancing) on the same CPU flash op

Workers receive an ``args`` namespace with: world_size, layouts, batch, heads, kv_heads, head_dim,
dtype, kernel, repeats, torch_ring, timeout, causal. ``layouts`` holds names or Layout objects: a
user-defined layout reaches the spawned workers by pickle, which imports the module that registers it.

GPU (``--device cuda``, see benchmarks/gpu.py): Llama-3-8B attention shapes
(32/8 heads, head_dim 128, bf16), 8K tokens per rank, N in {2, 4, 8, 16}: each CUDA kernel's TFLOP/s
against F.scaled_dot_product_attention, each layout's schedule efficiency (ideal / busiest rank), and
the peak memory per rank.

Usage (from the repo root):  python benchmarks/attention.py [--quick] [--seq-lens 8192 16384] [--json out.json]
                             python benchmarks/attention.py --device cuda [--world-sizes 2 4 8 16]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script: `benchmarks` imports from the repository root, and this folder's
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # files never shadow top-level packages

import argparse
import json
from dataclasses import asdict
from typing import Callable

import torch
import torch.distributed as dist

from benchmarks import args as flags
from benchmarks import gpu
from benchmarks.measure import Row, make_inputs, measure, memory_method, ours, print_bytes, sent_bytes, sweep
from cp_attention import LAYOUT_NAMES
from cp_attention.kernels.dtypes import dtype_from_name
from cp_attention.launch import spawn
from cp_attention.layouts import get_layout

__all__ = ["make_inputs", "ours", "torch_ring", "baseline_worker", "ring_worker", "measure_seq", "run"]

CHECK_SEQ = 1024  # the torch-ring correctness check runs once, at this small length


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

def baseline_worker(args, seq: int) -> dict:
    """World size 1: ring_attention runs the kernel on the full sequence (spawn it with
    ``threads=args.world_size``, the ring's total thread count)."""
    q, k, v, dout = make_inputs(args, seq)
    base = ours(q, k, v, dout, None, "contiguous", args.kernel, args.causal)
    rows = measure({"baseline": base}, seq, args.repeats, None)
    return {"rows": rows, "threads": torch.get_num_threads(), "memory": memory_method()}


def ring_worker(args, seq: int, extra: Callable | None = None) -> dict:
    """One rank of the ring (spawn it with 1 thread per rank): every layout, and torch's ring, at one S.

    ``extra(args, group, rank, world_size, seq) -> dict``, a module-level function (it is pickled),
    runs on every rank after the timings; rank 0's dict joins the result, which every rank returns.
    """
    rank, ws = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD  # torch's ring insists on a ProcessGroup object, not None
    meta = {"threads": torch.get_num_threads(), "memory": memory_method()}
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
    timed = [get_layout(x) for x in args.layouts]
    needed = {lay.name: lay for lay in [*timed, *(() if torch_error else (get_layout("zigzag"),))]}
    shard = {name: [lay.shard(t, 1, rank, ws) for t in full] for name, lay in needed.items()}
    from cp_attention.transport.process_group import transport_for

    transport = transport_for(group)  # one transport for our rings, so its sent_bytes counts them
    mine = {f"ring/{lay.name}": ours(*shard[lay.name], transport, lay, args.kernel, args.causal) for lay in timed}
    impls = dict(mine)
    if torch_error is None:
        impls["torch_ring/zigzag"] = torch_ring(*shard["zigzag"], group, args.causal)
    rows = measure(impls, seq, args.repeats, group)
    meta["bytes"] = sent_bytes(mine, {name: transport for name in mine}, group)
    if torch_error is not None:
        rows.append(Row(seq, "torch_ring/zigzag", error=torch_error))
    if extra is not None:
        meta.update(extra(args, group, rank, ws, seq))
    return {"rows": rows, **meta}


def measure_seq(args, seq: int, extra: Callable | None = None) -> tuple[dict, dict]:
    """The baseline and every ring at one S, back to back so they see the same machine.

    Returns what :func:`baseline_worker` and rank 0's :func:`ring_worker` return.
    """
    base = spawn(baseline_worker, 1, args, seq, threads=args.world_size)
    ring = spawn(ring_worker, args.world_size, args, seq, extra, threads=1, timeout_s=args.timeout)
    return base, ring


def model_bytes(args, seq: int) -> dict[str, tuple[float, float]]:
    """Per ring impl, the model's K/V + dK/dV bytes of one forward+backward call at ``seq`` (all ranks):
    needs-only (what the engine sends) and whole shards."""
    from benchmarks.modelled import AttentionShape
    from benchmarks.modelled import model_bytes as bytes_of

    shape = AttentionShape(args.batch, args.heads, args.kv_heads, args.head_dim,
                           elem_bytes=dtype_from_name(args.dtype).itemsize)
    return {f"ring/{get_layout(x).name}": bytes_of(x, seq, args.world_size, shape, causal=args.causal)
            for x in args.layouts}


def run(args: argparse.Namespace) -> list[Row]:
    """The whole benchmark for parsed command-line ``args``: prints the table, writes ``args.json``
    if set, and returns the rows."""
    header = (f"torch {torch.__version__}, world size {args.world_size}, gloo on 127.0.0.1, causal, dtype "
              f"{args.dtype}, kernel {args.kernel}, B={args.batch} H={args.heads} Hkv={args.kv_heads} "
              f"D={args.head_dim}, median of {args.repeats} (+1 warm-up)")

    def notes(ring: dict) -> list[str]:
        if "torch_ring_check_max_abs_err" not in ring:
            return []
        return [f"torch ring vs ours (zigzag, S={check_seq(args.world_size)}, fp32, out+grads): "
                f"max abs err {ring['torch_ring_check_max_abs_err']:.2e}; {ring.get('torch_cp_options', '')}"]

    rows, base, ring = sweep(header, args.seq_lens, lambda seq: measure_seq(args, seq), "ring", args.world_size,
                             notes)
    if ring.get("bytes"):
        print(f"(at S={args.seq_lens[-1]})")
        print_bytes(ring["bytes"], model_bytes(args, args.seq_lens[-1]))
    if args.json:
        meta = {"argv": sys.argv, "torch": torch.__version__, "args": vars(args),
                **{k: v for k, v in ring.items() if k != "rows"}, "baseline_threads": base["threads"]}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=2)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # --kernel: ours; torch's ring always runs the flash op
    flags.add_ring(p, seq_lens=[4096, 8192, 16384, 32768], world_size=2, layouts=LAYOUT_NAMES, kernel="auto")
    flags.add_shape(p, batch=1)
    gpu.add_arguments(p)
    flags.add_run(p, repeats=3, timeout=600, quick="smoke test: S = 1024 2048", json="the results")
    p.add_argument("--no-torch-ring", dest="torch_ring", action="store_false", help="skip torch's ring row")
    args = p.parse_args(argv)
    gpu.resolve_defaults(args)
    flags.resolve_kv_heads(args)
    args.causal = True
    if args.quick:
        args.seq_lens = [1024, 2048]
    return args


if __name__ == "__main__":
    from benchmarks.measure import finish

    parsed = parse_args()
    finish(gpu.run if parsed.device == "cuda" else run, parsed)
