"""Memory savers (``cphf.save_memory``) on CP-patched HF models, every rank in one process (the loopback
transport): the loss and the rank-summed gradients of one training step, to compare with the same CP
model without savers."""

from __future__ import annotations

import contextlib
import copy
import threading

import torch

from cp_attention.memory import offload
from cp_attention.transport.loopback import LoopbackGroup

from .hf_cases import SEQ, WINDOW_SEQ, _documents_batch, batch

BATCHES = ("plain", "padded", "packed")


def make_batch(kind: str, family: str) -> dict:
    """A plain batch (2 rows), a right-padded one (3 rows of 13, 5 and 17 real tokens) or a packed one (2
    rows of 4 documents, position ids restarting at each)."""
    if kind == "plain":
        return {"input_ids": batch(seq=WINDOW_SEQ if family.endswith("_window") else 2 * SEQ)}
    mode = {"padded": "padded_right", "packed": "packed_positions"}[kind]
    return _documents_batch(mode)[0]


class _Counts:
    """What the savers did, counted across the ranks (threads): layer runs, MLP-inner runs, stashes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.n = {"attention": 0, "mlp_inner": 0, "stashed": 0, "restored": 0, "stashed_on_cpu": 0}

    def add(self, key: str) -> None:
        with self.lock:
            self.n[key] += 1


@contextlib.contextmanager
def _counted_stashes(counts: _Counts):
    """``offload.HostStash`` replaced by a subclass that counts its copies out and back."""
    class Counted(offload.HostStash):
        def __init__(self, tensor):
            super().__init__(tensor)
            counts.add("stashed")
            if self.host.device.type == "cpu":
                counts.add("stashed_on_cpu")

        def restore(self):
            counts.add("restored")
            return super().restore()

    original = offload.HostStash
    offload.HostStash = Counted
    try:
        yield
    finally:
        offload.HostStash = original


def _instrument(model: torch.nn.Module, counts: _Counts) -> None:
    """Count every run of a decoder layer's attention (twice per step under checkpointing) and of the
    first submodule of its MLP (once per chunk, and again in backward, under mlp_chunks)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    for layer in model.modules():
        if isinstance(layer, GradientCheckpointingLayer):
            layer.self_attn.register_forward_pre_hook(lambda *_: counts.add("attention"))
            first = next(iter(layer.mlp.children()))
            first.register_forward_pre_hook(lambda *_: counts.add("mlp_inner"))


def cp_step(model_ref, world: int, full: dict, savers: dict | None, *, layout: str = "zigzag",
            cp_comm_type: str = "p2p", mesh_shape=None, loss: str = "causal_lm_loss") -> dict:
    """One forward and backward of ``world`` CP replicas of ``model_ref`` (deep copies, patched with
    ``apply_context_parallel``, then ``save_memory(**savers)`` unless ``savers`` is None) on ``full``:
    ``{"loss": [per rank], "grads": [rank-summed gradient per parameter, fp64], "counts": {...}}`` (counts:
    see :class:`_Counts`, :func:`_instrument`; ``layers``: decoder layers per model). ``loss``:
    ``"causal_lm_loss"`` (on the full logits) or ``"lm_loss"`` (the chunked head)."""
    from cp_attention.integrations import huggingface as cphf

    loop = LoopbackGroup(world, mesh_shape=mesh_shape)
    counts = _Counts()
    replicas = []
    for r in range(world):
        m = cphf.apply_context_parallel(copy.deepcopy(model_ref), group=loop.rank(r), layout=layout,
                                        cp_comm_type=cp_comm_type)
        if savers is not None:
            cphf.save_memory(m, **savers)
        m.train()
        m.zero_grad(set_to_none=True)
        _instrument(m, counts)
        replicas.append(m)

    def rank_fn(group):
        model = replicas[group.rank]
        local = cphf.shard_batch(full, group=group, layout=layout)
        if loss == "lm_loss":
            value = cphf.lm_loss(model, local, group=group, chunk_tokens=5)
        else:
            out = model(**cphf.model_inputs(local), use_cache=False)
            value = cphf.causal_lm_loss(out.logits, local["shift_labels"], group=group)
        value.backward()
        return value.detach()

    with _counted_stashes(counts):
        losses = loop.run(rank_fn)
    params = [list(m.parameters()) for m in replicas]
    grads = [sum(ps[i].grad.double() for ps in params if ps[i].grad is not None) for i in range(len(params[0]))]
    layers = sum(1 for m in model_ref.modules() if hasattr(m, "self_attn") and hasattr(m, "mlp"))
    return {"loss": [v.item() for v in losses], "grads": grads, "counts": dict(counts.n, layers=layers)}


def difference(a: dict, b: dict) -> float:
    """The largest difference of two :func:`cp_step` results: every rank's loss, every summed gradient."""
    losses = max(abs(x - y) for x, y in zip(a["loss"], b["loss"]))
    return max([losses] + [(g - h).abs().max().item() for g, h in zip(a["grads"], b["grads"])])
