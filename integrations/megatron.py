"""Megatron-core glue: ring attention in the ``core_attention`` slot of a GPT layer, for every layout.

megatron-core's local ``DotProductAttention`` refuses context parallelism and TransformerEngine's
offers the zigzag layout only. This adapter gives Megatron models all three layouts, with or
without TransformerEngine:

1. build the model from a spec whose ``core_attention`` is :class:`RingDotProductAttention`
   (:func:`get_gpt_layer_ring_spec`, or :func:`use_ring_attention` on any spec);
2. call :func:`apply_context_parallel` on the built model, so rotary embeddings use each token's
   GLOBAL position under the chosen layout (megatron's own per-rank RoPE slicing assumes zigzag);
3. shard every batch with :func:`get_batch_on_this_cp_rank` and the same layout.

The CP group is megatron's (``parallel_state`` or ``pg_collection.cp``). Attention sinks
(``softmax_type="off-by-one"`` or ``"learnable"``) are honoured. Features the ring cannot honour
exactly are refused with an error that names them: attention bias, packed sequences,
attention dropout, masks other than the causal or empty one, sliding windows,
``cp_comm_type`` other than ``"p2p"``, YaRN/mRoPE, and multi-token prediction under a non-zigzag layout.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from typing import Any, Mapping, Optional, Union

import torch
import torch.distributed as dist

import cp_attention as cpa
from cp_attention._extras import require_extra
from cp_attention.comm import group_rank_and_size
from cp_attention.kernels import check_kernel_name

require_extra("megatron", ("megatron.core",), "cp_attention.integrations.megatron")

from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.common.embeddings.rotary_pos_embedding import (  # noqa: E402
    MultimodalRotaryEmbedding,
    RotaryEmbedding,
)
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.module import MegatronModule  # noqa: E402
from megatron.core.transformer.utils import is_layer_window_attention  # noqa: E402

from ._megatron_rope import LayoutRotaryEmbedding

__all__ = [
    "RingDotProductAttention",
    "ring_core_attention",
    "use_ring_attention",
    "get_gpt_layer_ring_spec",
    "apply_context_parallel",
    "get_batch_on_this_cp_rank",
    "LayoutRotaryEmbedding",
    "DEFAULT_LAYOUT",
]

# TransformerEngine's and megatron's own batch slicing are zigzag, so it is the default everywhere.
DEFAULT_LAYOUT = "zigzag"
_APPLY_HINT = ("call cp_attention.integrations.megatron.apply_context_parallel(model) once after building "
               "the model")


def _resolve_cp_group(pg_collection):
    if pg_collection is not None and getattr(pg_collection, "cp", None) is not None:
        return pg_collection.cp
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_context_parallel_group()
    # A None group would mean the whole world to torch.distributed, never "no CP".
    raise RuntimeError("RingDotProductAttention found no CP group; call megatron.core.parallel_state."
                       "initialize_model_parallel(context_parallel_size=...) first or pass a pg_collection "
                       "with a .cp group")


class RingDotProductAttention(MegatronModule):
    """Exact ring attention with megatron-core's core-attention interface.

    Built by ``SelfAttention`` from the ``core_attention`` slot of a layer spec. Takes
    ``query [s, b, h, d]``, ``key``/``value [s, b, h_kv, d]`` (this rank's tokens under the layout)
    and returns ``[s, b, h * d_v]``; GQA/MQA K/V are not repeated. The CP group is
    ``pg_collection.cp``, else megatron's ``parallel_state``. The layout is the ``layout`` argument
    (set by :func:`ring_core_attention`), else ``config.cp_layout``, else ``"zigzag"``.

    Raises:
        ValueError: an unknown layout or kernel, a CP group whose size is not
            ``config.context_parallel_size``, or an unsupported ``cp_comm_type``.
        NotImplementedError: cross attention or sliding windows (here), and in
            ``forward`` attention bias, packed sequences, dropout while training, or a mask that is
            not the causal (or empty) mask of this rank's queries.
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None, layout: Union[str, cpa.Layout, None] = None,
                 kernel: str = "auto") -> None:
        super().__init__(config=config)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.layout = cpa.get_layout(layout or getattr(config, "cp_layout", None) or DEFAULT_LAYOUT)
        self.kernel = check_kernel_name(kernel)
        self.cp_group = _resolve_cp_group(pg_collection)
        self.cp_rank, self.cp_size = group_rank_and_size(self.cp_group)
        if self.cp_size != config.context_parallel_size:
            raise ValueError(f"the CP group has {self.cp_size} ranks but config.context_parallel_size="
                             f"{config.context_parallel_size}; they must match (RoPE uses the latter)")
        if cp_comm_type not in (None, "p2p"):
            raise ValueError(f"cp_comm_type={cp_comm_type!r} is not supported by RingDotProductAttention; it "
                             "implements the 'p2p' ring (set cp_comm_type='p2p' or None)")
        if attention_type != "self":
            raise NotImplementedError(f"RingDotProductAttention supports self attention only, got "
                                      f"attention_type={attention_type!r}")
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            raise NotImplementedError(f"sliding-window attention (config.window_size={config.window_size}) is "
                                      "not supported by ring attention yet; set window_size=None")
        self._init_softmax_offset(config)
        self.dropout_p = float(config.attention_dropout if attention_dropout is None else attention_dropout)
        # Megatron divides the scale by the layer number under apply_query_key_layer_scaling and
        # multiplies it back inside the fp32 softmax: the net scale is unchanged.
        self.softmax_scale = (softmax_scale if softmax_scale is not None
                              else 1.0 / math.sqrt(config.kv_channels))
        # Set by apply_context_parallel once the model's rotary embeddings follow the layout.
        self.global_positions_ready = self.cp_size == 1

    def _init_softmax_offset(self, config) -> None:
        """Attention sinks as megatron's ``softmax_type``: ``softmax_offset`` is one logit per local
        head in every softmax denominator, zeros for "off-by-one", a parameter for "learnable"
        (initialised by ``config.init_method``, as megatron's own attention does)."""
        kind = getattr(config, "softmax_type", "vanilla")
        if kind == "vanilla":
            self.softmax_offset = None
            return
        if kind not in ("off-by-one", "learnable"):
            raise ValueError(f"softmax_type={kind!r} is not known; expected 'vanilla', 'off-by-one' or 'learnable'")
        heads = config.num_attention_heads // config.tensor_model_parallel_size
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        offset = torch.zeros(heads, device=device, dtype=config.params_dtype)
        if kind == "learnable":
            self.softmax_offset = torch.nn.Parameter(offset)
            if config.perform_initialization:
                config.init_method(self.softmax_offset)
        else:
            self.register_buffer("softmax_offset", offset, persistent=False)

    def extra_repr(self) -> str:
        return f"layout={self.layout.name}, cp_size={self.cp_size}, kernel={self.kernel}"

    def _causal(self, attn_mask_type) -> bool:
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal):
            return True
        if mask_type in (AttnMaskType.no_mask, AttnMaskType.padding):
            return False
        raise NotImplementedError(f"attn_mask_type={mask_type} is not supported by ring attention; use "
                                  "AttnMaskType.causal or AttnMaskType.no_mask")

    def _check_mask(self, mask: Optional[torch.Tensor], causal: bool, local: int) -> None:
        """Accept only the mask the ring applies anyway; agree on the verdict so every rank raises."""
        if mask is None:
            return
        total = local * self.cp_size
        ok = mask.dtype == torch.bool and mask.dim() == 4 and tuple(mask.shape[-2:]) == (local, total)
        if ok:
            pos = self.layout.positions(total, self.cp_rank, self.cp_size).to(mask.device)
            keys = torch.arange(total, device=mask.device)
            expected = keys[None, :] > pos[:, None] if causal else torch.zeros_like(mask[0, 0])
            ok = torch.equal(mask, expected.expand_as(mask))
        bad = torch.tensor([0 if ok else 1], device=mask.device)
        if self.cp_size > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.cp_group)
        if int(bad.item()):
            raise NotImplementedError(
                f"ring attention applies the {'causal' if causal else 'empty'} mask over global positions itself "
                f"and cannot honour any other attention_mask (padding, document or custom masks); got "
                f"{tuple(mask.shape)} {mask.dtype} on at least one rank. Pass attention_mask=None, or a bool "
                f"[b, 1, {local}, {total}] mask sharded by get_batch_on_this_cp_rank(layout="
                f"'{self.layout.name}') (megatron's own get_batch_on_this_cp_rank shards for zigzag only)")

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type=None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params=None) -> torch.Tensor:
        """``query [s, b, h, d]``, ``key``/``value [s, b, h_kv, d(_v)]`` -> ``[s, b, h * d_v]``."""
        if attention_bias is not None:
            raise NotImplementedError("attention_bias (ALiBi, relative position bias) is not supported by "
                                      "RingDotProductAttention; use rotary or learned absolute positions")
        if packed_seq_params is not None:
            raise NotImplementedError("packed sequences (packed_seq_params / THD format) are not supported by "
                                      "RingDotProductAttention until varlen support lands; pass unpacked [s, b] "
                                      "batches without packed_seq_params")
        if self.training and self.dropout_p > 0:
            raise NotImplementedError(f"attention dropout ({self.dropout_p}) is not supported by ring attention; "
                                      "set config.attention_dropout=0.0")
        if not self.global_positions_ready:
            raise RuntimeError(f"this model has not been prepared for context parallelism: {_APPLY_HINT}; it "
                               f"makes rotary embeddings use global positions under the {self.layout.name} layout")
        causal = self._causal(attn_mask_type)
        self._check_mask(attention_mask, causal, query.shape[0])
        out = cpa.ring_attention(query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1),
                                 group=self.cp_group, layout=self.layout, causal=causal,
                                 softmax_scale=self.softmax_scale, kernel=self.kernel, sinks=self.softmax_offset)
        return out.transpose(0, 1).reshape(query.shape[0], query.shape[1], -1)


def ring_core_attention(layout: Optional[str] = None, kernel: str = "auto") -> type:
    """A ``core_attention`` class for a layer spec: :class:`RingDotProductAttention` bound to ``layout``.

    ``layout=None`` defers to ``config.cp_layout`` (else zigzag) when the model is built. Equal
    arguments (aliases included) return the same class. Raises ``ValueError`` for an unknown
    layout or kernel.
    """
    return _ring_class(None if layout is None else cpa.get_layout(layout).name, check_kernel_name(kernel))


@functools.lru_cache(maxsize=None)
def _ring_class(layout: Optional[str], kernel: str) -> type:
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("layout", layout)
        kwargs.setdefault("kernel", kernel)
        RingDotProductAttention.__init__(self, *args, **kwargs)

    # A class rather than a partial: megatron calls the slot directly and some code checks types.
    return type("RingDotProductAttention", (RingDotProductAttention,), {"__init__": __init__})


def _replace_core_attention(node: Any, builder: type, seen: set) -> int:
    if id(node) in seen:
        return 0
    seen.add(id(node))
    if isinstance(node, (list, tuple)):
        return sum(_replace_core_attention(item, builder, seen) for item in node)
    if not dataclasses.is_dataclass(node) or isinstance(node, type):
        return 0
    count = 0
    for field in dataclasses.fields(node):
        if field.name == "core_attention":
            setattr(node, field.name, builder)
            count += 1
        else:
            count += _replace_core_attention(getattr(node, field.name), builder, seen)
    return count


def use_ring_attention(spec: Any, layout: Optional[str] = None, kernel: str = "auto") -> Any:
    """A copy of a megatron layer or block spec with ring attention in every ``core_attention`` slot.

    Works on any spec tree (``ModuleSpec``, ``TransformerBlockSubmodules``, lists of layer specs),
    local or TransformerEngine. Raises ``ValueError`` if the spec has no ``core_attention`` slot.
    """
    spec = copy.deepcopy(spec)
    if _replace_core_attention(spec, ring_core_attention(layout, kernel), set()) == 0:
        raise ValueError(f"the spec has no core_attention slot to replace: {type(spec).__name__}")
    return spec


def get_gpt_layer_ring_spec(layout: Optional[str] = None, backend: str = "local", kernel: str = "auto",
                            **spec_kwargs) -> Any:
    """megatron's GPT layer spec with :class:`RingDotProductAttention` as core attention.

    ``backend="local"`` starts from ``get_gpt_layer_local_spec(**spec_kwargs)``;
    ``"transformer_engine"`` from ``get_gpt_layer_with_transformer_engine_spec(**spec_kwargs)`` (needs
    TransformerEngine). Raises ``ValueError`` for another backend.
    """
    from megatron.core.models.gpt import gpt_layer_specs

    builders = {"local": "get_gpt_layer_local_spec",
                "transformer_engine": "get_gpt_layer_with_transformer_engine_spec"}
    if backend not in builders:
        raise ValueError(f"unknown backend {backend!r}; expected one of {sorted(builders)}")
    if backend == "transformer_engine" and not gpt_layer_specs.HAVE_TE:
        raise ImportError("backend='transformer_engine' needs TransformerEngine (pip install "
                          "'cp_attention[gpu]' on a CUDA machine); backend='local' needs nothing more")
    return use_ring_attention(getattr(gpt_layer_specs, builders[backend])(**spec_kwargs), layout, kernel)


def _group_ranks(group) -> Optional[tuple[int, ...]]:
    if group is None or not dist.is_initialized():
        return None
    return tuple(dist.get_process_group_ranks(group))


def _swap_rotary_embeddings(model: torch.nn.Module, layout: cpa.Layout, group) -> None:
    slots = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()]
    for _, _, child in slots:
        if type(child) is not RotaryEmbedding and isinstance(child, (RotaryEmbedding, MultimodalRotaryEmbedding)):
            raise NotImplementedError(f"{type(child).__name__} is not supported with context parallelism by "
                                      "cp_attention yet (only RotaryEmbedding is); use "
                                      "position_embedding_type='rope' or 'learned_absolute'")
    for parent, name, child in slots:
        if type(child) is RotaryEmbedding:
            setattr(parent, name, LayoutRotaryEmbedding(child, layout, group))


def apply_context_parallel(model: torch.nn.Module) -> torch.nn.Module:
    """Finish switching a model built with ring core attention to context parallelism.

    Checks that every :class:`RingDotProductAttention` shares one layout and CP group, and replaces
    every ``RotaryEmbedding`` with a :class:`LayoutRotaryEmbedding`, so RoPE uses each token's
    global position under that layout (at CP size 1, the positions themselves, computed without the
    GPU megatron's own ``get_emb`` insists on). Idempotent. Returns ``model``.

    Raises:
        ValueError: no ring core attention in the model, or attentions with different layouts or groups.
        NotImplementedError: a rotary embedding type other than ``RotaryEmbedding`` (YaRN, mRoPE),
            or multi-token prediction with a layout other than zigzag; the model is left unchanged.
    """
    rings = [m for m in model.modules() if isinstance(m, RingDotProductAttention)]
    if not rings:
        raise ValueError("the model has no RingDotProductAttention; build it from get_gpt_layer_ring_spec(...) "
                         "or use_ring_attention(spec)")
    layouts = sorted({m.layout.name for m in rings})
    groups = {_group_ranks(m.cp_group) for m in rings}
    if len(layouts) > 1 or len(groups) > 1:
        raise ValueError(f"all ring attentions of a model must share one layout and CP group, got layouts "
                         f"{layouts} and groups {sorted(map(str, groups))}")
    first = rings[0]
    if first.cp_size > 1 and first.layout.name != "zigzag" and getattr(first.config, "mtp_num_layers", None):
        raise NotImplementedError(f"multi-token prediction (mtp_num_layers={first.config.mtp_num_layers}) rolls "
                                  "its labels across CP ranks assuming the zigzag layout; use layout='zigzag' "
                                  f"with MTP, not {first.layout.name!r}")
    # Also at CP size 1, where the rows are megatron's own: the wrapper needs no GPU.
    _swap_rotary_embeddings(model, first.layout, first.cp_group)
    for m in rings:
        m.global_positions_ready = True
    return model


def get_batch_on_this_cp_rank(batch: Mapping[str, Any], layout: Union[str, cpa.Layout] = DEFAULT_LAYOUT,
                              cp_group=None) -> dict[str, Any]:
    """This CP rank's share of a megatron batch dict, for any layout.

    Like ``megatron.core.utils.get_batch_on_this_cp_rank``: every tensor (``tokens``, ``labels``,
    ``loss_mask``, ``position_ids``, ...) is sharded along dim 1, ``attention_mask [b, 1, s, s]``
    along dim 2 (its queries); ``None`` and non-tensor values pass through. ``position_ids`` sharded
    this way hold global positions. ``cp_group`` defaults to megatron's CP group (world size 1 if
    ``parallel_state`` is not initialised). Returns a new dict; ``batch`` is not modified.

    Raises ``ValueError`` if a tensor's sequence length differs from the others' or the layout cannot
    split it.
    """
    lay = cpa.get_layout(layout)
    out = dict(batch)
    if cp_group is None:
        if not parallel_state.model_parallel_is_initialized():
            return out
        cp_group = parallel_state.get_context_parallel_group()
    rank, world_size = group_rank_and_size(cp_group)
    if world_size == 1:
        return out
    seq_len = None
    for key, val in batch.items():
        if not isinstance(val, torch.Tensor):
            continue
        dim = 2 if key == "attention_mask" else 1
        if val.dim() <= dim:
            raise ValueError(f"batch[{key!r}] has shape {tuple(val.shape)}; expected a sequence dimension {dim}")
        if seq_len is None:
            seq_len = val.shape[dim]
            lay.check(seq_len, world_size)
        elif val.shape[dim] != seq_len:
            raise ValueError(f"batch[{key!r}] has sequence length {val.shape[dim]} along dim {dim}, but other "
                             f"entries have {seq_len}; every entry must cover the same full sequence")
        out[key] = lay.shard(val, dim, rank, world_size)
    return out
