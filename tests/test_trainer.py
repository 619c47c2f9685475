"""``cphf.context_parallel_trainer``: transformers' Trainer and TRL's SFTTrainer with context parallelism
on dp x cp gloo ranks equal the plain Trainer in one process on the same global batch."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")

from . import trainer_cases  # noqa: E402

FP32 = 1e-6  # relative: transformers' loss runs in fp32 (the models are fp64)

# (kind, family, layout, dp, cp, per-device batch of the CP run, gradient accumulation)
CASES = [
    ("trainer", "llama", "zigzag", 1, 2, 2, 2),
    ("trainer", "mistral_window", "interleaved", 2, 2, 1, 1),
    ("trainer", "gpt_oss", "contiguous", 1, 2, 2, 1),  # sinks (GPT-OSS's own attention cannot pack: no reference)
    ("flatten", "llama", "contiguous", 2, 2, 1, 2),  # DataCollatorWithFlattening: packed documents
    ("sft", "qwen2", "zigzag", 1, 2, 2, 1),  # SFTTrainer, packing (bfd, padding-free)
]


def _id(case) -> str:
    kind, family, layout, dp, cp, batch, accum = case
    return f"{kind}-{family}-{layout}-{dp}x{cp}-b{batch}-ga{accum}"


def _relative(a, b) -> float:
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)).item() for k in b)


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_weights_equal_one_process_on_the_global_batch(pools, case):
    kind, family, layout, dp, cp, batch, accum = case
    pytest.importorskip("accelerate", reason="needs the trainer extra: pip install -e '.[trainer]'")
    if kind == "sft":
        pytest.importorskip("trl", reason="needs the trainer extra: pip install -e '.[trainer]'")
    common = dict(kind=kind, family=family, layout=layout, accum=accum, timeout=300)
    ref = pools(1).run(trainer_cases.train, cp=1, batch=batch * dp, **common)[0]
    got = pools(dp * cp).run(trainer_cases.train, cp=cp, batch=batch, **common)
    assert all(r["impl"] == "cp_ring" for r in got), [r["impl"] for r in got]
    start = trainer_cases.build(family).state_dict()
    assert _relative(ref["weights"], start) > 1e-3, "training did not move the weights"
    assert _relative(got[0]["weights"], ref["weights"]) <= FP32, _id(case)
    for r in got:
        assert len(r["losses"]) == len(ref["losses"]) == 3
        assert max(abs(a - b) / b for a, b in zip(r["losses"], ref["losses"])) <= FP32, (r["losses"], ref["losses"])
