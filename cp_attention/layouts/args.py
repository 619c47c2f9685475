"""Argument checks the layouts share: ints that must be ints, dims that must exist."""

from __future__ import annotations

import operator

__all__ = ["as_int", "check_dim"]


def as_int(name: str, value) -> int:
    """``value`` as an int (Python, numpy or 0-d integer tensor), else ``ValueError`` (bools too)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None


def check_dim(dim, ndim: int, what: str) -> int:
    """``dim`` of an ``ndim``-D tensor, made non-negative; ``ValueError`` if there is no such dimension."""
    if ndim == 0:
        raise ValueError(f"{what} needs a tensor with a sequence dimension, got a 0-D tensor")
    dim = as_int("dim", dim)
    if not -ndim <= dim < ndim:
        raise ValueError(f"{what}: dim {dim} is out of range for a {ndim}-D tensor (expected {-ndim} <= dim < {ndim})")
    return dim % ndim


# The shard each rank passes to Layout.gather, as ints every rank can compare: a problem code, the
# tensor's rank, the dim, the local length, a fingerprint of everything else about the shard, and the
