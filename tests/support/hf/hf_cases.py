"""HuggingFace cases run inside the gloo workers: tiny models from config classes, no download."""

from __future__ import annotations

import copy
import tempfile

import torch
import torch.distributed as dist

SEQ = 16
VOCAB = 64
# fp64 attention without the fp32 softmax upcast of HF's eager path: the exact reference for
# models that have no sdpa path (Gemma2).
REFERENCE_IMPL = "cp_test_fp64_reference"


def _reference_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                         **kwargs):
    rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    scores = query @ key.transpose(2, 3) * scaling
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, :, : key.shape[-2]]
    return (scores.softmax(-1) @ value).transpose(1, 2).contiguous(), None


def _config(family: str, **overrides):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
    if family == "llama":
        cfg = tf.LlamaConfig(**common)
    elif family == "llama_bidirectional":  # transformers' is_causal=False: bidirectional masks and attention
        cfg = tf.LlamaConfig(**common)
        cfg.is_causal = False
    elif family == "qwen2":
        cfg = tf.Qwen2Config(**common)
    elif family == "mistral":
        cfg = tf.MistralConfig(**common)
    elif family == "gemma2":
        cfg = tf.Gemma2Config(**common, head_dim=8, attn_logit_softcapping=None)
    elif family == "gemma2_softcap":  # a cap small enough to change every tiny model's scores
        cfg = tf.Gemma2Config(**common, head_dim=8, attn_logit_softcapping=0.5)
    elif family == "gpt_oss":  # learned attention sinks (s_aux); eager experts: grouped_mm has no fp64
        cfg = tf.GptOssConfig(**common, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                              experts_implementation="eager")
    elif family.endswith("_window"):
        cfg = _window_config(tf, family[:-len("_window")], common)
    else:
        raise ValueError(family)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


# Sliding windows (transformers' size W: query i sees keys i - W < j <= i) smaller than a CP chunk at
# WINDOW_SEQ tokens (8 on 4 ranks, 4 per zigzag half-chunk) and larger, on some layers of each model.
WINDOW_SEQ = 32
NO_WINDOW = 10**6  # a window wider than any sequence: the same model without its windows


def _window_config(tf, base: str, common: dict):
    three = {**common, "num_hidden_layers": 3}
    if base == "mistral":  # every layer
        return tf.MistralConfig(**common, sliding_window=5)
    if base == "qwen2":  # layers >= max_window_layers slide: layer 1
        return tf.Qwen2Config(**common, use_sliding_window=True, sliding_window=12, max_window_layers=1)
    if base == "qwen3":  # layers 1 and 2
        return tf.Qwen3Config(**three, head_dim=8, use_sliding_window=True, sliding_window=3, max_window_layers=1)
    if base == "qwen2_moe":  # the window reaches the attention only through the mask; layer 0 slides
        return tf.Qwen2MoeConfig(**common, use_sliding_window=True, sliding_window=6, max_window_layers=2,
                                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                 shared_expert_intermediate_size=32, experts_implementation="eager")
    if base == "gemma2":  # alternating local (layer 0) and global layers, with logit softcapping
        return tf.Gemma2Config(**common, head_dim=8, sliding_window=7, attn_logit_softcapping=0.5)
    if base == "gemma3":  # local and global layers (Gemma3ForCausalLM)
        return tf.Gemma3TextConfig(**three, head_dim=8, sliding_window=4,
                                   layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    if base == "gpt_oss":  # alternating, with sinks
        return tf.GptOssConfig(**common, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                               experts_implementation="eager", sliding_window=6)
    raise ValueError(base)


def window_effect(family: str, ids: torch.Tensor, logits: torch.Tensor) -> float:
    """How far ``logits`` (of ``build(family)`` on ``ids``) are from the same model without its windows:
    a test that ignored the windows would be off by this much."""
    with torch.no_grad():
        return (build(family, sliding_window=NO_WINDOW)(input_ids=ids).logits - logits).abs().max().item()


def build(family: str, seed: int = 0, **overrides):
    """A tiny fp64 causal LM with deterministic weights (the same on every rank)."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(_config(family, **overrides)).double()
    if family.startswith("gemma2"):
        from transformers.masking_utils import AttentionMaskInterface, eager_mask

        tf.AttentionInterface.register(REFERENCE_IMPL, _reference_attention)
        AttentionMaskInterface.register(REFERENCE_IMPL, eager_mask)
        model.set_attn_implementation(REFERENCE_IMPL)
    return model


def batch(seed: int = 1, size: int = 2, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (size, seq), generator=torch.Generator().manual_seed(seed))


def _reference_loss(model, ids, with_logits=False):
    """Next-token cross-entropy in fp64 on the full sequence (HF's own loss upcasts to fp32)."""
    logits = model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    return (loss, logits) if with_logits else loss


def _cp_step(model, ids, group, layout, cphf):
    local = cphf.shard_batch({"input_ids": ids}, group=group, layout=layout)
    out = model(input_ids=local["input_ids"], position_ids=local["position_ids"])
    loss = cphf.causal_lm_loss(out.logits, local["shift_labels"], group=group)
    loss.backward()
    return out, loss


def _summed_grads(model, group):
    grads = []
    for p in model.parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=group)
        grads.append(g)
    return grads


def equivalence(rank: int, world_size: int, *, family: str, layout: str, from_checkpoint: bool = False,
                seq: int = SEQ) -> dict:
    """Max abs differences of gathered logits, loss and CP-summed gradients against the model without CP
    (and, for windowed families, the :func:`window_effect` that shows the windows mattered)."""
    from cp_attention.integrations import huggingface as cphf

    ref = build(family)
    if from_checkpoint:
        # rank 0 writes, every rank loads; the loaded model is both the reference and the patched model
        # (HF recomputes some buffers on load, so it is not bit-identical to the in-memory original)
        import transformers as tf

        path = [tempfile.mkdtemp() if rank == 0 else None]
        dist.broadcast_object_list(path)
        if rank == 0:
            ref.save_pretrained(path[0])
        dist.barrier()
        eager_experts = {"experts_implementation": "eager"} if family == "gpt_oss" else {}  # fp64 MoE
        ref = tf.AutoModelForCausalLM.from_pretrained(path[0], dtype=torch.float64, **eager_experts)
        if family.startswith("gemma2"):
            ref.set_attn_implementation(REFERENCE_IMPL)
    model = copy.deepcopy(ref)
    ids = batch(seq=seq)
    ref_loss, ref_logits = _reference_loss(ref, ids, with_logits=True)
    ref_loss.backward()
    with torch.no_grad():
        hf_loss = ref(input_ids=ids, labels=ids).loss

    cphf.apply_context_parallel(model, layout=layout)
    out, loss = _cp_step(model, ids, None, layout, cphf)
    logits = cphf.gather_sequence(out.logits.detach(), layout=layout)
    grads = _summed_grads(model, None)
    return {
        "logits": (logits - ref_logits).abs().max().item(),
        "loss": abs(loss.item() - ref_loss.item()),
        "hf_loss": abs(loss.item() - hf_loss.item()),
        # transformers < 5.4 loads GPT-OSS's norms (_keep_in_fp32_modules) in fp32 even with dtype=float64:
        # their gradients, summed over the ranks, differ at fp32 rounding
        "grads": max([(g - p.grad).abs().max().item() for g, p in zip(grads, ref.parameters())
                      if p.dtype != torch.float32] + [0.0]),
        "fp32_grads": max([(g - p.grad).abs().max().item() for g, p in zip(grads, ref.parameters())
                           if p.dtype == torch.float32] + [0.0]),
        "finite": bool(torch.isfinite(out.logits).all()),
        "impl": model.config._attn_implementation,
        "window_effect": window_effect(family, ids, ref_logits) if family.endswith("_window") else None,
    }


def optimizer_steps(rank: int, world_size: int, *, layout: str, steps: int = 3) -> float:
    """Max parameter difference after a few AdamW steps with and without CP."""
    from cp_attention.integrations import huggingface as cphf

    ref = build("llama")
    model = cphf.apply_context_parallel(copy.deepcopy(ref), layout=layout)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        ids = batch(seed=10 + step)
        _reference_loss(ref, ids).backward()
        _cp_step(model, ids, None, layout, cphf)
        for p, g in zip(model.parameters(), _summed_grads(model, None)):
            p.grad = g
        opt_ref.step(), opt.step(), opt_ref.zero_grad(), opt.zero_grad()
    return max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))


def _gathered_logits(model, ids, group, layout, cphf):
    local = cphf.shard_batch({"input_ids": ids}, group=group, layout=layout)
    out = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
    return cphf.gather_sequence(out, group=group, layout=layout)


def isolation(rank: int, world_size: int) -> dict:
    """Two patched models with different layouts (one over a subgroup) and one unpatched, in one process."""
    from cp_attention.integrations import huggingface as cphf

    pair = dist.new_group([0, 1])  # every rank creates it; ranks 0 and 1 use it
    ids = batch(seq=24)  # divisible by 2 * world_size for zigzag on 3 ranks
    base = build("llama")
    want = base(input_ids=ids).logits
    a = cphf.apply_context_parallel(copy.deepcopy(base), layout="zigzag")
    plain = copy.deepcopy(base)
    out_a = _gathered_logits(a, ids, None, "zigzag", cphf)
    result = {"a": (out_a - want).abs().max().item()}
    if rank < 2:
        b = cphf.apply_context_parallel(copy.deepcopy(base), group=pair, layout="interleaved")
        result["b"] = (_gathered_logits(b, ids, pair, "interleaved", cphf) - want).abs().max().item()
        # model a still runs on the default group with zigzag after b was patched
        result["a_after_b"] = (_gathered_logits(a, ids, None, "zigzag", cphf) - out_a).abs().max().item()
    else:
        _gathered_logits(a, ids, None, "zigzag", cphf)  # keep the default group's collectives in step
    result["plain"] = (plain(input_ids=ids).logits - want).abs().max().item()
    result["plain_impl"] = plain.config._attn_implementation
    return result


def world_size_one_is_noop(rank: int, world_size: int) -> dict:
    """A group of one rank: the model object is untouched and generation still works."""
    from cp_attention.integrations import huggingface as cphf

    groups = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group
    model = build("llama")
    before = model.config._attn_implementation
    same = cphf.apply_context_parallel(model, group=groups[rank], layout="zigzag")
    ids = batch(size=1, seq=4)
    generated = model.generate(ids, max_new_tokens=3, do_sample=False)
    return {"same": same is model, "impl": (before, model.config._attn_implementation),
            "generated": generated.shape[1], "patched": hasattr(model, "_cp_attention")}


def refusal(rank: int, world_size: int, *, case: str) -> tuple[str, str]:
    """Run one unsupported feature on a patched model; return the exception type and message."""
    from cp_attention.integrations import huggingface as cphf

    family, overrides = {"window_zero": ("mistral", dict(sliding_window=0)),
                         "window_disagrees": ("qwen2_window", {}),
                         "bidirectional_window": ("mistral_window", dict(is_causal=False)),
                         "mask_disagrees_with_layer": ("gemma2_window", dict(use_bidirectional_attention=True)),
                         "mask_overlay": ("gemma3_window", dict(use_bidirectional_attention=True)),
                         "softcap": ("gemma2_softcap", {}),
                         "dropout": ("llama", dict(attention_dropout=0.1))}.get(case, ("llama", {}))
    ids = batch()
    try:
        kernel = "sdpa" if case == "softcap" else "auto"  # softcap needs a kernel that can cap
        layout = "contiguous" if case == "contiguous_missing_position_ids" else "zigzag"
        model = cphf.apply_context_parallel(build(family, **overrides), layout=layout, kernel=kernel)
        local = cphf.shard_batch({"input_ids": ids}, layout=layout)
        kwargs = dict(input_ids=local["input_ids"], position_ids=local["position_ids"])
        if case == "padding_hole":  # left and right padding are exact; a hole between real tokens is not
            mask = torch.ones_like(ids)
            mask[0, 5] = 0
            cphf.shard_batch({"input_ids": ids, "attention_mask": mask}, layout="zigzag")
        elif case == "labels_dp_cp_mesh":  # the loss's mean (CP group or whole mesh) is the caller's to say
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "cp"))
            model = cphf.apply_context_parallel(build(family), group=mesh, layout=layout)
            model(**cphf.shard_batch({"input_ids": ids, "labels": ids}, group=mesh, layout=layout))
        elif case == "padded_and_packed":
            mask = torch.ones_like(ids)
            mask[0, -3:] = 0
            pos = torch.cat([torch.arange(5), torch.arange(SEQ - 5)]).expand_as(ids)
            cphf.shard_batch({"input_ids": ids, "attention_mask": mask, "position_ids": pos}, layout="zigzag")
        elif case == "packed_kv_differs":
            cu = torch.tensor([0, 5, SEQ], dtype=torch.int32)
            model(input_ids=local["input_ids"], cu_seq_lens_q=cu, cu_seq_lens_k=torch.tensor([0, 6, SEQ]))
        elif case == "padding_forward":
            mask = torch.ones_like(local["input_ids"])
            mask[0, 0] = 0
            model(**kwargs, attention_mask=mask)
        elif case in ("missing_position_ids", "contiguous_missing_position_ids"):
            # contiguous: HF's default positions are right on rank 0 only, which once let it go on alone
            model(input_ids=local["input_ids"])
        elif case == "padding_on_one_rank":  # right padding lives in the last rank's shard only
            mask = torch.ones_like(local["input_ids"])
            if rank == world_size - 1:
                mask[0, -1] = 0
            model(**kwargs, attention_mask=mask)
        elif case == "positions_wrong_on_one_rank":
            model(input_ids=local["input_ids"], position_ids=local["position_ids"] + (rank == 1))
        elif case == "generate":
            model.generate(local["input_ids"], max_new_tokens=2)
        elif case == "kv_cache_decode":
            out = model(**kwargs, use_cache=True)
            model(input_ids=local["input_ids"][:, :1], position_ids=local["position_ids"][:, :1] + SEQ,
                  past_key_values=out.past_key_values)
        elif case == "dropout":
            model.train()
            model(**kwargs)
        elif case == "window_disagrees":  # its mask says 12, its attention argument 3
            model.model.layers[1].self_attn.sliding_window = 3
            model(**kwargs)
        elif case == "output_attentions":  # the ring never holds the weights; None must not pass for them
            model(**kwargs, output_attentions=True)
        elif case == "packed_kwargs":  # documents given, but the positions are not within the documents
            cu = torch.tensor([0, 5, SEQ], dtype=torch.int32)
            model(**kwargs, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=11, max_length_k=11)
        else:
            model(**kwargs)
    except Exception as e:  # noqa: BLE001 - the test checks what was raised
        return type(e).__name__, str(e)
    return "", ""


def _documents_batch(mode: str, seed: int = 3):
    """A batch in one of HF's packed or padded forms, and its documents as separate rows (token lists)."""
    g = torch.Generator().manual_seed(seed)
    if mode in ("packed_positions", "collator"):
        lengths = [[1, 6, 2, 14], [9, 5, 3, 6]] if mode == "packed_positions" else [[3, 1, 11, 7, 1]]
        ids = torch.randint(0, VOCAB, (len(lengths), sum(lengths[0])), generator=g)
        pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
        docs, b = [], {"input_ids": ids, "position_ids": pos}
        for r, row in enumerate(lengths):
            start = 0
            for n in row:
                docs.append(ids[r, start:start + n])
                start += n
        if mode == "collator":  # what DataCollatorWithFlattening(return_flash_attn_kwargs=True) emits
            cu = torch.tensor([0, *torch.cumsum(torch.tensor(lengths[0]), 0).tolist()], dtype=torch.int32)
            b.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths[0]), max_length_k=max(lengths[0]))
        return b, docs
    if mode == "unsplittable":  # a plain batch whose length no layout splits: each row a document
        ids = torch.randint(0, VOCAB, (2, 13), generator=g)
        return {"input_ids": ids}, [ids[0], ids[1]]
    real = [13, 5, 17]
    s = max(real) + 3
    ids = torch.randint(0, VOCAB, (len(real), s), generator=g)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(real):
        if mode.startswith("padded_right"):
            mask[r, :n] = 1
        else:
            mask[r, s - n:] = 1
    docs = [ids[r][mask[r].bool()] for r in range(len(real))]
    out = {"input_ids": ids, "attention_mask": mask}
    if mode.endswith(("_cumsum", "_filled")):  # HF's generate and many collators: 0, 1, ... over real tokens
        out["position_ids"] = mask.cumsum(-1) - 1  # the padding: -1 on the left, the last position on the right
        if mode.endswith("_filled"):
            out["position_ids"].masked_fill_(mask == 0, 1)
    return out, docs


def documents_equivalence(rank: int, world_size: int, *, family: str, layout: str, mode: str) -> dict:
    """A packed or padded batch under CP against each document run alone without CP (fp64): gathered
    logits per document, the loss and the CP-summed gradients."""
    from cp_attention.integrations import huggingface as cphf

    ref = build(family)
    model = copy.deepcopy(ref)
    full, docs = _documents_batch(mode)
    ref_logits, total, count, effect = [], 0.0, 0, 0.0
    for doc in docs:
        logits = ref(input_ids=doc[None]).logits[0]
        ref_logits.append(logits.detach())
        if family.endswith("_window"):
            effect = max(effect, window_effect(family, doc[None], logits[None]))
        if doc.numel() > 1:
            total = total + torch.nn.functional.cross_entropy(logits[:-1], doc[1:], reduction="sum")
            count += doc.numel() - 1
    ref_loss = total / count
    ref_loss.backward()

    cphf.apply_context_parallel(model, layout=layout)
    local = cphf.shard_batch(full, layout=layout)
    out = model(**cphf.model_inputs(local))
    loss = cphf.causal_lm_loss(out.logits, local["shift_labels"])
    loss.backward()
    logits = cphf.gather_sequence(out.logits.detach(), layout=layout, cu_seqlens=local["cu_seq_lens_q"])[0]
    cu = local["cu_seq_lens_q"].tolist()
    got = [logits[a:b] for a, b in zip(cu, cu[1:])][:len(docs)]  # the last may be the padding document
    grads = _summed_grads(model, None)
    return {
        "logits": max((g - w).abs().max().item() for g, w in zip(got, ref_logits)),
        "loss": abs(loss.item() - ref_loss.item()),
        # transformers < 5.4 loads GPT-OSS's norms (_keep_in_fp32_modules) in fp32 even with dtype=float64:
        # their gradients, summed over the ranks, differ at fp32 rounding
        "grads": max([(g - p.grad).abs().max().item() for g, p in zip(grads, ref.parameters())
                      if p.dtype != torch.float32] + [0.0]),
        "fp32_grads": max([(g - p.grad).abs().max().item() for g, p in zip(grads, ref.parameters())
                           if p.dtype == torch.float32] + [0.0]),
        "finite": bool(torch.isfinite(out.logits).all()),
        "impl": model.config._attn_implementation,
        "shape": tuple(local["input_ids"].shape),
        # every document (and at most one padding document) is in the packed row
        "documents": len(cu) - 1 - len(docs),
        "window_effect": effect,
    }
