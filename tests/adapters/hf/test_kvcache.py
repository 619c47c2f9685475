"""The sharded KV cache decodes only after its sharded prefill: a decoding step on an empty layer is
refused by name on every rank, whether the rank keeps the new token or not (it never returns no K/V)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")


@pytest.mark.parametrize("keeps", [True, False], ids=["owner", "other-rank"])
def test_a_decoding_step_before_the_prefill_is_refused(keeps):
    from cp_attention.integrations.huggingface.kvcache import sharded_cache

    layer = sharded_cache(1, lambda: keeps).layers[0]
    k = torch.randn(1, 2, 1, 4)
    with pytest.raises(RuntimeError, match="holds nothing before its sharded prefill"):
        layer.update(k, k.clone())


def test_a_decoding_step_after_the_prefill_returns_the_share():
    from cp_attention.integrations.huggingface.kvcache import sharded_cache

    layer = sharded_cache(1, lambda: True).layers[0]
    layer.start(torch.tensor([[0, 1, 2]]), torch.tensor([[0, 2, 4]]), 6)
    k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    layer.update(k, v)  # prefill: [1, Hkv, n, D] is the shard's stream (batch 1 here)
    k1, v1 = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4)
    keys, values = layer.update(k1, v1)
    assert torch.equal(keys, torch.cat([k, k1], dim=-2)) and torch.equal(values, torch.cat([v, v1], dim=-2))
    assert layer.positions.tolist() == [[0, 2, 4, 6]]
    assert layer.visible(None).all() and layer.visible(1).tolist() == [[False, False, False, True]]
