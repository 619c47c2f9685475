"""Megatron-core glue: ring attention in the ``core_attention`` slot of a GPT layer, for every layout.

megatron-core's local ``DotProductAttention`` refuses context parallelism and TransformerEngine's
offers the zigzag layout only. This adapter gives Megatron models every layout (contiguous, zigzag,
interleaved, and the per-batch ``"balanced"``, placed from each packed batch's documents), with or
without TransformerEngine:

1. build the model from a spec whose ``core_attention`` is :class:`RingDotProductAttention`
   (:func:`get_gpt_layer_ring_spec`, or :func:`use_ring_attention` on any spec);
2. call :func:`apply_context_parallel` on the built model, so rotary embeddings use each token's
   GLOBAL position under the chosen layout (megatron's own per-rank RoPE slicing assumes zigzag);
3. shard every batch with :func:`get_batch_on_this_cp_rank` and the same layout.

The CP group is megatron's (``parallel_state`` or ``pg_collection.cp``). Attention sinks
(``softmax_type="off-by-one"`` or ``"learnable"``) are honoured.

Strategies (``cp_comm_type``: ``"p2p"``, ``"all_gather"``, ``"a2a"``, ``"a2a+p2p"``, ``"auto"``), one
for every layer or one per layer, from the spec (``get_gpt_layer_ring_spec(cp_comm_type=...)``) or
megatron's own ``cp_comm_type`` argument; ``"a2a+p2p"`` over megatron's hierarchical CP groups
(``hierarchical_context_parallel_sizes=[a2a, p2p]``), see ``.groups``.

Sliding windows: ``config.window_size = (left, right)`` is honoured exactly on the layers where
megatron's ``is_layer_window_attention(window_size, window_attn_skip_freq, layer_number)`` says so
(the others attend globally), packed or not, sinks included. The convention is TransformerEngine's
and flash-attn's, which megatron passes through: a query at global position i sees key j iff
``i - left <= j <= i + right`` (within its document when packed), -1 is unbounded, and causal layers
also keep ``j <= i`` (TransformerEngine forces ``right = 0`` there). megatron's local
``DotProductAttention`` agrees for ``left, right >= 0`` with ``right = 0`` when causal, and differs
beyond that: its window mask replaces the causal mask (so it sees ``right`` keys ahead), and it does
not read -1 as unbounded. An ``attention_mask`` given to a windowed layer must still be the causal
(or empty) one; the window applies on top of it.

Packed sequences: megatron's THD ``PackedSeqParams`` (``qkv_format="thd"``, ``cu_seqlens_q`` and,
where given, ``cu_seqlens_q_padded``, over the FULL packed stream) are honoured exactly, causal or
not. The sharding is this package's layout applied to the documents (:func:`packed_documents`;
zigzag cuts every document into ``2 * cp_size`` near-equal chunks), not TransformerEngine's, so
documents may have any length; only the packed length must split. Shard packed batches with
:func:`get_batch_on_this_cp_rank` (``packed_seq_params=`` or megatron's ``cu_seqlens`` batch
entries). RoPE then restarts at every document: the ring attention rotates q and k itself at each
token's position within its document (see ``.rope``). Padding between documents
(``cu_seqlens_q_padded``) is attended by no real token.

Features the ring cannot honour exactly are refused with an error that names them: attention bias,
attention dropout, masks other than the causal or empty one, ``cp_comm_type="a2a+p2p"`` without
hierarchical CP groups, an all-to-all that cannot split the heads, YaRN/mRoPE, multi-token prediction
under a non-zigzag layout, and for packed sequences: ``qkv_format`` other than ``"thd"``, ``cu_seqlens_kv``
(or its padded form) different from ``cu_seqlens_q``'s (cross-document attention), an ``attention_mask``
alongside them, a dynamic CP group (``packed_seq_params.cp_group``/``local_cp_size`` other than the
model's), multi-latent attention and multi-token prediction.
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any, Callable, Sequence

import torch

import cp_attention as cpa
from cp_attention._extras import require_extra
from cp_attention.kernels import check_kernel_name
from cp_attention.schedules import check_window_size
from cp_attention.transport import group_rank_and_size

require_extra("megatron", ("megatron.core",), "cp_attention.integrations.megatron")

from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb  # noqa: E402
from megatron.core.models.common.embeddings.rotary_pos_embedding import (  # noqa: E402
    MultimodalRotaryEmbedding,
    RotaryEmbedding,
)
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.module import MegatronModule  # noqa: E402
from megatron.core.transformer.utils import is_layer_window_attention  # noqa: E402

try:  # the mscale megatron's attention passes to apply_rotary_pos_emb (1.0 unless the config has YaRN's)
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (  # noqa: E402
        _yarn_get_concentration_factor_from_config as _rope_mscale,
    )
except ImportError:  # pragma: no cover - a megatron-core without it
    def _rope_mscale(config) -> float:
        return 1.0

from .batch import DEFAULT_LAYOUT  # noqa: E402
from .checks import ForwardChecks, check_layer_call, install_forward_checks  # noqa: E402
from .groups import check_heads, layer_comm_type, resolve_cp_group, ring_group, spec_comm_types  # noqa: E402
from .packed import group_ranks  # noqa: E402
from .rope import LayoutRotaryEmbedding  # noqa: E402
from .spec import replace_core_attention  # noqa: E402

__all__ = ["RingDotProductAttention", "ring_core_attention", "use_ring_attention", "get_gpt_layer_ring_spec",
           "apply_context_parallel"]

_APPLY_HINT = ("call cp_attention.integrations.megatron.apply_context_parallel(model) once after building "
               "the model")


def _layer_window(config, layer_number: int) -> tuple[int, int]:
    """``config.window_size`` as ``(left, right)`` on the layers megatron makes sliding-window layers
    (``is_layer_window_attention``, with megatron's 1-based ``layer_number``), else ``(-1, -1)``."""
    if not is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
        return (-1, -1)
    try:
        return check_window_size(config.window_size)
    except ValueError:
        raise ValueError(f"config.window_size={config.window_size!r} must be (left, right), two ints >= -1 "
                         "(-1 = unbounded)") from None


class RingDotProductAttention(MegatronModule):
    """Exact ring attention with megatron-core's core-attention interface.

    Built by ``SelfAttention`` from the ``core_attention`` slot of a layer spec. Takes
    ``query [s, b, h, d]``, ``key``/``value [s, b, h_kv, d]`` (this rank's tokens under the layout)
    and returns ``[s, b, h * d_v]``; GQA/MQA K/V are not repeated. With THD ``packed_seq_params``
    megatron passes ``query [t, h, d]`` (``t`` = this rank's tokens of the packed stream, sharded
    with ``cu_seqlens=packed_documents(packed_seq_params)``) and gets ``[t, h * d_v]``; tokens attend
    within their documents, and RoPE, which megatron's attention then skips (see
    ``LayoutRotaryEmbedding``), is applied here at positions within documents. The CP group is
    ``pg_collection.cp``, else megatron's ``parallel_state``. The layout is the ``layout`` argument
    (set by :func:`ring_core_attention`), else ``config.cp_layout``, else ``"zigzag"``. On layers where
    megatron's ``is_layer_window_attention`` holds, ``window_size`` is ``config.window_size`` (see the
    module docstring), else ``(-1, -1)``.

    Raises:
        ValueError: an unknown layout or kernel, a CP group whose size is not
            ``config.context_parallel_size``, an unknown ``cp_comm_type`` or one that cannot run here
            (``"a2a+p2p"`` without megatron's hierarchical CP groups, heads the all-to-all cannot split, a
            per-layer list of the wrong length), or a ``config.window_size``
            that is not two ints >= -1 on a windowed layer; in ``forward``
            malformed packed_seq_params (see :func:`packed_documents`) or a packed stream that does
            not match the local tokens.
        NotImplementedError: cross attention (here), and in
            ``forward`` attention bias, dropout while training, a mask that is not the causal (or
            empty) mask of this rank's queries, or an unsupported packed feature (see the module
            docstring). Every ``forward`` error is raised on every CP rank alike, before the ring (agreed
            once per model forward, see :func:`apply_context_parallel`, else in one all-gather per call).
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, layout: str | cpa.Layout | None = None,
                 kernel: str = "auto", spec_cp_comm_type: str | tuple[str, ...] | None = None) -> None:
        super().__init__(config=config)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.layout = cpa.get_layout(layout or getattr(config, "cp_layout", None) or DEFAULT_LAYOUT)
        self.kernel = check_kernel_name(kernel)
        self.cp_group = resolve_cp_group(pg_collection)
        self.cp_rank, self.cp_size = group_rank_and_size(self.cp_group)
        if self.cp_size != config.context_parallel_size:
            raise ValueError(f"the CP group has {self.cp_size} ranks but config.context_parallel_size="
                             f"{config.context_parallel_size}; they must match (RoPE uses the latter)")
        self.cp_comm_type = layer_comm_type(config, self.layer_number, cp_comm_type, spec_cp_comm_type)
        self.ring_group = ring_group(self.cp_group, pg_collection, self.cp_comm_type)
        check_heads(self.ring_group, self.cp_comm_type, config.num_attention_heads // config.tensor_model_parallel_size,
                    self.layer_number)
        if attention_type != "self":
            raise NotImplementedError(f"RingDotProductAttention supports self attention only, got "
                                      f"attention_type={attention_type!r}")
        self.window_size = _layer_window(config, layer_number)
        self._init_softmax_offset(config)
        self.dropout_p = float(config.attention_dropout if attention_dropout is None else attention_dropout)
        # Megatron divides the scale by the layer number under apply_query_key_layer_scaling and
        # multiplies it back inside the fp32 softmax: the net scale is unchanged.
        self.softmax_scale = (softmax_scale if softmax_scale is not None
                              else 1.0 / math.sqrt(config.kv_channels))
        # Set by apply_context_parallel once the model's rotary embeddings follow the layout.
        self.global_positions_ready = self.cp_size == 1
        # Set by apply_context_parallel to the model's LayoutRotaryEmbedding.packed_rows: RoPE rows of
        # this rank's packed tokens (a plain attribute, not a submodule). None: no RoPE to apply.
        self.packed_rotary: Callable[[tuple[int, ...]], torch.Tensor] | None = None
        self.packed_rotary_problem: str | None = None
        # Set by apply_context_parallel to the model's once-per-forward data checks (a plain attribute).
        self.forward_checks: ForwardChecks | None = None

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
        window = "" if self.window_size == (-1, -1) else f", window_size={self.window_size}"
        comm = "" if self.cp_comm_type == "p2p" else f", cp_comm_type={self.cp_comm_type}"
        return f"layout={self.layout.name}, cp_size={self.cp_size}, kernel={self.kernel}{comm}{window}"

    def _causal(self, attn_mask_type) -> bool:
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal):
            return True
        if mask_type in (AttnMaskType.no_mask, AttnMaskType.padding):
            return False
        raise NotImplementedError(f"attn_mask_type={mask_type} is not supported by ring attention; use "
                                  "AttnMaskType.causal or AttnMaskType.no_mask")

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type=None,
                attention_bias: torch.Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
        """``query [s, b, h, d]``, ``key``/``value [s, b, h_kv, d(_v)]`` -> ``[s, b, h * d_v]``; with THD
        ``packed_seq_params``, ``[t, h, d]`` -> ``[t, h * d_v]`` (``[t, 1, h, d]`` -> ``[t, 1, h * d_v]``)."""
        if attention_bias is not None:
            raise NotImplementedError("attention_bias (ALiBi, relative position bias) is not supported by "
                                      "RingDotProductAttention; use rotary or learned absolute positions")
        if self.training and self.dropout_p > 0:
            raise NotImplementedError(f"attention dropout ({self.dropout_p}) is not supported by ring attention; "
                                      "set config.attention_dropout=0.0")
        if not self.global_positions_ready:
            raise RuntimeError(f"this model has not been prepared for context parallelism: {_APPLY_HINT}; it "
                               f"makes rotary embeddings use global positions under the {self.layout.name} layout")
        causal = self._causal(attn_mask_type)
        # Agreed across the CP group: by the model's forward check, else here in one all-gather.
        documents = check_layer_call(self, attention_mask, packed_seq_params, causal, query, key, value)
        if packed_seq_params is not None:
            if documents is None:  # check_layer_call returns a packed call's documents
                raise RuntimeError("RingDotProductAttention: the checks of a packed (THD) call returned no documents; "
                                   "this is a bug in cp_attention, please report it")
            return self._packed_forward(query, key, value, documents, causal)
        out = self._ring(query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), None, causal)
        return out.transpose(0, 1).reshape(query.shape[0], query.shape[1], -1)

    def _ring(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: tuple[int, ...] | None,
              causal: bool) -> torch.Tensor:
        """The ring on bshd tensors: with the forward's plan when its check accepted this call."""
        common: dict[str, Any] = dict(softmax_scale=self.softmax_scale, kernel=self.kernel,
                                      sinks=self.softmax_offset, cp_comm_type=self.cp_comm_type)
        plan = (None if self.forward_checks is None
                else self.forward_checks.plan_for(documents, causal, self.window_size))
        if plan is not None:
            return cpa.ring_attention(q, k, v, plan=plan, **common)
        return cpa.ring_attention(q, k, v, group=self.ring_group, layout=self.layout, causal=causal,
                                  cu_seqlens=documents, window_size=self.window_size, **common)

    def _packed_forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        documents: tuple[int, ...], causal: bool) -> torch.Tensor:
        """RoPE within documents (unless this layer has none), then the ring with ``cu_seqlens``."""
        four_d = query.dim() == 4
        q, k, v = (t.squeeze(1) if four_d else t for t in (query, key, value))
        no_rope = self.config.no_rope_freq[self.layer_number - 1] if self.config.no_rope_freq else False
        if self.packed_rotary is not None and not no_rope:
            # What megatron's attention does to unpacked [s, b, h, d] q and k, at positions within documents.
            rows = self.packed_rotary(documents)
            mscale = _rope_mscale(self.config)
            q, k = (apply_rotary_pos_emb(t.unsqueeze(1), rows, config=self.config, mscale=mscale,
                                         cp_group=self.cp_group).squeeze(1) for t in (q, k))
        out = self._ring(q[None], k[None], v[None], documents, causal)
        out = out[0].reshape(q.shape[0], -1)
        return out[:, None] if four_d else out


def ring_core_attention(layout: str | None = None, kernel: str = "auto",
                        cp_comm_type: str | Sequence[str] | None = None) -> type:
    """A ``core_attention`` class for a layer spec: :class:`RingDotProductAttention` bound to ``layout``.

    ``layout=None`` defers to ``config.cp_layout`` (else zigzag) when the model is built.
    ``cp_comm_type``: one strategy for every layer, or one per layer (``config.num_layers`` entries, in
    layer order), as megatron-core's list-valued ``config.cp_comm_type``; None takes megatron's
    (default ``"p2p"``). Equal arguments (aliases included) return the same class. Raises
    ``ValueError`` for an unknown layout, kernel or strategy.
    """
    return _ring_class(None if layout is None else cpa.get_layout(layout).name, check_kernel_name(kernel),
                       spec_comm_types(cp_comm_type))


@functools.cache
def _ring_class(layout: str | None, kernel: str, cp_comm_type: str | tuple[str, ...] | None = None) -> type:
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("layout", layout)
        kwargs.setdefault("kernel", kernel)
        kwargs.setdefault("spec_cp_comm_type", cp_comm_type)
        RingDotProductAttention.__init__(self, *args, **kwargs)

    # A class rather than a partial: megatron calls the slot directly and some code checks types.
    return type("RingDotProductAttention", (RingDotProductAttention,), {"__init__": __init__})


def use_ring_attention(spec: Any, layout: str | None = None, kernel: str = "auto",
                       cp_comm_type: str | Sequence[str] | None = None) -> Any:
    """A copy of a megatron layer or block spec with ring attention in every ``core_attention`` slot
    (``cp_comm_type`` as in :func:`ring_core_attention`).

    Works on any spec tree (``ModuleSpec``, ``TransformerBlockSubmodules``, lists of layer specs),
    local or TransformerEngine. Raises ``ValueError`` if the spec has no ``core_attention`` slot.
    """
    spec = copy.deepcopy(spec)
    if replace_core_attention(spec, ring_core_attention(layout, kernel, cp_comm_type), set()) == 0:
        raise ValueError(f"the spec has no core_attention slot to replace: {type(spec).__name__}")
    return spec


def get_gpt_layer_ring_spec(layout: str | None = None, backend: str = "local", kernel: str = "auto",
                            cp_comm_type: str | Sequence[str] | None = None, **spec_kwargs) -> Any:
    """megatron's GPT layer spec with :class:`RingDotProductAttention` as core attention (``cp_comm_type``
    as in :func:`ring_core_attention`: one per layer is how to choose per layer with megatron-core
    0.16, whose own list-valued ``config.cp_comm_type`` indexes the list with the 1-based layer number).

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
    return use_ring_attention(getattr(gpt_layer_specs, builders[backend])(**spec_kwargs), layout, kernel,
                              cp_comm_type)


def _swap_rotary_embeddings(model: torch.nn.Module, layout: cpa.Layout, group) -> list[LayoutRotaryEmbedding]:
    """Wrap every ``RotaryEmbedding`` (not those already wrapped); return the model's wrappers."""
    slots = [(parent, name, child) for parent in model.modules() if not isinstance(parent, LayoutRotaryEmbedding)
             for name, child in parent.named_children()]
    for _, _, child in slots:
        if type(child) is not RotaryEmbedding and isinstance(child, (RotaryEmbedding, MultimodalRotaryEmbedding)):
            raise NotImplementedError(f"{type(child).__name__} is not supported with context parallelism by "
                                      "cp_attention yet (only RotaryEmbedding is); use "
                                      "position_embedding_type='rope' or 'learned_absolute'")
    for parent, name, child in slots:
        if type(child) is RotaryEmbedding:
            setattr(parent, name, LayoutRotaryEmbedding(child, layout, group))
    return [m for m in model.modules() if isinstance(m, LayoutRotaryEmbedding)]


def apply_context_parallel(model: torch.nn.Module) -> torch.nn.Module:
    """Finish switching a model built with ring core attention to context parallelism.

    Checks that every :class:`RingDotProductAttention` shares one layout and CP group, and replaces
    every ``RotaryEmbedding`` with a :class:`LayoutRotaryEmbedding`, so RoPE uses each token's
    global position under that layout (at CP size 1, the positions themselves, computed without the
    GPU megatron's own ``get_emb`` insists on). For packed (THD) batches it links the model's rotary
    embedding to every ring attention, which then applies RoPE within documents itself. It hooks the
    model's forward (the outermost module taking ``input_ids``, ``attention_mask`` and ``packed_seq_params``,
    e.g. ``GPTModel``): each forward's mask, packed parameters and input shape are checked and agreed across
    the CP group in ONE small all-gather before any layer runs, and the layers skip their own checks.
    Idempotent. Returns ``model``.

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
    groups = {group_ranks(m.cp_group) for m in rings}
    if len(layouts) > 1 or len(groups) > 1:
        raise ValueError(f"all ring attentions of a model must share one layout and CP group, got layouts "
                         f"{layouts} and groups {sorted(map(str, groups))}")
    first = rings[0]
    if first.cp_size > 1 and first.layout.name != "zigzag" and getattr(first.config, "mtp_num_layers", None):
        raise NotImplementedError(f"multi-token prediction (mtp_num_layers={first.config.mtp_num_layers}) rolls "
                                  "its labels across CP ranks assuming the zigzag layout; use layout='zigzag' "
                                  f"with MTP, not {first.layout.name!r}")
    # Also at CP size 1, where the rows are megatron's own: the wrapper needs no GPU.
    ropes = _swap_rotary_embeddings(model, first.layout, first.cp_group)
    # Packed batches: the one rotary embedding yields no table and every ring applies its packed rows.
    problem = None
    if len(ropes) > 1:
        problem = (f"packed sequences need the model's single rotary embedding, but it has {len(ropes)}; ring "
                   "attention cannot tell which one each layer uses: pass unpacked batches")
    for rope in ropes:
        rope.applies_in_attention = len(ropes) == 1
    for m in rings:
        m.global_positions_ready = True
        m.packed_rotary = ropes[0].packed_rows if len(ropes) == 1 else None
        m.packed_rotary_problem = problem
    install_forward_checks(model, rings)
    return model
