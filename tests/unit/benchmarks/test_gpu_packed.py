"""The GPU benchmark's packed replay (benchmarks/gpu_packed.py), the parts that need no CUDA: the documents,
each rank's replayed plan (run here on the CPU: it sends what the work model says a real ring sends), the
busiest rank and the efficiency arithmetic; and the ``auto`` row's picks (benchmarks/gpu.py)."""

from __future__ import annotations

import argparse

import pytest
import torch

from benchmarks.gpu import kernel_picks
from benchmarks.gpu_packed import PackedRow, efficiency, layout_row, packed_documents, replay_plan, whole_batch
from benchmarks.modelled import AttentionShape, model_bytes
from cp_attention import LAYOUT_NAMES
from cp_attention.kernels import BLOCK_KINDS, get_kernel


def test_documents_are_seeded_lognormal_and_cover_the_batch_exactly():
    cu = packed_documents(65536, 2048)
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    assert cu[0] == 0 and cu[-1] == 65536 and min(lengths) >= 1
    assert cu == packed_documents(65536, 2048)  # the same batch on every run
    assert cu != packed_documents(65536, 2048, seed=1)
    # mean 2,048 (sigma 1.5: a long tail, so only roughly, over a few dozen documents); all but the
    # trimmed last one are draws, and the median sits well under the mean (exp(-sigma^2/2) = 0.32)
    assert 1024 <= 65536 / len(lengths) <= 4096
    assert sorted(lengths)[len(lengths) // 2] < 2048
    for n in (2, 4, 8):  # T = N x 8K splits for every layout (only T must split, never a document)
        for name in LAYOUT_NAMES:
            replay_plan(name, n - 1, n, cu, True)  # build_plan refuses a packed length it cannot split
    with pytest.raises(ValueError, match="--doc-mean"):
        packed_documents(4096, 0)


def test_efficiency_is_the_whole_batch_per_rank_over_the_busiest_rank():
    assert efficiency(80.0, 8, 10.0) == pytest.approx(1.0)
    assert efficiency(80.0, 8, 20.0) == pytest.approx(0.5)
    assert efficiency(12.0, 4, 2.0) == pytest.approx(1.5)  # faster than a perfect split: reported, not hidden
    assert efficiency(None, 8, 10.0) is None and efficiency(80.0, 8, None) is None


def test_the_replayed_plan_is_the_ranks_packed_plan_with_its_needs_only_setting():
    cu = packed_documents(256, 32)
    for needs in (True, False):
        plan, transport = replay_plan("balanced", 2, 4, cu, needs)
        assert (plan.rank, plan.world_size, plan.cu_seqlens, plan.needs_only) == (2, 4, cu, needs)
        assert plan.causal is True and plan.layout.name == "balanced" and plan.transport is transport


class _Script:
    """A timer that runs each call once and returns the next scripted time: (fwd, fwd+bwd) per rank."""

    def __init__(self, times: list[float]):
        self.times, self.calls = list(times), 0

    def __call__(self, fn, repeats: int) -> float:
        fn()
        self.calls += 1
        return self.times.pop(0)


def _args(**kw) -> argparse.Namespace:
    base = dict(heads=4, kv_heads=2, head_dim=16, dtype="float32", kernel="auto", repeats=1)
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_a_layout_row_replays_every_rank_and_sends_what_the_model_says(layout):
    n, cu = 4, packed_documents(1024, 96)
    args = _args()
    shape = AttentionShape(1, args.heads, args.kv_heads, args.head_dim, elem_bytes=4)
    needs_bytes, whole_bytes = model_bytes(layout, cu[-1], n, shape, cu)
    # rank r's (fwd, fwd+bwd); rank 2 has the slowest forward, rank 1 the slowest forward+backward
    script = [3.0, 9.0, 4.0, 12.0, 5.0, 11.0, 1.0, 2.0]
    rows = {}
    for needs in (True, False):
        timer = _Script(script)
        rows[needs] = row = layout_row(args, n, cu, layout, needs, (16.0, 40.0), device="cpu", timer=timer)
        assert row.error is None, row.error
        assert timer.calls == 2 * n
        assert (row.busiest_fwd_ms, row.busiest_fwdbwd_ms, row.busiest_rank) == (5.0, 12.0, 1)
        assert (row.ideal_fwd_ms, row.ideal_fwdbwd_ms) == (4.0, 10.0)
        assert row.fwd_efficiency == pytest.approx(4.0 / 5.0) and row.fwdbwd_efficiency == pytest.approx(10.0 / 12.0)
    # the replay's transport counted what the engine sent: the work model's figure, needs-only and whole
    assert rows[True].sent_mib == pytest.approx(needs_bytes / 2**20) == pytest.approx(rows[True].model_mib)
    assert rows[False].sent_mib == pytest.approx(whole_bytes / 2**20) == pytest.approx(rows[False].model_mib)
    assert rows[True].sent_mib <= rows[False].sent_mib


def test_a_layout_row_reports_a_failure_instead_of_raising():
    row = layout_row(_args(kernel="no_such_kernel"), 2, packed_documents(64, 8), "zigzag", True, (1.0, 2.0),
                     device="cpu", timer=_Script([1.0] * 4))
    assert isinstance(row, PackedRow) and "no_such_kernel" in row.error and row.busiest_fwdbwd_ms is None


def test_without_a_whole_batch_time_the_row_has_times_but_no_efficiency():
    row = layout_row(_args(), 2, packed_documents(64, 8), "contiguous", False, (None, None), device="cpu",
                     timer=_Script([1.0, 2.0, 3.0, 4.0]))
    assert row.error is None and row.busiest_fwdbwd_ms == 4.0
    assert row.ideal_fwdbwd_ms is None and row.fwdbwd_efficiency is None


def test_the_auto_row_names_the_kernel_it_picks_for_every_block_kind():
    picks = kernel_picks(get_kernel("auto", "cuda", torch.bfloat16, head_dim=128, v_head_dim=128))
    assert set(picks) == set(BLOCK_KINDS) and picks["varlen"] == "flash"
    assert all(name is None or get_kernel(name, "cuda", torch.bfloat16).name == name for name in picks.values())
    assert kernel_picks(get_kernel("flash", "cuda", torch.bfloat16)) == {"all": "flash"}


class _SchemaOps:
    """``torch.ops.aten``'s two FA2 ops as stand-ins that bind each call to the real op's schema (this
    torch's: the same arguments as torch 2.11's) and answer with tensors of the op's shapes."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []

    def _bind(self, name: str, args: tuple, kwargs: dict) -> dict:
        schema = getattr(torch.ops.aten, name).default._schema
        positional = [a for a in schema.arguments if not a.kwarg_only]
        assert len(args) == len(positional), (name, len(args))
        assert set(kwargs) <= {a.name for a in schema.arguments if a.kwarg_only}, kwargs
        bound = {a.name: x for a, x in zip(positional, args)} | kwargs
        kinds = {"Tensor": torch.Tensor, "Optional[Tensor]": torch.Tensor, "int": int, "float": float,
                 "bool": bool, "Optional[float]": float}
        for a in schema.arguments:
            if a.name in bound:
                assert isinstance(bound[a.name], kinds[str(a.type)]), (name, a.name, type(bound[a.name]))
        self.calls.append((name, bound))
        return bound

    def _flash_attention_forward(self, *args, **kwargs):
        b = self._bind("_flash_attention_forward", args, kwargs)
        q, v = b["query"], b["value"]
        out = torch.zeros(*q.shape[:2], v.shape[-1], dtype=q.dtype)
        return out, torch.zeros(q.shape[1], q.shape[0]), torch.zeros(2), torch.zeros(0), torch.zeros(0)

    def _flash_attention_backward(self, *args, **kwargs):
        b = self._bind("_flash_attention_backward", args, kwargs)
        assert b["logsumexp"].shape == (b["query"].shape[1], b["query"].shape[0])
        return torch.zeros_like(b["query"]), torch.zeros_like(b["key"]), torch.zeros_like(b["value"])


def test_the_whole_batch_baseline_calls_the_varlen_op_by_its_schema():
    cu, ops = packed_documents(512, 64), _SchemaOps()
    base = whole_batch(_args(repeats=3), cu, timer=_Script([2.0, 7.0]), device="cpu", ops=ops)
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    assert base.error is None and (base.fwd_ms, base.fwdbwd_ms) == (2.0, 7.0)
    assert (base.tokens, base.documents, base.longest) == (512, len(lengths), max(lengths))
    assert [name for name, _ in ops.calls] == ["_flash_attention_forward", "_flash_attention_forward",
                                               "_flash_attention_backward"]
    for _, b in ops.calls:
        # the whole batch as one varlen call: [T, H, D], every document's bounds, causal, no dropout
        assert b["query"].shape == (512, 4, 16) and b["key"].shape == (512, 2, 16)
        assert b["cum_seq_q"].tolist() == list(cu) and b["cum_seq_k"].dtype == torch.int32
        assert (b["max_q"], b["max_k"], b["is_causal"], b["dropout_p"]) == (max(lengths), max(lengths), True, 0.0)
        assert b["scale"] == pytest.approx(16 ** -0.5)


def test_the_whole_batch_baseline_reports_a_failure():
    base = whole_batch(_args(), packed_documents(64, 8), timer=_Script([1.0, 1.0]), device="cpu")
    assert base.error and base.fwd_ms is None  # the real op has no CPU kernel
