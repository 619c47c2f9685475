"""Context parallelism inside ``transformers.Trainer`` and TRL's ``SFTTrainer``:
:func:`context_parallel_trainer` (re-exported by :mod:`cp_attention.integrations.huggingface`).

The Trainer stays in charge of everything it does; the subclass changes five things:

- **data**: the Trainer's loaders are sharded over the dp ranks only (accelerate's own batch-sampler
  shard, re-pointed from the world to dp), so every CP rank of a dp group draws the same batch;
  :func:`shard_batch` then takes this rank's share and agrees a fingerprint of it across the CP group;
- **the loss's token count**: each optimizer step's ``num_items_in_batch`` is counted from the
  unsharded batches as the installed Trainer counts them (:func:`.loss.trainer_label_count`: before
  transformers 5.10 position 0 of each row too) and summed over the dp groups (one all-reduce, as the
  Trainer's own gather), so the Trainer's own loss (``sum / num_items_in_batch``, times the world size
  that DDP's average divides by again) is one process's on the global batch. The model gets
  ``labels=shift_labels`` and ``shift_labels``: transformers' loss and TRL's fused head then do not
  shift again. The same all-reduce counts each batch's real tokens for TRL's ``num_tokens`` (TRL's own
  count would include the layout's padding);
- **evaluation** (:mod:`.trainer_eval`): the eval loader yields real batches only (a short last
  batch, one-example fillers with masked labels where a dp rank has none left) instead of accelerate's
  repeated examples; each step's loss is the token mean over every dp group's real examples (the one
  process's loss on the same global batch), the logits are gathered to the full batch, and the loop's
  all-gather keeps one copy per dp group of the real examples only. ``compute_loss`` runs the base's
  own (TRL's metrics included), its ``gather_for_metrics`` summing every rank's share;
- **the loss in chunks**: where the Trainer's own ``compute_loss`` would run (training, and evaluation of
  the loss only), :func:`.lm_loss.lm_loss` computes the same loss with the LM head and cross-entropy over
  ``cp_loss_chunk_tokens`` tokens at a time, so the ``[tokens, vocab]`` logits never exist at once
  (value and gradient those of the Trainer's own loss). Full logits only where they are asked for:
  ``predict`` and evaluation with metrics, a base whose ``compute_loss`` is its own (TRL's SFTTrainer: its
  entropy and token-accuracy metrics read the logits), ``cp_loss_chunk_tokens=None``. The memory savers
  (``cp_activation_checkpointing``, ``cp_mlp_chunks``: :func:`.savers.save_memory`) go on the model;
- ``get_cp_size()`` is cp, so the Trainer's batch-size arithmetic counts dp ranks.

Why a subclass: accelerate's ``ParallelismConfig(cp_size=...)`` and the Trainer's CP path run
PyTorch's own context parallelism only (``cp_backend="torch"``, SDPA, GPU, FSDP2); neither offers a
hook through which a third-party CP backend can register. The subclass uses the Trainer's documented
override points (``get_batch_samples``, ``get_*_dataloader``, ``compute_loss``, ``prediction_step``,
``evaluation_loop``, ``get_cp_size``).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, cast

import torch

import cp_attention as cpa
from cp_attention import versions
from cp_attention.kernels import check_kernel_name
from cp_attention.transport import transport_for

from .attention import apply_context_parallel, gather_sequence
from .batch import model_inputs, shard_batch
from .lm_loss import head_kind, lm_loss
from .loss import trainer_label_count
from .savers import check_savers, save_memory
from .trainer_eval import (
    EvalSteps,
    fill_eval_loader,
    gather_real_rows,
    refuse_rows_not_examples,
    unpack_logits,
    world_gathers,
)

__all__ = ["context_parallel_trainer"]

if TYPE_CHECKING:  # the mixin only ever runs mixed into a Trainer (context_parallel_trainer): typed as one
    from transformers import PreTrainedModel
    from transformers import Trainer as _TrainerBase
else:
    _TrainerBase = object


def _refusals(trainer, cp_size: int, world: int) -> None:
    """What a CP Trainer cannot honour exactly; raised before any communication (the same on every
    rank: the Trainer's arguments are)."""
    args = trainer.args
    # transformers 5.23 renamed gradient_checkpointing (an alias since) to activation_checkpointing
    name = "activation_checkpointing" if hasattr(args, "activation_checkpointing") else "gradient_checkpointing"
    if trainer.cp_activation_checkpointing and getattr(args, name, None):
        raise ValueError(f"cp_activation_checkpointing={trainer.cp_activation_checkpointing!r} and the Trainer's own "
                         f"{name}=True both checkpoint the decoder layers, and the Trainer's, switched on when "
                         "train() starts, would replace ours: set one of them (cp_activation_checkpointing='offload' "
                         f"holds the saved inputs in CPU memory with no host syncs; TrainingArguments({name}=False) "
                         "to use it)")
    chunked = trainer.cp_loss_chunk_tokens is not None and trainer._base_method_is_the_trainers("compute_loss")
    if cp_size > 1 and chunked:
        try:  # lm_loss applies the head only as the forwards it has read do: refused now, not at the first step
            head_kind(trainer.model)
        except NotImplementedError as e:
            raise NotImplementedError(f"cp_loss_chunk_tokens={trainer.cp_loss_chunk_tokens}: {e}; or pass "
                                      "cp_loss_chunk_tokens=None (the Trainer's own loss on full logits)") from None
    if cp_size > 1 and not trainer.model_accepts_loss_kwargs:
        raise NotImplementedError("the model's forward takes no loss kwargs (the Trainer's model_accepts_loss_kwargs "
                                  "is False), so under context parallelism its loss would be each rank's own token "
                                  "mean, not the global batch's; use a model whose forward takes **kwargs (every "
                                  "transformers causal LM does)")
    if cp_size < 1 or world % cp_size:
        raise ValueError(f"cp_size={cp_size} must divide the world size {world} (dp = world / cp_size); set cp_size "
                         f"to a divisor of {world} or change torchrun's --nproc-per-node")
    if args.label_smoothing_factor:
        raise NotImplementedError("label_smoothing_factor > 0 is not supported with context parallelism (the label "
                                  "smoother shifts the labels again); set label_smoothing_factor=0")
    if trainer.compute_loss_func is not None:
        raise NotImplementedError("compute_loss_func is not supported with context parallelism: it would get this "
                                  "rank's already shifted labels; compute the loss in a compute_loss override")
    if args.n_gpu > 1:
        raise NotImplementedError("torch.nn.DataParallel (n_gpu > 1 in one process) cannot run context parallelism; "
                                  "run one process per GPU under torchrun")


def _is_trls(cls: Any) -> bool:
    """Whether ``cls`` is one of TRL's classes or a subclass of one (TRL is not imported to tell)."""
    return any(c.__module__.partition(".")[0] == "trl" for c in getattr(cls, "__mro__", ()))


def _shard_over_dp(loader, dp: int, dp_rank: int):
    """Re-point accelerate's shard of ``loader`` from the world to the dp ranks (the Trainer does the same
    for its rebalancing sampler); returns ``loader``. Raises ``NotImplementedError`` for a loader it
    does not know how to shard (iterable datasets dispatched from rank 0)."""
    shard = getattr(loader, "batch_sampler", None)
    if shard is not None and hasattr(shard, "num_processes"):
        shard.num_processes, shard.process_index = dp, dp_rank
        return loader
    dataset = getattr(loader, "dataset", None)
    if dataset is not None and hasattr(dataset, "num_processes") and hasattr(dataset, "process_index"):
        dataset.num_processes, dataset.process_index = dp, dp_rank
        return loader
    raise NotImplementedError(f"cannot shard the Trainer's {type(loader).__name__} over the dp ranks only; use a "
                              "map-style dataset (or an iterable one with dispatch_batches=False)")


def context_parallel_trainer(base: type) -> type:
    """A subclass of ``base`` (``transformers.Trainer``, ``trl.SFTTrainer`` or a subclass of either)
    whose constructor takes ``cp_size`` (default 1: the Trainer unchanged), ``cp_layout`` (default
    ``"zigzag"``), ``cp_kernel`` (default ``"auto"``) and ``cp_comm_type`` (default ``"p2p"``; not
    ``"a2a+p2p"``, whose CP group needs two levels) besides the base's own arguments, and the memory
    savers: ``cp_loss_chunk_tokens`` (default 1024: under CP the training loss runs the LM head and
    cross-entropy over chunks of that many tokens, :func:`.lm_loss.lm_loss`; None: on the full logits, as
    the base computes it), ``cp_activation_checkpointing`` (True: recompute each decoder layer in
    backward; ``"offload"``: and hold its saved inputs in CPU memory; default False) and ``cp_mlp_chunks``
    (each decoder layer's MLP over that many sequence chunks; default None), applied by
    :func:`.savers.save_memory` at any ``cp_size``. None of them changes the result.

    Under ``torchrun --nproc-per-node=W`` the world is dp x cp, dp = W / cp_size: the model's attention
    runs ring attention over each CP group, and training, evaluation and ``predict`` equal the Trainer
    without CP in one process on the same global batch (``batch * dp``), for any eval set size. Raises
    ``TypeError`` for a base that is not a Trainer; the constructor raises ``ValueError`` for a cp_size
    that does not divide the world, an unknown layout or kernel, a memory saver's value outside those
    above, or ``cp_activation_checkpointing`` together with the Trainer's own ``activation_checkpointing``
    (``gradient_checkpointing``), and ``NotImplementedError`` for a model whose LM head ``lm_loss`` cannot
    apply (where it would run: pass ``cp_loss_chunk_tokens=None``), label
    smoothing, ``compute_loss_func``, a model whose forward takes no loss kwargs or ``n_gpu > 1``;
    ``evaluate``/``predict`` raise ``NotImplementedError`` where the eval loader's repeated examples
    cannot be told apart (see :mod:`.trainer_eval`). Raises ``RuntimeError`` first, before anything else, for a
    transformers, accelerate or (for a TRL trainer) TRL older than ``cp_attention.versions.FLOORS``.
    """
    what = "cp_attention's CP Trainer (context_parallel_trainer)"
    for package in ("transformers", "accelerate"):
        versions.require_version(package, what)
    if _is_trls(base):
        versions.require_version("trl", what)
    from transformers import Trainer

    if not (isinstance(base, type) and issubclass(base, Trainer)):
        raise TypeError(f"context_parallel_trainer takes a transformers.Trainer class (or a subclass such as "
                        f"trl.SFTTrainer), got {base!r}")
    return type(f"ContextParallel{base.__name__}", (_ContextParallelMixin, base),
                {"__doc__": f"{base.__name__} with context parallelism: see context_parallel_trainer."})


class _ContextParallelMixin(_TrainerBase):
    """The overrides of :func:`context_parallel_trainer` (placed before the Trainer in the MRO)."""

    _metrics: dict[str, dict[str, list]]  # TRL's SFTTrainer's (compute_loss writes it only under TRL)

    def __init__(self, *args: Any, cp_size: int = 1, cp_layout: str | cpa.Layout = "zigzag",
                 cp_kernel: str = "auto", cp_comm_type: str = "p2p", cp_loss_chunk_tokens: int | None = 1024,
                 cp_activation_checkpointing: bool | str = False, cp_mlp_chunks: int | None = None,
                 **kwargs: Any) -> None:
        self.cp_layout, self.cp_size, self._cp_group, self._cp_mesh = cpa.get_layout(cp_layout), cp_size, None, None
        self._cp_eval: EvalSteps | None = None  # the evaluation loop's steps, while one runs
        check_kernel_name(cp_kernel)
        if cpa.check_comm_type_name(cp_comm_type) == "a2a+p2p":
            raise NotImplementedError("the CP Trainer's CP group is one level (a (dp, cp) mesh's cp dim); "
                                      "cp_comm_type='a2a+p2p' needs two: use 'a2a', 'all_gather' or 'p2p'")
        check_savers(cp_activation_checkpointing, cp_mlp_chunks, ("cp_activation_checkpointing", "cp_mlp_chunks"))
        chunk = cp_loss_chunk_tokens
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"cp_loss_chunk_tokens={cp_loss_chunk_tokens!r}: expected an int >= 1 (the tokens the LM "
                             "head and loss take at a time) or None (the full logits at once)")
        self.cp_loss_chunk_tokens, self.cp_activation_checkpointing = cp_loss_chunk_tokens, cp_activation_checkpointing
        super().__init__(*args, **kwargs)
        world = self.args.world_size
        _refusals(self, cp_size, world)
        self._dp, self._dp_rank = world // cp_size, 0
        if cp_activation_checkpointing or cp_mlp_chunks is not None:
            save_memory(self._cp_model(), checkpoint=cp_activation_checkpointing, mlp_chunks=cp_mlp_chunks)
        if cp_size == 1:
            return
        from torch.distributed.device_mesh import init_device_mesh

        self._cp_mesh = init_device_mesh(self.args.device.type, (self._dp, cp_size), mesh_dim_names=("dp", "cp"))
        self._cp_group = self._cp_mesh["cp"].get_group()
        self._dp_rank = self._cp_mesh["dp"].get_local_rank()
        model = self._cp_model()
        apply_context_parallel(model, group=self._cp_group, layout=self.cp_layout, kernel=cp_kernel,
                               cp_comm_type=cp_comm_type)
        cast("PreTrainedModel", model).config.use_cache = False  # training and evaluation read no KV cache

    def _cp_model(self) -> torch.nn.Module:
        """The Trainer's model, which its constructor sets (from ``model`` or ``model_init``)."""
        if self.model is None:
            raise ValueError("context_parallel_trainer needs the Trainer's model: pass model= (or model_init=)")
        return self.model

    # ---------------------------------------------------------------------------- data
    def get_cp_size(self) -> int:
        return self.cp_size

    def get_train_dataloader(self):
        return self._cp_loader(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset=None):
        return self._cp_eval_loader(super().get_eval_dataloader(eval_dataset))

    def get_test_dataloader(self, test_dataset):
        return self._cp_eval_loader(super().get_test_dataloader(test_dataset))

    def _cp_eval_loader(self, loader):
        return loader if self._cp_group is None else fill_eval_loader(self._cp_loader(loader), self._dp)

    def _cp_loader(self, loader):
        return loader if self._cp_group is None else _shard_over_dp(loader, self._dp, self._dp_rank)

    def _cp_shard(self, batch: dict) -> dict:
        """This rank's share of ``batch`` (see :func:`shard_batch`), as the model takes it: the shifted
        labels both as ``labels`` and ``shift_labels`` (the loss must not shift them again)."""
        # seq_idx (TRL's padding-free collator) restates cu_seq_lens_q's documents per token; the ring
        # takes the documents from cu_seq_lens_q
        full = {k: v for k, v in batch.items() if k != "seq_idx"}
        local = shard_batch(full, group=self._cp_group, layout=self.cp_layout)
        # The batch's other (non-tensor) entries pass through, but shard_batch's win: max_length_q/k of the
        # padded stream may differ from the collator's (the padding document can be the longest)
        inputs = {**{k: v for k, v in full.items() if not isinstance(v, torch.Tensor)}, **model_inputs(local)}
        if "labels" in batch:
            inputs["labels"] = inputs["shift_labels"] = local["shift_labels"]
        return inputs

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        """The Trainer's next ``num_batches`` batches, sharded, and the label tokens of the whole
        global step (every rank's, each counted once) as ``num_items_in_batch``. For TRL's SFTTrainer each
        batch also carries its real tokens over the world (``_TRAIN_TOKENS``, for its ``num_tokens``)."""
        if self._cp_group is None:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        refused, full = None, batches
        try:  # agreed within the CP group by shard_batch; across the dp groups below
            batches = [self._cp_shard(b) for b in batches]
        except (ValueError, NotImplementedError, TypeError) as e:
            refused = e
        # TRL's SFTTrainer counts the tokens it trains on; counted once shard_batch has checked the batches
        tokens = [_real_tokens(b) for b in full] if refused is None and hasattr(self, "_total_train_tokens") else None
        counting = refused is None and bool(batches) and "labels" in batches[0] and self.model_accepts_loss_kwargs
        # [the dp group's label tokens as one process's Trainer counts them (on each of its CP ranks), whether its
        # batch was refused, each batch's real tokens] summed over the world, in the one collective the Trainer's
        # own count takes: a refusal stops every rank, none waits in DDP's all-reduce
        stats = torch.zeros(2 + num_batches, dtype=torch.int64, device=device)
        if counting:
            stats[0] = sum(trainer_label_count(self, b) for b in full)
        group_count = stats[0].clone()
        stats[1] = refused is not None
        if tokens:
            stats[2:2 + len(tokens)] = torch.stack([t.to(device) for t in tokens])
        transport_for(None).all_reduce_sum_(stats)
        _stop_if_refused(refused, int(stats[1]))
        if tokens:  # every CP rank of a dp group counted its batch's tokens: each group's count once
            for batch, count in zip(batches, stats[2:] // self.cp_size):
                batch[_TRAIN_TOKENS] = count
        if not counting:
            return batches, None
        if self.args.average_tokens_across_devices:  # the Trainer then multiplies the loss by the world size
            return batches, stats[0] // self.cp_size  # each dp group's count once
        # each dp group's token mean, times cp (DDP averages over dp x cp ranks): the group's count / cp
        return batches, group_count / self.cp_size

    def compute_loss(self, model, inputs: dict, return_outputs: bool = False, num_items_in_batch=None):
        """The Trainer's own loss through :func:`lm_loss` in chunks (see :meth:`_chunked_loss`: the same
        value and gradient), or the base's own, its ``gather_for_metrics`` summing every rank's share
        (TRL's token, entropy and accuracy sums: see :func:`world_gathers`); TRL's ``num_tokens`` then
        counts the batch's real tokens, not the layout's padding."""
        if self._cp_group is None:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        tokens = inputs.pop(_TRAIN_TOKENS, None)
        chunk = self.cp_loss_chunk_tokens
        if chunk is not None and self._chunked_loss(inputs, return_outputs, num_items_in_batch):
            loss = lm_loss(model, inputs, group=self._cp_group, chunk_tokens=chunk,
                           num_items_in_batch=num_items_in_batch)
            if self.args.average_tokens_across_devices:  # as the base does, for DDP's average over the world
                loss = loss * (self.accelerator.num_processes // self.get_tp_size())
            # lm_loss's value is the CP group's, its gradient this rank's share. The Trainer's value is this
            # rank's share, which it averages over the world to log and sums to evaluate: 1/cp of the group's
            # value has the same sum over the group, and so the same mean and sum over the world
            return loss.detach() / self.cp_size + (loss - loss.detach())
        before = getattr(self, "_total_train_tokens", None)
        with world_gathers(self.accelerator):
            out = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                       num_items_in_batch=num_items_in_batch)
        if tokens is not None and before is not None:  # TRL added the padded stream's length: replace it
            self._total_train_tokens = before + int(tokens) // getattr(self, "_tp_size", 1)
            self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
        return out

    def _chunked_loss(self, inputs: dict, return_outputs: bool, num_items_in_batch) -> bool:
        """Whether this ``compute_loss`` takes :func:`lm_loss` instead of the base's: the base's would be
        the Trainer's own (neither the base class nor a label smoother or ``compute_loss_func`` computes
        it), on counted labels, and no one asked for the outputs (the logits)."""
        if self.cp_loss_chunk_tokens is None or return_outputs or num_items_in_batch is None:
            return False
        if "shift_labels" not in inputs or self.label_smoother is not None or self.compute_loss_func is not None:
            return False
        return self._base_method_is_the_trainers("compute_loss")

    def _base_method_is_the_trainers(self, method: str) -> bool:
        """Whether the base's ``method`` is ``transformers.Trainer``'s own (not TRL's, not a subclass's)."""
        from transformers import Trainer

        mro = type(self).__mro__
        owner = next(c for c in mro[mro.index(_ContextParallelMixin) + 1:] if method in vars(c))
        return owner is Trainer

    def _eval_count_is_the_trainers(self) -> bool:
        """Whether one process's evaluation divides the loss by the Trainer's count (its ``prediction_step``,
        which TRL's SFTTrainer before 1.15 calls) or by the loss's own targets (TRL's from 1.15, which hands
        ``compute_loss`` no count; a subclass's own)."""
        if self._base_method_is_the_trainers("prediction_step"):
            return True
        trl = versions.installed_version("trl") if _is_trls(type(self)) else None
        return trl is not None and versions.parse_version(trl) < (1, 15)

    # ---------------------------------------------------------------------------- evaluation
    def prediction_step(self, model, inputs, prediction_loss_only: bool, ignore_keys: list[str] | None = None):
        """The step's loss over every dp group's real examples (the same on every rank: one process's
        loss on the same global batch), from ``compute_loss`` given the step's label tokens (in chunks
        when only the loss is asked for); and the logits gathered and unpacked to the batch's
        ``[batch, seq, vocab]`` (zeros at padding) with the batch's labels."""
        if self._cp_group is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        real = self._cp_eval.advance() if self._cp_eval is not None else None
        inputs = self._prepare_inputs(inputs)
        refused = None
        local: dict = {}  # this rank's share; stays empty where its batch is refused
        try:  # agreed within the CP group by shard_batch; across the dp groups below
            local = self._cp_shard(inputs)
        except (ValueError, NotImplementedError, TypeError) as e:
            refused = e
        labelled = "labels" in local
        filler = real is not None and real[self._dp_rank] == 0
        if labelled and filler:  # no token of it counts
            local["labels"] = local["shift_labels"] = torch.full_like(local["shift_labels"], -100)
        # [the dp group's label tokens as the Trainer's prediction_step counts them (on every CP rank of the
        # group), this rank's loss targets, whether its batch was refused] summed over the world
        stats = torch.zeros(3, dtype=torch.int64, device=self.args.device)
        if labelled and not filler:
            stats[0], stats[1] = trainer_label_count(self, inputs), (local["shift_labels"] != -100).sum()
        stats[2] = refused is not None
        transport_for(None).all_reduce_sum_(stats)
        _stop_if_refused(refused, int(stats[2]))
        loss = outputs = None
        if labelled:
            # what one process divides by (the Trainer's count or the loss's targets: see the method)
            count = stats[0] // self.cp_size if self._eval_count_is_the_trainers() else stats[1]
            with torch.no_grad(), self.compute_loss_context_manager():
                result = self.compute_loss(model, local, return_outputs=not prediction_loss_only,
                                           num_items_in_batch=count)
            loss, outputs = (result, None) if prediction_loss_only else result
            # Each rank's loss is its share's sum over the step's count (times the world size the base
            # multiplies by for DDP's average when averaging tokens across devices): sum the shares
            total = loss.detach().double().reshape(1)
            transport_for(None).all_reduce_sum_(total)
            averaged = self.args.average_tokens_across_devices
            loss = (total[0] / (self.accelerator.num_processes // self.get_tp_size() if averaged else 1)).to(loss.dtype)
        if prediction_loss_only:
            return loss, None, None
        if outputs is None:
            with torch.no_grad(), self.compute_loss_context_manager():
                outputs = model(**local)
        full = gather_sequence(outputs["logits"], group=self._cp_group, layout=self.cp_layout,
                               cu_seqlens=local.get("cu_seq_lens_q"))
        return loss, unpack_logits(full, inputs), inputs.get("labels")

    def evaluation_loop(self, dataloader, description: str, prediction_loss_only: bool | None = None,
                        ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval"):
        """The Trainer's loop, its gathers keeping the real examples of each step once (see
        :func:`gather_real_rows`)."""
        if self._cp_group is None:
            return super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                           metric_key_prefix)
        steps = EvalSteps.of(dataloader, self._dp, self.args.dataloader_drop_last)
        loss_only = self.args.prediction_loss_only if prediction_loss_only is None else prediction_loss_only
        if self._dp > 1 and (not loss_only or "inputs" in self.args.include_for_metrics):
            refuse_rows_not_examples(dataloader)
        # The Trainer gathers through self.gather_function (its accelerator's gather_for_metrics, bound at
        # construction; the loop resets it to that at its end)
        saved, self._cp_eval = self.gather_function, steps
        self.gather_function = functools.partial(gather_real_rows, self.accelerator, self._dp, self.cp_size, steps)
        try:
            return super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                           metric_key_prefix)
        finally:
            self.gather_function, self._cp_eval = saved, None


def _stop_if_refused(refused: Exception | None, refusals: int) -> None:
    """Raise this rank's refusal, or stop because another dp group's batch was refused (``refusals``: the
    ranks that refused, summed over the world): no rank goes on into a collective the others left."""
    if refused is not None:
        raise refused
    if refusals:
        raise RuntimeError("another dp group's batch was refused by shard_batch (its ranks raised the reason); "
                           "every rank stops")


_TRAIN_TOKENS = "_cp_train_tokens"  # a training batch's real tokens over the world, for TRL's num_tokens


def _real_tokens(batch: dict) -> torch.Tensor:
    """The batch's real tokens as TRL counts them in one process: its attention mask's ones, or every
    token of a padding-free batch (the layout's padding comes later, in shard_batch)."""
    mask = batch.get("attention_mask")
    return mask.sum() if mask is not None else torch.tensor(batch["input_ids"].numel())
