"""Entry points that ``torch.compile`` never traces: each call is a graph break and runs eagerly.

What talks to other ranks (the ring, the agreement checks, plans, collectives) runs Python that Dynamo
cannot or must not trace: blocking collectives whose results are read on the host, caches keyed by
object identity, locks, weak references, a process group's C++ object. Traced, it fails inside Dynamo
or, worse, bakes one call's host decisions into a graph that later calls replay. So each public entry
point is wrapped by :func:`eager_only`: under ``torch.compile`` the call is a graph break (the model's
own math around it still compiles) and ``fullgraph=True`` fails naming the entry point and why.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import torch

__all__ = ["eager_only"]

F = TypeVar("F", bound=Callable[..., Any])


def eager_only(name: str) -> Callable[[F], F]:
    """Decorator: ``fn`` runs eagerly under ``torch.compile``, as a graph break named ``name``.

    Outside compilation the wrapper calls ``fn`` at once (one ``is_compiling()`` check, no host sync).
    ``torch.compiler.disable`` is applied lazily, at the first traced call: it imports ``torch._dynamo``
    (about a second), which an eager user of the library should not pay for at import. That first
    traced call takes an explicit graph break first, so ``fullgraph=True`` fails with this reason
    rather than with Dynamo's note about a skipped ``torch.compiler.disable``.
    """
    reason = (f"{name} talks to the other context-parallel ranks and decides on the host (agreement checks, "
              "plans, collectives), so it runs eagerly: a graph break under torch.compile. Compile without "
              "fullgraph=True (the model's other ops still compile); see docs/guides/compile.md")

    def wrap(fn: F) -> F:
        disabled: list[Callable[..., Any]] = []  # [torch.compiler.disable(fn)], made at the first traced call

        @functools.wraps(fn)
        def entry(*args: Any, **kwargs: Any) -> Any:
            if not torch.compiler.is_compiling():
                return fn(*args, **kwargs)
            if not disabled:
                import torch._dynamo as dynamo  # loaded already: Dynamo is tracing this call

                dynamo.graph_break(msg=reason)
                disabled.append(torch.compiler.disable(fn, reason=reason))
            return disabled[0](*args, **kwargs)

        return entry  # type: ignore[return-value]

    return wrap
