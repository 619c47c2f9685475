"""Megatron-core cases for packed (THD) batches, run inside the gloo workers: documents of any length
against each document run alone at CP=1, the padded convention, batch sharding and the refusals.
Shared model, batch and reference helpers come from :mod:`tests.support.megatron.megatron_cases`."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import cp_attention as cpa

from .megatron_cases import SEQ, VOCAB, _cp_model, _error, _qkv, _ring, build, config, parallel_state
from .megatron_cpu import cuda_hardcodes_unpatched, megatron_cuda_hardcodes_on_cpu

# Packed (THD) batches over SEQ tokens: a 1-token document, documents shorter than CP 3, and no
# length divisible by 2 * CP for CP 2 or 3 (so TransformerEngine's per-document split could not shard them).
DOCS = (1, 5, 2, 9, 7)
# TransformerEngine's padded convention: (real, padded) lengths; the padded stream is SEQ tokens.
PADDED_DOCS = ((1, 2), (5, 6), (2, 2), (9, 10), (3, 4))


def packed_batch(padded: bool, seed: int = 7):
    """A full packed batch ``[1, SEQ]`` without position_ids, its THD ``PackedSeqParams`` (max_seqlen unset),
    and the ``(start, length)`` of every real document in the stream. Padding tokens have loss_mask 0."""
    from megatron.core.packed_seq_params import PackedSeqParams

    pairs = PADDED_DOCS if padded else tuple((n, n) for n in DOCS)
    starts = [sum(p for _, p in pairs[:i]) for i in range(len(pairs))]
    spans = [(start, real) for start, (real, _) in zip(starts, pairs)]
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (1, SEQ + 1), generator=g)
    real = torch.zeros(1, SEQ, dtype=torch.bool)
    for start, length in spans:
        real[0, start:start + length] = True
    loss_mask = ((torch.rand(1, SEQ, generator=g) > 0.2) & real).double()
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": loss_mask}
    cu = torch.tensor([0] + [sum(r for r, _ in pairs[:i + 1]) for i in range(len(pairs))], dtype=torch.int32)
    cu_padded = torch.tensor(starts + [SEQ], dtype=torch.int32) if padded else None
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu.clone(),
                             cu_seqlens_q_padded=cu_padded,
                             cu_seqlens_kv_padded=None if cu_padded is None else cu_padded.clone())
    return batch, params, spans


def packed_reference(rank: int, world_size: int, model_kw: dict, padded: bool) -> dict:
    """CP=1 with megatron's own attention and RoPE, every real document of :func:`packed_batch` run on its
    own (unpacked, positions from 0): weights, the stream's logits (zero at padding) and the gradients of
    the masked mean loss over all documents."""
    with megatron_cuda_hardcodes_on_cpu():
        parallel_state(1)
        model = build(1, **model_kw)
        batch, _, spans = packed_batch(padded)
        logits = torch.zeros(1, SEQ, VOCAB, dtype=torch.float64)
        num = 0.0
        for start, length in spans:
            part = slice(start, start + length)
            doc_logits = model(batch["tokens"][:, part], torch.arange(length)[None], None)
            logits[:, part] = doc_logits.detach()
            per_token = F.cross_entropy(doc_logits.flatten(0, 1), batch["labels"][:, part].flatten(),
                                        reduction="none")
            num = num + (per_token * batch["loss_mask"][:, part].flatten()).sum()
        loss = num / batch["loss_mask"].sum()
        loss.backward()
    return {"state": model.state_dict(), "logits": logits, "loss": loss.item(),
            "grads": {n: p.grad for n, p in model.named_parameters()}}


def packed_equivalence(rank: int, world_size: int, layout: str, refs: dict, model_kw: dict,
                       rope_layout: str | None = None) -> dict:
    """CP=world_size on packed THD batches vs each document run on its own at CP=1 (``refs[padded]``):
    max abs differences of the real tokens' gathered logits, of the loss and of the summed gradients.
    ``rope_layout``: rotate with the packed rows of another layout (wrong on purpose)."""
    from cp_attention.integrations import megatron as cpm

    group = parallel_state(world_size).get_context_parallel_group()
    out = {}
    for padded, ref in refs.items():
        model = cpm.apply_context_parallel(_cp_model(world_size, layout, ref, model_kw))  # idempotent
        rings = [m for m in model.modules() if isinstance(m, cpm.RingDotProductAttention)]
        wrappers = [m for m in model.modules() if isinstance(m, cpm.LayoutRotaryEmbedding)]
        if rope_layout is not None:  # a deliberately wrong RoPE, to show the test can see it
            wrong = cpm.LayoutRotaryEmbedding(model.rotary_pos_emb.rope, rope_layout, group)
            for m in rings:
                m.packed_rotary = wrong.packed_rows
        batch, params, spans = packed_batch(padded)
        local = cpm.get_batch_on_this_cp_rank(batch, layout=layout, packed_seq_params=params)
        logits = model(local["tokens"], local["position_ids"], None, packed_seq_params=local["packed_seq_params"])
        per_token = F.cross_entropy(logits.flatten(0, 1), local["labels"].flatten(), reduction="none")
        num = (per_token * local["loss_mask"].flatten()).sum()
        stats = torch.stack([num.detach(), local["loss_mask"].sum()])
        dist.all_reduce(stats, group=group)
        (num / stats[1]).backward()
        grads = {}
        for name, p in model.named_parameters():
            g = p.grad.clone()
            dist.all_reduce(g, group=group)
            grads[name] = g
        full = cpa.get_layout(layout).gather(logits.detach(), dim=1, group=group,
                                                 cu_seqlens=cpm.packed_documents(params))
        real = torch.zeros(SEQ, dtype=torch.bool)
        for start, length in spans:
            real[start:start + length] = True
        out[padded] = {
            "logits": (full - ref["logits"])[:, real].abs().max().item(),
            "loss": abs(stats[0].item() / stats[1].item() - ref["loss"]),
            "grads": max((grads[n] - g).abs().max().item() for n, g in ref["grads"].items()),
            "finite": bool(torch.isfinite(logits).all()) and all(bool(torch.isfinite(g).all())
                                                                 for g in grads.values()),
            "rope_in_ring": all(m.packed_rotary is not None for m in rings) if model_kw.get(
                "position_embedding_type", "rope") == "rope" else all(m.packed_rotary is None for m in rings),
            "unpatched": cuda_hardcodes_unpatched(),
            "wrapped_once": all(type(m.rope).__name__ == "RotaryEmbedding" for m in wrappers),
        }
    return out


def packed_core_attention(rank: int, world_size: int, layout: str, causal: bool) -> dict:
    """RingDotProductAttention on a padded THD stream (no RoPE) vs fp64 attention over each real document
    alone, causal or not: the real tokens' outputs and the q, k, v gradients (GQA)."""
    from megatron.core.transformer.enums import AttnMaskType

    from cp_attention.integrations import megatron as cpm

    from ..core.reference import reference_attention

    parallel_state(world_size)
    ring = _ring(world_size, layout=layout, attn_mask_type=AttnMaskType.causal if causal else AttnMaskType.no_mask)
    ring.global_positions_ready = True
    _, params, spans = packed_batch(padded=True)
    documents = cpm.packed_documents(params)
    lay = cpa.get_layout(layout)

    def mine(t: torch.Tensor) -> torch.Tensor:
        return lay.shard(t, 0, rank, world_size, cu_seqlens=documents)

    q, k, v = (t[:, 0] for t in _qkv(SEQ, batch=1, seed=11))  # [SEQ, h, d]
    dout = torch.randn(SEQ, 4 * 8, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    real = torch.zeros(SEQ, dtype=torch.bool)
    for start, length in spans:
        real[start:start + length] = True
    dout[~real] = 0.0  # padding outputs are not part of the loss
    local = [mine(t).requires_grad_() for t in (q, k, v)]
    got = ring(*local, None, packed_seq_params=params)
    got.backward(mine(dout))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.zeros(SEQ, 4 * 8, dtype=torch.float64)
    for start, length in spans:
        out, _ = reference_attention(*(t[None, start:start + length] for t in full), causal=causal, scale=8 ** -0.5)
        want[start:start + length] = out[0].flatten(1)
    (want * dout).sum().backward()
    return {
        "shape": tuple(got.shape) == (SEQ // world_size, 4 * 8),
        "out": (got - mine(want.detach()))[mine(real)].abs().max().item(),
        "grads": max((a.grad - mine(b.grad)).abs().max().item() for a, b in zip(local, full)),
        "finite": bool(torch.isfinite(got).all()),
    }


def packed_batch_sharding(rank: int, world_size: int, table: torch.Tensor) -> dict[str, bool]:
    """get_batch_on_this_cp_rank on packed batches: megatron's THD batch entries and packed_seq_params shard
    alike, round trip exactly, make positions within documents; packed_rows are the rows of megatron's
    ``table`` (:func:`megatron_rope_table`) there."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from cp_attention.integrations import megatron as cpm

    group = parallel_state(world_size).get_context_parallel_group()
    out = {}
    for padded in (False, True):
        batch, params, _ = packed_batch(padded)
        batch["absent"] = None
        documents = cpm.packed_documents(params)
        entries = dict(batch, cu_seqlens=params.cu_seqlens_q[None],  # collated [1, n], as megatron's loaders give
                       cu_seqlens_padded=params.cu_seqlens_q_padded, max_seqlen=torch.tensor([SEQ]))
        with_positions = dict(batch, position_ids=torch.arange(SEQ)[None])
        for layout in cpa.LAYOUT_NAMES:
            lay = cpa.get_layout(layout)
            local = cpm.get_batch_on_this_cp_rank(batch, layout=layout, cp_group=group, packed_seq_params=params)
            from_entries = cpm.get_batch_on_this_cp_rank(entries, layout=layout, cp_group=group)
            given = cpm.get_batch_on_this_cp_rank(with_positions, layout=layout, cp_group=group,
                                                  packed_seq_params=params)
            held = lay.positions(SEQ, rank, world_size, documents)
            within = held - torch.tensor(documents)[torch.searchsorted(torch.tensor(documents), held, right=True) - 1]
            built = from_entries["packed_seq_params"]
            out[f"{layout}/padded={padded}"] = (
                all(torch.equal(lay.gather(local[k], 1, group, cu_seqlens=documents), v)
                    for k, v in batch.items() if isinstance(v, torch.Tensor))
                and local["absent"] is None and local["packed_seq_params"] is params
                and torch.equal(local["position_ids"], within[None])
                and torch.equal(given["position_ids"], held[None])  # given positions are sharded, not replaced
                and all(torch.equal(from_entries[k], local[k])
                        for k in ("tokens", "labels", "loss_mask", "position_ids"))
                and from_entries["cu_seqlens"] is entries["cu_seqlens"]
                and built.qkv_format == "thd" and built.max_seqlen_q == SEQ
                and cpm.packed_documents(built) == documents)
    for layout in cpa.LAYOUT_NAMES:
        wrapped = cpm.LayoutRotaryEmbedding(
            RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True), layout, group)
        documents = cpm.packed_documents(packed_batch(True)[1])
        held = cpa.get_layout(layout).positions(SEQ, rank, world_size, documents)
        within = cpa.document_position_ids(held, documents)
        out[f"{layout}/rope_rows"] = torch.equal(wrapped.packed_rows(documents), table.index_select(0, within))
    return out


def packed_refusals(rank: int, world_size: int) -> dict[str, str]:
    """Packed (THD) inputs the ring cannot honour, and the error each raised on this rank."""
    import dataclasses

    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from cp_attention.integrations import megatron as cpm

    parallel_state(world_size)
    q, k, v = _qkv(SEQ // world_size)
    ring = _ring(world_size)
    ring.global_positions_ready = True
    out: dict[str, str] = {}
    batch, good, _ = packed_batch(padded=True)
    tq, tk, tv = (t[:, 0] for t in (q, k, v))  # THD [t, heads, dim]

    def call(params, attention=ring, mask=None, tensors=(tq, tk, tv)):
        return lambda: attention(*tensors, mask, packed_seq_params=params)

    cross = dataclasses.replace(good, cu_seqlens_kv=torch.tensor([0, 4, SEQ - 4]))
    out["packed_sbhd"] = _error(call(dataclasses.replace(good, qkv_format="sbhd")))
    out["packed_cross"] = _error(call(cross))
    out["packed_one_rank_bad"] = _error(call(cross if rank == 0 else good))
    out["packed_mask"] = _error(call(good, mask=torch.zeros(1, 1, tq.shape[0], SEQ, dtype=torch.bool)))
    out["packed_local_cp_size"] = _error(call(dataclasses.replace(good, local_cp_size=1)))
    singles = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group
    out["packed_cp_group"] = _error(call(dataclasses.replace(good, cp_group=singles[rank])))
    out["packed_wrong_length"] = _error(call(good, tensors=(tq[:-2], tk[:-2], tv[:-2])))
    out["packed_no_cu"] = _error(call(dataclasses.replace(good, cu_seqlens_q=None, cu_seqlens_kv=None)))
    short = torch.tensor([0, 1, 3, 5, 15, 24], dtype=torch.int32)  # document 1: 5 real tokens in 2 slots
    out["packed_padding_too_short"] = _error(call(dataclasses.replace(good, cu_seqlens_q_padded=short,
                                                                      cu_seqlens_kv_padded=short)))
    mtp = _ring(world_size, cfg=config(world_size, mtp_num_layers=1))
    mtp.global_positions_ready = True
    out["packed_mtp"] = _error(call(good, attention=mtp))
    out["packed_batch_twice"] = _error(lambda: cpm.get_batch_on_this_cp_rank(
        dict(batch, cu_seqlens=good.cu_seqlens_q), packed_seq_params=good))
    out["packed_batch_rows"] = _error(lambda: cpm.get_batch_on_this_cp_rank(
        {"tokens": torch.zeros(2, SEQ)}, packed_seq_params=good))
    ten = dataclasses.replace(good, cu_seqlens_q=torch.tensor([0, 3, 10]), cu_seqlens_kv=None,
                              cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None)
    out["packed_unsplittable"] = _error(lambda: cpm.get_batch_on_this_cp_rank(
        {"tokens": torch.zeros(1, 10)}, packed_seq_params=ten))
    out["packed_batch_mask"] = _error(lambda: cpm.get_batch_on_this_cp_rank(
        dict(batch, attention_mask=torch.zeros(1, 1, SEQ, SEQ, dtype=torch.bool)), packed_seq_params=good))
    unlinked = cpm.LayoutRotaryEmbedding(RotaryEmbedding(kv_channels=8, rotary_percent=1.0,
                                                         use_cpu_initialization=True), "zigzag", ring.cp_group)
    out["packed_rope_not_linked"] = _error(lambda: unlinked(SEQ, packed_seq=True))
    return out
