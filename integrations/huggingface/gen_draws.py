"""One random draw for the whole group: what makes sampling under :func:`~.generation.generate` pick the
same tokens on every rank, whatever each rank's random generator holds.

Every rank computes the same probabilities bit for bit, but each draws from its own generator: ranks
seeded differently (or loopback ranks, threads of one process that share one generator) would pick
different tokens, and every later step would merge partial results computed for different tokens.
So while :func:`shared_draws` is active, each ``torch.multinomial`` (transformers' only draw: sampling
and beam sampling) counts on group rank 0 alone and reaches the other ranks in one small all-reduce of
the chosen indices (``[B, k]`` int64; rank 0's draw, zeros elsewhere). The other ranks also draw, from
a scratch generator, and throw the result away: their own generators are left untouched, and a
distribution ``torch.multinomial`` refuses (``nan``, ``inf``) raises the same error on every rank
instead of leaving rank 0's peers waiting in the all-reduce.

The interception is a ``TorchFunctionMode`` (its stack is per thread, as a loopback rank is). It is
paused during the model's forward (a per-op Python hook there would slow decoding down); it is active
in between, where transformers processes the logits and draws. No host sync is added: on NCCL the
all-reduce stays on the device.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode, _pop_mode, _push_mode

__all__ = ["shared_draws"]

_DRAWS = (torch.multinomial, torch.Tensor.multinomial)


class _SharedDraws(TorchFunctionMode):
    """Rank 0's draws, shared with every rank (see the module docstring)."""

    def __init__(self, transport: Any) -> None:
        super().__init__()
        self.transport = transport
        self.paused = False
        self._scratch: dict[torch.device, torch.Generator] = {}

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None
                           ) -> Any:
        kwargs = kwargs or {}
        if func not in _DRAWS:
            return func(*args, **kwargs)
        if self.transport.rank != 0:
            # the same checks as rank 0's draw, from a generator nobody else reads
            kwargs = {**kwargs, "generator": self._scratch_for(args[0].device)}
        drawn = func(*args, **kwargs)
        if self.transport.rank != 0:
            drawn.zero_()
        # rank 0's indices plus zeros: rank 0's draw on every rank (the sum of integers is exact)
        return self.transport.all_reduce_sum_(drawn)

    def _scratch_for(self, device: torch.device) -> torch.Generator:
        if device not in self._scratch:
            self._scratch[device] = torch.Generator(device=device)
        return self._scratch[device]


@contextlib.contextmanager
def shared_draws(model: torch.nn.Module, transport: Any) -> Iterator[None]:
    """Inside, every ``torch.multinomial`` of this thread outside ``model``'s forward returns group rank 0's
    draw on every rank of ``transport`` (one all-reduce of the drawn indices per draw)."""
    mode = _SharedDraws(transport)

    @torch.compiler.disable  # mode-stack bookkeeping: eager even in a compiled module's call
    def pause(module: torch.nn.Module, args: tuple) -> None:
        if _get_current_function_mode() is mode:  # ours, on this thread (not a mode pushed above it)
            _pop_mode()
            mode.paused = True

    @torch.compiler.disable
    def resume(module: torch.nn.Module, args: tuple, output: Any) -> None:
        if mode.paused:
            mode.paused = False
            _push_mode(mode)

    # prepend: the CP forward checks run without the mode; always_call: resumed even if the forward raised
    handles = [model.register_forward_pre_hook(pause, prepend=True),
               model.register_forward_hook(resume, always_call=True)]
    _push_mode(mode)
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        if not mode.paused and _get_current_function_mode() is mode:
            _pop_mode()
