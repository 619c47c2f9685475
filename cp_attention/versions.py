"""The versions of what cp_attention builds on that it supports, written once.

``setup.py`` reads :data:`FLOORS` (by path, before anything is installed: this module imports the standard
library only) for its requirements, the README's install table repeats it (a test compares the two), and
``make test-floor`` installs exactly these versions and runs the tests on them. :data:`TESTED` is the newest
version of each that the suite ran on; a newer one is allowed (no check can know what a future release
changes), an older one than the floor is refused by :func:`require_version` before anything runs.
"""

from __future__ import annotations

import importlib.metadata
import re

__all__ = ["FLOORS", "TESTED", "parse_version", "installed_version", "require_version"]

# The lowest release of each that the code supports and ``make test-floor`` tests.
FLOORS: dict[str, str] = {
    "torch": "2.9.1",
    "transformers": "5.0.0",
    "accelerate": "1.4.0",
    "trl": "1.3.0",
    "megatron-core": "0.16.0",
}
# The newest release of each that the suite ran on (``make test`` on CI installs the newest).
TESTED: dict[str, str] = {
    "torch": "2.13.0",
    "transformers": "5.24.0",
    "accelerate": "1.15.0",
    "trl": "1.16.0",
    "megatron-core": "0.16.1",
}


def parse_version(text: str) -> tuple[int, ...]:
    """The release numbers of a version string: ``'2.13.0+cpu'`` -> ``(2, 13, 0)``, ``'5.0.0rc1'`` -> ``(5, 0, 0)``.

    Raises ``ValueError`` if ``text`` does not start with a number."""
    match = re.match(r"\d+(?:\.\d+)*", text.strip())
    if match is None:
        raise ValueError(f"cannot read a version number from {text!r}; expected e.g. '5.4.0'")
    return tuple(int(part) for part in match.group(0).split("."))


def installed_version(package: str) -> str | None:
    """The installed distribution's version string, or None when ``package`` is not installed."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def require_version(package: str, what: str, installed: str | None = None) -> None:
    """Refuse an installed ``package`` older than its floor in :data:`FLOORS`.

    ``what`` names the feature that needs it, for the message; ``installed`` overrides the installed
    version (tests). A package that is not installed passes: the import that needs it says so.
    Raises ``RuntimeError`` naming the installed version and the supported range."""
    version = installed if installed is not None else installed_version(package)
    if version is None:
        return
    floor = FLOORS[package]
    if parse_version(version) < parse_version(floor):
        raise RuntimeError(
            f"{what} needs {package} >= {floor} (supported: {floor} to {TESTED[package]} and newer), but "
            f"{package} {version} is installed; upgrade it: pip install '{package}>={floor}'")


if __name__ == "__main__":  # ``make test-floor``: the floors as pip constraints, one ``package==version`` a line
    print("\n".join(f"{package}=={version}" for package, version in FLOORS.items()))
