"""A per-token function over sequence chunks: ALST's TiledMLP (arXiv 2506.13996) as one autograd Function.

Forward runs ``function`` on each chunk under ``no_grad`` and keeps only its input; backward recomputes
each chunk under ``enable_grad`` and takes that chunk's gradients with ``torch.autograd.grad``, so at most
one chunk's intermediates (an MLP's ``S/n x intermediate`` activations) are alive at any time, forward or
backward. The parameters are inputs of the Function: their gradients reach them through the autograd
graph (``AccumulateGrad``), where FSDP2's and DDP's hooks see them.

Exact only for a function that treats every position alone (a dense MLP): the chunks' results are those
of the whole input up to floating-point reordering inside the matmuls.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

__all__ = ["TiledFunction", "chunk_bounds", "tiled_apply"]


def chunk_bounds(length: int, chunks: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]``: ``length`` positions cut into at most ``chunks`` non-empty pieces whose
    sizes differ by at most one (the first ``length % chunks`` one longer); fewer pieces when ``length <
    chunks``, one empty piece ``(0, 0)`` when ``length == 0`` (so the function still runs once).

    Raises ``ValueError`` unless ``chunks`` is a positive int."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive int, got {chunks!r}")
    if length <= 0:
        return [(0, 0)]
    base, extra = divmod(length, chunks)
    bounds, start = [], 0
    for i in range(min(chunks, length)):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def _checked(out, piece: torch.Tensor, name: str) -> torch.Tensor:
    """``out`` if it is one tensor of ``piece``'s shape (metadata only: no host sync); else ``TypeError`` or
    ``ValueError``."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name} returned {type(out).__name__}, not one tensor: it cannot run over sequence "
                        "chunks (a block that also returns router logits or scores is not a per-token MLP); "
                        "leave mlp_chunks=None for it")
    if out.shape != piece.shape:
        raise ValueError(f"{name} returned shape {tuple(out.shape)} for an input of shape {tuple(piece.shape)}: "
                         "only a function whose output has its input's shape can run over sequence chunks; "
                         "leave mlp_chunks=None for it")
    return out


class TiledFunction(torch.autograd.Function):
    """``function`` over chunks of ``x`` along ``dim``; see the module docstring. Inputs: ``(function,
    bounds, dim, name, x, *params)``; ``params`` are the tensors ``function`` reads whose gradients are wanted."""

    @staticmethod
    def forward(ctx, function: Callable, bounds: list, dim: int, name: str, x: torch.Tensor, *params):
        out = None
        with torch.no_grad():
            for start, stop in bounds:
                piece = x.narrow(dim, start, stop - start)
                y = _checked(function(piece), piece, name)
                if out is None:  # the output dtype is the function's (autocast may change it)
                    if len(bounds) == 1:
                        out = y
                        break
                    out = torch.empty(x.shape, dtype=y.dtype, device=y.device)
                out.narrow(dim, start, stop - start).copy_(y)
                del y  # this chunk's result is in `out`; free it before the next chunk runs
        ctx.function, ctx.bounds, ctx.dim = function, bounds, dim
        # the parameters themselves, not saved tensors: they are alive anyway, and a checkpoint around this
        # Function would count saved ones as activations (and swap them for recomputed copies)
        ctx.params = params
        ctx.autocast = _autocast_state(x.device.type)
        ctx.save_for_backward(x)  # the only tensor kept: no intermediate of the function
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        needs_x = ctx.needs_input_grad[4]
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[5:]) if need]
        params = ctx.params
        grad_x = torch.empty_like(x) if needs_x else None
        grads: list = [None] * len(params)
        if not needs_x and not wanted:
            return (None, None, None, None, grad_x, *grads)
        device_type, enabled, dtype = ctx.autocast
        for start, stop in ctx.bounds:
            piece = x.narrow(ctx.dim, start, stop - start).detach().requires_grad_(needs_x)
            with torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled):
                y = ctx.function(piece)
            targets = ([piece] if needs_x else []) + [params[i] for i in wanted]
            found = torch.autograd.grad(y, targets, grad_out.narrow(ctx.dim, start, stop - start),
                                        allow_unused=True)
            del y
            if grad_x is not None:  # needs_x
                grad_x.narrow(ctx.dim, start, stop - start).copy_(found[0])
                found = found[1:]
            for i, g in zip(wanted, found):
                if g is not None:
                    grads[i] = g if grads[i] is None else grads[i].add_(g)
        return (None, None, None, None, grad_x, *grads)


def _autocast_state(device_type: str) -> tuple[str, bool, torch.dtype]:
    """The forward's autocast state, restored around the backward's recompute (the Function's backward
    does not run under the forward's autocast)."""
    if not torch.amp.is_autocast_available(device_type):
        return "cpu", False, torch.get_autocast_dtype("cpu")  # a valid, disabled context
    return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def tiled_apply(function: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, params: Sequence[torch.Tensor],
                chunks: int, dim: int = -2, name: str = "the tiled function") -> torch.Tensor:
    """``function(x)`` computed over ``chunks`` pieces of ``x`` along ``dim``, keeping only ``x`` for the
    backward (see the module docstring). ``function`` must treat every position along ``dim`` alone and
    return one tensor of its input's shape; ``params``: the tensors it reads whose gradients are wanted
    (e.g. ``tuple(mlp.parameters())``), the same objects it reads when called again in backward.
    ``name`` names ``function`` in errors.

    Raises ``ValueError`` unless ``chunks`` is a positive int or if ``x`` has no dim ``dim``; ``TypeError``
    / ``ValueError`` (at the call) if ``function`` returns anything but one tensor of its input's shape."""
    if x.dim() == 0 or not -x.dim() <= dim < x.dim():
        raise ValueError(f"tiled_apply: x of shape {tuple(x.shape)} has no dim {dim} to cut into chunks")
    dim = dim % x.dim()
    bounds = chunk_bounds(x.shape[dim], chunks)
    return TiledFunction.apply(function, bounds, dim, name, x, *params)

