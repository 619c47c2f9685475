"""Optional dependencies: say which extra to install when one is missing."""

from __future__ import annotations

import importlib.util
from typing import Sequence

__all__ = ["require_extra"]


def require_extra(extra: str, modules: Sequence[str], what: str) -> None:
    """Raise ``ImportError`` naming ``extra`` if any of ``modules`` cannot be imported.

    ``what`` is the part of cp_attention that needs them, for the message.
    """
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(
            f"{what} needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not installed; "
            f"install the '{extra}' extra: pip install 'cp_attention[{extra}]' (from a checkout: "
            f"pip install -e '.[{extra}]')"
        )
