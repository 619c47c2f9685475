"""One plan per batch: everything the attention calls of a batch share, derived and checked once.

An :class:`AttentionPlan` holds the layout, this rank's transport (rank, world size), causal, the
packed documents' boundaries (read to the host once) and the sliding window, with their agreed
signature. This rank's ring steps, lowered to kernel tasks with their index tensors on the device,
are built on the first call that needs them (they depend on the local length and on whether the
kernel takes masks) and reused by every later layer; so are the window's normalisation and the
kernel choice. ``ring_attention(q, k, v, plan=plan)`` then does no per-batch work at all.
"""

from __future__ import annotations

import copy
from typing import Any, cast

import torch

from .._deprecated import warn_renamed
from ..checks.validation import (
    PLAN_FIELDS,
    agree_bound_plan,
    agree_plan,
    check_plan_table,
    plan_codes,
    trusted_plan_key,
)
from ..kernels import AttentionKernel, get_kernel
from ..layouts.base import Layout
from ..layouts.documents import cu_seqlens_tuple
from ..layouts.registry import get_layout
from ..schedules.blocks import BlockTask
from ..schedules.causal import get_schedule, rank_steps
from ..schedules.derived import block_schedules
from ..schedules.lowering import BatchSpec, VarlenSpec, lower_steps
from ..schedules.needs import rank_needs
from ..schedules.windows import Window, normalize_window
from ..transport.base import Seat, Transport
from ..transport.process_group import transport_for
from .doc_batch import DocBatch, upload
from .needs_index import StepIndex, step_indices
from .varlen_batch import VarlenBatch

__all__ = ["AttentionPlan", "build_plan", "host_cu_seqlens", "plan_ahead"]

Steps = tuple[tuple["BlockTask | DocBatch | VarlenBatch", ...], ...]


def host_cu_seqlens(cu_seqlens: Any) -> Any:
    """``cu_seqlens`` as a host tuple of ints when it can be read as one (a CUDA tensor costs one
    device sync), else as given: validation judges it on every rank alike."""
    if cu_seqlens is None:
        return None
    try:
        return cu_seqlens_tuple(cu_seqlens)
    except ValueError:
        return cu_seqlens


def _setting(name: str, doc: str) -> property:
    """A plan setting as given: reading it is free; assigning it re-derives the plan (:meth:`AttentionPlan._reset`)."""
    return property(lambda plan: plan._given[name], lambda plan, value: plan._reset(**{name: value}), doc=doc)


class AttentionPlan:
    """What is fixed for a batch of attention calls on one rank. Build it with :func:`build_plan`
    (``cp_attention.plan``) and pass it to every call: ``ring_attention(q, k, v, plan=plan)``.

    Constructing one never raises and never communicates: bad arguments are encoded in
    :attr:`codes` and judged by the group together (:func:`build_plan` does it at once, a call
    without a plan in its validation).

    Every setting that decides what travels (layout, causal, cu_seqlens, window_size, needs_only) is
    in :attr:`codes`, which the group agrees on when the plan is built or bound and which every call's
    signature carries. Assigning one (``plan.needs_only = False``) re-encodes the codes, drops what
    was derived from the old value and marks the plan unagreed: the next call agrees the new codes
    (one all-gather, as a new plan's first call), and ranks that assigned differently get the same
    ``ValueError`` there instead of exchanging different sizes.
    """

    def __init__(self, layout: Any, transport: Transport | Seat, causal: Any = True, cu_seqlens: Any = None,
                 window_size: Any = (-1, -1), *, agreed: bool = False, needs_only: Any = True) -> None:
        self._transport: Transport | Seat = transport
        self._given: dict[str, Any] = {}
        self._settle(layout=layout, causal=causal, cu_seqlens=cu_seqlens, window_size=window_size,
                     needs_only=needs_only)
        # The group agreed on these fields: by build_plan, or by an adapter's per-forward check.
        self.agreed = agreed

    layout = property(lambda plan: plan._layout, lambda plan, value: plan._reset(layout=value),
                      doc="The resolved :class:`Layout` (None for one validation refuses).")
    causal = _setting("causal", "Causal mask over global positions, as given.")
    cu_seqlens = _setting("cu_seqlens", "Packed documents' boundaries as a host tuple (or as given, if unreadable).")
    window_size = _setting("window_size", "The sliding window ``(left, right)``, as given.")
    needs_only = _setting("needs_only", "Send only the K/V rows another rank needs (see schedules.needs); False "
                                        "sends whole shards, as the ring did before: a benchmark's baseline.")

    @property
    def transport(self) -> Transport:
        """This rank's handle on its group (a :class:`~cp_attention.transport.base.Seat` until :meth:`bind`)."""
        # A Seat stands in for the group until bind: what an unbound plan reads of it (rank, world size,
        # host_agreement, token) it has.
        return cast(Transport, self._transport)

    @transport.setter
    def transport(self, value: Any) -> None:
        raise AttributeError("a plan's group is fixed when it is built: build a plan for the other group "
                             "(cp_attention.plan(..., group=)), or put one built ahead to work with plan.bind(group)")

    def _settle(self, **changes: Any) -> None:
        """Take ``changes`` to the settings: re-encode :attr:`codes` and drop what was derived from them."""
        if "cu_seqlens" in changes:
            changes["cu_seqlens"] = host_cu_seqlens(changes["cu_seqlens"])
        given = self._given = {**self._given, **changes}
        self.codes: tuple[int, ...] = tuple(plan_codes(given["layout"], given["causal"], given["cu_seqlens"],
                                                       given["window_size"], given["needs_only"]))
        if "layout" in changes:
            try:
                self._layout: Layout | None = get_layout(given["layout"])
            except (ValueError, TypeError):
                self._layout = None  # refused by validation, on every rank alike
        # The cache key of a call's agreed verdict, beyond its tensors: the plan's fields but the
        # document boundaries' fingerprint, so a new batch of the same length needs no new agreement.
        self.trust_key = trusted_plan_key(self.codes)
        # Derived lazily: the needs' device index per (length, device, steps) and plans per (causal,
        # window) (:meth:`variant`). What the strategies derive from a plan they keep themselves
        # (cp_attention.strategies.plan_cache), keyed by the settings it derives from.
        self._needs_index: dict[tuple, tuple] = {}
        self._variants: dict[tuple, AttentionPlan] = {}
        if set(changes) != {"needs_only"}:  # the rest depends on the mask and the layout only
            # per local length, (length, lowering mode, device), kernel query
            self._windows: dict[int, Window | None] = {}
            self._steps: dict[tuple, Steps] = {}
            self._kernels: dict[tuple, AttentionKernel] = {}

    def _reset(self, **changes: Any) -> None:
        """An assigned setting: the plan as if built with it, to be agreed again by its next call (its
        codes changed, so no verdict of the old ones covers them; see
        :func:`~cp_attention.checks.validation.validate_call`)."""
        codes = self.codes
        self._settle(**changes)
        if self.codes != codes:
            self.agreed = False

    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def world_size(self) -> int:
        return self.transport.world_size

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    def __repr__(self) -> str:
        docs = f", documents={len(self.cu_seqlens) - 1}" if self.packed else ""
        whole = "" if self.needs_only is True else f", needs_only={self.needs_only!r}"
        return (f"AttentionPlan(layout={getattr(self.layout, 'name', self.layout)!r}, rank={self.rank}, "
                f"world_size={self.world_size}, causal={self.causal}{docs}, window_size={self.window_size}{whole})")

    def variant(self, causal: Any = None, window_size: Any = None) -> AttentionPlan:
        """The same batch with another ``causal`` or sliding window (a model whose layers differ), built
        once per variant and shared by every layer that asks for it (None: this plan's value). The
        variant is as agreed as this plan: every call's signature still carries causal and the window.
        """
        causal = self.causal if causal is None else causal
        window_size = self.window_size if window_size is None else window_size
        key = (bool(causal), tuple(window_size))
        if key == (bool(self.causal), tuple(self.window_size)):
            return self
        found = self._variants.get(key)
        if found is None:
            found = self._variants[key] = AttentionPlan(self.layout, self.transport, causal, self.cu_seqlens,
                                                         window_size,
                                                        agreed=self.agreed, needs_only=self.needs_only)
        return found

    def window(self, local_len: int) -> Window | None:
        """The normalised window for a local length (None: no side restricts anything)."""
        window = self._windows.get(local_len)
        if window is None and local_len not in self._windows:
            window = self._windows[local_len] = normalize_window(
                self.window_size, bool(self.causal), local_len * self.world_size, self.cu_seqlens)
        return window

    def kernel(self, name: str, device: torch.device, dtype: torch.dtype, softcap: bool, head_dim: int,
               v_head_dim: int, local_len: int) -> AttentionKernel:
        """The kernel ``name`` resolves to for these inputs (see :func:`~cp_attention.kernels.get_kernel`), cached."""
        key = (name, device, dtype, softcap, head_dim, v_head_dim, local_len)
        kern = self._kernels.get(key)
        if kern is None:
            kern = self._kernels[key] = get_kernel(name, device, dtype, softcap=softcap,
                                                   mask=self.window(local_len) is not None, head_dim=head_dim,
                                                   v_head_dim=v_head_dim)
        return kern

    def steps(self, local_len: int, kernel: AttentionKernel, device: torch.device, head_dim: int,
              v_head_dim: int) -> Steps:
        """This rank's tasks per ring step for ``local_len`` local tokens, packed-document batches on
        ``device``: built once per (length, kernel kind, device), then reused by every call. A kernel
        that takes variable-length batches runs each step's documents as one call per mask kind; one
        that takes masks, small documents as padded batches."""
        mode = "plain"
        if self.packed and self.window(local_len) is None and kernel.supports_varlen \
                and kernel.supports_shape(head_dim, v_head_dim):
            mode = "varlen"
        elif self.packed and kernel.supports_mask:
            mode = "batched"
        key = (local_len, mode, device)
        steps = self._steps.get(key)
        if steps is None:
            steps = self._steps[key] = self._build_steps(local_len, mode, device)
        return steps

    def _build_steps(self, n: int, mode: str, device: torch.device) -> Steps:
        window = self.window(n)
        causal = bool(self.causal)
        schedule = get_schedule(self.layout)
        if not self.packed and window is None and schedule is not None:
            return tuple(rank_steps(self.layout, causal, self.rank, self.world_size, n))
        total = n * self.world_size
        blocks = block_schedules(self.layout, causal, self.world_size, total, self.cu_seqlens, window, rank=self.rank)
        lowered = lower_steps(blocks, batched=mode == "batched", tiled=window is None, local_len=n,
                              varlen=mode == "varlen")
        return tuple(tuple(_ready(t, device) for t in step) for step in lowered)

    def needs_index(self, local_len: int, device: torch.device, steps: int) -> tuple[StepIndex | None, ...]:
        """This rank's needs as device indices: per ring step (``steps`` of them), the rows it sends and
        receives, on ``device`` (None at step 0); ``()`` when whole shards travel (:attr:`needs_only`
        False). Built once per (length, device)."""
        if not self.needs_only or self.world_size == 1:
            return ()
        key = (local_len, device, steps)
        found = self._needs_index.get(key)
        if found is None:
            needs = rank_needs(self.layout, bool(self.causal), self.world_size, local_len * self.world_size,
                               self.cu_seqlens, self.window(local_len), self.rank, steps)
            found = self._needs_index[key] = step_indices(needs, local_len, device)
        return found

    def traffic(self, local_len: int, device: torch.device, steps: int) -> tuple[StepIndex | None, ...]:
        """Deprecated (one release): :meth:`needs_index`."""
        warn_renamed("AttentionPlan.traffic", "AttentionPlan.needs_index")
        return self.needs_index(local_len, device, steps)

    def bind(self, group=None, device: torch.device | str | None = None) -> AttentionPlan:
        """Put a plan built ahead of the step (:func:`plan_ahead`) to work on ``group``: one agreement
        with the group (as :func:`build_plan`'s), then its host-built steps and needs index are moved to
        ``device`` (non-blocking, from pinned memory where there is a GPU). Returns this plan.

        Raises ``ValueError`` on every rank alike if any rank's plan differs from another's or was built
        for another rank or world size than it holds in ``group``.
        """
        transport = transport_for(group)
        agree_bound_plan(transport, self.codes, (self.transport.rank, self.transport.world_size), self.layout)
        self._transport, self.agreed = transport, True
        if device is not None and _device(device).type != "cpu":  # host-built entries already run on the CPU
            device = _device(device)
            memo: dict[int, Any] = {}
            self._steps = {(n, mode, device if dev.type == "cpu" else dev):
                           _moved(steps, device, memo) if dev.type == "cpu" else steps
                           for (n, mode, dev), steps in self._steps.items()}
            self._needs_index = {(n, device if dev.type == "cpu" else dev, k):
                                 _moved(index, device, memo) if dev.type == "cpu" else index
                                 for (n, dev, k), index in self._needs_index.items()}
        return self

    def first_step_tiles(self, local_len: int) -> bool:
        """Whether step 0's tasks cover every query and key row exactly once (packed documents without a
        window), so the engine writes its results instead of merging them."""
        return self.packed and self.window(local_len) is None


def _ready(task: Any, device: torch.device) -> Any:
    """A lowered task as the engine runs it: batch specs get their index tensors on ``device``."""
    if isinstance(task, BatchSpec):
        return DocBatch(task, device)
    if isinstance(task, VarlenSpec):
        return VarlenBatch(task, device)
    return task


def _device(device: torch.device | str) -> torch.device:
    """``device`` as a tensor's ``.device`` reads (``"cuda"`` is the current CUDA device)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _moved(obj: Any, device: torch.device, memo: dict[int, Any] | None = None) -> Any:
    """A copy of host-built ``obj`` (tasks, batches, index rows; tuples, lists, dicts and objects of
    them, at any depth) whose tensors are on ``device``, uploaded as the plan's own uploads are. What
    holds no tensor is shared, and what is shared stays shared (one upload per tensor)."""
    memo = {} if memo is None else memo
    found = memo.get(id(obj))
    if found is not None:
        return found
    out = obj
    if isinstance(obj, torch.Tensor):
        out = upload(obj, device)
    elif isinstance(obj, (tuple, list)):
        items = [_moved(o, device, memo) for o in obj]
        if any(a is not b for a, b in zip(items, obj)):
            out = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    elif isinstance(obj, dict):
        entries = {k: _moved(v, device, memo) for k, v in obj.items()}
        if any(entries[k] is not v for k, v in obj.items()):
            out = entries
    elif hasattr(obj, "__dict__") and not callable(obj) and not isinstance(obj, type):
        values = {name: _moved(value, device, memo) for name, value in vars(obj).items()}
        if any(values[name] is not value for name, value in vars(obj).items()):
            out = copy.copy(obj)
            for name, value in values.items():
                object.__setattr__(out, name, value)
    memo[id(obj)] = out
    return out


def plan_ahead(layout: str | Layout = "zigzag", rank: int = 0, world_size: int = 1, causal: bool = True,
           cu_seqlens=None, window_size: tuple[int, int] = (-1, -1), *, local_len: int,
           kernel: str = "auto", device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16,
           head_dim: int = 128, v_head_dim: int | None = None, softcap: bool = False,
           needs_only: bool = True) -> AttentionPlan:
    """Build rank ``rank``'s plan of one batch ahead of the step, with no process group (in a data
    loader's worker or a collator): the ring steps, their lowering and index tensors, and the
    needs (:meth:`AttentionPlan.needs_index`) are built on the host, for calls of ``local_len``
    tokens on ``device`` with the kernel ``kernel`` resolves to for ``dtype`` and the head dims. The
    plan pickles, so a worker can return it with the batch. In the step, ``plan.bind(group, device)``
    (one agreement) makes it the batch's plan: ``ring_attention(q, k, v, plan=plan)`` then builds
    nothing. ``needs_only`` as for :func:`build_plan` (bind agrees it with the rest).

    Raises ``ValueError`` for arguments :func:`build_plan` refuses (checked here on this rank; the
    group judges them together in :meth:`AttentionPlan.bind`).
    """
    seat = Seat(rank, world_size)
    plan = AttentionPlan(layout, seat, causal, cu_seqlens, window_size, needs_only=needs_only)
    check_plan_table([PLAN_FIELDS.decode(plan.codes)] * seat.world_size, plan.layout)
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    kern = plan.kernel(kernel, torch.device(device), dtype, softcap, head_dim, v_head_dim, local_len)
    host = torch.device("cpu")
    steps = plan.steps(local_len, kern, host, head_dim, v_head_dim)
    plan.needs_index(local_len, host, len(steps))
    return plan


def build_plan(layout: str | Layout = "zigzag", group=None, causal: bool = True, cu_seqlens=None,
               window_size: tuple[int, int] = (-1, -1), *, needs_only: bool = True) -> AttentionPlan:
    """The plan of one batch on this rank, agreed across ``group``: build it once per batch and pass
    it to every attention call (``ring_attention(q, k, v, plan=plan)``).

    Args mean what they mean for :func:`~cp_attention.ring_attention`. ``cu_seqlens`` is read to the
    host here, once (one device sync for a CUDA tensor). ``needs_only=False`` sends whole K/V shards
    (and dK/dV partials) instead of only the rows each rank needs: the benchmarks' baseline.

    Raises ``ValueError`` on every rank of the group alike, after one small all-gather (skipped when
    the group agreed on the same plan fields before; on gloo only once a fingerprint of every rank's
    fields, compared over P2P, shows them the same), for an unknown layout, a non-bool ``causal`` or
    ``needs_only``, bad ``cu_seqlens`` or ``window_size``, a packed length the layout cannot split, or
    arguments that differ between ranks.
    """
    transport = transport_for(group)
    plan = AttentionPlan(layout, transport, causal, cu_seqlens, window_size, needs_only=needs_only)
    agree_plan(transport, plan.codes, plan.layout)
    plan.agreed = True
    return plan
