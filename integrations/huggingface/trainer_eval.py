"""Evaluation of the CP Trainer (:mod:`.trainer`): which examples of each evaluation step are real,
and the gathers that count every real example once and nothing else.

accelerate's eval loader, sharded over the dp ranks, fills the last batch with repeated examples so
every rank takes the same number of steps (``even_batches``); their tokens would enter the loss. Here
the loader yields the real batches as the sampler made them (the last one short) and, where a dp rank
has no batch left in the last step, a one-example filler batch whose labels are masked: every batch
is all real or all filler, whatever the collator, and every rank still takes every step.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

__all__ = ["EvalBatches", "EvalSteps", "fill_eval_loader", "gather_real_rows", "world_gathers",
           "refuse_rows_not_examples", "unpack_logits"]


class EvalBatches:
    """accelerate's inner batch sampler of an eval loader, then one-example filler batches up to a
    multiple of ``dp`` batches (none with ``drop_last``: accelerate then drops the incomplete step, as
    one process drops its incomplete global batch). ``sizes``: the real examples of every batch, 0 for
    a filler, set when an iteration starts."""

    def __init__(self, inner, dp: int) -> None:
        self.inner, self.dp = inner, dp
        self.sizes: list[int] = []
        # what BatchSamplerShard and DataLoaderShard read from the sampler they wrap
        self.batch_size, self.drop_last = getattr(inner, "batch_size", None), getattr(inner, "drop_last", False)
        self.sampler = getattr(inner, "sampler", None)

    def _missing(self, batches: int) -> int:
        return 0 if self.drop_last or not batches else -batches % self.dp

    def __len__(self) -> int:
        return len(self.inner) + self._missing(len(self.inner))

    def __iter__(self) -> Iterator[list]:
        batches = [list(b) for b in self.inner]  # indices only; the sampler runs once per iteration
        missing = self._missing(len(batches))
        self.sizes = [len(b) for b in batches] + [0] * missing
        yield from batches
        for _ in range(missing):
            yield batches[0][:1]


def fill_eval_loader(loader, dp: int):
    """Make ``loader`` (accelerate's eval loader, already sharded over the dp ranks) yield real batches
    and fillers (see :class:`EvalBatches`) instead of batches filled with repeated examples; returns it.
    A loader that is not a map-style dataset's batch-sampler shard, or one that splits batches, is left
    as it is: :meth:`EvalSteps.of` refuses it unless it drops its last batch."""
    shard = getattr(loader, "batch_sampler", None)
    if (shard is not None and hasattr(shard, "even_batches") and not getattr(shard, "split_batches", False)
            and not isinstance(shard.batch_sampler, EvalBatches)):  # a cached loader (persistent workers): once
        # With a multiple of dp batches, accelerate's uneven mode hands every rank one batch per step
        shard.batch_sampler, shard.even_batches = EvalBatches(shard.batch_sampler, dp), False
    return loader


class EvalSteps:
    """The real examples of each dp rank in the current step of one evaluation loop."""

    def __init__(self, batches: EvalBatches | None, dp: int) -> None:
        self.batches, self.dp, self.step = batches, dp, 0
        self.current: list[int] | None = None  # None: every row is real

    @classmethod
    def of(cls, dataloader, dp: int, drop_last: bool) -> EvalSteps:
        """The steps of ``dataloader``; raises ``NotImplementedError`` for a loader whose last batch
        accelerate fills with repeated examples that cannot be told apart (iterable datasets, split
        batches, a loader not made by the Trainer's get_eval/test_dataloader) unless it drops it."""
        shard = getattr(dataloader, "batch_sampler", None)
        batches = getattr(shard, "batch_sampler", None)
        if isinstance(batches, EvalBatches):
            return cls(batches, dp)
        if drop_last:  # every step then holds full batches of real examples
            return cls(None, dp)
        raise NotImplementedError(
            f"evaluate/predict under context parallelism cannot tell the repeated examples accelerate fills the "
            f"last batch of this {type(dataloader).__name__} with from real ones (an iterable dataset, "
            "split_batches=True, or a loader not made by get_eval_dataloader/get_test_dataloader); use a "
            "map-style dataset, or set dataloader_drop_last=True")

    def advance(self) -> list[int] | None:
        """Move to the next step; its real examples per dp rank (None: all rows real)."""
        if self.batches is not None:
            self.current = self.batches.sizes[self.step * self.dp:(self.step + 1) * self.dp]
            self.step += 1
        return self.current


def refuse_rows_not_examples(dataloader) -> None:
    """Raise ``NotImplementedError`` if the loader's collator puts several examples in one row
    (transformers' DataCollatorWithFlattening, TRL's padding-free collator): the predictions of one
    process would then be one row per global batch, under dp > 1 one row per dp rank. Probed by
    collating the dataset's first example twice: the same on every rank."""
    from transformers.trainer_pt_utils import find_batch_size

    dataset = getattr(dataloader, "dataset", None)
    if dataset is None or not hasattr(dataset, "__getitem__") or len(dataset) == 0:
        return
    example = dataset[0]
    rows = find_batch_size(dataloader.collate_fn([example, example]))
    if rows is not None and rows != 2:
        raise NotImplementedError(
            "predictions (or include_for_metrics='inputs') of a collator that packs several examples into one "
            "row cannot be gathered under context parallelism with dp > 1: one process has one row per global "
            "batch, the dp ranks one each; evaluate the loss only (no compute_metrics, prediction_loss_only=True), "
            "or use dp = 1 (cp_size = world size)")


def gather_real_rows(accelerator, dp: int, cp: int, steps: EvalSteps, data, use_gather_object: bool = False):
    """The Trainer loop's ``gather_function`` under CP: every rank's rows, one copy per dp group (its CP
    ranks hold the same batch's results), only the real examples of the step, in dp-rank order: the
    rows one process gathers from the same global batch. Two all-gathers per tensor (the row counts,
    then the rows padded to the most)."""
    from accelerate.utils import recursively_apply

    if use_gather_object:
        raise NotImplementedError("evaluation outputs that are not tensors cannot be gathered under context "
                                  "parallelism; return tensors from compute_metrics' inputs")
    real = steps.current

    def rows(x: torch.Tensor) -> torch.Tensor:
        x = x[None] if x.dim() == 0 else x
        sizes = accelerator.gather(torch.tensor([x.shape[0]], device=x.device)).tolist()
        most = max(sizes)
        if x.shape[0] < most:
            x = torch.cat([x, x.new_zeros(most - x.shape[0], *x.shape[1:])])
        parts = accelerator.gather(x).reshape(dp, cp, most, *x.shape[1:])[:, 0]
        # The loss the loop repeats batch_size times: one copy per real example (a short batch's rows
        # are all real; a filler's none)
        keep = [sizes[r * cp] if real is None else min(sizes[r * cp], real[r]) for r in range(dp)]
        return torch.cat([parts[r, :keep[r]] for r in range(dp)])

    return recursively_apply(rows, data)


@contextlib.contextmanager
def world_gathers(accelerator) -> Iterator[None]:
    """Within the block, ``accelerator.gather_for_metrics`` gathers every rank's tensor once, with no
    end-of-loader truncation. What ``compute_loss`` gathers (TRL's token, entropy and accuracy sums) is
    per rank: each CP rank holds its own share of the tokens, a filler batch holds none, and accelerate's
    truncation to the dataset's remainder would drop ranks' shares, not repeated examples."""
    had = "gather_for_metrics" in vars(accelerator)
    saved = vars(accelerator).get("gather_for_metrics")

    def gather_every_rank(input_data: Any, use_gather_object: bool = False):
        if use_gather_object:
            raise NotImplementedError("compute_loss under context parallelism gathers tensors only (each rank's "
                                      "share); gather_for_metrics(..., use_gather_object=True) is not supported")
        return accelerator.gather(input_data)

    accelerator.gather_for_metrics = gather_every_rank
    try:
        yield
    finally:
        if had:
            accelerator.gather_for_metrics = saved
        else:
            del accelerator.gather_for_metrics  # the class's method again


def unpack_logits(stream: torch.Tensor, batch: dict) -> torch.Tensor:
    """Gathered logits ``[1, T, ...]`` of :func:`shard_batch`'s packed row (or ``[b, s, ...]``, unpacked)
    back to the batch's ``[b, s, ...]``: padding (``attention_mask`` zeros) filled with zeros."""
    b, s = batch["input_ids"].shape
    if stream.shape[:2] == (b, s):
        return stream
    mask = batch.get("attention_mask")
    if mask is None or bool(mask.all()):
        return stream[0, : b * s].reshape(b, s, *stream.shape[2:])
    out = stream.new_zeros(b, s, *stream.shape[2:])
    real = mask.bool()
    out[real] = stream[0, : int(real.sum())]  # rows of real tokens, in order, are the stream's start
    return out
