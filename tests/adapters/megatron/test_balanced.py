"""Issue 35: the per-batch layout ``"balanced"`` through the Megatron adapter. ``get_batch_on_this_cp_rank``
shards a THD packed batch by the placement balanced makes from THAT batch's documents
(``packed_documents(packed_seq_params)``, TransformerEngine's padded convention included), checked
against ``layout.shard(..., cu_seqlens=documents)`` computed here. The model's exactness under it (RoPE
within documents, the ring with the batch's plan) is the layout matrix of test_equivalence.py and
test_windows.py, whose batches are asserted here to be placed otherwise than zigzag places them, so
those cases could not pass by sharding with zigzag's positions.

Every rank runs as a thread of this process (the loopback ring); no megatron parallel state is needed.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="needs the megatron extra: pip install -e '.[megatron]'")

import torch  # noqa: E402

import cp_attention as cpa  # noqa: E402
from cp_attention.layouts.documents import document_position_ids  # noqa: E402
from cp_attention.transport.loopback import LoopbackGroup  # noqa: E402
from tests.support.megatron import megatron_packed_cases as mpc  # noqa: E402


def _differs_from_zigzag(cu: tuple[int, ...], world_size: int) -> bool:
    balanced, zigzag = cpa.get_layout("balanced"), cpa.get_layout("zigzag")
    return any(not torch.equal(balanced.positions(cu[-1], r, world_size, cu_seqlens=cu),
                               zigzag.positions(cu[-1], r, world_size, cu_seqlens=cu)) for r in range(world_size))


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("padded", [False, True], ids=["thd", "thd_padded"])
def test_packed_batch_is_sharded_by_its_own_documents(world_size, padded):
    """get_batch_on_this_cp_rank(layout="balanced") with packed_seq_params, and with megatron's cu_seqlens
    batch entries instead: every token tensor is balanced's shard for the batch's documents, position_ids
    are positions within documents, and the boundaries pass through."""
    from cp_attention.integrations import megatron as cpm

    batch, params, _ = mpc.packed_batch(padded)
    documents = cpm.packed_documents(params)
    assert _differs_from_zigzag(documents, world_size), documents
    entries = dict(batch, cu_seqlens=params.cu_seqlens_q[None], cu_seqlens_padded=params.cu_seqlens_q_padded)
    lay = cpa.get_layout("balanced")

    def rank_fn(group):
        return (cpm.get_batch_on_this_cp_rank(batch, layout="balanced", cp_group=group, packed_seq_params=params),
                cpm.get_batch_on_this_cp_rank(entries, layout="balanced", cp_group=group))

    for r, (local, from_entries) in enumerate(LoopbackGroup(world_size).run(rank_fn)):
        held = lay.positions(documents[-1], r, world_size, cu_seqlens=documents)
        for key in ("tokens", "labels", "loss_mask"):
            assert torch.equal(local[key], batch[key][:, held]), (r, key)
            assert torch.equal(from_entries[key], local[key]), (r, key)
        assert torch.equal(local["position_ids"], document_position_ids(held, documents)[None]), r
        assert torch.equal(from_entries["position_ids"], local["position_ids"]), r
        assert local["packed_seq_params"] is params
        assert cpm.packed_documents(from_entries["packed_seq_params"]) == documents


def test_the_layout_matrix_batches_tell_balanced_from_zigzag():
    """The packed batches of the adapter's layout matrix (test_equivalence.py: CP 2 and 3, padded or not;
    test_windows.py: CP 2 and 4) are placed otherwise by balanced than by zigzag."""
    from cp_attention.integrations import megatron as cpm

    for padded in (False, True):
        documents = cpm.packed_documents(mpc.packed_batch(padded)[1])
        for world_size in (2, 3, 4):
            assert _differs_from_zigzag(documents, world_size), (padded, world_size, documents)
