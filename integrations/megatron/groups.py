"""Which groups and strategy a megatron ring attention layer uses: the CP group (``pg_collection.cp``
or megatron's parallel state), the two-level group of ``cp_comm_type="a2a+p2p"`` (megatron's
hierarchical CP groups), and the layer's ``cp_comm_type``."""

from __future__ import annotations

from typing import Sequence

from megatron.core import parallel_state

import cp_attention as cpa
from cp_attention.strategies.dispatch import strategy_problem
from cp_attention.transport import transport_for
from cp_attention.transport.process_group import two_level_transport

__all__ = ["resolve_cp_group", "layer_comm_type", "check_heads", "ring_group", "spec_comm_types"]


def resolve_cp_group(pg_collection):
    if pg_collection is not None and getattr(pg_collection, "cp", None) is not None:
        return pg_collection.cp
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_context_parallel_group()
    # A None group would mean the whole world to torch.distributed, never "no CP".
    raise RuntimeError("RingDotProductAttention found no CP group; call megatron.core.parallel_state."
                       "initialize_model_parallel(context_parallel_size=...) first or pass a pg_collection "
                       "with a .cp group")


def layer_comm_type(config, layer_number: int, given: str | None, spec: str | tuple[str, ...] | None) -> str:
    """This layer's strategy: the spec's (one, or the layer's entry of one per layer), else megatron's
    (``config.cp_comm_type``: one, or one per layer, entry ``layer_number - 1`` this layer's), else
    ``"p2p"``. ``given``: what megatron's ``TransformerLayer`` passed. Raises ``ValueError`` if the spec
    and megatron's differ, for a per-layer list of the wrong length or an unknown name, and for a
    megatron-core whose ``TransformerLayer`` passed another layer's entry of its list (0.16 indexes it
    with the 1-based layer number; its last layer then fails with ``IndexError``)."""
    listed = getattr(config, "cp_comm_type", None)
    if isinstance(listed, (list, tuple)) and given is not None:
        _check_length(listed, config, "config.cp_comm_type")
        mine = listed[layer_number - 1]
        if given != mine:
            raise ValueError(
                f"layer {layer_number}: config.cp_comm_type lists one strategy per layer and this layer's is "
                f"{mine!r} (entry {layer_number - 1}), but megatron-core passed {given!r}: this megatron-core's "
                "TransformerLayer indexes the list with the 1-based layer number (every layer gets the next one's "
                "entry, the last an IndexError). Give the list to the spec instead, get_gpt_layer_ring_spec(..., "
                "cp_comm_type=[...]) or use_ring_attention(spec, cp_comm_type=[...]), and leave "
                "config.cp_comm_type None")
    if spec is None:
        return cpa.check_comm_type_name("p2p" if given is None else given)
    if not isinstance(spec, str):
        _check_length(spec, config, "cp_comm_type")
        spec = spec[layer_number - 1]
    if given is not None and given != spec:
        raise ValueError(f"layer {layer_number}: config.cp_comm_type gives {given!r} but the layer spec "
                         f"{spec!r}; set the strategy in one place")
    return cpa.check_comm_type_name(spec)


def spec_comm_types(cp_comm_type: str | Sequence[str] | None) -> str | tuple[str, ...] | None:
    """A spec's ``cp_comm_type`` checked: None, one name, or a tuple of names (one per layer). Raises
    ``ValueError`` for an unknown name."""
    if cp_comm_type is None or isinstance(cp_comm_type, str):
        return None if cp_comm_type is None else cpa.check_comm_type_name(cp_comm_type)
    return tuple(cpa.check_comm_type_name(name) for name in cp_comm_type)


def _check_length(names, config, what: str) -> None:
    if len(names) != config.num_layers:
        raise ValueError(f"{what} lists {len(names)} strategies, but the model has config.num_layers="
                         f"{config.num_layers}; give one per layer")


def check_heads(ring_group, cp_comm_type: str, heads: int, layer_number: int) -> None:
    """Raise ``ValueError`` when this layer's ``heads`` (query heads per TP rank) cannot be split by its
    all-to-all (``"a2a"``: over the CP group; ``"a2a+p2p"``: over the inner level): when the model is
    built, the same on every rank, instead of at its first forward."""
    problem = strategy_problem(transport_for(ring_group), cp_comm_type, heads)
    if problem is not None:
        raise ValueError(f"layer {layer_number}: {problem}")


def ring_group(cp_group, pg_collection, cp_comm_type: str):
    """What the ring calls take as ``group``: with megatron's two hierarchical CP groups
    (``hierarchical_context_parallel_sizes=[a2a, p2p]``: level 0 the all-to-all over consecutive CP
    ranks, level 1 across them) a two-level transport, so any layer may run ``"a2a+p2p"``; else the
    CP group. Raises ``ValueError`` for ``"a2a+p2p"`` without them, or with levels whose ranks are not
    this rank's CP rank = p2p rank x a2a size + a2a rank (checked on this rank, without communication)."""
    try:
        levels = getattr(pg_collection, "hcp", None) if pg_collection is not None else None
    except AttributeError:
        levels = None
    if levels is None and pg_collection is None and parallel_state.model_parallel_is_initialized():
        levels = parallel_state.get_hierarchical_context_parallel_groups(check_initialized=False)
    if levels is not None and len(levels) == 2:
        transport = two_level_transport(cp_group, outer=levels[1], inner=levels[0])
        if transport.levels is None:  # two_level_transport sets them
            raise RuntimeError("two_level_transport returned a transport without its two levels")
        outer, inner = transport.levels
        if (outer.rank * inner.world_size + inner.rank, outer.world_size * inner.world_size) == \
                (transport.rank, transport.world_size):
            return transport
        if cp_comm_type == "a2a+p2p":
            raise ValueError(f"megatron's hierarchical CP groups do not split the CP group as a2a+p2p needs: CP rank "
                             f"{transport.rank} of {transport.world_size} is rank {inner.rank} of {inner.world_size} "
                             f"in level 0 (a2a) and {outer.rank} of {outer.world_size} in level 1 (p2p), but must be "
                             "p2p rank x a2a size + a2a rank; build them with initialize_model_parallel(..., "
                             "hierarchical_context_parallel_sizes=[a2a, p2p]), or use 'a2a', 'all_gather' or 'p2p'")
        return cp_group  # the levels serve no layer: auto never picks a2a+p2p here
    if cp_comm_type == "a2a+p2p":
        raise ValueError("cp_comm_type='a2a+p2p' needs megatron's two hierarchical CP groups: initialise with "
                         "initialize_model_parallel(..., hierarchical_context_parallel_sizes=[a2a, p2p]) (or a "
                         "pg_collection with .hcp); or use 'a2a', 'all_gather' or 'p2p'")
    return cp_group
