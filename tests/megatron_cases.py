"""Megatron-core cases run inside the gloo workers: a tiny real ``GPTModel`` on CPU, no download.

The CP=1 reference runs megatron's own ``DotProductAttention`` and ``RotaryEmbedding``, which
hard-code CUDA; it runs in its own worker under :func:`megatron_cuda_hardcodes_on_cpu`, the only
place any megatron code is patched. The CP models run in other workers with no patch at all.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

SEQ = 24  # zigzag splits it for CP 2, 3 and 4
VOCAB = 64
IGNORE = -100
MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2)


@contextlib.contextmanager
def megatron_cuda_hardcodes_on_cpu() -> Iterator[None]:
    """Patch exactly the CUDA hard-codes megatron-core's CP=1 path hits on a machine with no GPU.

    - ``torch.cuda.current_device``: RoPE's ``get_emb`` moves ``inv_freq`` there, and the global
      memory buffer the local ``DotProductAttention`` uses allocates there. It returns ``"cpu"``.
    - ``fused_softmax.get_default_causal_mask``: builds its mask with ``device="cuda"``.
    - ``tensor_parallel.get_cuda_rng_tracker`` (as the local ``DotProductAttention`` sees it): its
      ``fork()`` needs CUDA RNG state; with dropout 0 a no-op fork is exact.
    """
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.transformer.dot_product_attention as dpa

    class _NoCudaRngTracker:
        def fork(self, *args, **kwargs):
            return contextlib.nullcontext()

        def is_initialized(self) -> bool:
            return False

    saved = (torch.cuda.current_device, fused_softmax.get_default_causal_mask,
             dpa.tensor_parallel.get_cuda_rng_tracker)
    torch.cuda.current_device = lambda: "cpu"
    fused_softmax.get_default_causal_mask = lambda sq: torch.ones(sq, sq, dtype=torch.bool).triu(1)
    dpa.tensor_parallel.get_cuda_rng_tracker = lambda *a, **k: _NoCudaRngTracker()
    try:
        yield
    finally:
        (torch.cuda.current_device, fused_softmax.get_default_causal_mask,
         dpa.tensor_parallel.get_cuda_rng_tracker) = saved


def cuda_hardcodes_unpatched() -> bool:
    """True if none of the patches of :func:`megatron_cuda_hardcodes_on_cpu` is in effect."""
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.transformer.dot_product_attention as dpa

    return (torch.cuda.current_device.__module__ == "torch.cuda"
            and fused_softmax.get_default_causal_mask.__module__ == "megatron.core.transformer.utils"
            and dpa.tensor_parallel.get_cuda_rng_tracker.__module__ == "megatron.core.tensor_parallel.random")


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


def _cp_model(world_size: int, layout: str, ref: dict, model_kw: dict, rope_layout: "str | None" = None):
    from cp_attention.integrations import megatron as cpm

    model = build(world_size, spec=cpm.get_gpt_layer_ring_spec(layout, normalization="RMSNorm"), **model_kw)
    model.load_state_dict(ref["state"])
    cpm.apply_context_parallel(model)
    if rope_layout is not None:  # a deliberately wrong RoPE, to show the test can see it
        model.rotary_pos_emb = cpm.LayoutRotaryEmbedding(model.rotary_pos_emb.rope, rope_layout,
                                                         model.rotary_pos_emb.group)
    return model


def equivalence(rank: int, world_size: int, layout: str, ref: dict, model_kw: dict, with_mask: bool = False,
                rope_layout: "str | None" = None) -> dict:
    """CP=world_size vs the reference: max abs differences of gathered logits, losses and summed grads."""
    from cp_attention.integrations import megatron as cpm

    ps = parallel_state(world_size)
    group = ps.get_context_parallel_group()
    model = _cp_model(world_size, layout, ref, model_kw, rope_layout)
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
    full_logits = cpm.cpa.get_layout(layout).gather(logits.detach(), dim=1, group=group)
    return {
        "logits": (full_logits - ref["logits"]).abs().max().item(),
        "loss": abs(stats[0].item() / stats[1].item() - ref["loss"]),
        "mcore_loss": abs(stats[2].item() / stats[1].item() - ref["mcore_loss"]),
        "grads": max((grads[n] - g).abs().max().item() for n, g in ref["grads"].items()),
        "finite": bool(torch.isfinite(logits).all()) and all(bool(torch.isfinite(g).all()) for g in grads.values()),
        "unpatched": cuda_hardcodes_unpatched(),
        "attention": sorted({type(m).__name__ for m in model.modules() if "Attention" in type(m).__name__}),
    }


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
                       rope_layout: "str | None" = None) -> dict:
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
        full = cpm.cpa.get_layout(layout).gather(logits.detach(), dim=1, group=group,
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

    from .reference import reference_attention

    parallel_state(world_size)
    ring = _ring(world_size, layout=layout, attn_mask_type=AttnMaskType.causal if causal else AttnMaskType.no_mask)
    ring.global_positions_ready = True
    _, params, spans = packed_batch(padded=True)
    documents = cpm.packed_documents(params)
    lay = cpm.cpa.get_layout(layout)

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
        for layout in cpm.cpa.LAYOUT_NAMES:
            lay = cpm.cpa.get_layout(layout)
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
    for layout in cpm.cpa.LAYOUT_NAMES:
        wrapped = cpm.LayoutRotaryEmbedding(
            RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True), layout, group)
        documents = cpm.packed_documents(packed_batch(True)[1])
        held = cpm.cpa.get_layout(layout).positions(SEQ, rank, world_size, documents)
        within = cpm.cpa.document_position_ids(held, documents)
        out[f"{layout}/rope_rows"] = torch.equal(wrapped.packed_rows(documents), table.index_select(0, within))
    return out


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


def _packed_refusals(out: dict, rank: int, world_size: int, ring, q, k, v) -> None:
    """Packed (THD) inputs the ring cannot honour, each refused by name (in place into ``out``)."""
    import dataclasses

    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from cp_attention.integrations import megatron as cpm

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
    _packed_refusals(out, rank, world_size, ring, q, k, v)
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
    out["cp_comm_type"] = _error(lambda: _ring(world_size, cp_comm_type="a2a"))
    out["window"] = _error(lambda: _ring(world_size, cfg=config(world_size, window_size=(4, 0))))
    out["softmax_type"] = _error(lambda: _ring(world_size, cfg=config(world_size, softmax_type="sigmoid")))
    out["cross_attention"] = _error(lambda: _ring(world_size, attention_type="cross"))
    out["cp_size_mismatch"] = _error(lambda: _ring(world_size, cfg=config(1)))
    out["unknown_layout"] = _error(lambda: _ring(world_size, layout="diagonal"))
    out["unknown_kernel"] = _error(lambda: _ring(world_size, kernel="cudnn"))
    out["no_ring_in_model"] = _error(lambda: cpm.apply_context_parallel(torch.nn.Linear(2, 2)))
    mixed = build(world_size, spec=spec)
    mixed.decoder.layers[1].self_attention.core_attention.layout = cpm.cpa.get_layout("interleaved")
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
    for layout in cpm.cpa.LAYOUT_NAMES:
        rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True, **kw)
        wrapped = cpm.LayoutRotaryEmbedding(rope, layout, group)
        rows = wrapped(SEQ, offset=offset)
        positions = cpm.cpa.get_layout(layout).positions(SEQ, rank, world_size)
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
    for layout in cpm.cpa.LAYOUT_NAMES:
        lay = cpm.cpa.get_layout(layout)
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
    """The losses of the Megatron example's training loop (``scripts/pretrain_megatron.py``), run in this worker."""
    from megatron.core import parallel_state as ps

    from cp_attention.training import megatron_example

    if ps.model_parallel_is_initialized():  # the example sets up its own TP x CP x DP state
        ps.destroy_model_parallel()
    _PARALLEL.clear()
    return megatron_example.train(megatron_example.parse_args(["--world-size", str(world_size), *argv]))


def pg_collection_group(rank: int, world_size: int, layout: str) -> dict:
    """CP over ``pg_collection.cp`` (two independent pairs of ranks), not megatron's global CP group."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from cp_attention.integrations import megatron as cpm

    from .reference import reference_attention

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    ring = _ring(2, layout=layout, cfg=config(2), pg_collection=ProcessGroupCollection(cp=pair))
    ring.global_positions_ready = True
    q, k, v = _qkv(SEQ, seed=rank // 2)  # each pair attends over its own sequence
    lay = cpm.cpa.get_layout(layout)
    local = [lay.shard(t, 0, rank % 2, 2) for t in (q, k, v)]
    got = ring(*local, None)
    want, _ = reference_attention(*(t.transpose(0, 1) for t in (q, k, v)), causal=True, scale=8 ** -0.5)
    want = lay.shard(want.transpose(0, 1), 0, rank % 2, 2).flatten(2)
    return {"group": ring.cp_group is pair and ring.cp_size == 2, "error": (got - want).abs().max().item()}


def softmax_sinks(rank: int, world_size: int, layout: str, softmax_type: str) -> dict:
    """megatron's ``softmax_type`` sinks on the ring against an independent fp64 reference: output, the
    input gradients, and the learnable offset's gradient summed over the CP ranks."""
    import cp_attention as cpa

    from .reference import reference_attention

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
