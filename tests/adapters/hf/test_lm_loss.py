"""``cphf.lm_loss``: the LM head and loss over chunks of tokens equal ``causal_lm_loss`` on the full logits
(fp64, loss and every parameter's gradient within 1e-10), hold no more than a chunk of logits, and refuse
what they cannot do exactly."""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from tests.support.hf import lm_loss_cases  # noqa: E402

EXACT = 1e-10


def _check(r: dict, what: str) -> None:
    assert r["loss"] < EXACT, f"{what}: loss differs by {r['loss']:.2e}"
    assert r["grads"] < EXACT, f"{what}: a gradient differs by {r['grads']:.2e}"
    assert r["grad_scale"] > 1e-3, f"{what}: the gradients are (almost) zero: the test could not fail"
    assert len(set(r["losses"])) == 1, f"{what}: the ranks' loss values differ: {r['losses']}"


def _skip_unbuildable_phimoe() -> None:
    """transformers 5.4 declares ``PhimoeConfig.tie_word_embeddings: int = False``, which huggingface_hub's
    strict dataclass validation (newer than 1.8) refuses: not even the default config can be built."""
    import huggingface_hub
    import transformers as tf

    try:
        tf.PhimoeConfig()
    except Exception as e:  # noqa: BLE001 - whatever the installed pair raises, the family cannot be built
        pytest.skip(f"transformers {tf.__version__} with huggingface_hub {huggingface_hub.__version__} cannot build "
                    f"even a default PhimoeConfig ({type(e).__name__}: {str(e).splitlines()[0]})")


# Every family hf_cases builds (gemma2/gemma3 with a final softcap small enough to change the loss, and
# without one), Granite's logits_scaling, Cohere's logit_scale, PhiMoE's head bias, tied and untied embeddings.
FAMILIES = [
    ("llama", {}), ("llama", {"tie_word_embeddings": True}), ("llama_bidirectional", {}), ("qwen2", {}),
    ("mistral_window", {}), ("gemma2_softcap", {"final_logit_softcapping": 0.5}),
    ("gemma2", {"final_logit_softcapping": None}), ("gemma3_window", {"final_logit_softcapping": 0.7}),
    ("gpt_oss_window", {}), ("qwen3_window", {}), ("qwen2_moe_window", {"tie_word_embeddings": True}),
    ("granite", {}), ("cohere", {}), ("cohere", {"tie_word_embeddings": False}), ("phimoe", {}),
]


@pytest.mark.parametrize("family,overrides", FAMILIES, ids=[f + "".join(f"-{k}={v}" for k, v in o.items())
                                                          for f, o in FAMILIES])
def test_every_family_equals_the_full_logits_loss(family, overrides):
    if family == "phimoe":
        _skip_unbuildable_phimoe()
    seq = 32 if family.endswith("_window") else 16
    _check(lm_loss_cases.compare(2, family=family, seq=seq, chunk_tokens=5, **overrides), family)


# (world, batch mode, cp_comm_type, loopback mesh, layout, chunk_tokens): plain, labelled, padded and packed
# batches (position ids or the collator's cu_seq_lens), every cp_comm_type, chunks that do not divide a
# rank's tokens, that equal them, and that exceed them.
BATCHES = [
    (2, "plain", "p2p", None, "zigzag", 3),
    (2, "labels", "all_gather", None, "contiguous", 32),
    (2, "padded", "a2a", None, "zigzag", 5),
    (2, "packed", "p2p", None, "interleaved", 1000),
    (4, "plain", "a2a+p2p", (2, 2), "zigzag", 7),
    (4, "padded", "p2p", None, "contiguous", 1),
    (4, "packed", "all_gather", None, "zigzag", 3),
    (4, "collator", "a2a+p2p", (2, 2), "zigzag", 5),
    (4, "labels", "a2a", None, "interleaved", 6),
]


@pytest.mark.parametrize("world,mode,comm,mesh,layout,chunk", BATCHES,
                         ids=[f"{w}-{m}-{c}-{lay}-chunk{k}" for w, m, c, _, lay, k in BATCHES])
def test_batches_strategies_and_chunks_equal_the_full_logits_loss(world, mode, comm, mesh, layout, chunk):
    r = lm_loss_cases.compare(world, mode=mode, cp_comm_type=comm, mesh_shape=mesh, layout=layout, chunk_tokens=chunk,
                              seq=32)
    _check(r, f"{world} ranks, {mode}, {comm}, chunks of {chunk}")


@pytest.mark.parametrize("world,mode,n", [(1, "plain", 37), (1, "packed", 37), (2, "labels", torch.tensor(37)),
                                          (4, "padded", 37.5)])
def test_num_items_in_batch_divides_the_groups_sum(world, mode, n):
    """The value is the group's cross-entropy sum over n (an int, a tensor as the Trainer passes, a float),
    the gradient this rank's sum over n; world 1: the unpatched model with group=None."""
    r = lm_loss_cases.compare(world, mode=mode, chunk_tokens=4, num_items_in_batch=n, seq=32)
    _check(r, f"num_items_in_batch on {world} ranks, {mode}")
    plain = lm_loss_cases.compare(world, mode=mode, chunk_tokens=4, seq=32)
    assert abs(r["losses"][0] - plain["losses"][0]) > 1e-3, "num_items_in_batch changed nothing"


def test_an_unpatched_model_without_a_group():
    _check(lm_loss_cases.compare(1, mode="labels", chunk_tokens=5), "world 1, group=None")


@pytest.mark.parametrize("family,overrides", [("llama", {}), ("gemma2_softcap", {"final_logit_softcapping": 0.5})])
def test_under_bf16_autocast_close_to_the_full_logits_loss(family, overrides):
    """An fp32 model under bf16 autocast: lm_loss's head matches the model's own rows bit for bit (or it
    would raise), its backward sums bf16 chunk gradients into fp32 ones, and values agree at bf16 precision."""
    r = lm_loss_cases.autocast_compare(family, **overrides)
    assert r["dtypes"] == (torch.float32, torch.float32), r
    assert r["loss"] < 1e-5 and r["grads_rel"] < 2e-2, r


@pytest.mark.parametrize("chunk", [5, 32])
def test_no_tensor_holds_more_than_a_chunk_of_logits(chunk):
    """Every vocab-sized tensor an op creates, in the loss's forward and in its backward, has at most
    chunk_tokens rows (the model's own logits: one row per sequence); the full logits' loss has more."""
    got = lm_loss_cases.vocab_rows(chunk)
    full = lm_loss_cases.vocab_rows(None)
    assert got["grads"] and got["tokens"] == 64
    assert got["forward"] <= chunk and got["backward"] <= chunk, got
    assert got["forward"] == got["backward"] == min(chunk, 64), got  # the chunks are what was counted
    assert full["forward"] == full["backward"] == 64 > chunk or chunk >= 64, full


def test_with_fsdp2_over_a_mesh_equals_the_full_logits_loss(pools):
    results = pools(2).run(lm_loss_cases.fsdp_equivalence, chunk_tokens=3, mode="padded", timeout=180)
    for rank, r in enumerate(results):
        assert r["loss"] < EXACT and r["grads"] < EXACT, f"rank {rank}: {r}"
        assert r["grad_scale"] > 0 and r["value"] == results[0]["value"], f"rank {rank}: {r}"


def test_with_fsdp2_on_the_root_alone_the_gradients_are_reduced(pools):
    """fully_shard on the root only: its gradients reach the shards through the hooks on the model's output
    logits, which lm_loss runs (with no gradient) though it computes the loss from the hidden states."""
    for rank, r in enumerate(pools(2).run(lm_loss_cases.fsdp_root_only, chunk_tokens=3, timeout=180)):
        assert r["sharded"], f"rank {rank}: the gradients never reached FSDP2's reduce-scatter: {r}"
        assert r["loss"] < EXACT and r["grads"] < EXACT, f"rank {rank}: {r}"


# What each kind of HEAD_TRANSFORMS does after ``logits = self.lm_head(...)``: the source lines of every
# listed class's forward, from the decoder call to ``loss = None``, must be these. How the forward keeps
# the ``logits_to_keep`` rows: newer transformers call their helper ``slice_logits_to_keep``; older ones
# (5.4) slice inline. Both keep ``hidden_states[:, rows, :]`` for the 1-D tensor of rows lm_loss passes.
_SLICING = {
    "helper": ("hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)",
               "logits = self.lm_head(hidden_states)"),
    "inline": ("slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep",
               "logits = self.lm_head(hidden_states[:, slice_indices, :])"),
}
_AFTER = {
    "none": (),
    "final_logit_softcapping": ("if self.config.final_logit_softcapping is not None:",
                                "logits = logits / self.config.final_logit_softcapping", "logits = torch.tanh(logits)",
                                "logits = logits * self.config.final_logit_softcapping"),
    "divide_by_logits_scaling": ("logits = logits / self.config.logits_scaling",),
    "times_logit_scale": ("logits = logits * self.logit_scale",),
}


def _head_lines(cls) -> tuple[str, tuple[str, ...]]:
    lines = [line.split("  #")[0].strip() for line in inspect.getsource(cls.forward).splitlines()]
    lines = [line for line in lines if line and not line.startswith("#")]
    call = next(i for i, line in enumerate(lines) if line.startswith("outputs") and "= self." in line)
    end = next(i for i, line in enumerate(lines) if line == "loss = None")
    closing = next(i for i in range(call, end) if lines[i] == ")")
    return lines[call], tuple(lines[closing + 1:end])


# Families every supported transformers has: the source check below cannot pass by finding none.
_KNOWN_EVERYWHERE = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Gemma2ForCausalLM",
                     "GraniteForCausalLM", "CohereForCausalLM")


def _installed_slicing() -> str:
    import transformers.modeling_utils as mu

    return "helper" if hasattr(mu, "slice_logits_to_keep") else "inline"


@pytest.mark.parametrize("slicing", sorted(_SLICING))
def test_every_known_class_applies_its_head_as_lm_loss_does(slicing):
    """Each listed class (that the installed transformers has) slices its rows as that version does and
    applies the head and its kind's transform as lm_loss does; the other version's slicing is skipped."""
    import transformers as tf

    from cp_attention.integrations.huggingface.lm_loss import HEAD_TRANSFORMS

    if slicing != _installed_slicing():
        pytest.skip(f"transformers {tf.__version__} slices logits_to_keep with its {_installed_slicing()} form, not "
                    f"the {slicing} one (slice_logits_to_keep is in newer versions only)")
    checked = 0
    for kind, names in HEAD_TRANSFORMS.items():
        for name in names:
            if not hasattr(tf, name):  # an older transformers without the family: head_kind never sees it
                continue
            call, lines = _head_lines(getattr(tf, name))
            assert "= self.model(" in call, f"{name}: the decoder is not self.model: {call}"
            want = ("hidden_states = outputs.last_hidden_state",) + _SLICING[slicing] + _AFTER[kind]
            assert lines == want, f"{name} ({kind}) applies its head otherwise: {lines}"
            checked += 1
    assert checked >= len(_KNOWN_EVERYWHERE), checked


def test_slice_logits_to_keep_keeps_the_rows_lm_loss_asks_for():
    """Newer transformers' helper keeps ``hidden[:, rows, :]`` for lm_loss's 1-D tensor of rows (and the
    last row for an int 1), what the inline slicing of older versions does."""
    import transformers
    import transformers.modeling_utils as mu

    if not hasattr(mu, "slice_logits_to_keep"):
        pytest.skip(f"transformers {transformers.__version__} has no slice_logits_to_keep (newer versions only); "
                    "its classes slice inline, which test_every_known_class_applies_its_head_as_lm_loss_does[inline] "
                    "checks")
    hidden = torch.randn(3, 7, 4)
    rows = torch.tensor([2, 6])
    assert torch.equal(mu.slice_logits_to_keep(hidden, rows), hidden[:, rows, :])
    assert torch.equal(mu.slice_logits_to_keep(hidden, 1), hidden[:, -1:, :])


def _llama_subclass():
    import transformers as tf

    class ScaledLlamaForCausalLM(tf.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    return ScaledLlamaForCausalLM


def test_a_head_lm_loss_does_not_know_is_refused_by_name_before_any_communication():
    import copy

    import transformers as tf

    from cp_attention.integrations import huggingface as cphf
    from cp_attention.transport.loopback import LoopbackGroup

    base = lm_loss_cases.model("llama")
    ids = lm_loss_cases.full_batch("plain")["input_ids"]
    scaled = _llama_subclass()(base.config)
    gpt2 = tf.AutoModelForCausalLM.from_config(tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2))
    odd_head = copy.deepcopy(base)
    odd_head.lm_head = torch.nn.Sequential(odd_head.lm_head)
    loop = LoopbackGroup(2, timeout_s=2.0)  # a collective would time out: only rank 0 calls
    cases = [(scaled, "ScaledLlamaForCausalLM", "its forward overrides LlamaForCausalLM's"),
             (gpt2, "GPT2LMHeadModel", "not a class lm_loss knows"),
             (odd_head, "Sequential", "plain torch.nn.Linear")]
    for m, name, why in cases:
        local = {"input_ids": ids[:, :8], "position_ids": torch.arange(8).expand(2, 8),
                 "shift_labels": ids[:, 1:9]}
        with pytest.raises(NotImplementedError, match=name) as info:
            cphf.lm_loss(m, local, group=loop.rank(0))
        assert why in str(info.value)


@pytest.mark.parametrize("kwargs,match", [
    (dict(chunk_tokens=0), "chunk_tokens must be a positive int"),
    (dict(chunk_tokens=2.0), "chunk_tokens must be a positive int"),
    (dict(chunk_tokens=True), "chunk_tokens must be a positive int"),
    (dict(num_items_in_batch=0), "num_items_in_batch must be a positive number"),
    (dict(num_items_in_batch=True), "num_items_in_batch must be a positive number"),
    (dict(num_items_in_batch=float("inf")), r"num_items_in_batch must be a positive number .* got inf"),
    (dict(num_items_in_batch=float("nan")), r"num_items_in_batch must be a positive number .* got nan"),
    (dict(num_items_in_batch=torch.ones(2)), "one-element real tensor"),
    (dict(drop="shift_labels"), "local must hold 'shift_labels'"),
    (dict(add={"logits_to_keep": 1}), "lm_loss sets it itself"),
    (dict(add={"shift_labels": torch.zeros(2, 5, dtype=torch.long)}), r"do not fit the inputs \(2, 16\)"),
])
def test_bad_arguments_are_refused(kwargs, match):
    from cp_attention.integrations import huggingface as cphf

    m = lm_loss_cases.model("llama")
    local = cphf.shard_batch(lm_loss_cases.full_batch("plain"))
    local.pop(kwargs.pop("drop", None), None)
    local.update(kwargs.pop("add", {}))
    with pytest.raises(ValueError, match=match):
        cphf.lm_loss(m, local, **kwargs)
