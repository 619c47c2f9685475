"""Adapters that patch existing models (HuggingFace, Megatron-core) to use ring attention.

Installed as ``cp_attention.integrations``: the sub-packages ``huggingface`` and ``megatron`` (the
one-all-gather verdict both use is the core's ``cp_attention.checks.verdicts``). Adapters hold glue
only, no attention math; each imports its framework lazily and says which extra to install when it
is missing. An adapter imports the core and its own sub-package only
(``tests/unit/structure/test_rooms.py``).
"""
