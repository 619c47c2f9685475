"""The in-process loopback ring (cp_attention/transport/loopback.py) is exact on CPU: the GPU tests and the GPU
benchmark rely on it to run N ranks on one device."""

from __future__ import annotations

import threading

import pytest
import torch

from cp_attention.transport.loopback import LoopbackGroup
from tests.support.core.loopback_cases import loopback_errors, loopback_refusal


def _assert_exact(errors: dict) -> None:
    bad = {k: v for k, v in errors.items() if v > 0}
    assert not bad, f"beyond tolerance: {bad}"


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "interleaved"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_loopback_ring_is_exact(layout, world_size, causal):
    _assert_exact(loopback_errors(world_size, layout=layout, causal=causal))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "interleaved"])
def test_loopback_packed_and_windowed(layout):
    _assert_exact(loopback_errors(4, layout=layout, causal=True, local_len=10, lengths=[1, 13, 3, 20, 3]))
    _assert_exact(loopback_errors(4, layout=layout, causal=True, local_len=16, window=(5, -1), kernel="math"))


def test_loopback_refusal_on_every_rank():
    messages = loopback_refusal(3, bad_rank=1)
    assert len(set(messages)) == 1 and "on rank 1" in messages[0], messages


def test_loopback_messages_match_in_posting_order():
    # Two exchanges posted before either is waited on, and waited on in the reverse order: each
    # receive still gets the message posted in the same position, as with gloo and NCCL.
    loop = LoopbackGroup(2)

    def body(group):
        me = group.rank
        first = torch.empty(1)
        second = torch.empty(1)
        a = group.exchange([torch.tensor([10.0 * me + 1])], [first], hop=1)
        b = group.exchange([torch.tensor([10.0 * me + 2])], [second], hop=1)
        b.wait()
        a.wait()
        return first.item(), second.item()

    assert loop.run(body) == [(11.0, 12.0), (1.0, 2.0)]


def test_loopback_missing_message_times_out_instead_of_hanging():
    loop = LoopbackGroup(2, timeout_s=0.5)

    def body(group):
        if group.rank == 0:
            group.exchange([], [torch.empty(1)], hop=1).wait()  # rank 1 never sends

    with pytest.raises(RuntimeError, match="did not arrive"):
        loop.run(body)


def test_loopback_group_needs_a_positive_size():
    with pytest.raises(ValueError, match="world_size >= 1"):
        LoopbackGroup(0)


def test_each_rank_runs_its_own_backward():
    """By design no loopback backward can deadlock: each rank thread runs its autograd backward itself
    (multithreading off in it), never queued behind another rank's on a shared device thread. Shown
    here by the flag each rank sees and by the thread each rank's backward runs on."""
    loop = LoopbackGroup(3)

    class Where(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            ctx_thread.append(threading.current_thread().name)
            return grad

    ctx_thread: list = []

    def body(group):
        x = torch.ones(2, requires_grad=True)
        Where.apply(x).sum().backward()
        return torch._C._is_multithreading_enabled(), threading.current_thread().name

    results = loop.run(body)
    assert [flag for flag, _ in results] == [False] * 3
    assert sorted(ctx_thread) == sorted(name for _, name in results)
    assert torch._C._is_multithreading_enabled()  # the caller's own setting is untouched


def test_training_reduces_gradients_over_loopback_ranks():
    """reduce_gradients takes a transport as its group: summed over CP, averaged over DP."""
    from cp_attention.training import reduce_gradients

    def body(group):
        p = torch.nn.Parameter(torch.zeros(2))
        p.grad = torch.full((2,), float(group.rank + 1))
        reduce_gradients([p], cp_group=group)
        q = torch.nn.Parameter(torch.zeros(2))
        q.grad = torch.full((2,), float(group.rank + 1))
        reduce_gradients([q], cp_group=LoopbackGroup(1).rank(0), dp_group=group)
        return p.grad.tolist(), q.grad.tolist()

    assert LoopbackGroup(2).run(body) == [([3.0, 3.0], [1.5, 1.5])] * 2
