"""The training loop on a data-parallel x context-parallel DeviceMesh, and its launcher (what a run is
made from, checked, is in :mod:`.config`; a rank's run, set up, restored and saved, in :mod:`.run`).

Each data-parallel replica takes its rows of the global micro-batch; inside a replica the CP ranks
hold 1/cp of every sequence. The CP loss is the replica's mean over all its tokens, so summing
gradients over the whole world and dividing by dp gives exactly the gradient of a dp-only run.
With ``trainer.fsdp=true`` the model is sharded by FSDP2 over dp x cp (``cphf.parallelize``), the loss
is the mean over every token of the global micro-batch, and checkpoints are sharded
(:mod:`.sharded_checkpoint`): a resume may change dp x cp, keeping the global batch.

Memory, never the result: the loss runs the LM head and cross-entropy over ``trainer.loss_chunk_tokens``
tokens at a time (``cphf.lm_loss``; null: on the full logits), ``trainer.activation_checkpointing``
(true, offload) and ``trainer.mlp_chunks`` put ``cphf.save_memory``'s savers on the model, and
``trainer.offload_optimizer`` (FSDP only) keeps the sharded parameters, gradients and optimizer state in
CPU memory. A resume may change any of them.

Failures: a rank that dies makes every other rank's next collective fail (gloo: at once, "Connection
closed by peer"; a rank that hangs: after ``trainer.dist_timeout_s``); each survivor then raises
:class:`PeerRankError` naming the step, and exits non-zero. ``trainer.resume_from=auto`` continues
from the newest complete checkpoint of the run directory (or starts fresh), so
``torchrun --max-restarts=N ... hydra.run.dir=DIR trainer.resume_from=auto`` survives a lost rank
with the same result as an uninterrupted run. Resume rules: :func:`checkpoint.check_resume_compatible`.

:func:`train` reads as its steps: :func:`.run.set_up` (placement, model, optimizer, data),
:func:`.run.restore`, then for each step the caller's ``before_step`` hook (where the tests SIGKILL a
rank), :func:`_step`, rank 0's :class:`_Progress` and :func:`.run.save`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .._extras import require_extra
from ..launch import run_on_ranks
from .checkpoint import CorruptCheckpointError
from .config import resume_point, trainer_placement, validate_config
from .device import all_reduce_, rank_device
from .run import Run, restore, save, set_up
from .steps import train_step

if TYPE_CHECKING:
    from torch.multiprocessing import ProcessExitedException

require_extra("train", ("hydra", "tqdm"), "cp_attention.training.loop")

__all__ = ["validate_config", "launch", "train", "resume_point", "PeerRankError"]


class PeerRankError(RuntimeError):
    """A collective failed on this rank because another rank died, failed or stopped answering."""


# what gloo says when a peer's socket goes away or stays silent (NCCL raises dist.DistError subclasses)
_COMM_FAILURE = ("connection closed by peer", "connection reset by peer", "connection refused", "broken pipe",
                 "timed out")


def _as_peer_error(e: BaseException, rank: int, where: str, timeout_s) -> PeerRankError | None:
    """``e`` restated as a :class:`PeerRankError` if it is a communication failure, else None."""
    text = " ".join(str(x) for x in (e, e.__cause__) if x is not None)
    if isinstance(e, PeerRankError) or not (isinstance(e, dist.DistError) or
                                            any(s in text.lower() for s in _COMM_FAILURE)):
        return None
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
    cause = ("a peer rank died or failed" if "timed out" not in text.lower() else
             f"a peer rank did not answer within trainer.dist_timeout_s={timeout_s} s (died, hung or far slower)")
    return PeerRankError(f"rank {rank}: {cause} {where}; this rank stops too. Cause: {first}. Restart with "
                         "trainer.resume_from=auto and the same hydra.run.dir (or run under torchrun "
                         "--max-restarts=N) to continue from the newest complete checkpoint")


def _keep_metrics_up_to(path: Path, step: int) -> None:
    """Rewrite ``metrics.jsonl`` (atomically) without the lines of steps after ``step``: on resume they
    will be logged again. Lines a crash left half-written are dropped too."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            pass
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


def _loss(run: Run, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, its detached value)`` of this rank's CP shard of ``batch`` (a replica's rows), the mean
    over ``run.loss_group``'s tokens, for :func:`~.steps.train_step`."""
    from cp_attention.integrations import huggingface as cphf

    layout, chunk_tokens = run.cfg["layout"]["name"], run.cfg["trainer"].get("loss_chunk_tokens", 1024)
    if run.packing:  # one packed row of all the documents; their boundaries reach the attention
        ids, pos = batch
        local = cphf.shard_batch({"input_ids": ids.to(run.device), "position_ids": pos.to(run.device)},
                                 group=run.cp_group, layout=layout)
        inputs = cphf.model_inputs(local)
    else:
        local = cphf.shard_batch({"input_ids": batch.to(run.device)}, group=run.cp_group, layout=layout)
        inputs = {"input_ids": local["input_ids"], "position_ids": local["position_ids"]}
    with run.precision:  # the LM head and loss too: under autocast, as the layers
        if chunk_tokens is None:
            loss = cphf.causal_lm_loss(run.model(**inputs).logits, local["shift_labels"], group=run.loss_group)
        else:  # the head and cross-entropy over chunks of tokens: no [tokens, vocab] logits at once
            loss = cphf.lm_loss(run.model, {**inputs, "shift_labels": local["shift_labels"]},
                                group=run.loss_group, chunk_tokens=chunk_tokens)
    return loss, loss.detach()


def _step(run: Run) -> float:
    """One optimizer step on the next global batch (each dp replica takes its rows, ``trainer.grad_accum``
    micro-batches); returns its loss, the mean over the replicas (the same on every rank)."""
    t = run.cfg["trainer"]
    rows = slice(run.dp_rank * t["micro_batch"], (run.dp_rank + 1) * t["micro_batch"])
    micro = []
    for _ in range(t["grad_accum"]):  # the same global batch on every rank
        full = run.batches.next(run.dp * t["micro_batch"])
        micro.append(tuple(x[rows] for x in full) if run.packing else full[rows])
    stat = train_step(run.model, run.opt, micro, lambda batch: _loss(run, batch), cp_group=run.cp_group,
                      dp_group=run.dp_group, scheduler=run.sched, grad_clip=t.get("grad_clip"), sharded=run.fsdp)
    all_reduce_(stat)
    return stat.item() / run.world  # equal on the CP ranks of a replica: the mean over replicas


class _Progress:
    """Rank 0's account of the steps: the progress bar, ``metrics.jsonl``, the last step's metrics."""

    def __init__(self, run: Run, metrics_path: Path, start: int) -> None:
        """A bar from step ``start`` of ``trainer.steps``; the clock of tokens_per_s starts now."""
        from tqdm import tqdm

        t = run.cfg["trainer"]
        self.run, self.path, self.start = run, metrics_path, start
        self.last: dict[str, Any] = {}
        self.bar = tqdm(total=t["steps"], initial=start, dynamic_ncols=True,
                        desc=f"train {run.cfg['layout']['name']} dp={run.dp} cp={run.cfg['cp_size']} "
                             f"{run.device.type} {t.get('precision', 'fp32')}")
        self.tokens_per_step = run.dp * t["micro_batch"] * t["grad_accum"] * t["seq_len"]
        self.t0 = time.perf_counter()

    def log(self, step: int, loss: float) -> None:
        """Record ``step``'s loss on the bar, and in ``metrics.jsonl`` every ``trainer.log_every`` steps
        and at the last."""
        t, elapsed = self.run.cfg["trainer"], time.perf_counter() - self.t0
        self.last = {"step": step, "loss": loss, "lr": self.run.sched.get_last_lr()[0],
                     "tokens": step * self.tokens_per_step,
                     "tokens_per_s": (step - self.start) * self.tokens_per_step / elapsed, "elapsed_s": elapsed}
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{self.last['tokens_per_s']:,.0f}")
        if step % t["log_every"] == 0 or step == t["steps"]:
            with self.path.open("a") as f:
                f.write(json.dumps(self.last) + "\n")


def train(cfg: dict, run_dir: str, resume: str | Path | None = None, device: str = "auto",
          before_step: Callable[[int], None] | None = None) -> dict | None:
    """Train on this rank (the process group is initialised), from checkpoint ``resume`` if given (see
    :func:`resume_point`), on ``device`` (``cpu``, ``cuda``: this rank's GPU, or ``auto``: what the
    group's backend needs), in ``trainer.precision``. ``before_step(step)``, if given, is called on
    every rank as it starts each step (1-based, before the step reads its batch). Returns the final
    metrics on rank 0. Raises :class:`PeerRankError` when another rank dies or fails."""
    t = cfg["trainer"]
    run = set_up(cfg, device)
    start = restore(run, resume) if resume is not None else 0
    ckpt_dir, metrics_path = Path(run_dir) / "checkpoints", Path(run_dir) / "metrics.jsonl"
    progress = _Progress(run, metrics_path, start) if run.rank == 0 else None
    run.model.train()
    # stop_after ends this launch early (a time-limited job) with a checkpoint to resume from
    end = t["steps"] if not t.get("stop_after") else min(t["steps"], start + t["stop_after"])
    if progress is not None:
        _keep_metrics_up_to(metrics_path, start)  # a crashed attempt may have logged steps after `start`
    where = f"before step {start + 1}"
    try:
        for step in range(start + 1, end + 1):
            where = f"during step {step} of {t['steps']}"
            if before_step is not None:
                before_step(step)
            loss = _step(run)
            if progress is not None:
                progress.log(step, loss)
            if (t["ckpt_every"] and step % t["ckpt_every"] == 0) or step == end:
                save(run, ckpt_dir, step)
        where = f"after its last step ({end})"
        if progress is not None:
            progress.bar.close()
        dist.barrier()
    except Exception as e:
        peer = _as_peer_error(e, run.rank, where, t.get("dist_timeout_s"))
        if peer is None:
            raise
        raise peer from e
    return progress.last if progress is not None else None


def _train_in_shared_dir(cfg: dict, run_dir: str, device: str = "auto",
                         before_step: Callable[[int], None] | None = None) -> dict | None:
    rank = dist.get_rank()
    rank_device(device)  # the CUDA device is current before the first (object) collective
    try:
        shared = [run_dir]
        dist.broadcast_object_list(shared, src=0)  # under torchrun, rank 0's Hydra directory is everyone's
        run_dir = shared[0]
        found: list = [None, None]  # rank 0 picks the checkpoint and every rank takes it, or raises the same error
        if rank == 0:
            try:
                found[0] = resume_point(cfg, dist.get_world_size(), run_dir)
            except (ValueError, FileNotFoundError, CorruptCheckpointError) as e:
                found[1] = (type(e), str(e))
        dist.broadcast_object_list(found, src=0)
    except Exception as e:
        peer = _as_peer_error(e, rank, "while the ranks started", cfg["trainer"].get("dist_timeout_s"))
        if peer is None:
            raise
        raise peer from e
    if found[1] is not None:
        raise found[1][0](found[1][1])
    return train(cfg, run_dir, found[0], device, before_step)


def _died_message(e: ProcessExitedException, run_dir: str) -> str:
    logged = Path(run_dir) / "metrics.jsonl"
    steps = logged.read_text().splitlines() if logged.is_file() else []
    after = f" after step {json.loads(steps[-1])['step']} (the last one logged)" if steps else ""
    return (f"rank {e.error_index} died ({e.signal_name}){after}; the other ranks were stopped. Run again with "
            f"trainer.resume_from=auto hydra.run.dir={run_dir} to continue from the newest complete checkpoint")


def launch(cfg: dict, run_dir: str, before_step: Callable[[int], None] | None = None) -> dict | None:
    """Run training: under ``torchrun`` on the ranks it started, otherwise on ``cfg['nproc']`` ranks
    spawned here, on ``trainer.device`` with ``trainer.backend`` (auto: NCCL on CUDA, gloo on CPU; see
    :mod:`.device`). All ranks write to rank 0's ``run_dir``. Returns rank 0's last metrics (``{}``
    when no step ran) on rank 0 (spawned: in this process), None on the other ranks. ``before_step``
    goes to :func:`train` on every rank (spawned ranks get it pickled: a module-level function).

    Raises what :func:`validate_config` raises, before any rank starts; :class:`PeerRankError` on a
    rank whose peer died or failed (under torchrun), and ``RuntimeError`` naming the rank when a
    spawned rank is killed.
    """
    from torch.multiprocessing import ProcessExitedException

    world = int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ else cfg["nproc"]
    validate_config(cfg, world)
    where = trainer_placement(cfg, world)
    if where.note and os.environ.get("RANK", "0") == "0":
        print(where.note, file=sys.stderr, flush=True)
    try:
        return run_on_ranks(_train_in_shared_dir, world, cfg, run_dir, where.device, before_step, backend=where.backend,
                            timeout_s=cfg["trainer"].get("dist_timeout_s"))
    except ProcessExitedException as e:  # a spawned rank was killed (a signal): it could say nothing itself
        raise RuntimeError(_died_message(e, run_dir)) from e
