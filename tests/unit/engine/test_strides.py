"""Strides never change a result: q, k, v and dout with the same values in any memory form give the
contiguous tensors' exact attention, on every strategy and every CPU kernel, forward and backward.

The cause this guards against: PyTorch's CPU flash op (``kernel="auto"``'s choice on CPU) silently
computes garbage when a tensor's last dim is not contiguous. The kernel protocol says every tensor a
kernel receives has a unit last-dim stride; :func:`test_every_kernel_receives_unit_last_stride` checks
that property of the engine for whatever kernel runs. The CUDA kernels meet the same strided inputs on
fake CUDA tensors (tests/unit/kernels/test_fake_cuda.py, tests/unit/strategies/test_fake_cuda_strategies.py), where
the real ops' own stride checks refuse anything else.
"""

from __future__ import annotations

import pytest
import torch

from cp_attention import kernels
from cp_attention.kernels.base import unit_stride
from tests.support.core.loopback_cases import loopback_errors
from tests.support.core.strides import STRIDE_FORMS

# (cp_comm_type, world size, mesh shape): one rank alone, the ring at an odd N, and every other strategy
STRATEGIES = [("p2p", 1, None), ("p2p", 3, None), ("all_gather", 2, None), ("a2a", 2, None),
              ("a2a+p2p", 4, (2, 2))]
WHICH = [("q",), ("k",), ("v",), ("dout",), ("q", "k", "v", "dout")]
# A mask feature per case, so the strided inputs meet the packed, windowed and sink paths too.
FEATURES = {("p2p", 1): dict(layout="zigzag", causal=True),
            ("p2p", 3): dict(layout="interleaved", causal=True, lengths=[3, 7, 14], window=(4, 0)),
            ("all_gather", 2): dict(layout="zigzag", causal=True),
            ("a2a", 2): dict(layout="contiguous", causal=False, sinks=True, softcap=3.0, lse_grad=True),
            ("a2a+p2p", 4): dict(layout="zigzag", causal=True, window=(5, -1))}


def _case(comm: str, world: int) -> dict:
    return dict(FEATURES[comm, world])


@pytest.mark.parametrize("which", WHICH, ids=["+".join(w) for w in WHICH])
@pytest.mark.parametrize("form", list(STRIDE_FORMS))
@pytest.mark.parametrize("comm, world, mesh", STRATEGIES, ids=[f"{c}-N{n}" for c, n, _ in STRATEGIES])
def test_strided_inputs_are_exact(comm, world, mesh, form, which):
    errors = loopback_errors(world, cp_comm_type=comm, mesh_shape=mesh, strided=which, stride_form=form,
                             heads=4, kv_heads=2, v_dim=12, **_case(comm, world))
    assert max(errors.values()) <= 0.0, errors


@pytest.mark.parametrize("kernel", ["cpu_flash", "math"])
def test_strided_inputs_every_cpu_kernel(kernel):
    errors = loopback_errors(2, layout="zigzag", causal=True, kernel=kernel, strided=("q", "k", "v", "dout"),
                             stride_form="step2")
    assert max(errors.values()) <= 0.0, errors


class _StrideWatch:
    """A kernel as it is, recording the last-dim stride of every tensor it is handed."""

    def __init__(self, kernel, seen: list) -> None:
        self._kernel, self._seen = kernel, seen

    def __getattr__(self, name):
        return getattr(self._kernel, name)

    def _record(self, what: str, args) -> None:
        self._seen += [(what, i, t.stride(-1), t.shape[-1]) for i, t in enumerate(args) if isinstance(t, torch.Tensor)]

    def forward(self, *args, **kwargs):
        self._record("forward", args)
        return self._kernel.forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        self._record("backward", args)
        return self._kernel.backward(*args, **kwargs)


@pytest.mark.parametrize("comm, world, mesh", STRATEGIES, ids=[f"{c}-N{n}" for c, n, _ in STRATEGIES])
def test_every_kernel_receives_unit_last_stride(monkeypatch, comm, world, mesh):
    seen: list = []
    for name, kernel in list(kernels._KERNELS.items()):
        monkeypatch.setitem(kernels._KERNELS, name, _StrideWatch(kernel, seen))
    errors = loopback_errors(world, cp_comm_type=comm, mesh_shape=mesh, strided=("q", "k", "v", "dout"),
                             stride_form="transposed", **_case(comm, world))
    assert max(errors.values()) <= 0.0, errors
    assert seen, "no kernel call was watched"
    bad = [s for s in seen if s[2] != 1 and s[3] > 1]
    assert not bad, f"kernels got tensors whose last dim is not contiguous: {bad[:5]}"


def test_unit_stride_copies_only_when_needed():
    x = torch.randn(2, 5, 3, 4)
    assert unit_stride(x) is x
    assert unit_stride(x[:, 1:3]).data_ptr() == x[:, 1:3].data_ptr()  # a sequence slice stays a view
    y = x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    z = unit_stride(y)
    assert z.stride(-1) == 1 and torch.equal(z, x)
