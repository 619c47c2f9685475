"""``cp_attention.memory.offload`` on CUDA without a GPU: fake CUDA tensors (torch's FakeTensorMode, as in
``tests/unit/kernels/test_fake_cuda.py``) and recording stand-ins for the stream and event plumbing. The copy
out runs on the side stream after it waited for the current one, into pinned host memory, ``non_blocking``,
followed by an event and ``record_stream``; the copy back waits for that event on the current stream and is
``non_blocking`` from pinned memory; nothing reads device data on the host. The autograd engine refuses
CUDA tensors on a CPU-only build, so the recompute is started the way backward starts it: by unpacking a
tensor the checkpoint saved."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from cp_attention.memory import offload as off
from tests.support.cuda.fake_cuda_support import _SYNC_OPS, _is_pinned, _pin_memory, cuda_guard_problem

aten = torch.ops.aten


class Stream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: Stream) -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: Event) -> None:
        self.log.append(("wait_event", self.name, event.id))


class Event:
    def __init__(self, log: list) -> None:
        self.log, self.id = log, sum(1 for e in log if e[0] == "record")

    def record(self, stream: Stream) -> None:
        self.log.append(("record", stream.name, self.id))


class Copies(TorchDispatchMode):
    """Every copy between devices as ``("copy", src, dst, non_blocking, src_pinned)``, every op that reads
    device data on the host as ``("sync", op)``."""

    def __init__(self, log: list) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        if packet in _SYNC_OPS:
            self.log.append(("sync", str(func)))
        if packet is aten.copy_:
            dst, src = args[0], args[1]
            nb = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            self.log.append(("copy", src.device.type, dst.device.type, nb, _is_pinned(src)))
        elif packet is aten._to_copy and kwargs.get("device") is not None:
            src = args[0]
            if torch.device(kwargs["device"]).type != src.device.type:
                self.log.append(("copy", src.device.type, torch.device(kwargs["device"]).type,
                                 kwargs.get("non_blocking", False), _is_pinned(src)))
        return out


@pytest.fixture(scope="module")
def guard():
    """The no-op CUDA device guard (built once, in a compiler subprocess: before the per-test check that
    tests not marked dist start no process)."""
    problem = cuda_guard_problem()
    if problem is not None:
        pytest.skip(f"fake CUDA needs a no-op CUDA device guard: {problem}")


@pytest.fixture
def fake(guard, monkeypatch):
    log: list = []
    stashes: list = []

    class Recorded(off.HostStash):
        def __init__(self, tensor):
            super().__init__(tensor)
            stashes.append(self)

    streams = {"current": Stream("current", log), "side": Stream("side", log)}

    @contextlib.contextmanager
    def on_stream(stream):
        log.append(("enter", stream.name))
        yield
        log.append(("exit", stream.name))

    monkeypatch.setattr(torch.Tensor, "pin_memory", _pin_memory)  # a CPU build cannot pin: mark instead
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(off, "_current_stream", lambda device: streams["current"])
    monkeypatch.setattr(off, "_side_stream", lambda device: streams["side"])
    monkeypatch.setattr(off, "_on_stream", on_stream)
    monkeypatch.setattr(off, "_new_event", lambda: Event(log))
    monkeypatch.setattr(off, "_keep_until_done", lambda t, s: log.append(("keep", t.device.type, s.name)))
    monkeypatch.setattr(off, "HostStash", Recorded)
    # the real function allocates with pin_memory=True, which a CPU build cannot: the same buffer, marked
    monkeypatch.setattr(off, "_pinned_empty", lambda like: torch.empty(like.shape, dtype=like.dtype).pin_memory())
    with FakeTensorMode(allow_non_fake_inputs=True), Copies(log):
        yield log, stashes


COPY_OUT = [("wait_stream", "side", "current"), ("enter", "side"), ("copy", "cuda", "cpu", True, False),
            ("record", "side", 0), ("exit", "side"), ("keep", "cuda", "side")]
COPY_BACK = [("wait_event", "current", 0), ("copy", "cpu", "cuda", True, True)]


def test_stash_copies_out_and_back_without_waiting(fake):
    log, stashes = fake
    x = torch.empty(2, 16, 8, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    stash = off.HostStash(x)
    assert log == COPY_OUT
    assert stash.host.device.type == "cpu" and _is_pinned(stash.host) and stash.host.dtype == torch.bfloat16
    back = stash.restore()
    assert log == COPY_OUT + COPY_BACK
    assert back.device.type == "cuda" and back.requires_grad and back.is_leaf and back.shape == x.shape


def test_offload_checkpoint_forward_and_recompute(fake):
    """The forward copies the layer's input out (and runs the layer once); the recompute, started by
    unpacking a saved tensor, copies it back and runs the layer again on it; no host read anywhere."""
    log, stashes = fake
    w = torch.empty(8, 8, device="cuda", requires_grad=True)
    x = torch.empty(2, 16, 8, device="cuda", requires_grad=True)
    seen = []

    def layer(h, scale):
        seen.append(h)
        return torch.tanh(h @ w) * scale + h

    out = off.offload_checkpoint(layer, x * 2, 0.5)
    assert len(seen) == 1 and seen[0].device.type == "cuda"
    assert len(stashes) == 1
    stash = stashes[0]
    assert stash.host.device.type == "cpu" and _is_pinned(stash.host)
    assert [e for e in log if e[0] in ("copy", "sync")] == [("copy", "cuda", "cpu", True, False)]
    del seen[0]
    _ = out.grad_fn.next_functions[0][0].next_functions[0][0]._saved_result  # tanh's output: the recompute
    assert len(seen) == 1 and seen[0].device.type == "cuda" and seen[0].is_leaf and seen[0].requires_grad
    assert [e for e in log if e[0] in ("copy", "sync", "wait_event")] == \
        [("copy", "cuda", "cpu", True, False), *COPY_BACK]

