"""Issue 44: the CP Trainer on every transformers, accelerate and TRL version it claims.

The Trainer's ``num_items_in_batch`` (what its loss divides by) counts position 0 of every row before
transformers 5.10 and not from it: the CP Trainer counts as the installed Trainer does, or its loss would
differ from one process's (tests/adapters/hf/test_trainer.py's equivalence tests, run on the floor, 5.4,
5.17 and the newest). Versions older than ``cp_attention.versions.FLOORS`` are refused first, by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
pytest.importorskip("accelerate", reason="needs the trainer extra: pip install -e '.[trainer]'")

import torch  # noqa: E402

from cp_attention import versions  # noqa: E402
from tests.support.hf import trainer_cases  # noqa: E402

OLD = "0.1.0"  # below every floor


def _batches() -> dict:
    """Batches whose counts tell the rules apart: rows whose first label is real (counted before 5.10 only),
    packed documents (DataCollatorWithFlattening), and a collator's own ``shift_labels``."""
    import transformers as tf

    rows = tf.default_data_collator(trainer_cases.examples(trainer_cases.SEQ, varied=False)[:6])
    packed = tf.DataCollatorWithFlattening()(trainer_cases.examples(trainer_cases.SEQ, varied=True)[:3])
    shifted = dict(rows, shift_labels=torch.full_like(rows["labels"], -100))
    shifted["shift_labels"][:, :5] = 1  # 5 targets a row: neither rule on labels gives that
    return {"rows": rows, "packed": packed, "shift_labels": shifted}


@pytest.mark.parametrize("name", ["rows", "packed", "shift_labels"])
def test_the_label_count_is_the_installed_trainers(tmp_path, name):
    """``trainer_label_count`` equals the installed Trainer's own ``num_items_in_batch`` (one process: no
    gather) on each batch; the rows' two counts differ, so a wrong rule cannot pass."""
    import transformers as tf

    from cp_attention.integrations.huggingface.loss import trainer_label_count
    from tests.support.hf.hf_cases import build

    args = tf.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    trainer = tf.Trainer(model=build("llama"), args=args)
    batch = _batches()[name]
    labels = batch["labels"]
    if name == "rows":
        assert int(labels.ne(-100).sum()) != int(labels[..., 1:].ne(-100).sum())  # first labels that count
    theirs = trainer._get_num_items_in_batch([batch], torch.device("cpu"))
    assert int(trainer_label_count(trainer, batch)) == int(theirs), (name, trainer_label_count(trainer, batch), theirs)


def test_the_trainers_older_checkpointing_name_is_read():
    """Before transformers 5.23, TrainingArguments has gradient_checkpointing only: the refusal of both
    checkpointings reads it and names it (on every installed version: arguments as 5.22 has them)."""
    from cp_attention.integrations.huggingface.trainer import _refusals

    trainer = SimpleNamespace(args=SimpleNamespace(gradient_checkpointing=True), cp_activation_checkpointing=True)
    with pytest.raises(ValueError, match=r"the Trainer's own gradient_checkpointing=True both checkpoint .*"
                                         r"TrainingArguments\(gradient_checkpointing=False\)"):
        _refusals(trainer, cp_size=2, world=2)


def _installed(monkeypatch, **old: str) -> None:
    """``versions.installed_version`` reports ``old``'s versions (keys with ``-`` as ``_``), the rest as installed."""
    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version",
                        lambda package: old.get(package.replace("-", "_"), real(package)))


@pytest.mark.parametrize("package", ["transformers", "accelerate"])
def test_older_transformers_or_accelerate_is_refused_first(monkeypatch, package):
    """Before anything else: even a base that is no Trainer gets the version's refusal, not the TypeError."""
    import transformers as tf

    from cp_attention.integrations import huggingface as cphf

    _installed(monkeypatch, **{package: OLD})
    floor = versions.FLOORS[package]
    words = (rf"context_parallel_trainer\) needs {package} >= {floor} .* but {package} {OLD} is installed; upgrade it: "
             rf"pip install '{package}>={floor}'")
    for base in (tf.Trainer, 42):
        with pytest.raises(RuntimeError, match=words):
            cphf.context_parallel_trainer(base)


def test_older_trl_is_refused_for_trls_trainers_only(monkeypatch):
    """An old TRL is refused when the class wrapped is TRL's (or a subclass of it), not for transformers'
    Trainer; at the floors, every class is taken."""
    trl = pytest.importorskip("trl", reason="needs the trainer extra: pip install -e '.[trainer]'")
    import transformers as tf

    from cp_attention.integrations import huggingface as cphf

    class MySFT(trl.SFTTrainer):
        pass

    _installed(monkeypatch, trl=OLD)
    for base in (trl.SFTTrainer, MySFT):
        with pytest.raises(RuntimeError, match=rf"needs trl >= {versions.FLOORS['trl']} .* trl {OLD} is installed"):
            cphf.context_parallel_trainer(base)
    assert issubclass(cphf.context_parallel_trainer(tf.Trainer), tf.Trainer)
    _installed(monkeypatch, **{k.replace("-", "_"): v for k, v in versions.FLOORS.items()})
    for base in (tf.Trainer, trl.SFTTrainer, MySFT):
        assert issubclass(cphf.context_parallel_trainer(base), base)


def test_the_eval_count_follows_the_bases_prediction_step(monkeypatch):
    """One process's evaluation divides the loss by the Trainer's count where the base's prediction_step is
    the Trainer's (transformers' Trainer; TRL's SFTTrainer before 1.15, whose prediction_step calls it), by
    the loss's own targets where it is not (TRL's from 1.15, which passes compute_loss no count; a subclass's
    own): the counts differ before transformers 5.10."""
    trl = pytest.importorskip("trl", reason="needs the trainer extra: pip install -e '.[trainer]'")
    import transformers as tf

    from cp_attention.integrations import huggingface as cphf

    class OwnStep(tf.Trainer):
        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)

    def the_trainers(base) -> bool:
        cls = cphf.context_parallel_trainer(base)
        return cls.__new__(cls)._eval_count_is_the_trainers()  # decided from the class and the versions only

    for version, expected in (("1.14.2", True), ("1.15.0", False), ("1.16.0", False)):
        _installed(monkeypatch, trl=version)
        assert the_trainers(trl.SFTTrainer) is expected, version
    assert the_trainers(tf.Trainer) and not the_trainers(OwnStep)
