"""``cp_attention.memory.tiled``: a per-token function over sequence chunks (ALST's TiledMLP) against the
same function on the whole input, fp64: values, the input's and the parameters' gradients, chunk counts
that do not divide the length or exceed it, gradcheck, and what the Function keeps for backward."""

from __future__ import annotations

import pytest
import torch

from cp_attention.memory import chunk_bounds, tiled_apply

TOL = 1e-10


def _mlp(hidden: int = 8, inner: int = 24, seed: int = 0) -> torch.nn.Module:
    """A gated (SwiGLU) MLP like Llama's, fp64."""
    torch.manual_seed(seed)

    class GatedMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(hidden, inner, bias=False)
            self.up = torch.nn.Linear(hidden, inner)
            self.down = torch.nn.Linear(inner, hidden)

        def forward(self, x):
            return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))

    return GatedMLP().double()


def _grads(mlp, x, out, seed=5):
    g = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(seed))
    mlp.zero_grad(set_to_none=True)
    x.grad = None
    out.backward(g)
    return [x.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]


@pytest.mark.parametrize("seq,chunks", [(12, 4), (13, 4), (7, 3), (3, 5), (1, 2), (10, 1)])
def test_tiled_mlp_equals_the_whole_mlp(seq, chunks):
    """Values and every gradient (input, each parameter), chunk counts dividing the length or not, and
    more chunks than positions (fewer, non-empty chunks)."""
    mlp = _mlp()
    x = torch.randn(2, seq, 8, dtype=torch.float64, requires_grad=True)
    ref = mlp(x)
    ref_grads = _grads(mlp, x, ref)
    out = tiled_apply(mlp, x, tuple(mlp.parameters()), chunks)
    assert (out - ref).abs().max().item() < TOL
    got = _grads(mlp, x, out)
    for a, b in zip(got, ref_grads):
        assert (a - b).abs().max().item() < TOL


def test_the_function_runs_once_per_chunk_and_backward_once_more():
    mlp = _mlp()
    sizes = []
    handle = mlp.register_forward_pre_hook(lambda m, args: sizes.append(args[0].shape[1]))
    x = torch.randn(1, 10, 8, dtype=torch.float64, requires_grad=True)
    out = tiled_apply(mlp, x, tuple(mlp.parameters()), 4)
    assert sizes == [3, 3, 2, 2]
    out.sum().backward()
    assert sizes == [3, 3, 2, 2] * 2
    handle.remove()


def test_only_the_input_is_kept_for_backward():
    """No intermediate of the MLP survives the forward: everything autograd saved is the input itself."""
    mlp = _mlp()
    x = torch.randn(1, 9, 8, dtype=torch.float64, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        tiled_apply(mlp, x, tuple(mlp.parameters()), 3)
    assert len(saved) == 1 and saved[0] is x
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mlp(x)
    assert len(saved) > 3  # the plain MLP keeps its intermediates: the check above can tell


def test_frozen_parameters_and_an_input_without_grad():
    mlp = _mlp()
    mlp.up.weight.requires_grad_(False)
    x = torch.randn(1, 6, 8, dtype=torch.float64)  # no grad: only the parameters' gradients
    g = torch.randn(1, 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    mlp(x).backward(g)
    ref = {name: p.grad.clone() for name, p in mlp.named_parameters() if p.requires_grad}
    mlp.zero_grad(set_to_none=True)
    tiled_apply(mlp, x, tuple(mlp.parameters()), 4).backward(g)
    assert mlp.up.weight.grad is None and x.grad is None
    got = {name: p.grad for name, p in mlp.named_parameters() if p.requires_grad}
    assert got.keys() == ref.keys() and len(got) == 4
    for name in ref:
        assert (got[name] - ref[name]).abs().max().item() < TOL


def test_gradcheck():
    w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)

    def f(x, w, b):
        return tiled_apply(lambda c: torch.nn.functional.linear(c, w, b).tanh() * c, x, (w, b), 3)

    assert torch.autograd.gradcheck(f, (x, w, b))


def test_other_dims_and_an_empty_sequence():
    mlp = _mlp()
    x = torch.randn(7, 8, dtype=torch.float64, requires_grad=True)  # (tokens, hidden): chunks along dim 0
    assert (tiled_apply(mlp, x, tuple(mlp.parameters()), 3, dim=0) - mlp(x)).abs().max().item() < TOL
    empty = torch.randn(2, 0, 8, dtype=torch.float64, requires_grad=True)
    out = tiled_apply(mlp, empty, tuple(mlp.parameters()), 4)
    assert out.shape == (2, 0, 8)
    out.sum().backward()
    assert empty.grad.shape == empty.shape


def test_chunk_bounds():
    assert chunk_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert chunk_bounds(3, 5) == [(0, 1), (1, 2), (2, 3)]
    assert chunk_bounds(0, 2) == [(0, 0)]
    for bad in (0, -1, 2.0, True, None):
        with pytest.raises(ValueError, match="positive int"):
            chunk_bounds(4, bad)


def test_refuses_a_function_that_is_not_shape_preserving():
    x = torch.randn(1, 4, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match=r"probe returned shape \(1, 2, 5\)"):
        tiled_apply(lambda c: c @ w.T, x, (w,), 2, name="probe")
    with pytest.raises(TypeError, match="probe returned tuple, not one tensor"):
        tiled_apply(lambda c: (c, c), x, (), 2, name="probe")
    with pytest.raises(ValueError, match="no dim 3"):
        tiled_apply(lambda c: c, x, (), 2, dim=3)


def test_backward_recomputes_under_the_forwards_autocast():
    """The Function's backward does not run under the forward's autocast by itself: the recompute
    restores it, so it computes what the forward computed (bf16 matmuls here)."""
    mlp = _mlp().float()
    seen = []
    mlp.register_forward_pre_hook(lambda m, args: seen.append(torch.is_autocast_enabled("cpu")))
    x = torch.randn(1, 6, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = mlp(x)
        out = tiled_apply(mlp, x, tuple(mlp.parameters()), 2)
    assert out.dtype == ref.dtype == torch.bfloat16
    assert (out.float() - ref.float()).abs().max().item() < 1e-2
    out.float().sum().backward()
    assert seen == [True] * 5  # the plain call, two chunks forward, two again in backward
    assert x.grad.dtype == torch.float32 and torch.isfinite(x.grad).all()
