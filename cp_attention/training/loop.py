"""The training loop on a data-parallel x context-parallel DeviceMesh, and its launcher (what a run is
made from, checked, is in :mod:`.config`).

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

Test hook: ``CP_ATTENTION_TEST_SIGKILL=RANK:STEP`` makes rank RANK SIGKILL itself as it starts step
STEP, on torchrun's first attempt only (``TORCHELASTIC_RESTART_COUNT`` unset or 0).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from .._extras import require_extra
from ..launch import run_on_ranks
from .checkpoint import CorruptCheckpointError, load_checkpoint, save_checkpoint
from .config import build_model, optimizer, resume_point, trainer_placement, validate_config
from .sharded_checkpoint import load_sharded_checkpoint, save_sharded_checkpoint
from .data import ByteBatches, PackedBatches, load_bytes, load_documents
from .device import all_reduce_, autocast, rank_device
from .steps import train_step

require_extra("train", ("hydra", "tqdm"), "cp_attention.training.loop")

__all__ = ["validate_config", "launch", "train", "resume_point", "PeerRankError"]


class PeerRankError(RuntimeError):
    """A collective failed on this rank because another rank died, failed or stopped answering."""


# what gloo says when a peer's socket goes away or stays silent (NCCL raises dist.DistError subclasses)
_COMM_FAILURE = ("connection closed by peer", "connection reset by peer", "connection refused", "broken pipe",
                 "timed out")


def _as_peer_error(e: BaseException, rank: int, where: str, timeout_s) -> Optional[PeerRankError]:
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


def _maybe_kill_self(rank: int, step: int) -> None:
    """The test hook of the module docstring."""
    spec = os.environ.get("CP_ATTENTION_TEST_SIGKILL")
    if spec and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and \
            tuple(map(int, spec.split(":"))) == (rank, step):
        print(f"CP_ATTENTION_TEST_SIGKILL: rank {rank} SIGKILLs itself at step {step} (t={time.time():.3f})",
              file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


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


def training_mesh(device_type: str, dp: int, cp: int, comm: dict):
    """``(mesh, cp_mesh, attention_group)``: the ``(dp, cp)`` DeviceMesh, its 1-D CP mesh (the data's and
    the loss's CP group), and the group the model's attention runs over: the CP group, or for
    ``cp_comm.name == "a2a+p2p"`` a ``(dp, cp_p2p, cp_a2a)`` mesh, its cp dims flattened (the CP mesh,
    CP rank = cp_p2p rank x cp_comm.inner + cp_a2a rank) and its 2-D ``(cp_p2p, cp_a2a)`` sub-mesh, a
    two-level CP group."""
    from torch.distributed.device_mesh import init_device_mesh

    if comm["name"] != "a2a+p2p":
        mesh = init_device_mesh(device_type, (dp, cp), mesh_dim_names=("dp", "cp"))
        return mesh, mesh["cp"], mesh["cp"].get_group()
    inner = comm["inner"]
    mesh = init_device_mesh(device_type, (dp, cp // inner, inner), mesh_dim_names=("dp", "cp_p2p", "cp_a2a"))
    levels = mesh["cp_p2p", "cp_a2a"]
    return mesh, levels._flatten("cp"), levels


def train(cfg: dict, run_dir: str, resume: "str | Path | None" = None, device: str = "auto") -> Optional[dict]:
    """Train on this rank (the process group is initialised), from checkpoint ``resume`` if given (see
    :func:`resume_point`), on ``device`` (``cpu``, ``cuda``: this rank's GPU, or ``auto``: what the
    group's backend needs), in ``trainer.precision``. Returns the final metrics on rank 0. Raises
    :class:`PeerRankError` when another rank dies or fails."""
    from cp_attention.integrations import huggingface as cphf

    rank, world = dist.get_rank(), dist.get_world_size()
    t, cp = cfg["trainer"], cfg["cp_size"]
    dp = world // cp
    device = rank_device(device)
    precision = autocast(device, t.get("precision", "fp32"))  # raises before any collective of train()
    comm = cfg.get("cp_comm") or {"name": "p2p"}
    mesh, cp_mesh, attention_group = training_mesh(device.type, dp, cp, comm)
    cp_group, dp_group, dp_rank = cp_mesh.get_group(), mesh["dp"].get_group(), mesh["dp"].get_local_rank()
    layout = cfg["layout"]["name"]
    is_main = rank == 0

    torch.manual_seed(t["seed"])
    random.seed(t["seed"])
    model = build_model(cfg["model"]).to(device)
    model.config.use_cache = False  # training never reads the KV cache HF would build each step
    fsdp, mlp_chunks = t.get("fsdp", False), t.get("mlp_chunks")
    checkpointing = t.get("activation_checkpointing", False)
    chunk_tokens = t.get("loss_chunk_tokens", 1024)  # None: the loss on the full logits
    if chunk_tokens is not None:  # every rank builds the same model: refused alike, before the first step
        from cp_attention.integrations.huggingface.lm_loss import head_kind

        try:
            head_kind(model)
        except NotImplementedError as e:
            raise NotImplementedError(f"trainer.loss_chunk_tokens={chunk_tokens}: {e}; or set "
                                      "trainer.loss_chunk_tokens=null") from None
    if fsdp:  # parameters, gradients and optimizer state sharded over dp x cp; gradients summed by FSDP
        cphf.parallelize(model, mesh, layout=layout, kernel=cfg["kernel"]["name"], cp_comm_type=comm["name"],
                         activation_checkpointing=checkpointing, mlp_chunks=mlp_chunks,
                         offload_optimizer=t.get("offload_optimizer", False))
    else:
        cphf.apply_context_parallel(model, group=attention_group, layout=layout, kernel=cfg["kernel"]["name"],
                                    cp_comm_type=comm["name"])
        if checkpointing or mlp_chunks is not None:
            cphf.save_memory(model, checkpoint=checkpointing, mlp_chunks=mlp_chunks)
    # FSDP: the loss is the mean over the global batch (all dp x cp ranks); else over the replica's tokens
    loss_group = mesh if fsdp else cp_group
    opt, sched = optimizer(model.parameters(), cfg["optim"], t["steps"])
    d = cfg["data"]
    packing = d.get("packing", False)
    if packing:  # rows of whole documents, position_ids restarting at 0 at each: no attention across them
        batches = PackedBatches(load_documents(d["source"], d.get("path"), d.get("text_key", "text")),
                                t["seq_len"], t["seed"])
    else:
        batches = ByteBatches(load_bytes(d["source"], d.get("path"), d.get("text_key", "text"), seed=t["seed"]),
                              t["seq_len"], t["seed"])
    start = 0
    if resume is not None:
        if fsdp:  # every rank reads its shards, resharded to this run's dp x cp
            state = load_sharded_checkpoint(resume, model, opt)
        else:
            state = load_checkpoint(resume)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        batches.load_state_dict(state["data"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        if device.type == "cuda" and state["rng"].get("cuda") is not None:
            saved = state["rng"].get("cuda_device")  # rank 0's GPU; every rank's (same seed, same ops) is alike
            if saved is not None and saved < len(state["rng"]["cuda"]):
                torch.cuda.set_rng_state(state["rng"]["cuda"][saved], device)
            else:  # a checkpoint from before cuda_device was saved
                for i, s in enumerate(state["rng"]["cuda"][: torch.cuda.device_count()]):
                    torch.cuda.set_rng_state(s, i)
        start = state["step"]
        if is_main:
            print(f"resuming from {resume} (step {start})", file=sys.stderr, flush=True)

    ckpt_dir = Path(run_dir) / "checkpoints"
    metrics_path = Path(run_dir) / "metrics.jsonl"
    bar = None
    if is_main:
        from tqdm import tqdm

        bar = tqdm(total=t["steps"], initial=start, dynamic_ncols=True,
                   desc=f"train {layout} dp={dp} cp={cp} {device.type} {t.get('precision', 'fp32')}")
    tokens_per_step = dp * t["micro_batch"] * t["grad_accum"] * t["seq_len"]
    t0, last = time.perf_counter(), {}

    def loss_fn(batch) -> tuple[torch.Tensor, torch.Tensor]:
        if packing:  # one packed row of all the documents; their boundaries reach the attention
            ids, pos = batch
            local = cphf.shard_batch({"input_ids": ids.to(device), "position_ids": pos.to(device)},
                                     group=cp_group, layout=layout)
            inputs = cphf.model_inputs(local)
        else:
            local = cphf.shard_batch({"input_ids": batch.to(device)}, group=cp_group, layout=layout)
            inputs = {"input_ids": local["input_ids"], "position_ids": local["position_ids"]}
        with precision:  # the LM head and loss too: under autocast, as the layers
            if chunk_tokens is None:
                loss = cphf.causal_lm_loss(model(**inputs).logits, local["shift_labels"], group=loss_group)
            else:  # the head and cross-entropy over chunks of tokens: no [tokens, vocab] logits at once
                loss = cphf.lm_loss(model, {**inputs, "shift_labels": local["shift_labels"]}, group=loss_group,
                                    chunk_tokens=chunk_tokens)
        return loss, loss.detach()

    def replica_rows(full):  # the same global batch on every rank; each dp replica takes its rows
        rows = slice(dp_rank * t["micro_batch"], (dp_rank + 1) * t["micro_batch"])
        return tuple(x[rows] for x in full) if packing else full[rows]

    model.train()
    # stop_after ends this launch early (a time-limited job) with a checkpoint to resume from
    end = t["steps"] if not t.get("stop_after") else min(t["steps"], start + t["stop_after"])
    if is_main and Path(metrics_path).is_file():
        _keep_metrics_up_to(metrics_path, start)  # a crashed attempt may have logged steps after `start`
    where = f"before step {start + 1}"
    try:
        for step in range(start, end):
            where = f"during step {step + 1} of {t['steps']}"
            _maybe_kill_self(rank, step + 1)
            micro = [replica_rows(batches.next(dp * t["micro_batch"])) for _ in range(t["grad_accum"])]
            stat = train_step(model, opt, micro, loss_fn, cp_group=cp_group, dp_group=dp_group, scheduler=sched,
                              grad_clip=t.get("grad_clip"), sharded=fsdp)
            all_reduce_(stat)
            loss_value = stat.item() / world  # equal on the CP ranks of a replica: the mean over replicas
            done = step + 1
            if is_main:
                elapsed = time.perf_counter() - t0
                last = {"step": done, "loss": loss_value, "lr": sched.get_last_lr()[0],
                        "tokens": done * tokens_per_step,
                        "tokens_per_s": (done - start) * tokens_per_step / elapsed, "elapsed_s": elapsed}
                bar.update(1)
                bar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{last['tokens_per_s']:,.0f}")
                if done % t["log_every"] == 0 or done == t["steps"]:
                    with metrics_path.open("a") as f:
                        f.write(json.dumps(last) + "\n")
            if (t["ckpt_every"] and done % t["ckpt_every"] == 0) or done == end:
                rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
                if device.type == "cuda":
                    rng["cuda"], rng["cuda_device"] = torch.cuda.get_rng_state_all(), device.index
                common = {"step": done, "scheduler": sched.state_dict(), "data": batches.state_dict(), "rng": rng}
                if fsdp:  # collective: every rank writes its own shards
                    save_sharded_checkpoint(ckpt_dir, done, model, opt, common, cfg, world)
                elif is_main:
                    save_checkpoint(ckpt_dir, done, {**common, "model": model.state_dict(),
                                                     "optimizer": opt.state_dict(), "config": cfg,
                                                     "world_size": world})
        where = f"after its last step ({end})"
        if bar is not None:
            bar.close()
        dist.barrier()
    except Exception as e:
        peer = _as_peer_error(e, rank, where, t.get("dist_timeout_s"))
        if peer is None:
            raise
        raise peer from e
    return last if is_main else None


def _train_in_shared_dir(cfg: dict, run_dir: str, device: str = "auto") -> Optional[dict]:
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
    return train(cfg, run_dir, found[0], device)


def _died_message(e: BaseException, run_dir: str) -> str:
    logged = Path(run_dir) / "metrics.jsonl"
    steps = logged.read_text().splitlines() if logged.is_file() else []
    after = f" after step {json.loads(steps[-1])['step']} (the last one logged)" if steps else ""
    return (f"rank {e.error_index} died ({e.signal_name}){after}; the other ranks were stopped. Run again with "
            f"trainer.resume_from=auto hydra.run.dir={run_dir} to continue from the newest complete checkpoint")


def launch(cfg: dict, run_dir: str) -> Optional[dict]:
    """Run training: under ``torchrun`` on the ranks it started, otherwise on ``cfg['nproc']`` ranks
    spawned here, on ``trainer.device`` with ``trainer.backend`` (auto: NCCL on CUDA, gloo on CPU; see
    :mod:`.device`). All ranks write to rank 0's ``run_dir``. Returns rank 0's last metrics (``{}``
    when no step ran) on rank 0 (spawned: in this process), None on the other ranks.

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
        return run_on_ranks(_train_in_shared_dir, world, cfg, run_dir, where.device, backend=where.backend,
                            timeout_s=cfg["trainer"].get("dist_timeout_s"))
    except ProcessExitedException as e:  # a spawned rank was killed (a signal): it could say nothing itself
        raise RuntimeError(_died_message(e, run_dir)) from e
