"""Sliding windows in the Megatron adapter (issue 11): a windowed tiny GPTModel with CP equals the same model at
CP=1 running megatron's own attention with its own sliding-window mask, forward and gradients, fp64."""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("megatron.core", reason="needs the megatron extra: pip install -e '.[megatron]'")

import cp_attention as cpa  # noqa: E402
from tests.adapters.megatron.test_equivalence import PLAIN_LAYOUTS, _packed_references  # noqa: E402
from tests.support.megatron import megatron_cases as mc  # noqa: E402
from tests.support.megatron import megatron_packed_cases as mpc  # noqa: E402
from tests.support.megatron import megatron_window_cases as mwc  # noqa: E402

FP64 = 1e-10
FP32 = 2e-6  # megatron's own loss is computed in fp32
NO_WINDOW = (-1, -1)

# The tiny GPT has 2 layers and SEQ = 24 tokens: a local chunk is 12 tokens at CP 2 and 6 at CP 4
# (zigzag chunks 6 and 3). window_attn_skip_freq makes one layer global.
WINDOWS = {
    # window of 2 keys back, inside the smallest zigzag chunk; freq 2: layer 1 windowed, layer 2 global
    "in_chunk": (dict(window_size=(2, 0), window_attn_skip_freq=2), [(2, 0), NO_WINDOW]),
    # 13 keys back, spanning 2 (CP 2) to 3 (CP 4) ranks; megatron's list form: layer 2 windowed only
    "across_ranks": (dict(window_size=(13, 0), window_attn_skip_freq=[0, 1]), [NO_WINDOW, (13, 0)]),
}

_REFS: dict = {}


def _reference(pools, with_mask=False, **model_kw):
    """megatron's own attention (and window mask) at CP=1, computed once per model in a 1-rank worker."""
    key = repr((with_mask, sorted(model_kw.items())))
    if key not in _REFS:
        _REFS[key] = pools(1).run(mc.reference, model_kw=model_kw, with_mask=with_mask, timeout=180)[0]
    return _REFS[key]


def _run(pools, world_size, layout, ref, model_kw, **kw):
    return pools(world_size).run(mc.equivalence, layout=layout, ref=ref, model_kw=model_kw, timeout=180, **kw)


def _assert_equivalent(results, what, windows):
    for rank, r in enumerate(results):
        assert r["finite"] and r["unpatched"], (what, rank, r)
        assert r["windows"] == windows, f"{what}: rank {rank} layer windows {r['windows']} != {windows}"
        for key in ("logits", "loss", "grads"):
            assert r[key] <= FP64, f"{what}: rank {rank} {key} differs by {r[key]:.3e}"
        assert r["mcore_loss"] <= FP32, f"{what}: rank {rank} megatron's loss differs by {r['mcore_loss']:.3e}"


CASES = list(itertools.product((2, 4), PLAIN_LAYOUTS, sorted(WINDOWS)))


@pytest.mark.parametrize("world_size,layout,window", CASES, ids=[f"cp{w}-{lay}-{win}" for w, lay, win in CASES])
def test_windowed_gpt_matches_cp1(pools, world_size, layout, window):
    model_kw, layer_windows = WINDOWS[window]
    results = _run(pools, world_size, layout, _reference(pools, **model_kw), model_kw)
    _assert_equivalent(results, f"{window} {layout} cp={world_size}", layer_windows)


def test_windowed_gpt_with_learnable_sinks_matches_cp1(pools):
    """softmax_type='learnable' (megatron's SoftmaxOne with a learned offset) plus a window: the offset's
    gradient is among the compared gradients."""
    model_kw = dict(WINDOWS["in_chunk"][0], softmax_type="learnable")
    ref = _reference(pools, **model_kw)
    assert any(n.endswith("core_attention.softmax_offset") for n in ref["grads"]), sorted(ref["grads"])
    _assert_equivalent(_run(pools, 4, "interleaved", ref, model_kw), "learnable sinks", WINDOWS["in_chunk"][1])


def test_windowed_gpt_accepts_the_causal_attention_mask(pools):
    """A causal attention_mask (sharded by the layout) is accepted on windowed layers; the window applies on top."""
    model_kw, layer_windows = WINDOWS["across_ranks"]
    results = _run(pools, 2, "zigzag", _reference(pools, with_mask=True, **model_kw), model_kw, with_mask=True)
    _assert_equivalent(results, "causal mask", layer_windows)


@pytest.mark.parametrize("wrong", ([NO_WINDOW, NO_WINDOW], [(13, 0), (13, 0)], [(13, 0), NO_WINDOW]),
                         ids=("ignored", "every_layer", "skip_layer_swapped"))
def test_a_window_ignored_or_on_the_wrong_layers_is_detected(pools, wrong):
    model_kw = WINDOWS["across_ranks"][0]
    results = _run(pools, 2, "zigzag", _reference(pools, **model_kw), model_kw, ring_windows=wrong)
    for key in ("logits", "grads"):
        assert min(r[key] for r in results) > 1e4 * FP64, (key, [r[key] for r in results])


def test_minus_one_is_unbounded(pools):
    """window_size=(-1, 0) on a causal model is plain causal attention (flash-attn's and TransformerEngine's
    convention; megatron's local mask would read -1 otherwise, so the reference is the unwindowed model)."""
    model_kw = dict(window_size=(-1, 0))
    results = _run(pools, 2, "contiguous", _reference(pools), model_kw)
    _assert_equivalent(results, "(-1, 0)", [(-1, 0), (-1, 0)])


PACKED_WINDOW = dict(window_size=(3, 0), window_attn_skip_freq=2)
def test_packed_window_changes_the_reference(pools):
    """The packed documents (1, 5, 2, 9, 7 tokens) are longer than the window: it matters."""
    windowed, plain = _packed_references(pools, **PACKED_WINDOW), _packed_references(pools)
    for padded in (False, True):
        assert (windowed[padded]["logits"] - plain[padded]["logits"]).abs().max() > 1e-3, padded


PACKED_CASES = list(itertools.product((2, 4), cpa.LAYOUT_NAMES))


@pytest.mark.parametrize("world_size,layout", PACKED_CASES, ids=[f"cp{w}-{lay}" for w, lay in PACKED_CASES])
def test_packed_windowed_gpt_matches_each_document_alone(pools, world_size, layout):
    """THD packed batches (padded or not) with a window of 3 on layer 1: positions within documents."""
    results = pools(world_size).run(mpc.packed_equivalence, layout=layout,
                                    refs=_packed_references(pools, **PACKED_WINDOW), model_kw=PACKED_WINDOW,
                                    timeout=180)
    for rank, per_padding in enumerate(results):
        for padded, r in per_padding.items():
            what = f"{layout} cp={world_size} padded={padded} rank {rank}"
            assert r["finite"] and r["rope_in_ring"] and r["unpatched"], (what, r)
            for key in ("logits", "loss", "grads"):
                assert r[key] <= FP64, f"{what}: {key} differs by {r[key]:.3e}"


# (mask, the layer's window, megatron's window that is the reference). A causal layer keeps j <= i, as
# TransformerEngine forces right = 0 under causal masks; megatron's local mask would see `right` keys ahead.
CORE = {"no_mask": (False, (5, 3), (5, 3)), "causal": (True, (5, 3), (5, 0))}
CORE_CASES = list(itertools.product((2, 4), PLAIN_LAYOUTS, sorted(CORE)))
_CORE_REFS: dict = {}


@pytest.mark.parametrize("world_size,layout,mask", CORE_CASES, ids=[f"cp{w}-{lay}-{m}" for w, lay, m in CORE_CASES])
def test_two_sided_window_matches_megatrons_dot_product_attention(pools, world_size, layout, mask):
    causal, window, megatron_window = CORE[mask]
    if mask not in _CORE_REFS:
        _CORE_REFS[mask] = pools(1).run(mwc.megatron_window_reference, causal=causal, window=megatron_window,
                                        timeout=120)[0]
    for rank, r in enumerate(pools(world_size).run(mwc.window_core_attention, layout=layout, causal=causal,
                                                   window=window, ref=_CORE_REFS[mask], timeout=120)):
        assert r["window"] == window and r["finite"], (rank, r)
        assert r["out"] <= FP64 and r["grads"] <= FP64, (rank, r)
