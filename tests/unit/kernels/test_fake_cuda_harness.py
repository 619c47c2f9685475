"""The fake-CUDA harness catches what it says it catches (see ``test_fake_cuda.py``): host reads and
copies under the sync watcher, fused-op calls the real ops' checks reject, and mutant kernels that sync
in backward or return the LSE in the wrong layout fail a ring case."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.support.cuda.fake_cuda_cases import check_clean, env, ring_case  # noqa: F401 - env: the fixture
from tests.support.cuda.fake_cuda_checks import PreconditionError
from tests.support.cuda.fake_cuda_support import SyncWatch

# pad_head reads data_ptr(): a fake tensor's is its storage offset in bytes (a real one's is 256-aligned)
pytestmark = pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")


def _under_watch(env, fn) -> list:
    events: list = []
    watch = SyncWatch(events)
    watch.phase = "step"
    with env.lock, env.mode, watch:
        fn()
    return events


@pytest.mark.parametrize("what, fn", [
    (".item()", lambda x: x.sum().item()),
    (".tolist()", lambda x: x.tolist()),
    ("bool(t)", lambda x: bool(x[0] > 0)),
    ("nonzero", lambda x: torch.nonzero(x > 0)),
    ("int(t)", lambda x: int(x[0])),
])
def test_watch_catches_host_reads(env, what, fn):
    def go():
        try:
            fn(torch.empty(4, device="cuda"))
        except Exception:  # noqa: BLE001 - the fake mode refuses data-dependent results: the log is what counts
            pass
    assert [e for e in _under_watch(env, go) if e[1] == "d2h"], what


def test_watch_catches_copies(env):
    def go():
        x = torch.empty(4, device="cuda")
        x.cpu()
        torch.tensor([1, 2], device="cuda")
        torch.arange(3).to("cuda", non_blocking=True)  # pageable: the host waits all the same
        torch.arange(3).pin_memory().to("cuda", non_blocking=True)
    kinds = [e[1] for e in _under_watch(env, go)]
    assert kinds == ["d2h", "h2d_blocking", "h2d_blocking", "h2d_async"], kinds


def test_checked_ops_reject_bad_calls(env):
    from cp_attention.kernels import cuda_efficient, cuda_flash
    x = lambda *s: torch.empty(*s, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    with env.lock, env.mode:
        with pytest.raises(PreconditionError, match="head_size 100"):
            cuda_flash._aten._flash_attention_forward(x(1, 8, 2, 100), x(1, 8, 2, 100), x(1, 8, 2, 100), None, None,
                                                      8, 8, 0.0, False, False)
        with pytest.raises(TypeError, match="positional"):
            cuda_flash._aten._flash_attention_forward(x(1, 8, 2, 64), x(1, 8, 2, 64), x(1, 8, 2, 64), None, None,
                                                      8, 8, 0.0, False, False, 0.1)
        with pytest.raises(TypeError, match="unexpected or repeated argument 'softmax_scale'"):
            cuda_flash._aten._flash_attention_forward(x(1, 8, 2, 64), x(1, 8, 2, 64), x(1, 8, 2, 64), None, None,
                                                      8, 8, 0.0, False, False, softmax_scale=0.1)
        with pytest.raises(PreconditionError, match="no GQA"):
            cuda_efficient._aten._efficient_attention_forward(x(1, 8, 4, 64), x(1, 8, 2, 64), x(1, 8, 2, 64), None,
                                                              None, None, None, None, 0.0, 0, True)
        lse = torch.empty(1, 2, 8, device="cuda")
        seed = torch.zeros((), dtype=torch.int64, device="cuda")
        with pytest.raises(PreconditionError, match="round32"):
            cuda_efficient._aten._efficient_attention_backward(
                x(1, 8, 2, 64), x(1, 8, 2, 64), x(1, 8, 2, 64), x(1, 8, 2, 64), None, x(1, 8, 2, 64), None, None,
                8, 8, lse, 0.0, seed, seed, 0, False)


@pytest.mark.parametrize("mutation, kind", [
    ("a scalar read of a device tensor, its error swallowed", "d2h"),
    ("a constant made with torch.tensor(..., device=...)", "h2d_blocking"),
    ("an upload from pageable memory", "h2d_blocking"),
])
def test_ring_catches_a_host_sync_in_a_kernel(env, monkeypatch, mutation, kind):
    """A flash backward that syncs or copies each call must fail the case, naming where."""
    from cp_attention.kernels.cuda_flash import FlashKernel
    orig = FlashKernel._bwd

    def mutant(self, dout, q, *args, **kwargs):
        if kind == "d2h":
            try:
                dout.sum().item()
            except Exception:  # noqa: BLE001 - swallowed: only the watcher sees it
                pass
        elif "pageable" in mutation:
            torch.arange(4).to(q.device, non_blocking=True)
        else:
            torch.tensor([1.0], device=q.device)
        return orig(self, dout, q, *args, **kwargs)
    monkeypatch.setattr(FlashKernel, "_bwd", mutant)
    res = ring_case(env, 2, "flash", "zigzag", torch.bfloat16, layers=1)
    with pytest.raises(AssertionError, match=rf"{kind}: .* at cp_attention/kernels/_cuda.py:\d+ \(backward\) \[step\]"):
        check_clean(res, "flash")


def test_wrong_lse_layout_is_caught(env, monkeypatch):
    """A mutant flash kernel whose LSE comes back [B, Sq, H] must fail the case."""
    from cp_attention.kernels.cuda_flash import FlashKernel
    # the fake mode logs the meta kernel it could not run; the failure is what counts
    monkeypatch.setattr(logging.getLogger("torch._subclasses.fake_tensor"), "disabled", True)
    orig = FlashKernel._fwd
    monkeypatch.setattr(FlashKernel, "_fwd", lambda self, *a, **k: (lambda o: (o[0], o[1].transpose(1, 2)))(
        orig(self, *a, **k)))
    with pytest.raises(Exception):  # noqa: B017 - any failure: a shape check, a merge, a precondition
        res = ring_case(env, 2, "flash", "zigzag", torch.bfloat16, h=8, hkv=2, n=16, layers=1)
        check_clean(res, "flash")
