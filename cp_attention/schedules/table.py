"""One rank's document blocks over its ring steps as columns of one tensor, not as one Python object
per block: a rank's packed steps hold tens of thousands of blocks, and the lowering and the engine's index
tensors are built from the columns with a few vectorised operations per step.

A row is ``(step, q_start, q_stop, kv_start, kv_stop, diag, lo)`` with the meaning of
:class:`~cp_attention.schedules.blocks.DocBlock`; a side without a bound holds :data:`UNBOUNDED`
(``diag``) or ``-UNBOUNDED`` (``lo``), so masks need no special case. Rows are in step order, and in
query-row order within a step. Index math only.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch

from .blocks import DocBlock

__all__ = ["BlockTable", "doc_blocks", "UNBOUNDED", "STEP", "Q_START", "Q_STOP", "KV_START", "KV_STOP", "DIAG", "LO"]

# No bound on that side of a band: beyond any block's size (blocks are at most a shard long).
UNBOUNDED = 1 << 40
STEP, Q_START, Q_STOP, KV_START, KV_STOP, DIAG, LO = range(7)


class BlockTable:
    """``rows [B, 7]`` (int64, see the module docstring) over ``steps`` ring steps. Reads like the
    per-step tuples of :class:`DocBlock` it replaces (``table[s]``, ``len``, iteration), which builds
    the objects: for tests and small tables; the lowering reads the columns."""

    __slots__ = ("rows", "steps", "_bounds")

    def __init__(self, rows: torch.Tensor, steps: int) -> None:
        self.rows = rows
        self.steps = steps
        self._bounds: list[int] | None = None

    @classmethod
    def from_blocks(cls, steps: Sequence[Sequence[DocBlock]]) -> BlockTable:
        """The table of per-step :class:`DocBlock` tuples ``steps[step]``."""
        rows = [(s, b.q_start, b.q_stop, b.kv_start, b.kv_stop, UNBOUNDED if b.diag is None else b.diag,
                 -UNBOUNDED if b.lo is None else b.lo) for s, blocks in enumerate(steps) for b in blocks]
        return cls(torch.tensor(rows, dtype=torch.long).reshape(-1, 7), len(steps))

    def bounds(self) -> list[int]:
        """Row offsets of the steps: step ``s`` is ``rows[bounds[s]:bounds[s + 1]]`` (one host read)."""
        if self._bounds is None:
            counts = torch.bincount(self.rows[:, STEP], minlength=self.steps)
            self._bounds = [0, *torch.cumsum(counts, 0).tolist()]
        return self._bounds

    def step(self, s: int) -> torch.Tensor:
        """Step ``s``'s rows ``[B_s, 7]`` (a view)."""
        b = self.bounds()
        return self.rows[b[s]:b[s + 1]]

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, s: int) -> tuple[DocBlock, ...]:
        if not -self.steps <= s < self.steps:
            raise IndexError(f"step {s} out of range for a table of {self.steps} steps")
        return doc_blocks(self.step(s % self.steps))

    def __iter__(self) -> Iterator[tuple[DocBlock, ...]]:
        return (self[s] for s in range(self.steps))

    def __repr__(self) -> str:
        return f"BlockTable({self.rows.shape[0]} blocks over {self.steps} steps)"


def doc_blocks(rows: torch.Tensor) -> tuple[DocBlock, ...]:
    """``rows [B, 7]`` (or ``[B, 6]`` without the step column) as :class:`DocBlock` s."""
    cols = rows[:, 1:] if rows.shape[1] == 7 else rows
    return tuple(DocBlock(a, b, c, d, None if g >= UNBOUNDED else g, None if lo <= -UNBOUNDED else lo)
                 for a, b, c, d, g, lo in cols.tolist())
