"""Cases for tests/distributed/test_fuzz_ring.py, test_fuzz_layout.py and tests/adapters/test_fuzz_adapters.py,
executed inside the gloo workers: ``fn(rank, world_size, ...)``.

Every case is described by plain, picklable data (one description per rank, so ranks may be called
with different arguments), built into tensors here, run, and reported as ``(exception type, message)``,
``("", "")`` when nothing was raised. A final barrier proves no rank was left in a half-finished
exchange.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import cp_attention as cpa

from . import custom_layouts  # noqa: F401 - registers "reversed_zigzag" (no packed documents) in every worker

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "int64": torch.int64, "int32": torch.int32, "bool": torch.bool,
          "complex64": torch.complex64}


def make_tensor(desc, seed: int = 0):
    """A tensor from ``(shape, dtype name, device)``; other descriptions are returned as they are
    (``("raw", value)`` -> value), so non-tensor arguments can be fuzzed too."""
    if isinstance(desc, tuple) and len(desc) == 2 and desc[0] == "raw":
        return desc[1]
    shape, dtype, device = desc
    dt = DTYPES[dtype]
    if device == "meta":
        return torch.empty(shape, dtype=dt, device="meta")
    g = torch.Generator().manual_seed(seed)
    if dt.is_floating_point:
        return torch.randn(shape, generator=g).to(dt)
    if dt.is_complex:
        return torch.randn(shape, generator=g, dtype=dt)
    if dt == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(0, 5, shape, generator=g, dtype=dt)


def make_arg(desc):
    """``None``, ``("tensor", values, dtype name[, device])``, ``("raw", value)``: the argument described."""
    if desc is None:
        return None
    kind = desc[0]
    if kind == "raw":
        return desc[1]
    if kind == "tensor":
        values, dtype = desc[1], desc[2]
        device = desc[3] if len(desc) > 3 else "cpu"
        return torch.tensor(values, dtype=DTYPES[dtype], device=device)
    if kind == "zeros":  # ("zeros", shape, dtype name, device)
        return torch.zeros(desc[1], dtype=DTYPES[desc[2]], device=desc[3])
    raise ValueError(f"unknown argument description {desc!r}")


def _capture(fn) -> tuple[str, str]:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the case reports what was raised
        return type(e).__name__, str(e)
    return "", ""


def ring_call(rank: int, world_size: int, *, specs: list) -> tuple[str, str]:
    """Call ``ring_attention`` with ``specs[rank]`` (a dict of tensor and argument descriptions, see
    :func:`make_tensor`, :func:`make_arg`); backward too when the inputs require grad. Returns what
    was raised; a successful call must give a finite output of the expected shape."""
    spec = specs[rank]
    q, k, v = (make_tensor(spec[name], seed=i + 10 * rank) for i, name in enumerate("qkv"))
    if spec.get("requires_grad"):
        for t in (q, k, v):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                t.requires_grad_(True)
    kwargs = {name: make_arg(spec[name]) for name in ("sinks", "cu_seqlens", "softmax_scale", "softcap",
                                                      "window_size") if name in spec}
    for name in ("layout", "causal", "kernel"):
        if name in spec:
            kwargs[name] = spec[name]

    def call():
        out = cpa.ring_attention(q, k, v, **kwargs)
        if spec.get("requires_grad"):
            out.float().square().sum().backward()
        expected = (q.shape[0], q.shape[1], q.shape[2], v.shape[3])
        if tuple(out.shape) != expected or not bool(torch.isfinite(out).all()):
            raise AssertionError(f"bad output: shape {tuple(out.shape)} (expected {expected}), "
                                 f"finite={bool(torch.isfinite(out).all())}")

    result = _capture(call)
    dist.barrier()  # the group is still usable: nobody is stuck in a half-finished exchange
    return result


def gather_call(rank: int, world_size: int, *, specs: list) -> tuple[str, str]:
    """``Layout.gather`` of a tensor described by ``specs[rank]`` (``x``, ``dim``, ``layout``,
    ``cu_seqlens``); checks a successful gather against the unshard of every rank's shard."""
    spec = specs[rank]
    x = make_tensor(spec["x"], seed=rank)
    lay = cpa.get_layout(spec.get("layout", "zigzag"))
    cu = make_arg(spec.get("cu_seqlens"))

    def call():
        full = lay.gather(x, spec["dim"], cu_seqlens=cu)
        parts = [make_tensor(s["x"], seed=r) for r, s in enumerate(specs)]
        if not torch.equal(full, lay.unshard(parts, spec["dim"], cu)):
            raise AssertionError("gather differs from unshard of the shards")

    result = _capture(call)
    dist.barrier()
    return result


def hf_shard_call(rank: int, world_size: int, *, batches: list, layout: str = "zigzag") -> tuple[str, str]:
    """``huggingface.shard_batch(batches[rank])``; a successful call must give every token entry the same
    local shape, with position_ids and shift_labels alike."""
    from cp_attention.integrations import huggingface as cphf

    def call():
        local = cphf.shard_batch(batches[rank], layout=layout)
        ids = local["input_ids"]
        for key in ("position_ids", "shift_labels", "labels", "attention_mask"):
            if key in local and tuple(local[key].shape[:2]) != tuple(ids.shape[:2]):
                raise AssertionError(f"{key} {tuple(local[key].shape)} does not match input_ids {tuple(ids.shape)}")

    result = _capture(call)
    dist.barrier()
    return result


def megatron_batch_call(rank: int, world_size: int, *, batches: list, layout: str = "zigzag",
                        packed: list | None = None) -> tuple[str, str]:
    """``megatron.get_batch_on_this_cp_rank(batches[rank], layout, cp_group=WORLD, packed_seq_params=...)``
    with ``packed[rank]`` the keyword arguments of a ``PackedSeqParams`` (tensors given as lists) or None;
    a successful call must give every token tensor this rank's share of the sequence."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from cp_attention.integrations import megatron as cpm

    def call():
        params = None
        if packed is not None and packed[rank] is not None:
            kwargs = {key: torch.tensor(val, dtype=torch.int32) if isinstance(val, list) else val
                      for key, val in packed[rank].items()}
            params = PackedSeqParams(**kwargs)
        batch = batches[rank]
        local = cpm.get_batch_on_this_cp_rank(batch, layout=layout, cp_group=dist.group.WORLD,
                                              packed_seq_params=params)
        for key, val in batch.items():
            if isinstance(val, torch.Tensor) and key not in ("cu_seqlens", "cu_seqlens_padded", "max_seqlen"):
                dim = 2 if key == "attention_mask" else 1
                if local[key].shape[dim] * world_size != val.shape[dim]:
                    raise AssertionError(f"{key}: local {tuple(local[key].shape)} from full {tuple(val.shape)}")

    result = _capture(call)
    dist.barrier()
    return result


def megatron_attention_call(rank: int, world_size: int, *, specs: list, layout: str = "zigzag") -> tuple[str, str]:
    """megatron's core attention slot (``RingDotProductAttention``) called with ``specs[rank]``: ``local``
    tokens of q, k, v, and either THD ``packed`` (``PackedSeqParams`` keyword arguments, lists as int32
    tensors) or an unpacked ``mask`` ("causal": the layout's own causal mask, "padding": one with a padded
    key, "shape": a mask of the wrong shape, None)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from ..megatron.megatron_cases import _qkv, _ring, parallel_state

    parallel_state(world_size)
    spec = specs[rank]
    ring = _ring(world_size, layout=layout)
    ring.global_positions_ready = True
    q, k, v = _qkv(spec["local"], batch=1, seed=rank)

    def call():
        if "packed" in spec:
            kwargs = {key: torch.tensor(val, dtype=torch.int32) if isinstance(val, list) else val
                      for key, val in spec["packed"].items()}
            mask = None if spec.get("mask") is None else torch.zeros(1, 1, spec["local"], spec["local"] * world_size,
                                                                     dtype=torch.bool)
            out = ring(q[:, 0], k[:, 0], v[:, 0], mask, packed_seq_params=PackedSeqParams(**kwargs))
        else:
            total = spec["local"] * world_size
            mask = None
            if spec.get("mask") is not None:
                full = torch.ones(total, total, dtype=torch.bool).triu(1)[None, None]
                if spec["mask"] == "padding":
                    full[..., 0] = True  # the first key is padding: every query could see it
                elif spec["mask"] == "shape":
                    full = full[..., :-1]
                mask = cpa.get_layout(layout).shard(full, 2, rank, world_size)
            out = ring(q, k, v, mask)
        if not bool(torch.isfinite(out).all()):
            raise AssertionError("non-finite output")

    result = _capture(call)
    dist.barrier()
    return result
