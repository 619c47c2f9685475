"""Which :func:`~.generation.generate` this thread runs, if any: what the patched model's hooks, mask and
attention ask to tell a generation's prefill and decoding steps from a plain forward. Per thread, since
a loopback rank is a thread."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

__all__ = ["active_generation", "decoding", "running"]

_LOCAL = threading.local()


@contextlib.contextmanager
def running(generation: Any) -> Iterator[None]:
    """Make ``generation`` (a :class:`~.generation.Generation`) this thread's active one inside."""
    previous, _LOCAL.generation = getattr(_LOCAL, "generation", None), generation
    try:
        yield
    finally:
        _LOCAL.generation = previous


def active_generation(state: Any) -> Any | None:
    """The generation this thread runs on the model whose CP state is ``state``, if any."""
    gen = getattr(_LOCAL, "generation", None)
    return gen if gen is not None and gen.state is state else None


def decoding() -> bool:
    """Whether this thread is in a decoding step of a generation (after its prefill)."""
    gen = getattr(_LOCAL, "generation", None)
    return gen is not None and gen.prefilled
