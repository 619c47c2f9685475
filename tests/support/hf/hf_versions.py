"""What the installed transformers has, for HF adapter tests that run on every version cp_attention supports
(cp_attention/versions.py: FLOORS to TESTED): the release that brought each name or behaviour a test
needs, read from that release's sources, and a skip mark naming it on older ones."""

from __future__ import annotations

import pytest

from cp_attention.versions import installed_version, parse_version

# transformers honours config.is_causal=False (bidirectional masks) from 5.2; before, the model stays causal.
BIDIRECTIONAL_CONFIG = (5, 2)
# create_causal_mask & co. take ``inputs_embeds`` from 5.2 (``input_embeds`` before) and ``cache_position``
# (required) before 5.4.
INPUTS_EMBEDS = (5, 2)
# PreTrainedModel.is_activation_checkpointing (and activation_checkpointing_enable/disable) from 5.23;
# is_gradient_checkpointing (& co.) before, deprecated after.
ACTIVATION_CHECKPOINTING = (5, 23)


def transformers_release() -> tuple[int, ...]:
    """The installed transformers' release numbers, e.g. ``(5, 24, 0)``; ``()`` when it is absent."""
    version = installed_version("transformers")
    return () if version is None else parse_version(version)


def has(release: tuple[int, ...]) -> bool:
    """Whether the installed transformers is ``release`` or newer."""
    return transformers_release() >= release


def needs(release: tuple[int, ...], what: str) -> pytest.MarkDecorator:
    """Skip the test on a transformers older than ``release``, naming ``what`` it lacks."""
    shown = ".".join(map(str, release))
    return pytest.mark.skipif(not has(release), reason=f"needs transformers >= {shown}: {what} (installed: "
                                                        f"{installed_version('transformers')})")


def checkpointing_on(model) -> bool:
    """Whether transformers' activation checkpointing is on, read under the name the installed version has."""
    return model.is_activation_checkpointing if has(ACTIVATION_CHECKPOINTING) else model.is_gradient_checkpointing
