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
                         mesh_shape: "tuple[int, int] | None" = None) -> dict:
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
