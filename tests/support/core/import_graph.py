"""What a module imports, read from its source: every import statement (function bodies too), with
relative imports resolved. Shared by the layer and room tests."""

from __future__ import annotations

import ast

__all__ = ["imported_names"]


def imported_names(source: str, package: str) -> list[str]:
    """Absolute dotted names a module of ``package`` imports: ``import a.b`` gives ``a.b``, and
    ``from X import y`` gives ``X.y`` (a submodule or a name of ``X``)."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names += [f"{base}.{a.name}" for a in node.names]
    return names
