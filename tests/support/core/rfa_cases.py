"""The ring-flash-attention drop-in (``cp_attention.compat.ring_flash_attn``) against ring-flash-attention's
own functions and against one process's attention, on gloo pool workers.

A generic harness, for any of ring-flash-attention's functions:

- :func:`rfa_missing`: why ring-flash-attention 0.1.8 cannot be the reference here (a skip reason), or None.
- :func:`original`: a context manager giving ring-flash-attention's own functions (a namespace of every
  public callable of the named modules), imported fresh on the flash-attn stand-in
  (``tests/support/cuda/flash_attn_standin.py``) and forgotten afterwards.
- :func:`run_cases`: the pool entry. ``pools(N).run(run_cases, cases, modules=..., flash_attn_version=...)``
  runs each ``(fn, kwargs)`` of ``cases`` as ``fn(rank, world_size, original, **kwargs)`` (``original``:
  the namespace above, None if ring-flash-attention is missing or ``modules`` is empty) and returns, per
  rank, the list of the cases' results in order. Many cases share one pool run: keep pool runs few.
- :func:`place`: the original's shard placements (its tests' ``extract_local``), written independently of
  cp_attention's layouts: ``"contiguous"``, ``"zigzag"``, ``"stripe"``.

And the batch API's cases: :func:`batch_case` (one call against both references) and
:func:`batch_matrix` (every function and option for a world size).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import sys
import types
from typing import Any, Callable, Iterator, Sequence

import pytest
import torch
import torch.distributed as dist

from cp_attention.kernels.dtypes import dtype_from_name

from ..cuda.flash_attn_standin import install
from .dist_cases import make_inputs
from .reference import excess_error, reference_attention

RFA_VERSION = "0.1.8"
BATCH_MODULES = ("ring_flash_attn", "zigzag_ring_flash_attn", "stripe_flash_attn")
PLACEMENTS = {"contiguous": "ring_flash_attn", "zigzag": "zigzag_ring_flash_attn", "stripe": "stripe_flash_attn"}
PACKINGS = ("", "kvpacked", "qkvpacked")
TOLERANCE = {"float32": 1e-5, "float64": 1e-10}  # issue 42: ours against one process's attention
# Against ring-flash-attention itself, and for the fp32 LSE: the original merges its blocks in fp32 whatever the
# input dtype (``update_out_and_lse`` casts to fp32), and its LSE is fp32 like flash-attn's.
FP32_TOLERANCE = 1e-5


def rfa_missing() -> str | None:
    """A skip reason if ring-flash-attention 0.1.8 is not installed, else None (nothing is imported)."""
    try:
        found = importlib.metadata.version("ring-flash-attn")
    except importlib.metadata.PackageNotFoundError:
        found = None
    if found != RFA_VERSION:
        return (f"ring-flash-attention {RFA_VERSION} is not installed (found {found}); "
                f"pip install --no-deps ring-flash-attn=={RFA_VERSION} (pure Python: runs on the flash-attn stand-in)")
    return None


def _rfa_keys() -> list[str]:
    return [k for k in sys.modules if k == "ring_flash_attn" or k.startswith("ring_flash_attn.")]


@contextlib.contextmanager
def original(modules: Sequence[str] = BATCH_MODULES, flash_attn_version: str = "2.8.3") -> Iterator[Any]:
    """ring-flash-attention's own public functions from ``modules`` (its module names, e.g.
    ``"zigzag_ring_flash_attn"``), as one namespace, on the flash-attn stand-in of ``flash_attn_version``.

    The modules are imported without the package's ``__init__``, which imports its HF adapter, and that fails on
    transformers >= 5 (``is_flash_attn_greater_or_equal_2_10`` is gone). Afterwards ``sys.modules`` holds again
    exactly the ``ring_flash_attn*`` and ``flash_attn*`` entries it held before (e.g. ours, installed)."""
    saved = {k: sys.modules.pop(k) for k in _rfa_keys()}
    try:
        spec = importlib.util.find_spec("ring_flash_attn")
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError(rfa_missing() or "ring_flash_attn is not an importable package")
        with pytest.MonkeyPatch.context() as mp:
            install(mp, flash_attn_version)
            package = types.ModuleType("ring_flash_attn")
            package.__path__ = list(spec.submodule_search_locations)
            package.__package__ = "ring_flash_attn"
            sys.modules["ring_flash_attn"] = package
            found = {}
            for name in modules:
                module = importlib.import_module(f"ring_flash_attn.{name}")
                found.update({k: f for k, f in vars(module).items() if callable(f) and not k.startswith("_")
                              and getattr(f, "__module__", "") == module.__name__})
            yield types.SimpleNamespace(**found)
    finally:
        for k in _rfa_keys():
            del sys.modules[k]
        sys.modules.update(saved)


def run_cases(rank: int, world_size: int, cases: Sequence[tuple[Callable[..., Any], dict]],
              modules: Sequence[str] = BATCH_MODULES, flash_attn_version: str = "2.8.3") -> list[Any]:
    """Pool entry: ``[fn(rank, world_size, original, **kwargs) for fn, kwargs in cases]`` (see the module doc)."""
    if not modules or rfa_missing():
        return [fn(rank, world_size, None, **kwargs) for fn, kwargs in cases]
    with original(modules, flash_attn_version) as ref:
        return [fn(rank, world_size, ref, **kwargs) for fn, kwargs in cases]


def place(x: torch.Tensor, placement: str, rank: int, world_size: int, dim: int = 1) -> torch.Tensor:
    """This rank's shard of ``x`` along ``dim`` as ring-flash-attention's tests cut it (``extract_local``)."""
    if placement == "contiguous":
        return x.chunk(world_size, dim=dim)[rank].contiguous()
    if placement == "zigzag":
        chunks = x.chunk(2 * world_size, dim=dim)
        return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim=dim).contiguous()
    if placement == "stripe":  # token t on rank t mod N
        return x.index_select(dim, torch.arange(rank, x.shape[dim], world_size)).contiguous()
    raise ValueError(f"unknown placement {placement!r}; expected one of {sorted(PLACEMENTS)}")


def function_name(placement: str, packing: str) -> str:
    """e.g. ``("zigzag", "kvpacked")`` -> ``"zigzag_ring_flash_attn_kvpacked_func"``."""
    return f"{PLACEMENTS[placement]}_{packing + '_' if packing else ''}func"


def batch_case(rank: int, world_size: int, ref: Any, *, placement: str, packing: str, causal: bool, dtype: str,
               heads: int = 4, kv_heads: int = 4, head_dim: int = 8, batch: int = 2, local_len: int = 6,
               window: tuple = (-1, -1), scale: float | None = None, return_probs: bool = False,
               explicit_group: bool = False, against_original: bool = True, seed: int = 0) -> dict:
    """Ours (``cp_attention.compat.ring_flash_attn``) on this rank's shard, in the original's placement, against:

    - one process's fp64 attention on the full sequence: excess errors (<= 0 passes) ``out``, ``dq``, ``dk``,
      ``dv`` (and ``lse``), tolerance :data:`TOLERANCE`; with ``return_probs`` in fp32 the loss weighs the LSE too
      (in fp64 it does not: the LSE is fp32 like the original's, so its gradient would be fp32-accurate only);
    - with ``ref`` and ``against_original``: ring-flash-attention's forward on the same shards: ``orig_out``,
      ``orig_lse`` (excess errors) and ``orig_like`` (the same return structure, shapes and dtypes).

    ``*_ok`` entries are checks that must be True."""
    import cp_attention.compat.ring_flash_attn as ours

    dt = dtype_from_name(dtype)
    name = function_name(placement, packing)
    q, k, v, dout = make_inputs(seed, batch, local_len * world_size, heads, kv_heads, head_dim, head_dim, dt)
    local = lambda t, dim=1: place(t, placement, rank, world_size, dim)  # noqa: E731
    lse_in_loss = return_probs and dt != torch.float64

    qr, kr, vr = (t.double().clone().requires_grad_() for t in (q, k, v))
    out_ref, lse_ref = reference_attention(qr, kr, vr, causal, head_dim ** -0.5 if scale is None else scale,
                                           window=window)
    dlse = torch.randn(lse_ref.shape, generator=torch.Generator().manual_seed(seed + 7), dtype=torch.float64)
    ((out_ref * dout.double()).sum() + ((lse_ref * dlse).sum() if lse_in_loss else 0.0)).backward()

    ql, kl, vl = local(q), local(k), local(v)
    args, grads = packed_leaves(ql, kl, vl, packing, 2)
    kwargs = dict(softmax_scale=scale, causal=causal, window_size=window, return_attn_probs=return_probs)
    if explicit_group:
        kwargs["group"] = dist.group.WORLD
    result = getattr(ours, name)(*args, **kwargs)
    out, lse = (result[0], result[1]) if return_probs else (result, None)
    loss = (out * local(dout)).sum()
    if lse_in_loss:
        loss = loss + (lse * local(dlse, 2).to(lse.dtype)).sum()
    loss.backward()
    tol = TOLERANCE[dtype]
    dq, dk, dv = grads()
    res = {
        "structure_ok": (isinstance(result, tuple) and len(result) == 3 and result[2] is None) if return_probs
        else isinstance(result, torch.Tensor),
        "out_ok": out.dtype == dt and tuple(out.shape) == (batch, local_len, heads, head_dim),
        "out": excess_error(out, local(out_ref), tol, 0.0),
        "dq": excess_error(dq, local(qr.grad), tol, 0.0),
        "dk": excess_error(dk, local(kr.grad), tol, 0.0),
        "dv": excess_error(dv, local(vr.grad), tol, 0.0),
    }
    if return_probs:
        res["lse_ok"] = lse.dtype == torch.float32 and tuple(lse.shape) == (batch, heads, local_len)
        res["lse"] = excess_error(lse, local(lse_ref, 2), FP32_TOLERANCE, 0.0)
    if ref is not None and against_original:
        with torch.no_grad():
            theirs = getattr(ref, name)(*(a.detach() for a in args), **kwargs)
        t_out = theirs[0] if return_probs else theirs
        res["orig_like"] = (type(theirs) is type(result) and t_out.dtype == out.dtype and t_out.shape == out.shape
                            and (not return_probs or (len(theirs) == 3 and theirs[2] is None
                                                      and theirs[1].dtype == lse.dtype
                                                      and theirs[1].shape == lse.shape)))
        res["orig_out"] = excess_error(out.detach(), t_out, FP32_TOLERANCE, 0.0)
        if return_probs:
            res["orig_lse"] = excess_error(lse.detach(), theirs[1], FP32_TOLERANCE, 0.0)
    return res


def batch_matrix(world_size: int) -> list[tuple[Callable[..., Any], dict]]:
    """Every batch function (3 placements x 3 packings) in fp32 and fp64, causal and not, with GQA or MQA
    (not for qkvpacked), a custom ``softmax_scale``, ``return_attn_probs`` and an explicit group spread over the
    cases, plus windows for each placement. The original is compared where it is a reference: without a window
    (it applies the window inside each ring block, not over global positions) and, for zigzag and stripe,
    causal only (it asserts ``causal``)."""
    cases = []
    j = 0
    for placement in PLACEMENTS:
        for packing in PACKINGS:
            for dtype in TOLERANCE:
                for causal in (True, False):
                    j += 1
                    heads = (4, 4) if packing == "qkvpacked" else ((4, 2) if j % 3 else (4, 1))
                    cases.append(dict(placement=placement, packing=packing, dtype=dtype, causal=causal, heads=heads[0],
                                      kv_heads=heads[1], scale=0.37 if j % 4 == 1 else None,
                                      return_probs=bin(j).count("1") % 2 == 1, explicit_group=j % 5 == 0,
                                      against_original=placement == "contiguous" or causal))
        for dtype in TOLERANCE:
            for causal, window in ((True, (3, -1)), (True, (4, 2)), (False, (2, 5)), (False, (-1, 1))):
                j += 1
                cases.append(dict(placement=placement, packing=PACKINGS[j % 3], dtype=dtype, causal=causal, heads=4,
                                  kv_heads=4 if j % 3 == 2 else 2, window=window, return_probs=j % 2 == 0,
                                  against_original=False))
    return [(batch_case, dict(kw, seed=100 * world_size + i)) for i, kw in enumerate(cases)]


def case_label(kwargs: dict) -> str:
    """A short name of a batch case, for failure messages."""
    keys = ("placement", "packing", "dtype", "causal", "heads", "kv_heads", "window", "scale", "return_probs",
            "explicit_group")
    return " ".join(f"{k}={kwargs[k]}" for k in keys if k in kwargs)


def packed_leaves(ql, kl, vl, packing: str, dim: int):
    """The leaves a ``packing`` variant takes (``"qkvpacked"``: one stacked at ``dim``; ``"kvpacked"``: q
    and k/v stacked; else q, k, v) and a function returning the gradients of q, k, v after backward."""
    if packing == "qkvpacked":
        leaf = torch.stack([ql, kl, vl], dim=dim).requires_grad_()
        return (leaf,), lambda: leaf.grad.unbind(dim)
    if packing == "kvpacked":
        leaf, kv = ql.clone().requires_grad_(), torch.stack([kl, vl], dim=dim).requires_grad_()
        return (leaf, kv), lambda: (leaf.grad, *kv.grad.unbind(dim))
    args = tuple(t.clone().requires_grad_() for t in (ql, kl, vl))
    return args, lambda: tuple(t.grad for t in args)


def failures(results, keys: tuple, label) -> tuple[list[str], int]:
    """From ``(cases, per-rank results)`` of :func:`run_cases`: every check among ``keys`` that failed
    (a ``*_ok``/``*_like`` flag not True, or an error over its tolerance), as lines named by
    ``label(kwargs)``, and how many results had any of the keys."""
    cases, per_rank = results
    bad, checked = [], 0
    for rank, res_list in enumerate(per_rank):
        for (_, kwargs), res in zip(cases, res_list):
            present = [key for key in keys if key in res]
            checked += bool(present)
            bad += [f"rank {rank} {label(kwargs)}: {key}="
                    f"{res[key] if isinstance(res[key], bool) else f'{res[key]:+.2e} over'}"
                    for key in present if (res[key] is not True if key.endswith(("_ok", "_like")) else res[key] > 0)]
    return bad, checked


class Untouchable:
    """A group that fails any use: a refusal must come before the call reaches the group."""

    def __getattr__(self, name):
        raise AssertionError(f"the group was used ({name}) before the refusal")


def assert_same_signature(name: str, ours, modules=None) -> None:
    """Our ``name`` takes exactly the original's parameters (names, kinds, defaults), in order; skips with
    the reason when ring-flash-attention is not importable."""
    import inspect

    import pytest

    reason = rfa_missing()
    if reason:
        pytest.skip(reason)
    with (original() if modules is None else original(modules)) as ref:
        theirs = inspect.signature(getattr(ref, name))
    shape = lambda s: [(p.name, p.kind, p.default) for p in s.parameters.values()]  # noqa: E731
    assert shape(inspect.signature(getattr(ours, name))) == shape(theirs)
