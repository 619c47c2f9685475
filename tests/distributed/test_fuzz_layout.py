"""Fuzz (issue 12): bad inputs to the layouts' shard / unshard / positions / gather raise ValueError
(or NotImplementedError), never another error or garbage; on real ranks, the same on every rank.
See tests/distributed/test_fuzz_ring.py for the conventions."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.core import fuzz_cases
from tests.support.core.fuzz_common import CASE_TIMEOUT, TRIED, _cu, _layout, _settings, judge

# ----------------------------------------------------------------------------------------------------
# 2. Layouts: shard / unshard / positions / gather (no process group: index math only)
# ----------------------------------------------------------------------------------------------------

LAYOUT_OBJECTS = ("contiguous", "zigzag", "interleaved", "reversed_zigzag")  # the last has no packed documents
NOT_INTS = (0.5, 2.0, True, None, "2", float("nan"))


@st.composite
def layout_setup(draw):
    """A valid (layout, world_size, rank, seq_len, cu_seqlens or None)."""
    name = draw(st.sampled_from(LAYOUT_OBJECTS))
    lay = _layout(name)
    n = draw(st.integers(1, 4))
    seq = lay.divisor(n) * draw(st.integers(1, 3))
    cu = None
    if name != "reversed_zigzag" and draw(st.booleans()):
        cu = _cu(draw, seq)
    return name, n, draw(st.integers(0, n - 1)), seq, cu


def _bad_cu(draw, seq: int):
    return draw(st.sampled_from((
        [1, seq], [0, seq + 1], [0, max(1, seq - 1)] if seq > 1 else [0, 2], [0, 0, seq], [0], [], [0, -1, seq],
        [0.0, float(seq)], f"0,{seq}", 3, [[0, seq]], ("tensor", [0, seq], "float32"),
        ("tensor", [False, True], "bool"), ("tensor", [0, seq], "int64", "meta"), ("tensor", [[0, seq]], "int64"),
        [0, 2 ** 70], [0, True, seq])))


def _cu_arg(value):
    return fuzz_cases.make_arg(value) if isinstance(value, tuple) and value and value[0] == "tensor" else value


LAYOUT_OPS = ("positions", "shard", "unshard", "gather")


@st.composite
def layout_case(draw):
    """``(op, defect, kwargs)``: one call of a Layout method with one defect (or none: defect "valid")."""
    name, n, rank, seq, cu = draw(layout_setup())
    op = draw(st.sampled_from(LAYOUT_OPS))
    defects = {"positions": ("seq_len", "rank", "world_size", "cu_seqlens"),
               "shard": ("seq_len", "rank", "world_size", "dim", "cu_seqlens", "scalar"),
               "unshard": ("seq_len", "dim", "cu_seqlens", "scalar", "shards"),
               "gather": ("dim", "cu_seqlens", "scalar")}[op]
    defect = draw(st.sampled_from(defects + ("valid",)))
    shape = [2, 3]
    dim = draw(st.integers(0, 2))
    shape.insert(dim, seq)
    args = dict(layout=name, world_size=n, rank=rank, seq_len=seq, cu_seqlens=cu, dim=dim, shape=shape,
                good_dim=dim, good_cu=cu)
    if defect == "seq_len":  # a length the layout cannot split
        bad = draw(st.sampled_from((0, -_layout(name).divisor(n), *NOT_INTS) if op == "positions" else (0, 1)))
        if op == "unshard":  # shards of unequal length, or of a length that does not split
            args["shard_lengths"] = draw(st.sampled_from(("unequal", "zero", "indivisible")))
        elif bad in (0, 1) and op == "shard":
            args["shape"][dim] = seq + 1 if bad == 1 and _layout(name).divisor(n) > 1 else 0
        else:
            args["seq_len"] = bad
        args["cu_seqlens"] = None
    elif defect == "rank":
        args["rank"] = draw(st.sampled_from((-1, n, n + 3, *NOT_INTS)))
    elif defect == "world_size":
        args["world_size"] = draw(st.sampled_from((0, -1, -n, *NOT_INTS)))
    elif defect == "dim":
        args["dim"] = draw(st.sampled_from((3, -4, 7, 1.0, None, "1")))
    elif defect == "cu_seqlens":
        args["cu_seqlens"] = _bad_cu(draw, seq)
    elif defect == "scalar":  # a 0-D tensor has no sequence dimension
        args["shape"] = []
        args["dim"] = 0
    elif defect == "shards":
        args["shards_defect"] = draw(st.sampled_from(("empty", "ndim", "dtype", "device", "other_dim", "not_tensor")))
    return op, defect, args


def _run_layout_op(op, args):
    import torch

    lay = _layout(args["layout"])
    n, rank, dim = args["world_size"], args["rank"], args["dim"]
    cu = _cu_arg(args["cu_seqlens"])
    x = torch.arange(float(math.prod(args["shape"]))).reshape(args["shape"])
    if op == "positions":
        pos = lay.positions(args["seq_len"], rank, n, cu)
        assert pos.dtype == torch.int64 and pos.numel() == args["seq_len"] // n
        return
    if op == "shard":
        lay.shard(x, dim, rank, n, cu)
        return
    if op == "gather":
        assert lay.gather(x, dim, cu_seqlens=cu) is x  # no process group: the identity, after the checks
        return
    # unshard: the shards of x, possibly broken
    how = args.get("shard_lengths")
    if x.dim() == 0:
        shards = [x] * n
    elif how is None:
        shards = [lay.shard(x, args["good_dim"], r, n, args["good_cu"]) for r in range(n)]
    else:
        # unequal lengths (two shards at least), empty shards, or a total the layout cannot split
        lengths = {"unequal": [2] + [1] * max(1, n - 1), "zero": [0] * n,
                   "indivisible": [1] * n if lay.divisor(n) > n else [1] * max(1, n - 1) + [2]}[how]
        if how == "indivisible" and lay.divisor(n) <= n:
            lengths = [1, 2] if n == 1 else lengths  # "unequal" then, as the layout splits any n tokens
        d = args["good_dim"]
        shards = [x.new_zeros([length if i == d else size for i, size in enumerate(x.shape)]) for length in lengths]
    defect = args.get("shards_defect")
    if defect in ("ndim", "dtype", "device", "other_dim") and len(shards) == 1:
        shards.append(shards[0].clone())  # a mismatch needs two shards
    if defect == "empty":
        shards = []
    elif defect == "ndim":
        shards[-1] = shards[-1].unsqueeze(0)
    elif defect == "dtype":
        shards[-1] = shards[-1].double()
    elif defect == "device":
        shards[-1] = shards[-1].to("meta")
    elif defect == "other_dim":
        other = (args["good_dim"] + 1) % x.dim()
        shards[-1] = torch.cat([shards[-1], shards[-1].narrow(other, 0, 1)], other)
    elif defect == "not_tensor":
        shards[-1] = shards[-1].tolist()
    full = lay.unshard(shards, dim, cu)
    if not args.get("shards_defect") and how is None:
        assert torch.equal(full, x)


@_settings(500)
@given(case=layout_case())
def test_layout_bad_inputs(case):
    op, defect, args = case
    if defect == "valid":
        TRIED["layout valid"] += 1
        _run_layout_op(op, args)
        return
    TRIED["layout"] += 1
    with pytest.raises((ValueError, NotImplementedError)):
        _run_layout_op(op, args)


@st.composite
def gather_case(draw, world_size: int):
    """``(kind, per-rank specs)`` for :func:`fuzz_cases.gather_call`: every rank's shard alike ("valid"),
    or some ranks' shard or arguments broken or different from the others'."""
    name = draw(st.sampled_from(("contiguous", "zigzag", "interleaved")))
    local = _layout(name).divisor(world_size) // world_size * draw(st.integers(1, 3))
    dim = draw(st.integers(0, 2))
    shape = [2, 3]
    shape.insert(dim, local)
    spec = dict(x=(tuple(shape), "float32", "cpu"), dim=dim, layout=name)
    if draw(st.booleans()):
        spec["cu_seqlens"] = ("raw", _cu(draw, local * world_size))
    kind = draw(st.sampled_from(("length", "other_dim", "dtype", "ndim", "dim", "dim_out_of_range", "cu_differs",
                                 "cu_bad", "scalar", "valid", "valid")))
    specs = [dict(spec) for _ in range(world_size)]
    if kind == "valid":
        return kind, specs
    some = draw(st.sets(st.integers(0, world_size - 1), min_size=1,
                        max_size=world_size if kind in ("dim_out_of_range", "cu_bad", "scalar") else world_size - 1))
    for r in some:
        s = specs[r]
        shape = list(s["x"][0])
        if kind == "length":
            shape[dim] += _layout(name).divisor(world_size) // world_size
        elif kind == "other_dim":
            shape[(dim + 1) % 3] += 1
        elif kind == "ndim":
            shape.append(1)
        elif kind == "scalar":
            shape = []
        s["x"] = (tuple(shape), "float64" if kind == "dtype" else "float32", "cpu")
        if kind == "dim":  # another axis
            s["dim"] = draw(st.sampled_from(((dim + 1) % 3, (dim + 2) % 3 - 3)))
        elif kind == "dim_out_of_range":
            s["dim"] = draw(st.sampled_from((3, -4, 9)))
        elif kind == "cu_differs":
            total = local * world_size
            old = s.get("cu_seqlens", (None, None))[1]
            s["cu_seqlens"] = ("raw", [0, 1, total] if old != [0, 1, total] else [0, total])
        elif kind == "cu_bad":
            s["cu_seqlens"] = ("raw", draw(st.sampled_from(([0, local * world_size + 1], [1, 2], [0, 0, 1], []))))
    return kind, specs


@pytest.mark.parametrize("world_size", [2, 3])
def test_layout_gather_bad_inputs(pools, world_size):
    @_settings(40)
    @given(case=gather_case(world_size))
    def run(case):
        kind, specs = case
        results = pools(world_size).run(fuzz_cases.gather_call, specs=specs, timeout=CASE_TIMEOUT)
        judge("Layout.gather", kind, results, f"{kind}: {specs}")

    run()
