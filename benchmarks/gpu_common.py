"""What the GPU benchmark's tables share (``benchmarks/gpu.py``, ``benchmarks/gpu_packed.py``): the
transport of a rank replayed alone, the forward / forward+backward pair of a call, and table cells (their
CUDA-event timing is ``benchmarks/measure.py``'s :func:`~benchmarks.measure.time_cuda`)."""

from __future__ import annotations

import re
from typing import Callable

import torch

__all__ = ["ReplayTransport", "fmt", "fwd_and_fwdbwd"]


class _Done:
    def wait(self) -> None:
        pass


class ReplayTransport:
    """A :class:`~cp_attention.transport.base.Transport` for one rank replayed alone: rank ``rank`` of
    ``world_size`` whose exchanges copy what it sends into what it receives, so its schedule runs with
    the memory traffic of a real receive. Collectives see only this rank (its own values).

    ``sent_bytes`` counts what the rank would have put on the wire, as every transport does (each
    exchange's send tensors; a collective's tensor once per other rank). With needs-only traffic a rank
    sends other rows than it receives, so the sizes differ: each receive buffer is filled with the first
    elements of the matching send tensor, and zeros past its end (or where nothing is sent). Only the
    memory traffic matters here, not the values."""

    host_agreement = False  # statuses are never exchanged: there is no one to agree with
    token = None

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.sent_bytes = 0

    def exchange(self, send, recv, hop: int = 1) -> _Done:
        self.sent_bytes += sum(t.numel() * t.element_size() for t in send)
        for i, r in enumerate(recv):
            s = send[i] if i < len(send) else None
            if s is not None and s.shape == r.shape:
                r.copy_(s)
                continue
            flat = r.view(-1)  # the engine's receive buffers are fresh, contiguous tensors
            m = 0 if s is None else min(s.numel(), flat.numel())
            if m:
                flat[:m].copy_(s.reshape(-1)[:m])
            flat[m:].zero_()
        return _Done()

    def all_gather_ints(self, values) -> list[list[int]]:
        return [list(values)] * self.world_size

    def all_gather_tensor(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.sent_bytes += tensor.numel() * tensor.element_size() * (self.world_size - 1)
        return [tensor] * self.world_size

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        self.sent_bytes += tensor.numel() * tensor.element_size() * (self.world_size - 1)
        return tensor.mul_(self.world_size)


def fwd_and_fwdbwd(call: Callable[..., torch.Tensor], q, k, v, dout) -> tuple[Callable, Callable]:
    def fwd():
        with torch.no_grad():
            call(q, k, v)

    def fwdbwd():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        call(*leaves).backward(dout)
    return fwd, fwdbwd


def fmt(x, spec: str) -> str:
    """``x`` formatted by ``spec``; None as ``-``, right-aligned to the spec's width so columns stay."""
    if x is not None:
        return format(x, spec)
    return "-".rjust(int(re.match(r"\d*", spec).group() or 0))
