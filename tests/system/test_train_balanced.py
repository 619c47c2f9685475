"""Issue 35: the launcher with ``layout=balanced`` and packed data (``data.packing=true``): every step's packed
batch is sharded by the placement balanced makes from that batch's documents, and one SGD step (lr=1) moves
the weights as the same step at cp_size=1 does (the launcher's own loop on gloo ranks)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("transformers", reason="needs the hf extra")
import torch  # noqa: E402

from tests.system.test_train import TINY, _config, weights  # noqa: E402


def _balanced_runs(rank: int, world_size: int, cfg: dict, run_dir: str) -> list:
    """The launcher's loop with ``cfg`` on this pool's ranks; per shard_batch call: the layout, the stream's
    documents, whether they differ from zigzag's placement, and whether this rank's tokens are balanced's
    shard of the packed rows for those documents (recomputed here from the full batch)."""
    import cp_attention as cpa
    from cp_attention.integrations import huggingface as cphf
    from cp_attention.layouts.documents import cu_seqlens_from_position_ids
    from cp_attention.training import loop

    calls: list = []
    real = cphf.shard_batch
    balanced, zigzag = cpa.get_layout("balanced"), cpa.get_layout("zigzag")

    def shard_batch(batch, group=None, layout="zigzag"):
        local = real(batch, group=group, layout=layout)
        ids, pos = batch["input_ids"], batch["position_ids"]
        # the rows' documents, from their position ids alone, one after the other
        bounds = [0]
        for row in pos:
            bounds += [bounds[-1] + b for b in cu_seqlens_from_position_ids(row)[1:]]
        cu = tuple(bounds)
        n = world_size
        calls.append({
            "layout": cpa.get_layout(layout).name, "cu": cu == tuple(local["cu_seq_lens_q"].tolist()),
            "differs": any(not torch.equal(balanced.positions(cu[-1], r, n, cu_seqlens=cu),
                                           zigzag.positions(cu[-1], r, n, cu_seqlens=cu)) for r in range(n)),
            "sharded": torch.equal(local["input_ids"], balanced.shard(ids.reshape(1, -1), 1, rank, n, cu_seqlens=cu))})
        return local

    cphf.shard_batch = shard_batch
    try:
        os.makedirs(run_dir, exist_ok=True)
        loop.train(cfg, run_dir)
    finally:
        cphf.shard_batch = real
    return calls


def _paragraphs(path) -> str:
    """A text file of paragraphs of 1 to 45 bytes: every 64-token row packs several documents (the builtin
    help topics are longer than a row, and a row of one document is a plain batch, zigzag for balanced)."""
    words = "ring attention shards every packed document over the ranks of a context parallel group".split()
    paragraphs = [" ".join(words[i % 7: i % 7 + 1 + (i * 5) % 6])[: 1 + (i * 13) % 45] for i in range(200)]
    path.write_text("\n\n".join(paragraphs) + "\n")
    return str(path)


@pytest.mark.slow
def test_balanced_packed_step_equals_cp1(pools, tmp_path):
    from cp_attention.training.config import build_model, validate_config

    sgd = ["data=text_file", f"data.path={_paragraphs(tmp_path / 'paragraphs.txt')}", "data.packing=true",
           "optim=sgd", "optim.lr=1.0", "trainer.steps=1", "trainer.grad_clip=null"]
    cfg = _config(*TINY, *sgd, "layout=balanced", "cp_size=2")
    ref = _config(*TINY, *sgd, "cp_size=1")
    assert cfg["layout"]["name"] == "balanced"
    validate_config(cfg, 2)
    for calls in pools(2).run(_balanced_runs, cfg=cfg, run_dir=str(tmp_path / "balanced"), timeout=240):
        assert len(calls) == 1, calls  # one micro-batch
        assert calls[0] == {"layout": "balanced", "cu": True, "differs": True, "sharded": True}, calls
    pools(1).run(_balanced_runs, cfg=ref, run_dir=str(tmp_path / "cp1"), timeout=240)
    got, want = weights(tmp_path / "balanced"), weights(tmp_path / "cp1")
    torch.manual_seed(ref["trainer"]["seed"])
    start = build_model(ref["model"]).state_dict()
    assert max((want[k] - start[k]).abs().max().item() for k in want) > 1e-3  # the step did something
    for k in want:  # fp32: the ring's sums in another order
        torch.testing.assert_close(got[k], want[k], atol=2e-6, rtol=0, msg=k)
