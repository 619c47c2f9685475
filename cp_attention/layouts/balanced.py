"""The per-batch layout ``"balanced"``: packed documents placed by a deterministic solver.

Without ``cu_seqlens`` it is zigzag (the same positions and the same causal ring schedule). With
``cu_seqlens``, :func:`place_documents` decides from the boundaries and the world size alone (so every
rank computes the same placement, and a plan agrees on it like on any layout) which rank holds which tokens.

What it guarantees
  * every rank holds exactly ``T / N`` tokens, in increasing order (``T % 2N == 0``, like zigzag);
  * a short document (at most half a rank's tokens and half a rank's mean causal work) stays whole on one
    rank, so its K/V never travel, except at most one per rank boundary (the smallest ones absorb the
    exact token counts);
  * a split document lies on consecutive ranks ``r, r+1, ..., r+k-1`` (never wrapping), each holding one
    head and one tail piece of it, nested like zigzag within those ranks (the rank holding most of it
    outermost, the innermost one contiguous piece), so every block is full or a causal band;
  * causal work (query-key pairs within documents) balanced: max/mean at most 1.019 on 300 lognormal
    batches each at N = 8 and 32 (mean length 1,024, sigma 1.5; T = 65,536 and 262,144), giant documents
    included; the K/V rows a needs-only ring sends are ~20% of zigzag's at N = 8 on average;
  * a pure function of ``(cu_seqlens, world_size)``, cached per pair; ~2.5 ms for 8,000 documents.

How it works
  Work counts ``p + 1`` pairs for a token at in-document position ``p``. A split piece is a head
  ``[a, a+h)`` plus a tail ``[L-b-t, L-b)`` with ``h = t`` (or one less), so its work is its share of the
  tokens times the document's density ``(L + 1) / 2`` wherever it sits: a split document is a fluid of
  constant density. Documents fall in three groups: *whole* (short), *dense* (too long to stay whole and
  denser than the batch's mean ``W / T``) and *light* (too long, not denser than the mean). The dense and
  the light ones form two streams, each consumed in ring order (so a document's pieces land on
  consecutive ranks); the smallest whole documents, up to 1/32 of the tokens, join the light stream as a
  tuning reserve.

  1. Plan: were the rest of a rank of the rest's mean density, each rank's dense tokens follow from the
     dense stream's excess density over it (so a dense document covers as few ranks as balance allows).
  2. Whole documents: the 4N longest by longest-processing-time first, the rest by a low-discrepancy
     deal of sizes, each rank's share chosen so that, with its planned fluid, its work hits the mean.
  3. In ring order each rank takes the dense and light tokens that fill its free tokens exactly and bring
     its work nearest the remaining work over the remaining ranks; a stream inside a document gives the
     next rank at least one token. The last rank takes what remains.
  4. If the plan still misses the mean by more than 2%, steps 2-3 run again with the small whole documents
     as the fluid in step 2 (for batches of many small documents, where the dense stream is too scarce to
     tune with), then with a larger tuning reserve (1/16, then 1/8); the best try wins.

  A document holding a fraction ``f`` of the tokens above about 0.4 carries most of the work and lies on
  every rank (the others cannot balance a rank without it), and the rows sent are then about ``f`` plus 0.05
  to 0.15 times zigzag's (measured at N = 8). Nested pieces of equal head and tail are what keeps the
  fluid's density; as ``f -> 1`` no balanced placement can send less than ``2/3`` of zigzag's rows anyway
  (each rank then needs work ``T^2/(2N)`` from ``T/N`` tokens of one document, so its last position is at
  least ``T/2 + T/(2N)`` and it needs that many rows less its own).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch

from .builtin import ZigzagLayout
from .documents import CuSeqlens, check_cu_seqlens

__all__ = ["BalancedLayout", "Piece", "place_documents", "placement_picture"]


class Piece(NamedTuple):
    """A run of one document on one rank: in-document positions ``[start, stop)``."""

    doc: int
    start: int
    stop: int


class _Stream:
    """Documents cut at any token, consumed in order: the ranks take consecutive stretches."""

    def __init__(self, docs: np.ndarray, lengths: np.ndarray):
        self.docs, self.lengths = docs.astype(np.int64), lengths.astype(np.int64)
        self.pos = 0
        self.ends: list[int] = []  # self.pos after each take
        self._index()

    def _index(self) -> None:
        self.cum_t = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.float64)
        self.cum_w = np.concatenate([[0.0], np.cumsum(self.lengths * (self.lengths + 1) / 2.0)])
        self.total = int(self.cum_t[-1])

    @property
    def left(self) -> int:
        return self.total - self.pos

    def inside(self) -> bool:
        """Whether the next token is not a document's first (then the next rank must take some)."""
        i = int(np.searchsorted(self.cum_t, self.pos, side="right")) - 1
        return 0 < self.pos < self.total and self.cum_t[i] != self.pos

    def work(self, take, start=None):
        """Work (fluid density) of the next ``take`` tokens after ``start`` (default: the current position)."""
        p = self.pos if start is None else start
        x = p + np.asarray(take, np.float64)
        return np.interp(x, self.cum_t, self.cum_w) - np.interp(p, self.cum_t, self.cum_w)

    def append(self, docs: np.ndarray, lengths: np.ndarray) -> None:
        self.docs = np.concatenate([self.docs, docs.astype(np.int64)])
        self.lengths = np.concatenate([self.lengths, lengths.astype(np.int64)])
        self._index()

    def take(self, count: int) -> None:
        """The next rank (in ring order, one call per rank) takes the next ``count`` tokens."""
        self.pos += count
        self.ends.append(self.pos)

    def owners(self, rank_of: np.ndarray, split: dict) -> None:
        """Record who holds each document: ``rank_of[doc]`` for one on a single rank, else
        ``split[doc] = [(rank, tokens), ...]`` in ring order."""
        if not self.total:
            return
        ends = np.asarray(self.ends, np.int64)
        starts, stops = self.cum_t[:-1].astype(np.int64), self.cum_t[1:].astype(np.int64)
        first = np.searchsorted(ends, starts, side="right")
        last = np.searchsorted(ends, stops - 1, side="right")
        one = first == last
        rank_of[self.docs[one]] = first[one]
        begins = np.concatenate([[0], ends[:-1]])
        for k in np.flatnonzero(~one).tolist():  # at most one document per rank boundary
            parts = [(q, int(min(stops[k], ends[q]) - max(starts[k], begins[q])))
                     for q in range(int(first[k]), int(last[k]) + 1)]
            split[int(self.docs[k])] = parts


def _tune_light(dense_s: _Stream, light_s: _Stream, avail: int, lam: int, target: float, min_dense: int) -> int:
    """How many light tokens, the dense stream taking the rest of ``avail``, bring the fluid's work nearest
    ``target`` (``lam`` when the light stream cannot move: empty, or the dense one too short)."""
    low = max(1 if light_s.inside() else 0, avail - dense_s.left)
    high = min(light_s.left, avail - min_dense)
    if not light_s.left or low > high:
        return lam
    xs = np.arange(low, high + 1)
    err = np.abs(light_s.work(xs) + dense_s.work(avail - xs) - target)
    return int(xs[int(np.argmin(err))])


def _dense_plan(dense_s: _Stream, world_size: int, share: int, mean_work: float, rho_rest: float) -> np.ndarray:
    """Dense tokens per rank if the rest were of one density ``rho_rest``: the dense stream is cut where its
    excess over ``rho_rest`` reaches ``r * (mean_work - share * rho_rest)``, so each rank is on target."""
    if not dense_s.total:
        return np.zeros(world_size, np.int64)
    excess = dense_s.cum_w - rho_rest * dense_s.cum_t
    cuts = np.interp((np.arange(1, world_size) * (mean_work - share * rho_rest)), excess, dense_s.cum_t)
    cuts = np.concatenate([[0.0], cuts, [float(dense_s.total)]])
    return np.minimum(np.diff(np.round(cuts)).astype(np.int64), share)


def _assign_whole(lengths: np.ndarray, work: np.ndarray, rho: np.ndarray, goal: np.ndarray, plan: np.ndarray,
                  cap: np.ndarray, work_cap: np.ndarray, whole_goal: np.ndarray, exact: int, by_small: bool
                  ) -> np.ndarray:
    """Ranks for whole documents (sorted longest first), or -1 for those left to the light stream.

    The fluid fills what a rank's whole documents leave, at density ``rho[r]``, so a document of ``L``
    tokens and work ``w`` changes rank ``r``'s work by ``w - rho[r] * L``; rank ``r`` needs these changes to
    sum to ``goal[r]`` and holds at most ``cap[r]`` whole tokens. The ``exact`` longest go one by one to the
    rank furthest above its goal that has room (longest processing time first); the rest, small, are
    dealt in a low-discrepancy order of sizes and cut in proportion to what each rank still lacks.
    With ``by_small`` the small documents themselves are the fluid (when the dense one is too scarce to
    tune with): rank ``r`` should hold ``whole_goal[r]`` work in ``plan[r]`` whole tokens.
    """
    n, ranks = lengths.size, rho.size
    if by_small and n > exact:
        small = float(work[exact:].sum() / lengths[exact:].sum())
        rho, goal = np.full(ranks, small), whole_goal - small * plan
    rank = np.full(n, -1, np.int64)
    held_t = np.zeros(ranks, np.int64)
    held_w = np.zeros(ranks)
    gap = -goal.astype(np.float64)  # how far each rank is above its goal (the changes are negative)
    for k in range(min(exact, n)):
        fits = (held_t + lengths[k] <= cap) & (held_w + work[k] <= work_cap)
        if not fits.any():
            continue
        change = work[k] - rho * lengths[k]
        # A document lighter than the fluid lowers the gap: it goes to the rank furthest above its goal;
        # one denser than the fluid raises it: it goes to the rank furthest below.
        r = int(np.argmax(np.where(fits, np.where(change <= 0, gap, -gap), -np.inf)))
        rank[k] = r
        held_t[r] += lengths[k]
        gap[r] += work[k] - rho[r] * lengths[k]
        held_w[r] += work[k]
    rest = np.flatnonzero(rank < 0)[np.flatnonzero(rank < 0) >= min(exact, n)]
    if rest.size:
        small = float(work[rest].sum() / lengths[rest].sum())
        # Tokens that close the gap at the fluid's density (the plan's, where the fluid is no denser).
        well = rho - small > 0.25 * rho
        room = np.maximum(np.where(well, gap / np.where(well, rho - small, 1.0), plan - held_t), 0)
        room = np.minimum(room * (lengths[rest].sum() / max(room.sum(), 1)), cap - held_t)
        room = np.minimum(room, np.maximum(work_cap - held_w, 0) / small)
        mixed = rest[np.argsort(np.modf(np.arange(rest.size) * 0.6180339887498949)[0], kind="stable")]
        end = np.cumsum(lengths[mixed])
        bounds = np.cumsum(room)
        to = np.searchsorted(bounds, end, side="left")  # the rank whose room holds the document's end
        ok = to < ranks
        ok[ok] = end[ok] - lengths[mixed][ok] >= bounds[to[ok]] - room[to[ok]]  # and its start: no straddling
        rank[mixed[ok]] = to[ok]
    return rank


def _solve(lengths: np.ndarray, world_size: int, tuner: float, by_small: bool) -> tuple[np.ndarray, dict, float]:
    """``(rank_of_whole, split, imbalance)``: the rank of each whole document (-1 if split), per split document
    ``[(rank, tokens), ...]`` in ring order, and the work's max/mean as planned. The smallest whole documents
    up to ``tuner`` of the tokens join the light stream; ``by_small``: see :func:`_assign_whole`."""
    n_docs = lengths.size
    total = int(lengths.sum())
    share = total // world_size
    work = lengths * (lengths + 1) / 2.0
    w_total = float(work.sum())
    rank_of = np.full(n_docs, -1, np.int64)
    if world_size == 1:
        rank_of[:] = 0
        return rank_of, {}, 1.0
    mean_work = w_total / world_size
    density = (lengths + 1) / 2.0
    fluid = (lengths > share // 2) | (work > mean_work / 2)
    dense = fluid & (density > w_total / total)
    ids = np.arange(n_docs)
    order = np.lexsort((ids, -lengths))  # longest first, then by index: deterministic
    pool = order[~fluid[order]]
    # The smallest whole documents, up to ``tuner`` of the tokens, join the light stream: they tune each rank's
    # work against the dense stream and absorb the exact token count (at most one is cut per rank boundary).
    tail = np.cumsum(lengths[pool][::-1])
    reserve = pool[pool.size - int(np.searchsorted(tail, total * tuner, side="right")):]
    pool = pool[:pool.size - reserve.size]
    d_ids, l_ids = order[dense[order]], np.concatenate([order[(fluid & ~dense)[order]], reserve])
    dense_s, light_s = _Stream(d_ids, lengths[d_ids]), _Stream(l_ids, lengths[l_ids])
    pool_t, pool_w = int(lengths[pool].sum()), float(work[pool].sum())
    rest_t = pool_t + light_s.total
    rho_rest = (pool_w + float(light_s.cum_w[-1])) / rest_t if rest_t else 0.0
    delta = _dense_plan(dense_s, world_size, share, mean_work, rho_rest)
    edges = np.concatenate([[0], np.cumsum(delta)])
    dense_w = dense_s.work(np.diff(edges), edges[:-1]) if dense_s.total else np.zeros(world_size)
    rho_light = float(light_s.cum_w[-1]) / light_s.total if light_s.total else 0.0
    lam = (share - delta) * (light_s.total / rest_t) if rest_t else np.zeros(world_size)
    # The fluid that absorbs a rank's free tokens is its dense stretch (the light stream where it has none).
    rho = np.where(delta > 0, dense_w / np.maximum(delta, 1), rho_light)
    goal = mean_work - rho * (share - lam) - rho_light * lam
    # Room for at least one dense and one light token on every rank, so no stream skips a rank.
    plan = (share - delta) * (pool_t / rest_t) if rest_t else np.zeros(world_size)
    cap = np.minimum(np.floor(plan * 1.1 + 0.02 * share).astype(np.int64), share - 2)
    # No rank's whole documents may carry more than the mean work less the fluid at its lightest.
    work_cap = mean_work - rho_light * (share - cap)
    rank_of[pool] = _assign_whole(lengths[pool], work[pool], rho, goal, plan, cap, work_cap,
                                  mean_work - dense_w - lam * rho_light, 4 * world_size, by_small)
    left = pool[rank_of[pool] < 0]  # no room anywhere: into the light stream
    if left.size:
        light_s.append(left, lengths[left])
    held = rank_of >= 0
    held_t = np.bincount(rank_of[held], weights=lengths[held], minlength=world_size).astype(np.int64)
    held_w = np.bincount(rank_of[held], weights=work[held], minlength=world_size)
    split: dict = {}
    w_left = w_total
    got = np.zeros(world_size)
    for r in range(world_size):
        target = w_left / (world_size - r)
        avail = share - int(held_t[r])
        if r == world_size - 1:
            d_take = dense_s.left
        else:
            min_dense = 1 if dense_s.inside() else 0
            l_take = _tune_light(dense_s, light_s, avail, min(avail, light_s.left), target - held_w[r], min_dense)
            d_take = min(max(avail - l_take, 0), dense_s.left)
        l_take = avail - d_take
        got[r] = held_w[r] + float(dense_s.work(d_take)) + float(light_s.work(l_take))
        w_left -= got[r]
        dense_s.take(d_take)
        light_s.take(l_take)
    dense_s.owners(rank_of, split)  # a stream document that landed on one rank is whole after all
    light_s.owners(rank_of, split)
    return rank_of, split, float(got.max() / got.mean())


def _pieces(length: int, parts: list) -> list:
    """Nested head-tail pieces ``(rank, head_start, head_stop, tail_start, tail_stop)`` of a document of
    ``length`` split as ``parts = [(rank, tokens), ...]``: the rank with the most tokens outermost (head at the
    start, tail at the end), the one with the fewest innermost (one contiguous run). A rank needs the rows
    below its last one, so the big pieces outside leave the others' last rows low."""
    out, head, tail = [], 0, length
    for rank, n in sorted(parts, key=lambda p: (-p[1], p[0])):
        h = n // 2
        out.append((rank, head, head + h, tail - (n - h), tail))
        head, tail = head + h, tail - (n - h)
    return out


@functools.lru_cache(maxsize=32)
def _solution(cu: tuple, world_size: int) -> tuple[np.ndarray, dict]:
    """The solver's answer for checked boundaries ``cu``: whole documents' ranks and split documents' parts."""
    lengths = np.diff(np.asarray(cu, np.int64))
    # When a placement misses the mean work by more than 2%: the small whole documents as the fluid, then
    # larger tuning reserves; the best try wins.
    tries = [_solve(lengths, world_size, 1 / 32, False)]
    for tuner, by_small in ((1 / 32, True), (1 / 16, False), (1 / 8, False)):
        if tries[-1][2] <= 1.02:
            break
        tries.append(_solve(lengths, world_size, tuner, by_small))
    rank_of, split, _ = min(tries, key=lambda t: t[2])
    return rank_of, split


@functools.lru_cache(maxsize=32)
def _placement(cu: tuple, world_size: int) -> tuple[torch.Tensor, ...]:
    """Every rank's positions (increasing packed-stream indices) for checked boundaries ``cu``."""
    bounds = np.asarray(cu, np.int64)
    lengths = np.diff(bounds)
    total = int(bounds[-1])
    rank_of, split = _solution(cu, world_size)
    owner = np.repeat(rank_of, lengths)
    for d, parts in split.items():
        base = int(bounds[d])
        for rank, a, b, c, e in _pieces(int(lengths[d]), parts):
            owner[base + a:base + b] = rank
            owner[base + c:base + e] = rank
    order = np.argsort(owner, kind="stable")
    counts = np.bincount(owner, minlength=world_size)
    if owner.min() < 0 or not (counts == total // world_size).all():  # an internal invariant, not the caller's
        raise AssertionError(f"balanced placement holds {counts.tolist()} tokens per rank, not {total // world_size}")
    return tuple(torch.from_numpy(p) for p in np.split(order, world_size))


def place_documents(cu_seqlens: CuSeqlens, world_size: int) -> tuple[tuple[Piece, ...], ...]:
    """The balanced placement: per rank, the :class:`Piece` s it holds, sorted by document and start.

    Raises ``ValueError`` for bad ``cu_seqlens``, a ``world_size`` below 1, or a packed length that is not
    a multiple of ``2 * world_size``.
    """
    cu = check_cu_seqlens(cu_seqlens)
    BalancedLayout().check(cu[-1], world_size)
    rank_of, split = _solution(cu, int(world_size))
    lengths = np.diff(np.asarray(cu, np.int64))
    pieces: list = [[] for _ in range(int(world_size))]
    for d in np.flatnonzero(rank_of >= 0).tolist():
        pieces[int(rank_of[d])].append(Piece(d, 0, int(lengths[d])))
    for d, parts in split.items():
        for rank, a, b, c, e in _pieces(int(lengths[d]), parts):
            pieces[rank] += [Piece(d, s, t) for s, t in ((a, b), (c, e)) if t > s]
    return tuple(tuple(sorted(p)) for p in pieces)


def placement_picture(cu_seqlens: CuSeqlens, world_size: int, width: int = 64) -> str:
    """An ASCII picture of :func:`place_documents`: one line per document, one character per
    ``ceil(L / width)`` tokens (the longest document ``width`` characters), showing the rank that holds
    them (``0-9a-z``); then one line per rank: its tokens and its causal work over the mean."""
    cu = check_cu_seqlens(cu_seqlens)
    pieces = place_documents(cu, world_size)
    owner: dict = {}
    for rank, ps in enumerate(pieces):
        for p in ps:
            owner.setdefault(p.doc, []).append((p.start, p.stop, rank))
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    scale = max(1, -(-max(b - a for a, b in zip(cu, cu[1:])) // width))
    lines = [f"{world_size} ranks, {cu[-1]} tokens, one character = {scale} token(s)"]
    for d, (a, b) in enumerate(zip(cu, cu[1:])):
        row = ["?"] * -(-(b - a) // scale)
        for start, stop, rank in sorted(owner[d]):
            for c in range(start // scale, -(-stop // scale)):
                row[c] = digits[rank % 36]
        lines.append(f"doc {d:>3} ({b - a:>6} tokens) |{''.join(row)}|")
    work = [sum((p.stop * (p.stop + 1) - p.start * (p.start + 1)) // 2 for p in ps) for ps in pieces]
    mean = sum(work) / world_size
    for rank, ps in enumerate(pieces):
        docs = sorted({p.doc for p in ps})
        lines.append(f"rank {rank}: {sum(p.stop - p.start for p in ps)} tokens, work {work[rank] / mean:.3f} x mean, "
                     f"documents {docs}")
    return "\n".join(lines)


class BalancedLayout(ZigzagLayout):
    """Zigzag without packed documents; with them, the per-batch placement of :func:`place_documents`."""

    name = "balanced"
    aliases = ()

    def _packed_positions(self, cu_seqlens: tuple[int, ...], rank: int, world_size: int) -> torch.Tensor:
        return _placement(tuple(cu_seqlens), world_size)[rank].clone()
