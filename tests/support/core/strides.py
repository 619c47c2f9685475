"""Tensors that hold the same values as a contiguous one but whose last dimension is not contiguous:
the forms users make without meaning to (a permuted copy viewed back, a strided slice). Shared by the
strided-input tests on the CPU kernels, the loopback strategies and the fake-CUDA kernels."""

from __future__ import annotations

import torch

__all__ = ["STRIDE_FORMS", "restride"]


def _transposed(t: torch.Tensor) -> torch.Tensor:
    # [B, S, H, D] stored as [B, H, D, S]: the last dim's stride is S
    return t.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)


def _step2(t: torch.Tensor) -> torch.Tensor:
    # every other column of a twice-as-wide tensor: the last dim's stride is 2
    return torch.stack([t, torch.zeros_like(t)], -1).flatten(-2)[..., ::2]


STRIDE_FORMS = {"transposed": _transposed, "step2": _step2}


def restride(t: torch.Tensor, form: str) -> torch.Tensor:
    """``t``'s values in the memory form ``form`` (a key of :data:`STRIDE_FORMS`), detached, with
    ``t``'s ``requires_grad``; its last dimension never has stride 1 (for a last dim longer than 1)."""
    out = STRIDE_FORMS[form](t.detach())
    assert t.shape[-1] == 1 or out.stride(-1) != 1, out.stride()
    return out.requires_grad_(t.requires_grad)
