"""Running cp_attention's CUDA path without a GPU: every tensor the library sees is a FakeTensor on
``cuda:0`` (torch's FakeTensorMode: aten ops run their meta/fake kernels, giving the real output
shapes, dtypes and strides and no data), through the ring on the in-process loopback transport.
Used by ``tests/test_fake_cuda.py`` (issue 23); the method is the shared ``tools/fake_cuda_trace.py``'s.

What is patched, none of it in cp_attention's source, all of it undone by the caller's
``pytest.MonkeyPatch`` (and :meth:`FakeCuda.close`) except P1:

  P1  a no-op CUDA DeviceGuard registered from C++ (torch.utils.cpp_extension.load, a few seconds to
      build once under the system temp dir): on a CPU-only build, indexing a fake CUDA tensor from Python
      (``t[:, a:b]``) otherwise raises "PyTorch is not linked with support for cuda devices". It cannot
      be unregistered; it changes nothing for real tensors (``torch.cuda.is_initialized()`` stays
      False, and creating a real CUDA tensor still fails).
  P2  ``aten::_efficient_attention_backward``'s Meta kernel replaced by one with the op's real argument
      list (torch 2.13's ``meta__efficient_attention_backward`` lacks ``out``, so every schema-correct
      call failed in fake mode with "got multiple values for argument 'scale'"); only when broken.
  P3  host-side planning on CPU index tensors runs outside fake mode (real CPU tensors):
      ``engine.plan.block_plans`` / ``lower_steps`` / ``_ready`` (a lowered step's DocBatch or
      VarlenBatch, whose ``upload`` alone runs in the fake mode), ``engine.doc_batch._make_bucket``,
      ``RingFault._failed_rank`` and validation's ``digests_agree`` (P2P agreements on CPU int64
      tensors over the loopback; they read only CPU tensors). ``Tensor.pin_memory`` returns the tensor
      itself (a CPU build cannot pin) and marks it pinned, so the watcher can tell an upload from
      pinned memory (truly asynchronous) from one from pageable memory (the host waits).
      ``engine.plan.cu_seqlens_tuple`` reads a fake CUDA ``cu_seqlens`` made by
      :meth:`FakeCuda.cuda_holding` from the host tensor it stands for, after a ``.cpu()`` that the
      watcher logs as the device read a real one costs.
  P4  loopback ranks run one at a time: the group's condition variable gets a process-wide RLock that
      a rank thread holds while it runs and releases only while it waits for a message
      (FakeTensorMode is not thread-safe).
  P5  the autograd engine is not used (on a CPU-only build it refuses CUDA tensors):
      ``cp_attention.api.RingAttentionFunction`` is replaced by an object whose ``apply`` calls
      ``RingAttentionFunction.forward`` with a minimal ctx; the test calls ``.backward`` itself.
  P6  ``torch.cuda.is_initialized`` -> True, ``torch.cuda.get_device_capability`` -> (9, 0) and
      ``torch.cuda.current_device`` -> 0, for the kernels' capability questions (an H100).
  P7  the kernel modules' ``_aten`` is a :class:`CheckedAten`: each fused-op call is bound to the real
      op's schema (extra, missing or unknown arguments fail), checked against what the CUDA code
      checks or assumes (metadata only), counted, and then run (the real op's fake kernel).

:class:`SyncWatch` (a dispatch mode under the fake mode) records every host read of device data
(``.item()``, ``.tolist()``, ``bool(t)``, ``nonzero``, a cuda->cpu copy) and every host->device copy,
with the cp_attention file:line that made it.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import shutil
import tempfile
import threading
import traceback
import weakref
from collections import Counter
from typing import Any, Callable, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten
_LIB_DIR = os.sep + "cp_attention" + os.sep
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ------------------------------------------------------------------------------------------- P1
# A shared library whose static initialiser registers the guard when none is (a few seconds to build:
# only c10 headers, no Python module).
_GUARD_SRC = r'''
#include <c10/core/impl/DeviceGuardImplInterface.h>
namespace {
struct InstallNoOpCudaGuard {
  InstallNoOpCudaGuard() {
    if (!c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA)) {
      static c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::CUDA> impl;
      c10::impl::registerDeviceGuard(c10::DeviceType::CUDA, &impl);
    }
  }
} install;
}  // namespace
'''
_GUARD: dict = {}


def _fake_cuda_indexing_works() -> bool:
    try:
        with FakeTensorMode():
            torch.empty(2, 4, device="cuda")[:, 1:3]
        return True
    except Exception:  # noqa: BLE001 - "PyTorch is not linked with support for cuda devices"
        return False


def cuda_guard_problem() -> Optional[str]:
    """None once fake CUDA tensors can be indexed from Python (a CUDA build has a guard; a CPU build
    gets the no-op one, compiled once under the system temp dir); else why not (a skip reason naming
    what is missing)."""
    if "problem" in _GUARD:
        return _GUARD["problem"]
    problem = None
    if not _fake_cuda_indexing_works():
        from torch.utils import cpp_extension
        compiler = os.environ.get("CXX", "c++")
        if shutil.which(compiler) is None:
            problem = f"no C++ compiler on PATH ({compiler!r}; $CXX names another) to build the no-op CUDA device guard"
        elif not cpp_extension.is_ninja_available():
            problem = "ninja is not installed: torch.utils.cpp_extension needs it to build the no-op CUDA device guard"
        else:
            build = os.path.join(tempfile.gettempdir(), f"cp_attention_fake_cuda_guard_{torch.__version__}")
            os.makedirs(build, exist_ok=True)
            src = os.path.join(build, "noop_cuda_guard.cpp")
            if not os.path.exists(src) or open(src).read() != _GUARD_SRC:
                with open(src, "w") as f:
                    f.write(_GUARD_SRC)
            try:
                cpp_extension.load("cp_attention_noop_cuda_guard", [src], build_directory=build,
                                   is_python_module=False, verbose=False)
            except Exception as e:  # noqa: BLE001 - reported as the skip reason
                problem = f"building the no-op CUDA device guard failed: {type(e).__name__}: {str(e)[:300]}"
            else:
                if not _fake_cuda_indexing_works():
                    problem = ("the no-op CUDA device guard was built and loaded, but fake CUDA tensors still "
                               "cannot be indexed")
    _GUARD["problem"] = problem
    return problem


# ------------------------------------------------------------------------------------------- P2
def fix_efficient_backward_meta() -> "torch.library.Library | None":
    """A Meta kernel for ``aten::_efficient_attention_backward`` with the schema's arguments, if torch's
    lacks ``out``; the returned library's ``_destroy()`` restores torch's."""
    import torch._meta_registrations as meta
    original = getattr(meta, "meta__efficient_attention_backward", None)
    if original is None or "out" in inspect.signature(original).parameters:
        return None

    def fixed(grad_out, query, key, value, bias, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              logsumexp, dropout_p, philox_seed, philox_offset, custom_mask_type, bias_requires_grad, scale=None,
              num_splits_key=None, window_size=None, shared_storage_dqdkdv=False):
        return original(grad_out, query, key, value, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        logsumexp, dropout_p, philox_seed, philox_offset, custom_mask_type, bias_requires_grad,
                        scale, num_splits_key, shared_storage_dqdkdv)

    lib = torch.library.Library("aten", "IMPL", "Meta")
    lib.impl("_efficient_attention_backward", fixed)
    return lib


# ------------------------------------------------------------------------------------ the watcher
_SYNC_OPS = {aten._local_scalar_dense, aten.nonzero, aten.is_nonzero, aten.equal, aten.masked_select,
             aten.unique_consecutive, aten._unique2, aten.repeat_interleave, aten._assert_async, aten.allclose,
             aten.item}
_COPY_OPS = {aten._to_copy, aten.copy_, aten.copy}


def where_in_library() -> str:
    """``path:line (function)`` of the innermost cp_attention frame on the stack."""
    frames = [f for f in traceback.extract_stack() if _LIB_DIR in f.filename]
    if not frames:
        return "?"
    f = frames[-1]
    return f"{os.path.relpath(f.filename, _REPO)}:{f.lineno} ({f.name})"


_PINNED: "dict[int, weakref.ref]" = {}  # by id: tensors compare elementwise, so no WeakSet


def _pin_memory(self, *args, **kwargs):  # P3: a CPU build cannot pin; mark instead
    _PINNED[id(self)] = weakref.ref(self, lambda _, key=id(self): _PINNED.pop(key, None))
    return self


def _is_pinned(t: torch.Tensor) -> bool:
    ref = _PINNED.get(id(t))
    return ref is not None and ref() is t


class SyncWatch(TorchDispatchMode):
    """Records, per phase, what a CUDA program would pay for on the host:

    - ``"d2h"``: a read of device data on the host (scalar reads, data-dependent shapes, cuda->cpu copies);
    - ``"h2d_blocking"``: a host->device copy the host waits for (``non_blocking=False``, or from pageable memory);
    - ``"h2d_async"``: a host->device copy from pinned memory with ``non_blocking=True``.

    ``events`` is a list of ``(phase, kind, what, where)``; set :attr:`phase` as the program goes on.
    The host values of small uploads are kept in ``values`` (the checks read uploaded offsets there).
    """

    def __init__(self, events: Optional[list] = None, values: "dict[int, torch.Tensor] | None" = None) -> None:
        super().__init__()
        self.events = [] if events is None else events
        self.phase = "?"
        self.values = values  # where to keep a copy of small uploads' host values, by the device tensor's id

    def _remember(self, src: torch.Tensor, outs: list) -> None:
        if self.values is None or src.numel() > 1 << 16:
            return
        with unset_fake_temporarily():
            real = src.detach().clone()
        for o in outs:
            self.values[id(o)] = real
            weakref.finalize(o, self.values.pop, id(o), None)

    def _log(self, kind: str, what: str) -> None:
        self.events.append((self.phase, kind, what, where_in_library()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in _SYNC_OPS and any(isinstance(a, torch.Tensor) and a.device.type == "cuda"
                                       for a in tree_leaves((args, kwargs))):
            self._log("d2h", str(func))
        out = func(*args, **kwargs)
        if packet in _COPY_OPS:
            outs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor)]
            src = args[1] if func.overloadpacket in (aten.copy_, aten.copy) else args[0]
            if not isinstance(src, torch.Tensor):
                return out
            if src.device.type == "cuda" and any(o.device.type == "cpu" for o in outs):
                self._log("d2h", f"cuda->cpu copy {func}")
            elif src.device.type == "cpu" and any(o.device.type == "cuda" for o in outs):
                if func.overloadpacket is aten._to_copy:
                    nb = kwargs.get("non_blocking", False)
                else:
                    nb = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
                self._remember(src, [o for o in outs if o.device.type == "cuda"])
                pinned = _is_pinned(src)
                if nb and pinned:
                    self._log("h2d_async", f"{func} {tuple(src.shape)} {src.dtype}")
                else:
                    why = "non_blocking=False" if not nb else "from pageable (unpinned) memory"
                    self._log("h2d_blocking", f"{func} {tuple(src.shape)} {src.dtype} ({why})")
        return out


def summarize(events: list, kinds=("d2h", "h2d_blocking"), phases=None) -> list[str]:
    """``"kind what at file:line (phase)"`` of the events of ``kinds`` in ``phases`` (None: all), deduplicated."""
    seen = []
    for phase, kind, what, where in events:
        if kind in kinds and (phases is None or phase in phases):
            line = f"{kind}: {what} at {where} [{phase}]"
            if line not in seen:
                seen.append(line)
    return seen


# --------------------------------------------------------------------------- P7 precondition checks
def _round(n, m):
    return -(-n // m) * m


def bind(name: str, args, kwargs) -> dict:
    """The arguments of a call of ``aten.<name>`` by the op's schema; TypeError for what it rejects."""
    schema = getattr(aten, name).default._schema
    positional = [a for a in schema.arguments if not a.kwarg_only]
    names = {a.name for a in schema.arguments}
    if len(args) > len(positional):
        raise TypeError(f"{name}: {len(args)} positional arguments, the schema has {len(positional)}")
    bound = {a.name: v for a, v in zip(positional, args)}
    for k, v in kwargs.items():
        if k in bound or k not in names:
            raise TypeError(f"{name}: bad keyword argument {k!r}")
        bound[k] = v
    for a in schema.arguments:
        if a.name not in bound:
            if not a.has_default_value():
                raise TypeError(f"{name}: missing argument {a.name!r}")
            bound[a.name] = a.default_value
    return bound


HALF = (torch.float16, torch.bfloat16)


def _varlen_checks(a, q, k, cu_q_name, cu_k_name, max_q_name, max_k_name, values):
    """flash_api.cpp mha_varlen_fwd / mha_varlen_bwd on the offsets: int32, contiguous, on the device,
    one sequence count; with their values known (uploaded by the plan), well formed, the max lengths
    at least the longest sequence, causal sequences square (the op's causal mask is bottom-right)."""
    cu_q, cu_k = a[cu_q_name], a[cu_k_name]
    yield cu_q is not None and cu_k is not None, "cum_seq_q and cum_seq_k both given"
    if cu_q is None or cu_k is None:
        return
    yield all(c.dtype == torch.int32 and c.dim() == 1 and c.is_contiguous() and c.device.type == "cuda"
              for c in (cu_q, cu_k)), "cu_seqlens int32, 1-D, contiguous, on the device"
    yield cu_q.numel() == cu_k.numel() >= 2, f"one batch size: {cu_q.numel()} vs {cu_k.numel()} offsets"
    yield q.dim() == 3 and k.dim() == 3, "varlen q/k/v are [total, H, D]"
    yield isinstance(a[max_q_name], int) and isinstance(a[max_k_name], int), "max lengths are host ints"
    vq, vk = values.get(id(cu_q)), values.get(id(cu_k))
    if vq is None or vk is None:
        yield False, "cu_seqlens values unknown (not uploaded from the host by the plan)"
        return
    dq, dk = (vq[1:] - vq[:-1]).tolist(), (vk[1:] - vk[:-1]).tolist()
    yield int(vq[0]) == 0 and int(vk[0]) == 0 and min(dq) >= 0 and min(dk) >= 0, "offsets from 0, nondecreasing"
    yield int(vq[-1]) == q.shape[0] and int(vk[-1]) == k.shape[0], \
        f"offsets end at the totals: {int(vq[-1])}/{q.shape[0]}, {int(vk[-1])}/{k.shape[0]}"
    yield a[max_q_name] >= max(dq) and a[max_k_name] >= max(dk), \
        f"max_q/max_k {a[max_q_name]}/{a[max_k_name]} cover the longest sequences {max(dq)}/{max(dk)}"
    if a["is_causal"]:
        yield dq == dk, "causal varlen sequences square (top-left == bottom-right only there)"


def _flash_fwd_checks(a, values):
    # flash_api.cpp mha_fwd / mha_varlen_fwd
    q, k, v = a["query"], a["key"], a["value"]
    yield q.dtype in HALF and k.dtype == q.dtype and v.dtype == q.dtype, "fp16/bf16 and equal dtypes"
    yield all(t.device.type == "cuda" for t in (q, k, v)), "cuda tensors"
    yield all(t.stride(-1) == 1 for t in (q, k, v)), "contiguous last dim"
    yield a["dropout_p"] == 0.0 and (a["scale"] is None or a["scale"] > 0), "no dropout, positive scale"
    d, h = q.shape[-1], q.shape[-2]
    yield d % 8 == 0 and d <= 256, f"head_size {d} multiple of 8 and <= 256"
    yield h % k.shape[-2] == 0, "H % Hkv == 0"
    yield k.shape[-1] == d and tuple(v.shape) == tuple(k.shape), \
        f"CHECK_SHAPE k/v == (..., Hkv, {d}): k {tuple(k.shape)} v {tuple(v.shape)}"
    if a["cum_seq_q"] is None and a["cum_seq_k"] is None:
        yield all(t.dim() == 4 for t in (q, k, v)) and q.shape[0] == k.shape[0], "dense: 4-D, one batch"
        yield a["max_q"] == q.shape[1] and a["max_k"] == k.shape[1], "max_q/max_k are the dense lengths"
    else:
        yield from _varlen_checks(a, q, k, "cum_seq_q", "cum_seq_k", "max_q", "max_k", values)


def _flash_bwd_checks(a, values):
    # flash_api.cpp mha_bwd / mha_varlen_bwd; attention_backward.cu makes grad_out and out contiguous first
    q, k, v, o, do, lse = a["query"], a["key"], a["value"], a["out"], a["grad_out"], a["logsumexp"]
    yield q.dtype in HALF and all(t.dtype == q.dtype for t in (k, v, o, do)), "q,k,v,out,dout one fp16/bf16 dtype"
    yield all(t.device.type == "cuda" for t in (q, k, v, o, do, lse)), "cuda tensors"
    yield all(t.stride(-1) == 1 for t in (q, k, v)), "q,k,v contiguous last dim"
    yield a["dropout_p"] == 0.0 and (a["scale"] is None or a["scale"] > 0), "no dropout, positive scale"
    hs, hs_og = q.shape[-1], do.shape[-1]
    yield hs % 8 == 0 and hs_og % 8 == 0 and hs <= 256 and hs == _round(hs_og, 8), f"head sizes {hs}/{hs_og}"
    h, hkv = q.shape[-2], k.shape[-2]
    yield h % hkv == 0 and k.shape[-1] == hs and tuple(v.shape) == tuple(k.shape), "k/v shapes"
    yield tuple(o.shape) == tuple(q.shape) and tuple(do.shape) == tuple(q.shape[:-1]) + (hs_og,), \
        f"out {tuple(o.shape)} / dout {tuple(do.shape)} like q {tuple(q.shape)}"
    rows = (q.shape[0], h, q.shape[1]) if q.dim() == 4 else (h, q.shape[0])
    yield lse.dtype == torch.float32 and tuple(lse.shape) == rows, \
        f"lse fp32 {list(rows)} ([B,H,Sq] dense, [H,Tq] varlen), got {tuple(lse.shape)}"
    yield lse.is_contiguous(), "lse read as a contiguous buffer (raw pointer)"
    yield a["rng_state"].device.type == "cuda" and a["rng_state"].numel() == 2, "rng_state: 2 values on the device"
    if a["cum_seq_q"] is None and a["cum_seq_k"] is None:
        yield q.dim() == 4 and a["max_q"] == q.shape[1] and a["max_k"] == k.shape[1], "dense: 4-D, dense lengths"
    else:
        yield from _varlen_checks(a, q, k, "cum_seq_q", "cum_seq_k", "max_q", "max_k", values)


def _eff_common(q, k, v, bias, sq, sk):
    yield all(t.dim() == 4 for t in (q, k, v)), "4-D"
    yield all(t.device.type == "cuda" for t in (q, k, v)), "cuda tensors"
    yield q.dtype == k.dtype == v.dtype, "one dtype"
    yield q.shape[0] == k.shape[0] == v.shape[0] and k.shape[1] == v.shape[1], "batch / key length"
    yield q.shape[2] == k.shape[2] == v.shape[2], f"heads q,k,v equal (no GQA): {q.shape[2]},{k.shape[2]},{v.shape[2]}"
    yield q.shape[3] == k.shape[3], "q/k head dim equal"
    yield all(t.stride(-1) == 1 for t in (q, k, v)), "last dim contiguous"
    if q.dtype in HALF:
        yield all(s % 8 == 0 for t in (q, k, v) for s in t.stride()[:3]), \
            "strides B/M/H multiple of 8 (16-byte aligned kernels)"
    if bias is not None:
        yield bias.dtype == q.dtype, "bias dtype == q dtype"
        yield tuple(bias.shape) == (q.shape[0], q.shape[2], sq, sk), f"bias shape {tuple(bias.shape)}"
        yield bias.stride(3) == 1 and all(s % 8 == 0 for s in bias.stride()[:3]), f"bias strides {bias.stride()}"


def _eff_fwd_checks(a, values):
    q, k, v, bias = a["query"], a["key"], a["value"], a["bias"]
    yield from _eff_common(q, k, v, bias, q.shape[1], k.shape[1])
    yield a["cu_seqlens_q"] is None and a["compute_log_sumexp"] and a["dropout_p"] == 0.0, "dense, LSE, no dropout"
    yield a["custom_mask_type"] in (0, 1), "mask type none or top-left causal"


def _eff_bwd_checks(a, values):
    # attention_backward.cu _efficient_attention_backward
    q, k, v, bias, o, do, lse = (a[n] for n in ("query", "key", "value", "bias", "out", "grad_out_", "logsumexp"))
    yield from _eff_common(q, k, v, bias, q.shape[1], k.shape[1])
    b, sq, h, _ = q.shape
    yield do.dim() == 4 and do.shape[:3] == q.shape[:3] and do.shape[3] == v.shape[3], "grad_out [B,Sq,H,Kv]"
    yield tuple(o.shape) == tuple(do.shape) and o.is_contiguous(), "out [B,Sq,H,Kv] contiguous (o_strideM derived)"
    yield (lse.dtype == torch.float32 and tuple(lse.shape[:2]) == (b, h) and lse.shape[2] >= _round(sq, 32)), \
        f"lse fp32 [B,H,>=round32(Sq)], got {tuple(lse.shape)}"
    yield lse.stride(0) % 8 == 0 and lse.stride(1) % 8 == 0, "lse batch/head strides multiple of 8"
    yield a["max_seqlen_q"] == sq and a["max_seqlen_k"] == k.shape[1] and not a["bias_requires_grad"], "dense sizes"
    yield a["custom_mask_type"] in (0, 1), "mask type none or top-left causal"


def _cudnn_common(q, k, v, causal):
    # the conventions tests/aten_standins.py models for cuDNN's MHA
    yield all(t.device.type == "cuda" for t in (q, k, v)), "cuda tensors"
    yield q.dtype in HALF and k.dtype == q.dtype and v.dtype == q.dtype, "fp16/bf16, one dtype"
    yield all(t.dim() == 4 and t.stride(-1) == 1 for t in (q, k, v)), "bhsd, contiguous last dim"
    yield q.shape[1] == k.shape[1] == v.shape[1], "equal heads (no GQA relied on)"
    yield q.shape[-1] == k.shape[-1] == v.shape[-1] and q.shape[-1] % 8 == 0 and q.shape[-1] <= 128, \
        f"equal head dims, multiple of 8, <= 128: {q.shape[-1]},{k.shape[-1]},{v.shape[-1]}"
    yield not causal or q.shape[2] == k.shape[2], "causal only on square blocks"


def _cudnn_fwd_checks(a, values):
    yield from _cudnn_common(a["query"], a["key"], a["value"], a["is_causal"])
    yield a["attn_bias"] is None and a["compute_log_sumexp"] and a["dropout_p"] == 0.0, "no bias, LSE, no dropout"


def _cudnn_bwd_checks(a, values):
    q, o, do, lse = a["query"], a["out"], a["grad_out"], a["logsumexp"]
    yield from _cudnn_common(q, a["key"], a["value"], a["is_causal"])
    b, h, sq, _ = q.shape
    yield tuple(lse.shape) == (b, h, sq, 1) and lse.dtype == torch.float32, f"lse [B,H,Sq,1] fp32: {tuple(lse.shape)}"
    same = all(x == y for x, y, n in zip(o.stride(), do.stride(), o.shape) if n > 1)  # size-1 dims: any stride
    yield tuple(o.shape) == tuple(do.shape) and same, \
        f"out and grad_out equal strides (cuDNN < 9.5.1): {o.stride()} {do.stride()}"
    yield a["max_q"] == sq and a["max_k"] == a["key"].shape[2], "max_q/max_k"
    yield all(t.device.type == "cuda" and t.dtype == torch.int64 for t in (a["philox_seed"], a["philox_offset"])), \
        "philox seed/offset int64 on the device"


CHECKS: dict[str, Callable] = {
    "_flash_attention_forward": _flash_fwd_checks, "_flash_attention_backward": _flash_bwd_checks,
    "_efficient_attention_forward": _eff_fwd_checks, "_efficient_attention_backward": _eff_bwd_checks,
    "_scaled_dot_product_cudnn_attention": _cudnn_fwd_checks,
    "_scaled_dot_product_cudnn_attention_backward": _cudnn_bwd_checks}


class PreconditionError(RuntimeError):
    """A fused-op call that the op's CUDA code would reject (or silently mis-handle)."""


class CheckedAten:
    """Stands in for ``torch.ops.aten`` in the kernel modules: binds, checks and counts each fused-op
    call, then runs the real op (its fake kernel)."""

    def __init__(self, values: "dict[int, torch.Tensor] | None" = None) -> None:
        self.calls: Counter = Counter()
        self.values = {} if values is None else values  # fake device tensor id -> its real host values

    def __getattr__(self, name):
        op = getattr(aten, name)
        check = CHECKS.get(name)
        if check is None:
            return op

        def call(*args, **kwargs):
            self.calls[name] += 1
            bound = bind(name, args, kwargs)
            with unset_fake_temporarily():  # metadata, and host values: real tensors
                bad = [msg for ok, msg in check(bound, self.values) if not ok]
            if bad:
                raise PreconditionError(f"{name}: " + "; ".join(bad) + f" (called at {where_in_library()})")
            return op(*args, **kwargs)
        return call


# ----------------------------------------------------------------------------------- P5 manual ctx
class ManualCtx:
    """What RingAttentionFunction.forward/backward use of an autograd ctx."""

    def __init__(self, needs_input_grad):
        self.needs_input_grad = needs_input_grad
        self.saved_tensors = ()
        self.materialize_grads = True

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def set_materialize_grads(self, value):
        self.materialize_grads = value


_TAPE = threading.local()


def tape() -> list:
    """This thread's ``(ctx, inputs)`` of every manual apply, in call order."""
    if not hasattr(_TAPE, "entries"):
        _TAPE.entries = []
    return _TAPE.entries


class ManualRingFunction:
    """Replaces ``cp_attention.api.RingAttentionFunction``: ``apply`` runs ``forward`` directly (under
    no_grad, as the autograd engine would) and keeps the ctx on this thread's tape."""

    def __init__(self, function) -> None:
        self.function = function

    def apply(self, q, k, v, plan, sinks=None):
        needs = (q.requires_grad, k.requires_grad, v.requires_grad, False,
                 sinks is not None and sinks.requires_grad)
        ctx = ManualCtx(needs)
        with torch.no_grad():
            out, lse = self.function.forward(ctx, q, k, v, plan, sinks)
        tape().append((ctx, (q, k, v, sinks)))
        return out, lse

    def backward(self, ctx, dout, dlse):
        with torch.no_grad():
            return self.function.backward(ctx, dout, dlse)


# --------------------------------------------------------------------------------------- harness
def real_tensors(fn):
    """``fn`` run outside the fake mode: on real (CPU) tensors."""
    def wrapped(*a, **k):
        with unset_fake_temporarily():
            return fn(*a, **k)
    wrapped.__wrapped__ = fn
    return wrapped


class FakeCuda:
    """The installed environment: the fake mode, the rank lock, the checked op namespace."""

    def __init__(self) -> None:
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.lock = threading.RLock()
        # fake CUDA tensors' values where the host knows them (uploads; a cu_seqlens given as a CUDA
        # tensor): id -> a real CPU copy
        self.host_values: dict[int, torch.Tensor] = {}
        self.aten = CheckedAten(self.host_values)
        self.meta_lib = None
        self.ring_function = None

    def install(self, mp) -> "FakeCuda":
        import cp_attention.api as api
        import cp_attention.checks.validation as validation
        import cp_attention.engine.doc_batch as doc_batch
        import cp_attention.engine.plan as plan_mod
        import cp_attention.engine.ring as ring
        import cp_attention.engine.varlen_batch as varlen_batch
        from cp_attention.engine.fault import RingFault
        from cp_attention.kernels import cuda_cudnn, cuda_efficient, cuda_flash

        self.meta_lib = fix_efficient_backward_meta()  # P2
        # P3
        mp.setattr(plan_mod, "block_plans", real_tensors(plan_mod.block_plans))
        mp.setattr(plan_mod, "lower_steps", real_tensors(plan_mod.lower_steps))
        mp.setattr(doc_batch, "_make_bucket", real_tensors(doc_batch._make_bucket))
        # a lowered step's batches build their index tensors on the host; only the uploads are fake
        mp.setattr(plan_mod, "_ready", real_tensors(plan_mod._ready))
        for mod in (doc_batch, varlen_batch):
            mp.setattr(mod, "upload", self._faked(mod.upload))
        mp.setattr(RingFault, "_failed_rank", real_tensors(RingFault._failed_rank))
        mp.setattr(validation, "digests_agree", real_tensors(validation.digests_agree))
        mp.setattr(torch.Tensor, "pin_memory", _pin_memory)
        mp.setattr(plan_mod, "cu_seqlens_tuple", self._host_read(plan_mod.cu_seqlens_tuple))
        # P5
        self.ring_function = ManualRingFunction(ring.RingAttentionFunction)
        mp.setattr(api, "RingAttentionFunction", self.ring_function)
        # P6
        mp.setattr(torch.cuda, "is_initialized", lambda: True)
        mp.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        mp.setattr(torch.cuda, "current_device", lambda: 0)  # the fake mode names "cuda" as cuda:<current>
        # P7
        for mod in (cuda_cudnn, cuda_efficient, cuda_flash):
            mp.setattr(mod, "_aten", self.aten)
        return self

    def _faked(self, fn):
        """``fn`` run in the fake mode (an upload: a real host tensor in, a fake CUDA tensor out)."""
        def wrapped(*a, **k):
            with self.mode:
                return fn(*a, **k)
        wrapped.__wrapped__ = fn
        return wrapped

    def _host_read(self, fn):
        """cu_seqlens_tuple, reading a fake CUDA tensor's values from :attr:`host_values` (the one host
        read the plan makes of a CUDA ``cu_seqlens``, logged as a ``d2h`` event by the watcher)."""
        def read(cu):
            real = self.host_values.get(id(cu)) if isinstance(cu, torch.Tensor) else None
            if real is not None:
                cu.cpu()  # the copy a real device read makes: seen by the watcher
                with unset_fake_temporarily():
                    return fn(real)
            return fn(cu)
        return read

    def close(self) -> None:
        import cp_attention.api as api
        from cp_attention.engine import ring
        if self.meta_lib is not None:
            self.meta_lib._destroy()
            self.meta_lib = None
        # caches that may hold fake tensors keyed by the cuda device
        ring.band_mask.cache_clear()
        with api._PLANS_LOCK:
            api._PLANS.clear()
        self.host_values.clear()

    # ------------------------------------------------------------------ ring on the loopback
    def group(self, world: int, timeout_s: float = 60.0):
        from cp_attention.transport.loopback import LoopbackGroup
        group = LoopbackGroup(world, timeout_s=timeout_s)
        group._cv = threading.Condition(self.lock)  # P4
        return group

    def run(self, world: int, fn: Callable[[Any, SyncWatch], Any], timeout_s: float = 60.0) -> list:
        """``fn(rank_handle, watch)`` on every rank of a new loopback group, one rank at a time, under
        the fake mode with a :class:`SyncWatch`; the ranks' results in rank order."""
        group = self.group(world, timeout_s)

        def body(rank):
            with self.lock:
                watch = SyncWatch(values=self.host_values)
                tape().clear()
                try:
                    with self.mode, watch:
                        return fn(rank, watch)
                finally:
                    tape().clear()
        return group.run(body)

    def fake(self, *shape, dtype=torch.bfloat16, requires_grad=False) -> torch.Tensor:
        """A fake CUDA tensor (call inside the fake mode)."""
        return torch.empty(*shape, device="cuda", dtype=dtype, requires_grad=requires_grad)

    def cuda_holding(self, values: torch.Tensor) -> torch.Tensor:
        """A fake CUDA tensor standing for the real CPU tensor ``values`` (call inside the fake mode)."""
        with unset_fake_temporarily():
            real = values.clone()
        t = torch.empty(tuple(real.shape), dtype=real.dtype, device="cuda")
        self.host_values[id(t)] = real
        weakref.finalize(t, self.host_values.pop, id(t), None)
        return t


@contextlib.contextmanager
def phase(watch: SyncWatch, name: str):
    old = watch.phase
    watch.phase = name
    try:
        yield
    finally:
        watch.phase = old


# ------------------------------------------------------------------ flash-attn 2.7+ fake kernels
def register_flash_attn_fakes(iface, calls: Counter) -> Callable[[], None]:
    """Fake kernels for the flash-attn 2.7+ stand-in's custom ops (``tests/flash_attn_standin.py``),
    as flash-attn itself registers them (``register_fake`` in ``flash_attn_interface.py``: ``out``
    like q, ``softmax_lse [B, H, Sq]`` fp32, ``rng_state [2]`` int64; the backward writes the given
    dq/dk/dv), after the stand-in's own argument checks (the package's ``CHECK``s). Returns the undo."""
    from . import flash_attn_standin as standin
    fwd, bwd = iface._flash_attn_forward, iface._flash_attn_backward

    def forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                alibi_slopes, return_softmax):
        calls["_flash_attn_forward"] += 1
        standin._check_inputs(q, k, v, True)
        if dropout_p or alibi_slopes is not None or return_softmax:
            raise RuntimeError("the fake models dropout 0, no ALiBi, no softmax return only")
        b, sq, h, _ = q.shape
        return (torch.empty_like(q), torch.empty((b, h, sq), dtype=torch.float32, device=q.device),
                torch.empty((0,), dtype=q.dtype, device=q.device),
                torch.empty((2,), dtype=torch.int64, device=q.device))

    def backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size_left,
                 window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
        calls["_flash_attn_backward"] += 1
        standin._check_inputs(q, k, v, True)
        b, sq, h, _ = q.shape
        if out.shape != q.shape or dout.shape != q.shape or out.dtype != q.dtype or dout.dtype != q.dtype:
            raise RuntimeError("out and dout must have q's shape and dtype")
        lse = softmax_lse
        if tuple(lse.shape) != (b, h, sq) or lse.dtype != torch.float32 or not lse.is_contiguous():
            raise RuntimeError("softmax_lse: the kernel reads a contiguous fp32 [batch, heads, seqlen_q] buffer")
        for given, like in ((dq, q), (dk, k), (dv, v)):
            if given is not None and (given.shape != like.shape or given.dtype != like.dtype or given.stride(-1) != 1):
                raise RuntimeError("dq/dk/dv must have the shape and dtype of q/k/v and a contiguous last dimension")
        return torch.empty((b, h, _round(sq, 128)), dtype=torch.float32, device=q.device)

    saved = (fwd._abstract_fn, bwd._abstract_fn)
    fwd.register_fake(forward)
    bwd.register_fake(backward)

    def undo():
        fwd._abstract_fn, bwd._abstract_fn = saved
    return undo
