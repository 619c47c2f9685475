"""The packed-documents workload of the layout comparison (the ``packed`` config group).

A seeded stream of documents with lognormal lengths (long-tailed, like a pretraining corpus) is packed
into one sequence, as flash-attn's ``cu_seqlens`` describes it. For every layout and world size the
schedule's work model with ``cu_seqlens`` gives the score pairs per rank and ring step, summed up as in
the rest of the comparison: **imbalance** is the busiest rank's pairs over the mean rank's, over the
whole ring (:func:`benchmarks.modelled.imbalance`), and **step-synchronous efficiency** charges
every ring step its busiest rank (:func:`benchmarks.modelled.step_sync_efficiency`).

It is set against TransformerEngine-style padding (THD context parallelism, ring-flash-attention's
varlen zigzag): every document padded to a multiple of 2N (:func:`studies.layout_comparison.analysis.document_padding`),
where our layouts need only the whole stream to split. A small measured run times
``ring_attention(cu_seqlens=)`` per layout on CPU gloo.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Callable, Iterable

from benchmarks.documents import lognormal_lengths  # noqa: F401 (re-exported: the study imports it from here)
from benchmarks.measure import Stopwatch
from benchmarks.modelled import (
    AttentionShape,
    flops_per_pair,
    imbalance,
    model_bytes,
    one_thread,
    step_sync_efficiency,
)
from cp_attention.layouts import get_layout
from cp_attention.layouts.documents import cu_seqlens_from_lengths, pad_cu_seqlens
from cp_attention.schedules import work_model
from studies.layout_comparison.analysis import document_padding, document_pairs

__all__ = ["PackedStream", "lognormal_lengths", "packed_stream", "te_padded_cu_seqlens", "stream_divisor",
           "check_packed", "packed_tables", "measure_packed"]

Records = list[dict]
FITS = ("trim", "pad")


@dataclass(frozen=True)
class PackedStream:
    """Documents packed into one stream: the real ones, then (``pad > 0``) one padding document."""

    seed: int
    lengths: tuple[int, ...]  # the real documents, in stream order
    pad: int  # tokens of the padding document appended so the stream splits (0: none)

    @property
    def cu_seqlens(self) -> tuple[int, ...]:
        """flash-attn's ``[0, l1, l1+l2, ..., T]``, the padding document included."""
        return cu_seqlens_from_lengths((*self.lengths, *((self.pad,) if self.pad else ())))

    @property
    def real_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def tokens(self) -> int:
        """T, the packed length every layout splits: real tokens plus the padding document."""
        return self.real_tokens + self.pad


def packed_stream(p: dict, seed: int, divisor: int, total_tokens: int | None = None) -> PackedStream:
    """The packed workload of the ``packed`` config ``p`` for one seed, padded to a multiple of ``divisor``.

    ``p["fit"]`` says what happens to the document that crosses ``total_tokens``: ``trim`` cuts it so the
    stream ends exactly there; ``pad`` leaves it out (unless it is the only one, which is trimmed). Then
    one padding document (:func:`cp_attention.layouts.documents.pad_cu_seqlens`) makes the length a multiple of
    ``divisor``: none with ``trim`` when ``total_tokens`` already splits.
    """
    total = p["total_tokens"] if total_tokens is None else total_tokens
    lengths = lognormal_lengths(total, p["mean_doc_len"], p["sigma"], seed, p["min_doc_len"], p["max_doc_len"])
    over = sum(lengths) - total
    if over:
        if p["fit"] == "pad" and len(lengths) > 1:
            lengths.pop()
        else:
            lengths[-1] -= over
    _, pad = pad_cu_seqlens(cu_seqlens_from_lengths(lengths), divisor)
    return PackedStream(seed, tuple(lengths), pad)


def te_padded_cu_seqlens(lengths: Iterable[int], multiple: int) -> tuple[int, ...]:
    """Boundaries of the documents each padded to a multiple of ``multiple`` (TransformerEngine's THD split)."""
    return cu_seqlens_from_lengths(n + (-n % multiple) for n in lengths)


def stream_divisor(layouts: Iterable[str], world_sizes: Iterable[int]) -> int:
    """The least T every layout can split at every world size (the lcm of their divisors)."""
    return math.lcm(1, *(get_layout(lay).divisor(n) for lay in layouts for n in world_sizes))


def check_packed(p: dict) -> None:
    """Raise ``ValueError`` naming the ``packed.*`` key, what it got and what it accepts."""
    def fail(key: str, got, want: str) -> None:
        raise ValueError(f"config packed.{key}={got!r}: expected {want} (override with packed.{key}=...)")

    def positive_int(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 1

    for key in ("total_tokens", "min_doc_len", "bars_world_size"):
        if not positive_int(p[key]):
            fail(key, p[key], "a positive integer")
    if not isinstance(p["mean_doc_len"], (int, float)) or p["mean_doc_len"] <= 0:
        fail("mean_doc_len", p["mean_doc_len"], "a positive number (tokens)")
    if not isinstance(p["sigma"], (int, float)) or p["sigma"] < 0:
        fail("sigma", p["sigma"], "a number >= 0 (the lognormal's sigma, in log space)")
    if p["max_doc_len"] is not None and (not positive_int(p["max_doc_len"]) or p["max_doc_len"] < p["min_doc_len"]):
        fail("max_doc_len", p["max_doc_len"], f"null or an integer >= min_doc_len={p['min_doc_len']}")
    if p["fit"] not in FITS:
        fail("fit", p["fit"], " or ".join(FITS))
    if not isinstance(p["seeds"], list) or not p["seeds"] or not all(isinstance(s, int) for s in p["seeds"]):
        fail("seeds", p["seeds"], "a non-empty list of integers, e.g. [0,1,2]")
    for key, vals in (("world_sizes", p["world_sizes"]), ("measure.world_sizes", p["measure"]["world_sizes"])):
        if not isinstance(vals, list) or not all(positive_int(v) for v in vals):
            fail(key, vals, "a list of positive integers, e.g. [2,4,8]")
    if not p["world_sizes"]:
        fail("world_sizes", p["world_sizes"], "a non-empty list of positive integers, e.g. [2,4,8]")
    if not positive_int(p["measure"]["total_tokens"]):
        fail("measure.total_tokens", p["measure"]["total_tokens"], "a positive integer")


# ---------------------------------------------------------------- modelled

def _packed_work(lay: str, causal: bool, stream: PackedStream, ws: int) -> list[list[int]] | None:
    try:
        return work_model(lay, causal, stream.tokens, ws, cu_seqlens=stream.cu_seqlens)
    except NotImplementedError:  # a user-defined layout without packed positions
        return None


def packed_tables(p: dict, layouts: list[str], causal: bool, shape: AttentionShape, skipped: Records) -> dict:
    """Every modelled packed table: ``{"packed", "packed_work_per_rank_step", "packed_te_padding",
    "packed_documents"}`` (record lists; the per-rank-and-step work and the document list for the
    first seed only). ``shape`` turns pairs into FLOPs (forward + backward, :func:`flops_per_pair`) and
    rows into the K/V + dK/dV bytes of one training step, all ranks (``kv_dkv_bytes_needs_only``: what
    the engine sends; ``kv_dkv_bytes_whole``: whole shards).
    """
    with one_thread():
        return _packed_tables(p, layouts, causal, shape, skipped)


def _packed_tables(p: dict, layouts: list[str], causal: bool, shape: AttentionShape, skipped: Records) -> dict:
    sizes = sorted(set(p["world_sizes"]))
    div = stream_divisor(layouts + ["zigzag"], sizes)  # zigzag: TE's own split is modelled too
    flops = shape.batch * shape.heads * (flops_per_pair(shape, False) + flops_per_pair(shape, True))
    rows, steps, te_rows, docs = [], [], [], []
    for i, seed in enumerate(p["seeds"]):
        st = packed_stream(p, seed, div)
        real = document_pairs(st.lengths, causal)
        ours_pairs = real + document_pairs([st.pad] if st.pad else [], causal)
        if i == 0:
            cu = st.cu_seqlens
            docs += [{"seed": seed, "doc": d, "start": cu[d], "length": cu[d + 1] - cu[d],
                      "padding": d == len(st.lengths)} for d in range(len(cu) - 1)]
        for ws in sizes:
            for lay in layouts:
                w = _packed_work(lay, causal, st, ws)
                if w is None:
                    if i == 0:
                        skipped.append({"part": "packed", "layout": lay, "world_size": ws, "seq_len": st.tokens,
                                        "reason": f"layout {lay!r} does not support packed documents"})
                    continue
                totals = [sum(r) for r in w]
                needs, whole = model_bytes(lay, st.tokens, ws, shape, st.cu_seqlens, causal)
                rows.append({
                    "seed": seed, "layout": lay, "world_size": ws, "seq_len": st.tokens,
                    "documents": len(st.lengths), "real_tokens": st.real_tokens, "pad_tokens": st.pad,
                    "imbalance": imbalance(w), "step_sync_efficiency": step_sync_efficiency(w),
                    "total_pairs": sum(totals), "real_pairs": real, "busiest_rank_pairs": max(totals),
                    "rank_pairs": " ".join(map(str, totals)),
                    "kv_dkv_bytes_needs_only": needs, "kv_dkv_bytes_whole": whole,
                })
                if i == 0:
                    mean = sum(totals) / ws
                    steps += [{"layout": lay, "world_size": ws, "seq_len": st.tokens, "rank": r, "step": s,
                               "pairs": w[r][s], "rank_total_over_mean": totals[r] / mean}
                              for r in range(ws) for s in range(ws)]
            te = document_padding(st.lengths, 2 * ws, causal)
            te_cu = te_padded_cu_seqlens(st.lengths, 2 * ws)
            te_w = work_model("zigzag", causal, te_cu[-1], ws, cu_seqlens=te_cu)
            te_rows.append({
                "seed": seed, "world_size": ws, "multiple": 2 * ws, "documents": te.documents,
                "real_tokens": te.tokens, "te_pad_tokens": te.pad_tokens,
                "te_pad_tokens_pct": 100 * te.pad_tokens / te.tokens, "our_pad_tokens": st.pad,
                "extra_tokens": te.pad_tokens - st.pad, "extra_tokens_pct": 100 * (te.pad_tokens - st.pad) / st.tokens,
                "real_pairs": real, "our_pairs": ours_pairs, "te_pairs": te.padded_pairs,
                "extra_pairs": te.padded_pairs - ours_pairs,
                "extra_pairs_pct": 100 * (te.padded_pairs - ours_pairs) / ours_pairs,
                "extra_fwdbwd_tflop": (te.padded_pairs - ours_pairs) * flops / 1e12,
                "te_zigzag_imbalance": imbalance(te_w), "te_zigzag_step_sync_efficiency": step_sync_efficiency(te_w),
            })
    return {"packed": rows, "packed_work_per_rank_step": steps, "packed_te_padding": te_rows,
            "packed_documents": docs}


# ---------------------------------------------------------------- measured

def _baseline_worker(args, cu: tuple[int, ...]) -> dict:
    """One process, the whole packed stream (spawn with ``threads`` = the ring's total)."""
    import torch

    from benchmarks.measure import make_inputs, measure, ours

    full = make_inputs(args, cu[-1])
    rows = measure({"baseline": ours(*full, None, "contiguous", args.kernel, args.causal, cu)}, cu[-1], args.repeats,
                   None)
    return {"rows": rows, "threads": torch.get_num_threads()}


def _ring_worker(args, cu: tuple[int, ...], te_cu: tuple[int, ...]) -> dict:
    """One rank: every layout on the packed stream, and zigzag on the TE-style padded stream."""
    import torch
    import torch.distributed as dist

    from benchmarks.measure import make_inputs, measure, ours

    rank, ws, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    full, te_full = make_inputs(args, cu[-1]), make_inputs(args, te_cu[-1])
    impls = {}
    for lay in args.layouts:
        shards = [lay.shard(t, 1, rank, ws, cu_seqlens=cu) for t in full]
        impls[f"ring/{lay.name}"] = ours(*shards, group, lay, args.kernel, args.causal, cu)
    zig = get_layout("zigzag")
    shards = [zig.shard(t, 1, rank, ws, cu_seqlens=te_cu) for t in te_full]
    impls["ring/zigzag, TE-padded"] = ours(*shards, group, zig, args.kernel, args.causal, te_cu)
    return {"rows": measure(impls, cu[-1], args.repeats, group), "threads": torch.get_num_threads()}


def measure_packed(p: dict, m: dict, layouts: list[str], causal: bool, log: Callable[[str], None]) -> Records:
    """Time ``ring_attention(cu_seqlens=)`` for every layout at each ``packed.measure.world_sizes``.

    ``m`` holds the attention settings (heads, kv_heads, head_dim, dtype, kernel, repeats, timeout);
    the batch is 1 (packed documents). The stream is the first seed's, ``packed.measure.total_tokens``
    long. Rows: the single-process baseline on the whole stream, ``ring/<layout>``, and
    ``ring/zigzag, TE-padded`` (every document padded to a multiple of 2N and the padding attended: the
    TE-style split run by our zigzag), with ratios to the baseline and the modelled imbalance.
    """
    from benchmarks.measure import limit_malloc_caching
    from cp_attention.launch import spawn
    from studies.layout_comparison.timings import _wall_rows

    limit_malloc_caching()
    out: Records = []
    for ws in p["measure"]["world_sizes"]:
        ok = [lay for lay in layouts if _supports_packed(lay)]
        st = packed_stream(p, p["seeds"][0], stream_divisor(ok + ["zigzag"], [ws]), p["measure"]["total_tokens"])
        cu = st.cu_seqlens
        te_cu = te_padded_cu_seqlens(st.lengths, 2 * ws)
        args = argparse.Namespace(batch=1, heads=m["heads"], kv_heads=m["kv_heads"] or m["heads"],
                                  head_dim=m["head_dim"], dtype=m["dtype"], kernel=m["kernel"], repeats=m["repeats"],
                                  causal=causal, layouts=[get_layout(x) for x in ok])
        clock = Stopwatch()
        base = spawn(_baseline_worker, 1, args, cu, threads=ws)
        ring = spawn(_ring_worker, ws, args, cu, te_cu, threads=1, timeout_s=m["timeout"])
        log(f"measured packed documents at world size {ws}, T={st.tokens} in {clock.seconds():.0f} s")
        with one_thread():
            model = {lay: imbalance(work_model(lay, causal, st.tokens, ws, cu_seqlens=cu)) for lay in ok}
            model["zigzag, TE-padded"] = imbalance(work_model("zigzag", causal, te_cu[-1], ws, cu_seqlens=te_cu))
        for r in _wall_rows(base["rows"] + ring["rows"], ws):
            name = r["impl"].split("/", 1)[-1]
            out.append({**r, "documents": len(st.lengths), "tokens_computed": te_cu[-1] if "TE" in name else cu[-1],
                        "modelled_imbalance": model.get(name) if r["impl"] != "baseline" else None,
                        "threads_per_rank": ring["threads"], "baseline_threads": base["threads"]})
    return out


def _supports_packed(layout: str) -> bool:
    lay = get_layout(layout)
    d = lay.divisor(1)
    try:
        lay.positions(d, 0, 1, cu_seqlens=(0, d))
    except NotImplementedError:
        return False
    return True
