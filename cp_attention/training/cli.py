"""The command-line options the example training scripts share."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Optional

from ..kernels import KERNEL_NAMES
from .device import BACKENDS, DEVICES, PRECISIONS, placement

__all__ = ["example_parser", "place_example"]


def example_parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the options every example script takes (ranks, device, backend,
    precision, layout, kernel, sequence length, batch, steps, learning rate, seed, logging); a script
    adds its own."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn when not under torchrun")
    p.add_argument("--device", default="auto", choices=DEVICES,
                   help="auto: cuda when this machine has a GPU per rank, else cpu; rank i uses cuda:LOCAL_RANK")
    p.add_argument("--backend", default="auto", choices=BACKENDS, help="auto: nccl on cuda, gloo on cpu")
    p.add_argument("--precision", default="fp32", choices=PRECISIONS,
                   help="bf16: forward and loss under torch.autocast(bfloat16), fp32 weights (cpu too: slow)")
    p.add_argument("--layout", default="zigzag")
    p.add_argument("--kernel", default="auto", choices=KERNEL_NAMES)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=5)
    return p


def place_example(args: argparse.Namespace, cp_size: Optional[int] = None,
                  refuse: Optional[Callable[[str, str], Optional[str]]] = None) -> argparse.Namespace:
    """Resolve ``args.device`` and ``args.backend`` (``auto`` included) for a job of ``args.world_size``
    ranks (torchrun's ``WORLD_SIZE`` / ``LOCAL_WORLD_SIZE`` when under it) with CP groups of ``cp_size``
    (default: all ranks); returns ``args``. Exits with a usage error (status 2) naming the option to
    change when they cannot work together, or when ``refuse(device, precision)`` gives a reason."""
    if "RANK" in os.environ:
        args.world_size = int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_WORLD_SIZE", args.world_size))
    else:
        local = args.world_size
    try:
        where = placement(args.device, args.backend, local_ranks=local, cp_size=cp_size or args.world_size,
                          precision=args.precision, prefix="--")
        reason = refuse(where.device, args.precision) if refuse is not None else None
        if reason:
            raise ValueError(reason)
    except ValueError as e:
        print(f"{os.path.basename(sys.argv[0])}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if where.note and os.environ.get("RANK", "0") == "0":
        print(where.note, file=sys.stderr, flush=True)
    args.device, args.backend = where.device, where.backend
    return args
