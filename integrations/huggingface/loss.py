"""The loss of a CP-patched HuggingFace model given ``labels``: the exact CP loss, or a refusal by name.

``model(**shard_batch({"input_ids": ids, "labels": labels}))`` (``model_inputs`` forgotten) hands the
model this rank's shard of ``labels`` and the ``shift_labels`` that :func:`shard_batch` shifted on the
FULL sequence. Transformers' own ``ForCausalLMLoss`` would take their mean over this rank's tokens only:
a different value on every rank, none of them the loss without CP. :func:`apply_context_parallel`
therefore replaces the model's ``loss_function`` with :class:`CPModelLoss`:

- without ``num_items_in_batch``: :func:`causal_lm_loss` over the CP group (the mean over every rank's
  label tokens, the same value on every rank, each rank's gradient its share, as
  ``causal_lm_loss(out.logits, local["shift_labels"], group)`` gives);
- with ``num_items_in_batch`` (the caller's own normalisation, as the CP Trainer counts it over the
  world): transformers' loss on ``shift_labels``, ``sum / num_items_in_batch``, a share the caller sums.

Refused by name in the model's forward pre-hook, on every rank alike before any layer runs
(:meth:`CPModelLoss.check`): ``labels`` without ``shift_labels`` (labels sharded by hand could only be
shifted inside the shard); ``ignore_index`` other than -100 (what :func:`shard_batch` marks); a model
whose loss is not causal LM cross-entropy; and a CP group taken from a ``(dp, cp)`` mesh without
``num_items_in_batch``, whose mean must span the CP group or the whole mesh depending on how the
gradients are reduced (``reduce_gradients`` or ``parallelize``'s FSDP sum): the caller says which
through :func:`causal_lm_loss`'s ``group``.

A head that computes its loss without ``loss_function`` is not caught (none of the supported families
does; TRL's fused LM head does, and its trainer takes the loss from its log-probabilities and the CP
Trainer's ``num_items_in_batch`` instead).

:func:`trainer_label_count` is that ``num_items_in_batch`` as the installed transformers' Trainer counts it
(the rule changed in 5.10), so the CP Trainer divides by what one process divides by.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from cp_attention.transport import is_device_mesh
from cp_attention.transport.mesh import is_two_level
from cp_attention.versions import parse_version

__all__ = ["CPModelLoss", "model_loss", "trainer_label_count"]

_IGNORE_INDEX = -100
_FIX = ("pass the batch from shard_batch through model_inputs, model(**model_inputs(local)), and take the loss as "
        "causal_lm_loss(out.logits, local['shift_labels'], group=...)")


# transformers' Trainer counts num_items_in_batch over labels[..., 1:] (the causal LM loss's targets) from 5.10 on;
# before, over every label, position 0 of each row too: its loss, divided by that count, is that much smaller
_TRAINER_COUNTS_SHIFTED = (5, 10)


def trainer_label_count(trainer: Any, batch: dict) -> torch.Tensor:
    """The label tokens of ``batch`` (a whole, unsharded batch as the collator made it) that the installed
    ``transformers.Trainer`` counts for ``num_items_in_batch`` (``_get_num_items_in_batch``), as a 0-d tensor:
    the value the one process divides its loss by, which the CP Trainer must divide by too.

    transformers < 5.10: every label that is not -100, position 0 of each row included (one more per row
    than the loss's targets where that label is real); from 5.10: the collator's ``shift_labels`` if it
    gives them, else ``labels[..., 1:]`` for a loss that shifts the labels (the Trainer's
    ``_loss_shifts_labels``), else every label. Raises ``AttributeError`` if a transformers >= 5.10 Trainer
    has no ``_loss_shifts_labels`` (its rule changed again: this function must learn it)."""
    import transformers

    labels = batch["labels"]
    if parse_version(transformers.__version__) >= _TRAINER_COUNTS_SHIFTED:
        if "shift_labels" in batch:
            labels = batch["shift_labels"]
        elif trainer._loss_shifts_labels:
            labels = labels[..., 1:]
    return labels.ne(_IGNORE_INDEX).sum()


def _causal_lm_base() -> Callable:
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss


class CPModelLoss:
    """A patched model's ``loss_function`` (see the module docstring); ``check`` is its forward pre-hook's."""

    def __init__(self, base: Callable, group: Any, cp_loss: Callable, refusal: str | None,
                 uncounted_refusal: str | None) -> None:
        self.base, self.group, self.cp_loss = base, group, cp_loss
        self.refusal = refusal  # whenever labels are given
        self.uncounted_refusal = uncounted_refusal  # when they are given without num_items_in_batch

    def check(self, kwargs: dict[str, Any]) -> None:
        """Raise ``ValueError`` or ``NotImplementedError`` if this forward's ``labels`` cannot give the exact
        CP loss (pure: every rank decides alike from the same keys)."""
        if kwargs.get("labels") is None:
            return
        if kwargs.get("shift_labels") is None:
            raise ValueError(
                "labels reached the context-parallel model without shift_labels: this rank holds a shard of them, "
                "and the model's loss would shift them inside the shard and average over this rank's tokens "
                f"only (a different, wrong loss on every rank). Either {_FIX}, or pass every key of shard_batch's "
                "result (its shift_labels make the model's own loss the exact CP loss)")
        index = kwargs.get("ignore_index")
        if index is not None and int(index) != _IGNORE_INDEX:
            raise ValueError(f"ignore_index={int(index)} given to a context-parallel model: shard_batch marks "
                             f"padding and document ends with {_IGNORE_INDEX}; leave ignore_index at -100")
        if self.refusal is not None:
            raise NotImplementedError(self.refusal)
        if self.uncounted_refusal is not None and kwargs.get("num_items_in_batch") is None:
            raise NotImplementedError(self.uncounted_refusal)

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                 num_items_in_batch: torch.Tensor | int | None = None, ignore_index: int = _IGNORE_INDEX,
                 shift_labels: torch.Tensor | None = None, **forward_kwargs: Any) -> torch.Tensor:
        """The loss the model's forward asks for with ``labels`` (transformers hands it the forward's own
        kwargs too, the attention's among them: ``ForCausalLMLoss`` ignores them, and so does this)."""
        if shift_labels is None or self.refusal is not None or (self.uncounted_refusal is not None
                                                                 and num_items_in_batch is None):
            raise RuntimeError("CPModelLoss was called with arguments its check refuses: the model's forward "
                               "pre-hook did not run (a layer or head called on its own?); " + _FIX)
        if num_items_in_batch is not None:  # the caller's normalisation: this rank's share of its global loss
            return self.base(logits, shift_labels, vocab_size, num_items_in_batch=num_items_in_batch,
                             ignore_index=ignore_index, shift_labels=shift_labels)
        return self.cp_loss(logits, shift_labels, group=self.group)


def model_loss(model: torch.nn.Module, group_arg: Any, group: Any, cp_loss: Callable) -> CPModelLoss:
    """The :class:`CPModelLoss` for ``model`` patched over ``group`` (``group_arg``: what the caller passed,
    perhaps a mesh), computing the CP loss with ``cp_loss`` (:func:`causal_lm_loss`)."""
    base: Callable | None = getattr(model, "loss_function", None)  # transformers' loss of the model's class
    base = base.base if isinstance(base, CPModelLoss) else base  # patched again: wrap the model's own
    refusal = uncounted_refusal = None
    if base is not None and base is not _causal_lm_base():
        name = getattr(base, "__name__", type(base).__name__)
        refusal = (f"labels given to a context-parallel model whose loss is {name}, not causal LM cross-entropy: "
                   f"the ring adapter computes only the latter exactly; {_FIX}")
    if is_device_mesh(group_arg) and group_arg.ndim > 1 and not is_two_level(group_arg):
        uncounted_refusal = ("labels given to a context-parallel model whose CP group is the 'cp' dim of a "
                   f"{group_arg.ndim}-D mesh {group_arg.mesh_dim_names}: its loss must average over the CP group "
                   "(gradients then reduced with reduce_gradients) or over the whole mesh (parallelize's FSDP sum), "
                   "which the model cannot tell; " + _FIX.replace("group=...", "group=mesh for parallelize"))
    return CPModelLoss(base or _causal_lm_base(), group, cp_loss, refusal, uncounted_refusal)
