"""Which groups and strategy a megatron ring attention layer uses: the CP group (``pg_collection.cp``
or megatron's parallel state), the two-level group of ``cp_comm_type="a2a+p2p"`` (megatron's
hierarchical CP groups), and the layer's ``cp_comm_type``."""

from __future__ import annotations

from typing import Optional

import cp_attention as cpa
from cp_attention.transport.process_group import two_level_transport
from megatron.core import parallel_state

__all__ = ["resolve_cp_group", "layer_comm_type", "ring_group"]


def resolve_cp_group(pg_collection):
    if pg_collection is not None and getattr(pg_collection, "cp", None) is not None:
        return pg_collection.cp
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_context_parallel_group()
    # A None group would mean the whole world to torch.distributed, never "no CP".
    raise RuntimeError("RingDotProductAttention found no CP group; call megatron.core.parallel_state."
                       "initialize_model_parallel(context_parallel_size=...) first or pass a pg_collection "
                       "with a .cp group")


def layer_comm_type(config, layer_number: int, given: Optional[str], spec: "str | tuple[str, ...] | None") -> str:
    """This layer's strategy: the spec's (one, or the layer's entry of one per layer), else megatron's
    ``cp_comm_type`` argument, else ``"p2p"``. Raises ``ValueError`` if both are given and differ, for a
    per-layer list of the wrong length, or an unknown name."""
    if spec is None:
        return cpa.check_comm_type_name("p2p" if given is None else given)
    if not isinstance(spec, str):
        if len(spec) != config.num_layers:
            raise ValueError(f"cp_comm_type lists {len(spec)} strategies, but the model has config.num_layers="
                             f"{config.num_layers}; give one per layer")
        spec = spec[layer_number - 1]
    if given is not None and given != spec:
        raise ValueError(f"layer {layer_number}: config.cp_comm_type gives {given!r} but the layer spec "
                         f"{spec!r}; set the strategy in one place")
    return cpa.check_comm_type_name(spec)


def ring_group(cp_group, pg_collection, cp_comm_type: str):
    """What the ring calls take as ``group``: with megatron's two hierarchical CP groups
    (``hierarchical_context_parallel_sizes=[a2a, p2p]``: level 0 the all-to-all over consecutive CP
    ranks, level 1 across them) a two-level transport, so any layer may run ``"a2a+p2p"``; else the
    CP group. Raises ``ValueError`` for ``"a2a+p2p"`` without them."""
    try:
        levels = getattr(pg_collection, "hcp", None) if pg_collection is not None else None
    except AttributeError:
        levels = None
    if levels is None and pg_collection is None and parallel_state.model_parallel_is_initialized():
        levels = parallel_state.get_hierarchical_context_parallel_groups(check_initialized=False)
    if levels is not None and len(levels) == 2:
        return two_level_transport(cp_group, outer=levels[1], inner=levels[0])
    if cp_comm_type == "a2a+p2p":
        raise ValueError("cp_comm_type='a2a+p2p' needs megatron's two hierarchical CP groups: initialise with "
                         "initialize_model_parallel(..., hierarchical_context_parallel_sizes=[a2a, p2p]) (or a "
                         "pg_collection with .hcp); or use 'a2a', 'all_gather' or 'p2p'")
    return cp_group
