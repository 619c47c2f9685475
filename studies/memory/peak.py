"""A true peak-memory meter: the peak of live tensor bytes through the allocator over a training step, and
what was live at that peak, attributed to the model's parts by the op that allocated each block.

CPU: ``torch.profiler`` with ``profile_memory=True`` reports every allocation and free of the CPU allocator
(which caches nothing: a freed block is gone). :func:`replay` walks those events in time order, keeping the
running sum of live bytes, its peak, and the peak of each region of the step (the forward; the loss's
backward; each decoder layer's backward; ...). CUDA: the same events (the caching allocator reports block
allocations and frees), and ``torch.cuda.max_memory_allocated`` as the headline, which the replay must match.

Attribution: module scopes are marked with ``record_function`` ranges from forward pre/post hooks (so a
checkpoint's recompute is marked too); an allocation inside a module's range belongs to that module; one made
by a backward node belongs to the module whose forward op created that node (the profiler gives both the same
sequence number); gradients still live when the step ends are ``params+grads``. Each module maps to a term
(:data:`TERMS`). Allocations a memory saver makes on the host on purpose (offloaded checkpoints: an op inside a
``cp_attention::offload`` range, see ``--offload-scope``) are counted apart as ``offloaded (host)`` and are
not part of the device peak: on a GPU they would not be device memory.

Nothing here changes what the step holds: the hooks only open and close profiler ranges.
"""

from __future__ import annotations

import re
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch.autograd.profiler import record_function

__all__ = ["TERMS", "OFFLOADED", "OFFLOAD_SCOPE", "Snapshot", "Peak", "term_of", "module_scopes", "measure_step",
           "replay"]

MIB = 1024 * 1024
TERMS = ("logits/loss", "attention", "MLP", "norms", "checkpoints", "params+grads", "other")
OFFLOADED = "offloaded (host)"
OFFLOAD_SCOPE = "cp_attention::offload"  # a profiler range around a saver's copies to the host
_MODULE = "cpm.module:"
_PHASE = "cpm.phase:"
_BACKWARD_NODE = "autograd::engine::evaluate_function: "
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def term_of(path: str | None) -> str:
    """The term of a module path (``model.layers.0.self_attn.q_proj``): ``None`` (no module: the loss
    outside the model, or the lm_loss's own head) and the CausalLM root and its head are ``logits/loss``; a
    decoder layer's own ops (its residual adds: the layer outputs, which are the next layer's checkpoint)
    are ``checkpoints``."""
    if path is None or path == "" or path.split(".")[-1] in ("lm_head", "score"):
        return "logits/loss"
    if ".self_attn" in path + "." and _LAYER.search(path):
        return "attention"
    if ".mlp" in path + "." and _LAYER.search(path):
        return "MLP"
    if path.split(".")[-1].endswith("norm"):
        return "norms"
    if re.search(r"layers\.\d+$", path):
        return "checkpoints"
    return "other"  # the embedding's output, rotary cos/sin, masks


def region_of(phase: str, path: str | None, term: str) -> str:
    """Where in the step an allocation happened: ``forward``/``backward`` and the part of the model."""
    m = _LAYER.search(path or "")
    where = f"layer {m.group(1)}" if m else ("head+loss" if term == "logits/loss" else "rest")
    return f"{phase} {where}"


@contextmanager
def module_scopes(model: torch.nn.Module) -> Iterator[None]:
    """Mark every module's forward (and a checkpoint's recompute of it) with a profiler range
    ``cpm.module:<path>``."""
    handles, stack = [], []

    def pre(name):
        def hook(module, args):
            rf = record_function(_MODULE + name)
            rf.__enter__()
            stack.append(rf)
        return hook

    def post(module, args, out):
        if stack:
            stack.pop().__exit__(None, None, None)

    # No hooks on the LM head: lm_loss applies the head itself and refuses hooks it cannot run. Its
    # allocations then fall in the root's scope, which term_of maps to "logits/loss" as it does "lm_head".
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    for name, module in model.named_modules():
        if module is head:
            continue
        handles.append(module.register_forward_pre_hook(pre(name)))
        handles.append(module.register_forward_hook(post, always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        while stack:
            stack.pop().__exit__(None, None, None)


@dataclass
class Snapshot:
    """Bytes live at one moment, by term (``TERMS`` and ``OFFLOADED``), plus which of them are vocab-sized."""

    total: int
    terms: dict
    vocab_bytes: int = 0  # of ``terms["logits/loss"]``: blocks whose size is a multiple of the vocab

    def mib(self) -> dict:
        return {k: v / MIB for k, v in self.terms.items()}


@dataclass
class Peak:
    """One step's memory: the device peak (live tensor bytes, the live-before bytes included), the snapshot
    at it, the peak of each region, the host bytes offloaded at the device peak and at their own peak."""

    peak: int
    at_peak: Snapshot
    regions: dict = field(default_factory=dict)  # region -> Snapshot at that region's peak
    host_peak: int = 0
    before: int = 0  # bytes live when the step began (parameters, the batch)
    window_peak: int = 0  # peak of (device + host) bytes allocated within the step, for the RSS cross-check
    allocator_peak: int | None = None  # CUDA: max_memory_allocated (the replay is checked against it)
    events: int = 0
    top: list = field(default_factory=list)  # the largest (term, op, bytes, blocks) groups live at the peak
    top_layers: list = field(default_factory=list)  # the same at the peak of the layers' backward


def _ancestors(e):
    p = e.parent
    while p is not None:
        yield p
        p = p.parent


def _forward_modules(events: list) -> tuple[list, dict]:
    """Every allocation event, and each op sequence number's module path (``None``: no module; ``("via",
    n)``: an op run inside the backward of node ``n``, e.g. a custom Function's recompute)."""
    from torch._C._profiler import _EventType

    allocs, seq_path, stack = [], {}, list(events)
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation:
            allocs.append(e)
        elif e.tag == _EventType.TorchOp and e.extra_fields.sequence_number >= 0 \
                and not e.name.startswith(_BACKWARD_NODE):  # forward ops, and a recompute's in backward
            seq = e.extra_fields.sequence_number
            for a in _ancestors(e):  # the nearest module range or backward node
                if a.name.startswith(_MODULE):
                    seq_path.setdefault(seq, a.name[len(_MODULE):])
                    break
                if a.name.startswith(_BACKWARD_NODE):
                    if a.extra_fields.sequence_number != seq:  # not the node's own op (it has the node's number)
                        seq_path.setdefault(seq, ("via", a.extra_fields.sequence_number))
                    break
            else:
                seq_path.setdefault(seq, None)
    allocs.sort(key=lambda e: (e.start_time_ns, e.id))
    return allocs, seq_path


def _classify(e, seq_path: dict, device: str, offload_scope: str) -> tuple[str, str | None, str]:
    """(phase, module path, term) of one allocation: the nearest module range or backward node decides."""
    phase, path, term, decided, offloaded = "other", None, None, False, False
    for a in _ancestors(e):  # innermost first
        if a.name.startswith(_PHASE):
            phase = a.name[len(_PHASE):]
        elif a.name == offload_scope:
            offloaded = True
        elif decided:
            continue
        elif a.name.startswith(_MODULE):
            path, decided = a.name[len(_MODULE):], True
        elif a.name.startswith(_BACKWARD_NODE):
            decided, seq = True, a.extra_fields.sequence_number
            if "AccumulateGrad" in a.name:
                term = "params+grads"
            elif seq not in seq_path:
                term = "other"  # a node whose forward op ran before the measured step
            else:
                path = seq_path[seq]
                for _ in range(16):  # through ops run inside other nodes' backward, to a forward op
                    if not isinstance(path, tuple):
                        break
                    path = seq_path.get(path[1])
                path = None if isinstance(path, tuple) else path
    if offloaded or e.extra_fields.device.type != device:  # a saver's copy to the host; a GPU step's host block
        term = OFFLOADED
    if term is None:  # no module and no node: the loss outside the model (forward), the gradient's seed (backward)
        term = term_of(path) if decided or phase == "forward" else "other"
    return phase, path, term


def replay(events_root: list, before: int, grad_ptrs: set, vocab: int, device: str,
           offload_scope: str = OFFLOAD_SCOPE) -> Peak:
    """Replay the profiler's allocation events in time order; see the module docstring.

    ``events_root``: ``prof.profiler.kineto_results.experimental_event_tree()``; ``before``: bytes live when
    profiling began (counted in every total, as ``params+grads``); ``grad_ptrs``: the data pointers of the
    gradients after backward; ``device``: ``"cpu"`` or ``"cuda"`` (the allocations that count).
    """
    allocs, seq_path = _forward_modules(events_root)
    info = [(e, *_classify(e, seq_path, device, offload_scope)) for e in allocs]

    # Blocks still live at the end whose pointer is a gradient's are params+grads, wherever they came from.
    live_at_end: dict[int, int] = {}
    for i, (e, *_rest) in enumerate(info):
        if e.extra_fields.alloc_size > 0:
            live_at_end[e.extra_fields.ptr] = i
        else:
            live_at_end.pop(e.extra_fields.ptr, None)
    for ptr, i in live_at_end.items():
        if ptr in grad_ptrs and info[i][3] != OFFLOADED:
            info[i] = info[i][:3] + ("params+grads",)

    totals: dict[str, int] = defaultdict(int)
    totals["params+grads"] = before
    live: dict[int, tuple[int, str, bool]] = {}
    vocab_live = 0
    device_now, host_now, window_now = before, 0, 0
    best = Peak(before, Snapshot(before, dict(totals)), before=before)
    for e, phase, path, term in info:
        size, ptr = e.extra_fields.alloc_size, e.extra_fields.ptr
        if size > 0:
            is_vocab = term == "logits/loss" and size % vocab == 0
            live[ptr] = (size, term, is_vocab)
        else:
            if ptr not in live:  # allocated before profiling began (counted in ``before`` or not at all)
                continue
            size, term, is_vocab = live.pop(ptr)
            size = -size
        totals[term] += size
        vocab_live += size if is_vocab else 0
        window_now += size
        if term == OFFLOADED:
            host_now += size
        else:
            device_now += size
        best.window_peak = max(best.window_peak, window_now)
        best.host_peak = max(best.host_peak, host_now)
        if size <= 0:
            continue
        if device_now > best.peak:
            best.peak, best.at_peak = device_now, Snapshot(device_now, dict(totals), vocab_live)
        region = region_of(phase, path, term)
        if device_now > best.regions.get(region, Snapshot(-1, {})).total:
            best.regions[region] = Snapshot(device_now, dict(totals), vocab_live)
    best.events = len(info)
    best.top = _top_at(info, best.peak, before)
    layers = [k for k in best.regions if k.startswith("backward layer")]
    if layers:  # the layers' backward: what binds at a wider model once the loss is chunked
        best.top_layers = _top_at(info, max(best.regions[k].total for k in layers), before)
    return best


def _op_of(e) -> str:
    """The allocating op: the nearest ancestor that is an aten op or a backward node, with the backward node."""
    names = [a.name for a in _ancestors(e)]
    op = next((n for n in names if n.startswith("aten::")), names[0] if names else "?")
    node = next((n[len(_BACKWARD_NODE):] for n in names if n.startswith(_BACKWARD_NODE)), None)
    return f"{op} in {node}" if node else op


def _top_at(info: list, peak: int, before: int, k: int = 12) -> list:
    """The ``k`` largest (term, op) groups of the blocks live at the first moment the device total hits
    ``peak``: ``[(term, op, bytes, blocks), ...]``."""
    live: dict[int, tuple] = {}
    now = before
    for e, _phase, _path, term in info:
        size, ptr = e.extra_fields.alloc_size, e.extra_fields.ptr
        if size > 0:
            live[ptr] = (size, term, e)
            now += size if term != OFFLOADED else 0
        elif ptr in live:
            old = live.pop(ptr)
            now -= old[0] if old[1] != OFFLOADED else 0
        if now == peak and size > 0:
            break
    groups: dict = defaultdict(lambda: [0, 0])
    for size, term, e in live.values():
        g = groups[(term, _op_of(e))]
        g[0] += size
        g[1] += 1
    return sorted(((t, op, b, n) for (t, op), (b, n) in groups.items()), key=lambda x: -x[2])[:k]


def _storages_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if t is not None:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def measure_step(model: torch.nn.Module, forward_loss, vocab: int,
                 offload_scope: str = OFFLOAD_SCOPE) -> Peak:
    """Profile one forward (``loss = forward_loss()``) and backward of ``model`` and :func:`replay` it.

    The gradients must be ``None`` on entry (the first step, or after ``zero_grad(set_to_none=True)``);
    they are left in place. ``before`` = the parameters' bytes (the only large tensors live at entry).
    """
    from torch.profiler import ProfilerActivity, profile

    device = next(model.parameters()).device.type
    if any(p.grad is not None for p in model.parameters()):
        raise ValueError("measure_step: the parameters hold gradients; call zero_grad(set_to_none=True) first, "
                         "so the step's gradients are counted as they are allocated")
    before = _storages_bytes(model.parameters())
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    with module_scopes(model), profile(activities=activities, profile_memory=True) as prof:
        with record_function(_PHASE + "forward"):
            loss = forward_loss()
        with record_function(_PHASE + "backward"):
            loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
    grad_ptrs = {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
    peak = replay(prof.profiler.kineto_results.experimental_event_tree(), before, grad_ptrs, vocab, device,
                  offload_scope)
    if device == "cuda":
        peak.allocator_peak = torch.cuda.max_memory_allocated()
    return peak
