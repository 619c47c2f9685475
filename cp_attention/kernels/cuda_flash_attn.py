"""The flash-attn package (Dao-AILab, 2.6 to 2.8) on CUDA, imported lazily: the same FlashAttention-2
kernels as ``flash``, plus logit softcapping.

``flash_attn.flash_attn_interface`` signatures, read at the tags v2.6.0-v2.6.3, v2.7.0-v2.7.4.post1
and v2.8.0-v2.8.3.post1 (identical within each group)::

    2.6:  _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
              alibi_slopes, return_softmax) -> (out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state)
          _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
              causal, window_size, softcap, alibi_slopes, deterministic, rng_state=None)
              -> (dq, dk, dv, softmax_d)
    2.7+: _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
              window_size_right, softcap, alibi_slopes, return_softmax)
              -> (out, softmax_lse, S_dmask, rng_state)
          _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
              causal, window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
              rng_state=None) -> softmax_d

From 2.7 both are ``torch.library.custom_op`` s whose backward writes ``dq``/``dk``/``dv`` in place
(``mutates_args``) and returns only ``softmax_d``, so the gradients are always preallocated here and
read back from those buffers (2.6 writes into them too). bshd, fp16/bf16, equal head dims (2.7+
checks "multiple of 8": padded here), at most 256, GQA native, LSE ``[B, H, Sq]`` fp32 natural log
read contiguous by the backward. Causal and windows are bottom-right aligned: squares only, see
:mod:`cp_attention.kernels._cuda`.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import sys
from collections.abc import Mapping
from types import ModuleType

import torch

from ._cuda import FusedKernel, pad_head, round_up
from .cuda_efficient import EfficientKernel

__all__ = ["FlashAttnKernel", "flash_attn_interface"]

_NOT_INSTALLED = "kernel 'flash_attn' needs the flash-attn package (>= 2.6): pip install 'cp_attention[gpu]'"


@functools.lru_cache(maxsize=1)
def _import_interface() -> ModuleType | None:
    # Imported once; a broken build (e.g. an ABI mismatch with torch) counts as absent.
    try:
        return importlib.import_module("flash_attn.flash_attn_interface")
    except (ImportError, OSError):
        return None


def flash_attn_interface() -> ModuleType | None:
    """``flash_attn.flash_attn_interface`` if importable (one already in ``sys.modules`` wins), else None."""
    return sys.modules.get("flash_attn.flash_attn_interface") or _import_interface()


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:2])


def split_window_api(fai: ModuleType) -> bool | None:
    """True for the 2.7+ calling convention (``window_size_left``, ``window_size_right``), False for
    2.6's ``window_size`` pair, None for a flash-attn before 2.6 (no ``softcap`` argument). Read from
    the function's parameters (a 2.7+ custom op keeps the decorated function in ``_init_fn``), else
    from ``flash_attn.__version__``."""
    return _split_for(fai._flash_attn_forward)


@functools.lru_cache(maxsize=8)
def _split_for(fn) -> bool | None:
    # cached per function object: inspect.signature costs tens of microseconds per kernel call
    params: Mapping[str, inspect.Parameter]
    try:
        params = inspect.signature(getattr(fn, "_init_fn", fn)).parameters
    except (TypeError, ValueError):
        params = {}
    if "window_size_left" in params:
        return True
    if "window_size" in params:
        return False if "softcap" in params else None
    version = _version(getattr(sys.modules.get("flash_attn"), "__version__", "2.7"))
    return None if version < (2, 6) else version >= (2, 7)


class FlashAttnKernel(FusedKernel):
    """FlashAttention-2 from the flash-attn package, fp16/bf16, head dim <= 256, softcap."""

    name = "flash_attn"
    dtypes = (torch.float16, torch.bfloat16)
    wide_fallback = EfficientKernel()
    max_head_dim = 256
    supports_softcap = True

    def supports(self, device: torch.device | str, dtype: torch.dtype) -> bool:
        if not super().supports(device, dtype):
            return False
        fai = flash_attn_interface()
        return fai is not None and split_window_api(fai) is not None

    @staticmethod
    def _interface() -> tuple[ModuleType, bool]:
        fai = flash_attn_interface()
        split = None if fai is None else split_window_api(fai)
        if fai is None or split is None:
            raise ImportError(_NOT_INSTALLED)
        return fai, split

    def _fwd(self, q, k, v, causal, scale, softcap: float = 0.0):
        fai, split = self._interface()
        d = round_up(max(q.shape[-1], v.shape[-1]), 8)
        window = (-1, -1) if split else ((-1, -1),)
        res = fai._flash_attn_forward(pad_head(q, d), pad_head(k, d), pad_head(v, d), 0.0, float(scale), bool(causal),
                                      *window, float(softcap), None, False)
        out, lse = (res[0], res[1]) if split else (res[0], res[5])
        return out[..., :v.shape[-1]], lse

    def _bwd(self, dout, q, k, v, out, lse, causal, scale, softcap: float = 0.0):
        fai, split = self._interface()
        dqk, dvd = q.shape[-1], v.shape[-1]
        d = round_up(max(dqk, dvd), 8)
        qp, kp, vp = pad_head(q, d), pad_head(k, d), pad_head(v, d)
        dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (qp, kp, vp))
        window = (-1, -1) if split else ((-1, -1),)
        fai._flash_attn_backward(pad_head(dout.to(q.dtype), d), qp, kp, vp, pad_head(out.to(q.dtype), d),
                                 lse.float().contiguous(), dq, dk, dv, 0.0, float(scale), bool(causal), *window,
                                 float(softcap), None, False, None)
        return dq[..., :dqk], dk[..., :dqk], dv[..., :dvd]
