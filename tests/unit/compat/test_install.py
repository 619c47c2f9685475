"""``cp_attention.compat.install_ring_flash_attn``: ``import ring_flash_attn`` gives ours afterwards, it is
idempotent, and it refuses (registering nothing) when ring-flash-attention itself is already imported."""

from __future__ import annotations

import importlib
import sys
import types

import pytest

import cp_attention.compat
import cp_attention.compat.ring_flash_attn as ours
from cp_attention.compat import install_ring_flash_attn


def _rfa_keys() -> list[str]:
    return sorted(k for k in sys.modules if k == "ring_flash_attn" or k.startswith("ring_flash_attn."))


@pytest.fixture(autouse=True)
def no_ring_flash_attn_modules():
    """No ``ring_flash_attn*`` module during the test; exactly the ones there were before, after it."""
    saved = {k: sys.modules.pop(k) for k in _rfa_keys()}
    yield
    for k in _rfa_keys():
        del sys.modules[k]
    sys.modules.update(saved)


def _fake_real(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__file__ = f"/site-packages/{name.replace('.', '/')}.py"
    return module


def test_exported():
    assert "install_ring_flash_attn" in cp_attention.compat.__all__


def test_import_ring_flash_attn_gives_ours():
    assert install_ring_flash_attn() is ours
    module = importlib.import_module("ring_flash_attn")
    assert module is ours
    from ring_flash_attn import zigzag_ring_flash_attn_func  # noqa: PLC0415 - the caller's import, after install

    assert zigzag_ring_flash_attn_func is ours.zigzag_ring_flash_attn_func
    # the original's function modules, as a caller may import from them
    assert importlib.import_module("ring_flash_attn.stripe_flash_attn").stripe_flash_attn_func \
        is ours.stripe_flash_attn_func


def test_idempotent():
    first = install_ring_flash_attn()
    keys = _rfa_keys()
    assert install_ring_flash_attn() is first
    assert _rfa_keys() == keys


@pytest.mark.parametrize("already", ["ring_flash_attn", "ring_flash_attn.utils"])
def test_refuses_when_the_real_package_is_imported(already):
    """Also after a partial import (the package's __init__ failed, its submodules stayed)."""
    fake = _fake_real(already)
    sys.modules[already] = fake
    with pytest.raises(RuntimeError, match=r"ring-flash-attention is already imported .*"
                                           r"install_ring_flash_attn\(\) before anything imports ring_flash_attn"):
        install_ring_flash_attn()
    assert _rfa_keys() == [already] and sys.modules[already] is fake
