"""Test support for core: see tests/support/__init__.py."""
