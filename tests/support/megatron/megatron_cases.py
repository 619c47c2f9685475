"""Megatron-core cases run inside the gloo workers: a tiny real ``GPTModel`` on CPU, no download.

The CP=1 reference runs megatron's own ``DotProductAttention`` and ``RotaryEmbedding``, which
hard-code CUDA; it runs in its own worker under :func:`megatron_cuda_hardcodes_on_cpu`, the only
place any megatron code is patched. The CP models run in other workers with no patch at all.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import cp_attention as cpa

from .megatron_cpu import cuda_hardcodes_unpatched, megatron_cuda_hardcodes_on_cpu

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

SEQ = 24  # zigzag splits it for CP 2, 3 and 4
VOCAB = 64
IGNORE = -100
MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2)


_PARALLEL: dict[str, Any] = {}


def parallel_state(cp: int):
    """megatron's parallel state with CP size ``cp`` (TP = PP = 1), initialised once per worker."""
    from megatron.core import parallel_state as ps

    if _PARALLEL.get("cp") != cp or not ps.model_parallel_is_initialized():
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(context_parallel_size=cp, create_gloo_process_groups=False)
        _PARALLEL["cp"] = cp
    return ps


def config(cp: int, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(MODEL, use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0,
              params_dtype=torch.float64, normalization="RMSNorm", context_parallel_size=cp)
    kw.update(overrides)
    return TransformerConfig(**kw)


def build(cp: int, spec=None, position_embedding_type: str = "rope", seed: int = 0, **overrides):
    """A tiny fp64 ``GPTModel``; ``spec`` defaults to megatron's local layer spec."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    torch.manual_seed(seed)
    spec = spec if spec is not None else get_gpt_layer_local_spec(normalization="RMSNorm")
    return GPTModel(config(cp, **overrides), spec, vocab_size=VOCAB, max_sequence_length=4 * SEQ,
                    position_embedding_type=position_embedding_type).double()


def full_batch(seed: int = 1, size: int = 2, with_mask: bool = False) -> dict[str, torch.Tensor]:
    """A megatron batch dict over the full sequence (labels already shifted, like megatron's datasets)."""
    tokens = torch.randint(0, VOCAB, (size, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
             "loss_mask": (torch.rand(size, SEQ, generator=torch.Generator().manual_seed(seed)) > 0.2).double(),
             "position_ids": torch.arange(SEQ).expand(size, SEQ)}
    if with_mask:  # megatron's convention: True = masked out, [b, 1, s, s]
        batch["attention_mask"] = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).expand(size, 1, SEQ, SEQ)
    return batch


def _losses(model, batch):
    """(fp64 masked mean next-token loss from the logits, its parts, megatron's own per-token loss)."""
    logits = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"))
    per_token = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
    mcore = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"])
    return logits, (per_token * batch["loss_mask"].flatten()).sum(), batch["loss_mask"].sum(), mcore


def reference(rank: int, world_size: int, model_kw: dict, with_mask: bool = False) -> dict:
    """CP=1 with megatron's own attention and RoPE: weights, logits, losses and gradients."""
    with megatron_cuda_hardcodes_on_cpu():
        parallel_state(1)
        model = build(1, **model_kw)
        batch = full_batch(with_mask=with_mask)
        logits, num, den, mcore = _losses(model, batch)
        (num / den).backward()
    return {"state": model.state_dict(), "logits": logits.detach(), "loss": (num / den).item(),
            "mcore_loss": ((mcore * batch["loss_mask"]).sum() / den).item(),
            "grads": {n: p.grad for n, p in model.named_parameters()}}


def _cp_model(world_size: int, layout: str, ref: dict, model_kw: dict, rope_layout: str | None = None,
              ring_windows: list | None = None, cp_comm_type=None):
    from cp_attention.integrations import megatron as cpm

    spec = cpm.get_gpt_layer_ring_spec(layout, normalization="RMSNorm", cp_comm_type=cp_comm_type)
    model = build(world_size, spec=spec, **model_kw)
    model.load_state_dict(ref["state"])
    cpm.apply_context_parallel(model)
    if rope_layout is not None:  # a deliberately wrong RoPE, to show the test can see it
        model.rotary_pos_emb = cpm.LayoutRotaryEmbedding(model.rotary_pos_emb.rope, rope_layout,
                                                         model.rotary_pos_emb.group)
    rings = [m for m in model.modules() if isinstance(m, cpm.RingDotProductAttention)]
    for m, window in zip(rings, ring_windows or ()):  # wrong per-layer windows on purpose, to show tests see them
        m.window_size = tuple(window)
    return model


def equivalence(rank: int, world_size: int, layout: str, ref: dict, model_kw: dict, with_mask: bool = False,
                rope_layout: str | None = None, ring_windows: list | None = None, cp_comm_type=None,
                hierarchical: tuple[int, int] | None = None) -> dict:
    """CP=world_size vs the reference: max abs differences of gathered logits, losses and summed grads.
    ``ring_windows``: per-layer windows forced onto the ring attentions (wrong on purpose).
    ``cp_comm_type``: the layer spec's (one, or one per layer). ``hierarchical`` (a2a, p2p): megatron's
    hierarchical CP groups as ``initialize_model_parallel(hierarchical_context_parallel_sizes=...)``
    makes them (level 0 consecutive CP ranks), stood in by a DeviceMesh's (megatron needs einops)."""
    from cp_attention.integrations import megatron as cpm
    from cp_attention.integrations.megatron import groups as megatron_groups

    ps = parallel_state(world_size)
    group = ps.get_context_parallel_group()
    real = megatron_groups.parallel_state.get_hierarchical_context_parallel_groups
    if hierarchical is not None:
        from torch.distributed.device_mesh import init_device_mesh

        a2a, p2p = hierarchical
        mesh = init_device_mesh("cpu", (p2p, a2a))
        levels = [mesh.get_group(1), mesh.get_group(0)]
        megatron_groups.parallel_state.get_hierarchical_context_parallel_groups = lambda check_initialized=True: levels
    try:
        model = _cp_model(world_size, layout, ref, model_kw, rope_layout, ring_windows, cp_comm_type)
    finally:
        megatron_groups.parallel_state.get_hierarchical_context_parallel_groups = real
    local = cpm.get_batch_on_this_cp_rank(full_batch(with_mask=with_mask), layout=layout)
    logits, num, den, mcore = _losses(model, local)
    stats = torch.stack([num.detach(), den, (mcore.double() * local["loss_mask"]).sum().detach()])
    dist.all_reduce(stats, group=group)
    (num / stats[1]).backward()  # this rank's share of the global mean
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=group)
        grads[name] = g
    full_logits = cpa.get_layout(layout).gather(logits.detach(), dim=1, group=group)
    return {
        "logits": (full_logits - ref["logits"]).abs().max().item(),
        "loss": abs(stats[0].item() / stats[1].item() - ref["loss"]),
        "mcore_loss": abs(stats[2].item() / stats[1].item() - ref["mcore_loss"]),
        "grads": max((grads[n] - g).abs().max().item() for n, g in ref["grads"].items()),
        "finite": bool(torch.isfinite(logits).all()) and all(bool(torch.isfinite(g).all()) for g in grads.values()),
        "unpatched": cuda_hardcodes_unpatched(),
        "attention": sorted({type(m).__name__ for m in model.modules() if "Attention" in type(m).__name__}),
        "windows": [m.window_size for m in model.modules() if isinstance(m, cpm.RingDotProductAttention)],
        "comm_types": [m.cp_comm_type for m in model.modules() if isinstance(m, cpm.RingDotProductAttention)],
    }


def _error(fn) -> str:
    """``"ExcType: message"`` of what ``fn()`` raised, or ``"no error"``."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return f"{type(e).__name__}: {e}"
    return "no error"


def _qkv(local: int, batch: int = 2, heads: int = 4, groups: int = 2, dim: int = 8, seed: int = 0):
    """Random ``[s, b, h, d]`` query and ``[s, b, g, d]`` key/value in fp64."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(local, batch, heads, dim, generator=g, dtype=torch.float64)
    k, v = (torch.randn(local, batch, groups, dim, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v


def _ring(world_size: int, layout: str = "zigzag", cfg=None, **kwargs):
    from megatron.core.transformer.enums import AttnMaskType

    from cp_attention.integrations import megatron as cpm

    kw = dict(config=cfg or config(world_size), layer_number=1, attn_mask_type=AttnMaskType.causal,
              attention_type="self", layout=layout)
    kw.update(kwargs)
    return cpm.RingDotProductAttention(**kw)


def refusals(rank: int, world_size: int) -> dict[str, str]:
    """Every unsupported input or setting, and the error it raised on this rank."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.utils import get_batch_on_this_cp_rank as megatron_get_batch

    from cp_attention.integrations import megatron as cpm

    parallel_state(world_size)
    local = SEQ // world_size
    q, k, v = _qkv(local)
    out: dict[str, str] = {}
    spec = cpm.get_gpt_layer_ring_spec("zigzag", normalization="RMSNorm")
    # learned_absolute: with RoPE, megatron's own zigzag slicing would call .cuda() before the check.
    model = build(world_size, spec=spec, position_embedding_type="learned_absolute")
    batch = cpm.get_batch_on_this_cp_rank(full_batch(), layout="zigzag")
    out["not_prepared"] = _error(lambda: model(batch["tokens"], batch["position_ids"], None))
    ring = _ring(world_size)
    ring.global_positions_ready = True
    out["attention_bias"] = _error(lambda: ring(q, k, v, None, attention_bias=torch.zeros(1, 4, local, SEQ)))
    dropout = _ring(world_size, attention_dropout=0.1)
    dropout.global_positions_ready = True
    out["dropout_train"] = _error(lambda: dropout(q, k, v, None))
    out["dropout_eval"] = _error(lambda: dropout.eval()(q, k, v, None))
    full_mask = full_batch(with_mask=True)["attention_mask"]
    padding = full_mask.clone()
    padding[..., -1] = True  # the last key is padding
    out["padding_mask"] = _error(lambda: ring(q, k, v, cpm.get_batch_on_this_cp_rank(
        {"attention_mask": padding}, layout="zigzag")["attention_mask"]))
    # Only rank 0 passes a wrong mask: every rank must still raise, none may wait in the ring.
    one_bad = padding if rank == 0 else full_mask
    out["one_rank_bad_mask"] = _error(lambda: ring(q, k, v, cpm.get_batch_on_this_cp_rank(
        {"attention_mask": one_bad}, layout="zigzag")["attention_mask"]))
    interleaved = _ring(world_size, layout="interleaved")
    interleaved.global_positions_ready = True
    zigzag_sliced = megatron_get_batch({"attention_mask": full_mask.clone()})["attention_mask"]
    out["mask_sliced_for_another_layout"] = _error(lambda: interleaved(q, k, v, zigzag_sliced))
    out["unsharded_mask"] = _error(lambda: ring(q, k, v, full_mask))
    out["cp_comm_type"] = _error(lambda: _ring(world_size, cp_comm_type="ulysses"))
    out["a2a_p2p_without_levels"] = _error(lambda: _ring(world_size, cp_comm_type="a2a+p2p"))
    # megatron's list-valued config.cp_comm_type: entry layer_number - 1 is the layer's; megatron-core 0.16's
    # TransformerLayer passes entry layer_number (the next layer's), refused by name
    listed = config(world_size, cp_comm_type=["all_gather", "a2a"])
    out["config_list_shifted"] = _error(lambda: _ring(world_size, cfg=listed, layer_number=1, cp_comm_type="a2a"))
    out["config_list_entry"] = _ring(world_size, cfg=listed, layer_number=2, cp_comm_type="a2a").cp_comm_type
    out["spec_list_length"] = _error(lambda: _ring(world_size, spec_cp_comm_type=("a2a",) * 3))
    # 3 query heads cannot be split over an all-to-all of 2: refused when the model is built
    three = config(world_size, num_attention_heads=3, num_query_groups=1, kv_channels=8)
    out["a2a_heads"] = _error(lambda: _ring(world_size, cfg=three, cp_comm_type="a2a"))
    out["window"] = _error(lambda: _ring(world_size, cfg=config(world_size, window_size=(4, -2))))
    out["softmax_type"] = _error(lambda: _ring(world_size, cfg=config(world_size, softmax_type="sigmoid")))
    out["cross_attention"] = _error(lambda: _ring(world_size, attention_type="cross"))
    out["cp_size_mismatch"] = _error(lambda: _ring(world_size, cfg=config(1)))
    out["unknown_layout"] = _error(lambda: _ring(world_size, layout="diagonal"))
    out["unknown_kernel"] = _error(lambda: _ring(world_size, kernel="no_such_kernel"))
    out["no_ring_in_model"] = _error(lambda: cpm.apply_context_parallel(torch.nn.Linear(2, 2)))
    mixed = build(world_size, spec=spec)
    mixed.decoder.layers[1].self_attention.core_attention.layout = cpa.get_layout("interleaved")
    out["mixed_layouts"] = _error(lambda: cpm.apply_context_parallel(mixed))
    # Like YaRN: a RotaryEmbedding subclass whose tables LayoutRotaryEmbedding does not reproduce.
    # (YarnRotaryEmbedding itself cannot be built without CUDA.)
    scaled = build(world_size, spec=spec)
    scaled.rotary_pos_emb = type("ScaledRotaryEmbedding", (RotaryEmbedding,), {})(
        kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)
    out["rope_subclass"] = _error(lambda: cpm.apply_context_parallel(scaled))
    out["rope_subclass_left_untouched"] = type(scaled.rotary_pos_emb).__name__
    mtp = build(world_size, spec=cpm.get_gpt_layer_ring_spec("interleaved", normalization="RMSNorm"),
                mtp_num_layers=1)
    out["mtp_not_zigzag"] = _error(lambda: cpm.apply_context_parallel(mtp))
    ragged = {"tokens": torch.zeros(2, SEQ, dtype=torch.long), "labels": torch.zeros(2, SEQ - 4, dtype=torch.long)}
    out["ragged_batch"] = _error(lambda: cpm.get_batch_on_this_cp_rank(ragged))
    out["unsplittable_batch"] = _error(lambda: cpm.get_batch_on_this_cp_rank({"tokens": torch.zeros(2, 6)}))
    out["te_backend"] = _error(lambda: cpm.get_gpt_layer_ring_spec(backend="transformer_engine"))
    out["unknown_backend"] = _error(lambda: cpm.get_gpt_layer_ring_spec(backend="apex"))
    return out


def core_attention_cp1(rank: int, world_size: int) -> dict[str, float]:
    """At CP=1, RingDotProductAttention vs megatron's DotProductAttention on the same q, k, v (GQA)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    out = {}
    with megatron_cuda_hardcodes_on_cpu():
        parallel_state(1)
        q, k, v = _qkv(SEQ)
        for mask_type in (AttnMaskType.causal, AttnMaskType.no_mask):
            for name, kw, cfg_kw in (("default", {}, {}), ("softmax_scale", {"softmax_scale": 0.3}, {}),
                                     ("qk_layer_scaling", {}, {"apply_query_key_layer_scaling": True})):
                cfg = config(1, **cfg_kw)
                args = dict(config=cfg, layer_number=2, attn_mask_type=mask_type, attention_type="self", **kw)
                ring = _ring(1, **args)
                qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
                qm, km, vm = (t.clone().requires_grad_() for t in (q, k, v))
                got, want = ring(qr, kr, vr, None), DotProductAttention(**args)(qm, km, vm, None)
                grad = torch.randn_like(got, generator=torch.Generator().manual_seed(3))
                got.backward(grad)
                want.backward(grad)
                diffs = [(got - want).abs().max()] + [(a.grad - b.grad).abs().max()
                                                        for a, b in ((qr, qm), (kr, km), (vr, vm))]
                out[f"{mask_type.name}/{name}"] = max(d.item() for d in diffs)
                out[f"{mask_type.name}/{name}/shape"] = tuple(got.shape) == tuple(want.shape)
    return out


def megatron_rope_table(rank: int, world_size: int, kw: dict, offset: int) -> torch.Tensor:
    """megatron's RotaryEmbedding table for the whole sequence (CP=1)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    with megatron_cuda_hardcodes_on_cpu():
        parallel_state(1)
        return RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True, **kw)(
            SEQ, offset=offset)


def rope_rows(rank: int, world_size: int, table: torch.Tensor, kw: dict, offset: int) -> dict[str, bool]:
    """LayoutRotaryEmbedding rows vs the rows of megatron's full table at the layout's positions."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from cp_attention.integrations import megatron as cpm

    group = parallel_state(world_size).get_context_parallel_group()
    out = {}
    for layout in cpa.LAYOUT_NAMES:
        rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True, **kw)
        wrapped = cpm.LayoutRotaryEmbedding(rope, layout, group)
        rows = wrapped(SEQ, offset=offset)
        positions = cpa.get_layout(layout).positions(SEQ, rank, world_size)
        out[layout] = torch.equal(rows, table.index_select(0, positions)) and wrapped(SEQ, offset) is rows
    out["delegates"] = wrapped.get_rotary_seq_len(None, None, torch.zeros(3), config(world_size)) == 3 * world_size
    return out


def batch_sharding(rank: int, world_size: int) -> dict[str, bool]:
    """get_batch_on_this_cp_rank: megatron's own for zigzag; an exact round trip for every layout."""
    from megatron.core.utils import get_batch_on_this_cp_rank as megatron_get_batch

    from cp_attention.integrations import megatron as cpm

    group = parallel_state(world_size).get_context_parallel_group()
    full = full_batch(with_mask=True)
    full["note"] = "not a tensor"
    full["absent"] = None
    snapshot = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in full.items()}
    tensors = {k: v for k, v in full.items() if isinstance(v, torch.Tensor)}
    theirs = megatron_get_batch({k: v.clone() for k, v in tensors.items()})
    out = {"zigzag_is_megatrons": all(torch.equal(cpm.get_batch_on_this_cp_rank(full)[k], theirs[k])
                                      for k in tensors)}
    for layout in cpa.LAYOUT_NAMES:
        lay = cpa.get_layout(layout)
        local = cpm.get_batch_on_this_cp_rank(full, layout=layout, cp_group=group)
        out[layout] = (all(torch.equal(lay.gather(local[k], dim=2 if k == "attention_mask" else 1, group=group),
                                       v) for k, v in tensors.items())
                       and local["note"] == "not a tensor" and local["absent"] is None
                       and torch.equal(local["position_ids"][0], lay.positions(SEQ, rank, world_size)))
    out["input_untouched"] = all(torch.equal(full[k], v) if isinstance(v, torch.Tensor) else full[k] == v
                                 for k, v in snapshot.items())
    return out


def layout_from_config(rank: int, world_size: int) -> dict[str, str]:
    """Where RingDotProductAttention takes its layout from: the spec, else config.cp_layout, else zigzag."""
    from cp_attention.integrations import megatron as cpm

    parallel_state(world_size)
    cfg = config(world_size)
    cfg.cp_layout = "striped"
    kw = dict(layer_number=1, attn_mask_type=None, attention_type="self")
    return {"config": cpm.ring_core_attention()(config=cfg, **kw).layout.name,
            "spec_wins": cpm.ring_core_attention("contiguous")(config=cfg, **kw).layout.name,
            "default": cpm.ring_core_attention()(config=config(world_size), **kw).layout.name}


def example_losses(rank: int, world_size: int, argv: list) -> list:
    """The losses of the Megatron example's training loop (``examples/pretrain_megatron.py``), run in this worker."""
    from megatron.core import parallel_state as ps

    from examples import pretrain_megatron as megatron_example

    if ps.model_parallel_is_initialized():  # the example sets up its own TP x CP x DP state
        ps.destroy_model_parallel()
    _PARALLEL.clear()
    return megatron_example.train(megatron_example.parse_args(["--world-size", str(world_size), *argv]))


def pg_collection_group(rank: int, world_size: int, layout: str) -> dict:
    """CP over ``pg_collection.cp`` (two independent pairs of ranks), not megatron's global CP group."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from ..core.reference import reference_attention

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    ring = _ring(2, layout=layout, cfg=config(2), pg_collection=ProcessGroupCollection(cp=pair))
    ring.global_positions_ready = True
    q, k, v = _qkv(SEQ, seed=rank // 2)  # each pair attends over its own sequence
    lay = cpa.get_layout(layout)
    local = [lay.shard(t, 0, rank % 2, 2) for t in (q, k, v)]
    got = ring(*local, None)
    want, _ = reference_attention(*(t.transpose(0, 1) for t in (q, k, v)), causal=True, scale=8 ** -0.5)
    want = lay.shard(want.transpose(0, 1), 0, rank % 2, 2).flatten(2)
    return {"group": ring.cp_group is pair and ring.cp_size == 2, "error": (got - want).abs().max().item()}


def hierarchical_levels(rank: int, world_size: int) -> dict:
    """cp_comm_type="a2a+p2p" over a pg_collection's ``hcp``: megatron's order (level 0 the a2a over
    consecutive CP ranks) builds; the levels swapped are refused where the CP rank is not p2p rank x a2a
    size + a2a rank (ranks 1 and 2 of 4), without communication."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from torch.distributed.device_mesh import init_device_mesh

    ps = parallel_state(world_size)
    mesh = init_device_mesh("cpu", (2, 2))  # dim 1: consecutive ranks
    cp = ps.get_context_parallel_group()
    ring = _ring(world_size, cp_comm_type="a2a+p2p",
                 pg_collection=ProcessGroupCollection(cp=cp, hcp=[mesh.get_group(1), mesh.get_group(0)]))
    outer, inner = ring.ring_group.levels
    swapped = ProcessGroupCollection(cp=cp, hcp=[mesh.get_group(0), mesh.get_group(1)])
    return {"levels": ((outer.rank, outer.world_size), (inner.rank, inner.world_size)),
            "swapped": _error(lambda: _ring(world_size, cp_comm_type="a2a+p2p", pg_collection=swapped)),
            "swapped_p2p": _ring(world_size, pg_collection=swapped).ring_group is cp}


def softmax_sinks(rank: int, world_size: int, layout: str, softmax_type: str) -> dict:
    """megatron's ``softmax_type`` sinks on the ring against an independent fp64 reference: output, the
    input gradients, and the learnable offset's gradient summed over the CP ranks."""
    import cp_attention as cpa

    from ..core.reference import reference_attention

    parallel_state(world_size)
    torch.manual_seed(3)  # the learnable offset is initialised alike on every rank
    ring = _ring(world_size, layout=layout, cfg=config(world_size, softmax_type=softmax_type))
    ring.global_positions_ready = True
    offset = ring.softmax_offset
    q, k, v = _qkv(SEQ, seed=5)
    dout = torch.randn(SEQ, 2, 4 * 8, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    lay = cpa.get_layout(layout)
    local = [lay.shard(t, 0, rank, world_size).requires_grad_() for t in (q, k, v)]
    got = ring(*local, None)
    got.backward(lay.shard(dout, 0, rank, world_size))

    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_offset = offset.detach().clone().requires_grad_() if isinstance(offset, torch.nn.Parameter) else offset
    want, _ = reference_attention(*(t.transpose(0, 1) for t in full), causal=True, scale=8 ** -0.5,
                                  sinks=ref_offset)
    want = want.transpose(0, 1).flatten(2)
    want.backward(dout)
    result = {
        "kind": type(offset).__name__,
        "sink_effect": offset.abs().max().item() if softmax_type == "learnable" else 1.0,
        "out": (got - lay.shard(want.detach(), 0, rank, world_size)).abs().max().item(),
        "grads": max((a.grad - lay.shard(b.grad, 0, rank, world_size)).abs().max().item() for a, b in zip(local, full)),
    }
    if isinstance(offset, torch.nn.Parameter):
        summed = offset.grad.clone()
        dist.all_reduce(summed)
        result["offset_grad"] = (summed - ref_offset.grad).abs().max().item()
    return result
