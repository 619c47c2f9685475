"""Issue 44: the HF adapter on every transformers version it claims (cp_attention/versions.py: FLOORS to TESTED).

transformers renamed what the adapter meets: the forwards' KV cache argument (``past_key_values`` before 5.24,
``cache`` from it), the mask interface's query description (``cache_position`` before 5.4, ``q_length``/
``q_offset`` from it) and the cache layers' ``get_mask_sizes`` argument with it. Each form is tested here
on every version (the interface is called directly where the installed transformers would not call it
so); the whole of tests/adapters/hf runs on the floor, 5.4, 5.17 and the newest (see the report of issue 44).
Below the floor, ``apply_context_parallel`` and ``parallelize`` refuse before touching anything."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from cp_attention import versions  # noqa: E402
from tests.support.hf.hf_cases import batch, build  # noqa: E402

OLD = "4.57.1"  # below every floor cp_attention's HF adapter has had


@pytest.mark.parametrize("name", ["past_key_values", "cache"])
def test_a_users_own_cache_given_to_a_forward_is_refused_by_name(name):
    """A cache holding tokens, given to a patched model's forward under either name (transformers 5.24's
    forwards take ``cache``; before, ``past_key_values``), is refused by the forward's check on every rank
    alike and before any layer runs: the cache gains nothing. (Once the check read ``past_key_values``
    only, and ``cache=`` reached the layers.)"""
    from cp_attention.integrations import huggingface as cphf
    from cp_attention.transport.loopback import LoopbackGroup

    loop = LoopbackGroup(2, timeout_s=30)
    ref = build("llama")
    replicas = [cphf.apply_context_parallel(copy.deepcopy(ref), group=loop.rank(r), layout="zigzag") for r in range(2)]
    ids = batch(size=1)

    def rank_fn(group):
        model = replicas[group.rank]
        local = cphf.model_inputs(cphf.shard_batch({"input_ids": ids}, group=group, layout="zigzag"))
        out = model(**local, use_cache=True)  # a cache of this rank's shard, as the forward fills it
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        held = cache.get_seq_length()
        try:
            model(**local, **{name: cache})
        except NotImplementedError as e:
            return str(e), held, cache.get_seq_length()
        return "", held, cache.get_seq_length()

    results = loop.run(rank_fn)
    messages = {message for message, _, _ in results}
    assert len(messages) == 1, results
    message = messages.pop()
    assert message.startswith(f"{name}= got a KV cache that holds tokens") and f"drop {name}=" in message, message
    assert message.endswith("(on rank 0; ranks refused: [0, 1])"), message
    assert all(held == after == ids.shape[1] // 2 for _, held, after in results), results


def test_the_mask_interface_takes_either_form_of_the_queries():
    """transformers 5.0-5.3 ask the mask interface with ``cache_position=`` ([q_length]: the queries' cache
    indices), 5.4 on with ``q_length=``/``q_offset=``: both forms get the same answer; neither or both is
    refused by name (a transformers the adapter does not know)."""
    from cp_attention.integrations.huggingface.masks import RingMask, ring_mask

    config = type("Config", (), {"attention_chunk_size": None})()
    for extra, want in (({}, None), ({"local_size": 3}, RingMask(True, 3)),
                        ({"allow_is_bidirectional_skip": False}, RingMask(False, None))):
        new = ring_mask(batch_size=2, q_length=5, kv_length=5, q_offset=0, kv_offset=0, config=config,
                        allow_is_causal_skip=True, dtype=torch.float64, **extra)
        old = ring_mask(batch_size=2, cache_position=torch.arange(5), kv_length=5, kv_offset=0, config=config,
                        allow_is_causal_skip=True, dtype=torch.float64, **extra)
        assert new == old == want, (extra, new, old)
    with pytest.raises(TypeError, match="neither q_length .* nor cache_position .*; expected exactly one"):
        ring_mask(batch_size=2, kv_length=5)
    with pytest.raises(TypeError, match="both q_length and cache_position; expected exactly one"):
        ring_mask(batch_size=2, q_length=5, cache_position=torch.arange(5), kv_length=5)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[0, 0] = False
    with pytest.raises(NotImplementedError, match="padding"):  # the old form is checked as the new one
        ring_mask(batch_size=2, cache_position=torch.arange(5), kv_length=5, attention_mask=mask)


def test_the_sharded_cache_sizes_the_mask_from_either_form():
    """transformers before 5.4 ask a cache layer's ``get_mask_sizes`` with the queries' ``cache_position``,
    5.4 on with their count: the same (kv length, offset) either way, the length read from the shape."""
    from cp_attention.integrations.huggingface.kvcache import sharded_cache

    layer = sharded_cache(1, lambda: True).layers[0]
    layer.start(torch.zeros(1, 4, dtype=torch.long), torch.arange(4)[None], 7)
    assert layer.get_mask_sizes(3) == layer.get_mask_sizes(torch.arange(7, 10)) == (10, 0)
    assert all(type(n) is int for n in layer.get_mask_sizes(torch.arange(7, 10)))


def _untouched(model: torch.nn.Module, impl: str) -> bool:
    return (model.config._attn_implementation == impl and "generate" not in vars(model)
            and not any(hasattr(m, "_cp_attention") or m._forward_pre_hooks or m._forward_hooks
                        for m in model.modules()))


def test_apply_context_parallel_refuses_an_old_transformers_first(monkeypatch):
    """Below the floor: a RuntimeError naming the installed version and the supported range, before the
    group is even read (a group that would fail to be read, or to communicate, is never touched) and
    with the model unchanged; the same for a world of one, which is otherwise returned untouched."""
    from cp_attention.integrations import huggingface as cphf
    from cp_attention.transport.loopback import LoopbackGroup

    monkeypatch.setattr(versions, "installed_version", lambda package: OLD if package == "transformers" else None)
    floor, tested = versions.FLOORS["transformers"], versions.TESTED["transformers"]
    expected = (rf"HuggingFace adapter \(apply_context_parallel\) needs transformers >= {floor} \(supported: "
                rf"{floor} to {tested} and newer\), but transformers {OLD} is installed")
    model = build("llama")
    impl = model.config._attn_implementation

    class Untouchable:  # any use of the group (its size, a collective) would raise something else
        def __getattr__(self, name):
            raise AssertionError(f"the group was used ({name}) before the version check")

    for group in (LoopbackGroup(2, timeout_s=5).rank(0), LoopbackGroup(1).rank(0), Untouchable()):
        with pytest.raises(RuntimeError, match=expected):
            cphf.apply_context_parallel(model, group=group, layout="zigzag")
        assert _untouched(model, impl)
    monkeypatch.setattr(versions, "installed_version", lambda package: versions.FLOORS[package])
    cphf.apply_context_parallel(model, group=LoopbackGroup(2).rank(0), layout="zigzag")  # the floor itself runs
    assert model.config._attn_implementation == cphf.ATTN_IMPLEMENTATION


def test_parallelize_refuses_an_old_transformers_first(monkeypatch):
    """``parallelize`` checks the version before its mesh (an object that is no mesh would be a TypeError)
    and before its one all-gather: the model is unchanged."""
    from cp_attention.integrations import huggingface as cphf

    monkeypatch.setattr(versions, "installed_version", lambda package: OLD if package == "transformers" else None)
    model = build("llama")
    impl = model.config._attn_implementation
    with pytest.raises(RuntimeError, match=rf"\(parallelize\) needs transformers >= .* but transformers {OLD} is"):
        cphf.parallelize(model, object(), layout="zigzag")
    assert _untouched(model, impl)
