"""Labels left in a sharded batch (``model(**shard_batch(batch_with_labels))``): the model's own loss is the
exact CP loss, the model without CP's loss on the full batch, on every rank; or refused by name on every
rank alike. And left-padded batches with HF's ``attention_mask.cumsum(-1) - 1`` position ids are exact.

Every rank runs as a thread of this process (the loopback ring), in fp64; the reference is transformers'
own model, unpatched, on the full batch with the same labels, mask and position ids.
"""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("transformers", reason="needs the hf extra")
import torch  # noqa: E402

from cp_attention.transport.loopback import LoopbackGroup  # noqa: E402
from tests.support.hf.hf_cases import SEQ, VOCAB, batch, build  # noqa: E402

FP64 = 1e-10


def _labels(ids: torch.Tensor) -> torch.Tensor:
    labels = ids.clone()
    labels[0, 3:6] = -100  # some tokens unlabelled: the mean must count the labelled ones of every rank
    return labels


def _run(world_size: int, family: str, full: dict, layout: str, forward=None) -> tuple[list, list]:
    """Each loopback rank's ``(loss, logits, error)`` of ``model(**shard_batch(full))`` after backward,
    and the replicas (for their gradients). ``forward(model, local)`` replaces the plain call."""
    from cp_attention.integrations import huggingface as cphf

    ref = build(family)
    loop = LoopbackGroup(world_size)
    replicas = [cphf.apply_context_parallel(copy.deepcopy(ref), group=loop.rank(r), layout=layout)
                for r in range(world_size)]

    def rank_fn(group):
        model = replicas[group.rank]
        local = cphf.shard_batch(full, group=group, layout=layout)
        try:
            out = forward(model, local) if forward else model(**local, use_cache=False)
        except (ValueError, NotImplementedError) as e:
            return None, None, f"{type(e).__name__}: {e}"
        out.loss.backward()
        return out.loss.detach(), out.logits.detach(), None

    return loop.run(rank_fn), replicas


def _reference(family: str, full: dict) -> tuple[torch.Tensor, list]:
    ref = build(family)
    out = ref(**full, use_cache=False)  # transformers' own loss (fp32 inside) and attention, no CP
    out.loss.backward()
    return out.loss.detach(), [p.grad for p in ref.parameters()]


def _grad_error(replicas, grads) -> float:
    return max((sum(m_params[i].grad for m_params in ([*m.parameters()] for m in replicas)) - g).abs().max().item()
               for i, g in enumerate(grads))


@pytest.mark.parametrize("family,layout,world_size", [("llama", "zigzag", 2), ("qwen2", "interleaved", 4),
                                                       ("gemma2", "contiguous", 2), ("gpt_oss", "zigzag", 2)])
def test_labels_left_in_the_sharded_batch_give_the_exact_loss(family, layout, world_size):
    ids = batch(seq=32)
    full = {"input_ids": ids, "labels": _labels(ids)}
    results, replicas = _run(world_size, family, full, layout)
    ref_loss, ref_grads = _reference(family, full)
    for rank, (loss, _, error) in enumerate(results):
        assert error is None, error
        # HF's loss upcasts the logits to fp32 (as the fp64 model's are not): the loss to fp32 rounding
        assert abs(loss.item() - ref_loss.item()) < 2e-6, (rank, loss.item(), ref_loss.item())
    assert len({r[0].item() for r in results}) == 1, "the same value on every rank"
    # the CP loss's gradients, summed over the ranks, are those of the loss without CP
    assert _grad_error(replicas, ref_grads) < 2e-6


def test_the_models_loss_equals_causal_lm_loss():
    """Bit for bit what causal_lm_loss(out.logits, local["shift_labels"], group) gives (fp64: no upcast)."""
    from cp_attention.integrations import huggingface as cphf

    ids = batch(seq=32)
    full = {"input_ids": ids, "labels": _labels(ids)}
    loop = LoopbackGroup(2)
    models = [cphf.apply_context_parallel(build("llama"), group=loop.rank(r)) for r in range(2)]

    def rank_fn(group):
        local = cphf.shard_batch(full, group=group)
        out = models[group.rank](**local, use_cache=False)
        return out.loss.item(), cphf.causal_lm_loss(out.logits, local["shift_labels"], group=group).item()

    for own, cp in loop.run(rank_fn):
        assert own == cp


@pytest.mark.parametrize("positions", ["cumsum", "filled"])
def test_left_padded_batch_with_hf_position_ids_is_exact(positions):
    """What HF's generate and many collators make: position_ids = attention_mask.cumsum(-1) - 1, the
    padding's -1 (or masked_fill_(mask == 0, 1)); with labels -100 at the padding."""
    ids = batch(size=3, seq=SEQ)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    mask[2, :2] = 0
    pos = mask.cumsum(-1) - 1
    if positions == "filled":
        pos.masked_fill_(mask == 0, 1)
    labels = ids.masked_fill(mask == 0, -100)
    full = {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "labels": labels}
    results, replicas = _run(2, "llama", full, "zigzag")
    # Without CP, HF shifts labels over the whole row, so a left-padded row's last padding token would be
    # scored on predicting the first real token; each row's real tokens are one document under CP, which
    # scores none: the reference's shift_labels leave those out (the rest is HF's own loss, unchanged).
    shift = torch.cat([labels[:, 1:], labels.new_full((3, 1), -100)], 1).masked_fill(mask == 0, -100)
    ref_loss, ref_grads = _reference("llama", {**full, "shift_labels": shift})
    for rank, (loss, _, error) in enumerate(results):
        assert error is None, error
        assert abs(loss.item() - ref_loss.item()) < 2e-6, (rank, loss.item(), ref_loss.item())
    assert _grad_error(replicas, ref_grads) < 2e-6


def test_labels_without_shift_labels_are_refused_on_every_rank():
    """Labels sharded by hand (shift_labels dropped) could only be shifted inside the shard."""
    ids = batch(seq=32)

    def forward(model, local):
        return model(input_ids=local["input_ids"], position_ids=local["position_ids"], labels=local["labels"])

    results, _ = _run(2, "llama", {"input_ids": ids, "labels": ids}, "zigzag", forward)
    errors = {r[2] for r in results}
    assert len(errors) == 1, errors
    assert errors.pop().startswith("ValueError: labels reached the context-parallel model without shift_labels")


def test_a_model_whose_loss_is_not_causal_lm_cross_entropy_is_refused():
    ids = batch(seq=32)

    def forward(model, local):
        model.loss_function = lambda logits, labels, vocab_size, **kwargs: logits.sum()  # noqa: ARG005
        from cp_attention.integrations import huggingface as cphf

        cphf.apply_context_parallel(model, group=model._cp_attention.group)  # patched again: wraps this loss
        return model(**local, use_cache=False)

    results, _ = _run(2, "llama", {"input_ids": ids, "labels": ids}, "zigzag", forward)
    for _, _, error in results:
        assert error.startswith("NotImplementedError: labels given to a context-parallel model whose loss is "
                                "<lambda>, not causal LM cross-entropy"), error


def test_model_inputs_path_is_unchanged():
    """Without labels the model computes no loss: out.loss is None, the adapter's documented path."""
    from cp_attention.integrations import huggingface as cphf

    ids = torch.randint(0, VOCAB, (1, 32), generator=torch.Generator().manual_seed(5))
    loop = LoopbackGroup(2)
    models = [cphf.apply_context_parallel(build("llama"), group=loop.rank(r)) for r in range(2)]

    def rank_fn(group):
        local = cphf.shard_batch({"input_ids": ids, "labels": ids}, group=group)
        return models[group.rank](**cphf.model_inputs(local), use_cache=False).loss

    assert loop.run(rank_fn) == [None, None]
