"""The floating dtypes cp_attention accepts, by the names configs and command lines use."""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "FLOAT_DTYPES", "dtype_from_name"]

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
FLOAT_DTYPES: tuple[torch.dtype, ...] = tuple(DTYPES.values())


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (``"float32"``, ``"bfloat16"``, ...).

    Raises ``ValueError`` for a name not in :data:`DTYPES`, listing the known ones.
    """
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown dtype {name!r}; expected one of: {', '.join(DTYPES)}") from None
