"""Megatron cases for issue 12 (never hang, agreed errors), run inside the gloo workers: refusals that
depend on one rank's own data (masks, packed boundaries, shapes, batches) are raised alike on every CP
rank, and a checked model forward agrees on them in exactly one collective."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections import Counter
from typing import Iterator

import torch
import torch.distributed as dist

import cp_attention as cpa

from .megatron_cases import SEQ, _error, _qkv, _ring, build, full_batch, parallel_state
from .megatron_packed_cases import packed_batch

# Collectives of torch.distributed (ring P2P, batch_isend_irecv, is not one of them).
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
               "broadcast_object_list", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "barrier",
               "gather", "scatter", "reduce")
# Host syncs and per-layer checks the issue forbids per layer.
SYNCS = ((torch.Tensor, "item"), (torch.Tensor, "tolist"), (torch, "equal"))
DYNAMO = os.sep + os.path.join("torch", "_dynamo") + os.sep  # torch.compiler.disable's wrapper frames


@contextlib.contextmanager
def counting() -> Iterator[Counter]:
    """Count calls of the collectives, ``Tensor.item``/``tolist`` and ``torch.equal`` made by the
    adapters' code (``integrations/``: directly, or for a collective through the checks' agreement or the
    transport it calls), as ``name``, and the collectives made from anywhere, as ``any:name`` (the ring's
    own validation included)."""
    from cp_attention import checks, integrations, transport

    root = os.path.dirname(integrations.__file__) + os.sep
    seams = tuple(os.path.dirname(room.__file__) + os.sep for room in (transport, checks))
    counts: Counter = Counter()
    saved = []

    def caller(collective: bool) -> str:
        frame = sys._getframe(2)
        # a collective the adapter asked the checks' agreement or the transport for is the adapter's (through
        # torch.compiler.disable's wrapper frames, which every transport operation has)
        while collective and frame is not None and (frame.f_code.co_filename.startswith(seams)
                                                    or DYNAMO in frame.f_code.co_filename):
            frame = frame.f_back
        return "" if frame is None else frame.f_code.co_filename

    def wrap(owner, name, collective):
        fn = getattr(owner, name)

        def counted(*args, **kwargs):
            if caller(collective).startswith(root):
                counts[name] += 1
            if collective:
                counts["any:" + name] += 1
            return fn(*args, **kwargs)

        saved.append((owner, name, fn))
        setattr(owner, name, counted)

    for name in COLLECTIVES:
        wrap(dist, name, True)
    for owner, name in SYNCS:
        wrap(owner, name, False)
    try:
        yield counts
    finally:
        for owner, name, fn in reversed(saved):
            setattr(owner, name, fn)


def _model(world_size: int, layout: str = "zigzag", **overrides):
    from cp_attention.integrations import megatron as cpm

    return cpm.apply_context_parallel(build(world_size, spec=cpm.get_gpt_layer_ring_spec(
        layout, normalization="RMSNorm"), **overrides))


def _ring_calls(model) -> Counter:
    """Count the calls of every ring attention of ``model`` (a forward hook on each)."""
    from cp_attention.integrations import megatron as cpm

    calls: Counter = Counter()
    for m in model.modules():
        if isinstance(m, cpm.RingDotProductAttention):
            m.register_forward_pre_hook(lambda *_: calls.update(["ring"]))
    return calls


def _bad_mask() -> torch.Tensor:
    """This rank's shard of a causal mask with one padded key: the ring cannot honour it."""
    from cp_attention.integrations import megatron as cpm

    full = full_batch(with_mask=True)["attention_mask"].clone()
    full[..., -1] = True
    return cpm.get_batch_on_this_cp_rank({"attention_mask": full}, layout="zigzag")["attention_mask"]


def mixed_masks(rank: int, world_size: int) -> dict:
    """Rank 0 gives a mask, the others None: a mask the ring cannot honour is refused on every rank (a
    layer called directly, a ring of a checked model called after its forward, and the model forward);
    the causal mask itself is fine next to None and changes nothing."""
    from cp_attention.integrations import megatron as cpm

    parallel_state(world_size)
    local = cpm.get_batch_on_this_cp_rank(full_batch(with_mask=True), layout="zigzag")
    causal, bad = local["attention_mask"], _bad_mask()
    q, k, v = _qkv(SEQ // world_size)
    ring = _ring(world_size)
    ring.global_positions_ready = True
    out = {"layer_bad": _error(lambda: ring(q, k, v, bad if rank == 0 else None))}
    mixed = ring(q, k, v, causal if rank == 0 else None)
    out["layer_causal_vs_none"] = (mixed - ring(q, k, v, None)).abs().max().item()
    model = _model(world_size)
    calls = _ring_calls(model)
    args = (local["tokens"], local["position_ids"])
    plain = model(*args, None).detach()
    out["model_causal_vs_none"] = (model(*args, causal if rank == 0 else None) - plain).abs().max().item()
    calls.clear()
    out["model_bad"] = _error(lambda: model(*args, bad if rank == 0 else None))
    out["model_bad_ring_calls"] = calls["ring"]  # refused before any layer ran
    # The checked forward is over: one of its rings called directly checks itself again, agreed.
    core = model.decoder.layers[0].self_attention.core_attention
    out["model_ring_after_forward"] = _error(lambda: core(q, k, v, bad if rank == 0 else None))
    out["model_after_refusal"] = (model(*args, None) - plain).abs().max().item()
    return out


def packed_one_rank_bad(rank: int, world_size: int) -> dict:
    """Packed (THD) batches whose boundaries are bad on rank 0 only, or valid on every rank but not the
    same, or given on rank 0 only: the model forward and a direct layer call refuse on every rank."""
    from cp_attention.integrations import megatron as cpm

    parallel_state(world_size)
    model = _model(world_size)
    calls = _ring_calls(model)
    batch, params, _ = packed_batch(padded=False)
    local = cpm.get_batch_on_this_cp_rank(batch, layout="zigzag", packed_seq_params=params)
    decreasing = torch.tensor([0, 5, 3, SEQ], dtype=torch.int32)
    other = torch.tensor([0, 12, SEQ], dtype=torch.int32)
    variants = {
        "bad_boundaries": dataclasses.replace(params, cu_seqlens_q=decreasing, cu_seqlens_kv=decreasing),
        "other_documents": dataclasses.replace(params, cu_seqlens_q=other, cu_seqlens_kv=other),
        "packed_on_one_rank": None,
    }
    q, k, v = (t[:, 0] for t in _qkv(SEQ // world_size, batch=1))
    ring = _ring(world_size)
    ring.global_positions_ready = True
    out = {}
    for name, variant in variants.items():
        mine = variant if rank == 0 else params
        out[f"model/{name}"] = _error(lambda mine=mine: model(local["tokens"], local["position_ids"], None,
                                                              packed_seq_params=mine))
        out[f"layer/{name}"] = _error(lambda mine=mine: ring(q, k, v, None, packed_seq_params=mine))
    out["ring_calls"] = calls["ring"]
    return out


def shapes_differ(rank: int, world_size: int) -> dict:
    """Ranks whose local inputs differ in shape (rank 0 holds one row less, or one token more): refused on
    every rank before any layer runs, naming every rank's shape."""
    from cp_attention.integrations import megatron as cpm

    parallel_state(world_size)
    model = _model(world_size)
    calls = _ring_calls(model)
    local = cpm.get_batch_on_this_cp_rank(full_batch(size=2), layout="zigzag")
    tokens, positions = local["tokens"], local["position_ids"]
    rows = (tokens[:1], positions[:1]) if rank == 0 else (tokens, positions)
    out = {"rows": _error(lambda: model(*rows, None))}
    q, k, v = _qkv(SEQ // world_size + (2 if rank == 0 else 0))
    ring = _ring(world_size)
    ring.global_positions_ready = True
    out["layer_length"] = _error(lambda: ring(q, k, v, None))
    out["ring_calls"] = calls["ring"]
    return out


def collectives_per_forward(rank: int, world_size: int, layout: str) -> dict:
    """What the checks cost, counted (see :func:`counting`) in checked forwards of models of 2 and 4 layers,
    unpacked without and with the causal mask (positional and keyword arguments) and packed; in a ring
    layer called directly; and in the 2-layer model with its forward hooks removed."""
    from cp_attention.integrations import megatron as cpm

    parallel_state(world_size)
    local = cpm.get_batch_on_this_cp_rank(full_batch(with_mask=True), layout=layout)
    batch, params, _ = packed_batch(padded=True)
    packed = cpm.get_batch_on_this_cp_rank(batch, layout=layout, packed_seq_params=params)
    out = {}
    for layers in (2, 4):
        model = _model(world_size, layout, num_layers=layers)
        runs = {  # each is run in the loop below, within this iteration
            "plain": lambda: model(local["tokens"], local["position_ids"], None),  # noqa: B023
            "mask": lambda: model(local["tokens"], local["position_ids"], local["attention_mask"]),  # noqa: B023
            "mask_as_kwargs": lambda: model(  # noqa: B023
                input_ids=local["tokens"], position_ids=local["position_ids"], attention_mask=local["attention_mask"]),
            "packed": lambda: model(packed["tokens"], packed["position_ids"], None,  # noqa: B023
                                    packed_seq_params=packed["packed_seq_params"]),
        }
        for name, run in runs.items():
            run()  # warm: the RoPE caches
            with counting() as counts:
                logits = run()
            out[f"{name}/{layers}"] = dict(counts)
            out[f"{name}/{layers}/finite"] = bool(torch.isfinite(logits).all())
    q, k, v = _qkv(SEQ // world_size)
    core = model.decoder.layers[0].self_attention.core_attention
    with counting() as counts:
        core(q, k, v, None)
    out["direct_layer"] = dict(counts)
    for handle in model._cp_forward_checks_hooks:
        handle.remove()
    with counting() as counts:
        runs["mask"]()
    out["unhooked_mask/4"] = dict(counts)
    return out


def batch_one_rank_bad(rank: int, world_size: int) -> dict:
    """get_batch_on_this_cp_rank with a batch bad on rank 0 only (megatron's CP group by default, or
    ``cp_group``): every rank raises the same error; a good batch still shards alike."""
    from cp_attention.integrations import megatron as cpm

    group = parallel_state(world_size).get_context_parallel_group()
    good = full_batch()
    ragged = dict(good, labels=good["labels"][:, :-4])
    batch, params, _ = packed_batch(padded=False)
    decreasing = dataclasses.replace(params, cu_seqlens_q=torch.tensor([0, 5, 3, SEQ], dtype=torch.int32),
                                     cu_seqlens_kv=None)
    mine = lambda bad, ok: bad if rank == 0 else ok  # noqa: E731
    return {
        "ragged": _error(lambda: cpm.get_batch_on_this_cp_rank(mine(ragged, good))),
        "ragged_group": _error(lambda: cpm.get_batch_on_this_cp_rank(mine(ragged, good), cp_group=group)),
        "packed": _error(lambda: cpm.get_batch_on_this_cp_rank(batch, packed_seq_params=mine(decreasing, params))),
        "not_a_batch": _error(lambda: cpm.get_batch_on_this_cp_rank(mine(None, good))),
        "good": torch.equal(cpm.get_batch_on_this_cp_rank(good)["tokens"],
                            cpa.get_layout("zigzag").shard(good["tokens"], 1, rank, world_size)),
    }
