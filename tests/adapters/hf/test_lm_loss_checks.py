"""``cphf.lm_loss``'s checks of what it cannot see in advance: hooks on the LM head (refused by name on
every rank), a head whose output differs from lm_loss's on the rows it compares (a random one besides
each sequence's last, drawn anew each call by a generator of its own), and a tensor
``num_items_in_batch`` that is zero, negative or not finite (refused in the one all-reduce, with no host
sync before it). Each is given on one of two loopback ranks; every rank must raise alike."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from tests.support.hf import lm_loss_cases  # noqa: E402


def _scale_rows(rows: str):
    """A forward hook's body: the head's output times 1.5 on every row, or on all but each sequence's last."""
    def scale(module, args, out):
        if rows == "all":
            return out * 1.5
        out = out.clone()
        out[:, :-1] *= 1.5
        return out

    return scale


def _on_two_ranks(replicas, call):
    """``call(model, local, group)`` on two loopback ranks, each with its replica: what each raised."""
    from cp_attention.integrations import huggingface as cphf

    full = lm_loss_cases.full_batch("plain")

    def step(group):
        try:
            call(replicas[group.rank], cphf.shard_batch(full, group=group), group)
        except (RuntimeError, ValueError) as e:  # NotImplementedError is a RuntimeError
            return e
        return None

    return step


@pytest.mark.parametrize("rows", ["all", "all but the last"])
def test_a_head_that_differs_from_the_models_logits_raises_on_every_rank(rows):
    """A global module hook (which lm_loss cannot see on the head) changes one rank's lm_head output, on
    every row or on all but each sequence's last: the model's logits differ from lm_loss's head on the
    rows it compares (a random one besides the last), and every rank raises after the one all-reduce."""
    import copy

    from torch.nn.modules.module import register_module_forward_hook

    from cp_attention.integrations import huggingface as cphf
    from cp_attention.transport.loopback import LoopbackGroup

    base = lm_loss_cases.model("llama")
    loop = LoopbackGroup(2)
    replicas = [cphf.apply_context_parallel(copy.deepcopy(base), group=loop.rank(r)) for r in range(2)]
    scale = _scale_rows(rows)
    handle = register_module_forward_hook(lambda m, a, out: scale(m, a, out) if m is replicas[1].lm_head else None)
    try:
        for _ in range(3):  # every call: the compared rows are drawn anew
            step = _on_two_ranks(replicas, lambda m, local, g: cphf.lm_loss(m, local, group=g))
            for rank, e in enumerate(loop.run(step)):
                assert isinstance(e, RuntimeError) and "differs from LlamaForCausalLM's own logits (on 1 rank(s))" \
                    in str(e), f"rank {rank}: {e!r}"
    finally:
        handle.remove()


def _hook(kind: str, rows: str = "all but the last"):
    """Puts one kind of hook on ``model.lm_head`` (its name: what the refusal must say)."""
    scale = _scale_rows(rows)

    def add(model):
        head = model.lm_head
        if kind == "forward hook":
            head.register_forward_hook(scale)
        elif kind == "forward pre-hook":
            head.register_forward_pre_hook(lambda module, args: (args[0] * 1.5,))
        elif kind == "backward hook":
            head.register_full_backward_hook(lambda module, grad_in, grad_out: (grad_in[0] * 2,))
        else:  # what accelerate's add_hook_to_module does
            plain = head.forward
            head.forward = lambda x: scale(head, (x,), plain(x))
    return add


@pytest.mark.parametrize("kind", ["forward hook", "forward pre-hook", "backward hook", "a forward replaced"])
def test_hooks_on_the_head_are_refused_by_name_on_every_rank(kind):
    """lm_loss applies the head itself, so hooks on it (a forward hook that changes only the rows lm_loss's
    cross-check did not compare, a pre-hook, a backward hook, a forward set on the instance) would be lost:
    refused, on every rank alike (one rank has them), named where they are. Without them: exact."""
    import copy

    from cp_attention.integrations import huggingface as cphf
    from cp_attention.transport.loopback import LoopbackGroup

    base = lm_loss_cases.model("llama")
    loop = LoopbackGroup(2)
    replicas = [cphf.apply_context_parallel(copy.deepcopy(base), group=loop.rank(r)) for r in range(2)]
    _hook(kind)(replicas[1])
    step = _on_two_ranks(replicas, lambda m, local, g: cphf.lm_loss(m, local, group=g).backward())
    errors = loop.run(step)
    for rank, e in enumerate(errors):
        assert isinstance(e, NotImplementedError), f"rank {rank}: {e!r}"
        assert "cannot run the hooks on LlamaForCausalLM's output embedding (Linear) on 1 rank(s)" in str(e), str(e)
        assert "Remove them" in str(e) and "causal_lm_loss(" in str(e)
    assert kind in str(errors[1]) and "here:" not in str(errors[0])


def test_the_compared_rows_cover_every_position_and_leave_the_callers_rng_alone():
    """The rows lm_loss compares: each call's last position and one drawn from the others, which over many
    calls reaches every position; drawn from lm_loss's own generator (the global RNG state is untouched),
    alike on every rank (a fresh generator draws the same sequence)."""
    import importlib

    module = importlib.import_module("cp_attention.integrations.huggingface.lm_loss")
    state = torch.get_rng_state()
    module._row_generators.clear()
    first = [module._rows_to_check(8, torch.device("cpu")).tolist() for _ in range(200)]
    module._row_generators.clear()
    again = [module._rows_to_check(8, torch.device("cpu")).tolist() for _ in range(200)]
    assert first == again and all(r[1] == 7 and 0 <= r[0] < 7 for r in first)
    assert {r[0] for r in first} == set(range(7))
    assert torch.equal(torch.get_rng_state(), state)
    assert module._rows_to_check(1, torch.device("cpu")).tolist() == [0]


@pytest.mark.parametrize("n", [torch.tensor(0), torch.tensor(0.0), torch.tensor(-4), torch.tensor(float("nan")),
                               torch.tensor(float("inf")), torch.tensor([float("-inf")])],
                         ids=["int0", "float0", "negative", "nan", "inf", "-inf"])
def test_a_tensor_count_that_is_not_positive_and_finite_is_refused_on_every_rank(n):
    """A tensor num_items_in_batch of 0, a negative count, NaN or inf (given on one rank; the other passes
    37) would make the loss inf, NaN or 0: refused on every rank alike with what was given, after the one
    all-reduce (a GPU tensor's value is not read on the host before it)."""
    import copy

    from cp_attention.integrations import huggingface as cphf
    from cp_attention.transport.loopback import LoopbackGroup

    base = lm_loss_cases.model("llama")
    loop = LoopbackGroup(2)
    replicas = [cphf.apply_context_parallel(copy.deepcopy(base), group=loop.rank(r)) for r in range(2)]
    counts = [torch.tensor(37), n]
    step = _on_two_ranks(replicas, lambda m, local, g: cphf.lm_loss(m, local, group=g,
                                                                        num_items_in_batch=counts[g.rank]))
    errors = loop.run(step)
    for rank, e in enumerate(errors):
        assert isinstance(e, ValueError), f"rank {rank}: {e!r}"
        assert "num_items_in_batch must be positive and finite" in str(e) and "on 1 rank(s)" in str(e), str(e)
        assert f"got {counts[rank]!r} here" in str(e), str(e)


def test_fsdp2s_own_hooks_on_the_head_are_not_refused(pools):
    """The hooks FSDP2 puts on a head it shards on its own are not the user's: lm_loss runs, exactly."""
    runs = pools(2).run(lm_loss_cases.fsdp_root_only, chunk_tokens=3, head_too=True, timeout=180)
    for rank, r in enumerate(runs):
        assert r["hooks"] >= 1, f"rank {rank}: FSDP2 put no forward hook on the head, the test cannot fail: {r}"
        assert r["loss"] < 1e-10 and r["grads"] < 1e-10, f"rank {rank}: {r}"
