"""A CP-patched HF model with every rank in one process (cp_attention.transport.loopback): N replicas of the model,
one thread each, so the adapter runs on one GPU (and, in fp64, on the CPU in CI)."""

from __future__ import annotations

import copy

import torch

import cp_attention as cpa
from cp_attention.transport.loopback import LoopbackGroup

from .hf_cases import batch, build


def loopback_equivalence(world_size: int, *, family: str = "llama", layout: str = "zigzag", device: str = "cpu",
                         dtype: torch.dtype = torch.float64, seq: int = 32, cp_comm_type: str = "p2p",
                         mesh_shape: tuple[int, int] | None = None) -> dict:
    """Max abs differences of the gathered logits, the loss and the rank-summed gradients of the patched
    replicas against the unpatched model (the same dtype and device); ``grads_rel``: the worst gradient
    difference relative to that parameter's largest gradient. ``cp_comm_type`` and ``mesh_shape`` (a
    two-level group) as in ``apply_context_parallel``."""
    from cp_attention.integrations import huggingface as cphf

    ref = build(family).to(device=device, dtype=dtype)
    ids = batch(seq=seq).to(device)
    ref_logits = ref(input_ids=ids, use_cache=False).logits
    # fp32 or wider like causal_lm_loss (a bf16 cross-entropy would round the loss itself by ~0.03)
    wide = ref_logits.double() if dtype == torch.float64 else ref_logits.float()
    ref_loss = torch.nn.functional.cross_entropy(wide[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    ref_loss.backward()
    loop = LoopbackGroup(world_size, mesh_shape=mesh_shape)
    replicas = [cphf.apply_context_parallel(copy.deepcopy(ref), group=loop.rank(r), layout=layout,
                                            cp_comm_type=cp_comm_type) for r in range(world_size)]
    for m in replicas:
        m.zero_grad(set_to_none=True)

    def rank_fn(group):
        model = replicas[group.rank]
        local = cphf.shard_batch({"input_ids": ids}, group=group, layout=layout)
        out = model(**cphf.model_inputs(local), use_cache=False)
        loss = cphf.causal_lm_loss(out.logits, local["shift_labels"], group=group)
        loss.backward()
        return out.logits.detach(), loss.detach()

    results = loop.run(rank_fn)
    logits = cpa.get_layout(layout).unshard([r[0] for r in results], 1)
    params = [list(m.parameters()) for m in replicas]
    diffs = [((sum(ps[i].grad.double() for ps in params) - p.grad.double()).abs().max().item(),
              p.grad.double().abs().max().item()) for i, p in enumerate(ref.parameters())]
    grad_err = max(d for d, _ in diffs)
    grad_rel = max(d / max(scale, 1e-30) for d, scale in diffs)
    return {"logits": (logits.double() - ref_logits.double()).abs().max().item(),
            "loss": max(abs(r[1].item() - ref_loss.item()) for r in results),
            "grads": grad_err, "grads_rel": grad_rel}


def packed_rows(lengths: list[list[int]], seed: int = 3) -> tuple[dict, list[torch.Tensor]]:
    """A packed batch (``position_ids`` restarting at 0 at every document; row r holds documents of
    ``lengths[r]`` tokens, every row as long) and its documents as separate token rows."""
    from .hf_cases import VOCAB

    width = sum(lengths[0])
    if any(sum(row) != width for row in lengths):
        raise ValueError(f"every row must hold {width} tokens, got {[sum(row) for row in lengths]}")
    ids = torch.randint(0, VOCAB, (len(lengths), width), generator=torch.Generator().manual_seed(seed))
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    docs = []
    for r, row in enumerate(lengths):
        starts = [sum(row[:i]) for i in range(len(row))]
        docs += [ids[r, a:a + n] for a, n in zip(starts, row)]
    return {"input_ids": ids, "position_ids": pos}, docs


def loopback_documents(world_size: int, lengths: list[list[int]], *, layout: str, family: str = "llama") -> dict:
    """A packed batch (:func:`packed_rows`) through ``shard_batch`` and the patched model on loopback
    ranks, against each document run alone without CP (fp64): max abs differences of the gathered logits
    (per document), the loss and the rank-summed gradients; ``sharded`` whether every rank's tokens,
    positions and labels are ``layout.shard(..., cu_seqlens=cu)`` of the packed stream (computed here,
    independently of shard_batch); ``cu`` the stream's documents (the padding one included)."""
    from cp_attention.integrations import huggingface as cphf
    from cp_attention.layouts.documents import cu_seqlens_from_lengths, pad_cu_seqlens

    ref = build(family)
    full, docs = packed_rows(lengths)
    lay = cpa.get_layout(layout)
    ref_logits, total, count = [], 0.0, 0
    for doc in docs:
        logits = ref(input_ids=doc[None]).logits[0]
        ref_logits.append(logits.detach())
        if doc.numel() > 1:
            total = total + torch.nn.functional.cross_entropy(logits[:-1], doc[1:], reduction="sum")
            count += doc.numel() - 1
    ref_loss = total / count
    ref_loss.backward()
    # The stream shard_batch must build: every document in order, one padding document up to the divisor.
    cu, pad = pad_cu_seqlens(cu_seqlens_from_lengths([n for row in lengths for n in row]), lay.divisor(world_size))
    stream = torch.cat([*docs, torch.zeros(pad, dtype=torch.long)])[None]
    within = torch.cat([torch.arange(b - a) for a, b in zip(cu, cu[1:])])[None]
    labels = torch.cat([torch.cat([d[1:], d.new_full((1,), -100)]) for d in docs]
                       + [torch.full((pad,), -100, dtype=torch.long)])[None]
    loop = LoopbackGroup(world_size)
    replicas = [cphf.apply_context_parallel(copy.deepcopy(ref), group=loop.rank(r), layout=layout)
                for r in range(world_size)]
    for m in replicas:
        m.zero_grad(set_to_none=True)

    def rank_fn(group):
        r = group.rank
        local = cphf.shard_batch(full, group=group, layout=layout)
        sharded = (tuple(local["cu_seq_lens_q"].tolist()) == cu
                   and all(torch.equal(local[key], lay.shard(want, 1, r, world_size, cu_seqlens=cu))
                           for key, want in (("input_ids", stream), ("position_ids", within),
                                             ("shift_labels", labels))))
        out = replicas[r](**cphf.model_inputs(local))
        loss = cphf.causal_lm_loss(out.logits, local["shift_labels"], group=group)
        loss.backward()
        return out.logits.detach(), loss.detach(), sharded

    results = loop.run(rank_fn)
    logits = lay.unshard([res[0] for res in results], 1, cu_seqlens=cu)[0]
    got = [logits[a:b] for a, b in zip(cu, cu[1:])][:len(docs)]
    params = [list(m.parameters()) for m in replicas]
    grads = max((sum(ps[i].grad for ps in params) - p.grad).abs().max().item() for i, p in enumerate(ref.parameters()))
    return {"logits": max((g - w).abs().max().item() for g, w in zip(got, ref_logits)),
            "loss": max(abs(res[1].item() - ref_loss.item()) for res in results), "grads": grads,
            "sharded": [res[2] for res in results], "cu": cu}
