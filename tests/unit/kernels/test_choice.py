"""Issue 41: ``auto``'s declared table, each kernel's refusals, and flash's native windows, proven on CPU
(the CUDA ops' stand-ins of ``tests/support/cuda/aten_standins.py``: the real schemas, the CUDA code's checks
and masking conventions, computed in fp64)."""

from __future__ import annotations

import pytest
import torch

from cp_attention.checks.blocks import named_kernel_problem
from cp_attention.kernels import BLOCK_KINDS, cuda_cudnn, cuda_efficient, cuda_flash, get_kernel
from cp_attention.kernels._cuda import band_pieces
from cp_attention.kernels.choice import AUTO_TABLE, KernelChoice
from cp_attention.layouts import get_layout
from tests.support.cuda.aten_standins import AtenStandIns
from tests.support.cuda.flash_attn_standin import attend, band

FP16 = torch.float16
TOL = dict(atol=2e-5, rtol=1e-5)


@pytest.fixture
def aten(monkeypatch):
    ops = AtenStandIns()
    for mod in (cuda_flash, cuda_efficient, cuda_cudnn):
        monkeypatch.setattr(mod, "_aten", ops)
    return ops


def _flash_sees(sq: int, sk: int, left: int, right: int) -> torch.Tensor:
    """What flash's dense op lets a ``[Sq, Sk]`` call see for these windows (mha_fwd/mha_bwd: a side
    >= Sk becomes unbounded, then bottom-right alignment)."""
    left, right = (-1 if w >= sk else w for w in (left, right))
    allowed = band(sq, sk, left, right)
    return torch.ones(sq, sk, dtype=torch.bool) if allowed is None else allowed


def _bands(limit: int):
    """Every (Sq, Sk, lo, hi) up to ``limit`` whose band lets every query row see a key."""
    for sq in range(1, limit + 1):
        for sk in range(1, limit + 1):
            for lo in range(-sq - 1, sk + 1):
                for hi in range(lo, sk + sq + 1):
                    offset = torch.arange(sk)[None] - torch.arange(sq)[:, None]
                    want = (offset >= lo) & (offset <= hi)
                    if want.any(1).all():
                        yield sq, sk, lo, hi, want


def test_band_pieces_compute_every_band_exactly():
    """Every band of every small block: the pieces cover each query row once, and what flash's op
    sees in them (its clamp included) is exactly the band, with every window -1 or within the piece's
    keys (so the clamp is never relied on)."""
    count = split = 0
    for sq, sk, lo, hi, want in _bands(9):
        got = torch.zeros(sq, sk, dtype=torch.bool)
        rows_seen = torch.zeros(sq, dtype=torch.int64)
        pieces = band_pieces(sq, sk, lo, hi)
        for rows, keys, left, right in pieces:
            n = keys.stop - keys.start
            assert 0 < n and all(w == -1 or 0 <= w < n for w in (left, right)), (sq, sk, lo, hi, pieces)
            got[rows, keys] = _flash_sees(rows.stop - rows.start, n, left, right)
            rows_seen[rows] += 1
        assert torch.equal(got, want), (sq, sk, lo, hi, pieces)
        assert (rows_seen == 1).all(), (sq, sk, lo, hi, pieces)
        count += 1
        split += len(pieces) > 1
    assert count > 5_000 and split > 0  # the clamp case is among them


@pytest.mark.parametrize("sq, sk, lo, hi", [(16, 16, -5, 0), (16, 24, 3, 9), (12, 20, -4, 6), (20, 6, -30, 1),
                                            (5, 3, -10, 1), (9, 14, 2, 2), (8, 8, -100, 100)])
def test_flash_runs_windows_natively(aten, sq, sk, lo, hi):
    """A band on ``flash``: window_size_left/right on the op (no mask, no other op), forward, LSE and
    backward equal fp64 attention under the band."""
    g = torch.Generator().manual_seed(sq * 31 + sk)
    q, k, v = (torch.randn(2, n, h, 16, generator=g) for n, h in ((sq, 4), (sk, 2), (sk, 2)))
    offset = torch.arange(sk)[None] - torch.arange(sq)[:, None]
    allowed = (offset >= lo) & (offset <= hi)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    out, lse = attend(qd, kd, vd, 0.3, allowed)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(out, (qd, kd, vd), dout)
    kern = get_kernel("flash", "cuda", FP16, mask=True)
    o, l = kern.forward(q, k, v, False, 0.3, band=(lo, hi))
    torch.testing.assert_close(o.double(), out.detach(), **TOL)
    torch.testing.assert_close(l.double(), lse.detach(), **TOL)
    got = kern.backward(dout.float(), q, k, v, out.detach().float(), lse.detach().float(), False, 0.3, band=(lo, hi))
    for a, b in zip(got, grads):
        torch.testing.assert_close(a.double(), b, **TOL)
    ops = {op for op, _ in aten.calls}
    assert ops == {"_flash_attention_forward", "_flash_attention_backward"}, ops
    assert all(a["window_size_left"] is not None and not a["is_causal"] for _, a in aten.calls)


@pytest.mark.parametrize("sq, sk, causal, runs_on", [
    (8, 8, True, "cudnn"), (8, 8, False, "cudnn"), (12, 5, True, "cudnn"),
    (1, 9, True, "flash"), (9, 1, True, "flash"), (1, 1, False, "flash"), (6, 5, True, "flash"),  # 1-row piece
])
def test_auto_gives_blocks_cudnn_refuses_to_the_next_kernel(aten, sq, sk, causal, runs_on):
    """On sm90 dense blocks run on cuDNN, except blocks with a one-token side (or a causal block whose
    full part is one row): those run on flash, exactly, forward and backward."""
    choice = get_kernel("auto", "cuda", FP16)
    assert choice.route("causal" if causal else "full", sq, sk, causal).name == runs_on
    g = torch.Generator().manual_seed(sq * 13 + sk)
    q, k, v = (torch.randn(1, n, 4, 8, generator=g) for n in (sq, sk, sk))
    allowed = torch.ones(sq, sk, dtype=torch.bool).tril() if causal else None
    out, lse = attend(q.double(), k.double(), v.double(), 0.5, allowed)
    o, l = choice.forward(q, k, v, causal, 0.5)
    torch.testing.assert_close(o.double(), out, **TOL)
    torch.testing.assert_close(l.double(), lse, **TOL)
    choice.backward(torch.ones_like(o), q, k, v, o, l, causal, 0.5)
    prefix = "_scaled_dot_product_cudnn" if runs_on == "cudnn" else "_flash_attention"
    assert aten.calls and all(op.startswith(prefix) for op, _ in aten.calls), [op for op, _ in aten.calls]


@pytest.mark.parametrize("capability, want", [
    ((9, 0), {"causal": "cudnn", "full": "cudnn", "window": "flash", "varlen": "flash", "masked": "efficient"}),
    ((10, 0), {"causal": "cudnn", "full": "cudnn", "window": "flash", "varlen": "flash", "masked": "efficient"}),
    ((8, 0), {"causal": "flash", "full": "flash", "window": "flash", "varlen": "flash", "masked": "efficient"}),
    ((8, 9), {"causal": "flash", "full": "flash", "window": "flash", "varlen": "flash", "masked": "efficient"}),
    ((7, 5), {"causal": "efficient", "full": "efficient", "window": "efficient", "varlen": None,
              "masked": "efficient"}),
])
def test_the_table_by_gpu_generation(monkeypatch, capability, want):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert get_kernel("auto", "cuda", FP16, head_dim=128).picks == want


def test_the_table_names_only_registered_kernels_and_every_kind():
    from cp_attention.kernels import KERNEL_NAMES
    for row in AUTO_TABLE:
        for kind in BLOCK_KINDS:
            assert set(row.order(kind)) <= set(KERNEL_NAMES), (row, kind)
            # the reference ends every list that has one: auto never fails where math can run a block
            assert not row.order(kind) or kind == "varlen" or row.order(kind)[-1] == "math", (row, kind)


def test_auto_on_a_cpu_and_on_other_devices():
    assert get_kernel("auto", "cpu", torch.float32).picks == {
        "causal": "cpu_flash", "full": "cpu_flash", "window": "cpu_flash", "varlen": None, "masked": "cpu_flash"}
    assert set(get_kernel("auto", "meta", torch.float32).picks.values()) == {"math", None}
    assert isinstance(get_kernel("auto", "cpu", torch.float64), KernelChoice)


@pytest.mark.parametrize("layout, world, local_len, comm, refused", [
    ("zigzag", 2, 2, "p2p", True),  # halves of one token
    ("zigzag", 2, 4, "p2p", False),
    ("contiguous", 4, 1, "p2p", True),  # a one-token shard
    ("contiguous", 2, 2, "p2p", False),
    ("interleaved", 2, 2, "p2p", True),  # its strictly-lower diagonal block is 1x1
    ("interleaved", 2, 3, "p2p", False),
    ("zigzag", 2, 8, "all_gather", False),
    ("zigzag", 2, 2, "all_gather", True),
])
def test_a_named_kernel_is_refused_for_blocks_it_cannot_run(layout, world, local_len, comm, refused):
    cudnn = get_kernel("cudnn", "cuda", FP16)
    problem = named_kernel_problem("cudnn", cudnn, get_layout(layout), True, world, local_len, False, False, comm)
    assert (problem is not None) == refused, problem
    if refused:
        assert "kernel 'cudnn' cannot run a" in problem and "use kernel='auto'" in problem
    # flash takes every block shape
    assert named_kernel_problem("flash", get_kernel("flash", "cuda", FP16), get_layout(layout), True, world,
                                local_len, True, True, comm) is None


def test_a_named_kernel_that_refuses_one_token_blocks_is_refused_for_documents_and_windows():
    cudnn = get_kernel("cudnn", "cuda", FP16)
    zigzag = get_layout("zigzag")
    packed = named_kernel_problem("cudnn", cudnn, zigzag, True, 2, 64, True, False, "p2p")
    assert packed.startswith("kernel 'cudnn' cannot run packed documents") and "kernel='flash'" in packed
    assert "sliding windows" in named_kernel_problem("cudnn", cudnn, zigzag, True, 2, 64, False, True, "p2p")
