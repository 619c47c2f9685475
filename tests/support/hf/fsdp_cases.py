"""FSDP2 x CP cases run inside the gloo workers: ``parallelize`` over a (dp, cp) DeviceMesh against one
process training the same fp64 model on the whole global batch (every dp rank's batch)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from .hf_cases import SEQ, VOCAB, WINDOW_SEQ, build

_MESHES: dict = {}


def mesh(dp: int, cp: int):
    """The worker's (dp, cp) mesh (dp=0: a 1-D mesh named "cp"), made once per shape (each makes
    process groups)."""
    from torch.distributed.device_mesh import init_device_mesh

    if (dp, cp) not in _MESHES:
        _MESHES[(dp, cp)] = (init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",)) if dp == 0 else
                             init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp")))
    return _MESHES[(dp, cp)]


def dp_batch(step: int, dp_rank: int, packed: bool, seq: int) -> tuple[dict, list[tuple]]:
    """One dp rank's batch for ``step`` and its documents as ``(ids, labels)`` rows for the reference.

    The dp ranks' batches hold different numbers of label tokens (a masked label span, or other
    document lengths), so a loss averaged per dp rank would weigh tokens unequally."""
    g = torch.Generator().manual_seed(100 * step + dp_rank)
    if packed:
        lengths = ([1, 6, 2, seq - 9], [5, seq - 8, 3], [seq - 3, 2, 1])[(step + dp_rank) % 3]
        rows = [lengths, lengths[::-1]] if dp_rank % 2 == 0 else [lengths]
        ids = torch.randint(0, VOCAB, (len(rows), seq), generator=g)
        pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])
        docs = []
        for r, row in enumerate(rows):
            start = 0
            for n in row:
                docs.append((ids[r, start:start + n], ids[r, start:start + n]))
                start += n
        return {"input_ids": ids, "position_ids": pos}, docs
    ids = torch.randint(0, VOCAB, (2, seq), generator=g)
    labels = ids.clone()
    labels[0, : 3 + 4 * dp_rank] = -100  # prompt tokens without a label: fewer on dp rank 0
    return {"input_ids": ids, "labels": labels}, [(ids[r], labels[r]) for r in range(2)]


def _reference_step(ref, docs) -> torch.Tensor:
    """The global batch's mean next-token loss (every labelled token weighs alike), backpropagated."""
    total, count = 0.0, 0
    for ids, labels in docs:
        logits = ref(input_ids=ids[None]).logits[0]
        target = labels[1:]
        total = total + torch.nn.functional.cross_entropy(logits[:-1], target, ignore_index=-100, reduction="sum")
        count += int((target != -100).sum())
    loss = total / count
    loss.backward()
    return loss.detach()


def _optimizer(name: str, params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9) if name == "sgd" else torch.optim.AdamW(params, lr=1e-2)


def equivalence(rank: int, world_size: int, *, family: str, layout: str, dp: int, cp: int, packed: bool,
                checkpointing: bool | str, optim: str, steps: int = 3, cp_comm_type: str = "p2p",
                chunk_tokens: int | None = None, mlp_chunks: int | None = None,
                offload_optimizer: bool = False) -> dict:
    """On the (dp, cp) mesh (dp=0: a 1-D "cp" mesh), train ``steps`` steps with ``parallelize`` (and
    ``cp_comm_type``, ``checkpointing``, ``mlp_chunks``, ``offload_optimizer``) and, on every rank, the
    reference on the global batch; the loss is ``lm_loss`` over ``chunk_tokens`` (None: ``causal_lm_loss``
    on the full logits). Return the largest relative differences of the losses and of the full
    parameters, and what each rank holds of them."""
    from torch.distributed.tensor import DTensor

    from cp_attention.integrations import huggingface as cphf

    m = mesh(dp, cp)
    dp_rank = m["dp"].get_local_rank() if dp else 0
    dp = max(dp, 1)
    seq = WINDOW_SEQ if family.endswith("_window") else SEQ
    ref = build(family)
    model = cphf.parallelize(copy.deepcopy(ref), m, layout=layout, activation_checkpointing=checkpointing,
                             cp_comm_type=cp_comm_type, mlp_chunks=mlp_chunks, offload_optimizer=offload_optimizer)
    ref.train(), model.train()
    opt_ref, opt = _optimizer(optim, ref.parameters()), _optimizer(optim, model.parameters())
    losses, ref_losses = [], []
    for step in range(steps):
        batches = [dp_batch(step, r, packed, seq) for r in range(dp)]
        ref_losses.append(_reference_step(ref, [d for _, docs in batches for d in docs]).item())
        local = cphf.shard_batch(batches[dp_rank][0], group=m, layout=layout)
        if chunk_tokens is None:
            loss = cphf.causal_lm_loss(model(**cphf.model_inputs(local)).logits, local["shift_labels"], group=m)
        else:
            loss = cphf.lm_loss(model, local, group=m, chunk_tokens=chunk_tokens)
        loss.backward()
        losses.append(loss.item())
        opt_ref.step(), opt.step(), opt_ref.zero_grad(), opt.zero_grad()
    params, held, full_sizes, rel = dict(model.named_parameters()), 0, 0, 0.0
    for name, p_ref in ref.named_parameters():
        p = params[name]
        assert isinstance(p, DTensor), f"{name} is not sharded"
        full = p.full_tensor()
        rel = max(rel, ((full - p_ref).abs().max() / p_ref.abs().max().clamp_min(1e-30)).item())
        held += p.to_local().numel()
        full_sizes += full.numel()
        bound = -(-full.shape[0] // world_size) * full[0].numel()
        assert p.to_local().numel() <= bound, f"{name}: rank {rank} holds {p.to_local().numel()} > {bound} elements"
    moved = max(((p0 - p1).abs().max() / p1.abs().max()).item()
                for p0, p1 in zip(build(family).parameters(), ref.parameters()))
    return {"params": rel, "loss": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)), "losses": losses,
            "held": held, "full": full_sizes, "moved": moved, "offloaded": _offloaded(model),
            "impl": model.config._attn_implementation}


def _offloaded(model) -> bool | None:
    """Whether every FSDP2 parameter group of ``model`` runs CPUOffloadPolicy (None: some do, some not)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule)]
    kinds = {isinstance(g.offload_policy, CPUOffloadPolicy) for g in groups if g is not None}
    return kinds.pop() if len(kinds) == 1 else None


def refusal(rank: int, world_size: int, *, case: str) -> tuple[str, str]:
    """One input ``parallelize`` or ``shard_batch`` must refuse; the exception's type and message."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from cp_attention.integrations import huggingface as cphf

    m = mesh(2, world_size // 2)
    model = build("gpt_oss" if case == "moe_mlp_chunks" else "llama", seed=rank if case == "weights_differ" else 0)
    try:
        if case == "no_cp_dim":
            cphf.parallelize(model, init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",)))
        elif case == "cp_not_world":
            cphf.parallelize(model, m["cp"])  # a cp mesh over some of the ranks only
        elif case == "already_fsdp":
            flat = mesh(1, world_size)["cp"]  # made on every rank (collective); used on one
            if rank == 1:  # on one rank only: every rank must still refuse alike
                fully_shard(model, mesh=flat)
            cphf.parallelize(model, m)
        elif case == "weights_differ":
            cphf.parallelize(model, m)
        elif case == "moe_mlp_chunks":  # a mixture-of-experts MLP cannot run over sequence chunks exactly
            cphf.parallelize(model, m, mlp_chunks=2)
        elif case == "a2a_p2p":  # the (dp, cp) mesh's cp dim is one level
            cphf.parallelize(model, m, cp_comm_type="a2a+p2p")
        elif case == "batch_differs":  # the cp ranks of one group were given different batches
            ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(rank))
            cphf.shard_batch({"input_ids": ids}, group=m, layout="zigzag")
        else:
            raise AssertionError(case)
    except (ValueError, NotImplementedError, TypeError) as e:
        return type(e).__name__, str(e)
    finally:
        dist.barrier()
    return "none", ""


def mixed_precision(rank: int, world_size: int, *, steps: int = 2) -> dict:
    """FSDP2's MixedPrecisionPolicy through parallelize: an fp64 model computing in fp32 with fp64
    gradient reduction; relative differences from the fp64 single-process run."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from cp_attention.integrations import huggingface as cphf

    m = mesh(1, world_size)
    ref = build("llama")
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float64)
    model = cphf.parallelize(copy.deepcopy(ref), m, layout="zigzag", mp_policy=policy)
    opt_ref, opt = _optimizer("sgd", ref.parameters()), _optimizer("sgd", model.parameters())
    loss_err, dtypes = 0.0, set()
    for step in range(steps):
        batch, docs = dp_batch(step, 0, False, SEQ)
        ref_loss = _reference_step(ref, docs).item()
        local = cphf.shard_batch(batch, group=m, layout="zigzag")
        out = model(**cphf.model_inputs(local))
        dtypes.add(str(out.logits.dtype))
        loss = cphf.causal_lm_loss(out.logits, local["shift_labels"], group=m)
        loss.backward()
        dtypes.add(str(next(model.parameters()).grad.dtype))
        loss_err = max(loss_err, abs(loss.item() - ref_loss) / ref_loss)
        opt_ref.step(), opt.step(), opt_ref.zero_grad(), opt.zero_grad()
    rel = max(((p.full_tensor() - q).abs().max() / q.abs().max()).item()
              for p, q in zip(model.parameters(), ref.parameters()))
    return {"loss": loss_err, "params": rel, "dtypes": sorted(dtypes)}


def mesh_as_group(rank: int, world_size: int) -> dict:
    """On a (2, 2) mesh, every CP entry point given the mesh does what it does given the mesh's cp group;
    causal_lm_loss given the mesh averages over all four ranks' tokens."""
    import cp_attention as cpa
    from cp_attention.integrations import huggingface as cphf

    m = mesh(2, world_size // 2)
    cp, dp_rank = m["cp"].get_group(), m["dp"].get_local_rank()
    g = torch.Generator().manual_seed(7 + dp_rank)  # one batch per dp rank
    q, k, v = (torch.randn(1, 8, 2, 4, dtype=torch.float64, generator=g) for _ in range(3))
    same = {
        "ring": torch.equal(cpa.ring_attention(q, k, v, group=m), cpa.ring_attention(q, k, v, group=cp)),
        "plan": torch.equal(cpa.ring_attention(q, k, v, plan=cpa.plan("zigzag", m)),
                            cpa.ring_attention(q, k, v, group=cp)),
        "gather": torch.equal(cphf.gather_sequence(q, group=m), cphf.gather_sequence(q, group=cp)),
    }
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=g)
    a, b = cphf.shard_batch({"input_ids": ids}, group=m), cphf.shard_batch({"input_ids": ids}, group=cp)
    same["shard_batch"] = all(torch.equal(a[key], b[key]) for key in a) and a.keys() == b.keys()
    logits = torch.randn(1, SEQ // 2, VOCAB, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    loss = cphf.causal_lm_loss(logits, a["shift_labels"], group=m)
    # the reference: every rank's token losses summed and counted, gathered over the whole world
    token = torch.nn.functional.cross_entropy(logits[0], a["shift_labels"][0], ignore_index=-100, reduction="sum")
    stats = torch.stack([token, (a["shift_labels"] != -100).sum().double()])
    dist.all_reduce(stats)
    return {**same, "loss": abs(loss.item() - (stats[0] / stats[1]).item())}
