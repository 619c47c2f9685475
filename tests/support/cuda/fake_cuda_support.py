"""Running cp_attention's CUDA path without a GPU: every tensor the library sees is a FakeTensor on
``cuda:0`` (torch's FakeTensorMode: aten ops run their meta/fake kernels, giving the real output
shapes, dtypes and strides and no data), through the ring on the in-process loopback transport.
Used through ``tests/support/cuda/fake_cuda_cases.py`` by the fake-CUDA tests (issue 23); the method is that
of the shared ``/work/shared/tools/fake_cuda_trace.py`` (outside the repository).

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
      ``engine.plan.block_schedules`` / ``lower_steps`` / ``_ready`` (a lowered step's DocBatch or
      VarlenBatch, whose ``upload`` alone runs in the fake mode), ``engine.doc_batch.build_buckets``,
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
      ``cp_attention.api.AttentionFunction`` is replaced by an object whose ``apply`` calls
      ``AttentionFunction.forward`` with a minimal ctx; the test calls ``.backward`` itself.
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
import weakref
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .fake_cuda_checks import CheckedAten, where_in_library

aten = torch.ops.aten
_LIB_DIR = os.sep + "cp_attention" + os.sep
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

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


def cuda_guard_problem() -> str | None:
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
def fix_efficient_backward_meta() -> torch.library.Library | None:
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


_PINNED: dict[int, weakref.ref] = {}  # by id: tensors compare elementwise, so no WeakSet


def _pin_memory(self, *args, **kwargs):  # P3: a CPU build cannot pin; mark instead
    key = id(self)
    _PINNED[key] = weakref.ref(self, lambda _: _PINNED.pop(key, None))
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

    def __init__(self, events: list | None = None, values: dict[int, torch.Tensor] | None = None) -> None:
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


# ----------------------------------------------------------------------------------- P5 manual ctx
class ManualCtx:
    """What AttentionFunction.forward/backward use of an autograd ctx."""

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
    """Replaces ``cp_attention.api.AttentionFunction``: ``apply`` runs ``forward`` directly (under
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

    def install(self, mp) -> FakeCuda:
        import cp_attention.api as api
        import cp_attention.checks.validation as validation
        import cp_attention.engine.doc_batch as doc_batch
        import cp_attention.engine.doc_index as doc_index
        import cp_attention.engine.function as function
        import cp_attention.engine.needs_index as needs_index
        import cp_attention.engine.plan as plan_mod
        import cp_attention.engine.varlen_batch as varlen_batch
        from cp_attention.engine.fault import RingFault
        from cp_attention.kernels import cuda_cudnn, cuda_efficient, cuda_flash

        self.meta_lib = fix_efficient_backward_meta()  # P2
        # P3
        mp.setattr(plan_mod, "block_schedules", real_tensors(plan_mod.block_schedules))
        mp.setattr(plan_mod, "lower_steps", real_tensors(plan_mod.lower_steps))
        mp.setattr(doc_batch, "build_buckets", real_tensors(doc_batch.build_buckets))
        # a lowered step's batches build their index tensors on the host; only the uploads are fake
        mp.setattr(plan_mod, "_ready", real_tensors(plan_mod._ready))
        # the needs: host index math, then uploads (fake) like the batches'
        mp.setattr(plan_mod, "rank_needs", real_tensors(plan_mod.rank_needs))
        mp.setattr(plan_mod, "step_indices", real_tensors(plan_mod.step_indices))
        for mod in (doc_batch, doc_index, varlen_batch, needs_index, plan_mod):
            mp.setattr(mod, "upload", self._faked(mod.upload))
        mp.setattr(RingFault, "_failed_rank", real_tensors(RingFault._failed_rank))
        mp.setattr(validation, "digests_agree", real_tensors(validation.digests_agree))
        mp.setattr(torch.Tensor, "pin_memory", _pin_memory)
        mp.setattr(plan_mod, "cu_seqlens_tuple", self._host_read(plan_mod.cu_seqlens_tuple))
        # P5
        self.ring_function = ManualRingFunction(function.AttentionFunction)
        mp.setattr(api, "AttentionFunction", self.ring_function)
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
        from cp_attention.engine import tasks
        if self.meta_lib is not None:
            self.meta_lib._destroy()
            self.meta_lib = None
        # caches that may hold fake tensors keyed by the cuda device
        tasks.band_mask.cache_clear()
        with api._PLANS_LOCK:
            api._PLANS.clear()
        self.host_values.clear()

    # ------------------------------------------------------------------ ring on the loopback
    def group(self, world: int, timeout_s: float = 60.0, mesh_shape=None):
        from cp_attention.transport.loopback import LoopbackGroup
        group = LoopbackGroup(world, timeout_s=timeout_s, mesh_shape=mesh_shape)
        group._cv = threading.Condition(self.lock)  # P4
        return group

    def run(self, world: int, fn: Callable[[Any, SyncWatch], Any], timeout_s: float = 60.0, mesh_shape=None) -> list:
        """``fn(rank_handle, watch)`` on every rank of a new loopback group (two-level with ``mesh_shape``),
        one rank at a time, under the fake mode with a :class:`SyncWatch`; the ranks' results in rank order."""
        group = self.group(world, timeout_s, mesh_shape)

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
