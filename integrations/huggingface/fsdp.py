"""FSDP2 and context parallelism on one ``DeviceMesh``: :func:`parallelize` (re-exported by
:mod:`cp_attention.integrations.huggingface`).

Context parallelism runs over the mesh's ``"cp"`` dim; FSDP2 (``fully_shard``, per decoder layer and at
the root) shards parameters, gradients and optimizer state over ALL the mesh's ranks (dp x cp,
flattened). FSDP normally averages gradients over its ranks. CP needs their SUM: each CP rank holds
its share of a loss that is the mean over every label token of the global batch (:func:`.lm_loss.lm_loss`,
or :func:`.attention.causal_lm_loss` on full logits, with ``group=mesh``), so the sum over dp x cp is
exactly the gradient of one process on the whole global batch, however the label tokens fall between
the dp ranks. ``parallelize`` sets FSDP's reduction to a plain sum (``set_gradient_divide_factor(1.0)``
with sum-only collectives, which gloo supports too).

Memory: the savers of :func:`.savers.save_memory` (activation checkpointing, its saved inputs offloaded
to the CPU, the MLP over sequence chunks) and FSDP2's ``CPUOffloadPolicy`` (parameters, gradients and
optimizer state in CPU memory, the optimizer step on the CPU) change where memory goes, not the result.
"""

from __future__ import annotations

import struct

import torch

import cp_attention as cpa
from cp_attention.checks.verdicts import agree
from cp_attention.kernels import check_kernel_name
from cp_attention.transport import CP_DIM, is_device_mesh
from cp_attention.versions import require_version

from .attention import apply_context_parallel
from .savers import check_savers, save_memory

__all__ = ["parallelize", "fsdp_mesh"]

_KINDS = (ValueError, NotImplementedError)


def _check_mesh(mesh) -> None:
    """Refuse a mesh FSDP x CP cannot use (the same on every rank: a mesh is built collectively)."""
    import torch.distributed as dist

    if not is_device_mesh(mesh):
        raise TypeError(f"parallelize needs a torch.distributed DeviceMesh, got {type(mesh).__name__}; build one "
                        "with init_device_mesh(device_type, (dp, cp), mesh_dim_names=('dp', 'cp'))")
    names = tuple(mesh.mesh_dim_names or ())
    if CP_DIM not in names:
        raise ValueError(f"parallelize needs a DeviceMesh with a {CP_DIM!r} dim, got dims {names or 'unnamed'}; "
                         "build it with init_device_mesh(device_type, (dp, cp), mesh_dim_names=('dp', 'cp'))")
    if mesh.ndim > 2:
        raise NotImplementedError(f"parallelize takes a (dp, cp) or (cp,) mesh, got {mesh.ndim} dims {names}; "
                                  "tensor or pipeline parallel dims are not supported")
    world = dist.get_world_size()
    cp = mesh[CP_DIM].size() if mesh.ndim > 1 else mesh.size()
    if world % cp != 0 or mesh.size() != world:
        raise ValueError(f"the mesh's cp={cp} must divide the world size {world} and the mesh must span every "
                         f"rank (dp x cp = world), got a mesh of shape {tuple(mesh.shape)} over {world} ranks; use "
                         f"init_device_mesh(device_type, ({world // max(cp, 1)}, {cp}), mesh_dim_names=('dp', 'cp'))")


def _wrapped(model: torch.nn.Module) -> str | None:
    """The data-parallel wrapper already on ``model`` (or on one of its modules), if any."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    for m in model.modules():
        for kind, name in ((FSDPModule, "FSDP2 (fully_shard)"), (FullyShardedDataParallel, "FSDP"),
                           (DistributedDataParallel, "DistributedDataParallel")):
            if isinstance(m, kind):
                return name
    return None


def _fingerprint(model: torch.nn.Module) -> list[int]:
    """[parameter count, elements, sum, sum of squares as int64 bits]: equal on ranks holding the same
    weights (the same reduction over the same values), different when a rank initialised its own. Meta
    parameters (initialised after sharding) count by shape only."""
    params = list(model.parameters())
    real = [p.detach() for p in params if p.device.type != "meta"]
    sums = [0.0, 0.0]
    if real:
        stats = torch.stack([torch.stack([p.double().sum(), p.double().square().sum()]) for p in real]).sum(0)
        sums = stats.tolist()  # once, at set-up
    bits = [struct.unpack("<q", struct.pack("<d", s))[0] for s in sums]
    return [len(params), sum(p.numel() for p in params), *bits]


def fsdp_mesh(mesh):
    """The 1-D mesh FSDP shards over: every rank of ``mesh`` (its dims flattened, cached by the mesh)."""
    if mesh.ndim == 1:
        return mesh
    return mesh._flatten("_".join(mesh.mesh_dim_names))


def parallelize(model: torch.nn.Module, mesh, layout: str | cpa.Layout = "zigzag",
                activation_checkpointing: bool | str = False, mp_policy=None, kernel: str = "auto",
                reshard_after_forward: bool = True, cp_comm_type: str = "p2p", mlp_chunks: int | None = None,
                offload_optimizer: bool = False) -> torch.nn.Module:
    """Context parallelism over ``mesh["cp"]`` and FSDP2 over all of ``mesh`` (dp x cp); returns ``model``.

    ``mesh``: ``init_device_mesh(device_type, (dp, cp), mesh_dim_names=("dp", "cp"))`` (any name for
    the dp dim), or a 1-D mesh named ``"cp"``. Every rank passes the same model with the same weights
    (or meta weights it initialises after this call). Then, per step: ``local = shard_batch(batch,
    group=mesh, layout=...)`` on this dp rank's batch, ``loss = lm_loss(model, local, group=mesh)`` (the
    LM head and cross-entropy over chunks of tokens; ``causal_lm_loss(model(**model_inputs(local)).logits,
    local["shift_labels"], group=mesh)`` is the same loss on full logits), ``loss.backward()`` and the
    optimizer's step: the gradients are those of one process on the global batch (the dp ranks'
    batches together), with no further call. Do not call ``reduce_gradients``.

    Memory (none changes the result): ``activation_checkpointing``: True recomputes each decoder layer
    in backward (non-reentrant), ``"offload"`` also holds the layers' saved inputs in CPU memory;
    ``mlp_chunks``: each decoder layer's MLP runs over that many sequence chunks (see
    :func:`.savers.save_memory`); ``offload_optimizer``: FSDP2's ``CPUOffloadPolicy``: the sharded
    parameters, gradients and optimizer state live in CPU memory (pinned when CUDA is available),
    parameters are copied to the device for each all-gather, and the optimizer steps on the CPU: build
    the optimizer after this call (meta weights initialised after it: ``to_empty(device="cpu")``).
    ``mp_policy``: an FSDP2 ``MixedPrecisionPolicy`` (e.g. bf16 compute, fp32 gradient reduction). ``kernel``
    as in ``ring_attention``. ``reshard_after_forward`` as in ``fully_shard`` for the decoder layers.
    ``cp_comm_type`` as in ``apply_context_parallel``, but ``"a2a+p2p"``, which needs a CP dim of two levels
    (a (dp, cp) mesh's is one).

    Raises, before any communication: ``RuntimeError`` for a transformers older than
    ``cp_attention.versions.FLOORS``; ``TypeError`` if ``mesh`` is no DeviceMesh; ``ValueError`` for a
    mesh without a ``"cp"`` dim, one whose cp does not divide the world or that does not span it, an
    unknown layout, kernel or ``cp_comm_type``, or an ``activation_checkpointing``, ``mlp_chunks`` or
    ``offload_optimizer`` value outside those above; ``NotImplementedError`` for more than two mesh
    dims or ``cp_comm_type="a2a+p2p"``. Then, the same on every rank (one small all-gather over the
    mesh): ``ValueError`` if a rank's model is already wrapped by FSDP or DDP, the ranks' models differ
    (parameter count, sizes or values), the model cannot checkpoint activations when asked to, or its
    MLPs cannot run over sequence chunks exactly (mixture-of-experts blocks: see ``save_memory``).
    """
    require_version("transformers", "cp_attention's HuggingFace adapter (parallelize)")
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard

    check_savers(activation_checkpointing, mlp_chunks, ("activation_checkpointing", "mlp_chunks"))
    if not isinstance(offload_optimizer, bool):
        raise ValueError(f"offload_optimizer={offload_optimizer!r}: expected True (FSDP2's CPUOffloadPolicy: "
                         "parameters, gradients and optimizer state in CPU memory) or False")
    _check_mesh(mesh)
    lay = cpa.get_layout(layout)
    check_kernel_name(kernel)
    if cpa.check_comm_type_name(cp_comm_type) == "a2a+p2p":
        raise NotImplementedError("parallelize cannot run cp_comm_type='a2a+p2p': the (dp, cp) mesh's cp dim is one "
                                  "level, and a2a+p2p needs two (a ring across one, all-to-all inside the other); use "
                                  "cp_comm_type='a2a' (all-to-all over the cp dim) or 'p2p'")
    problem = None
    wrapped = _wrapped(model)
    if wrapped is not None:
        problem = (0, f"the model is already wrapped by {wrapped}; pass the bare model to parallelize, which "
                      "applies FSDP2 itself (context parallelism needs FSDP's gradients summed, not averaged)")
    elif activation_checkpointing and not getattr(model, "supports_gradient_checkpointing", False):
        problem = (0, f"activation_checkpointing={activation_checkpointing!r}, but {type(model).__name__} does not "
                      "support transformers' gradient checkpointing; pass activation_checkpointing=False")
    elif activation_checkpointing or mlp_chunks is not None:
        try:  # save_memory refuses what it cannot do exactly (an MoE MLP in chunks) changing nothing: agreed below
            save_memory(model, checkpoint=activation_checkpointing, mlp_chunks=mlp_chunks)
        except ValueError as e:
            problem = (0, f"parallelize(activation_checkpointing={activation_checkpointing!r}, "
                          f"mlp_chunks={mlp_chunks!r}): {e}")
    # A wrapped model's parameters are DTensors, whose sums would communicate: fingerprint only a bare one.
    headers = agree(None, mesh.size(), problem, _KINDS, "(on rank {first}; ranks refused: {bad})",
                    _fingerprint(model) if problem is None else [0, 0, 0, 0])
    if len(set(headers)) > 1:
        raise ValueError("the ranks' models differ (parameter count, sizes or values): every rank must build the "
                         "same model with the same weights (seed torch alike, or load the same checkpoint) before "
                         f"parallelize; per rank [params, elements, sum, sum of squares]: {headers}")
    apply_context_parallel(model, group=mesh, layout=lay, kernel=kernel, cp_comm_type=cp_comm_type)
    flat = fsdp_mesh(mesh)
    policy = {} if mp_policy is None else {"mp_policy": mp_policy}
    if offload_optimizer:  # pinned host memory needs CUDA; on a CPU mesh the shards stay where they are
        policy["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for m in list(model.modules()):
        if m is not model and type(m).__name__ in blocks:
            fully_shard(m, mesh=flat, reshard_after_forward=reshard_after_forward, **policy)
    fully_shard(model, mesh=flat, **policy)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # the sum over dp x cp (see the module docstring)
            m.set_force_sum_reduction_for_comms(True)
    return model
