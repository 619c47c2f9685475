"""Per-batch figures of a layout on packed documents: causal work imbalance, K/V and dK/dV bytes per
training step (needs-only and whole shards), kernel calls per rank and step, and the cost model's
projected step time; and the batches they are measured on (lognormal mixes, one giant document, a
real corpus's documents).

Pure index math on the layouts' positions and the library's cost model
(:mod:`cp_attention.strategies.cost`, :mod:`cp_attention.strategies.batch_model`); nothing runs attention.
"""

from __future__ import annotations

import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from benchmarks.documents import fit_lengths as _fit
from benchmarks.documents import lognormal_lengths
from benchmarks.modelled import AttentionShape, model_bytes, training_bytes  # noqa: F401 (re-exported)
from cp_attention.layouts import get_layout
from cp_attention.layouts.documents import cu_seqlens_from_lengths
from cp_attention.schedules.derived import block_schedules
from cp_attention.schedules.lowering import lower_steps
from cp_attention.strategies import batch_model
from cp_attention.strategies.cost import HARDWARE, Hardware, Workload, estimate

__all__ = ["Batch", "H100_SHAPE", "training_bytes", "model_bytes", "kernel_calls", "batch_figures", "lognormal_batch",
           "giant_batch", "stdlib_lengths", "corpus_batches"]

# Llama-3-8B's attention: 32 query heads, 8 K/V heads, head dim 128, bf16 (fp32 dK/dV partials).
H100_SHAPE = AttentionShape(batch=1, heads=32, kv_heads=8, head_dim=128, elem_bytes=2)


@dataclass(frozen=True)
class Batch:
    """One packed batch: ``source`` (e.g. ``"lognormal"``), ``name`` (seed or index), document bounds."""

    source: str
    name: str
    cu_seqlens: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return self.cu_seqlens[-1]

    @property
    def longest(self) -> int:
        return max(b - a for a, b in zip(self.cu_seqlens, self.cu_seqlens[1:]))


def kernel_calls(layout: str, cu: tuple[int, ...], world_size: int, causal: bool = True
                 ) -> dict[str, tuple[float, int]]:
    """``{"varlen": (mean, most), "batched": (mean, most)}`` kernel calls per rank and ring step: the
    lowered tasks of every rank's plan (what ``AttentionPlan.steps`` runs). ``varlen``: a kernel that
    takes variable-length batches (CUDA's flash-attn: one call per mask kind per step); ``batched``:
    one that takes masks (small blocks batched, the rest one call each)."""
    total = cu[-1]
    plans = block_schedules(get_layout(layout), causal, world_size, total, cu, None)
    out = {}
    for mode in ("varlen", "batched"):
        counts = [len(step) for plan in plans
                  for step in lower_steps(plan, batched=mode == "batched", tiled=True, local_len=total // world_size,
                                          varlen=mode == "varlen")]
        out[mode] = (sum(counts) / (world_size * world_size), max(counts))
    return out


def batch_figures(layout: str, batch: Batch, world_size: int, shape: AttentionShape = H100_SHAPE,
                  hw: Hardware = HARDWARE["h100"], calls: bool = True) -> dict:
    """One record: ``layout`` on ``batch`` at ``world_size`` ranks, causal. ``imbalance``: the busiest
    rank's (query, key) pairs over the mean rank's; ``bytes_needs``/``bytes_whole``: K/V + dK/dV bytes
    per training step, all ranks; ``calls_varlen``/``calls_batched`` (mean per rank and step, None
    without ``calls``); ``step_ms``/``step_ms_whole``: the cost model's p2p forward + backward time of
    one attention call, needs-only and whole shards (``comm_ms`` its exposed communication).

    Raises ``ValueError`` if the layout cannot split the batch over ``world_size`` ranks.
    """
    cu, total, n = batch.cu_seqlens, batch.tokens, batch.tokens // world_size
    pairs = batch_model.rank_pair_totals(layout, True, (-1, -1), total, world_size, cu)
    needs = batch_model.step_needs(layout, True, (-1, -1), total, world_size, cu)
    whole = [[0] + [n] * (world_size - 1)] * world_size
    w = Workload(world_size, shape.batch, total, shape.heads, shape.kv_heads, shape.head_dim, shape.dv,
                 shape.elem_bytes, True, (-1, -1), cu, layout)
    est, old = estimate(w, "p2p", hw), estimate(w, "p2p", hw, needs_only=False)
    found = kernel_calls(layout, cu, world_size) if calls else {}
    varlen, batched = found.get("varlen", (None, None)), found.get("batched", (None, None))
    return {
        "source": batch.source, "batch": batch.name, "layout": layout, "world_size": world_size, "tokens": total,
        "documents": len(cu) - 1, "longest": batch.longest,
        "imbalance": max(pairs) * world_size / sum(pairs),
        "rows_needs": sum(map(sum, needs)), "rows_whole": world_size * (world_size - 1) * n,
        "bytes_needs": training_bytes(needs, shape), "bytes_whole": training_bytes(whole, shape),
        "calls_varlen": varlen[0], "calls_varlen_max": varlen[1], "calls_batched": batched[0],
        "step_ms": est.total_s * 1e3, "compute_ms": est.compute_s * 1e3, "comm_ms": est.exposed_comm_s * 1e3,
        "step_ms_whole": old.total_s * 1e3,
    }


def lognormal_batch(total: int, seed: int, mean: float = 1024, sigma: float = 1.5) -> Batch:
    """Lognormal document lengths (mean ``mean``, ``sigma``; Python's ``random.Random(seed)``) packed into
    ``total`` tokens, the last document trimmed."""
    return Batch("lognormal", f"seed {seed}", _fit(lognormal_lengths(total, mean, sigma, seed), total))


def giant_batch(total: int, seed: int, share: float = 0.6, mean: float = 1024, sigma: float = 1.5) -> Batch:
    """One document of ``share`` of the ``total`` tokens among lognormal ones, at a seeded place."""
    big = round(share * total)
    rest = list(_fit(lognormal_lengths(total - big, mean, sigma, seed), total - big))
    lengths = [b - a for a, b in zip(rest, rest[1:])]
    lengths.insert(random.Random(seed).randrange(len(lengths) + 1), big)
    return Batch("giant", f"seed {seed}", cu_seqlens_from_lengths(lengths))


def stdlib_lengths(bytes_per_token: int = 4) -> tuple[str, list[int]]:
    """A real corpus that ships here: this Python's standard library sources (``Lib/**/*.py`` without
    site-packages, in path order), each file one document of ``ceil(bytes / bytes_per_token)`` tokens
    (no tokenizer ships here; ~4 bytes per token is typical of BPE tokenizers on code and English).
    Returns ``(description, lengths)``."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in lib.rglob("*.py") if "site-packages" not in p.parts)
    lengths = [max(1, -(-p.stat().st_size // bytes_per_token)) for p in files]
    return f"{lib} (*.py, {len(files)} files)", lengths


def corpus_batches(lengths: Sequence[int], total: int, count: int, seed: int = 0,
                   source: str = "stdlib") -> list[Batch]:
    """The first ``count`` batches of ``total`` tokens of the documents ``lengths``, shuffled with
    ``seed`` and packed end to end as a pretraining packer does: a document crossing a batch's end is
    cut, its rest opening the next batch (a document longer than T spans several)."""
    order = list(lengths)
    random.Random(seed).shuffle(order)
    out, current, room = [], [], total
    for x in order:
        while x and len(out) < count:
            take = min(x, room)
            current.append(take)
            x, room = x - take, room - take
            if room == 0:
                out.append(Batch(source, f"batch {len(out)}", cu_seqlens_from_lengths(current)))
                current, room = [], total
        if len(out) == count:
            break
    return out


def pick(rows: Sequence[dict], **eq) -> list[dict]:
    """The records whose fields equal ``eq``."""
    return [r for r in rows if all(r[k] == v for k, v in eq.items())]


def ratio(rows: Sequence[dict], layout: str, base: str, key: str, base_key: str | None = None) -> list[float]:
    """Per batch (source, batch, N): ``layout``'s ``key`` over ``base``'s ``base_key`` (default ``key``)."""
    index = {(r["source"], r["batch"], r["world_size"]): r for r in rows if r["layout"] == base}
    return [r[key] / index[(r["source"], r["batch"], r["world_size"])][base_key or key]
            for r in rows if r["layout"] == layout and (r["source"], r["batch"], r["world_size"]) in index]
