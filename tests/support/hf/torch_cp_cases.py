"""The torch ``context_parallel`` drop-in (cp_attention.compat.torch_cp) training a tiny HF Llama with
``attn_implementation="sdpa"``, against the same script in one process without CP.

The script is what a torchtitan / accelerate caller writes: inputs, labels (shifted before sharding)
and position ids are the context's buffers, the model runs unmodified, and a pre-hook on each attention
module drops the mask transformers builds from the sharded position ids (accelerate's
``_attach_context_parallel_hooks`` does the same). Each rank's loss is its tokens' share of the mean over
every token, so the gradients summed over the ranks are the gradients without CP.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

VOCAB = 64
SEQ = 16  # plain batches: [2, SEQ]
PACKED = (5, 11, 7, 1, 8)  # packed documents: [1, 32], not each a multiple of 2 * world_size
# AdamW divides each gradient by its own running magnitude, so a component whose gradient is ~1e-9 turns
# fp32 rounding (gradients agree to ~1e-7) into an update difference of up to ~lr: 3e-5 keeps 3 steps of
# it under 1e-6 (1e-4 gave 1.2e-6 with packed documents) while training moves the weights by ~9e-5.
LR = 3e-5


def build(seed: int = 0):
    """A tiny fp32 Llama (GQA: 4 query heads, 2 KV heads) on transformers' sdpa attention."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    return tf.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").float()


def drop_attention_masks(model) -> None:
    """accelerate's pattern: the attention modules get ``attention_mask=None, is_causal=True``."""
    def hook(_module, args, kwargs):
        if "attention_mask" in kwargs:
            kwargs["attention_mask"], kwargs["is_causal"] = None, True
        return args, kwargs

    for name, module in model.named_modules():
        if name.endswith("self_attn"):
            module.register_forward_pre_hook(hook, with_kwargs=True)


def batch(step: int, packed: bool) -> dict:
    """Full-sequence ``input_ids``, ``labels`` (shifted: the next token of the same document, else -100)
    and ``position_ids`` (within documents), and ``cu_seqlens`` when packed."""
    g = torch.Generator().manual_seed(100 + step)
    lengths = PACKED if packed else (SEQ,)
    rows = 1 if packed else 2
    total = sum(lengths)
    ids = torch.randint(0, VOCAB, (rows, total), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths]).expand(rows, total).clone()
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()])
    labels[:, cu[1:] - 1] = -100  # a document's last token predicts nothing
    return {"input_ids": ids, "labels": labels, "position_ids": pos, "cu_seqlens": cu if packed else None}


def _loss(model, b: dict, count: int) -> torch.Tensor:
    logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), b["labels"].flatten(),
                                             ignore_index=-100, reduction="sum") / count


def train(group, *, layout: str = "zigzag", packed: bool = False, steps: int = 3, cp=None, start=None) -> dict:
    """``steps`` AdamW steps of the same model with and without CP on this rank of ``group`` (a mesh, a
    process group or a loopback rank); ``cp`` is the ``context_parallel`` to use (ours by default),
    ``start`` the initial model (:func:`build` by default; loopback threads share one, built before them:
    the seed is global). Returns each step's loss both ways, the largest parameter difference at the end
    and how far training moved the parameters."""
    from cp_attention.training import reduce_gradients
    from cp_attention.transport import transport_for
    from cp_attention.transport.mesh import cp_group

    if cp is None:
        from cp_attention.compat.torch_cp import context_parallel as cp
    start = build() if start is None else start
    ref, model = copy.deepcopy(start), copy.deepcopy(start)
    drop_attention_masks(model)
    opt_ref, opt = (torch.optim.AdamW(m.parameters(), lr=LR) for m in (ref, model))
    losses, ref_losses, grads = [], [], 0.0
    for step in range(steps):
        b = batch(step, packed)
        count = int((b["labels"] != -100).sum())
        ref_loss = _loss(ref, b, count)
        ref_loss.backward()
        ref_losses.append(ref_loss.item())
        bufs = [b["input_ids"], b["labels"], b["position_ids"]]
        extra = {"layout": layout, "cu_seqlens": b["cu_seqlens"]} if cp_is_ours(cp) else {}
        with cp(group, buffers=bufs, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(bufs), **extra):
            loss = _loss(model, b, count)
            loss.backward()
        reduce_gradients(model, cp_group=cp_group(group))
        losses.append(transport_for(group).all_reduce_sum_(loss.detach().clone()).item())
        grads = max([grads] + [(p.grad - q.grad).abs().max().item()
                               for p, q in zip(model.parameters(), ref.parameters())])
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
    return {"losses": losses, "ref_losses": ref_losses, "grads": grads,
            "params": max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())),
            "moved": max((p - q).abs().max().item() for p, q in zip(ref.parameters(), start.parameters()))}


def cp_is_ours(cp) -> bool:
    return getattr(cp, "__module__", "").startswith("cp_attention")


def loopback_training(world_size: int, *, layout: str = "zigzag", packed: bool = False, steps: int = 3) -> list:
    """:func:`train` on every rank of a :class:`LoopbackGroup` (threads in this process)."""
    from cp_attention.transport.loopback import LoopbackGroup

    start = build()
    return LoopbackGroup(world_size, timeout_s=60).run(
        lambda g: train(g, layout=layout, packed=packed, steps=steps, start=start))


def gloo_training(rank: int, world_size: int, *, layout: str = "zigzag", packed: bool = False) -> dict:
    """:func:`train` on a 1-D ``("cp",)`` DeviceMesh over the pool's gloo ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    out = train(mesh, layout=layout, packed=packed)
    dist.barrier()
    return out


def torch_cp_on_cpu(rank: int, world_size: int) -> dict:
    """The same script under torch's own ``context_parallel`` on CPU gloo (``steps=1``): its results, or
    the exception it raises."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    try:
        out = train(mesh, steps=1, cp=context_parallel)
    except Exception as e:  # noqa: BLE001 - the test reports what torch raised
        dist.barrier()
        return {"error": f"{type(e).__name__}: {e}"}
    ours = train(mesh, steps=1)
    dist.barrier()
    return {"error": "", "torch": out, "ours": ours}
