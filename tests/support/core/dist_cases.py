"""Cases executed inside the gloo worker processes: ``fn(rank, world_size, ...)``.

Each rank builds the same full tensors from the same seed, shards them with the layout, runs the
ring and compares its shard of the output and of every gradient with the fp64 reference.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import cp_attention as cpa
from cp_attention.engine.function import AttentionFunction
from cp_attention.engine.ring import RingSource
from cp_attention.engine.tasks import KernelSettings
from cp_attention.kernels import MathKernel
from cp_attention.kernels.dtypes import dtype_from_name
from cp_attention.layouts.documents import cu_seqlens_from_lengths
from cp_attention.schedules import rank_steps
from cp_attention.transport import transport_for

from .reference import excess_error, reference_attention


def make_inputs(seed: int, batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, v_dim: int,
                dtype: torch.dtype):
    """Full q, k, v and an upstream gradient, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(batch, seq, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(batch, seq, kv_heads, v_dim, generator=g).to(dtype)
    dout = torch.randn(batch, seq, heads, v_dim, generator=g).to(dtype)
    return q, k, v, dout


def attention_errors(rank: int, world_size: int, *, layout: str, causal: bool, dtype: str, kernel: str,
                     heads: int = 4, kv_heads: int = 4, head_dim: int = 16, v_dim: int | None = None,
                     batch: int = 2, local_len: int = 6, scale: float | None = None, atol: float,
                     rtol: float, seed: int = 0, sinks: bool = False, lse_grad: bool = False,
                     softcap: float = 0.0, window: tuple = (-1, -1), cp_comm_type: str = "p2p",
                     mesh_shape: tuple[int, int] | None = None) -> dict:
    """Excess error over tolerance (<= 0 passes) for out, lse, dq, dk, dv on this rank's shard.

    ``mesh_shape``: the group is a two-level ``DeviceMesh`` of that shape (for ``cp_comm_type="a2a+p2p"``).

    With ``sinks``, learned per-head sink logits join every softmax, and ``dsinks`` is the error of
    their gradient summed over the group (each rank holds its queries' share). With ``lse_grad``,
    the loss also weighs the returned LSE, so every gradient carries the LSE's share.
    """
    dt = dtype_from_name(dtype)
    v_dim = v_dim or head_dim
    seq = local_len * world_size
    q, k, v, dout = make_inputs(seed, batch, seq, heads, kv_heads, head_dim, v_dim, dt)
    scale_ = scale if scale is not None else head_dim ** -0.5

    # Reference in fp64 on the (already dtype-rounded) full inputs.
    qr, kr, vr = (t.double().clone().requires_grad_() for t in (q, k, v))
    sink = (torch.randn(heads, generator=torch.Generator().manual_seed(seed + 99)) + 1.0).to(dt) if sinks else None
    sink_ref = sink.double().clone().requires_grad_() if sinks else None
    out_ref, lse_ref = reference_attention(qr, kr, vr, causal, scale_, sinks=sink_ref, softcap=softcap, window=window)
    dlse = torch.randn(lse_ref.shape, generator=torch.Generator().manual_seed(seed + 7), dtype=torch.float64)
    loss_ref = (out_ref * dout.double()).sum() + ((lse_ref * dlse).sum() if lse_grad else 0.0)
    loss_ref.backward()

    lay = cpa.get_layout(layout)
    shard = lambda t: lay.shard(t, 1, rank, world_size)  # noqa: E731
    ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
    sink_l = sink.clone().requires_grad_() if sinks else None
    group = None
    if mesh_shape is not None:
        from torch.distributed.device_mesh import init_device_mesh

        group = init_device_mesh("cpu", tuple(mesh_shape))
    out, lse = cpa.ring_attention(ql, kl, vl, group=group, layout=layout, causal=causal, softmax_scale=scale,
                                  kernel=kernel, return_lse=True, sinks=sink_l, softcap=softcap,
                                  window_size=tuple(window), cp_comm_type=cp_comm_type)
    loss = (out * shard(dout)).sum() + ((lse * lay.shard(dlse, 2, rank, world_size).to(lse.dtype)).sum()
                                        if lse_grad else 0.0)
    loss.backward()

    extra = {}
    if sinks:
        dsink = sink_l.grad.clone()
        dist.all_reduce(dsink)  # every rank holds its queries' share
        extra = {"dsinks": excess_error(dsink, sink_ref.grad, atol, rtol), "dsinks_dtype_ok": dsink.dtype == dt}
    return {**extra,
        "out_dtype_ok": out.dtype == dt and out.shape == (batch, local_len, heads, v_dim),
        "out": excess_error(out, shard(out_ref), atol, rtol),
        "lse": excess_error(lse, lay.shard(lse_ref, 2, rank, world_size), atol, rtol),
        "dq": excess_error(ql.grad, shard(qr.grad), atol, rtol),
        "dk": excess_error(kl.grad, shard(kr.grad), atol, rtol),
        "dv": excess_error(vl.grad, shard(vr.grad), atol, rtol),
        "grad_dtypes_ok": all(t.grad.dtype == dt for t in (ql, kl, vl)),
    }


def pairs_computed(rank: int, world_size: int, *, layout: str, causal: bool, local_len: int) -> dict:
    """Run the engine with a spy kernel and return how many score pairs each step computed.

    Compared in the test against the schedule's work model and the exact mask size, this shows
    masked steps are skipped rather than computed and discarded.
    """
    seen = []

    class Spy(MathKernel):
        def forward(self, q, k, v, causal_, scale):
            rows, cols = q.shape[1], k.shape[1]
            seen.append(rows * cols if not causal_ else sum(min(i + 1, cols) for i in range(rows)))
            return super().forward(q, k, v, causal_, scale)

    q, k, v, _ = make_inputs(1, 1, local_len * world_size, 2, 2, 8, 8, torch.float64)
    lay = cpa.get_layout(layout)
    ql, kl, vl = (lay.shard(t, 1, rank, world_size) for t in (q, k, v))
    transport = transport_for(None)
    source = RingSource(transport, rank_steps(lay, causal, rank, world_size, local_len),
                        KernelSettings.of(Spy(), 8 ** -0.5))
    out, _ = AttentionFunction.apply(ql, kl, vl, source)
    out_ref, _ = reference_attention(q, k, v, causal, 8 ** -0.5)
    return {"pairs": sum(seen), "calls": len(seen),
            "max_err": (out - lay.shard(out_ref, 1, rank, world_size)).abs().max().item()}


def call_and_capture(rank: int, world_size: int, *, per_rank: dict | None = None, subgroup: list | None = None,
                     **kwargs) -> tuple[str, str]:
    """Call ring_attention with ``kwargs`` (overridden per rank by ``per_rank[rank]``); return the
    exception type and message it raised, or ("", "") if it did not raise."""
    spec = dict(batch=1, local_len=4, heads=4, kv_heads=4, head_dim=8, v_dim=8, dtype="float32",
                layout="zigzag", causal=True, kernel="auto", softmax_scale=None, requires_grad=True, ndim=4,
                sinks=None, sink_value=0.0, softcap=0.0, cp_comm_type="p2p")
    spec.update(kwargs)
    spec.update((per_rank or {}).get(rank, {}))
    dt = dtype_from_name(spec["dtype"])
    q = torch.randn(spec["batch"], spec["local_len"], spec["heads"], spec["head_dim"], dtype=dt)
    k = torch.randn(spec["batch"], spec["local_len"], spec["kv_heads"], spec["head_dim"], dtype=dt)
    v = torch.randn(spec["batch"], spec["local_len"], spec["kv_heads"], spec["v_dim"], dtype=dt)
    if spec["ndim"] == 3:
        q = q[0]
    for t in (q, k, v):
        t.requires_grad_(spec["requires_grad"])
    group = None
    if subgroup is not None:
        group = dist.new_group(subgroup)  # every rank must take part in creating it
    try:
        sinks = None if spec["sinks"] is None else torch.full((spec["sinks"],), spec["sink_value"], dtype=dt)
        out = cpa.ring_attention(q, k, v, group=group, layout=spec["layout"], causal=spec["causal"],
                                 softmax_scale=spec["softmax_scale"], kernel=spec["kernel"], sinks=sinks,
                                 softcap=spec["softcap"], cp_comm_type=spec["cp_comm_type"])
        if spec["requires_grad"]:
            out.sum().backward()
    except Exception as e:  # noqa: BLE001 - the case reports what was raised
        result = (type(e).__name__, str(e))
    else:
        result = ("", "")
    # Prove the group is still usable (nobody is stuck in a half-finished exchange).
    dist.barrier()
    return result


def gather_roundtrip(rank: int, world_size: int, *, layout: str) -> bool:
    """Layout.gather on each rank returns the full tensor."""
    full = torch.arange(2 * 3 * 4 * world_size * 5, dtype=torch.float32).reshape(2, 3, 4 * world_size, 5)
    lay = cpa.get_layout(layout)
    return torch.equal(lay.gather(lay.shard(full, 2, rank, world_size), dim=2), full)


def reduced_gradients(rank: int, world_size: int) -> dict:
    """``reduce_gradients`` on a 2 (dp) x 2 (cp) grid: gradients of mixed dtypes, one parameter without."""
    from cp_attention.training import reduce_gradients

    cp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.zeros(3))
    model.b = torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.float64))
    model.frozen = torch.nn.Parameter(torch.zeros(1))
    model.a.grad = torch.arange(3.0) + 10 * rank
    model.b.grad = torch.full((2, 2), float(rank * rank), dtype=torch.float64)
    reduce_gradients(model, cp_group=cp_groups[rank // 2], dp_group=dp_groups[rank % 2])
    return {"a": model.a.grad, "b": model.b.grad, "frozen": model.frozen.grad}


def packed_attention_errors(rank: int, world_size: int, *, layout: str, causal: bool, lengths: list[int],
                            kernel: str = "math", heads: int = 4, kv_heads: int = 2, head_dim: int = 8,
                            dtype: str = "float64", atol: float = 1e-10, rtol: float = 0.0, seed: int = 0,
                            sinks: bool = False, lse_grad: bool = False, window: tuple = (-1, -1)) -> dict:
    """Packed documents (``cu_seqlens`` from ``lengths``) against each document's own fp64 attention:
    excess error over tolerance (<= 0 passes) for out, lse, dq, dk, dv on this rank's shard."""
    dt = dtype_from_name(dtype)
    cu = list(cu_seqlens_from_lengths(lengths))
    q, k, v, dout = make_inputs(seed, 1, cu[-1], heads, kv_heads, head_dim, head_dim, dt)
    scale = head_dim ** -0.5
    qr, kr, vr = (t.double().clone().requires_grad_() for t in (q, k, v))
    sink = (torch.randn(heads, generator=torch.Generator().manual_seed(seed + 99)) + 1.0).to(dt) if sinks else None
    sink_ref = sink.double().clone().requires_grad_() if sinks else None
    # The reference never sees the packing: one independent attention per document.
    parts = [reference_attention(qr[:, a:b], kr[:, a:b], vr[:, a:b], causal, scale, sinks=sink_ref, window=window)
             for a, b in zip(cu, cu[1:])]
    out_ref = torch.cat([o for o, _ in parts], 1)
    lse_ref = torch.cat([lse for _, lse in parts], 2)
    dlse = torch.randn(lse_ref.shape, generator=torch.Generator().manual_seed(seed + 7), dtype=torch.float64)
    ((out_ref * dout.double()).sum() + ((lse_ref * dlse).sum() if lse_grad else 0.0)).backward()

    lay = cpa.get_layout(layout)
    shard = lambda t, dim=1: lay.shard(t, dim, rank, world_size, cu_seqlens=cu)  # noqa: E731
    ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
    sink_l = sink.clone().requires_grad_() if sinks else None
    out, lse = cpa.ring_attention(ql, kl, vl, layout=layout, causal=causal, kernel=kernel, return_lse=True,
                                  sinks=sink_l, cu_seqlens=torch.tensor(cu), window_size=tuple(window))
    loss = (out * shard(dout)).sum() + ((lse * shard(dlse, 2).to(lse.dtype)).sum() if lse_grad else 0.0)
    loss.backward()
    extra = {}
    if sinks:
        dsink = sink_l.grad.clone()
        dist.all_reduce(dsink)
        extra["dsinks"] = excess_error(dsink, sink_ref.grad, atol, rtol)
    return {**extra,
            "out": excess_error(out, shard(out_ref), atol, rtol),
            "lse": excess_error(lse, shard(lse_ref, 2), atol, rtol),
            "dq": excess_error(ql.grad, shard(qr.grad), atol, rtol),
            "dk": excess_error(kl.grad, shard(kr.grad), atol, rtol),
            "dv": excess_error(vl.grad, shard(vr.grad), atol, rtol)}


def packed_refusal(rank: int, world_size: int, *, case: str) -> tuple[str, str]:
    """A bad packed call (``case``); return the exception type and message ring_attention raised."""
    local = 4
    cu = [0, 3, local * world_size]
    batch = 1
    if case == "batch":
        batch = 2
    elif case == "wrong_end":
        cu = [0, 3, local * world_size + 2]
    elif case == "not_increasing":
        cu = [0, 3, 3, local * world_size]
    elif case == "differs":  # only the last rank disagrees: every rank must still raise, none may hang
        cu = [0, 3 if rank < world_size - 1 else 5, local * world_size]
    q = torch.randn(batch, local, 2, 8, dtype=torch.float64, requires_grad=True)
    try:
        cpa.ring_attention(q, q, q, layout="interleaved", cu_seqlens=torch.tensor(cu)).sum().backward()
    except Exception as e:  # noqa: BLE001 - the case reports what was raised
        result = (type(e).__name__, str(e))
    else:
        result = ("", "")
    dist.barrier()  # the group is still usable: nobody is stuck in a half-finished exchange
    return result


def window_exchanges(rank: int, world_size: int) -> dict:
    """Count the ring's K/V and dK/dV exchanges (forward, backward) this rank posts for a contiguous causal
    call whose window reaches only the previous shard, and for the same call without a window (a step
    where this rank neither sends nor receives a row posts none); check the windowed one's result."""
    from cp_attention.transport import ProcessGroupTransport as _Comm

    counts = []
    original = _Comm.exchange

    def counting(self, send, recv, hop=1):
        if any(t.is_floating_point() for t in (*send, *recv)):  # K/V or dK/dV, not a status agreement
            counts.append(hop)
        return original(self, send, recv, hop)

    local, window = 8, (5, -1)
    q, k, v, dout = make_inputs(3, 1, local * world_size, 2, 1, 8, 8, torch.float64)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out_ref, _ = reference_attention(qr, kr, vr, True, 8 ** -0.5, window=window)
    (out_ref * dout).sum().backward()
    lay = cpa.get_layout("contiguous")
    shard = lambda t: lay.shard(t, 1, rank, world_size)  # noqa: E731
    result = {}
    _Comm.exchange = counting
    try:
        for name, win in (("windowed", window), ("full", (-1, -1))):
            ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
            counts.clear()
            out = cpa.ring_attention(ql, kl, vl, layout=lay, window_size=win)
            fwd = len(counts)
            (out * shard(dout)).sum().backward()
            result[name] = (fwd, len(counts) - fwd)
            if name == "windowed":
                result["err"] = max((a - b).abs().max().item() for a, b in
                                    ((out, shard(out_ref)), (ql.grad, shard(qr.grad)), (kl.grad, shard(kr.grad)),
                                     (vl.grad, shard(vr.grad))))
    finally:
        _Comm.exchange = original
    return result


def window_refusal(rank: int, world_size: int) -> tuple[str, str]:
    """A window_size that is bad on the last rank only; return what ring_attention raised here."""
    q = torch.randn(1, 4, 2, 8)
    window = (-3, 0) if rank == world_size - 1 else (2, -1)
    try:
        cpa.ring_attention(q, q, q, window_size=window)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return type(e).__name__, str(e)
    return "none", ""


def injected_failure(rank: int, world_size: int, *, fail_rank: int, fail_step: int, phase: str) -> dict:
    """Make the kernel raise on ``fail_rank`` at ring step ``fail_step`` of the ``phase`` pass (forward
    or backward) of one call, then call again. Returns, per call, what was raised (type, message) or
    ("", "") and how long the call took, and the second call's error against the reference."""
    import time

    from cp_attention.kernels import MathKernel as _Math

    q, k, v, dout = make_inputs(5, 1, 4 * world_size, 2, 1, 8, 8, torch.float64)
    out_ref, _ = reference_attention(*(t.clone().requires_grad_() for t in (q, k, v)), False, 8 ** -0.5)
    lay = cpa.get_layout("interleaved")  # non-causal: one kernel call per ring step
    shard = lambda t: lay.shard(t, 1, rank, world_size)  # noqa: E731
    calls = {"n": 0}
    original = getattr(_Math, phase)

    def failing(self, *args, **kwargs):
        calls["n"] += 1
        if rank == fail_rank and calls["n"] == fail_step + 1:
            raise RuntimeError("injected kernel failure")
        return original(self, *args, **kwargs)

    results = []
    for attempt in range(2):
        ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
        calls["n"] = 0
        if attempt == 0:
            setattr(_Math, phase, failing)
        t0 = time.perf_counter()
        try:
            out = cpa.ring_attention(ql, kl, vl, layout=lay, causal=False, kernel="math")
            (out * shard(dout)).sum().backward()
            outcome = ("", "")
        except Exception as e:  # noqa: BLE001 - the test inspects it
            outcome = (type(e).__name__, str(e))
        finally:
            setattr(_Math, phase, original)
        results.append({"raised": outcome, "seconds": time.perf_counter() - t0})
    results[1]["err"] = (out - shard(out_ref)).abs().max().item()
    dist.barrier()
    return {"calls": results}


def repeated_backward(rank: int, world_size: int, *, layout: str, kernel: str) -> float:
    """Backward twice through one forward (``retain_graph=True``): the largest difference between the
    two passes' gradients, which must be 0 (backward must not write into what the forward saved)."""
    q, k, v, dout = make_inputs(5, 1, 8 * world_size, 2, 1, 8, 8, torch.float64)
    lay = cpa.get_layout(layout)
    ql, kl, vl = (lay.shard(t, 1, rank, world_size).requires_grad_() for t in (q, k, v))
    out = cpa.ring_attention(ql, kl, vl, layout=lay, causal=True, kernel=kernel)
    first = torch.autograd.grad(out, (ql, kl, vl), lay.shard(dout, 1, rank, world_size), retain_graph=True)
    second = torch.autograd.grad(out, (ql, kl, vl), lay.shard(dout, 1, rank, world_size))
    return max((a - b).abs().max().item() for a, b in zip(first, second))
