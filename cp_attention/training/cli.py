"""The command-line options the example training scripts share."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

from ..kernels import KERNEL_NAMES
from ..strategies import check_comm_type_name
from .device import BACKENDS, DEVICES, PRECISIONS, placement

__all__ = ["example_parser", "memory_options", "memory_savers", "place_example", "comm_problem"]


def example_parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the options every example script takes (ranks, device, backend,
    precision, layout, kernel, CP strategy, sequence length, batch, steps, learning rate, seed, logging);
    a script adds its own."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn when not under torchrun")
    p.add_argument("--device", default="auto", choices=DEVICES,
                   help="auto: cuda when this machine has a GPU per rank, else cpu; rank i uses cuda:LOCAL_RANK")
    p.add_argument("--backend", default="auto", choices=BACKENDS, help="auto: nccl on cuda, gloo on cpu")
    p.add_argument("--precision", default="fp32", choices=PRECISIONS,
                   help="bf16: forward and loss under torch.autocast(bfloat16), fp32 weights (cpu too: slow)")
    p.add_argument("--layout", default="zigzag",
                   help="contiguous, zigzag, interleaved or balanced (per batch from packed documents; zigzag "
                        "without), or a registered layout")
    p.add_argument("--kernel", default="auto", choices=KERNEL_NAMES)
    p.add_argument("--cp-comm-type", default="p2p",
                   help="how K/V travel: p2p (the ring), all_gather, a2a (Ulysses), a2a+p2p (with --cp-a2a-size), auto")
    p.add_argument("--cp-a2a-size", type=int, default=None,
                   help="a two-level CP group: all-to-all inside groups of this many CP ranks, the ring across "
                        "them (a2a+p2p; divides the CP size, > 1 and smaller)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=5)
    return p


def _count(least: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if value < least:
            raise argparse.ArgumentTypeError(f"expected an int >= {least}, got {text!r}")
        return value
    return parse


def memory_options(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the HuggingFace examples' memory savers to ``p`` (none changes the result): the loss in chunks,
    activation checkpointing (offloaded), the MLP in chunks; returns ``p``. See :func:`memory_savers`."""
    p.add_argument("--loss-chunk-tokens", type=_count(0), default=1024,
                   help="the LM head and loss over chunks of this many tokens (lm_loss); 0: the full logits at once")
    p.add_argument("--activation-checkpointing", default="off", choices=["off", "on", "offload"],
                   help="on: recompute each decoder layer in backward; offload: and hold its saved input in CPU memory")
    p.add_argument("--mlp-chunks", type=_count(1), default=None,
                   help="run each decoder layer's MLP over this many sequence chunks (ALST's TiledMLP)")
    return p


def memory_savers(args: argparse.Namespace) -> tuple[int | None, bool | str, int | None]:
    """``(loss chunk tokens or None for full logits, checkpoint, mlp_chunks)`` from :func:`memory_options`'
    flags, the defaults where ``args`` lacks them (no chunks of the loss: 1024 tokens, no savers)."""
    chunk = getattr(args, "loss_chunk_tokens", 1024)
    modes: dict[str, bool | str] = {"off": False, "on": True, "offload": "offload"}
    checkpoint = modes[getattr(args, "activation_checkpointing", "off")]
    return (chunk or None), checkpoint, getattr(args, "mlp_chunks", None)


def comm_problem(cp_comm_type: str, a2a_size: int | None, cp_size: int, layers: int = 0) -> str | None:
    """Why ``--cp-comm-type`` (one name, or with ``layers`` > 0 a comma-separated one per layer) and
    ``--cp-a2a-size`` cannot run on CP groups of ``cp_size`` ranks; None when they can."""
    names = cp_comm_type.split(",")
    if len(names) > 1 and len(names) != layers:
        return (f"--cp-comm-type {cp_comm_type} lists {len(names)} strategies; give one"
                + (f", or one per layer ({layers})" if layers else " (this script takes one for every layer)"))
    for name in names:
        try:
            check_comm_type_name(name)
        except ValueError as e:
            return f"--cp-comm-type: {e}"
    if a2a_size is None:
        if "a2a+p2p" in names:
            return (f"--cp-comm-type a2a+p2p needs --cp-a2a-size: the all-to-all group size, > 1, dividing the CP "
                    f"size {cp_size} and smaller (or --cp-comm-type a2a for all {cp_size} ranks)")
        return None
    if a2a_size <= 1 or a2a_size >= cp_size or cp_size % a2a_size:
        return (f"--cp-a2a-size {a2a_size}: the all-to-all group size must be > 1, divide the CP size {cp_size} "
                "and be smaller; drop it for a one-level CP group")
    return None


def place_example(args: argparse.Namespace, cp_size: int | None = None,
                  refuse: Callable[[str, str], str | None] | None = None, layers: int = 0) -> argparse.Namespace:
    """Resolve ``args.device`` and ``args.backend`` (``auto`` included) for a job of ``args.world_size``
    ranks (torchrun's ``WORLD_SIZE`` / ``LOCAL_WORLD_SIZE`` when under it) with CP groups of ``cp_size``
    (default: all ranks); returns ``args``. Exits with a usage error (status 2) naming the option to
    change when they cannot work together, when ``--cp-comm-type``/``--cp-a2a-size`` cannot (see
    :func:`comm_problem`; ``layers``: how many per-layer strategies the script's model takes, 0 for
    one), or when ``refuse(device, precision)`` gives a reason."""
    if "RANK" in os.environ:
        args.world_size = int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_WORLD_SIZE", args.world_size))
    else:
        local = args.world_size
    try:
        where = placement(args.device, args.backend, local_ranks=local, cp_size=cp_size or args.world_size,
                          precision=args.precision, prefix="--")
        reason = comm_problem(args.cp_comm_type, args.cp_a2a_size, cp_size or args.world_size, layers)
        reason = reason or (refuse(where.device, args.precision) if refuse is not None else None)
        if reason:
            raise ValueError(reason)
    except ValueError as e:
        print(f"{os.path.basename(sys.argv[0])}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if where.note and os.environ.get("RANK", "0") == "0":
        print(where.note, file=sys.stderr, flush=True)
    args.device, args.backend = where.device, where.backend
    return args
