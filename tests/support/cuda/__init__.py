"""Test support for cuda: see tests/support/__init__.py."""
