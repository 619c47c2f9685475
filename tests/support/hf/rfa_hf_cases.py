"""A training script written for ring-flash-attention's HF adapter (the pattern Axolotl uses), run on gloo ranks
after ``cp_attention.compat.install_ring_flash_attn()``, against the same training in one process.

:func:`rfa_script` is the caller's code: it imports ``ring_flash_attn``, patches transformers once with
``substitute_hf_flash_attn(group, heads_k_stride)``, and per batch calls ``update_ring_flash_attn_params(cu_seqlens,
group)`` with the whole packed batch's boundaries and feeds each rank its contiguous slice. Its model is built with
``attn_implementation="flash_attention_2"``; transformers refuses that name on a machine without flash-attn and
CUDA, so on CPU :func:`build_flash` sets it on the config after building (the one line a GPU script does not
need). The cases restore what the script patched (``sys.modules``, transformers' flash entry points): the pool's
workers outlive the test.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from typing import Iterator

import torch
import torch.distributed as dist

from tests.support.hf import torch_cp_cases

STEPS = 3


def original_adapter_signatures() -> dict[str, list[tuple[str, object]]] | None:
    """The top-level functions of ring-flash-attention's ``adapters/hf_adapter.py``: their parameters (name, default
    or ``inspect.Parameter.empty``) in order, read from its source with ``ast`` (importing it fails on
    transformers 5); None when ring-flash-attention is not installed."""
    import ast
    import importlib.util
    import inspect
    import pathlib

    from tests.support.core.rfa_cases import rfa_missing

    spec = importlib.util.find_spec("ring_flash_attn") if rfa_missing() is None else None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "adapters" / "hf_adapter.py"
    found = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef):
            args = node.args
            positional = args.posonlyargs + args.args
            defaults = [inspect.Parameter.empty] * (len(positional) - len(args.defaults)) + [
                ast.literal_eval(d) for d in args.defaults]
            params = list(zip((a.arg for a in positional), defaults))
            params += [(a.arg, inspect.Parameter.empty if d is None else ast.literal_eval(d))
                       for a, d in zip(args.kwonlyargs, args.kw_defaults)]
            if args.kwarg:
                params.append((args.kwarg.arg, inspect.Parameter.empty))
            found[node.name] = params
    return found


def build(kind: str = "llama") -> torch.nn.Module:
    """The tiny fp32 start model: :func:`torch_cp_cases.build`'s Llama, or a Mistral of the same size whose
    sliding window (6 tokens) is shorter than the longest packed document (11)."""
    if kind == "llama":
        return torch_cp_cases.build()
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.MistralConfig(vocab_size=torch_cp_cases.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=6)
    return tf.MistralForCausalLM._from_config(cfg, attn_implementation="sdpa").float()


def build_flash(start: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``start`` whose layers call transformers' ``"flash_attention_2"`` attention."""
    model = copy.deepcopy(start)
    model.config._attn_implementation = "flash_attention_2"
    return model


def _local(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per = t.shape[1] // world_size
    return t[:, rank * per:(rank + 1) * per]


def rfa_script(group, start: torch.nn.Module, heads_k_stride: int = 1, steps: int = STEPS) -> dict:
    """The caller's script: ``steps`` AdamW steps on packed batches, this rank's slice; returns the global losses
    and the final parameters."""
    from ring_flash_attn import substitute_hf_flash_attn, update_ring_flash_attn_params

    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    model = build_flash(start)
    substitute_hf_flash_attn(process_group=group, heads_k_stride=heads_k_stride)
    opt = torch.optim.AdamW(model.parameters(), lr=torch_cp_cases.LR)
    losses = []
    for step in range(steps):
        b = torch_cp_cases.batch(step, packed=True)
        count = int((b["labels"] != -100).sum())
        update_ring_flash_attn_params(b["cu_seqlens"].to(torch.int32), group)
        local = {k: _local(b[k], rank, world_size) for k in ("input_ids", "labels", "position_ids")}
        loss = torch_cp_cases._loss(model, local, count)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=group)
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        losses.append(total.item())
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()]}


def one_process(start: torch.nn.Module, steps: int = STEPS) -> dict:
    """The same training without CP: the whole packed batch, transformers' sdpa (documents from the positions)."""
    model = copy.deepcopy(start)
    opt = torch.optim.AdamW(model.parameters(), lr=torch_cp_cases.LR)
    losses = []
    for step in range(steps):
        b = torch_cp_cases.batch(step, packed=True)
        loss = torch_cp_cases._loss(model, b, int((b["labels"] != -100).sum()))
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()]}


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """``install_ring_flash_attn()`` for the block; afterwards ``sys.modules``' ring_flash_attn entries and
    transformers' flash-attention entry points are as before, and the adapter starts afresh."""
    import transformers.modeling_flash_attention_utils as fa_utils
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from cp_attention.compat import install_ring_flash_attn, rfa_hf_adapter

    names = [k for k in sys.modules if k == "ring_flash_attn" or k.startswith("ring_flash_attn.")]
    saved_modules = {k: sys.modules.pop(k) for k in names}
    saved_forward = fa_utils._flash_attention_forward
    saved_entry = ALL_ATTENTION_FUNCTIONS["flash_attention_2"]
    try:
        install_ring_flash_attn()
        yield
    finally:
        for k in [k for k in sys.modules if k == "ring_flash_attn" or k.startswith("ring_flash_attn.")]:
            del sys.modules[k]
        sys.modules.update(saved_modules)
        fa_utils._flash_attention_forward = saved_forward
        ALL_ATTENTION_FUNCTIONS["flash_attention_2"] = saved_entry
        rfa_hf_adapter.DATA_PARAMS.clear()
        rfa_hf_adapter._ORIGINAL.clear()
        rfa_hf_adapter.use_ring_attn(True)


def axolotl_pattern(rank: int, world_size: int, kind: str = "llama", heads_k_stride: int = 1) -> dict:
    """:func:`rfa_script` on the pool's default group and :func:`one_process`, for the :func:`build` model
    ``kind``: each step's losses both ways, the largest parameter difference and how far training moved the
    parameters."""
    start = build(kind)
    ref = one_process(start)
    with installed():
        ours = rfa_script(dist.group.WORLD, start, heads_k_stride)
    dist.barrier()
    initial = list(start.parameters())
    return {"losses": ours["losses"], "ref_losses": ref["losses"],
            "params": max((p - q).abs().max().item() for p, q in zip(ours["params"], ref["params"])),
            "moved": max((p - q).abs().max().item() for p, q in zip(ref["params"], initial))}


def refusal(rank: int, world_size: int, case: str) -> str:
    """One forward of the patched model with a flaw only ``rank`` 0 has (``case``): the error each rank raised."""
    start = torch_cp_cases.build()
    with installed():
        from ring_flash_attn import substitute_hf_flash_attn, update_ring_flash_attn_params

        group = dist.group.WORLD
        model = build_flash(start)
        substitute_hf_flash_attn(group, 1)
        b = torch_cp_cases.batch(0, packed=True)
        cu = b["cu_seqlens"]
        if case == "documents" and rank == 0:
            cu = torch.tensor([0, 16, 32])
        if case != "no_params":
            update_ring_flash_attn_params(cu, group)
        local = {k: _local(b[k], rank, world_size) for k in ("input_ids", "position_ids")}
        if case == "positions" and rank == 0:
            local["position_ids"] = local["position_ids"] + 1
        kwargs = {"attention_mask": torch.ones_like(local["input_ids"]).index_fill_(1, torch.tensor([0]), 0)} \
            if case == "padding" else {}
        try:
            model(**local, use_cache=False, **kwargs)
        except Exception as e:  # noqa: BLE001 - the test reads the message
            return f"{type(e).__name__}: {e}"
        finally:
            dist.barrier()
    return ""
