"""Plans built ahead of the step (cp_attention.plan_ahead, AttentionPlan.bind): built on the host with
no process group, pickled as a data loader's worker returns them, bound to the group in the step; the
calls then build nothing and give exactly what a plan built in the step gives."""

from __future__ import annotations

import pickle

import pytest
import torch

import cp_attention as cpa
from cp_attention.engine.plan import AttentionPlan
from cp_attention.layouts.documents import cu_seqlens_from_lengths
from cp_attention.transport.loopback import LoopbackGroup
from tests.support.cuda.fake_cuda_cases import check_clean, env, ring_case  # noqa: F401 - env: the fixture

pytestmark = pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")

LENGTHS = [1, 40, 3, 17, 2, 33]  # 96 tokens


@pytest.mark.parametrize("layout", ["zigzag", "balanced", "contiguous"])
@pytest.mark.parametrize("window", [(-1, -1), (9, -1)])
def test_a_plan_built_ahead_runs_like_one_built_in_the_step(layout, window, monkeypatch):
    world_size, cu = 4, cu_seqlens_from_lengths(LENGTHS)
    total = cu[-1]
    n = total // world_size
    lay = cpa.get_layout(layout)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, total, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    # in the loader's worker: no group, then across a process boundary
    ahead = [pickle.loads(pickle.dumps(cpa.plan_ahead(layout, r, world_size, True, cu, window, local_len=n,
                                                      kernel="math", device="cpu", dtype=torch.float64,
                                                      head_dim=8))) for r in range(world_size)]

    def body(rank, bound: bool):
        shard = [lay.shard(t, 1, rank.rank, world_size, cu).requires_grad_() for t in (q, k, v)]
        plan = ahead[rank.rank].bind(rank, "cpu") if bound else cpa.plan(lay, rank, True, cu, window)
        out = cpa.ring_attention(*shard, plan=plan, kernel="math")
        out.square().sum().backward()
        return [out.detach()] + [t.grad for t in shard]

    fresh = LoopbackGroup(world_size).run(lambda r: body(r, False))

    def no_build(self, *args):
        raise AssertionError("a bound plan built its steps again")
    monkeypatch.setattr(AttentionPlan, "_build_steps", no_build)
    monkeypatch.setattr("cp_attention.engine.plan.rank_needs", no_build)
    bound = LoopbackGroup(world_size).run(lambda r: body(r, True))
    for a, b in zip(fresh, bound):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_bind_refuses_a_plan_of_another_rank_on_every_rank():
    ahead = [cpa.plan_ahead("zigzag", r, 2, True, (0, 5, 16), local_len=8, kernel="math", device="cpu",
                            dtype=torch.float64, head_dim=8) for r in (1, 0)]  # swapped

    def body(rank):
        with pytest.raises(ValueError, match="built for rank 1 of 2") as e:
            ahead[rank.rank].bind(rank)
        return str(e.value)
    messages = LoopbackGroup(2).run(body)
    assert messages[0] == messages[1]


def test_plan_ahead_refuses_what_plan_refuses():
    with pytest.raises(ValueError, match="zigzag layout needs"):
        cpa.plan_ahead("zigzag", 0, 4, True, (0, 5, 10), local_len=2, device="cpu", dtype=torch.float64, head_dim=8)
    with pytest.raises(ValueError, match="rank"):
        cpa.plan_ahead("zigzag", 4, 4, True, None, local_len=2, device="cpu", dtype=torch.float64, head_dim=8)


@pytest.mark.parametrize("kernel,layout,lengths,window", [
    ("flash", "balanced", [1, 60, 7, 60], (-1, -1)),  # varlen batches and the needs
    ("efficient", "zigzag", [1, 60, 7, 60], (20, -1)),  # a window's tiles
    ("flash", "interleaved", None, (-1, -1)),
])
def test_a_bound_plan_runs_on_fake_cuda_with_no_sync_and_no_upload_in_the_calls(env, kernel, layout, lengths, window):
    # The plan is built on the host ahead of the step and bound (its index tensors uploaded) in the plan
    # phase; the first call and every later one neither sync nor upload anything.
    check_clean(ring_case(env, 2, kernel, layout, torch.bfloat16, n=64, lengths=lengths, window=window, ahead=True),
                kernel, ahead=True)


def test_moving_a_host_plan_uploads_every_tensor_once_at_any_depth(monkeypatch):
    from cp_attention.engine import plan as plan_mod
    uploads = []

    def upload(t, device):
        uploads.append(t)
        return t.clone()
    monkeypatch.setattr(plan_mod, "upload", upload)

    class Inner:
        def __init__(self, t):
            self.idx, self.name = t, "inner"

    class Outer:
        def __init__(self, inner, shared):
            self.inner, self.shared, self.count = inner, shared, 3

    shared = torch.arange(4)
    plain = ("no tensors", 1)
    obj = ([Outer(Inner(torch.arange(3)), shared), Outer(Inner(shared), shared)], plain, {"k": shared})
    moved = plan_mod._moved(obj, torch.device("cpu"))
    assert len(uploads) == 2 and any(u is shared for u in uploads)  # the shared tensor once, at any depth
    first, second = moved[0]
    assert first.inner.idx is not obj[0][0].inner.idx and torch.equal(first.inner.idx, torch.arange(3))
    assert first.shared is second.shared is second.inner.idx is moved[2]["k"]  # still one tensor
    assert moved[1] is plain and first.count == 3 and obj[0][0].inner.idx is not first.inner.idx
