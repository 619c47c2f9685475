"""Entry points that ``torch.compile`` never traces: each call is a graph break and runs eagerly.

What talks to other ranks (the ring, the agreement checks, plans, collectives) runs Python that Dynamo
cannot or must not trace: blocking collectives whose results are read on the host, caches keyed by
object identity, locks, weak references, a process group's C++ object. Traced, it fails inside Dynamo
("Member 'exchange' is not registered") or, worse, bakes one call's host decisions into a graph that
later calls replay. So each public entry point is wrapped by :func:`eager_only`: under
``torch.compile`` the call is a graph break (the model's own math around it still compiles), and
``fullgraph=True`` fails at it, naming it. See docs/guides/compile.md.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch

__all__ = ["eager_only", "EAGER_REASON"]

F = TypeVar("F", bound=Callable[..., Any])

EAGER_REASON = ("context-parallel attention talks to the other ranks and decides on the host (agreement checks, "
                "plans, collectives), so it runs eagerly: a graph break under torch.compile; see "
                "docs/guides/compile.md")


def eager_only(fn: F) -> F:
    """``fn``, run eagerly under ``torch.compile``: each call is a graph break, never traced.

    ``torch.compiler.disable`` with :data:`EAGER_REASON`: its wrapper lives in a file Dynamo skips, so
    no frame of ours is ever compiled around the call, and ``fullgraph=True`` fails at it with
    Dynamo's "Skip calling torch.compiler.disable()d function" naming ``fn`` and the reason. It
    imports ``torch._dynamo`` (about a second, once per process, as the first traced or eager call
    would with torch's lazy variant). Outside compilation a call costs about a microsecond more and
    never syncs with the device.
    """
    return torch.compiler.disable(fn, reason=EAGER_REASON)
