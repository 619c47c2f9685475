"""PyTorch's ``context_parallel`` context manager and ``context_parallel_unshard``, on cp_attention's ring.

``torch.distributed.tensor.experimental.context_parallel(mesh, buffers=..., buffer_seq_dims=...,
no_restore_buffers=...)`` shards the given buffers in place along their sequence dims (torch's default
head-tail placement: 2N chunks, rank r holds chunks r and 2N-1-r, which is the ``zigzag`` layout),
restores them on exit, and inside the context runs every ``F.scaled_dot_product_attention`` call on its
ring over the mesh. This module does the same on :func:`cp_attention.ring_attention`, with a ``layout=``
keyword torch does not have (any registered layout; ``"balanced"`` with ``cu_seqlens``: packed documents),
and it runs on CPU (gloo) as well as on GPUs.

What it refuses that torch accepts: an ``attn_mask`` (any: a mask over local rows is not the mask over
the whole sequence), ``dropout_p`` other than 0, a call whose sequence length is not the context's
local length, buffers of different lengths or listed twice, a length the layout cannot split (torch
silently falls back to an unbalanced split), and a nested context in one thread.

Only the calling thread's SDPA calls go to the ring: the module attribute
``torch.nn.functional.scaled_dot_product_attention`` is replaced (once, while any thread is inside a
context) by a dispatcher that runs torch's own function for every thread that is not inside one.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Sequence, TypedDict

import torch
import torch.nn.functional as F

from ..api import plan as build_plan
from ..api import ring_attention
from ..engine.plan import host_cu_seqlens
from ..layouts import Layout, get_layout
from ..layouts.args import check_dim
from ..transport.process_group import group_rank_and_size

__all__ = ["context_parallel", "context_parallel_unshard"]

_STATE = threading.local()  # .active: this thread's _Context, or absent
_PATCH_LOCK = threading.Lock()


class _Patch(TypedDict):
    users: int  # contexts entered (in any thread) and not yet left
    original: Callable[..., torch.Tensor] | None  # torch's F.scaled_dot_product_attention, saved by _install


_PATCH: _Patch = {"users": 0, "original": None}


def _original() -> Callable[..., torch.Tensor]:
    """The function our patch replaced (saved before the patch went in)."""
    original = _PATCH["original"]
    if original is None:
        raise RuntimeError("cp_attention's scaled_dot_product_attention patch is in place without the function it "
                           "replaced; this is a bug in cp_attention.compat.torch_cp, please report it")
    return original


class _Context:
    """What one ``context_parallel`` block fixes: the group, layout, documents and local length."""

    def __init__(self, mesh: Any, layout: Layout, cu_seqlens: Any, local_len: int | None) -> None:
        self.mesh, self.layout, self.cu_seqlens, self.local_len = mesh, layout, cu_seqlens, local_len
        self.plans: dict[bool, Any] = {}  # per is_causal; built on the first call (every rank alike)

    def plan(self, causal: bool):
        if causal not in self.plans:
            self.plans[causal] = build_plan(self.layout, self.mesh, causal=causal, cu_seqlens=self.cu_seqlens)
        return self.plans[causal]

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any,
                  dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool) -> torch.Tensor:
        _check_sdpa_call(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, self.local_len)
        # SDPA's tensors are [batch, heads, seq, dim]; the ring takes [batch, seq, heads, dim]: views only.
        out = ring_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                             softmax_scale=scale, plan=self.plan(is_causal))
        return out.transpose(1, 2)


def _check_sdpa_call(query: Any, key: Any, value: Any, attn_mask: Any, dropout_p: Any, is_causal: Any,
                     enable_gqa: Any, local_len: int | None) -> None:
    """Refuse, by name, an SDPA call the ring cannot run exactly (before any communication)."""
    where = "scaled_dot_product_attention inside cp_attention.compat.torch_cp.context_parallel"
    if attn_mask is not None:
        raise NotImplementedError(
            f"{where}: attn_mask is not supported (got a {type(attn_mask).__name__}); a mask over this rank's "
            "rows is not the mask over the whole sequence. Pass attn_mask=None with is_causal=True for causal "
            "attention, and cu_seqlens= to context_parallel for packed documents (HuggingFace models build a mask "
            "from sharded position_ids: drop it in a pre-hook on each attention module, as accelerate does, or "
            "use cp_attention.integrations.huggingface.apply_context_parallel)")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or dropout_p != 0:
        raise NotImplementedError(f"{where}: dropout_p must be 0, got {dropout_p!r}; attention dropout is not "
                                  "supported under context parallelism (set the model's attention dropout to 0, "
                                  "or call model.eval())")
    for name, flag in (("is_causal", is_causal), ("enable_gqa", enable_gqa)):
        if not isinstance(flag, bool):
            raise ValueError(f"{where}: {name} must be a bool, got {type(flag).__name__} {flag!r}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{where}: {name} must be a 4-D tensor [batch, heads, local_seq, head_dim], got {shape}")
    if key.shape[1] != value.shape[1]:
        raise ValueError(f"{where}: key and value must have the same number of heads, got {key.shape[1]} and "
                         f"{value.shape[1]}")
    hq, hk = query.shape[1], key.shape[1]
    if not enable_gqa and hq != hk:
        raise ValueError(f"{where}: query has {hq} heads but key/value have {hk}; pass enable_gqa=True for "
                         "grouped-query attention (as SDPA requires), or repeat the key/value heads")
    if enable_gqa and hq % hk != 0:
        raise ValueError(f"{where}: enable_gqa=True needs query heads ({hq}) divisible by key/value heads ({hk})")
    lengths = (query.shape[2], key.shape[2], value.shape[2])
    if len(set(lengths)) != 1:
        raise ValueError(f"{where}: query, key and value must be sharded alike, got local lengths {lengths} "
                         "(seq is dim 2); a KV cache or cross-attention over another sequence is not supported")
    if local_len is not None and lengths[0] != local_len:
        raise ValueError(f"{where}: the query has local length {lengths[0]} (dim 2), but the context sharded its "
                         f"buffers to {local_len} tokens per rank; shard the sequence the attention runs on "
                         "(pass the model's inputs as buffers), or leave buffers out if you shard them yourself")


def _sdpa_dispatch(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                   scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` while a context is active somewhere: the calling thread's
    context runs it on the ring; any other thread gets torch's own function."""
    ctx = getattr(_STATE, "active", None)
    if ctx is None:
        return _original()(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                           scale=scale, enable_gqa=enable_gqa)
    return ctx.attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _install() -> None:
    with _PATCH_LOCK:
        if _PATCH["users"] == 0 and F.scaled_dot_product_attention is not _sdpa_dispatch:
            _PATCH["original"] = F.scaled_dot_product_attention
            F.scaled_dot_product_attention = _sdpa_dispatch
        _PATCH["users"] += 1


def _uninstall() -> None:
    with _PATCH_LOCK:
        _PATCH["users"] -= 1
        # Restore only our own patch: one installed over ours (torch's CP, a profiler) is its owner's to
        # undo, and ours passes every call through to the original while no thread is inside a context.
        if _PATCH["users"] == 0 and F.scaled_dot_product_attention is _sdpa_dispatch:
            F.scaled_dot_product_attention = _original()


def _buffer_list(buffers: Sequence[torch.Tensor] | None, seq_dims: Sequence[int] | None, what: str,
                 dims_name: str) -> tuple[list[torch.Tensor], list[int]]:
    buffers = [] if buffers is None else list(buffers)
    seq_dims = [] if seq_dims is None else list(seq_dims)
    if len(buffers) != len(seq_dims):
        raise ValueError(f"{what}: {dims_name} must have one sequence dim per buffer, got {len(seq_dims)} dims for "
                         f"{len(buffers)} buffers")
    dims = []
    for i, (b, d) in enumerate(zip(buffers, seq_dims)):
        if not isinstance(b, torch.Tensor):
            raise ValueError(f"{what}: buffer {i} must be a tensor, got {type(b).__name__} "
                             "(a BlockMask is not supported)")
        dims.append(check_dim(d, b.dim(), f"{what} (buffer {i})"))
    return buffers, dims


def _global_length(buffers: list[torch.Tensor], dims: list[int], what: str) -> int | None:
    lengths = [b.shape[d] for b, d in zip(buffers, dims)]
    if len(set(lengths)) > 1:
        raise ValueError(f"{what}: every buffer must have the same length along its sequence dim, got {lengths}; "
                         "pass only the tensors of the sequence being sharded (inputs, labels, positions)")
    return lengths[0] if lengths else None


def _check_shardable(buffers: list[torch.Tensor], no_restore: list[torch.Tensor]) -> None:
    what = "context_parallel"
    for i, b in enumerate(buffers):
        if isinstance(b, torch.nn.Parameter) or b.requires_grad:
            raise ValueError(f"{what}: buffer {i} is a parameter or requires grad; it is sharded in place, so pass "
                             "plain tensors (inputs, labels, position ids), not parameters")
        if any(b is other for other in buffers[:i]):
            raise ValueError(f"{what}: buffer {i} is listed twice; each tensor is sharded in place once, so list "
                             "it once")
        # Two views of one storage would be overwritten by each other's in-place shard.
        if any(b.untyped_storage().data_ptr() == o.untyped_storage().data_ptr() and b.numel() and o.numel()
               for o in buffers[:i]):
            raise ValueError(f"{what}: buffer {i} shares storage with an earlier buffer (a view of it); pass a "
                             ".clone() so that sharding one in place does not overwrite the other")
    for t in no_restore:
        if not any(t is b for b in buffers):
            raise ValueError(f"{what}: no_restore_buffers must be a subset of buffers (the same tensor objects), "
                             f"got one of shape {tuple(t.shape)} that is not among them")


@contextlib.contextmanager
def context_parallel(mesh: Any, *, buffers: Sequence[torch.Tensor] | None = None,
                     buffer_seq_dims: Sequence[int] | None = None,
                     no_restore_buffers: set | None = None, layout: str | Layout = "zigzag",
                     cu_seqlens: Any = None) -> Iterator[None]:
    """Shard ``buffers`` in place and run every ``F.scaled_dot_product_attention`` call of this thread on
    cp_attention's ring over ``mesh``, as ``torch.distributed.tensor.experimental.context_parallel`` does.

    Args:
        mesh: the context-parallel group: a 1-D ``DeviceMesh`` (or one with a ``"cp"`` dim), a process
            group, ``None`` (the default group; a world of one without torch.distributed) or a transport
            (``LoopbackGroup(n).rank(r)``).
        buffers: tensors sharded in place along ``buffer_seq_dims`` for the duration (inputs, labels,
            position ids), all of one length along their sequence dims; their shape changes inside.
        buffer_seq_dims: the sequence dim of each buffer.
        no_restore_buffers: buffers (the same objects) left sharded on exit.
        layout: how the sequence is split, a name or :class:`~cp_attention.Layout`; the default
            ``"zigzag"`` is torch's head-tail placement.
        cu_seqlens: packed documents ``[0, l1, l1+l2, ..., T]`` over the full sequence (batch 1): buffers
            are sharded with them and every attention call stays within documents.

    Inside, SDPA calls must have ``attn_mask=None`` and ``dropout_p=0``, ``[batch, heads, local_seq, dim]``
    tensors of the context's local length; ``is_causal`` (over global positions), ``scale`` and
    ``enable_gqa`` are honoured. The patch and the buffers are undone on exit, exceptions included.

    Raises:
        ValueError: buffers and dims that do not pair up, of different lengths, listed twice, sharing
            storage, parameters, a length the layout cannot split, ``no_restore_buffers`` not among them.
        RuntimeError: a context already active in this thread (nesting is not supported).
        NotImplementedError / ValueError: from SDPA calls inside, as above.
    """
    what = "context_parallel"
    if getattr(_STATE, "active", None) is not None:
        raise RuntimeError(f"{what}: a context is already active in this thread; nesting is not supported "
                           "(it would shard the buffers twice): exit the outer context first")
    lay = get_layout(layout)
    buffers, dims = _buffer_list(buffers, buffer_seq_dims, what, "buffer_seq_dims")
    no_restore = [] if no_restore_buffers is None else list(no_restore_buffers)
    _check_shardable(buffers, no_restore)
    total = _global_length(buffers, dims, what)
    cu = host_cu_seqlens(cu_seqlens)
    rank, world_size = group_rank_and_size(mesh)
    if cu is not None and total is not None:
        if any(b.shape[0] != 1 and d != 0 for b, d in zip(buffers, dims)):
            raise ValueError(f"{what}: cu_seqlens (packed documents) needs buffers of batch 1 (dim 0), got shapes "
                             f"{[tuple(b.shape) for b in buffers]}; pack the batch's rows into one sequence")
    # Every shard is computed before any buffer changes, so a refusal leaves them all untouched.
    with torch.no_grad():
        shards = [lay.shard(b, d, rank, world_size, cu_seqlens=cu) for b, d in zip(buffers, dims)]
        originals = [None if any(b is t for t in no_restore) else b.clone() for b in buffers]
        for b, s in zip(buffers, shards):
            b.resize_(s.shape)
            b.copy_(s)
    local_len = None if total is None else total // world_size
    _STATE.active = _Context(mesh, lay, cu, local_len)
    _install()
    try:
        yield
    finally:
        _STATE.active = None
        _uninstall()
        with torch.no_grad():
            for b, original in zip(buffers, originals):
                if original is not None:
                    b.resize_(original.shape)
                    b.copy_(original)


@torch.no_grad()
def context_parallel_unshard(mesh: Any, buffers: Sequence[torch.Tensor], seq_dims: Sequence[int],
                             layout: str | Layout = "zigzag", cu_seqlens: Any = None) -> list[torch.Tensor]:
    """The full tensors of ``buffers`` sharded by :func:`context_parallel` (e.g. its outputs): each
    all-gathered over ``mesh`` along its seq dim and put back in sequence order by ``layout``.

    Not differentiable. Returns new tensors, ``[..., local_seq * world_size, ...]``. Raises
    ``ValueError`` (on every rank alike, before the data moves) for buffers and dims that do not pair
    up, and as :meth:`cp_attention.Layout.gather` does.
    """
    lay = get_layout(layout)
    buffers, dims = _buffer_list(buffers, seq_dims, "context_parallel_unshard", "seq_dims")
    cu = host_cu_seqlens(cu_seqlens)
    return [lay.gather(b, d, group=mesh, cu_seqlens=cu) for b, d in zip(buffers, dims)]
