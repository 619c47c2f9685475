"""Adapters that patch existing models (HuggingFace, Megatron-core) to use ring attention.

Installed as ``cp_attention.integrations``. Adapters hold glue only, no attention math; each imports
its framework lazily and says which extra to install when it is missing.
"""
