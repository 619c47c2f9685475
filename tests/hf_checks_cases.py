"""Cases for tests/test_hf_checks.py (run in the gloo workers): what one forward of a CP-patched HF
model costs in collectives, and what ranks holding different inputs get."""

from __future__ import annotations

import torch

from cp_attention.agreement import VERDICTS

from .agreement_cases import counting
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
    from cp_attention.integrations import huggingface as cphf

    model = cphf.apply_context_parallel(build("llama"), layout="zigzag")
    ids = batch(size=1, seq=SEQ if rank == 0 else 2 * SEQ)
    local = cphf.shard_batch({"input_ids": ids}, layout="zigzag")
    try:
        model(**cphf.model_inputs(local))
    except ValueError as e:
        return "ValueError", str(e)
    return "", ""
