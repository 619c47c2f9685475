"""The command-line flags the benchmarks and studies share, each declared here once, so that ``--heads`` or
``--repeats`` means one thing and reads one way in every script.

A script adds the groups it takes. Each keyword a script passes adds that flag with the keyword's value as
its default; a list default takes one or more values (``nargs="+"``); a keyword left out adds nothing, so
no script accepts a flag it would ignore. The groups:

- :func:`add_ring`: what runs where: ``--seq-lens``, ``--world-size``, ``--world-sizes``,
  ``--tokens-per-rank``, ``--layouts``, ``--layout``, ``--kernel``, ``--device``;
- :func:`add_shape`: the attention's shape: ``--batch``, ``--heads``, ``--kv-heads``, ``--head-dim``,
  ``--dtype``;
- :func:`add_model`: a model's size: ``--layers``, ``--hidden``, ``--intermediate``, ``--vocab``;
- :func:`add_documents`: a packed batch: ``--tokens``, ``--documents``, ``--sigma``, ``--seed``;
- :func:`add_run`: the run itself: ``--repeats``, ``--timeout``, ``--quick``, ``--json``.

The flags a script has alone stay in that script. The module imports the standard library only at
import time (``benchmarks/stress.py`` and ``tests/conftest.py`` import without torch); the groups that
offer the library's names as choices import them when called.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["UNSET", "add_ring", "add_shape", "add_model", "add_documents", "add_run", "resolve_kv_heads"]

Parser = argparse._ActionsContainer  # a parser, or a group of its flags (argparse's add_argument_group)


class _Unset:
    """A flag the script does not take."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()


def _flag(p: Parser, name: str, default: Any, kind: type, text: str, choices: Any = None) -> None:
    """``--name`` with ``default`` (not added when UNSET; a list default takes one or more values)."""
    if default is UNSET:
        return
    many = isinstance(default, (list, tuple))
    p.add_argument(f"--{name}", type=kind, nargs="+" if many else None, default=list(default) if many else default,
                   choices=choices, help=text)


def add_ring(p: Parser, *, seq_lens: Any = UNSET, world_size: Any = UNSET, world_sizes: Any = UNSET,
             tokens_per_rank: Any = UNSET, layouts: Any = UNSET, layout: Any = UNSET, kernel: Any = UNSET,
             device: Any = UNSET) -> None:
    """The sequence, how many ranks split it, with which layouts and kernel, on which device."""
    _flag(p, "seq-lens", seq_lens, int, "global sequence lengths S")
    _flag(p, "world-size", world_size, int, "the number of ranks N (the CP size)")
    _flag(p, "world-sizes", world_sizes, int, "the world sizes N, one measurement each")
    _flag(p, "tokens-per-rank", tokens_per_rank, int, "tokens per rank: the sequence is N x this")
    if layouts is not UNSET or layout is not UNSET:
        from cp_attention import LAYOUT_NAMES

        _flag(p, "layouts", layouts, str, "the layouts, one row each", LAYOUT_NAMES)
        _flag(p, "layout", layout, str, "the layout")
    if kernel is not UNSET:
        from cp_attention import KERNEL_NAMES

        _flag(p, "kernel", kernel, str, "the cp_attention kernel", KERNEL_NAMES)
    _flag(p, "device", device, str, "cpu or cuda: where it runs (the description says how)", ("cpu", "cuda"))


def add_shape(p: Parser, *, batch: Any = UNSET, heads: Any = UNSET, head_pairs: Any = UNSET, kv_heads: Any = UNSET,
              head_dim: Any = UNSET, dtype: Any = UNSET) -> None:
    """The attention's shape. ``--heads`` is one count (``heads``) or a list of ``query/kv`` pairs
    (``head_pairs``, e.g. ``["8/2", "8/8"]``); an unset ``--kv-heads`` is as many as ``--heads``
    (:func:`resolve_kv_heads`)."""
    if heads is not UNSET and head_pairs is not UNSET:
        raise ValueError("add_shape: pass heads (one count) or head_pairs (query/kv pairs), not both")
    _flag(p, "batch", batch, int, "sequences per batch B")
    _flag(p, "heads", heads, int, "query heads")
    _flag(p, "heads", head_pairs, str, "query/kv heads, e.g. 8/2")
    _flag(p, "kv-heads", kv_heads, int, "K/V heads" + (" (unset: as many as --heads)" if kv_heads is None else ""))
    _flag(p, "head-dim", head_dim, int, "head dimension D")
    if dtype is not UNSET:
        from cp_attention.kernels.dtypes import DTYPES

        _flag(p, "dtype", dtype, str, "q, k, v element type", DTYPES)


def add_model(p: Parser, *, layers: Any = UNSET, hidden: Any = UNSET, intermediate: Any = UNSET,
              vocab: Any = UNSET) -> None:
    """A model's size (its heads come from :func:`add_shape`)."""
    _flag(p, "layers", layers, int, "decoder layers")
    _flag(p, "hidden", hidden, int, "hidden size")
    _flag(p, "intermediate", intermediate, int, "MLP intermediate size")
    _flag(p, "vocab", vocab, int, "vocabulary size")


def add_documents(p: Parser, *, tokens: Any = UNSET, documents: Any = UNSET, sigma: Any = UNSET,
                  seed: Any = UNSET) -> None:
    """A packed batch: its length, its documents and how their lengths are drawn."""
    _flag(p, "tokens", tokens, int, "packed length T")
    _flag(p, "documents", documents, int, "documents in the packed batch")
    _flag(p, "sigma", sigma, float, "lognormal spread of the document lengths")
    _flag(p, "seed", seed, int, "seed of the document lengths")


def add_run(p: Parser, *, repeats: Any = UNSET, timeout: Any = UNSET, quick: str | None = None,
            json: str | None = None) -> None:
    """The run: timed repeats, the time limit, ``--quick`` (``quick`` says what the smoke run is) and
    ``--json PATH`` (``json`` says what the file holds)."""
    _flag(p, "repeats", repeats, int, "timed repeats of each measurement, after one warm-up")
    _flag(p, "timeout", timeout, int, "seconds after which a hung run fails instead of waiting")
    if quick is not None:
        p.add_argument("--quick", action="store_true", help=quick)
    if json is not None:
        p.add_argument("--json", metavar="PATH", default=None, help=f"also write {json} as JSON to PATH")


def resolve_kv_heads(args: argparse.Namespace) -> None:
    """An unset ``--kv-heads``: as many K/V heads as query heads."""
    args.kv_heads = args.kv_heads or args.heads
