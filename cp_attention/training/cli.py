"""The command-line options the example training scripts share."""

from __future__ import annotations

import argparse

from ..kernels import KERNEL_NAMES

__all__ = ["example_parser"]


def example_parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the options every example script takes (ranks, layout, kernel,
    sequence length, batch, steps, learning rate, seed, logging); a script adds its own."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn when not under torchrun")
    p.add_argument("--layout", default="zigzag")
    p.add_argument("--kernel", default="auto", choices=KERNEL_NAMES)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=5)
    return p
