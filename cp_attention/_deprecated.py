"""Deprecated names, kept importable for one release: a module's ``__getattr__`` that answers an old
name with the new object and a ``DeprecationWarning`` naming its replacement (PEP 562)."""

from __future__ import annotations

import warnings
from typing import Any, Callable

__all__ = ["deprecated_names", "warn_renamed"]


def warn_renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that ``old`` is deprecated in favour of ``new`` (both as the caller writes them)."""
    warnings.warn(f"{old} is deprecated and will be removed in the next release; use {new}", DeprecationWarning,
                  stacklevel=stacklevel)


def deprecated_names(module: str, renamed: dict[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``module`` that answers each old name of ``renamed`` (old -> new) with
    ``namespace[new]`` and a ``DeprecationWarning``; any other name raises ``AttributeError`` as usual."""

    def __getattr__(name: str) -> Any:
        new = renamed.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warn_renamed(f"{module}.{name}", f"{module}.{new}")
        return namespace[new]

    return __getattr__
