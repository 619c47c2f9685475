"""Activation checkpointing whose saved input waits in host memory: :func:`offload_checkpoint`.

Non-reentrant checkpointing keeps, per checkpointed layer, only what it needs to run the layer again:
the layer's input (the hidden states, ``S x hidden``). Here that input is copied to host memory in the
forward and brought back for the recompute in backward, so the device keeps no per-layer activation.

On CUDA nothing waits on the host: the copy out runs on a side stream that first waits for the current
one (which produced the input), into pinned memory, ``non_blocking``; an event marks its end, and
``record_stream`` tells the caching allocator that the side stream still reads the input, so its memory
is reused only after the copy. The copy back is ``non_blocking`` on the current stream after it waits
for that event. The stream and event plumbing sits in small functions (``_current_stream``,
``_side_stream``, ``_on_stream``, ``_new_event``, ``_keep_until_done``, ``_pinned_empty``) that a test
without a GPU replaces. On the CPU the "host copy" is a plain copy (nothing to gain; the same semantics).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["HostStash", "offload_checkpoint"]

_SIDE_STREAMS: dict = {}  # device -> the side stream its copies out run on (one per device, made on first use)


# ------------------------------------------------------------------- the plumbing (replaced in tests)
def _current_stream(device: torch.device):
    return torch.cuda.current_stream(device)


def _side_stream(device: torch.device):
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


def _on_stream(stream):
    return torch.cuda.stream(stream)


def _new_event():
    return torch.cuda.Event()


def _keep_until_done(tensor: torch.Tensor, stream) -> None:
    tensor.record_stream(stream)


def _pinned_empty(like: torch.Tensor) -> torch.Tensor:
    return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=True)


# ------------------------------------------------------------------------------------------ the stash
class HostStash:
    """A copy of one tensor in host memory, made without a host sync, and its way back (:meth:`restore`).

    ``tensor``: any tensor; a CUDA one is copied into pinned memory on a side stream (see the module
    docstring), one on another device synchronously, a CPU one into a fresh CPU tensor. The stash keeps
    no reference to ``tensor``. Attributes: ``host`` (the copy), ``device``, ``requires_grad``."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.device = tensor.device
        self.requires_grad = tensor.requires_grad
        self.event = None
        src = tensor.detach()
        if src.device.type == "cuda":
            self.host = _pinned_empty(src)
            current, side = _current_stream(src.device), _side_stream(src.device)
            side.wait_stream(current)  # the copy reads what the current stream is still writing
            with _on_stream(side):
                self.host.copy_(src, non_blocking=True)
                self.event = _new_event()
                self.event.record(side)
            _keep_until_done(src, side)  # the allocator must not hand src's memory out before the copy ran
        elif src.device.type == "cpu":
            self.host = src.clone(memory_format=torch.contiguous_format)
        else:
            self.host = src.to("cpu")

    def restore(self) -> torch.Tensor:
        """The tensor back on its device, a new leaf with the original's ``requires_grad`` (so a recompute
        from it saves the same tensors as the forward did). On CUDA: ``non_blocking``, ordered after the
        copy out by the current stream waiting for its event."""
        if self.device.type == "cuda":
            _current_stream(self.device).wait_event(self.event)
            back = self.host.to(self.device, non_blocking=True)
        elif self.device.type == "cpu":
            back = self.host
        else:
            back = self.host.to(self.device)
        return back.detach().requires_grad_(self.requires_grad)


def _offloadable(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def offload_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` under non-reentrant activation checkpointing, its first argument (a layer's
    hidden states) kept in host memory until the backward's recompute (see the module docstring).

    The signature of transformers' ``_gradient_checkpointing_func`` (``function`` is the layer's forward
    with its keyword arguments bound). Only the first argument is moved; the others stay where they are
    (shared by every layer: masks, rotary tables). A first argument that is no floating-point tensor is
    checkpointed as it is. Nothing here keeps the device tensor: the checkpoint gets a closure that runs
    the forward on the original and the recompute on the restored copy. Returns what ``function`` returns."""
    if not args or not _offloadable(args[0]):
        return checkpoint(function, *args, use_reentrant=False)
    stash = HostStash(args[0])
    original: list = [args[0]]  # handed to the forward's run, then dropped
    rest = args[1:]
    del args

    def run():
        x = original.pop() if original else stash.restore()
        return function(x, *rest)

    return checkpoint(run, use_reentrant=False)

