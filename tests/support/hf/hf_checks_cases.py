"""Cases for tests/adapters/hf/test_checks.py (run in the gloo workers): what one forward of a CP-patched HF
model costs in collectives, and what ranks holding different inputs get."""

from __future__ import annotations

import torch

from cp_attention.checks.agreement import VERDICTS

from ..core.agreement_cases import counting
from .hf_cases import SEQ, batch, build


def forward_collectives(rank: int, world_size: int, *, packed: bool) -> list[int]:
    """Collectives in each of two forwards (the ring's validation cache emptied first, so the layers
    would all-gather if the forward were not agreed)."""
    from cp_attention.integrations import huggingface as cphf

    model = cphf.apply_context_parallel(build("llama"), layout="zigzag")
    ids = batch(size=1)
    full = {"input_ids": ids}
    if packed:
        full["position_ids"] = torch.cat([torch.arange(5), torch.arange(SEQ - 5)])[None]
    local = cphf.shard_batch(full, layout="zigzag")
    counts = []
    VERDICTS.clear()
    for _ in range(2):
        with counting() as c:
            model(**cphf.model_inputs(local))
        counts.append(c["collectives"])
    return counts


def different_shapes(rank: int, world_size: int) -> tuple[str, str]:
    """Rank 0 shards a batch of SEQ tokens, the others one of 2*SEQ: every rank must raise alike."""
    import cp_attention as cpa
    from cp_attention.integrations import huggingface as cphf
    from cp_attention.integrations.huggingface import batch as hf_batch

    model = cphf.apply_context_parallel(build("llama"), layout="zigzag")
    ids = batch(size=1, seq=SEQ if rank == 0 else 2 * SEQ)
    # Each rank shards its own batch alone (shard_batch itself would refuse the difference).
    local = hf_batch._shard_batch({"input_ids": ids}, cpa.get_layout("zigzag"), rank, world_size)
    try:
        model(**cphf.model_inputs(local))
    except ValueError as e:
        return "ValueError", str(e)
    return "", ""


def shard_batch_outcome(rank: int, world_size: int, *, case: str) -> tuple[str, str]:
    """shard_batch where one rank's batch differs (``case``): every rank must raise alike."""
    from cp_attention.integrations import huggingface as cphf

    ids = batch(size=1)
    full = {"input_ids": ids}
    if rank == 1:
        if case == "bad_on_one_rank":  # a hole in the padding: refused on this rank's data alone
            mask = torch.ones_like(ids)
            mask[0, 5] = 0
            full["attention_mask"] = mask
        elif case == "longer_on_one_rank":
            full["input_ids"] = batch(size=1, seq=2 * SEQ)
        elif case == "other_documents_on_one_rank":
            full["position_ids"] = torch.cat([torch.arange(5), torch.arange(SEQ - 5)])[None]
    if case == "other_documents_on_one_rank" and rank != 1:
        full["position_ids"] = torch.cat([torch.arange(6), torch.arange(SEQ - 6)])[None]
    try:
        cphf.shard_batch(full, layout="zigzag")
    except (ValueError, NotImplementedError) as e:
        return type(e).__name__, str(e)
    return "", ""
