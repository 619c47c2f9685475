"""Per-rank memory of FSDP2 x context parallelism on a HuggingFace Llama.

For each ``dp x cp`` configuration (``cphf.parallelize`` over a ``(dp, cp)`` mesh; 1x1 is the plain
model in one process) one training step of a random-weight fp32 Llama with AdamW is measured on every
rank, and the maximum over ranks is reported:

  model states   bytes this rank holds of the parameters, their gradients (right after backward) and
                 AdamW's state (after its step): ``to_local()`` of DTensors, plain tensors as they are.
  activations    bytes of the tensors saved for backward during the forward and the loss, counted by
                 ``torch.autograd.graph.saved_tensors_hooks``: each storage once, at its full size,
                 parameters and FSDP's unsharded parameters (a storage shared with a parameter) left
                 out. Nothing saved is freed before backward, so the sum is the forward's peak. With
                 activation checkpointing, each decoder layer's input (kept for the recompute) counts
                 too. Not counted: transient buffers (FSDP's all-gathered layer, communication buffers,
                 the logits before the loss reads them) and the allocator's overhead.
  tokens/s       global tokens per step (dp x S) over the slowest rank's step time, median of the
                 timed steps (after two measured steps).
  longest seq    the longest global sequence (a multiple of the layout's divisor) whose model states
                 plus activations fit ``--cap-mib``, from a line a + b * local_tokens fitted to the
                 activations at S and S/2, then verified by one step at that length.

Usage (from the repo root):
  python benchmarks/memory.py [--configs 1x1 2x1 1x2 2x2 1x4] [--seq-len 1024] [--cap-mib MIB]
                                     [--activation-checkpointing] [--quick] [--json out.json]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script: `benchmarks` imports from the repository root, and this folder's
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # files never shadow top-level packages

import argparse
import contextlib
import gc
import json
import os
import statistics
import time
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from cp_attention.launch import run_on_ranks

__all__ = ["add_arguments", "build_model", "SavedActivations", "model_state_bytes", "longest_seq", "measure_config",
           "worker", "run"]

MIB = 1024 * 1024
# The quick smoke run: a tiny model and sequence (finishes in well under a minute on 2 cores).
QUICK = {"hidden": 64, "layers": 2, "vocab": 512, "intermediate": 176, "heads": 4, "kv_heads": 2, "seq_len": 256,
         "steps": 1}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--configs", nargs="+", default=["1x1 2x1 1x2 2x2 1x4"],
                   help="dp x cp shapes, e.g. 1x1 2x2 (1x1, the baseline, is always measured)")
    p.add_argument("--seq-len", type=int, default=1024, help="global sequence length S per dp rank")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1408)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=2, help="timed steps per configuration (after two measured ones)")
    p.add_argument("--layout", default="zigzag")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--cap-mib", type=float, default=None,
                   help="per-rank memory cap; default: 1x1's model states + its activations at 3S/4")
    p.add_argument("--quick", action="store_true", help="tiny model and sequence: a smoke test")
    p.add_argument("--json", default=None, help="write every row (and the setup) to this file")


def build_model(args: argparse.Namespace, max_len: int) -> torch.nn.Module:
    """The benchmark's Llama: random weights, seeded alike on every rank, fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=max_len, use_cache=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float().train()


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(tensors) -> int:
    return sum(_local(t).numel() * t.element_size() for t in tensors if t is not None)


def model_state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[int, int]:
    """Bytes this rank holds of the parameters and of the optimizer's state (every tensor in it)."""
    opt_tensors = [v for state in opt.state.values() for v in state.values() if torch.is_tensor(v)]
    return _nbytes(model.parameters()), _nbytes(opt_tensors)


class SavedActivations:
    """Counts the bytes of the tensors autograd saves while active (see the module docstring).

    Parameters are recognised by their storage, looked up at each save: FSDP2 swaps its unsharded
    parameters (plain ``nn.Parameter``s, views of the all-gather output) into the modules only while a
    layer runs, and an op saves views of them (``weight.t()``), not the parameters themselves.
    """

    def __init__(self, model: torch.nn.Module, layers: "list[torch.nn.Module]" = ()) -> None:
        self.model, self.layers, self.storages = model, list(layers), {}

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def count(self, t: Any) -> None:
        """Count ``t``'s storage once, unless it is a parameter's."""
        if not torch.is_tensor(t) or isinstance(t, torch.nn.Parameter) or t.layout != torch.strided:
            return
        storage = _local(t).untyped_storage()
        ptr = storage.data_ptr()
        if storage.nbytes() == 0 or ptr in self.storages:
            return
        params = {p.untyped_storage().data_ptr() for p in self.model.parameters() if type(p) is torch.nn.Parameter}
        if ptr not in params:
            self.storages[ptr] = storage.nbytes()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.count(t)
        return t  # saved as it is: the measurement must not change what is held

    @contextlib.contextmanager
    def __call__(self) -> Iterator["SavedActivations"]:
        # A checkpointed layer saves through its own hooks; what it keeps is its input (the recompute's).
        handles = [m.register_forward_pre_hook(lambda m, a, kw: self.count(a[0] if a else kw.get("hidden_states")),
                                               with_kwargs=True) for m in self.layers]
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield self
        finally:
            for h in handles:
                h.remove()


def _step(model, opt, mesh, ids: torch.Tensor, layout: str, meter: Optional[SavedActivations]) -> dict:
    """One training step; this rank's activation bytes and model-state bytes (params, grads, optimizer)."""
    from cp_attention.integrations import huggingface as cphf

    local = cphf.shard_batch({"input_ids": ids}, group=mesh, layout=layout)
    with meter() if meter is not None else contextlib.nullcontext():
        out = model(**cphf.model_inputs(local))
        loss = cphf.causal_lm_loss(out.logits, local["shift_labels"], group=mesh)
    del out
    loss.backward()
    grads = _nbytes(p.grad for p in model.parameters())
    opt.step()
    params, optim = model_state_bytes(model, opt)
    opt.zero_grad(set_to_none=True)
    return {"act": meter.bytes if meter is not None else 0, "params": params, "grads": grads, "optim": optim}


def longest_seq(cap: float, states: float, a: float, b: float, cp: int, divisor: int) -> int:
    """The longest global sequence (a multiple of ``divisor``) with ``states + a + b * S / cp <= cap``; 0 if none."""
    if b <= 0:
        return 0
    return max(0, int((cap - states - a) / b * cp) // divisor * divisor)


def measure_config(args: argparse.Namespace, dp: int, cp: int, cap: Optional[float]) -> dict:
    """One rank of a ``dp x cp`` configuration (1x1: one process, no process group needed): every
    measurement, the maximum over ranks. ``cap=None`` derives the cap: the model states plus the
    activations at 3S/4.
    """
    import cp_attention as cpa
    from cp_attention.integrations import huggingface as cphf

    world = dp * cp
    mesh, dp_rank = None, 0
    divisor = cpa.get_layout(args.layout).divisor(cp)
    half = args.seq_len // 2 // divisor * divisor
    model = build_model(args, max_len=1 << 20)
    n_params = sum(p.numel() for p in model.parameters())
    layers = list(model.model.layers) if args.activation_checkpointing else []
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
        dp_rank = mesh["dp"].get_local_rank()
        model = cphf.parallelize(model, mesh, layout=args.layout,
                                 activation_checkpointing=args.activation_checkpointing)
    elif args.activation_checkpointing:  # as parallelize does: non-reentrant, every decoder layer
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.24 (the old name warns)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def batch(seq: int, step: int) -> torch.Tensor:
        # Each dp rank its own batch (one row of seq tokens); the cp ranks of a dp group the same one.
        g = torch.Generator().manual_seed(1000 * step + dp_rank)
        return torch.randint(0, args.vocab, (1, seq), generator=g)

    full = _step(model, opt, mesh, batch(args.seq_len, 0), args.layout, SavedActivations(model, layers))
    act_half = _step(model, opt, mesh, batch(half, 1), args.layout, SavedActivations(model, layers))["act"]
    times = []
    for i in range(args.steps):
        if world > 1:
            dist.barrier()  # ranks start together, so the slowest rank's time is the step's
        t0 = time.perf_counter()
        _step(model, opt, mesh, batch(args.seq_len, 2 + i), args.layout, None)
        times.append(time.perf_counter() - t0)
    stats = torch.tensor([full["params"], full["grads"], full["optim"], full["act"], act_half, *times],
                         dtype=torch.float64)
    if world > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # per-rank figures: the largest rank's
    params, grads, optim, act, act_half = stats[:5].tolist()
    times = stats[5:].tolist()
    states = params + grads + optim
    # Activations against local tokens: a straight line through the two measured lengths.
    b = (act - act_half) / ((args.seq_len - half) / cp)
    a = act - b * args.seq_len / cp
    if cap is None:
        cap = states + a + b * (3 * args.seq_len // 4) / cp
        cap = float(-(-cap // MIB) * MIB)  # a whole MiB
    longest = longest_seq(cap, states, a, b, cp, divisor)
    verify = {"act": 0, "params": 0, "grads": 0, "optim": 0}
    if longest > 0:
        verify = _step(model, opt, mesh, batch(longest, 99), args.layout, SavedActivations(model, layers))
    vstats = torch.tensor([verify["params"] + verify["grads"] + verify["optim"], verify["act"],
                           verify["params"] + verify["grads"] + verify["optim"] + verify["act"]], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(vstats, op=dist.ReduceOp.MAX)
    v_states, v_act, v_total = vstats.tolist()
    step_s = statistics.median(times) if times else float("nan")
    return {"config": f"{dp}x{cp}", "dp": dp, "cp": cp, "world": world, "params_count": n_params,
            "threads_per_rank": torch.get_num_threads(), "seq_len": args.seq_len, "half_seq_len": half,
            "param_bytes": params, "grad_bytes": grads, "optim_bytes": optim, "state_bytes": states,
            "act_bytes": act, "act_bytes_half": act_half, "act_fit_a": a, "act_fit_b_per_local_token": b,
            "step_s": step_s, "step_s_all": times, "tokens_per_s": dp * args.seq_len / step_s,
            "cap_bytes": cap, "longest_seq": longest, "verify_state_bytes": v_states, "verify_act_bytes": v_act,
            "verify_total_bytes": v_total, "verified": longest > 0 and v_total <= cap}


def worker(args: argparse.Namespace, shapes: "list[tuple[int, int]]", cap: float, t0: float) -> "list[dict]":
    """One rank of a spawned job: :func:`measure_config` for each ``(dp, cp)`` of this world size in turn."""
    rows = []
    for dp, cp in shapes:
        rows.append(measure_config(args, dp, cp, cap))
        gc.collect()  # the last configuration's model, optimizer and FSDP state
        if dist.get_rank() == 0:
            print(f"  {dp}x{cp} done after {time.time() - t0:.0f} s", flush=True)
    return rows


def _parse_configs(specs: "list[str]") -> "list[tuple[int, int]]":
    shapes = []
    for spec in " ".join(specs).replace(",", " ").split():
        dp, _, cp = spec.lower().partition("x")
        if not (dp.isdigit() and cp.isdigit()) or int(dp) < 1 or int(cp) < 1:
            raise SystemExit(f"--configs: expected shapes like 2x2 (dp x cp), got {spec!r}")
        shapes.append((int(dp), int(cp)))
    return [(1, 1)] + [s for s in dict.fromkeys(shapes) if s != (1, 1)]  # 1x1 first: the baseline and the cap


def _x(value: float, base: float) -> str:
    return f"({value / base:.2f}x)" if base else "(-)"


def _print_table(rows: "list[dict]", args: argparse.Namespace, cap: float) -> None:
    print(f"\nper rank (the largest rank's); cap {cap / MIB:.0f} MiB per rank"
          + (" (default: 1x1's model states + its activations at 3S/4)" if args.cap_mib is None else ""))
    head = (f"{'dp x cp':>7} | {'model states MiB':>22} | {f'activations MiB at S={args.seq_len}':>28} | "
            f"{'tokens/s':>8} | {'longest seq under cap':>23} | verified")
    print(head + "\n" + "-" * len(head))
    base = rows[0]
    for r in rows:
        longest_x = f"({r['longest_x']:.2f}x)" if r["longest_x"] is not None else "(-)"
        print(f"{r['config']:>7} | {r['state_bytes'] / MIB:>12.1f} {_x(r['state_bytes'], base['state_bytes']):>9} | "
              f"{r['act_bytes'] / MIB:>18.1f} {_x(r['act_bytes'], base['act_bytes']):>9} | "
              f"{r['tokens_per_s']:>8.0f} | {r['longest_seq']:>13} {longest_x:>9} | "
              f"{'yes' if r['verified'] else 'no'} ({r['verify_total_bytes'] / MIB:.1f} MiB)")
    threads = ", ".join(f"{r['config']} {r['threads_per_rank']}" for r in rows)
    print(f"\ntokens/s: global tokens per step (dp x S) / the slowest rank's step time, median of {args.steps} "
          f"step(s). The ranks share this machine's {os.cpu_count()} cores (threads per rank: {threads}), so "
          "tokens/s is not a scaling measure here.")
    print("activations: bytes saved for backward in the forward and the loss (each storage once, parameters left "
          "out); model states: parameters + gradients + AdamW state held by the rank. verified: one step at the "
          "longest length measured <= cap (its measured states + activations in brackets).")


def run(args: argparse.Namespace) -> list[dict]:
    """Measure every configuration (1x1 first), print the table; returns the rows."""
    import cp_attention as cpa

    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    configs = _parse_configs(args.configs)
    if "RANK" in os.environ:  # each configuration needs its own world size: the ranks are spawned here
        raise SystemExit("run this benchmark as a plain python script, not under torchrun: it starts its own ranks")
    if args.steps < 1:
        raise SystemExit(f"--steps must be at least 1, got {args.steps}")
    lay = cpa.get_layout(args.layout)
    for _, cp in configs:
        if args.seq_len % (2 * lay.divisor(cp)):  # S and S/2 must both split
            raise SystemExit(f"--seq-len {args.seq_len}: must be a multiple of {2 * lay.divisor(cp)} "
                             f"(twice the {args.layout} divisor at cp={cp})")
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    n_params = sum(p.numel() for p in build_model(args, max_len=1 << 20).parameters())
    print(f"model: Llama, {n_params:,} parameters ({n_params / 1e6:.1f} M), hidden {args.hidden}, {args.layers} "
          f"layers, vocab {args.vocab}, intermediate {args.intermediate}, heads {args.heads}/{args.kv_heads} kv; "
          f"fp32, AdamW; layout {args.layout}; activation checkpointing "
          f"{'on' if args.activation_checkpointing else 'off'}")
    print(f"S={args.seq_len}: each dp rank trains on its own batch of one S-token sequence; {args.steps} timed "
          "step(s) per configuration", flush=True)
    t0 = time.time()  # wall clock: the spawned ranks report against it too
    rows: list[dict] = []
    cap = None if args.cap_mib is None else args.cap_mib * MIB
    # 1x1 here (no process group); then one spawned job per world size, its shapes one after the other
    # (starting ranks, each importing torch and transformers, costs more than a small configuration).
    rows.append(measure_config(args, 1, 1, cap))
    cap = rows[0]["cap_bytes"]
    print(f"  1x1 done after {time.time() - t0:.0f} s", flush=True)
    worlds: dict[int, list] = {}
    for dp, cp in configs[1:]:
        worlds.setdefault(dp * cp, []).append((dp, cp))
    for world, shapes in worlds.items():
        rows += run_on_ranks(worker, world, args, shapes, cap, t0, timeout_s=900)
    rows.sort(key=lambda r: configs.index((r["dp"], r["cp"])))
    base = rows[0]
    for r in rows:
        r["state_x"] = r["state_bytes"] / base["state_bytes"]
        r["act_x"] = r["act_bytes"] / base["act_bytes"]
        r["longest_x"] = r["longest_seq"] / base["longest_seq"] if base["longest_seq"] else None
    _print_table(rows, args, cap)
    print(f"total {time.time() - t0:.0f} s")
    if args.json:
        setup = {k: v for k, v in vars(args).items() if k != "json"}
        with open(args.json, "w") as f:
            json.dump({"setup": {**setup, "params_count": n_params, "cap_bytes": cap}, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    from benchmarks.measure import command_line

    command_line(__doc__, add_arguments, run)
