"""The rooms of the code and their levels, written once (see docs/design.md, "Rooms and levels").

``setup.py`` reads this file by path to install :data:`PACKAGE_ROOMS` (before anything is installed: it
imports nothing), and ``tests/unit/structure`` checks every import against :data:`LEVELS`,
:data:`ABOVE_CORE` and :data:`FORBIDDEN_ABOVE`.
"""

__all__ = ["CORE_ROOMS", "LEVELS", "ABOVE_CORE", "PACKAGE_ROOMS", "CHECKOUT_ROOMS", "FORBIDDEN_ABOVE"]

# The core's sub-packages, bottom up, with their levels: a room imports rooms of its own level or below.
_CORE_LEVELS = {"kernels": 0, "transport": 0, "memory": 0, "layouts": 1, "schedules": 2, "checks": 3, "engine": 4,
                "strategies": 5}
CORE_ROOMS = tuple(_CORE_LEVELS)
# Every core room and top-level module of cp_attention/, by level.
LEVELS = {**_CORE_LEVELS, "api": 6, "__init__": 6, "_extras": 0, "_deprecated": 0, "launch": 0, "versions": 0,
          "rooms": 0}
# The levels above the core, bottom up: the adapters (integrations/, installed as cp_attention.integrations),
# then the launcher and the drop-ins, side by side.
ABOVE_CORE = ("integrations", "training", "compat")
# The sub-packages of cp_attention/ that setup.py installs (integrations/ is mapped in by its package_dir).
PACKAGE_ROOMS = (*CORE_ROOMS, "training", "compat")
# A checkout's folders, never installed: above everything, and nothing in the package imports them.
CHECKOUT_ROOMS = ("benchmarks", "studies", "examples")
# Level -> the rooms above it (or outside the package) it must not import.
FORBIDDEN_ABOVE = {
    "core": {*ABOVE_CORE, *CHECKOUT_ROOMS},
    "integrations": {"training", "compat", *CHECKOUT_ROOMS},
    "training": {"compat", *CHECKOUT_ROOMS},
    "compat": {"training", *CHECKOUT_ROOMS},  # the drop-ins sit beside training, above the adapters
}
