"""Test support for megatron: see tests/support/__init__.py."""
