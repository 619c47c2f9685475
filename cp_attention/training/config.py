"""What a training run is made from, checked before any rank starts: the config's checks, the
checkpoint to resume from, the device placement, the model and the optimizer with its schedule."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch

import cp_attention as cpa

from ..kernels import check_kernel_name
from .checkpoint import check_resume_compatible, checkpoint_info, find_complete_checkpoint, latest_checkpoint
from .data import VOCAB_SIZE
from .device import placement

__all__ = ["validate_config", "resume_point", "trainer_placement", "build_model", "optimizer"]


def resume_point(cfg: dict, world_size: int, run_dir: str | Path | None) -> Path | None:
    """The checkpoint this run resumes from, checked: None for a fresh start.

    ``trainer.resume_from`` is null (fresh), a checkpoint file, checkpoints directory or run directory
    (its latest checkpoint, which must be complete), or ``auto``: the newest complete checkpoint in
    ``run_dir/checkpoints``, skipping incomplete or corrupt ones with a note on stderr, and a fresh
    start if there is none. Raises ``FileNotFoundError``, :class:`CorruptCheckpointError` (naming the
    file) or ``ValueError`` (an incompatible config, naming the fields).
    """
    spec = cfg["trainer"].get("resume_from")
    if not spec:
        return None
    if spec == "auto":
        if run_dir is None:
            raise ValueError("trainer.resume_from=auto needs the run directory to look in for checkpoints/, got "
                             "run_dir=None; pass the run directory (validate_config leaves auto to the ranks)")
        directory = Path(run_dir) / "checkpoints"
        path, info, skipped = find_complete_checkpoint(directory)
        for why in skipped:
            print(f"resume_from=auto: skipping {why}", file=sys.stderr, flush=True)
        if path is None or info is None:  # both or neither
            print(f"resume_from=auto: no complete checkpoint in {directory}; starting fresh", file=sys.stderr,
                  flush=True)
            return None
    else:
        path = latest_checkpoint(spec)  # raises FileNotFoundError naming the path
        info = checkpoint_info(path)
    check_resume_compatible(info, cfg, world_size, path)
    return path


def validate_config(cfg: dict, world_size: int) -> None:
    """Fail fast, before any process starts, on a config that cannot run. Raises ``ValueError``,
    ``FileNotFoundError`` or :class:`CorruptCheckpointError` saying what to change."""
    cp = cfg["cp_size"]
    if cp < 1 or world_size % cp != 0:
        raise ValueError(f"cp_size={cp} must divide the world size {world_size} (dp = world / cp); "
                         f"set cp_size to a divisor of {world_size} or change nproc / --nproc-per-node")
    layout = cpa.get_layout(cfg["layout"]["name"])
    seq = cfg["trainer"]["seq_len"]
    if seq % layout.divisor(cp) != 0:
        raise ValueError(f"trainer.seq_len={seq} cannot be split by the {layout.name} layout over cp_size={cp}: "
                         f"it needs a multiple of {layout.divisor(cp)}; change trainer.seq_len or layout")
    check_kernel_name(cfg["kernel"]["name"])
    _check_cp_comm(cfg.get("cp_comm") or {"name": "p2p"}, cp, cfg["trainer"].get("fsdp", False), _heads(cfg["model"]))
    if cfg["trainer"].get("resume_from") not in (None, "", "auto"):  # auto: after the ranks know the run dir
        resume_point(cfg, world_size, None)  # a missing, corrupt or incompatible checkpoint
    data = cfg["data"]
    if data["source"] in ("text", "jsonl") and not (data.get("path") and Path(data["path"]).is_file()):
        raise FileNotFoundError(f"data.source={data['source']} needs data.path to name an existing file, "
                                f"got {data.get('path')!r}")
    packing = data.get("packing", False)
    if not isinstance(packing, bool):
        raise ValueError(f"data.packing must be true or false, got {packing!r}")
    if packing and data["source"] == "synthetic":
        raise ValueError("data.packing=true needs documents, and data.source=synthetic has none; use "
                         "data.packing=false with it, or a builtin, text or jsonl source")
    path = cfg["model"].get("pretrained_path")
    if path and not Path(path).is_dir():
        raise FileNotFoundError(f"model.pretrained_path={path!r} is not a directory saved with save_pretrained")
    t = cfg["trainer"]
    for key in ("steps", "micro_batch", "grad_accum"):
        if t[key] < 1:
            raise ValueError(f"trainer.{key} must be >= 1, got {t[key]}")
    for key in ("fsdp", "offload_optimizer"):
        if not isinstance(t.get(key, False), bool):
            raise ValueError(f"trainer.{key} must be true or false, got {t[key]!r}")
    _check_memory(t)
    timeout = t.get("dist_timeout_s")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"trainer.dist_timeout_s must be a positive number of seconds (or null for torch's "
                         f"default), got {timeout}")
    trainer_placement(cfg, world_size)


def _check_memory(t: dict) -> None:
    """The memory savers' keys: ``activation_checkpointing`` true, false or offload, ``mlp_chunks`` null or
    an int >= 1, ``loss_chunk_tokens`` null (full logits) or an int >= 1, ``offload_optimizer`` with
    ``fsdp`` only. Raises ``ValueError`` naming the key."""
    from cp_attention.integrations.huggingface.savers import check_savers

    check_savers(t.get("activation_checkpointing", False), t.get("mlp_chunks"),
                 ("trainer.activation_checkpointing", "trainer.mlp_chunks"))
    chunk = t.get("loss_chunk_tokens", 1024)
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"trainer.loss_chunk_tokens={chunk!r}: expected an int >= 1 (the tokens the LM head and "
                         "loss take at a time) or null (the full logits at once)")
    if t.get("offload_optimizer", False) and not t.get("fsdp", False):
        raise ValueError("trainer.offload_optimizer=true needs trainer.fsdp=true: it is FSDP2's CPUOffloadPolicy "
                         "(sharded parameters, gradients and optimizer state in CPU memory); set trainer.fsdp=true "
                         "or trainer.offload_optimizer=false")


def _heads(model_cfg: dict) -> int | None:
    """The model's query heads: the preset's, or a local checkpoint's ``config.json``'s; None if unknown."""
    path = model_cfg.get("pretrained_path")
    if not path:
        return model_cfg.get("num_attention_heads")
    config = Path(path) / "config.json"
    return json.loads(config.read_text()).get("num_attention_heads") if config.is_file() else None


def _check_cp_comm(comm: dict, cp: int, fsdp: bool, heads: int | None = None) -> None:
    """``cp_comm.name`` a strategy; for ``a2a+p2p``, ``cp_comm.inner`` a proper divisor of cp_size > 1 and
    no FSDP (its mesh has one cp dim); an all-to-all (``a2a`` over cp_size, ``a2a+p2p`` over
    ``cp_comm.inner``) that splits the model's ``heads``. Raises ``ValueError`` naming the key."""
    try:
        name = cpa.check_comm_type_name(comm.get("name"))
    except ValueError as e:
        raise ValueError(f"cp_comm.name: {e}; pick one with cp_comm=p2p|all_gather|a2a|a2a_p2p|auto") from None
    inner = comm.get("inner")
    if name != "a2a+p2p":
        if inner is not None:
            raise ValueError(f"cp_comm.inner={inner} is only for cp_comm=a2a_p2p; drop it")
        _check_heads(name, cp, heads)
        return
    if not isinstance(inner, int) or inner <= 1 or inner >= cp or cp % inner:
        raise ValueError(f"cp_comm.inner={inner!r}: a2a+p2p needs the all-to-all size, an int > 1 that divides "
                         f"cp_size={cp} and is smaller; set cp_comm.inner (or cp_comm=a2a for all of cp)")
    if fsdp:
        raise ValueError("cp_comm=a2a_p2p with trainer.fsdp=true is not supported (FSDP's mesh has one cp dim); "
                         "use cp_comm=a2a or p2p with FSDP")
    _check_heads(name, inner, heads)


def _check_heads(name: str, degree: int, heads: int | None) -> None:
    """An all-to-all over ``degree`` ranks gives each rank ``heads / degree`` query heads."""
    if name in ("a2a", "a2a+p2p") and degree > 1 and heads and heads % degree:
        over = "cp_size" if name == "a2a" else "cp_comm.inner"
        raise ValueError(f"cp_comm={name.replace('+', '_')} splits the model's {heads} query heads over "
                         f"{over}={degree} "
                         f"ranks, which does not divide them; use cp_comm=p2p, all_gather or auto, or a {over} "
                         f"that divides {heads}")


def _local_ranks(world_size: int) -> int:
    """How many ranks run on this machine: torchrun's ``LOCAL_WORLD_SIZE``, else all of them (spawned)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if "RANK" in os.environ else world_size


def trainer_placement(cfg: dict, world_size: int):
    """The resolved ``trainer.device`` and ``trainer.backend`` (a :class:`~.device.Placement`) for a job
    of ``world_size`` ranks; raises ``ValueError`` saying which option to change (see ``training.device``)."""
    t = cfg["trainer"]
    return placement(t.get("device", "auto"), t.get("backend", "auto"), local_ranks=_local_ranks(world_size),
                     cp_size=cfg["cp_size"], precision=t.get("precision", "fp32"), prefix="trainer.")


def build_model(model_cfg: dict):
    """A causal LM from a local checkpoint or from a tiny config preset (random weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_cfg.get("pretrained_path"):
        model = AutoModelForCausalLM.from_pretrained(model_cfg["pretrained_path"])
    else:
        kwargs = {k: v for k, v in model_cfg.items() if k not in ("family", "pretrained_path")}
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_cfg["family"], vocab_size=VOCAB_SIZE,
                                                                      **kwargs))
    if model.config.vocab_size < VOCAB_SIZE:
        raise ValueError(f"the model's vocabulary ({model.config.vocab_size}) is smaller than the byte "
                         f"tokenizer's ({VOCAB_SIZE})")
    return model


def optimizer(params, optim_cfg: dict, steps: int):
    kind = optim_cfg["name"]
    opt: torch.optim.Optimizer
    if kind == "adamw":
        opt = torch.optim.AdamW(params, lr=optim_cfg["lr"], weight_decay=optim_cfg["weight_decay"],
                                betas=tuple(optim_cfg["betas"]))
    elif kind == "sgd":
        opt = torch.optim.SGD(params, lr=optim_cfg["lr"], momentum=optim_cfg.get("momentum", 0.0))
    else:
        raise ValueError(f"unknown optim.name {kind!r}; expected adamw or sgd")
    warmup = optim_cfg.get("warmup_steps", 0)

    def factor(step: int) -> float:  # linear warm-up, then cosine to min_lr_ratio
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        floor = optim_cfg.get("min_lr_ratio", 0.1)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)
