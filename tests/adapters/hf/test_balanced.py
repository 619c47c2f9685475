"""Issue 35: the per-batch layout ``"balanced"`` through the HF adapter. A packed batch is sharded by the
placement the layout makes from THAT batch's documents (``shard_batch``, the CP Trainer's batches), the
patched model attends with it, and ``generate`` prefills a packed prompt with it; each is checked against
an independent reference: ``layout.shard(..., cu_seqlens=cu)`` computed here, and the model run in one
process on each document alone (fp64, within 1e-10).

Every batch here is one where the balanced placement differs from zigzag's (asserted), so an adapter
that silently sharded by zigzag's positions (balanced without ``cu_seqlens``) would fail.

Every rank runs as a thread of this process (the loopback ring).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="needs the hf extra")
import torch  # noqa: E402

import cp_attention as cpa  # noqa: E402
from cp_attention.layouts.documents import cu_seqlens_from_lengths, pad_cu_seqlens  # noqa: E402
from cp_attention.transport.loopback import LoopbackGroup  # noqa: E402
from tests.support.hf import generate_cases  # noqa: E402
from tests.support.hf.hf_loopback_cases import loopback_documents  # noqa: E402

FP64 = 1e-10
# Two packed rows: documents of 1 to 22 tokens (62 in all: one padding document rounds the stream up)
ROWS = [[1, 6, 2, 14, 9], [5, 3, 22, 2]]


def differs_from_zigzag(cu: tuple[int, ...], world_size: int) -> bool:
    """Whether balanced places the documents ``cu`` otherwise than zigzag on some rank: else a test of this
    batch could not tell the two apart."""
    balanced, zigzag = cpa.get_layout("balanced"), cpa.get_layout("zigzag")
    return any(not torch.equal(balanced.positions(cu[-1], r, world_size, cu_seqlens=cu),
                               zigzag.positions(cu[-1], r, world_size, cu_seqlens=cu)) for r in range(world_size))


@pytest.mark.parametrize("world_size", [2, 4])
def test_packed_llama_equals_each_document_alone(world_size):
    """shard_batch(layout="balanced") on a packed batch (position_ids restarting at 0): every rank's tokens,
    positions and labels are balanced's shard of the packed stream for its documents, and the patched
    Llama's gathered logits, loss and rank-summed gradients equal each document run alone (fp64)."""
    r = loopback_documents(world_size, ROWS, layout="balanced")
    assert differs_from_zigzag(r["cu"], world_size), r["cu"]
    assert all(r["sharded"]), r["sharded"]
    for key in ("logits", "loss", "grads"):
        assert r[key] <= FP64, f"N={world_size}: {key} differs by {r[key]:.3e}"


def test_unpacked_batch_is_sharded_as_zigzag():
    """Without documents balanced is zigzag: a plain batch's shards and position ids are zigzag's."""
    from cp_attention.integrations import huggingface as cphf

    ids = torch.arange(2 * 16).reshape(2, 16)
    got = LoopbackGroup(4).run(lambda g: cphf.shard_batch({"input_ids": ids}, group=g, layout="balanced"))
    zigzag = cpa.get_layout("zigzag")
    for r, local in enumerate(got):
        assert "cu_seq_lens_q" not in local
        assert torch.equal(local["input_ids"], zigzag.shard(ids, 1, r, 4))
        assert torch.equal(local["position_ids"][0], zigzag.positions(16, r, 4))


def test_the_trainers_batches_are_sharded_by_their_own_documents():
    """The CP Trainer's batch sharding (cp_layout="balanced") on two collated batches of the same length
    but other documents (DataCollatorWithFlattening's cu_seq_lens_q/k): each is balanced's shard for ITS
    documents (a placement cached per length would give both the first's)."""
    from types import SimpleNamespace

    from cp_attention.integrations.huggingface.trainer import _ContextParallelMixin

    lay = cpa.get_layout("balanced")
    batches = []
    for lengths in ([3, 1, 11, 7, 2], [14, 1, 1, 8]):
        cu = torch.tensor(cu_seqlens_from_lengths(lengths), dtype=torch.int32)
        ids = torch.arange(24)[None] + 100 * len(batches)
        batches.append({"input_ids": ids, "labels": ids, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
                        "max_length_q": max(lengths), "max_length_k": max(lengths)})
    cus = [tuple(b["cu_seq_lens_q"].tolist()) for b in batches]
    assert all(differs_from_zigzag(cu, 4) for cu in cus)
    assert any(not torch.equal(lay.positions(24, r, 4, cu_seqlens=cus[0]), lay.positions(24, r, 4, cu_seqlens=cus[1]))
               for r in range(4)), "the two batches must be placed differently"

    def shard(group):
        fake = SimpleNamespace(_cp_group=group, cp_layout=lay)
        return [_ContextParallelMixin._cp_shard(fake, b) for b in batches]

    for r, locals_ in enumerate(LoopbackGroup(4).run(shard)):
        for batch, local in zip(batches, locals_):
            cu = tuple(batch["cu_seq_lens_q"].tolist())
            assert local["cu_seq_lens_q"].tolist() == list(cu)  # 24 tokens split as they are at N = 4
            assert torch.equal(local["input_ids"], lay.shard(batch["input_ids"], 1, r, 4, cu_seqlens=cu))


@pytest.mark.parametrize("world,family,seq", [(2, "llama", 13), (4, "mistral_window", 17)])
def test_generate_prefills_the_packed_prompt_by_the_balanced_placement(world, family, seq):
    """cphf.generate(layout="balanced") with two left-padded prompts (two documents of the packed prompt):
    the tokens and every step's scores equal single-process generate's, and after the prefill each rank's
    cache holds exactly the prompt tokens balanced places on it for that stream."""
    ids, mask = generate_cases.prompts(2, seq, (0, 3))
    lengths = [int(n) for n in mask.sum(1)]
    lay = cpa.get_layout("balanced")
    cu, _ = pad_cu_seqlens(cu_seqlens_from_lengths(lengths), lay.divisor(world))
    assert differs_from_zigzag(cu, world), cu
    new = 4
    results = generate_cases.loopback_generate(world, family, "balanced", seq=seq, max_new_tokens=new)
    for rank, r in enumerate(results):
        assert r["sequences"] and r["scores"] <= generate_cases.ATOL, (rank, r)
        # the prompt's tokens this rank holds (stream indices of the two documents, not the padding one)
        held = lay.positions(cu[-1], rank, world, cu_seqlens=cu)
        prompt = int((held < cu[2]).sum())
        # the new tokens (all but the last, never fed back) go round the ranks in turn
        kept = len(range(rank, new - 1, world))
        assert r["cached"] == prompt + 2 * kept, (rank, r["cached"], prompt, kept)  # kept in both rows


def test_the_layout_matrix_batches_tell_balanced_from_zigzag():
    """The packed and padded batches of the adapter's layout matrix (test_equivalence.py at N = 2 and 4,
    test_windows.py) are placed otherwise by balanced than by zigzag, so those cases could not pass by
    sharding with zigzag's positions."""
    from cp_attention.integrations.huggingface.batch import _shard_batch
    from tests.support.hf.hf_cases import _documents_batch

    lay = cpa.get_layout("balanced")
    for mode in ("packed_positions", "collator", "padded_right", "padded_left"):
        full, _ = _documents_batch(mode)
        for world_size in (2, 4):
            cu = tuple(_shard_batch(full, lay, 0, world_size)["cu_seq_lens_q"].tolist())
            assert differs_from_zigzag(cu, world_size), (mode, world_size, cu)
