"""Test support for hf: see tests/support/__init__.py."""
