"""Drop-in replacements for the context-parallel APIs people already call (issue 42): above the core,
like ``cp_attention.training``; it imports the adapters only inside functions, so it imports without
the ``hf`` extra.

- :mod:`cp_attention.compat.ring_flash_attn`: ring-flash-attention 0.1.8's functions, same names,
  signatures and shard placement, on cp_attention's layouts and strategies, and its HF adapter
  (:mod:`cp_attention.compat.rfa_hf_adapter`);
- :mod:`cp_attention.compat.torch_cp`: PyTorch's ``context_parallel`` context manager and
  ``context_parallel_unshard``, plus a ``layout=`` keyword.
"""

from __future__ import annotations

import sys
import types

from .torch_cp import context_parallel, context_parallel_unshard

__all__ = ["context_parallel", "context_parallel_unshard", "install_ring_flash_attn"]

# ring-flash-attention's own module names a caller may import from (``from ring_flash_attn.zigzag_ring_flash_attn
# import ...``); each resolves to our one module of functions. Its adapters package and HF adapter module resolve
# to ours (``from ring_flash_attn.adapters.hf_adapter import DATA_PARAMS``).
_RFA_SUBMODULES = ("ring_flash_attn", "zigzag_ring_flash_attn", "stripe_flash_attn", "ring_flash_attn_varlen",
                   "zigzag_ring_flash_attn_varlen", "llama3_flash_attn_varlen")


def _is_ours(module: object) -> bool:
    return getattr(module, "__name__", "").startswith(__name__ + ".")


def install_ring_flash_attn() -> types.ModuleType:
    """Make ``import ring_flash_attn`` (and its function modules, e.g. ``ring_flash_attn.zigzag_ring_flash_attn``)
    give :mod:`cp_attention.compat.ring_flash_attn`, and ``ring_flash_attn.adapters.hf_adapter`` give
    :mod:`cp_attention.compat.rfa_hf_adapter`, so a script written for ring-flash-attention runs on
    cp_attention unchanged. Call it before anything imports ``ring_flash_attn``; calling it again is a no-op.

    Returns the module. Raises ``RuntimeError`` (and registers nothing) if ring-flash-attention itself, or any
    of its modules, is already imported: code may hold its functions already.
    """
    theirs = sorted(name for name, module in sys.modules.items()
                    if (name == "ring_flash_attn" or name.startswith("ring_flash_attn."))
                    and module is not None and not _is_ours(module))
    if theirs:
        where = getattr(sys.modules.get(theirs[0]), "__file__", None) or "?"
        raise RuntimeError(
            f"install_ring_flash_attn: ring-flash-attention is already imported ({', '.join(theirs)}, from {where}); "
            "call cp_attention.compat.install_ring_flash_attn() before anything imports ring_flash_attn (first "
            "thing in the script), or import cp_attention.compat.ring_flash_attn as ring_flash_attn instead")
    from . import ring_flash_attn as ours

    sys.modules["ring_flash_attn"] = ours
    for name in _RFA_SUBMODULES:
        sys.modules[f"ring_flash_attn.{name}"] = ours
    sys.modules["ring_flash_attn.adapters"] = ours.adapters
    sys.modules["ring_flash_attn.adapters.hf_adapter"] = ours.adapters.hf_adapter
    return ours
