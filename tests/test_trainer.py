"""``cphf.context_parallel_trainer``: transformers' Trainer and TRL's SFTTrainer with context parallelism
on dp x cp gloo ranks equal the plain Trainer in one process on the same global batch."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")

from . import trainer_cases  # noqa: E402

FP32 = 1e-6  # relative: transformers' loss runs in fp32 (the models are fp64)

# (kind, family, layout, dp, cp, per-device batch of the CP run, gradient accumulation, cp_comm_type)
CASES = [
    ("trainer", "llama", "zigzag", 1, 2, 2, 2, "p2p"),
    ("trainer", "mistral_window", "interleaved", 2, 2, 1, 1, "all_gather"),
    ("trainer", "gpt_oss", "contiguous", 1, 2, 2, 1, "p2p"),  # sinks (GPT-OSS's own attention cannot pack: no reference)
    ("flatten", "llama", "contiguous", 2, 2, 1, 2, "a2a"),  # DataCollatorWithFlattening: packed documents
    ("sft", "qwen2", "zigzag", 1, 2, 2, 1, "auto"),  # SFTTrainer, packing (bfd, padding-free)
]


def _id(case) -> str:
    kind, family, layout, dp, cp, batch, accum, comm = case
    return f"{kind}-{family}-{layout}-{dp}x{cp}-b{batch}-ga{accum}-{comm}"


def _relative(a, b) -> float:
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)).item() for k in b)


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_weights_equal_one_process_on_the_global_batch(pools, case):
    kind, family, layout, dp, cp, batch, accum, comm = case
    pytest.importorskip("accelerate", reason="needs the trainer extra: pip install -e '.[trainer]'")
    if kind == "sft":
        pytest.importorskip("trl", reason="needs the trainer extra: pip install -e '.[trainer]'")
    common = dict(kind=kind, family=family, layout=layout, accum=accum, timeout=300)
    ref = pools(1).run(trainer_cases.train, cp=1, batch=batch * dp, **common)[0]
    got = pools(dp * cp).run(trainer_cases.train, cp=cp, batch=batch, cp_comm_type=comm, **common)
    assert all(r["impl"] == "cp_ring" for r in got), [r["impl"] for r in got]
    start = trainer_cases.build(family).state_dict()
    assert _relative(ref["weights"], start) > 1e-3, "training did not move the weights"
    assert _relative(got[0]["weights"], ref["weights"]) <= FP32, _id(case)
    for r in got:
        assert len(r["losses"]) == len(ref["losses"]) == 3
        assert max(abs(a - b) / b for a, b in zip(r["losses"], ref["losses"])) <= FP32, (r["losses"], ref["losses"])


def test_without_averaging_tokens_across_devices(pools):
    """average_tokens_across_devices=False: each dp rank's token mean (one dp rank here, so one process's)."""
    pytest.importorskip("accelerate", reason="needs the trainer extra: pip install -e '.[trainer]'")
    common = dict(kind="trainer", family="llama", layout="zigzag", accum=2, average_tokens=False, timeout=300)
    ref = pools(1).run(trainer_cases.train, cp=1, batch=2, **common)[0]
    got = pools(2).run(trainer_cases.train, cp=2, batch=2, **common)
    assert _relative(got[0]["weights"], ref["weights"]) <= FP32
    assert max(abs(a - b) / b for a, b in zip(got[1]["losses"], ref["losses"])) <= FP32


@pytest.mark.parametrize("dp,cp", [(1, 2), (2, 2)])
def test_evaluate_and_predict_equal_one_process(pools, dp, cp):
    pytest.importorskip("accelerate", reason="needs the trainer extra: pip install -e '.[trainer]'")
    ref = pools(1).run(trainer_cases.evaluate, family="llama", layout="zigzag", cp=1, timeout=300)[0]
    got = pools(dp * cp).run(trainer_cases.evaluate, family="llama", layout="zigzag", cp=cp, timeout=300)
    for r in got:  # every rank reports the same, one-process loss
        assert abs(r["loss"] - ref["loss"]) <= FP32 * ref["loss"], (r["loss"], ref["loss"])
    # the logits gathered to the full sequence, one copy per example, in order
    assert got[0]["logits"].shape == ref["logits"].shape == (13, trainer_cases.SEQ, trainer_cases.VOCAB)
    assert (got[0]["logits"] - ref["logits"]).abs().max() <= 1e-9 * ref["logits"].abs().max()
    assert got[0]["labels"].equal(ref["labels"])


def test_checkpoints_resume_and_save_model(pools):
    pytest.importorskip("accelerate", reason="needs the trainer extra: pip install -e '.[trainer]'")
    got = pools(2).run(trainer_cases.resume, layout="interleaved", cp=2, timeout=300)
    assert _relative(got[0]["resumed"], got[0]["straight"]) <= FP32
    for r in got:  # the saved model loads without CP, with the trained weights
        assert r["saved_equal"] and r["loaded_impl"] != "cp_ring", r


def test_shard_keeps_the_packed_streams_own_max_length():
    """A collator's max_length_q/k (its documents') yield to shard_batch's: the padding document that
    rounds the stream up to the layout's divisor can be the longest, and the model checks the values."""
    from types import SimpleNamespace

    import torch

    import cp_attention as cpa
    from cp_attention.integrations._hf_trainer import _ContextParallelMixin
    from cp_attention.transport import LoopbackGroup

    cu = torch.tensor([0, 1, 2], dtype=torch.int32)  # two 1-token documents; zigzag over 2 ranks pads by 2
    batch = {"input_ids": torch.arange(2)[None], "labels": torch.arange(2)[None], "cu_seq_lens_q": cu,
             "cu_seq_lens_k": cu, "max_length_q": 1, "max_length_k": 1}

    def shard(group):
        fake = SimpleNamespace(_cp_group=group, cp_layout=cpa.get_layout("zigzag"))
        return _ContextParallelMixin._cp_shard(fake, batch)

    for local in LoopbackGroup(2).run(shard):
        assert local["cu_seq_lens_q"].tolist() == [0, 1, 2, 4]
        assert local["max_length_q"] == local["max_length_k"] == 2
        assert local["labels"] is local["shift_labels"]


def test_strategies_the_cp_group_cannot_run_are_refused_at_once():
    """Before the Trainer is built (no process group needed): a2a+p2p needs a two-level CP group, which
    the Trainer's (dp, cp) mesh does not have; an unknown name is refused by name."""
    import transformers as tf

    from cp_attention.integrations import huggingface as cphf

    from .hf_cases import build

    CPTrainer = cphf.context_parallel_trainer(tf.Trainer)
    with pytest.raises(NotImplementedError, match=r"cp_comm_type='a2a\+p2p' needs two: use 'a2a', 'all_gather' or"):
        CPTrainer(model=build("llama"), cp_size=2, cp_comm_type="a2a+p2p")
    with pytest.raises(ValueError, match="unknown cp_comm_type 'ulysses'"):
        CPTrainer(model=build("llama"), cp_size=2, cp_comm_type="ulysses")
