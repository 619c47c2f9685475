"""A named kernel against the blocks a call will give it: judged from the agreed call alone (layout,
causal, world size, local length, documents, window, strategy), so every rank reaches the same
verdict before any communication.

``auto`` needs no such check (it routes a refused block to the next kernel of its table); a kernel
named explicitly that would be handed a block it refuses (cuDNN and a one-token side, see
:meth:`~cp_attention.kernels.base.AttentionKernel.block_refusal`) is refused here, by name, with the
kernel that can run it.
"""

from __future__ import annotations

import functools
from typing import Sequence, cast

from ..kernels import AttentionKernel
from ..layouts.base import Layout
from ..schedules.blocks import BlockTask
from ..schedules.causal import get_schedule, rank_steps
from ..schedules.derived import block_schedules
from ..schedules.lowering import lower_steps

__all__ = ["dense_ring_blocks", "named_kernel_problem"]


@functools.lru_cache(maxsize=64)
def dense_ring_blocks(layout: Layout, causal: bool, world_size: int, local_len: int
                      ) -> frozenset[tuple[int, int, bool]]:
    """Every ``(Sq, Sk, causal)`` block shape any rank's ring runs for one dense sequence of
    ``local_len`` tokens per rank (the layout's own schedule, or the blocks derived from its positions)."""
    shapes: set[tuple[int, int, bool]] = set()
    steps: Sequence[tuple[BlockTask, ...]]
    for rank in range(world_size):
        if get_schedule(layout) is not None:
            steps = rank_steps(layout, causal, rank, world_size, local_len)
        else:
            table = block_schedules(layout, causal, world_size, local_len * world_size, None, None, rank=rank)
            # Unbatched, not varlen: every task is a plain BlockTask.
            steps = cast("tuple[tuple[BlockTask, ...], ...]",
                         lower_steps(table, batched=False, tiled=True, local_len=local_len))
        shapes.update((t.q_stop - t.q_start, t.kv_stop - t.kv_start, t.causal) for step in steps for t in step)
    return frozenset(shapes)


def named_kernel_problem(name: str, kernel: AttentionKernel, layout: Layout, causal: bool, world_size: int,
                         local_len: int, packed: bool, windowed: bool, comm_type: str) -> str | None:
    """Why the kernel named ``name`` cannot run this call's blocks, or None. A kernel that takes every
    block shape passes at once; one that refuses some passes only when every block of a dense ring is
    known to be one it takes (packed documents, windows and the other strategies cut blocks down to
    single tokens, so they are refused outright for it)."""
    if kernel.block_refusal(1, 1, False) is None:
        return None
    advice = "use kernel='auto' (it runs such blocks on the next kernel of its table) or kernel='flash'"
    if packed or windowed:
        what = "packed documents" if packed else "sliding windows"
        return (f"kernel {name!r} cannot run {what}: their blocks can have a single query row or key (a 1-token "
                f"document or piece of one), which {name!r} refuses; {advice}")
    if comm_type != "p2p":
        half = max(local_len // 2, 1)
        problem = kernel.block_refusal(half, half, True)
        return None if problem is None else (f"{problem} (cp_comm_type={comm_type!r}, local length {local_len}); "
                                             f"{advice}")
    for sq, sk, block_causal in sorted(dense_ring_blocks(layout, bool(causal), world_size, local_len)):
        problem = kernel.block_refusal(sq, sk, block_causal)
        if problem is not None:
            return (f"{problem}, which the {layout.name} ring gives it at local length {local_len} and world size "
                    f"{world_size}; {advice}")
    return None
