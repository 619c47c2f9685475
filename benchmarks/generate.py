"""Long-prompt generation under context parallelism.

For each prompt length S and each world size N, a random-weight fp32 Llama generates ``--new-tokens``
tokens greedily from one S-token prompt: N = 1 is plain ``model.generate`` in this process (the
baseline); N > 1 is ``cphf.generate`` on N spawned gloo ranks (sharded prefill, sharded KV cache,
pass-Q decoding). Reported per configuration (the slowest or largest rank):

  prefill s       the first forward (the whole prompt), wall time;
  decode ms/tok   the later forwards, median wall time per token;
  KV MiB/rank     keys and values the cache holds on a rank at the end (the sharded cache's positions too);
  comm B/step     bytes one rank contributes to the decoding steps' all-gathers, per generated token,
                  summed over layers (each rank's partial out and LSE: ``layers x batch x heads x
                  (head_dim + 1)`` values); 0 without CP.

Usage (from the repo root):
  python benchmarks/generate.py [--prompt-lens 4096 16384] [--worlds 1 2 4] [--new-tokens 8]
                                       [--quick] [--json out.json]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script: `benchmarks` imports from the repository root, and this folder's
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # files never shadow top-level packages

import argparse
import json
import statistics
from typing import Any

import torch

from benchmarks import args as flags
from benchmarks.measure import Stopwatch, command_text
from cp_attention.launch import run_on_ranks

__all__ = ["add_arguments", "measure", "run"]

QUICK = {"new_tokens": 4, "hidden": 64, "layers": 2, "vocab": 256, "intermediate": 128, "heads": 4, "kv_heads": 2}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--new-tokens", type=int, default=8)
    flags.add_model(p, layers=4, hidden=256, intermediate=512, vocab=2048)
    flags.add_shape(p, heads=8, kv_heads=4)
    flags.add_ring(p, layout="zigzag")
    flags.add_run(p, quick="a tiny model (a smoke test; pick small --prompt-lens)", json="the rows")


def _model(args: argparse.Namespace, max_len: int) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=max_len)
    return tf.LlamaForCausalLM(cfg).eval()


class _Clock:
    """Wall time of every forward of a model (forward hooks)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.times: list[float] = []
        self._watch = Stopwatch()
        self._hooks = (model.register_forward_pre_hook(self._begin), model.register_forward_hook(self._end))

    def _begin(self, *_: Any) -> None:
        self._watch = Stopwatch()

    def _end(self, *_: Any) -> None:
        self.times.append(self._watch.seconds())


def _cache_bytes(cache: Any) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (layer.keys, layer.values, getattr(layer, "positions", None)) if t is not None)


def measure(args: argparse.Namespace, seq: int) -> dict:
    """One generation on this rank (plain without a process group, CP with one); this rank's figures."""
    import torch.distributed as dist

    from cp_attention.transport.process_group import ProcessGroupTransport

    world = dist.get_world_size() if dist.is_initialized() else 1
    model = _model(args, seq + args.new_tokens)
    ids = torch.randint(1, args.vocab, (1, seq), generator=torch.Generator().manual_seed(seq))
    kwargs = dict(max_new_tokens=args.new_tokens, do_sample=False, return_dict_in_generate=True, pad_token_id=0)
    sent = [0, 0]  # bytes, all-gathers
    if world == 1:
        clock = _Clock(model)
        with torch.no_grad():
            out = model.generate(ids, **kwargs)
    else:
        from cp_attention.integrations import huggingface as cphf

        cphf.apply_context_parallel(model, layout=args.layout)
        clock = _Clock(model)
        real = ProcessGroupTransport.all_gather_tensor

        def counted(self, tensor):
            if len(clock.times) >= 1:  # after the prefill: the decoding steps' merges
                sent[0] += tensor.numel() * tensor.element_size()
                sent[1] += 1
            return real(self, tensor)

        ProcessGroupTransport.all_gather_tensor = counted
        try:
            with torch.no_grad():
                out = cphf.generate(model, ids, layout=args.layout, **kwargs)
        finally:
            ProcessGroupTransport.all_gather_tensor = real
    cache = getattr(out, "cache", None) or out.past_key_values
    steps = max(1, len(clock.times) - 1)
    return {"world": world, "seq": seq, "prefill_s": clock.times[0],
            "decode_ms": 1e3 * statistics.median(clock.times[1:]) if len(clock.times) > 1 else float("nan"),
            "kv_bytes": _cache_bytes(cache), "comm_bytes_per_step": sent[0] / steps,
            "gathers_per_step": sent[1] / steps,
            "tokens": out.sequences[0, seq:].tolist()}


def _worker(args: argparse.Namespace, seqs: list[int]) -> list[dict]:
    import torch.distributed as dist

    rows = []
    for seq in seqs:
        mine = measure(args, seq)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        rows.append({**mine, "prefill_s": max(r["prefill_s"] for r in every),
                     "decode_ms": max(r["decode_ms"] for r in every),
                     "kv_bytes": max(r["kv_bytes"] for r in every),
                     "same_tokens_on_every_rank": all(r["tokens"] == mine["tokens"] for r in every)})
    return rows


def run(args: argparse.Namespace) -> list[dict]:
    """Measure every (S, N), print the table with ratios to N = 1 at the same S; returns the rows."""
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"command: {command_text()}")
    print(f"model: Llama fp32, hidden {args.hidden}, {args.layers} layers, heads {args.heads}/{args.kv_heads} kv, "
          f"vocab {args.vocab}; one prompt, {args.new_tokens} greedy tokens; layout {args.layout}", flush=True)
    rows = []
    for world in args.worlds:
        if world == 1:
            rows += [{**measure(args, seq), "same_tokens_on_every_rank": True} for seq in args.prompt_lens]
        else:
            rows += run_on_ranks(_worker, world, args, list(args.prompt_lens), timeout_s=3600)
    base = {r["seq"]: r for r in rows if r["world"] == 1}
    print(f"\n{'S':>7} {'N':>2} {'prefill s':>10} {'x N=1':>6} {'decode ms/tok':>14} {'KV MiB/rank':>12} "
          f"{'x N=1':>6} {'comm B/step':>12} {'tokens = N=1':>13}")
    for r in sorted(rows, key=lambda r: (r["seq"], r["world"])):
        b = base.get(r["seq"])
        same = "yes" if b is None or r["tokens"] == b["tokens"] else "NO"
        print(f"{r['seq']:>7} {r['world']:>2} {r['prefill_s']:>10.2f} "
              f"{r['prefill_s'] / b['prefill_s'] if b else 0:>6.2f} "
              f"{r['decode_ms']:>14.1f} {r['kv_bytes'] / 2**20:>12.2f} "
              f"{r['kv_bytes'] / b['kv_bytes'] if b else 0:>6.2f} {r['comm_bytes_per_step']:>12.0f} {same:>13}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setup": vars(args), "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    from benchmarks.measure import command_line

    command_line(__doc__, add_arguments, run)
