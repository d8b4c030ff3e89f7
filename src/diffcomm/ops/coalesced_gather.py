"""``all_gather_coalesced`` and ``reduce_scatter_coalesced``: the list ops along a dim, with
sizes that may differ between ranks (one communication per dtype; re-exported by
:mod:`diffcomm.ops.coalesced`, their public home).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from .._errors import CrossRankMismatchError
from .._torch import compiling
from ..backend import args as A
from ..backend import label
from ..backend.args import PG
from ..backend.buffers import joined
from .all_gather import _AllGather, _ReduceScatter
from .base import ListOp, apply, call, list_args
from .coalesced_reduce import _AllReduceList
from .packing import back as _back
from .packing import by_dtype as _by_dtype
from .packing import case_specs as _case_specs
from .packing import check_dims as _check_dims
from .packing import check_list as _check_list
from .packing import check_op as _check_op
from .packing import check_split_sizes_list as _check_sizes
from .packing import debug_check as _debug_check
from .packing import even_or_none as _even_or_none
from .packing import even_split_sizes as _even_sizes
from .packing import moved as _moved
from .packing import pack as _pack
from .packing import unpack as _unpack
from .precision_format import Precision, quantized
from .registry import Kwargs
from .shared_args import shared_args
from .validation import Learned
from .validation import current_backend as _b
from .validation import own_slice as _own_slice
from .validation import rank as _rank
from .validation import with_sizes as _with
from .validation import world as _world

SplitSizes = tuple[tuple[int, ...], ...] | None  # per tensor, every rank's size along its dim


def _tensor_major(
    moved: list[Tensor], groups: list[list[int]], bufs: Sequence[Tensor], world: int, out: list[Any]
) -> list[Any]:
    """Even gathered buffers (rank-major) -> one tensor per input (one copy each)."""
    for g, buf in zip(groups, bufs):
        rows = buf.view(world, buf.numel() // world).split([moved[i].numel() for i in g], dim=1)
        for i, block in zip(g, rows):
            m = moved[i]
            out[i] = block.reshape(world * m.shape[0], *m.shape[1:])
    return out


class _LearnedList(Learned):
    """:class:`Learned` sizes of an ``all_gather_coalesced``, with the list's *logical*
    shapes (``logical``: per tensor, its shape without ``dim`` and its dtype, as the user
    sees it — without any vmap batch dim)."""

    logical: tuple[tuple[tuple[int, ...], torch.dtype], ...] = ()


def _learning_key(moved: list[Tensor], sizes: Learned) -> tuple[Any, int]:
    """The key under which the group remembers this list's sizes, and the unit (in
    elements) its buffers are counted in.

    Both come from the logical shapes, so a vmapped call is the unbatched call with every
    element ``B`` times wider: it shares the unbatched call's key and remembered row
    counts, and its cost (one collective per dtype once the group knows the list) does
    not depend on the batch size. (Keyed by the batched shapes, every new batch size was
    a new list — one more size exchange — and a larger batch overflowed the remembered
    padding — one more gather.)"""
    logical = getattr(sizes, "logical", ())
    physical = tuple((tuple(m.shape[1:]), m.dtype) for m in moved)
    if len(logical) != len(moved):
        return ("coalesced", physical), 1
    ratios = set()
    for m, (rest, _) in zip(moved, logical):
        n_log, n_phys = math.prod(rest), math.prod(m.shape[1:])
        if n_log == 0 or n_phys % n_log:
            return ("coalesced", physical), 1
        ratios.add(n_phys // n_log)
    if len(ratios) != 1:
        return ("coalesced", physical), 1
    return ("coalesced", logical), ratios.pop()


def _dims_code(dims: Sequence[int]) -> int:
    """The gathered dims as one int, sent after the sizes (in the same exchange: free), so
    ranks gathering square tensors along different dims, which agree in every size and
    move the same bytes (a silently wrong value on every rank), are an error instead."""
    return zlib.crc32(repr(tuple(dims)).encode())


def _check_same_dims(table: list[list[int]], dims: Sequence[int]) -> None:
    """Raise :class:`~diffcomm.CrossRankMismatchError` on every rank (all hold ``table``,
    whose rows end with :func:`_dims_code`) when the ranks' gathered dims differ."""
    if all(row[-1] == table[0][-1] for row in table):
        return
    classes: dict[int, list[int]] = {}
    for r, row in enumerate(table):
        classes.setdefault(row[-1], []).append(r)
    agree = " | ".join(str(rs) for rs in classes.values())
    raise CrossRankMismatchError(
        "diffcomm.all_gather_coalesced(): the ranks must concatenate along the same `dim`, but "
        f"it differs between ranks (ranks that agree: {agree}; this rank's dim per tensor: "
        f"{tuple(dims)}). Every rank must pass the same dim."
    )


class _AllGatherList(ListOp):
    """all_gather of every tensor ``i`` along ``dims[i]``; ``split_sizes[i]``: every rank's size
    along it (``None``: the same on every rank, the even path)."""

    name = "all_gather_coalesced"
    family = "coalesced"
    order = 30
    nmeta = 3  # dims, pg, split_sizes
    dims = 0
    forward_text = "each tensor concatenated over ranks along dim"
    backward_text = "reduce_scatter_coalesced(sum)"
    # element i is all_gather(tensors[i]): its rule (no coalesced mapping to name instead)
    spmd = replace(_AllGather.spmd, instead=None)

    @staticmethod
    def run(xs: Sequence[Tensor], dims: tuple[int, ...], pg: PG, split_sizes: SplitSizes) -> list[Tensor]:
        world = _world(pg)
        moved = _moved(xs, dims)
        groups = _by_dtype(moved)
        out: list[Any] = [None] * len(xs)
        if split_sizes is None:
            bufs = _b().all_gather_coalesced(_pack(moved, groups), pg)
            return _back(_tensor_major(moved, groups, bufs, world, out), dims)
        # variable split_sizes: rank r's buffer of a dtype holds its rows of every tensor of that
        # dtype, so the buffers' lengths differ between ranks: one uneven all_gather each
        inner = [math.prod(m.shape[1:]) for m in moved]
        if isinstance(split_sizes, Learned) and not split_sizes:  # learned here, with the first buffer
            key, unit = _learning_key(moved, split_sizes)

            def length(g: int, counts: list[int]) -> int:
                return sum(counts[i] * inner[i] for i in groups[g]) // unit

            packed = _pack(moved, groups)
            if unit > 1:  # batched: counted in units of the batch (the same bytes)
                packed = [b.reshape(-1, unit) for b in packed]
            bufs, table = _b().all_gather_coalesced_unsized(
                packed, [*(m.shape[0] for m in moved), _dims_code(dims)], length, key, pg
            )
            _check_same_dims(table, dims)
            bufs = [b.reshape(-1) for b in bufs]
            split_sizes.extend(tuple(row[i] for row in table) for i in range(len(xs)))
            if _even_or_none(tuple(split_sizes)) is None:  # as it turned out, the even layout
                return _back(_tensor_major(moved, groups, bufs, world, out), dims)
        else:
            lens = [[sum(split_sizes[i][r] * inner[i] for i in g) for r in range(world)] for g in groups]
            bufs = _b().all_gather_coalesced(_pack(moved, groups), pg, lens)
        for g, buf in zip(groups, bufs):
            ln = [sum(split_sizes[i][r] * inner[i] for i in g) for r in range(world)]
            pieces: dict[int, list[Tensor]] = {i: [] for i in g}
            for r, seg in enumerate(buf.split(ln)):
                for i, piece in zip(g, seg.split([split_sizes[i][r] * inner[i] for i in g])):
                    pieces[i].append(piece.view(split_sizes[i][r], *moved[i].shape[1:]))
            for i in g:
                out[i] = joined(pieces[i])
        return _back(out, dims)

    @staticmethod
    def transpose(
        ctx: Any, gs: list[Tensor], idx: list[int], dims: tuple[int, ...], pg: PG, split_sizes: SplitSizes
    ) -> Any:
        part = None if split_sizes is None else _even_or_none(tuple(split_sizes[i] for i in idx))
        return call(_ReduceScatterList, *list_args(gs, tuple(dims[i] for i in idx), "sum", pg, part))

    @staticmethod
    def out_shape(xs: Sequence[Tensor], dims: tuple[int, ...], pg: PG, split_sizes: SplitSizes) -> list[Any]:
        world = _world(pg)
        return [
            _with(x.shape, {d: x.shape[d] * world if split_sizes is None else sum(split_sizes[i])})
            for i, (x, d) in enumerate(zip(xs, dims))
        ]

    @staticmethod
    def dual_args(kw: Kwargs, world: int) -> tuple[Kwargs, float]:
        return {"dim": kw.get("dim", 0), "split_sizes": kw.get("split_sizes")}, 1.0

    @staticmethod
    def cases(world: int) -> Iterator[Kwargs]:
        w, with_dim = world, _case_specs(world)[2]
        yield {"specs": with_dim, "kwargs": {"dim": -1}}
        yield {"specs": with_dim, "kwargs": {"dim": 0}}
        # split_sizes along dim that differ between ranks: learned (one exchange) or given; a
        # rank with no rows
        varied = tuple(tuple((i + r) % 3 if i != 2 else 0 for r in range(w)) for i in range(len(with_dim)))
        yield {"specs": with_dim, "kwargs": {"dim": 0}, "rank_sizes": varied}
        yield {"specs": with_dim, "kwargs": {"dim": 0, "split_sizes": varied}, "rank_sizes": varied}


class _ReduceScatterList(ListOp):
    """Linear (sum/avg) reduce_scatter of every tensor ``i`` along ``dims[i]``, split
    ``split_sizes[i]`` (``None``: every tensor evenly)."""

    name = "reduce_scatter_coalesced"
    family = "coalesced"
    order = 31
    dual = _AllGatherList
    nmeta = 4  # dims, op, pg, split_sizes
    dims = 0
    forward_text = "chunk r of each tensor's reduction along dim"
    backward_text = "all_gather_coalesced"
    spmd = _ReduceScatter.spmd  # reduce_scatter's, per element

    @staticmethod
    def run(
        xs: Sequence[Tensor], dims: tuple[int, ...], op: str, pg: PG, split_sizes: SplitSizes
    ) -> list[Tensor]:
        world = _world(pg)
        moved = _moved(xs, dims)
        groups = _by_dtype(moved)
        if split_sizes is None:
            # rank-major layout: row r of each buffer holds chunk r of every tensor of the dtype
            bufs = [
                joined([moved[i].reshape(world, moved[i].numel() // world) for i in g], 1) for g in groups
            ]
            parts = _b().reduce_scatter_coalesced([b.view(-1) for b in bufs], op, pg)
            shapes = [(m.shape[0] // world, *m.shape[1:]) for m in moved]
            return _back(_unpack(shapes, groups, parts), dims)
        # uneven: rank-major again, chunk r of tensor i is split_sizes[i][r] rows long, so the
        # buffer splits unevenly between ranks (one uneven reduce_scatter per dtype)
        rank = _rank(pg)
        inner = [math.prod(m.shape[1:]) for m in moved]
        starts = [[sum(s[:r]) for r in range(world)] for s in split_sizes]
        bufs = [
            joined(
                [
                    moved[i].narrow(0, starts[i][r], split_sizes[i][r]).reshape(-1)
                    for r in range(world)
                    for i in g
                ]
            )
            for g in groups
        ]
        lens = [[sum(split_sizes[i][r] * inner[i] for i in g) for r in range(world)] for g in groups]
        parts = _b().reduce_scatter_coalesced(bufs, op, pg, lens)
        shapes = [(split_sizes[i][rank], *m.shape[1:]) for i, m in enumerate(moved)]
        return _back(_unpack(shapes, groups, parts), dims)

    @staticmethod
    def label(dims: tuple[int, ...], op: str, pg: PG, split_sizes: SplitSizes) -> str:
        return f"reduce_scatter_coalesced({op})"

    @staticmethod
    def transpose(
        ctx: Any,
        gs: list[Tensor],
        idx: list[int],
        dims: tuple[int, ...],
        op: str,
        pg: PG,
        split_sizes: SplitSizes,
    ) -> Any:
        part = None if split_sizes is None else tuple(split_sizes[i] for i in idx)
        out = call(_AllGatherList, *list_args(gs, tuple(dims[i] for i in idx), pg, part))
        if op != "avg":
            return out
        world = _world(pg)
        return [o / world for o in out]

    @staticmethod
    def out_shape(
        xs: Sequence[Tensor], dims: tuple[int, ...], op: str, pg: PG, split_sizes: SplitSizes
    ) -> list[Any]:
        world, rank = _world(pg), _rank(pg)
        return [
            _with(x.shape, {d: x.shape[d] // world if split_sizes is None else split_sizes[i][rank]})
            for i, (x, d) in enumerate(zip(xs, dims))
        ]

    dual_args = staticmethod(_ReduceScatter.dual_args)  # reduce_scatter's, per element

    @staticmethod
    def cases(world: int) -> Iterator[Kwargs]:
        w, with_dim = world, _case_specs(world)[2]
        no_int_dim = tuple(s for s in with_dim if s[1] != "int64")
        for rop in ("sum", "avg", "min"):
            yield {"specs": no_int_dim if rop == "avg" else with_dim, "kwargs": {"dim": 0, "op": rop}}
        # uneven splits
        split = tuple(tuple(w if r == i % w else 0 for r in range(w)) for i in range(len(with_dim)))
        for rop in ("sum", "avg", "max"):
            specs = no_int_dim if rop == "avg" else with_dim
            yield {"specs": specs, "kwargs": {"dim": 0, "op": rop, "split_sizes": split[: len(specs)]}}


@shared_args
def all_gather_coalesced(
    tensors: Sequence[Tensor],
    dim: int = 0,
    group: A.GroupLike = None,
    *,
    split_sizes: Sequence[Sequence[int]] | None = None,
    async_op: bool = False,
    precision: Precision | None = None,
) -> list[Tensor]:
    """Concatenate every rank's ``tensors[i]`` along ``dim``: one communication per dtype.

    Args:
        tensors: a non-empty list or tuple of tensors with at least one dimension (any
            shapes, mixed dtypes, one device); shapes agree between ranks except along
            ``dim``, where they may differ (as for :func:`diffcomm.all_gather`).
        dim: the dimension to concatenate along (negative counts from each tensor's end).
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        split_sizes: keyword-only; per tensor, every rank's ``tensors[i].shape[dim]`` if
            already known (``split_sizes[i][rank]`` must equal this rank's size). Without
            it the sizes are learned with **one** small exchange of host integers for the
            whole list (never one per tensor). Under ``torch.compile`` nothing can be
            exchanged: without ``split_sizes`` the sizes are taken to be equal on every rank.
        async_op: {async_op_list}

    Returns:
        A list of new tensors: ``out[i]`` is ``tensors[i].shape`` with ``dim`` of size
        ``sum(sizes_i)``, rank ``r``'s block at ``sum(sizes_i[:r])`` (equal sizes:
        ``world * shape[dim]``, rank ``r``'s block at ``r * shape[dim]``).

    Gradient:
        ``reduce_scatter_coalesced(grad, dim, op="sum", split_sizes=sizes)`` (one
        communication per dtype, the sizes reused, never exchanged again): each rank gets
        the sum over ranks of the gradient of its own block.

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: dc.all_gather_coalesced([torch.ones(dc.get_rank() + 1)]))
            # [[tensor([1., 1., 1.])], [tensor([1., 1., 1.])]]  (rank 0 sent 1 row, rank 1 two)
    """
    if precision is not None:  # each tensor its own quantized all_gather (docs/precision.md)
        kw = {"dim": dim, "group": group, "split_sizes": split_sizes}
        return quantized("coalesced")("all_gather", tensors, precision, async_op, **kw)
    name = "all_gather_coalesced"
    ts = _check_list(tensors, name)
    dims = _check_dims(ts, dim, name)
    pg = A.resolve_group(group, name)
    world = _world(pg)
    sizes: SplitSizes = None
    if split_sizes is not None:
        sizes = _check_sizes(split_sizes, ts, dims, world, name, True, _rank(pg))
    flat = () if sizes is None else tuple(v for s in sizes for v in s)
    # async_op without split_sizes: its sizes are exchanged first, a blocking call's sent
    # with the rows once the group knows the list (mixed, gloo aborts a rank): a field
    # only then (as in all_gather)
    unsized_async = {"async_op": True} if async_op and sizes is None else {}
    _debug_check(name, pg, ts, vary=dims, dim=tuple(dims), split_sizes=flat, **unsized_async)
    meta: Any = _even_or_none(sizes)
    if sizes is None and world > 1 and not compiling():
        b = _b()
        if async_op or getattr(b, "all_gather_coalesced_unsized", None) is None:
            # the output shapes are needed before the op runs: exchanged first, once
            with label(f"{name} (size exchange)"):
                table = b.exchange_size_lists([*(t.shape[d] for t, d in zip(ts, dims)), _dims_code(dims)], pg)
            _check_same_dims(table, dims)
            meta = _even_or_none(tuple(tuple(row[i] for row in table) for i in range(len(ts))))
        else:  # learned by the op itself: with the first buffer once the group knows the list
            meta = _LearnedList()
            meta.logical = tuple(
                (tuple(t.shape[:d]) + tuple(t.shape[d + 1 :]), t.dtype) for t, d in zip(ts, dims)
            )
    return list(apply(_AllGatherList, *list_args(ts, tuple(dims), pg, meta), async_op=async_op))


@shared_args
def reduce_scatter_coalesced(
    tensors: Sequence[Tensor],
    dim: int = 0,
    op: Any = "sum",
    group: A.GroupLike = None,
    *,
    split_sizes: Sequence[Sequence[int]] | None = None,
    async_op: bool = False,
    precision: Precision | None = None,
) -> list[Tensor]:
    """Reduce every tensor over ranks and give rank ``r`` chunk ``r`` of each along ``dim``.

    Args:
        tensors: a non-empty list or tuple of tensors with at least one dimension (any
            shapes, mixed dtypes, one device), same shapes on every rank.
        dim: the dimension to split (negative counts from each tensor's end).
        op: reduce op as for :func:`diffcomm.all_reduce`.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        split_sizes: keyword-only; per tensor, the per-rank chunk sizes along ``dim``
            (summing to ``tensors[i].shape[dim]``; the same on every rank), so rank
            ``r``'s chunk sizes may differ from the others'. ``None``: every tensor splits
            evenly (each ``shape[dim]`` divisible by the group size).
        async_op: {async_op_list}

    Returns:
        A list of new tensors: ``out[i]`` is ``tensors[i].shape`` with ``dim`` of size
        ``split_sizes[i][rank]`` (even: ``shape[dim] // world``), equal to
        ``dc.reduce_scatter(tensors[i], dim, op, split_sizes=split_sizes[i])``.

    Gradient:
        ``all_gather_coalesced(grad, dim, split_sizes=split_sizes)`` (one communication
        per dtype; divided by the world size for avg). ``max``/``min``/``product`` reduce
        the whole buffers (:func:`all_reduce_coalesced` and its rule) and keep the own
        chunk, like :func:`diffcomm.reduce_scatter`.

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: dc.reduce_scatter_coalesced([torch.arange(4.0)], split_sizes=[[1, 3]]))
            # [[tensor([0.])], [tensor([2., 4., 6.])]]
    """
    if precision is not None:  # each tensor its own quantized reduce_scatter (docs/precision.md)
        kw = {"dim": dim, "op": op, "group": group, "split_sizes": split_sizes}
        return quantized("coalesced")("reduce_scatter", tensors, precision, async_op, **kw)
    name = "reduce_scatter_coalesced"
    ts = _check_list(tensors, name)
    dims = _check_dims(ts, dim, name)
    op_name = _check_op(op, ts, name)
    pg = A.resolve_group(group, name)
    world = _world(pg)
    if split_sizes is None:
        sizes = _even_sizes(ts, dims, world, name)
    else:
        sizes = _check_sizes(split_sizes, ts, dims, world, name, False, _rank(pg))
    flat = () if split_sizes is None else tuple(v for s in sizes for v in s)
    _debug_check(name, pg, ts, op=op_name, dim=tuple(dims), split_sizes=flat)
    if op_name in A.LINEAR_OPS:
        args = list_args(ts, tuple(dims), op_name, pg, _even_or_none(sizes))
        return list(apply(_ReduceScatterList, *args, async_op=async_op))
    # max/min/product: reduce everything, keep the own chunk (as dc.reduce_scatter)
    full = apply(_AllReduceList, *list_args(ts, op_name, pg), async_op=async_op)
    return [y.narrow(d, *_own_slice(s, pg)) for y, d, s in zip(full, dims, sizes)]
