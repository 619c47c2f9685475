"""transformers.Trainer and TRL's SFTTrainer cases run inside the gloo workers: the CP Trainer of
``cphf.context_parallel_trainer`` on dp x cp ranks, and the plain Trainer in ONE process (a pool of
one) on the same global batch, as the reference. Models are fp64; transformers' loss upcasts to fp32."""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Iterator

import torch
import torch.distributed as dist

from examples.finetune_trainer import id_tokenizer

from .hf_cases import SEQ, VOCAB, WINDOW_SEQ, build

ROWS = 16  # examples in the training set


@contextlib.contextmanager
def torchrun_env(rank: int, world_size: int) -> Iterator[None]:
    """The variables torchrun sets, so accelerate sees the worker's (already initialised) process group."""
    values = dict(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
                  MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Rows(torch.utils.data.Dataset):
    """Examples as dicts of lists (what collators take)."""

    def __init__(self, examples: list) -> None:
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict:
        return self.examples[i]


@contextlib.contextmanager
def lm_loss_calls() -> Iterator[list]:
    """Within the block, the CP Trainer's calls of ``lm_loss`` (the chunked loss) are listed: each
    call's ``chunk_tokens`` and whether the model was training."""
    from cp_attention.integrations.huggingface import trainer as cp_trainer

    calls, real = [], cp_trainer.lm_loss

    def counting(model, local, group=None, chunk_tokens=1024, num_items_in_batch=None):
        calls.append((chunk_tokens, model.training))
        return real(model, local, group=group, chunk_tokens=chunk_tokens, num_items_in_batch=num_items_in_batch)

    cp_trainer.lm_loss = counting
    try:
        yield calls
    finally:
        cp_trainer.lm_loss = real


def examples(seq: int, varied: bool, seed: int = 5) -> list:
    """``ROWS`` examples; prompts of several lengths carry no label (-100), so batches hold different
    numbers of label tokens. ``varied``: lengths differ too (for packing collators)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(ROWS):
        n = seq - (3 * i) % (seq // 2) if varied else seq
        ids = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        labels = [-100] * (i % 5) + ids[i % 5:]
        out.append({"input_ids": ids, "labels": labels})
    return out


def has_argument(name: str) -> bool:
    """Whether the installed transformers' ``TrainingArguments`` takes ``name``."""
    import dataclasses

    import transformers as tf

    return any(f.name == name for f in dataclasses.fields(tf.TrainingArguments))


def sequential_sampling() -> dict:
    """The TrainingArguments for sequential training batches: ``train_sampling_strategy`` from transformers 5.2;
    before it, none: the Trainer's random sampler, which accelerate seeds alike in one process and on every
    rank (the same permutation: each global batch holds the same examples either way)."""
    return {"train_sampling_strategy": "sequential"} if has_argument("train_sampling_strategy") else {}


def _trainer(kind: str, model, dataset, out: str, *, batch: int, accum: int, steps: int, cp: int, layout: str,
             eval_dataset=None, save_steps: int = 0, average_tokens: bool = True, cp_comm_type: str = "p2p",
             savers: dict | None = None, packing: bool = True):
    """The Trainer of ``kind`` (``trainer``: default collator; ``flatten``: DataCollatorWithFlattening;
    ``sft``: SFTTrainer, with ``packing`` or padded rows), CP when ``cp`` > 1 (with the CP Trainer's memory arguments
    ``savers``); sequential sampling, constant-lr SGD."""
    import transformers as tf

    from cp_attention.integrations import huggingface as cphf

    common = dict(output_dir=out, per_device_train_batch_size=batch, per_device_eval_batch_size=batch,
                  gradient_accumulation_steps=accum, max_steps=steps, learning_rate=0.5, lr_scheduler_type="constant",
                  optim="sgd", weight_decay=0.0, max_grad_norm=0.5, logging_steps=1, report_to=[], use_cpu=True,
                  seed=0, save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
                  dataloader_num_workers=0, disable_tqdm=True, average_tokens_across_devices=average_tokens,
                  **sequential_sampling())
    extra = {"cp_size": cp, "cp_layout": layout, "cp_comm_type": cp_comm_type, **(savers or {})} if cp > 1 else {}
    if kind == "sft":
        import datasets
        import trl

        base = trl.SFTTrainer
        args = trl.SFTConfig(**common, bf16=False, packing=packing, max_length=SEQ)
        ds = datasets.Dataset.from_list([{"input_ids": e["input_ids"]} for e in dataset.examples])  # SFT labels: all
        tokenizer = id_tokenizer(VOCAB, pad_id=VOCAB - 2, eos_id=VOCAB - 1)
        kwargs = dict(args=args, train_dataset=ds, processing_class=tokenizer,
                      eval_dataset=None if eval_dataset is None else datasets.Dataset.from_list(eval_dataset.examples))
    else:
        base = tf.Trainer
        collator = tf.DataCollatorWithFlattening() if kind == "flatten" else tf.default_data_collator
        kwargs = dict(args=tf.TrainingArguments(**common, remove_unused_columns=False), train_dataset=dataset,
                      data_collator=collator, eval_dataset=eval_dataset)
    cls = cphf.context_parallel_trainer(base) if cp > 1 else base
    return cls(model=model, **kwargs, **extra)


def train(rank: int, world_size: int, *, kind: str, family: str, layout: str, cp: int, batch: int, accum: int = 1,
          steps: int = 3, average_tokens: bool = True, cp_comm_type: str = "p2p", savers: dict | None = None) -> dict:
    """Train ``steps`` steps; rank 0 returns the weights and the logged losses, every rank its calls of
    the chunked loss. ``batch`` is per device: with cp > 1 each dp rank's; the global batch is ``batch *
    world_size / cp``. ``average_tokens``: the Trainer's ``average_tokens_across_devices``;
    ``cp_comm_type`` and ``savers`` (cp_loss_chunk_tokens, cp_activation_checkpointing, cp_mlp_chunks): the
    CP Trainer's."""
    seq = WINDOW_SEQ if family.endswith("_window") else SEQ
    model = build(family)
    # No KV cache: with one, transformers does not separate packed documents (nor, ever, GPT-OSS's
    # own attention: no packed case runs it as the reference)
    model.config.use_cache = False
    data = Rows(examples(seq, varied=kind != "trainer"))
    with torchrun_env(rank, world_size), tempfile.TemporaryDirectory() as out, lm_loss_calls() as calls:
        trainer = _trainer(kind, model, data, out, batch=batch, accum=accum, steps=steps, cp=cp, layout=layout,
                           average_tokens=average_tokens, cp_comm_type=cp_comm_type, savers=savers)
        trainer.train()
        losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"weights": weights if rank == 0 else None, "losses": losses, "lm_loss_calls": calls,
            "impl": model.config._attn_implementation}


def evaluate(rank: int, world_size: int, *, family: str, layout: str, cp: int, rows: int, batch: int) -> dict:
    """``evaluate()`` and ``predict()`` on ``rows`` held-out examples, ``batch`` per device (under CP per dp
    rank: the global eval batch is ``batch * dp``); rank 0's predictions, every rank's losses. Rows whose
    count no global batch divides leave a short last batch (and, at dp > 1, dp ranks without one), which
    accelerate fills with repeated examples."""
    model = build(family)
    model.config.use_cache = False
    data = Rows(examples(SEQ, varied=False))
    held_out = Rows(examples(SEQ, varied=False, seed=9)[:rows])
    with torchrun_env(rank, world_size), tempfile.TemporaryDirectory() as out:
        trainer = _trainer("trainer", model, data, out, batch=batch, accum=1, steps=1, cp=cp, layout=layout,
                           eval_dataset=held_out)
        with lm_loss_calls() as evaluating:
            loss = trainer.evaluate()["eval_loss"]
        with lm_loss_calls() as predicting:
            predicted = trainer.predict(held_out)
    return {"loss": loss, "test_loss": predicted.metrics["test_loss"], "lm_loss_calls": (evaluating, predicting),
            "logits": torch.as_tensor(predicted.predictions) if rank == 0 else None,
            "labels": torch.as_tensor(predicted.label_ids) if rank == 0 else None}


def evaluate_refused(rank: int, world_size: int, *, cp: int) -> str:
    """``evaluate()`` on 2 examples, one per dp rank: the second's attention_mask has a hole, which
    shard_batch refuses on its dp group only. What every rank raised (the others must stop, not wait)."""
    model = build("llama")
    model.config.use_cache = False
    held_out = [dict(e, attention_mask=[1] * SEQ) for e in examples(SEQ, varied=False, seed=9)[:2]]
    held_out[1]["attention_mask"][SEQ // 2] = 0
    with torchrun_env(rank, world_size), tempfile.TemporaryDirectory() as out:
        trainer = _trainer("trainer", model, Rows(examples(SEQ, varied=False)), out, batch=1, accum=1, steps=1,
                           cp=cp, layout="zigzag", eval_dataset=Rows(held_out))
        try:
            trainer.evaluate()
        except (ValueError, RuntimeError) as e:
            return f"{type(e).__name__}: {e}"
    return "nothing raised"


def sft_metrics(rank: int, world_size: int, *, cp: int, batch: int, eval_rows: int, steps: int = 2,
                packing: bool = True) -> dict:
    """TRL's SFTTrainer with ``packing`` (else padded rows): ``steps`` training steps, then ``evaluate()`` on
    ``eval_rows`` held-out examples (packed too); every rank's logged training metrics and evaluation metrics."""
    model = build("qwen2")
    model.config.use_cache = False
    data = Rows(examples(SEQ, varied=True))
    held_out = Rows([{"input_ids": e["input_ids"]} for e in examples(SEQ, varied=True, seed=9)[:eval_rows]])
    with torchrun_env(rank, world_size), tempfile.TemporaryDirectory() as out:
        trainer = _trainer("sft", model, data, out, batch=batch, accum=1, steps=steps, cp=cp, layout="zigzag",
                           eval_dataset=held_out, packing=packing)
        trainer.train()
        trainer.evaluate()
    # What TRL logs: some versions (1.0) log their metrics without adding them to evaluate()'s result
    logged = [log for log in trainer.state.log_history if "loss" in log]
    metrics = next(log for log in reversed(trainer.state.log_history) if "eval_loss" in log)
    return {"train": logged, "eval": metrics}


def resume(rank: int, world_size: int, *, layout: str, cp: int) -> dict:
    """Train 4 steps straight, and 2 + 2 from the step-2 checkpoint (``resume_from_checkpoint``); save the
    model and load it without CP. Rank 0's weights of each, and what the loaded model runs."""
    import transformers as tf

    def run(out: str, steps: int, save: int, checkpoint=None):
        model = build("llama")
        model.config.use_cache = False
        trainer = _trainer("trainer", model, Rows(examples(SEQ, varied=False)), out, batch=2, accum=1, steps=steps,
                           cp=cp, layout=layout, save_steps=save)
        trainer.train(resume_from_checkpoint=checkpoint)
        return trainer, {k: v.detach().clone() for k, v in model.state_dict().items()}

    shared = [tempfile.mkdtemp() if rank == 0 else None]  # the Trainer's output_dir: one for all ranks
    dist.broadcast_object_list(shared)
    a, b = f"{shared[0]}/a", f"{shared[0]}/b"
    with torchrun_env(rank, world_size):
        _, straight = run(a, 4, 0)
        run(b, 2, 2)
        trainer, resumed = run(b, 4, 0, checkpoint=f"{b}/checkpoint-2")
        trainer.save_model(f"{b}/final")  # rank 0 writes it
        dist.barrier()
        loaded = tf.AutoModelForCausalLM.from_pretrained(f"{b}/final", dtype=torch.float64)
        same = all(torch.equal(loaded.state_dict()[k], v) for k, v in resumed.items())
    return {"straight": straight if rank == 0 else None, "resumed": resumed if rank == 0 else None,
            "saved_equal": same, "loaded_impl": loaded.config._attn_implementation}
