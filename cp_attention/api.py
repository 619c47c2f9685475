"""The public entry points: :func:`plan` (one per batch) and :func:`ring_attention`."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Sequence

import torch

from .checks.agreement import in_agreed_forward
from .checks.validation import tensor_codes, validate_call
from .engine.function import AttentionFunction
from .engine.plan import AttentionPlan, build_plan, host_cu_seqlens, plan_ahead
from .engine.ring import RingSource
from .engine.tasks import KernelSettings
from .layouts.base import Layout
from .strategies.dispatch import run_strategy, strategy_problem
from .transport.eager import eager_only
from .transport.process_group import transport_for

__all__ = ["ring_attention", "plan", "plan_ahead"]

# Under torch.compile a plan is built eagerly (a graph break): it agrees over the group on the host.
plan = eager_only(build_plan)


class _Default:
    """A default argument's value that can tell whether the caller passed it (the plan then decides)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


# Any: each stands in for a typed parameter's default in ring_attention's signature.
_LAYOUT: Any
_CAUSAL: Any
_WINDOW: Any
_LAYOUT, _CAUSAL, _WINDOW, _GROUP = _Default("zigzag"), _Default(True), _Default((-1, -1)), _Default(None)


def _given(value: Any, default: _Default) -> Any:
    """``value`` as passed, or ``default``'s own value when the caller left the argument out."""
    return default.value if value is default else value


# Plans of calls made without one, so a model's layers share one (the first layer builds it). Keyed
# by what a plan holds; small, since a training step's batches come one after another.
_PLANS: OrderedDict[tuple, AttentionPlan] = OrderedDict()
_PLANS_LOCK = threading.Lock()
_MAX_PLANS = 8


def _cached_plan(group, layout, causal, cu_seqlens, window_size) -> AttentionPlan:
    transport = transport_for(group)
    cu = host_cu_seqlens(cu_seqlens)
    try:
        # causal as given, with its type: neither "no" nor 1.0 may find the plan True built
        key = (transport.token, layout, type(causal), causal, cu, tuple(window_size))
        hash(key)
    except Exception:  # noqa: BLE001 - bad arguments: an uncached plan, refused by validation
        return AttentionPlan(layout, transport, causal, cu, window_size)
    with _PLANS_LOCK:
        found = _PLANS.get(key)
        if found is not None:
            _PLANS.move_to_end(key)
            return found
    made = AttentionPlan(layout, transport, causal, cu, window_size)
    with _PLANS_LOCK:
        _PLANS[key] = made
        while len(_PLANS) > _MAX_PLANS:
            _PLANS.popitem(last=False)
    return made


def _refuse_contradictions(p: AttentionPlan, group, layout, causal, cu_seqlens, window_size) -> None:
    """With a plan, an argument the plan fixes may only be left out. Same on every rank (SPMD)."""
    given = [name for name, value, default in (("group", group, _GROUP), ("layout", layout, _LAYOUT),
                                               ("causal", causal, _CAUSAL), ("window_size", window_size, _WINDOW))
             if value is not default]
    if cu_seqlens is not None:
        given.append("cu_seqlens")
    if given:
        raise ValueError(f"ring_attention got plan= and also {', '.join(given)}, which the plan fixes ({p!r}); "
                         "build the plan with them (cp_attention.plan(...)) and pass only plan=")


def _strategy(plan: AttentionPlan, cp_comm_type: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """The strategy a validated call runs: ``"p2p"`` alone (nothing travels), the cost model's pick for
    ``"auto"``, else the one named. Raises ``ValueError`` (on every rank alike) for one the group or
    the head count cannot run."""
    if plan.world_size == 1:
        return "p2p"
    if cp_comm_type == "auto":
        from .strategies.auto import auto_comm_type

        return auto_comm_type(plan, q, k, v)
    problem = strategy_problem(plan.transport, cp_comm_type, q.shape[2])
    if problem is not None:
        raise ValueError(f"ring_attention: {problem}")
    return cp_comm_type


@eager_only
def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group=_GROUP,
    layout: str | Layout = _LAYOUT,
    causal: bool = _CAUSAL,
    softmax_scale: float | None = None,
    kernel: str = "auto",
    return_lse: bool = False,
    sinks: torch.Tensor | None = None,
    softcap: float | None = 0.0,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    window_size: tuple[int, int] = _WINDOW,
    plan: AttentionPlan | None = None,
    cp_comm_type: str = "p2p",
):
    """Exact attention over a sequence sharded across the ranks of ``group``.

    Args:
        q: ``[batch, local_seq, heads, head_dim]``, this rank's query shard.
        k, v: ``[batch, local_seq, kv_heads, head_dim]`` / ``[..., v_head_dim]``; ``heads`` must be a
            multiple of ``kv_heads`` (GQA/MQA). K/V travel with their own heads.
        group: process group; ``None`` is the default group, and without torch.distributed (or with
            world size 1) this is plain attention.
        layout: name or :class:`Layout` the caller used to shard q, k and v.
        causal: causal mask over GLOBAL positions.
        softmax_scale: defaults to ``head_dim ** -0.5``.
        kernel: ``"auto"`` (each block on the fastest kernel that takes it, by the declared table of
            :mod:`cp_attention.kernels.choice`: cuDNN for dense blocks from sm90 on, flash's varlen op for
            packed documents, its own windows), ``"cpu_flash"`` (alias ``"sdpa"``), ``"flash"``,
            ``"flash_attn"``, ``"efficient"``, ``"cudnn"`` or ``"math"``. A named kernel runs every block,
            so one that would be given a block it refuses (cuDNN and a one-token side) raises.
        return_lse: also return the log-sum-exp, which is differentiable like ``out`` (a bool, the same on
            every rank: an all-to-all strategy sends it back only when asked).
        sinks: ``[heads]``, one learned logit per query head added to every softmax denominator
            (attention sinks: GPT-OSS ``s_aux``; a zero tensor is the "off-by-one" softmax). It is
            differentiable; each rank's gradient is its own queries' share, so summing it over the
            group (as for every other parameter) gives the gradient without CP.
        softcap: flash-attn's logit softcapping (Gemma2's ``attn_logit_softcapping``): scaled scores
            become ``softcap * tanh(scores / softcap)``; 0 or None disables it. ``kernel="auto"`` picks a
            kernel that supports it; a named kernel that cannot raises, naming one that can.
        cu_seqlens: packed documents, flash-attn's ``[0, l1, l1+l2, ..., T]`` over the full packed
            sequence (the same on every rank; an int tensor or sequence, read on the host). A token
            then attends only within its document (causal or not). q, k, v are ``[1, T/N, ...]``,
            sharded with ``layout.shard(..., cu_seqlens=cu_seqlens)``; only T must split, never a document.
        window_size: ``(left, right)`` sliding window, flash-attn's convention: a query at global
            position i sees key j iff ``i - left <= j <= i + right`` (and ``j <= i`` when causal); -1
            is unbounded. Positions are within documents when packed. Blocks and ring steps wholly
            outside the window are skipped: the ring stops after the last shard any rank needs.
        plan: the batch's :func:`plan`, built once per batch and passed to every layer's call: the
            layout, group, causal, documents and window come from it (passing any of them too raises),
            and nothing that depends only on them is derived again. Without it, the call finds (or
            builds) a plan itself, reading ``cu_seqlens`` to the host on every call.
        cp_comm_type: how K/V travel (megatron-core's names); inputs, outputs and every feature above are
            the same for all. ``"p2p"``: the ring. ``"all_gather"``: every other shard's K/V gathered
            at once (more memory, no per-step latency); the backward sends dK/dV home in one
            reduce-scatter. ``"a2a"``: Ulysses; an all-to-all swaps sequence shards for head shards,
            attention runs over the whole sequence for heads/N heads, and a second all-to-all swaps back
            (needs heads divisible by N; K/V heads are repeated when fewer). ``"a2a+p2p"``: ``group`` is
            a 2-D ``DeviceMesh``: all-to-all inside dim 1, the ring across dim 0; the CP rank is the
            flattened (row-major) mesh rank, so shard with ``rank=mesh_rank, world_size=mesh.size()``.
            ``"auto"``: the cost model (:mod:`cp_attention.strategies.cost`) picks one per call shape.

    Returns:
        ``out [batch, local_seq, heads, v_head_dim]`` in q's dtype, differentiable in q, k, v (and sinks); with
        ``return_lse``, also ``lse [batch, heads, local_seq]`` (natural log; fp32, or fp64 for fp64 inputs;
        the sinks included).

    Raises:
        ValueError: bad shapes, dtypes, devices, head ratio, a length the layout cannot split,
            an unknown layout or kernel, sinks of the wrong shape, a negative softcap or a kernel that
            cannot apply it, bad ``cu_seqlens`` or a batch larger than 1 with them, a bad ``window_size``,
            arguments that differ between ranks (the plan's ``needs_only`` and ``return_lse`` too),
            ``plan=`` together with an argument the plan fixes, an unknown ``cp_comm_type``, or one the
            group or the head count cannot run.
            Raised on every rank of the group alike, before any ring communication.
    """

    if plan is None:
        group = None if group is _GROUP else group
        plan = _cached_plan(group, _given(layout, _LAYOUT), _given(causal, _CAUSAL), cu_seqlens,
                            _given(window_size, _WINDOW))
    else:
        _refuse_contradictions(plan, group, layout, causal, cu_seqlens, window_size)
    transport = plan.transport
    codes = tensor_codes(q, k, v, softmax_scale, kernel, sinks, softcap, cp_comm_type, return_lse)
    softcap = 0.0 if softcap is None else softcap  # transformers' and flash-attn's "no softcap"
    # A plan the group agreed on needs no new agreement for a new batch's boundaries: see trust_key.
    trusted = (*codes, *plan.trust_key) if plan.agreed else None
    validate_call(codes + list(plan.codes), plan.layout, transport, in_agreed_forward(transport), trusted, sinks)
    n = q.shape[1]
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    kern = plan.kernel(kernel, q.device, q.dtype, softcap > 0, q.shape[-1], v.shape[-1], n)
    strategy = _strategy(plan, cp_comm_type, q, k, v)
    if strategy != "p2p":
        out, lse = run_strategy(q, k, v, plan, strategy, kern, scale, float(softcap), sinks, return_lse)
        return (out, lse) if return_lse else out
    steps = plan.steps(n, kern, q.device, q.shape[-1], v.shape[-1])
    ring = RingSource(transport, steps, KernelSettings.of(kern, scale, softcap, packed=plan.packed),
                      first_step_tiles=plan.first_step_tiles(n), needs_index=plan.needs_index(n, q.device, len(steps)))
    out, lse = AttentionFunction.apply(q, k, v, ring, sinks)
    return (out, lse) if return_lse else out
