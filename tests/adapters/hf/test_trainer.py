"""``cphf.context_parallel_trainer``: transformers' Trainer and TRL's SFTTrainer with context parallelism
on dp x cp gloo ranks equal the plain Trainer in one process on the same global batch."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")

from tests.support.hf import trainer_cases  # noqa: E402

FP32 = 1e-6  # relative: transformers' loss runs in fp32 (the models are fp64)

# (kind, family, layout, dp, cp, per-device batch of the CP run, gradient accumulation, cp_comm_type, the CP
# Trainer's memory arguments): the loss in chunks smaller and larger than a rank's tokens (1024: the
# default) and on full logits (None), checkpointing on, offloaded, off, the MLP in chunks
CASES = [
    ("trainer", "llama", "zigzag", 1, 2, 2, 2, "p2p",
     dict(cp_loss_chunk_tokens=3, cp_activation_checkpointing="offload", cp_mlp_chunks=2)),
    ("trainer", "mistral_window", "interleaved", 2, 2, 1, 1, "all_gather", dict(cp_loss_chunk_tokens=None)),
    ("trainer", "gpt_oss", "contiguous", 1, 2, 2, 1, "p2p",  # sinks (GPT-OSS's own attention cannot pack: no reference)
     dict(cp_activation_checkpointing=True)),
    ("flatten", "llama", "contiguous", 2, 2, 1, 2, "a2a",  # DataCollatorWithFlattening: packed documents
     dict(cp_loss_chunk_tokens=5, cp_activation_checkpointing=True, cp_mlp_chunks=3)),
    # SFTTrainer, packing (bfd, padding-free); its own loss; the documents placed per batch (balanced)
    ("sft", "qwen2", "balanced", 1, 2, 2, 1, "auto", {}),
]


def _id(case) -> str:
    kind, family, layout, dp, cp, batch, accum, comm, savers = case
    short = {"cp_loss_chunk_tokens": "chunk", "cp_activation_checkpointing": "ac", "cp_mlp_chunks": "mlp"}
    return "-".join([f"{kind}-{family}-{layout}-{dp}x{cp}-b{batch}-ga{accum}-{comm}",
                     *(f"{short[k]}{v}" for k, v in savers.items())])


def _relative(a, b) -> float:
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)).item() for k in b)


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_weights_equal_one_process_on_the_global_batch(pools, case):
    """Training (the loss in chunks by default, with the memory savers asked for) equals the plain Trainer
    in one process: the logged losses and the final weights; the chunked loss ran on every micro-step
    where the Trainer's own loss would, with the chunks asked for, and nowhere else."""
    kind, family, layout, dp, cp, batch, accum, comm, savers = case
    pytest.importorskip("accelerate", reason="needs the trainer extra: pip install -e '.[trainer]'")
    if kind == "sft":
        pytest.importorskip("trl", reason="needs the trainer extra: pip install -e '.[trainer]'")
    common = dict(kind=kind, family=family, layout=layout, accum=accum, timeout=300)
    ref = pools(1).run(trainer_cases.train, cp=1, batch=batch * dp, **common)[0]
    got = pools(dp * cp).run(trainer_cases.train, cp=cp, batch=batch, cp_comm_type=comm, savers=savers, **common)
    assert all(r["impl"] == "cp_ring" for r in got), [r["impl"] for r in got]
    start = trainer_cases.build(family).state_dict()
    assert _relative(ref["weights"], start) > 1e-3, "training did not move the weights"
    assert _relative(got[0]["weights"], ref["weights"]) <= FP32, _id(case)
    chunk = savers.get("cp_loss_chunk_tokens", 1024)
    expected = [] if kind == "sft" or chunk is None else [(chunk, True)] * (3 * accum)
    for r in got:
        assert len(r["losses"]) == len(ref["losses"]) == 3
        assert max(abs(a - b) / b for a, b in zip(r["losses"], ref["losses"])) <= FP32, (r["losses"], ref["losses"])
        assert r["lm_loss_calls"] == expected, (r["lm_loss_calls"], expected)


def test_without_averaging_tokens_across_devices(pools):
    """average_tokens_across_devices=False: each dp rank's token mean (one dp rank here, so one process's)."""
    pytest.importorskip("accelerate", reason="needs the trainer extra: pip install -e '.[trainer]'")
    common = dict(kind="trainer", family="llama", layout="zigzag", accum=2, average_tokens=False, timeout=300)
    ref = pools(1).run(trainer_cases.train, cp=1, batch=2, **common)[0]
    got = pools(2).run(trainer_cases.train, cp=2, batch=2, **common)
    assert _relative(got[0]["weights"], ref["weights"]) <= FP32
    assert max(abs(a - b) / b for a, b in zip(got[1]["losses"], ref["losses"])) <= FP32


# (dp, cp, eval rows, eval batch per dp rank): 7 rows in batches of 2 leave a short last batch (accelerate
# fills it with example 0); at 2x2, 5 rows leave one dp rank a short batch and the other none
EVAL_CASES = [(1, 2, 7, 2), (2, 2, 5, 2)]


@pytest.mark.parametrize("dp,cp,rows,batch", EVAL_CASES, ids=[f"{d}x{c}-rows{r}-b{b}" for d, c, r, b in EVAL_CASES])
def test_evaluate_and_predict_equal_one_process(pools, dp, cp, rows, batch):
    """evaluate()'s and predict()'s losses, logits and labels equal one process's on the same global batch:
    no repeated example counted, none gathered."""
    pytest.importorskip("accelerate", reason="needs the trainer extra: pip install -e '.[trainer]'")
    common = dict(family="llama", layout="zigzag", rows=rows, timeout=300)
    ref = pools(1).run(trainer_cases.evaluate, cp=1, batch=batch * dp, **common)[0]
    got = pools(dp * cp).run(trainer_cases.evaluate, cp=cp, batch=batch, **common)
    for r in got:  # every rank reports the same, one-process losses
        for key in ("loss", "test_loss"):
            assert abs(r[key] - ref[key]) <= FP32 * ref[key], (key, r[key], ref[key])
        # evaluate() without metrics asks for the loss only: in chunks; predict() for the logits: none
        evaluating, predicting = r["lm_loss_calls"]
        assert evaluating == [(1024, False)] * -(-rows // (batch * dp)) and predicting == [], r["lm_loss_calls"]
    # the logits gathered to the full sequence, one copy per example, in order
    assert got[0]["logits"].shape == ref["logits"].shape == (rows, trainer_cases.SEQ, trainer_cases.VOCAB)
    assert (got[0]["logits"] - ref["logits"]).abs().max() <= 1e-9 * ref["logits"].abs().max()
    assert got[0]["labels"].equal(ref["labels"])


def test_an_eval_batch_refused_on_one_dp_group_stops_every_rank(pools):
    pytest.importorskip("accelerate", reason="needs the trainer extra: pip install -e '.[trainer]'")
    got = pools(4).run(trainer_cases.evaluate_refused, cp=2, timeout=60)
    assert all(r.startswith("RuntimeError: another dp group's batch was refused") for r in got[:2]), got
    assert all(r.startswith("ValueError: attention_mask row 0 has padding between real tokens") for r in got[2:]), got


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_sft_metrics_equal_one_process(pools, packing):
    """TRL's SFTTrainer (packing, padding-free; or padded rows, whose first labels count in the Trainer's
    num_items_in_batch before transformers 5.10, which TRL's evaluation divides by before TRL 1.15): the
    logged training metrics (num_tokens counting real tokens, not the layout's padding) and evaluate()'s
    loss, entropy, token accuracy and num_tokens equal one process's. 5 eval rows in batches of 2 per dp
    rank: a short batch and a filler."""
    pytest.importorskip("accelerate", reason="needs the trainer extra: pip install -e '.[trainer]'")
    pytest.importorskip("trl", reason="needs the trainer extra: pip install -e '.[trainer]'")
    dp = 2
    common = dict(eval_rows=5, packing=packing, timeout=300)
    ref = pools(1).run(trainer_cases.sft_metrics, cp=1, batch=2 * dp, **common)[0]
    got = pools(2 * dp).run(trainer_cases.sft_metrics, cp=2, batch=2, **common)
    keys = ("loss", "entropy", "mean_token_accuracy", "num_tokens")
    assert ref["train"][-1]["num_tokens"] > 0
    if packing:  # the padded rows' few eval tokens: the untrained model's accuracy can be 0 (TRL 1.16's is)
        assert ref["eval"]["eval_mean_token_accuracy"] > 0
    for r in got:
        assert len(r["train"]) == len(ref["train"]) == 2
        for mine, theirs in zip(r["train"], ref["train"]):
            assert mine["num_tokens"] == theirs["num_tokens"], (mine, theirs)
            for key in keys:
                assert abs(mine[key] - theirs[key]) <= FP32 * abs(theirs[key]), (key, mine, theirs)
        for key in keys:
            name = f"eval_{key}"
            assert name in r["eval"], (name, r["eval"])
            assert abs(r["eval"][name] - ref["eval"][name]) <= FP32 * abs(ref["eval"][name]), (name, r["eval"],
                                                                                                ref["eval"])


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
    from cp_attention.integrations.huggingface.trainer import _ContextParallelMixin
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
    from tests.support.hf.hf_cases import build

    CPTrainer = cphf.context_parallel_trainer(tf.Trainer)
    with pytest.raises(NotImplementedError, match=r"cp_comm_type='a2a\+p2p' needs two: use 'a2a', 'all_gather' or"):
        CPTrainer(model=build("llama"), cp_size=2, cp_comm_type="a2a+p2p")
    with pytest.raises(ValueError, match="unknown cp_comm_type 'ulysses'"):
        CPTrainer(model=build("llama"), cp_size=2, cp_comm_type="ulysses")


def _eval_shard(rows: int, batch: int, dp: int, rank: int, drop_last: bool = False):
    """accelerate's shard of a sequential eval loader for dp rank ``rank`` (what the CP Trainer's
    get_eval_dataloader re-points to the dp ranks), and the same shard filled by fill_eval_loader."""
    from types import SimpleNamespace

    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler, SequentialSampler

    def shard():
        inner = BatchSampler(SequentialSampler(range(rows)), batch, drop_last)
        return BatchSamplerShard(inner, num_processes=dp, process_index=rank, even_batches=True)

    from cp_attention.integrations.huggingface.trainer_eval import fill_eval_loader

    return shard(), fill_eval_loader(SimpleNamespace(batch_sampler=shard()), dp).batch_sampler


def test_eval_loader_yields_real_batches_then_fillers():
    """Where accelerate fills the last step with repeated examples, the CP eval loader yields the short
    real batch, or a one-example filler its sizes mark as holding no real example."""
    pytest.importorskip("accelerate", reason="needs the trainer extra: pip install -e '.[trainer]'")
    theirs, ours = _eval_shard(5, 2, dp=2, rank=1)
    assert list(theirs) == [[2, 3], [1, 2]]  # accelerate: rank 0 gets [4, 0], rank 1 examples 1 and 2 again
    assert list(ours) == [[2, 3], [0]] and ours.batch_sampler.sizes == [2, 2, 1, 0]
    _, ours = _eval_shard(5, 2, dp=2, rank=0)
    assert list(ours) == [[0, 1], [4]] and len(ours) == 2
    _, ours = _eval_shard(7, 2, dp=1, rank=0)
    assert list(ours) == [[0, 1], [2, 3], [4, 5], [6]]  # accelerate at dp=1: [6, 0]
    _, ours = _eval_shard(5, 2, dp=2, rank=1, drop_last=True)  # the incomplete step dropped, as one process does
    assert list(ours) == [[2, 3]]


def test_eval_loaders_that_repeat_examples_are_refused():
    """Repeated examples that cannot be told apart (an iterable dataset's shard, split batches), and
    predictions of a collator that packs examples into one row at dp > 1, are refused by name."""
    pytest.importorskip("accelerate", reason="needs the trainer extra: pip install -e '.[trainer]'")
    from types import SimpleNamespace

    import transformers as tf
    from torch.utils.data import DataLoader

    from cp_attention.integrations.huggingface.trainer_eval import EvalSteps, refuse_rows_not_examples

    iterable = SimpleNamespace(dataset=[])  # no batch sampler: accelerate's IterableDatasetShard pads
    with pytest.raises(NotImplementedError, match="set dataloader_drop_last=True"):
        EvalSteps.of(iterable, dp=2, drop_last=False)
    assert EvalSteps.of(iterable, dp=2, drop_last=True).advance() is None  # full batches only: every row real
    data = trainer_cases.Rows(trainer_cases.examples(trainer_cases.SEQ, varied=True))
    refuse_rows_not_examples(DataLoader(data, collate_fn=tf.default_data_collator))  # one row per example
    with pytest.raises(NotImplementedError, match="packs several examples into one row"):
        refuse_rows_not_examples(DataLoader(data, collate_fn=tf.DataCollatorWithFlattening()))


def test_models_without_loss_kwargs_are_refused(tmp_path):
    """A forward without loss kwargs would return each rank's own token mean: refused when built."""
    import transformers as tf

    from cp_attention.integrations import huggingface as cphf
    from tests.support.hf.hf_cases import build

    model = build("llama")
    model.accepts_loss_kwargs = False
    args = tf.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(NotImplementedError, match="model_accepts_loss_kwargs"):
        cphf.context_parallel_trainer(tf.Trainer)(model=model, args=args, cp_size=2)



# The Trainer's own checkpointing: TrainingArguments(activation_checkpointing) from transformers 5.23 (the older
# gradient_checkpointing an alias of it since), gradient_checkpointing before
OWN = "activation_checkpointing" if trainer_cases.has_argument("activation_checkpointing") else "gradient_checkpointing"
NEWER_NAME = pytest.mark.skipif(OWN != "activation_checkpointing", reason="TrainingArguments(activation_checkpointing) "
                                "needs transformers >= 5.23; gradient_checkpointing, the older name, is tested instead")


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize("kwargs,args,words", [
    pytest.param(dict(cp_activation_checkpointing=True), dict(activation_checkpointing=True),
                 "cp_activation_checkpointing=True and the Trainer's own activation_checkpointing=True",
                 marks=NEWER_NAME),
    pytest.param(dict(cp_activation_checkpointing="offload"), dict(activation_checkpointing=True),
                 "cp_activation_checkpointing='offload' and the Trainer's own", marks=NEWER_NAME),
    (dict(cp_activation_checkpointing=True), dict(gradient_checkpointing=True),
     f"cp_activation_checkpointing=True and the Trainer's own {OWN}=True .*TrainingArguments\\({OWN}=False\\)"),
    (dict(cp_activation_checkpointing="on"), {}, "cp_activation_checkpointing='on': expected True"),
    (dict(cp_mlp_chunks=0), {}, "cp_mlp_chunks=0: expected None"),
    (dict(cp_loss_chunk_tokens=0), {}, "cp_loss_chunk_tokens=0: expected an int >= 1"),
    (dict(cp_loss_chunk_tokens=True), {}, "cp_loss_chunk_tokens=True: expected an int >= 1"),
])
def test_memory_arguments_that_cannot_be_honoured_are_refused(tmp_path, kwargs, args, words):
    """When the Trainer is built, before any process group: bad values, and our checkpointing together
    with the Trainer's own (which, switched on at train(), would replace ours), refused by name."""
    import transformers as tf

    from cp_attention.integrations import huggingface as cphf
    from tests.support.hf.hf_cases import build

    arguments = tf.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **args)
    with pytest.raises(ValueError, match=words):
        cphf.context_parallel_trainer(tf.Trainer)(model=build("llama"), args=arguments, cp_size=2, **kwargs)


def test_a_head_the_chunked_loss_cannot_apply_is_refused_when_built(tmp_path):
    """A causal LM whose forward lm_loss has not read: refused when the Trainer is built (not at the first
    step), naming the way out; with cp_loss_chunk_tokens=None, or a base computing its own loss, no refusal
    comes from it (the world-size check speaks next: no process group here)."""
    import transformers as tf

    from cp_attention.integrations import huggingface as cphf
    from tests.support.hf.hf_cases import build

    class Custom(tf.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    model = build("llama")
    model.__class__ = Custom
    args = tf.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    CPTrainer = cphf.context_parallel_trainer(tf.Trainer)
    with pytest.raises(NotImplementedError, match="cp_loss_chunk_tokens=1024: lm_loss cannot apply the LM head of "
                                                  "Custom .*; or pass cp_loss_chunk_tokens=None"):
        CPTrainer(model=model, args=args, cp_size=2)
    with pytest.raises(ValueError, match="cp_size=2 must divide the world size 1"):
        CPTrainer(model=model, args=args, cp_size=2, cp_loss_chunk_tokens=None)

    class OwnLoss(tf.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    with pytest.raises(ValueError, match="cp_size=2 must divide the world size 1"):
        cphf.context_parallel_trainer(OwnLoss)(model=model, args=args, cp_size=2)
