"""What a schedule is made of: block tasks (plain, for the engine's kernels) and document blocks
(bands of one document, which the lowering turns into tasks). Pure Python and index math.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BlockTask", "DocBlock", "source_rank", "task_pairs", "doc_block_pairs", "increasing_positions"]


@dataclass(frozen=True)
class BlockTask:
    """One local attention block: rows ``q_start:q_stop`` of the local queries against rows
    ``kv_start:kv_stop`` of the K/V shard held at this step.

    ``causal`` means the top-left-aligned lower triangle of the sliced block: query ``i`` of the
    slice sees key ``k`` of the slice iff ``k <= i``. ``band = (lo, hi)`` (sliding windows; then
    ``causal`` is False) means query ``i`` sees key ``k`` iff ``lo <= k - i <= hi``. Tasks are never
    empty, and every query row of a task sees at least one key.
    """

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int
    causal: bool
    band: tuple[int, int] | None = None

    @property
    def q(self) -> slice:
        return slice(self.q_start, self.q_stop)

    @property
    def kv(self) -> slice:
        return slice(self.kv_start, self.kv_stop)


@dataclass(frozen=True)
class DocBlock:
    """Local query rows ``q_start:q_stop`` of one document against that document's K/V rows
    ``kv_start:kv_stop`` of the shard held at this step.

    ``diag`` None: no upper bound. Otherwise query ``i`` of the block (counted from ``q_start``) sees
    key ``b`` (from ``kv_start``) only if ``b <= i + diag``: a causal band whose diagonal is shifted by
    ``diag`` (0 is the top-left triangle). ``lo`` (sliding windows only; None: no lower bound) also
    requires ``b >= i + lo``. Every query row sees at least one key, and every key is seen.
    """

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int
    diag: int | None
    lo: int | None = None

    @property
    def q_len(self) -> int:
        return self.q_stop - self.q_start

    @property
    def kv_len(self) -> int:
        return self.kv_stop - self.kv_start


def source_rank(rank: int, world_size: int, step: int) -> int:
    """The rank whose K/V shard ``rank`` holds at ring ``step``: ``(rank - step) mod world_size``."""
    return (rank - step) % world_size


def task_pairs(task: BlockTask) -> int:
    """Number of (query, key) score pairs the task computes."""
    a = task.q_stop - task.q_start
    b = task.kv_stop - task.kv_start
    if task.band is not None:
        lo, hi = task.band
        return sum(max(0, min(b - 1, i + hi) - max(0, i + lo) + 1) for i in range(a))
    if not task.causal:
        return a * b
    # Top-left triangle: row i sees min(i + 1, b) keys.
    full_rows = max(0, a - b)
    tri_rows = a - full_rows
    return tri_rows * (tri_rows + 1) // 2 + full_rows * b


def doc_block_pairs(block: DocBlock) -> int:
    """Number of (query, key) score pairs a block computes."""
    a, w = block.q_len, block.kv_len
    if block.lo is not None:
        i = torch.arange(a)
        last = i + block.diag if block.diag is not None else torch.full_like(i, w - 1)
        return int((last.clamp(max=w - 1) - (i + block.lo).clamp(min=0) + 1).clamp(min=0).sum())
    if block.diag is None:
        return a * w
    # Row i sees min(i + diag + 1, w) keys: a ramp until the band reaches the last key, then full rows.
    ramp = max(0, min(a, w - block.diag - 1))
    first = block.diag + 1
    return ramp * first + ramp * (ramp - 1) // 2 + (a - ramp) * w


def increasing_positions(layout, total: int, rank: int, world_size: int, cu_seqlens, what: str) -> torch.Tensor:
    """``layout.positions`` of ``rank`` (packed as ``cu_seqlens`` if not None), which the schedules
    derived from positions need in increasing order. Raises ``NotImplementedError`` naming ``what``
    needs it when they are not."""
    pos = layout.positions(total, rank, world_size, cu_seqlens)
    if pos.numel() > 1 and not bool((pos[1:] > pos[:-1]).all()):
        raise NotImplementedError(f"layout {layout.name!r} does not hold its tokens in increasing order, "
                                  f"which {what} need")
    return pos
