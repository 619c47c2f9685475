"""The HF adapter agrees each forward's data in one collective, and nothing per layer."""

from __future__ import annotations

import pytest

from tests.support.hf import hf_checks_cases as cases

pytest.importorskip("transformers")


@pytest.mark.parametrize("packed", [False, True])
def test_one_collective_per_forward(pools, packed):
    assert pools(2).run(cases.forward_collectives, packed=packed, timeout=120) == [[1, 1], [1, 1]]


def test_ranks_with_different_shapes_all_raise(pools):
    results = pools(2).run(cases.different_shapes, timeout=120)
    assert {kind for kind, _ in results} == {"ValueError"}
    assert results[0][1] == results[1][1] and "inputs of different shapes" in results[0][1]


@pytest.mark.parametrize("case,message", [
    ("bad_on_one_rank", "(on rank 1; ranks refused: [1])"),
    ("longer_on_one_rank", "shard_batch got different batches"),
    ("other_documents_on_one_rank", "shard_batch got different batches"),
])
def test_shard_batch_agrees_across_ranks(pools, case, message):
    results = pools(2).run(cases.shard_batch_outcome, case=case, timeout=120)
    assert len(set(results)) == 1 and results[0][0] == "ValueError" and message in results[0][1], results
