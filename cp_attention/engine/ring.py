"""The ring engine: one autograd Function that executes any layout's schedule with any kernel.

Forward: at step s this rank holds the K/V shard of rank (r - s) mod N. It posts the exchange of
that shard to the next rank (double buffer), runs the step's block tasks, and folds each block into
fp32 out/LSE accumulators. Backward replays the same plan in reverse, starting with the shard the
forward held last (kept for it): K/V ride the ring backwards, and a fp32 dK/dV accumulator travels
with each shard, collecting every other rank's contribution, back to its owner, where the owner's
own part waited. So backward sends K/V one hop fewer than forward (none at N=2), and no hop follows
its last compute.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..kernels.base import AttentionKernel, accumulation_dtype
from ..schedules.blocks import BlockTask
from ..transport.base import Transport
from .fault import RingFault
from .merge import merge_at, merge_block

__all__ = ["RingPlan", "RingAttentionFunction"]


@dataclass(frozen=True)
class RingPlan:
    """Everything one call of the engine needs besides the tensors: the transport, this rank's tasks
    per ring step (from the batch's :class:`~cp_attention.engine.plan.AttentionPlan`), the kernel."""

    comm: Transport
    # steps[s] = this rank's tasks at ring step s: plain blocks, and for packed documents batches of
    # document blocks (engine.doc_batch.DocBatch, engine.varlen_batch.VarlenBatch) with the same
    # forward/backward/first interface
    steps: "list[tuple] | tuple[tuple, ...]"
    kernel: AttentionKernel
    scale: float
    softcap: float = 0.0  # 0: none; else flash-attn's softcap on the scaled scores
    # Steps from packed documents: K/V rows are gathered, so kept token-major.
    packed: bool = False
    # Step 0's tasks cover every query row and every held key row exactly once (schedules.lowering
    # checks it for packed documents without a window), so the accumulators are written there, not
    # merged into zeros. (A DocBatch says for itself whether it writes first: folded documents'
    # rows are first written at a later step.)
    first_step_tiles: bool = False

    @property
    def kernel_head_major(self) -> bool:
        return not self.packed and getattr(self.kernel, "head_major_kv", False)

    @property
    def kernel_kwargs(self) -> dict:
        """Optional kernel arguments: only what is in use, so kernels without them keep working."""
        return {"softcap": self.softcap} if self.softcap else {}


class _KVRing:
    """Shards travelling round the ring: the one held now, and at most one spare buffer to receive
    the next into.

    ``head_major`` keeps each shard in ``[B, H, n, D]`` memory (copied once per call) for kernels
    that run faster on it; :meth:`views` always hands out ``[B, n, H, D]``-shaped views. The
    caller's tensors are only ever sent; tensors the ring ``owned`` from the start are recycled as
    receive buffers once their send completed. After the last of ``exchanges`` the spare is dropped,
    so the final step's compute runs without it.
    """

    def __init__(self, comm: Transport, tensors: tuple[torch.Tensor, ...], exchanges: int,
                 head_major: bool = False, owned: bool = False) -> None:
        self.comm = comm
        self.head_major = head_major
        if head_major:
            if all(t.transpose(1, 2).is_contiguous() for t in tensors):  # already head-major memory
                tensors = tuple(t.transpose(1, 2) for t in tensors)
            else:
                tensors = tuple(t.new_empty(t.shape[0], t.shape[2], t.shape[1], t.shape[3]).copy_(t.transpose(1, 2))
                                for t in tensors)
                owned = True
        else:
            tensors = tuple(t.contiguous() for t in tensors)
        self.current = tensors
        self._callers = None if owned else tensors  # never written into
        self._remaining = exchanges
        self._spare: "tuple[torch.Tensor, ...] | None" = None
        self._pending = None

    def views(self) -> tuple[torch.Tensor, ...]:
        """The current shard as ``[B, n, H, D]``-shaped tensors (strided views when head-major)."""
        return tuple(t.transpose(1, 2) for t in self.current) if self.head_major else self.current

    def start(self, hop: int = 1) -> None:
        """Post the exchange: send the current shard ``hop`` ranks on, receive the next one into the
        spare buffer."""
        recv = self._spare if self._spare is not None else tuple(torch.empty_like(t) for t in self.current)
        self._spare = None
        self._pending = (self.current, recv, self.comm.exchange(self.current, recv, hop))

    def finish(self) -> None:
        """Wait for the exchange and make the received shard current."""
        sent, recv, handle = self._pending
        handle.wait()
        self._pending = None
        self.current = recv
        self._remaining -= 1
        if self._remaining > 0 and sent is not self._callers:
            self._spare = sent


def _covers(rows: slice, length: int) -> bool:
    return rows.start == 0 and rows.stop == length


def _add_rows(acc: "torch.Tensor | None", rows: "slice | torch.Tensor", block: torch.Tensor, length: int,
              dtype: torch.dtype) -> torch.Tensor:
    """``acc[:, rows] += block`` for a slice or a LongTensor of distinct rows. A missing accumulator
    starts as the block itself when the block covers every row (every schedule's step 0 does without
    packed documents), saving a zero fill and a read-modify-write."""
    if acc is None:
        if isinstance(rows, slice) and _covers(rows, length):
            return block.to(dtype).contiguous()
        acc = block.new_zeros((block.shape[0], length, *block.shape[2:]), dtype=dtype)
    if isinstance(rows, slice):
        acc[:, rows] += block
    else:
        acc.index_add_(1, rows, block.to(dtype))
    return acc


def _set_rows(acc: "torch.Tensor | None", rows: "slice | torch.Tensor", block: torch.Tensor, length: int,
              dtype: torch.dtype) -> torch.Tensor:
    """``acc[:, rows] = block``, allocating ``acc`` uninitialised: for a step whose tasks cover every row once."""
    if acc is None:
        acc = block.new_empty((block.shape[0], length, *block.shape[2:]), dtype=dtype)
    if isinstance(rows, slice):
        acc[:, rows] = block
    else:
        acc.index_copy_(1, rows, block.to(dtype))
    return acc


def _merge_rows(out: "torch.Tensor | None", lse: "torch.Tensor | None", rows: "slice | torch.Tensor",
                o_blk: torch.Tensor, lse_blk: torch.Tensor, length: int, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """LSE-merge a block into (out, lse) at a slice or LongTensor of rows; like :func:`_add_rows`, a
    full first block is taken as is."""
    if out is None:
        if isinstance(rows, slice) and _covers(rows, length):
            return o_blk.to(dtype).contiguous(), lse_blk.to(dtype).contiguous()
        b, _, h, dv = o_blk.shape
        out = o_blk.new_zeros((b, length, h, dv), dtype=dtype)
        lse = o_blk.new_full((b, h, length), float("-inf"), dtype=dtype)
    if isinstance(rows, slice):
        merge_block(out, lse, o_blk, lse_blk, rows)
    else:
        merge_at(out, lse, o_blk, lse_blk, rows)
    return out, lse


@functools.lru_cache(maxsize=256)
def band_mask(rows: int, cols: int, lo: int, hi: int, device: torch.device) -> torch.Tensor:
    """``[1, rows, cols]`` bool: query ``i`` may see key ``b`` iff ``lo <= b - i <= hi`` (cached, so
    kernels that convert masks do it once)."""
    offset = torch.arange(cols, device=device)[None, :] - torch.arange(rows, device=device)[:, None]
    return ((offset >= lo) & (offset <= hi))[None]


def _block_kwargs(plan: RingPlan, t: BlockTask, q: torch.Tensor) -> dict:
    if t.band is None:
        return plan.kernel_kwargs
    mask = band_mask(t.q_stop - t.q_start, t.kv_stop - t.kv_start, *t.band, q.device)
    return {**plan.kernel_kwargs, "mask": mask}


def _task_forward(plan: RingPlan, t, s: int, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, k_own: torch.Tensor, v_own: torch.Tensor):
    """A task's results at step ``s``: (whether they are the first for their rows, a list of
    ``(rows, out, lse)``). ``k``/``v``: the shard held now; ``k_own``/``v_own``: this rank's own."""
    if not isinstance(t, BlockTask):  # a batch of document blocks (DocBatch, VarlenBatch)
        return t.first, t.forward(plan.kernel, q, k, v, k_own, v_own, plan.scale, plan.kernel_kwargs)
    o_blk, lse_blk = plan.kernel.forward(q[:, t.q], k[:, t.kv], v[:, t.kv], t.causal, plan.scale,
                                         **_block_kwargs(plan, t, q))
    return plan.first_step_tiles and s == 0, [(t.q, o_blk, lse_blk)]


def _task_backward(plan: RingPlan, t, s: int, dout, q, k, v, k_own, v_own, out, lse):
    """A task's gradients at step ``s``: (whether they are the first for their rows, a list of
    ``(q_rows, dq, keys)`` with ``keys`` a list of ``(own, kv_rows, dk, dv)``; ``own`` rows index
    this rank's own shard, the others the shard held now)."""
    if not isinstance(t, BlockTask):
        return t.first, t.backward(plan.kernel, dout, q, k, v, k_own, v_own, out, lse, plan.scale, plan.kernel_kwargs)
    dq, dk, dv = plan.kernel.backward(dout[:, t.q], q[:, t.q], k[:, t.kv], v[:, t.kv], out[:, t.q], lse[:, :, t.q],
                                      t.causal, plan.scale, **_block_kwargs(plan, t, q))
    return plan.first_step_tiles and s == 0, [(t.q, dq, [(False, t.kv, dk, dv)])]


def _backward_pass(plan: RingPlan, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   held: tuple[torch.Tensor, ...], out: torch.Tensor, lse: torch.Tensor, acc: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ring's backward: this rank's ``dq``, ``dk``, ``dv`` (in ``acc``) given the final ``out``/``lse``.

    The steps run in reverse, starting with ``held``, the shard the forward held last (``()`` with a
    single step). At step s this rank holds rank (r - s)'s shard; the shard for step s - 1 comes from
    rank r + 1, and so does the dK/dV accumulator of the shard held, carrying the contributions of
    steps last..s+1 of the ranks after this one. This rank adds its own and passes it on to rank r - 1.
    At step 0 the accumulator for this rank's own shard arrives complete, so no hop follows the last
    compute, and K/V make one hop fewer than in forward order (none at N=2).
    """
    n = q.shape[1]
    last = len(plan.steps) - 1
    comm = plan.comm
    # ``held`` is saved for backward, so never received into: a second backward (retain_graph) reads it again.
    kv = _KVRing(comm, held, last - 1, head_major=plan.kernel_head_major) if last else None
    dq = None
    own = (None, None)  # this rank's contributions to its own shard's gradients (step 0, folded documents)
    dkv = None  # the travelling accumulator of the shard held now
    fault = RingFault(comm)
    for s in range(last, -1, -1):
        if s > 1:
            kv.start(-1)
        grads = []
        if fault.ok:
            try:
                if s > 0:
                    kc, vc = kv.views()
                else:  # our own shard; head-major copies where the kernel runs faster on them
                    kc, vc = _KVRing(comm, (k, v), 0, head_major=plan.kernel_head_major).views()
                grads = [_task_backward(plan, t, s, dout, q, kc, vc, k, v, out, lse) for t in plan.steps[s]]
            except Exception as e:  # noqa: BLE001 - contained: re-raised after the last exchange
                fault.fail(e)
        if s < last:
            dkv.finish()
        travelling = dkv.current if s < last else (None, None)
        for first, results in grads:
            for q_rows, dq_blk, keys in results:
                # Reverse order: dq rows may already hold a later step's part, so always add.
                dq = _add_rows(dq, q_rows, dq_blk, n, acc)
                for home, kv_rows, dk_blk, dv_blk in keys:
                    if home or s == 0:
                        # This rank's own rows: step 0's tasks and folded documents each cover
                        # different rows, so a first result writes them, whichever comes first.
                        update = _set_rows if first else _add_rows
                        own = (update(own[0], kv_rows, dk_blk, n, acc), update(own[1], kv_rows, dv_blk, n, acc))
                    else:
                        travelling = (_add_rows(travelling[0], kv_rows, dk_blk, n, acc),
                                      _add_rows(travelling[1], kv_rows, dv_blk, n, acc))
        if s > 0:
            if dkv is None:  # the step that starts the accumulator
                travelling = tuple(torch.zeros_like(t, dtype=acc) if a is None else a for t, a in zip((k, v), travelling))
                dkv = _KVRing(comm, travelling, last, owned=True)
            dkv.start(-1)
        if 1 < s:
            kv.finish()
    fault.raise_if_failed("backward")
    dk, dv = own
    if dkv is not None:  # the other ranks' contributions to this rank's shard
        dk = dkv.current[0] if dk is None else dk.add_(dkv.current[0])
        dv = dkv.current[1] if dv is None else dv.add_(dkv.current[1])
    dk = torch.zeros_like(k, dtype=acc) if dk is None else dk
    dv = torch.zeros_like(v, dtype=acc) if dv is None else dv
    dq = torch.zeros_like(q, dtype=acc) if dq is None else dq
    return dq, dk, dv


class RingAttentionFunction(torch.autograd.Function):
    """Ring attention over local shards ``q [B, n, H, D]``, ``k [B, n, Hkv, D]``, ``v [B, n, Hkv, Dv]``.

    Returns ``out [B, n, H, Dv]`` in q's dtype and ``lse [B, H, n]`` (fp32; fp64 for fp64 inputs),
    both differentiable.
    ``sinks [H]`` adds one logit per head to every softmax denominator (GPT-OSS ``s_aux``); its
    gradient is this rank's queries' share, so summed over the group it is the full gradient.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan,
                sinks: "torch.Tensor | None" = None):
        acc = accumulation_dtype(q.dtype)
        b, n, h, _ = q.shape
        out = lse = None
        last = len(plan.steps) - 1
        ring = _KVRing(plan.comm, (k, v), last, head_major=plan.kernel_head_major)
        fault = RingFault(plan.comm)
        for s, tasks in enumerate(plan.steps):
            if s < last:
                ring.start()
            if fault.ok:
                try:
                    kc, vc = ring.views()
                    for t in tasks:
                        first, results = _task_forward(plan, t, s, q, kc, vc, k, v)
                        for rows, o_blk, lse_blk in results:
                            if first:  # the rows' first result: written, not merged
                                out = _set_rows(out, rows, o_blk, n, acc)
                                lse = _set_rows(lse.transpose(1, 2) if lse is not None else None, rows,
                                                lse_blk.transpose(1, 2), n, acc).transpose(1, 2)
                            else:
                                out, lse = _merge_rows(out, lse, rows, o_blk, lse_blk, n, acc)
                except Exception as e:  # noqa: BLE001 - contained: re-raised after the last exchange
                    fault.fail(e)
            if s < last:
                ring.finish()
        fault.raise_if_failed("forward")
        if out is None:  # no task at all: every row attends to nothing
            out = q.new_zeros(b, n, h, v.shape[-1], dtype=acc)
            lse = q.new_full((b, h, n), float("-inf"), dtype=acc)
        if sinks is not None:
            # One extra logit per head in every denominator (a key with a zero value), merged once:
            # the kernels' backward then sees the final probabilities through the final LSE.
            with_sink = torch.logaddexp(lse, sinks.to(acc)[None, :, None])
            out = out * torch.exp(lse - with_sink).transpose(1, 2).unsqueeze(-1)
            lse = with_sink
        out = out.to(q.dtype)
        ctx.plan = plan
        # The shard held last is kept for backward, which starts with it (see _backward_pass): at N=2
        # backward then moves no K/V at all.
        ctx.save_for_backward(q, k, v, out, lse, sinks, *(ring.views() if last > 0 else ()))
        ctx.set_materialize_grads(False)  # an unused LSE must cost nothing in backward
        return out, lse

    @staticmethod
    def backward(ctx, dout: "torch.Tensor | None", dlse: "torch.Tensor | None"):
        plan: RingPlan = ctx.plan
        q, k, v, out, lse, sinks, *held = ctx.saved_tensors
        acc = accumulation_dtype(q.dtype)
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[4]:
            # d lse/d sink = p_sink = exp(sink - lse); d out/d sink = -p_sink * out, so per head
            # dsink = sum over batch and rows of p_sink * (dlse - rowsum(dout * out)).
            delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)  # [B, H, n]
            if dlse is not None:
                delta = delta - dlse.to(acc)
            p_sink = torch.exp(sinks.to(acc)[None, :, None] - lse)
            dsinks = -(p_sink * delta).sum((0, 2)).to(sinks.dtype)
        dv_dim = v.shape[-1]
        if dlse is not None:
            # A gradient on the LSE adds dlse * p to every score's gradient, i.e. the kernels' rowsum
            # D = rowsum(dout * out) becomes D - dlse. One extra channel does it for any kernel,
            # exactly: out gets a column of ones, dout a column of -dlse, v a column of zeros
            # (so dout @ v^T, hence every dP, is unchanged; the extra dv column is dropped).
            out = torch.cat([out, out.new_ones(*out.shape[:-1], 1)], dim=-1)
            dout = torch.cat([dout, (-dlse).transpose(1, 2).unsqueeze(-1).to(dout.dtype)], dim=-1)
            zero_col = lambda t: torch.cat([t, t.new_zeros(*t.shape[:-1], 1)], dim=-1)  # noqa: E731
            v = zero_col(v)
            held = [held[0], zero_col(held[1])] if held else []
        dq, dk, dv = _backward_pass(plan, dout, q, k, v, tuple(held), out, lse, acc)
        return dq.to(q.dtype), dk.to(k.dtype), dv[..., :dv_dim].to(v.dtype), None, dsinks
