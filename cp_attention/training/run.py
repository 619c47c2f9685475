"""One rank's training run: what :func:`.loop.train` sets up and checkpoints.

:func:`set_up` places the rank on the ``(dp, cp)`` mesh (:func:`training_mesh`), builds the model with
its attention context-parallel (FSDP2-sharded with ``trainer.fsdp``), its optimizer, scheduler and data
into a :class:`Run`; :func:`restore` loads a checkpoint into it and :func:`save` writes one (one file
from rank 0, or with FSDP every rank's shards, :mod:`.sharded_checkpoint`). A resume may change dp x cp
with FSDP only; the rules are :func:`.checkpoint.check_resume_compatible`'s.
"""

from __future__ import annotations

import random
import sys
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .checkpoint import load_checkpoint, save_checkpoint
from .config import build_model, optimizer
from .data import ByteBatches, PackedBatches, load_bytes, load_documents
from .device import autocast, rank_device
from .sharded_checkpoint import load_sharded_checkpoint, save_sharded_checkpoint

__all__ = ["Run", "set_up", "restore", "save", "training_mesh"]


@dataclass
class Run:
    """One rank's training run as :func:`set_up` builds it: where the rank sits in the ``(dp, cp)`` mesh,
    its groups, the model, optimizer, scheduler and data."""

    cfg: dict
    rank: int
    world: int
    dp: int
    dp_rank: int
    device: torch.device
    precision: AbstractContextManager  # what each forward and loss run in (trainer.precision)
    cp_group: Any  # the data's CP group (a ProcessGroup)
    dp_group: Any
    loss_group: Any  # FSDP: the whole (dp, cp) DeviceMesh, so the loss is the global batch's mean; else cp_group
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: Any  # a torch LR scheduler
    batches: ByteBatches | PackedBatches

    @property
    def fsdp(self) -> bool:
        """``trainer.fsdp``: the model sharded by FSDP2 over dp x cp, the checkpoints sharded."""
        return self.cfg["trainer"].get("fsdp", False)

    @property
    def packing(self) -> bool:
        """``data.packing``: a batch is ``(input_ids, position_ids)`` rows of whole documents."""
        return self.cfg["data"].get("packing", False)


def set_up(cfg: dict, device: str) -> Run:
    """This rank's run: its device and precision (raised before any collective), the ``(dp, cp)`` mesh
    (:func:`training_mesh`), the model made context-parallel (:func:`_build_model`), the optimizer and
    its scheduler, and the data (:func:`_batches`)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    t, cp = cfg["trainer"], cfg["cp_size"]
    dp = world // cp
    where = rank_device(device)
    precision = autocast(where, t.get("precision", "fp32"))  # raises before any collective of train()
    comm = cfg.get("cp_comm") or {"name": "p2p"}
    mesh, cp_mesh, attention_group = training_mesh(where.type, dp, cp, comm)
    cp_group, dp_group, dp_rank = cp_mesh.get_group(), mesh["dp"].get_group(), mesh["dp"].get_local_rank()
    model = _build_model(cfg, where, mesh, attention_group, comm["name"])
    opt, sched = optimizer(model.parameters(), cfg["optim"], t["steps"])
    batches = _batches(cfg)
    return Run(cfg, rank, world, dp, dp_rank, where, precision, cp_group, dp_group,
                mesh if t.get("fsdp", False) else cp_group, model, opt, sched, batches)


def training_mesh(device_type: str, dp: int, cp: int, comm: dict) -> tuple[Any, Any, Any]:
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


def _build_model(cfg: dict, device: torch.device, mesh: Any, attention_group: Any, comm_type: str) -> torch.nn.Module:
    """``cfg['model']`` seeded with ``trainer.seed`` on ``device``, its attention context-parallel over
    ``attention_group`` by ``comm_type`` (with ``trainer.fsdp``: sharded by FSDP2 over ``mesh``) and
    ``trainer``'s memory savers on. Raises ``NotImplementedError`` when ``trainer.loss_chunk_tokens``
    cannot chunk its LM head."""
    from cp_attention.integrations import huggingface as cphf

    t, layout, kernel = cfg["trainer"], cfg["layout"]["name"], cfg["kernel"]["name"]
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
        cphf.parallelize(model, mesh, layout=layout, kernel=kernel, cp_comm_type=comm_type,
                         activation_checkpointing=checkpointing, mlp_chunks=mlp_chunks,
                         offload_optimizer=t.get("offload_optimizer", False))
    else:
        cphf.apply_context_parallel(model, group=attention_group, layout=layout, kernel=kernel,
                                    cp_comm_type=comm_type)
        if checkpointing or mlp_chunks is not None:
            cphf.save_memory(model, checkpoint=checkpointing, mlp_chunks=mlp_chunks)
    return model


def _batches(cfg: dict) -> ByteBatches | PackedBatches:
    """The run's batches: rows of bytes, or with ``data.packing`` rows of whole documents whose
    position_ids restart at 0 at each (no attention across them)."""
    t, d = cfg["trainer"], cfg["data"]
    if d.get("packing", False):
        return PackedBatches(load_documents(d["source"], d.get("path"), d.get("text_key", "text")),
                             t["seq_len"], t["seed"])
    return ByteBatches(load_bytes(d["source"], d.get("path"), d.get("text_key", "text"), seed=t["seed"]),
                       t["seq_len"], t["seed"])


def restore(run: Run, resume: str | Path) -> int:
    """Load checkpoint ``resume`` into ``run`` (FSDP: every rank reads its shards, resharded to this
    run's dp x cp): weights, optimizer, scheduler, data position and RNG states; returns its step."""
    if run.fsdp:
        state = load_sharded_checkpoint(resume, run.model, run.opt)
    else:
        state = load_checkpoint(resume)
        run.model.load_state_dict(state["model"])
        run.opt.load_state_dict(state["optimizer"])
    run.sched.load_state_dict(state["scheduler"])
    run.batches.load_state_dict(state["data"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    if run.device.type == "cuda" and state["rng"].get("cuda") is not None:
        saved = state["rng"].get("cuda_device")  # rank 0's GPU; every rank's (same seed, same ops) is alike
        if saved is not None and saved < len(state["rng"]["cuda"]):
            torch.cuda.set_rng_state(state["rng"]["cuda"][saved], run.device)
        else:  # a checkpoint from before cuda_device was saved
            for i, s in enumerate(state["rng"]["cuda"][: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(s, i)
    if run.rank == 0:
        print(f"resuming from {resume} (step {state['step']})", file=sys.stderr, flush=True)
    return state["step"]


def save(run: Run, ckpt_dir: Path, step: int) -> None:
    """Checkpoint ``run`` after ``step`` into ``ckpt_dir``: with FSDP every rank writes its shards (a
    collective), else rank 0 writes one file; both hold the scheduler, data position and RNG states."""
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if run.device.type == "cuda":
        rng["cuda"], rng["cuda_device"] = torch.cuda.get_rng_state_all(), run.device.index
    common = {"step": step, "scheduler": run.sched.state_dict(), "data": run.batches.state_dict(), "rng": rng}
    if run.fsdp:
        save_sharded_checkpoint(ckpt_dir, step, run.model, run.opt, common, run.cfg, run.world)
    elif run.rank == 0:
        save_checkpoint(ckpt_dir, step, {**common, "model": run.model.state_dict(), "optimizer": run.opt.state_dict(),
                                         "config": run.cfg, "world_size": run.world})
