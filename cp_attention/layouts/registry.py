"""The one layout registry: every layout by name and alias, with its own causal ring schedule when
it has one (built-in layouts get theirs from :mod:`cp_attention.schedules.causal`).

A layout without a schedule of its own still runs everywhere: its blocks are derived from its
positions (see :func:`cp_attention.schedules.derived.block_schedules`).
"""

from __future__ import annotations

from typing import Callable

from .balanced import BalancedLayout
from .base import Layout
from .builtin import ContiguousLayout, InterleavedLayout, ZigzagLayout

__all__ = ["LAYOUT_NAMES", "get_layout", "layout_names", "layout_schedule", "register_layout"]

# Every known layout by canonical name, built-in first, then those registered, in that order, with
# its causal schedule (None: derived from its positions).
_LAYOUTS: dict[str, Layout] = {}
_SCHEDULES: dict[str, Callable | None] = {}
_BY_NAME: dict[str, Layout] = {}  # lower-case name or alias -> layout


def register_layout(layout: Layout, schedule: Callable | None = None) -> None:
    """Make a layout resolvable by its name and aliases (``get_layout("mine")``), optionally with its
    causal ring schedule ``schedule(causal, rank, world_size, step, local_len) -> tuple[BlockTask, ...]``.

    Registering an equal layout again is a no-op (a given ``schedule`` replaces the old one), so a
    module that registers on import may be imported twice (spawned worker processes re-import it).
    Raises ``TypeError`` for a non-Layout and ``ValueError`` for a name that is empty or already taken
    by a different layout.
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"register_layout needs a Layout instance, got {type(layout).__name__}")
    if not layout.name:
        raise ValueError(f"{type(layout).__name__} has an empty name; set the class attribute `name`")
    names = [n.lower() for n in (layout.name, *layout.aliases)]
    for n in names:
        taken = _BY_NAME.get(n)
        if taken is not None and type(taken) is not type(layout):
            raise ValueError(f"layout name {n!r} is already taken by {taken!r}; choose another name")
    if layout.name not in _LAYOUTS:
        _LAYOUTS[layout.name] = layout
        _SCHEDULES[layout.name] = None
    _BY_NAME.update({n: _LAYOUTS[layout.name] for n in names})
    if schedule is not None:
        _SCHEDULES[layout.name] = schedule


def get_layout(layout: str | Layout) -> Layout:
    """Resolve a layout name (or alias, case-insensitive) or pass a :class:`Layout` through.

    Raises ``ValueError`` for an unknown name, listing the known ones (built-in and registered), and
    ``TypeError`` for something that is neither.
    """
    if isinstance(layout, Layout):
        return layout
    if not isinstance(layout, str):
        raise TypeError(f"layout must be a str or Layout, got {type(layout).__name__}")
    try:
        return _BY_NAME[layout.lower()]
    except KeyError:
        known = ", ".join(f"{lay.name} (aliases: {', '.join(lay.aliases)})" if lay.aliases else lay.name
                          for lay in _LAYOUTS.values())
        raise ValueError(f"unknown layout {layout!r}; expected one of: {known}") from None


def layout_names() -> tuple[str, ...]:
    """Canonical names of every registered layout, in registration order (built-in first)."""
    return tuple(_LAYOUTS)


def layout_schedule(layout: str | Layout) -> Callable | None:
    """The causal ring schedule registered for ``layout``, or None (its blocks then derive from its
    positions). Raises what :func:`get_layout` raises."""
    return _SCHEDULES.get(get_layout(layout).name)


for _builtin in (ContiguousLayout(), ZigzagLayout(), InterleavedLayout(), BalancedLayout()):
    register_layout(_builtin)
LAYOUT_NAMES: tuple[str, ...] = layout_names()  # the built-in layouts
