"""Cases for ``cphf.lm_loss`` (tests/adapters/hf/test_lm_loss.py): the chunked LM head and loss against
``causal_lm_loss`` on the full logits of an identical replica, on loopback ranks, one process, or FSDP2
over gloo; and the vocab-sized tensors each creates."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cp_attention.transport.loopback import LoopbackGroup

from .hf_cases import SEQ, VOCAB, batch, build

_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2)


def model(family: str, **overrides):
    """A tiny fp64 causal LM: :func:`.hf_cases.build`'s families, plus ``granite`` (``logits_scaling`` 3),
    ``cohere`` (``logit_scale`` 0.3) and ``phimoe`` (a bias on the LM head), which hf_cases does not build."""
    import transformers as tf

    if family not in ("granite", "cohere", "phimoe"):
        return build(family, **overrides)
    torch.manual_seed(0)
    if family == "granite":
        cfg = tf.GraniteConfig(**_COMMON, logits_scaling=3.0)
    elif family == "cohere":
        cfg = tf.CohereConfig(**_COMMON, logit_scale=0.3, eos_token_id=None)
    else:  # eager experts: grouped_mm has no fp64
        cfg = tf.PhimoeConfig(**_COMMON, num_local_experts=4, num_experts_per_tok=2, lm_head_bias=True,
                              experts_implementation="eager")
    for k, v in overrides.items():
        setattr(cfg, k, v)
    m = tf.AutoModelForCausalLM.from_config(cfg).double()
    return m.eval() if family == "phimoe" else m  # PhiMoE's router samples in training mode


def full_batch(mode: str, seq: int = SEQ) -> dict:
    """A batch of full sequences: ``plain``, ``labels`` (a prompt span labelled -100), ``padded`` (rows
    padded left and right), ``packed`` (position ids restarting) or ``collator`` (one row, cu_seq_lens)."""
    ids = batch(seq=seq)
    if mode == "plain":
        return {"input_ids": ids}
    if mode == "labels":
        labels = ids.clone()
        labels[0, : seq // 2 + 1] = -100
        return {"input_ids": ids, "labels": labels}
    if mode == "padded":
        mask = torch.ones_like(ids)
        mask[0, seq - 5:] = 0
        mask[1, :3] = 0
        return {"input_ids": ids, "attention_mask": mask}
    if mode == "packed":
        lengths = [[3, seq - 10, 7], [1, seq - 1]]
        return {"input_ids": ids, "position_ids": torch.stack([torch.cat([torch.arange(n) for n in row])
                                                               for row in lengths])}
    if mode == "collator":
        cu = torch.tensor([0, 5, 6, seq - 4, seq], dtype=torch.int32)
        longest = int((cu[1:] - cu[:-1]).max())
        pos = torch.cat([torch.arange(int(b - a)) for a, b in zip(cu[:-1], cu[1:])])[None]
        return {"input_ids": ids[:1], "position_ids": pos, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
                "max_length_q": longest, "max_length_k": longest}
    raise ValueError(mode)


def _grad_diff(a: torch.nn.Module, b: torch.nn.Module) -> tuple[float, float]:
    """Largest |difference| of two replicas' parameter gradients (None must match None), and the
    largest gradient (so a test can see the gradients are not all zero)."""
    diff, scale = 0.0, 0.0
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        if (p.grad is None) != (q.grad is None):
            raise AssertionError(f"{name}: gradient given by one loss only")
        if p.grad is not None:
            diff = max(diff, (p.grad - q.grad).abs().max().item())
            scale = max(scale, p.grad.abs().max().item())
    return diff, scale


def compare(world_size: int, *, family: str = "llama", mode: str = "plain", layout: str = "zigzag",
            cp_comm_type: str = "p2p", mesh_shape: tuple[int, int] | None = None, chunk_tokens: int = 5,
            num_items_in_batch: int | float | torch.Tensor | None = None, seq: int = SEQ, **overrides: Any) -> dict:
    """``lm_loss`` against ``causal_lm_loss(model(**model_inputs(local)).logits, ...)`` on identical
    replicas patched over ``world_size`` loopback ranks (1: the unpatched model, ``group=None``).

    With ``num_items_in_batch=n`` the reference is the full logits' loss times the global label count
    over n (its gradient is then this rank's cross-entropy sum over n). Returns the largest loss and
    per-rank gradient differences, the largest gradient, the losses and the per-rank token counts."""
    from cp_attention.integrations import huggingface as cphf

    base = model(family, **overrides)
    full = full_batch(mode, seq)
    loop = LoopbackGroup(world_size, mesh_shape=mesh_shape) if world_size > 1 else None
    pairs = [[cphf.apply_context_parallel(copy.deepcopy(base), group=None if loop is None else loop.rank(r),
                                          layout=layout, cp_comm_type=cp_comm_type) for _ in range(2)]
             for r in range(world_size)]

    def step(group, rank: int) -> dict:
        ref, mine = pairs[rank]
        local = cphf.shard_batch(full, group=group, layout=layout)
        logits = ref(**cphf.model_inputs(local), use_cache=False).logits
        want = cphf.causal_lm_loss(logits, local["shift_labels"], group=group)
        if num_items_in_batch is not None:
            count = (local["shift_labels"] != -100).sum().double().reshape(1)
            if group is not None:
                group.all_reduce_sum_(count)
            want = want * count[0] / num_items_in_batch
        want.backward()
        got = cphf.lm_loss(mine, local, group=group, chunk_tokens=chunk_tokens, num_items_in_batch=num_items_in_batch)
        got.backward()
        return {"want": want.item(), "got": got.item(), "tokens": local["shift_labels"].numel()}

    results = [step(None, 0)] if loop is None else loop.run(lambda g: step(g, g.rank))
    grads = [_grad_diff(ref, mine) for ref, mine in pairs]
    return {"loss": max(abs(r["want"] - r["got"]) for r in results), "grads": max(g for g, _ in grads),
            "grad_scale": min(s for _, s in grads), "losses": [r["got"] for r in results],
            "tokens": [r["tokens"] for r in results]}


def autocast_compare(family: str, **overrides: Any) -> dict:
    """An fp32 model under CPU bf16 autocast, one process: ``lm_loss`` against ``causal_lm_loss`` on the
    full logits; the loss difference, the largest gradient difference relative to that parameter's
    largest gradient, and the losses' and gradients' dtypes."""
    from cp_attention.integrations import huggingface as cphf

    base = model(family, **overrides).float()
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    local = cphf.shard_batch(full_batch("labels", 32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = cphf.causal_lm_loss(ref(**cphf.model_inputs(local), use_cache=False).logits, local["shift_labels"])
        got = cphf.lm_loss(mine, local, chunk_tokens=5)
    want.backward()
    got.backward()
    rel = max(((p.grad - q.grad).abs().max() / p.grad.abs().max()).item()
              for p, q in zip(ref.parameters(), mine.parameters()))
    return {"loss": abs(want.item() - got.item()), "grads_rel": rel,
            "dtypes": (got.dtype, mine.lm_head.weight.grad.dtype)}


class VocabRows(TorchDispatchMode):
    """Records, for every op's non-view output whose last dim is ``vocab``, its rows (numel / vocab)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.rows = vocab, [0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == self.vocab:
                    self.rows.append(t.numel() // self.vocab)
        return out


def vocab_rows(chunk_tokens: int | None, vocab: int = 97, mode: str = "plain", seq: int = 32) -> dict:
    """The most rows of any vocab-sized tensor created in the loss's forward and in its backward, for
    ``lm_loss`` over ``chunk_tokens`` (None: ``causal_lm_loss`` on the full logits), one process. The
    vocab (97) is no other dim of the model, so only logits-like tensors are counted."""
    from cp_attention.integrations import huggingface as cphf

    m = model("llama", vocab_size=vocab)
    local = cphf.shard_batch(full_batch(mode, seq))
    forward, backward = VocabRows(vocab), VocabRows(vocab)
    with forward:
        if chunk_tokens is None:
            loss = cphf.causal_lm_loss(m(**cphf.model_inputs(local), use_cache=False).logits, local["shift_labels"])
        else:
            loss = cphf.lm_loss(m, local, chunk_tokens=chunk_tokens)
    with backward:
        loss.backward()
    return {"forward": max(forward.rows), "backward": max(backward.rows), "tokens": local["shift_labels"].numel(),
            "grads": all(p.grad is not None for p in m.parameters())}


def fsdp_equivalence(rank: int, world_size: int, *, chunk_tokens: int, mode: str) -> dict:
    """In a gloo worker: ``parallelize`` over a (1, world) mesh, two replicas; ``lm_loss(model, local,
    group=mesh)`` against ``causal_lm_loss`` on the full logits: the loss and every full gradient."""
    from torch.distributed.device_mesh import init_device_mesh

    from cp_attention.integrations import huggingface as cphf

    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "cp"))
    base = model("llama")
    ref = cphf.parallelize(copy.deepcopy(base), mesh)
    mine = cphf.parallelize(copy.deepcopy(base), mesh)
    local = cphf.shard_batch(full_batch(mode), group=mesh)
    want = cphf.causal_lm_loss(ref(**cphf.model_inputs(local)).logits, local["shift_labels"], group=mesh)
    want.backward()
    got = cphf.lm_loss(mine, local, group=mesh, chunk_tokens=chunk_tokens)
    got.backward()
    diff, scale = 0.0, float("inf")
    for (_name, p), q in zip(ref.named_parameters(), mine.parameters()):
        a, b = p.grad.full_tensor(), q.grad.full_tensor()
        diff, scale = max(diff, (a - b).abs().max().item()), min(scale, a.abs().max().item())
    return {"loss": abs(want.item() - got.item()), "grads": diff, "grad_scale": scale, "value": got.item()}


def fsdp_root_only(rank: int, world_size: int, *, chunk_tokens: int, head_too: bool = False) -> dict:
    """In a gloo worker: plain data parallelism with ``fully_shard`` on the root module alone (no CP, each
    rank its own row, the loss's mean over the world, ``group=None``). Its gradients reach the shards only
    through the hooks on the model's output (FSDP2's root post-backward), which lm_loss must run though it
    never uses those logits. ``head_too``: ``fully_shard`` on the LM head first as well
    (``reshard_after_forward=False``: its full weight stays after the forward), so the head carries FSDP2's
    own hooks, which only gather and free its parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from cp_attention.integrations import huggingface as cphf

    mesh = init_device_mesh("cpu", (world_size,))
    base = model("llama")
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    for m in (ref, mine):
        if head_too:
            fully_shard(m.lm_head, mesh=mesh, reshard_after_forward=False)
        fully_shard(m, mesh=mesh)
    ids = batch(size=world_size)[rank:rank + 1]  # this rank's row, whole (no CP); the loss's mean spans the world
    local = {"input_ids": ids, "position_ids": torch.arange(ids.shape[1])[None],
             "shift_labels": torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1)}
    want = cphf.causal_lm_loss(ref(**cphf.model_inputs(local)).logits, local["shift_labels"])
    want.backward()
    got = cphf.lm_loss(mine, local, chunk_tokens=chunk_tokens)
    got.backward()
    sharded = all(type(q.grad).__name__ == "DTensor" for q in mine.parameters())
    diff = max((p.grad.full_tensor() - q.grad.full_tensor()).abs().max().item() if sharded else float("inf")
               for p, q in zip(ref.parameters(), mine.parameters()))
    return {"loss": abs(want.item() - got.item()), "grads": diff, "sharded": sharded,
            "hooks": len(mine.lm_head._forward_hooks)}
