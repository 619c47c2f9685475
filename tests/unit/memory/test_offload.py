"""``cp_attention.memory.offload`` on the CPU: checkpointing with the saved input in a host copy, fp64
exact against the plain function; between forward and backward the input's own storage is gone and only
the stash's copy (a different storage) holds it; the recompute starts from that copy."""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from cp_attention.memory import offload as off
from cp_attention.memory import offload_checkpoint

TOL = 1e-10


class Stashes(off.HostStash):
    """The HostStash, every one made kept in ``made`` (the test's window onto what the offload keeps)."""

    made: list = []

    def __init__(self, tensor):
        super().__init__(tensor)
        Stashes.made.append(self)
        self.restored = 0

    def restore(self):
        self.restored += 1
        return super().restore()


@pytest.fixture
def stashes(monkeypatch):
    Stashes.made = []
    monkeypatch.setattr(off, "HostStash", Stashes)
    return Stashes.made


def _layers(seed=0):
    torch.manual_seed(seed)
    lins = [torch.nn.Linear(8, 8).double() for _ in range(3)]

    def layer(i):
        def run(h, scale):
            return torch.tanh(lins[i](h)) * scale + h
        return run
    return lins, [layer(i) for i in range(3)]


def _run(lins, fns, x, wrap, keep=None):
    h = x * 2  # MulBackward0 with a number saves nothing: only the checkpoint could keep h alive
    for fn in fns:
        if keep is not None:
            keep.append(StorageWeakRef(h.untyped_storage()))
        h = wrap(fn, h, 0.5)
    return h.square().sum()


def test_equals_the_plain_layers_and_the_inputs_leave(stashes):
    lins, fns = _layers()
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    params = [x, *(p for lin in lins for p in lin.parameters())]
    ref = _run(lins, fns, x, lambda f, h, s: f(h, s))
    ref_grads = torch.autograd.grad(ref, params)
    inputs: list = []
    loss = _run(lins, fns, x, offload_checkpoint, keep=inputs)
    # between forward and backward: every layer's input storage is freed, its values live in a stash of
    # another storage, none restored yet
    assert [w.expired() for w in inputs] == [True] * 3
    assert len(stashes) == 3 and all(s.restored == 0 for s in stashes)
    assert all(s.host.device.type == "cpu" and s.host.requires_grad is False for s in stashes)
    first = (x.detach() * 2)
    assert torch.equal(stashes[0].host, first)
    grads = torch.autograd.grad(loss, params)
    assert [s.restored for s in stashes] == [1, 1, 1]  # each recompute started from its stash
    assert abs(loss.item() - ref.item()) < TOL
    for a, b in zip(grads, ref_grads):
        assert (a - b).abs().max().item() < TOL


def test_plain_checkpointing_keeps_the_input():
    """The storage check above can fail: plain non-reentrant checkpointing keeps each layer's input."""
    lins, fns = _layers()
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    inputs: list = []
    loss = _run(lins, fns, x, lambda f, h, s: torch.utils.checkpoint.checkpoint(f, h, s, use_reentrant=False),
                keep=inputs)
    assert [w.expired() for w in inputs] == [False] * 3
    loss.backward()


def test_retain_graph_recomputes_twice_and_no_grad_input(stashes):
    lins, fns = _layers()
    x = torch.randn(1, 4, 8, dtype=torch.float64)  # no grad: the stash restores a tensor without grad too
    loss = _run(lins, fns, x, offload_checkpoint)
    w = lins[0].weight
    g1 = torch.autograd.grad(loss, w, retain_graph=True)[0]
    g2 = torch.autograd.grad(loss, w)[0]
    assert torch.equal(g1, g2) and [s.restored for s in stashes] == [2, 2, 2]
    assert [s.requires_grad for s in stashes] == [False, True, True]  # the later inputs depend on weights
    ref = torch.autograd.grad(_run(lins, fns, x, lambda f, h, s: f(h, s)), w)[0]
    assert (g1 - ref).abs().max().item() < TOL


def test_a_first_argument_that_is_no_float_tensor_is_checkpointed_as_it_is(stashes):
    w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    out = offload_checkpoint(lambda idx, t: (t[idx] @ w).sin().sum(), torch.tensor([0, 2]),
                             torch.randn(3, 3, dtype=torch.float64))
    out.backward()
    assert stashes == [] and w.grad is not None
