"""Packed documents on a kernel that takes variable-length batches (PyTorch's flash with
``cum_seq_q/k``): exact through the ring, and one call per mask kind per ring step whatever the
number of documents. On CPU against the aten stand-ins (the real schemas, flash's varlen checks and
bottom-right causal alignment, fp64 math, an fp32 LSE as the op returns)."""

from __future__ import annotations

from collections import Counter

import pytest

import cp_attention as cpa
from cp_attention.kernels import cuda_flash
from cp_attention.kernels.cuda_flash import FlashKernel
from cp_attention.schedules import BlockTask, VarlenSpec, block_schedules, lower_steps
from cp_attention.schedules.lowering import square_pieces
from tests.support.core.loopback_cases import loopback_errors
from tests.support.cuda.aten_standins import AtenStandIns


@pytest.fixture
def flash_on_cpu(monkeypatch):
    """The flash kernel runs CPU fp64 tensors through the stand-in ops; returns the stand-ins (their
    ``calls`` record every op call)."""
    ops = AtenStandIns()
    monkeypatch.setattr(cuda_flash, "_aten", ops)
    monkeypatch.setattr(FlashKernel, "supports", lambda self, device, dtype: True)
    return ops


LENGTHS = {2: [1, 13, 3, 20, 5, 6], 3: [7, 1, 11, 2, 9, 6, 5, 7], 4: [3, 17, 9, 1, 8, 10]}


@pytest.mark.parametrize("layout", cpa.LAYOUT_NAMES)
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("use_plan", [False, True])
def test_packed_documents_on_varlen_flash_are_exact(flash_on_cpu, world_size, layout, use_plan):
    lengths = LENGTHS[world_size]
    errors = loopback_errors(world_size, layout=layout, causal=True, kernel="flash", lengths=lengths,
                             local_len=sum(lengths) // world_size, atol=2e-6, use_plan=use_plan)
    assert not {k: v for k, v in errors.items() if v > 0}, errors
    ops = Counter(name for name, _ in flash_on_cpu.calls)
    varlen = [a for name, a in flash_on_cpu.calls if a.get("cum_seq_q") is not None]
    assert varlen and ops["_flash_attention_forward"] == sum(1 for n, a in flash_on_cpu.calls
                                                             if n == "_flash_attention_forward"
                                                             and a["cum_seq_q"] is not None)


def test_non_causal_packed_documents_on_varlen_flash_are_exact(flash_on_cpu):
    errors = loopback_errors(3, layout="zigzag", causal=False, kernel="flash", lengths=LENGTHS[3],
                             local_len=sum(LENGTHS[3]) // 3, atol=2e-6)
    assert not {k: v for k, v in errors.items() if v > 0}, errors


def _flash_calls_per_step(ops: AtenStandIns, documents: int, world_size: int = 2) -> int:
    ops.calls.clear()
    lengths = [16] * documents
    loopback_errors(world_size, layout="zigzag", causal=True, kernel="flash", lengths=lengths,
                    local_len=sum(lengths) // world_size, atol=1.0)
    forwards = sum(1 for name, _ in ops.calls if name == "_flash_attention_forward")
    return forwards / (world_size * world_size)  # per rank and ring step


def test_calls_per_step_do_not_grow_with_documents(flash_on_cpu):
    few, many = _flash_calls_per_step(flash_on_cpu, 16), _flash_calls_per_step(flash_on_cpu, 64)
    assert few == many and many <= 3, (few, many)


@pytest.mark.parametrize("rows,cols", [(5, 5), (3, 7), (7, 3), (1, 4), (4, 1)])
def test_square_pieces_cover_a_causal_block(rows, cols):
    """Full and square causal pieces compute exactly the top-left causal block's pairs."""
    task = BlockTask(2, 2 + rows, 10, 10 + cols, True)
    want = {(i, j) for i in range(rows) for j in range(cols) if j <= i}
    got = []
    for p in square_pieces(task):
        assert not p.causal or p.q_stop - p.q_start == p.kv_stop - p.kv_start, p
        got += [(i - 2, j - 10) for i in range(p.q_start, p.q_stop) for j in range(p.kv_start, p.kv_stop)
                if not p.causal or j - p.kv_start <= i - p.q_start]
    assert sorted(got) == sorted(want)


@pytest.mark.parametrize("layout", cpa.LAYOUT_NAMES)
def test_varlen_lowering_covers_each_pair_once(layout):
    """Every step: a few varlen batches of one mask kind each, disjoint query rows within one, and
    together exactly the pairs of the step's document blocks."""
    cu = (0, 1, 14, 17, 37, 42, 48)
    every = block_schedules(cpa.get_layout(layout), True, 3, 48, cu, None)
    for blocks in every:
        steps = lower_steps(blocks, batched=False, tiled=True, local_len=16, varlen=True)
        for s, specs in enumerate(steps):
            assert all(isinstance(x, VarlenSpec) for x in specs) and len(specs) <= 4
            pairs = Counter()
            for spec in specs:
                rows = [r for p in spec.pieces for r in range(p.q_start, p.q_stop)]
                assert len(rows) == len(set(rows)), "query rows repeat within one call"
                assert spec.first == (s == 0)
                for p in spec.pieces:
                    assert p.causal == spec.causal
                    pairs.update((i, j) for i in range(p.q_start, p.q_stop) for j in range(p.kv_start, p.kv_stop)
                                 if not p.causal or j - p.kv_start <= i - p.q_start)
            want = Counter()
            for b in blocks[s]:
                for i in range(b.q_len):
                    top = b.kv_len if b.diag is None else min(b.kv_len, i + b.diag + 1)
                    want.update((b.q_start + i, b.kv_start + j) for j in range(top))
            assert pairs == want
