"""ring-flash-attention's HF adapter on cp_attention (``cp_attention.compat.rfa_hf_adapter``): the names its callers
import, the flash-attention entry points it patches, a script written for it (Axolotl's pattern: patch, then
``update_ring_flash_attn_params`` per batch) equal to one process on gloo ranks, and the refusals, raised alike
on every rank (tests/support/hf/rfa_hf_cases.py)."""

from __future__ import annotations

import inspect
import sys

import pytest
import torch

from cp_attention.compat import rfa_hf_adapter
from tests.support.hf import rfa_hf_cases

pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")

# What the original's hf_adapter module offers (ring-flash-attention 0.1.8): callers import these names.
ORIGINAL_NAMES = ("DATA_PARAMS", "RING_ATTN_SWITCH", "check_params", "update_ring_flash_attn_params", "use_ring_attn",
                  "create_ring_flash_attention_forward", "flash_attention_forward", "substitute_hf_flash_attn")


def test_the_callers_imports_resolve_to_ours():
    with rfa_hf_cases.installed():
        import ring_flash_attn.adapters.hf_adapter as by_path
        from ring_flash_attn import substitute_hf_flash_attn, update_ring_flash_attn_params
        from ring_flash_attn.adapters import hf_adapter

        assert hf_adapter is by_path is rfa_hf_adapter
        assert substitute_hf_flash_attn is rfa_hf_adapter.substitute_hf_flash_attn
        assert update_ring_flash_attn_params is rfa_hf_adapter.update_ring_flash_attn_params
        assert all(hasattr(by_path, name) for name in ORIGINAL_NAMES)
    assert "ring_flash_attn.adapters" not in sys.modules or sys.modules["ring_flash_attn.adapters"] \
        is not rfa_hf_adapter


def test_signatures_are_the_originals():
    """Parameter names, order and defaults of the public functions, against ring-flash-attention's own source
    (read without importing it: its hf_adapter import fails on transformers 5)."""
    source = rfa_hf_cases.original_adapter_signatures()
    if source is None:
        pytest.skip("ring-flash-attn is not installed (pip install ring-flash-attn==0.1.8 --no-deps)")
    for name in ("check_params", "update_ring_flash_attn_params", "use_ring_attn",
                 "create_ring_flash_attention_forward", "flash_attention_forward", "substitute_hf_flash_attn"):
        theirs = source[name]
        ours = [(p.name, p.default) for p in inspect.signature(getattr(rfa_hf_adapter, name)).parameters.values()]
        assert ours == theirs, (name, ours, theirs)


def test_substitute_patches_transformers_and_the_switch_restores_it():
    import transformers.modeling_flash_attention_utils as fa_utils
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    before = fa_utils._flash_attention_forward
    seen = []
    with rfa_hf_cases.installed():
        fa_utils._flash_attention_forward = lambda *a, **k: seen.append("transformers")  # transformers' own
        rfa_hf_adapter.substitute_hf_flash_attn(None, 1)
        rfa_hf_adapter.substitute_hf_flash_attn(None, 1)  # twice: the switch still reaches transformers' own
        assert ALL_ATTENTION_FUNCTIONS["flash_attention_2"] is rfa_hf_adapter.flash_attention_forward
        rfa_hf_adapter.use_ring_attn(False)
        fa_utils._flash_attention_forward(None, None, None, None, 1, True)
        assert seen == ["transformers"]
        rfa_hf_adapter.use_ring_attn(True)
        with pytest.raises(ValueError, match="one packed row"):
            fa_utils._flash_attention_forward(torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8),
                                              torch.zeros(2, 4, 2, 8), None, 4, True)
        assert seen == ["transformers"]
    assert fa_utils._flash_attention_forward is before


def test_a_callers_own_flash_forward_is_the_one_that_runs():
    """The original's flash_attention_forward looks transformers' ``_flash_attention_forward`` up per call: callers
    (OpenRLHF-style adapters) swap in their own and rely on that."""
    import transformers.modeling_flash_attention_utils as fa_utils

    start = rfa_hf_cases.torch_cp_cases.build()
    model = rfa_hf_cases.build_flash(start)
    calls = []

    def theirs(q, k, v, attention_mask, query_length, is_causal, **kwargs):
        calls.append((tuple(q.shape), query_length, is_causal, kwargs["softmax_scale"]))
        return torch.zeros_like(q)

    with rfa_hf_cases.installed():
        rfa_hf_adapter.substitute_hf_flash_attn(None, 1)
        fa_utils._flash_attention_forward = theirs
        model(input_ids=torch.zeros(1, 8, dtype=torch.long), use_cache=False)
    assert calls == [((1, 8, 4, 8), 8, True, 8 ** -0.5)] * 2


@pytest.mark.slow
@pytest.mark.parametrize("world_size,kind,stride", [(2, "llama", 1), (4, "llama", 2), (2, "mistral", 1)])
def test_axolotl_pattern_script_equals_one_process(pools, world_size, kind, stride):
    """3 AdamW steps of a tiny fp32 Llama (GQA) on packed documents (lengths 5, 11, 7, 1, 8: cut anywhere by the
    contiguous slices), the script unchanged but for the attention name set after building (CPU has no FA2);
    a Mistral's 6-token sliding window counts as transformers' does (query i sees keys i - 6 < j <= i)."""
    results = pools(world_size).run(rfa_hf_cases.axolotl_pattern, kind=kind, heads_k_stride=stride, timeout=300)
    for rank, r in enumerate(results):
        assert r["moved"] >= 5e-5, f"rank {rank}: training did not move the weights ({r['moved']:.2e})"
        assert max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"])) <= 1e-6, (rank, r)
        assert r["params"] <= 1e-6, f"rank {rank}: parameters differ by {r['params']:.2e}"


@pytest.mark.parametrize("case,kind,pattern", [
    ("positions", "ValueError", r"position_ids must be this rank's contiguous slice .*rank 0 first"),
    ("documents", "ValueError", r"rank 0"),
    ("no_params", "RuntimeError", r"call update_ring_flash_attn_params\(cu_seqlens, process_group\)"),
    ("padding", "NotImplementedError", r"a padding attention_mask cannot be honoured"),
])
def test_refusals_are_raised_on_every_rank(pools, case, kind, pattern):
    """A flaw on rank 0 only (positions, documents) is raised on both ranks, not a hang."""
    import re

    for rank, error in enumerate(pools(2).run(rfa_hf_cases.refusal, case=case, timeout=120)):
        assert error.startswith(kind + ":") and re.search(pattern, error), (rank, error)
