"""Coalesced collectives: one communication per dtype for a whole list of tensors.

``all_reduce_coalesced``, ``broadcast_coalesced``, ``all_gather_coalesced`` and
``reduce_scatter_coalesced`` take a list (or tuple) of tensors of any shapes and mixed
dtypes and return a list in the same order; element ``i`` equals the single-tensor op
applied to ``tensors[i]``, with the same gradient. Real models move many small tensors
(biases, layer-norm weights, statistics); one collective each pays the per-collective
latency many times over.

How: the tensors are grouped by dtype (in order of first appearance); each group is
**packed** into one flat buffer (``torch.cat`` of the flattened tensors, laid out so the
op becomes a plain dim-0 op on the buffer), **one** raw collective runs per buffer, and
the result is **split back with views** (``split`` + ``view`` / ``movedim``; only
``all_gather_coalesced`` copies, because the gathered buffer is rank-major and each
result must be tensor-major).

Gradient convention as for every collective (the objective is the sum of the per-rank
objectives): the backward of a coalesced op is its **dual coalesced op**, again one
communication per dtype:

==========================  =========================================================
op                          backward (adjoint)
==========================  =========================================================
all_reduce_coalesced        all_reduce_coalesced of the gradients (sum/avg); max/min:
                            the summed gradient goes to the arg-extreme ranks, ties split
                            (the tie counts travel in the same buffer: still one call per
                            dtype); product: zero-safe product of the others (one more
                            all_reduce per dtype: the zero counts share the gradients'
                            buffer, the product of the non-zero values is its own call)
broadcast_coalesced         reduce_coalesced(sum) to ``src``; other ranks exact zeros
reduce_coalesced            broadcast_coalesced from ``dst`` (divided by the world for avg)
all_gather_coalesced        reduce_scatter_coalesced(sum)
reduce_scatter_coalesced    all_gather_coalesced (divided by the world size for avg)
==========================  =========================================================

The packing (``cat`` / ``split`` / ``view``) is ordinary differentiable torch, so the
autograd Functions below only ever see flat buffers, one per dtype. Every rank runs the
same backward collectives: the gradient of a buffer covers every tensor packed into it,
with zeros where an output got no gradient or its input does not require grad.
"""

# Size: ~700 lines, over the ~600 guideline until issue 32's op-class rewrite splits ops/.

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..backend import args as A
from ..backend import label
from . import engine as _async
from .base import ListOp, call_list
from .base import only_on as _only_on
from .collectives import WEIGHT_DTYPE, product_parts, product_weight
from .engine import async_if as _async_if
from .packing import back as _back
from .packing import by_dtype as _by_dtype
from .packing import check_dims as _check_dims
from .packing import check_list as _check_list
from .packing import check_op as _check_op
from .packing import check_split_sizes_list as _check_sizes
from .packing import debug_check as _debug_check
from .packing import even_or_none as _even_or_none
from .packing import moved as _moved
from .packing import pack as _pack
from .packing import unpack as _unpack
from .packing import unpack_like as _unpack_like
from .registry import OpSpec, markdown, register
from .validation import PG
from .validation import current_backend as _b
from .validation import rank as _rank
from .validation import world as _world

__all__ = [
    "all_reduce_coalesced",
    "broadcast_coalesced",
    "reduce_coalesced",
    "all_gather_coalesced",
    "reduce_scatter_coalesced",
    "COALESCED_OPS",
    "coalesced_markdown",
]


# ======================================================================================
# the list ops (one autograd node for the whole list; one raw call per dtype), on the
# ListOp base of diffcomm.ops.base: each states run / transpose / label, the base the rest
# ======================================================================================


class _AllReduceList(ListOp):
    """Self-adjoint for sum/avg; max/min/product are the sum composed with a weight."""

    name = "all_reduce_coalesced"
    nmeta = 2  # op, pg
    same_shapes = True

    @staticmethod
    def nonlinear(meta: tuple[Any, ...]) -> bool:
        return meta[0] not in A.LINEAR_OPS

    @staticmethod
    def label(op: str, pg: PG) -> str:
        return f"all_reduce_coalesced({op})"

    @staticmethod
    def run(xs: Sequence[Tensor], op: str, pg: PG) -> list[Tensor]:
        groups = _by_dtype(xs)
        return _unpack_like(xs, groups, _b().all_reduce_coalesced(_pack(xs, groups), op, pg, owned=True))

    @staticmethod
    def transpose(ctx: Any, gs: list[Tensor], idx: list[int], op: str, pg: PG) -> Any:
        if op in A.LINEAR_OPS:
            return call_list(_AllReduceList, 2, op, pg, *gs)
        saved, n = ctx.saved_tensors, len(ctx.meta)
        xs = [saved[i] for i in idx]
        if op == "product":  # the gradients and the zero counts share the sum buffers
            ws, g_total = _product_weights(xs, pg, gs)
            return [g * w.conj() for g, w in zip(g_total, ws)]
        # max/min: the gradients and the tie masks share the buffers (same dtypes): one
        # call per dtype
        masks = [(x.detach() == saved[n + i].detach()).to(x.dtype) for x, i in zip(xs, idx)]
        both = call_list(_AllReduceList, 2, "sum", pg, *gs, *masks)
        k = len(gs)
        return [g * (m / c).conj() for g, m, c in zip(both[:k], masks, both[k:])]

    @staticmethod
    def tangent(ctx: Any, ts: list[Tensor], op: str, pg: PG) -> Any:
        n = len(ts)
        saved = ctx.saved_tensors
        xs, ys = saved[:n], saved[n:]
        if op == "product":
            ws = _product_weights(xs, pg)[0]
        else:
            masks = [(x == y).to(x.dtype) for x, y in zip(xs, ys)]
            ws = [m / c for m, c in zip(masks, call_list(_AllReduceList, 2, "sum", pg, *masks))]
        return call_list(_AllReduceList, 2, "sum", pg, *(t * w for t, w in zip(ts, ws)))


def _product_weights(xs: Sequence[Tensor], pg: PG, summed: Sequence[Tensor] = ()) -> tuple[list, list]:
    """``prod_{j != r} x_j`` per tensor (zero-safe, O(n) memory at any world size; the
    rule of :func:`diffcomm.ops.collectives.product_weight`): the zero counts and zero entries
    in one sum all_reduce per dtype, the product of the non-zero values in one product
    all_reduce per dtype. ``summed`` (tensors of the same dtypes, e.g. the gradients) are
    sum-reduced in the same call (float16/bfloat16: the weight is computed in float32, so
    its counts travel in a float32 buffer of their own). Returns ``(weights, summed
    reduced)``."""
    wide = [x.to(WEIGHT_DTYPE.get(x.dtype, x.dtype)) for x in xs]  # half precision: float32
    parts = [product_parts(x) for x in wide]
    k, n = len(summed), len(xs)
    zs = [z.to(x.dtype) for (z, _, _), x in zip(parts, wide)]
    both = call_list(_AllReduceList, 2, "sum", pg, *summed, *zs, *(xz for _, xz, _ in parts))
    prods = call_list(_AllReduceList, 2, "product", pg, *(xn for _, _, xn in parts))
    ws = [
        product_weight(z, xz, xn, c, s, p).to(x.dtype)
        for (z, xz, xn), c, s, p, x in zip(parts, both[k : k + n], both[k + n :], prods, xs)
    ]
    return ws, list(both[:k])


class _BroadcastList(ListOp):
    name = "broadcast_coalesced"
    nmeta = 2  # src, pg
    same_shapes = True

    @staticmethod
    def run(xs: Sequence[Tensor], src: int, pg: PG) -> list[Tensor]:
        groups = _by_dtype(xs)
        return _unpack_like(xs, groups, _b().broadcast_coalesced(_pack(xs, groups), src, pg, owned=True))

    @staticmethod
    def transpose(ctx: Any, gs: list[Tensor], idx: list[int], src: int, pg: PG) -> Any:
        return call_list(_ReduceList, 3, src, "sum", pg, *gs)


class _ReduceList(ListOp):
    """Linear (sum/avg) reduce to ``dst``, zeros elsewhere: the dual of broadcast."""

    name = "reduce_coalesced"
    nmeta = 3  # dst, op, pg
    same_shapes = True

    @staticmethod
    def label(dst: int, op: str, pg: PG) -> str:
        return f"reduce_coalesced({op})"

    @staticmethod
    def run(xs: Sequence[Tensor], dst: int, op: str, pg: PG) -> list[Tensor]:
        groups = _by_dtype(xs)
        return _unpack_like(xs, groups, _b().reduce_coalesced(_pack(xs, groups), dst, op, pg))

    @staticmethod
    def transpose(ctx: Any, gs: list[Tensor], idx: list[int], dst: int, op: str, pg: PG) -> Any:
        out = call_list(_BroadcastList, 2, dst, pg, *gs)
        if op != "avg":
            return out
        world = _world(pg)
        return [o / world for o in out]


Sizes = tuple[tuple[int, ...], ...] | None  # per tensor, every rank's size along its dim


class Learned(list):
    """Sizes an ``all_gather_coalesced`` learns while it gathers: empty when the op is
    applied, filled by its forward with every tensor's per-rank sizes (so the autograd
    context, which keeps this object, has them for the backward)."""


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


class _AllGatherList(ListOp):
    """all_gather of every tensor ``i`` along ``dims[i]``; ``sizes[i]``: every rank's size
    along it (``None``: the same on every rank, the even path)."""

    name = "all_gather_coalesced"
    nmeta = 3  # dims, pg, sizes
    dims = 0

    @staticmethod
    def run(xs: Sequence[Tensor], dims: tuple[int, ...], pg: PG, sizes: Sizes) -> list[Tensor]:
        world = _world(pg)
        moved = _moved(xs, dims)
        groups = _by_dtype(moved)
        out: list[Any] = [None] * len(xs)
        if sizes is None:
            bufs = _b().all_gather_coalesced(_pack(moved, groups), pg)
            return _back(_tensor_major(moved, groups, bufs, world, out), dims)
        # variable sizes: rank r's buffer of a dtype holds its rows of every tensor of that
        # dtype, so the buffers' lengths differ between ranks: one uneven all_gather each
        inner = [math.prod(m.shape[1:]) for m in moved]
        if type(sizes) is Learned and not sizes:  # learned here, with the first buffer
            key = ("coalesced", tuple((tuple(m.shape[1:]), m.dtype) for m in moved))

            def length(g: int, counts: list[int]) -> int:
                return sum(counts[i] * inner[i] for i in groups[g])

            bufs, table = _b().all_gather_coalesced_unsized(
                _pack(moved, groups), [m.shape[0] for m in moved], length, key, pg
            )
            sizes.extend(tuple(row[i] for row in table) for i in range(len(xs)))
            if _even_or_none(tuple(sizes)) is None:  # as it turned out, the even layout
                return _back(_tensor_major(moved, groups, bufs, world, out), dims)
        else:
            lens = [[sum(sizes[i][r] * inner[i] for i in g) for r in range(world)] for g in groups]
            bufs = _b().all_gather_coalesced(_pack(moved, groups), pg, lens)
        for g, buf in zip(groups, bufs):
            ln = [sum(sizes[i][r] * inner[i] for i in g) for r in range(world)]
            pieces: dict[int, list[Tensor]] = {i: [] for i in g}
            for r, seg in enumerate(buf.split(ln)):
                for i, piece in zip(g, seg.split([sizes[i][r] * inner[i] for i in g])):
                    pieces[i].append(piece.view(sizes[i][r], *moved[i].shape[1:]))
            for i in g:
                out[i] = torch.cat(pieces[i])
        return _back(out, dims)

    @staticmethod
    def transpose(
        ctx: Any, gs: list[Tensor], idx: list[int], dims: tuple[int, ...], pg: PG, sizes: Sizes
    ) -> Any:
        part = None if sizes is None else _even_or_none(tuple(sizes[i] for i in idx))
        return call_list(_ReduceScatterList, 4, tuple(dims[i] for i in idx), "sum", pg, part, *gs)


class _ReduceScatterList(ListOp):
    """Linear (sum/avg) reduce_scatter of every tensor ``i`` along ``dims[i]``, split
    ``sizes[i]`` (``None``: every tensor evenly)."""

    name = "reduce_scatter_coalesced"
    nmeta = 4  # dims, op, pg, sizes
    dims = 0

    @staticmethod
    def label(dims: tuple[int, ...], op: str, pg: PG, sizes: Sizes) -> str:
        return f"reduce_scatter_coalesced({op})"

    @staticmethod
    def run(xs: Sequence[Tensor], dims: tuple[int, ...], op: str, pg: PG, sizes: Sizes) -> list[Tensor]:
        world = _world(pg)
        moved = _moved(xs, dims)
        groups = _by_dtype(moved)
        if sizes is None:
            # rank-major layout: row r of each buffer holds chunk r of every tensor of the dtype
            bufs = [
                torch.cat([moved[i].reshape(world, moved[i].numel() // world) for i in g], 1) for g in groups
            ]
            parts = _b().reduce_scatter_coalesced([b.view(-1) for b in bufs], op, pg)
            shapes = [(m.shape[0] // world, *m.shape[1:]) for m in moved]
            return _back(_unpack(shapes, groups, parts), dims)
        # uneven: rank-major again, chunk r of tensor i is sizes[i][r] rows long, so the
        # buffer splits unevenly between ranks (one uneven reduce_scatter per dtype)
        rank = _rank(pg)
        inner = [math.prod(m.shape[1:]) for m in moved]
        starts = [[sum(s[:r]) for r in range(world)] for s in sizes]
        bufs = [
            torch.cat(
                [moved[i].narrow(0, starts[i][r], sizes[i][r]).reshape(-1) for r in range(world) for i in g]
            )
            for g in groups
        ]
        lens = [[sum(sizes[i][r] * inner[i] for i in g) for r in range(world)] for g in groups]
        parts = _b().reduce_scatter_coalesced(bufs, op, pg, lens)
        shapes = [(sizes[i][rank], *m.shape[1:]) for i, m in enumerate(moved)]
        return _back(_unpack(shapes, groups, parts), dims)

    @staticmethod
    def transpose(
        ctx: Any, gs: list[Tensor], idx: list[int], dims: tuple[int, ...], op: str, pg: PG, sizes: Sizes
    ) -> Any:
        part = None if sizes is None else tuple(sizes[i] for i in idx)
        out = call_list(_AllGatherList, 3, tuple(dims[i] for i in idx), pg, part, *gs)
        if op != "avg":
            return out
        world = _world(pg)
        return [o / world for o in out]


# ======================================================================================
# the public ops
# ======================================================================================


def all_reduce_coalesced(
    tensors: Sequence[Tensor], op: Any = "sum", group: A.GroupLike = None, *, async_op: bool = False
) -> list[Tensor]:
    """Reduce every tensor of ``tensors`` over the ranks: one communication per dtype.

    Args:
        tensors: a non-empty list or tuple of tensors (any shapes, mixed dtypes, one
            device); the same list (length, shapes, dtypes) on every rank.
        op: reduce op as for :func:`diffcomm.all_reduce` (checked against every dtype).
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        async_op: return at once a list of :class:`~diffcomm.AsyncTensor` that wait for
            the one communication on first use; values and gradients equal the blocking
            op's, and the backward is asynchronous too (``docs/async.md``).

    Returns:
        A list of new tensors, ``out[i]`` of ``tensors[i].shape`` equal to
        ``dc.all_reduce(tensors[i], op)``. Outputs of one dtype are views of one buffer.

    Gradient:
        ``all_reduce_coalesced`` of the output gradients (sum/avg), one communication
        per dtype. ``max``/``min``: the summed gradient to the arg-extreme ranks, ties
        split evenly (still one communication per dtype); ``product``: zero-safe
        product of the others (one more all_reduce per dtype: the product of the
        non-zero values; the zero counts travel with the gradients).

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: dc.all_reduce_coalesced([torch.ones(2), torch.arange(3)]))
            # [[tensor([2., 2.]), tensor([0, 2, 4])], ...] on both ranks
    """
    name = "all_reduce_coalesced"
    ts = _check_list(tensors, name)
    op_name = _check_op(op, ts, name)
    pg = A.resolve_group(group, name)
    _debug_check(name, pg, ts, op=op_name)
    with _async_if(async_op):
        return list(call_list(_AllReduceList, 2, op_name, pg, *ts))


def broadcast_coalesced(
    tensors: Sequence[Tensor], src: int = 0, group: A.GroupLike = None, *, async_op: bool = False
) -> list[Tensor]:
    """Every rank gets rank ``src``'s tensors: one communication per dtype.

    Args:
        tensors: a non-empty list or tuple of tensors (any shapes, mixed dtypes, one
            device), same shapes and dtypes on every rank (only ``src``'s values matter).
        src: group-local rank whose tensors are sent.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        async_op: return at once a list of :class:`~diffcomm.AsyncTensor` that wait for
            the one communication on first use; values and gradients equal the blocking
            op's, and the backward is asynchronous too (``docs/async.md``).

    Returns:
        A list of new tensors, ``out[i]`` of ``tensors[i].shape`` holding ``src``'s
        values (``dc.broadcast(tensors[i], src)``).

    Gradient:
        a coalesced ``reduce(sum)`` to ``src`` (one communication per dtype): ``src``
        gets the sum of every rank's output gradients, the other ranks exact zeros.

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: dc.broadcast_coalesced([torch.tensor([1.0 * dc.get_rank()])], src=1))
            # [[tensor([1.])], [tensor([1.])]]
    """
    name = "broadcast_coalesced"
    ts = _check_list(tensors, name)
    pg = A.resolve_group(group, name)
    src = A.check_rank(src, name, "src", _world(pg))
    _debug_check(name, pg, ts, src=src)
    with _async_if(async_op):
        return list(call_list(_BroadcastList, 2, src, pg, *ts))


def reduce_coalesced(
    tensors: Sequence[Tensor],
    dst: int = 0,
    op: Any = "sum",
    group: A.GroupLike = None,
    *,
    async_op: bool = False,
) -> list[Tensor]:
    """Reduce every tensor over the ranks onto ``dst``; zeros elsewhere. One communication
    per dtype (the dual of :func:`broadcast_coalesced`).

    Args:
        tensors: a non-empty list or tuple of tensors (any shapes, mixed dtypes, one
            device), same shapes and dtypes on every rank.
        dst: group-local rank that receives the reductions.
        op: reduce op as for :func:`diffcomm.all_reduce`.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        async_op: return at once a list of :class:`~diffcomm.AsyncTensor` that wait for
            the one communication on first use; values and gradients equal the blocking
            op's, and the backward is asynchronous too (``docs/async.md``).

    Returns:
        A list of new tensors, ``out[i]`` of ``tensors[i].shape``: ``dc.reduce(tensors[i],
        dst, op)`` (the reduction on ``dst``, zeros of that shape elsewhere).

    Gradient:
        ``broadcast_coalesced(grad, src=dst)`` (divided by the world size for avg);
        ``max``/``min``/``product`` reduce on every rank (:func:`all_reduce_coalesced`
        and its rule) and keep the result on ``dst``, like :func:`diffcomm.reduce`.

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: dc.reduce_coalesced([torch.ones(2)], dst=1))
            # [[tensor([0., 0.])], [tensor([2., 2.])]]
    """
    name = "reduce_coalesced"
    ts = _check_list(tensors, name)
    op_name = _check_op(op, ts, name)
    pg = A.resolve_group(group, name)
    dst = A.check_rank(dst, name, "dst", _world(pg))
    _debug_check(name, pg, ts, op=op_name, dst=dst)
    with _async_if(async_op):
        if op_name in A.LINEAR_OPS:
            return list(call_list(_ReduceList, 3, dst, op_name, pg, *ts))
        # max/min/product: every rank needs the result for its gradient anyway (as dc.reduce)
        full = call_list(_AllReduceList, 2, op_name, pg, *ts)
        return [_only_on(y, _rank(pg) == dst) for y in full]


def all_gather_coalesced(
    tensors: Sequence[Tensor],
    dim: int = 0,
    group: A.GroupLike = None,
    *,
    split_sizes: Sequence[Sequence[int]] | None = None,
    async_op: bool = False,
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
        async_op: return at once a list of :class:`~diffcomm.AsyncTensor` that wait for
            the one communication on first use; values and gradients equal the blocking
            op's, and the backward is asynchronous too (``docs/async.md``).

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
    name = "all_gather_coalesced"
    ts = _check_list(tensors, name)
    dims = _check_dims(ts, dim, name)
    pg = A.resolve_group(group, name)
    world = _world(pg)
    sizes: Sizes = None
    if split_sizes is not None:
        sizes = _check_sizes(split_sizes, ts, dims, world, name, True, _rank(pg))
    flat = () if sizes is None else tuple(v for s in sizes for v in s)
    _debug_check(name, pg, ts, vary=dims, dim=dim, split_sizes=flat)
    meta: Any = _even_or_none(sizes)
    if sizes is None and world > 1 and not torch.compiler.is_compiling():
        b = _b()
        if async_op or not hasattr(b, "all_gather_coalesced_unsized"):
            # the output shapes are needed before the op runs: exchanged first, once
            with label(f"{name} (size exchange)"):
                table = b.exchange_size_lists([t.shape[d] for t, d in zip(ts, dims)], pg)
            meta = _even_or_none(tuple(tuple(row[i] for row in table) for i in range(len(ts))))
        else:  # learned by the op itself: with the first buffer once the group knows the list
            meta = Learned()
    with _async_if(async_op):
        return list(call_list(_AllGatherList, 3, tuple(dims), pg, meta, *ts))


def reduce_scatter_coalesced(
    tensors: Sequence[Tensor],
    dim: int = 0,
    op: Any = "sum",
    group: A.GroupLike = None,
    *,
    split_sizes: Sequence[Sequence[int]] | None = None,
    async_op: bool = False,
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
        async_op: return at once a list of :class:`~diffcomm.AsyncTensor` that wait for
            the one communication on first use; values and gradients equal the blocking
            op's, and the backward is asynchronous too (``docs/async.md``).

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
    name = "reduce_scatter_coalesced"
    ts = _check_list(tensors, name)
    dims = _check_dims(ts, dim, name)
    op_name = _check_op(op, ts, name)
    pg = A.resolve_group(group, name)
    world, rank = _world(pg), _rank(pg)
    if split_sizes is None:
        for i, (t, d) in enumerate(zip(ts, dims)):
            if t.shape[d] % world:
                raise A.arg_error(
                    name,
                    f"tensors[{i}]",
                    f"of a size along dim {d} divisible by the group size {world} (or pass `split_sizes`)",
                    f"shape {list(t.shape)}",
                )
        sizes = tuple((t.shape[d] // world,) * world for t, d in zip(ts, dims))
    else:
        sizes = _check_sizes(split_sizes, ts, dims, world, name, False, rank)
    flat = () if split_sizes is None else tuple(v for s in sizes for v in s)
    _debug_check(name, pg, ts, op=op_name, dim=dim, split_sizes=flat)
    with _async_if(async_op):
        if op_name in A.LINEAR_OPS:
            return list(call_list(_ReduceScatterList, 4, tuple(dims), op_name, pg, _even_or_none(sizes), *ts))
        # max/min/product: reduce everything, keep the own chunk (as dc.reduce_scatter)
        full = call_list(_AllReduceList, 2, op_name, pg, *ts)
        return [y.narrow(d, sum(s[:rank]), s[rank]) for y, d, s in zip(full, dims, sizes)]


# ======================================================================================
# the coalesced op -> adjoint table (tests walk it; the docs' table is generated from it)
# ======================================================================================

COALESCED_OPS: dict[str, OpSpec] = register(
    "coalesced",
    OpSpec(
        "all_reduce_coalesced",
        all_reduce_coalesced,
        "all_reduce_coalesced",
        "op over ranks of each tensor, on every rank",
        "all_reduce_coalesced of grads (max/min: to arg-extreme ranks, ties split; product: "
        "zero-safe, plus one all_reduce per dtype)",
    ),
    OpSpec(
        "broadcast_coalesced",
        broadcast_coalesced,
        "reduce_coalesced",
        "src's tensors on every rank",
        "reduce_coalesced(sum) to src; other ranks exact zeros",
    ),
    OpSpec(
        "reduce_coalesced",
        reduce_coalesced,
        "broadcast_coalesced",
        "op over ranks on dst, zeros elsewhere",
        "broadcast_coalesced from dst",
    ),
    OpSpec(
        "all_gather_coalesced",
        all_gather_coalesced,
        "reduce_scatter_coalesced",
        "each tensor concatenated over ranks along dim",
        "reduce_scatter_coalesced(sum)",
    ),
    OpSpec(
        "reduce_scatter_coalesced",
        reduce_scatter_coalesced,
        "all_gather_coalesced",
        "chunk r of each tensor's reduction along dim",
        "all_gather_coalesced",
    ),
)


def coalesced_markdown() -> str:
    """The coalesced op -> adjoint table as Markdown (the docs include this)."""
    return markdown("coalesced")


# asynchronous coalesced ops: output shapes (Function arguments: tensor, *meta, *tensors)


def _list_shapes(n: int) -> Any:
    def shapes(a: tuple[Any, ...]) -> list[tuple[int, ...]]:
        return [tuple(t.shape) for t in (a[0], *a[n + 1 :])]

    return shapes


def _gathered_shapes(a: tuple[Any, ...]) -> list[tuple[int, ...]]:
    dims, pg, sizes = a[1], a[2], a[3]
    world = _world(pg)
    out = []
    for i, (t, d) in enumerate(zip((a[0], *a[4:]), dims)):
        n = t.shape[d] * world if sizes is None else sum(sizes[i])
        out.append(tuple(n if k == d else s for k, s in enumerate(t.shape)))
    return out


def _scattered_shapes(a: tuple[Any, ...]) -> list[tuple[int, ...]]:
    dims, pg, sizes = a[1], a[3], a[4]
    world, rank = _world(pg), _rank(pg)
    out = []
    for i, (t, d) in enumerate(zip((a[0], *a[5:]), dims)):
        n = t.shape[d] // world if sizes is None else sizes[i][rank]
        out.append(tuple(n if k == d else s for k, s in enumerate(t.shape)))
    return out


_async.OUT_SHAPES.update(
    {
        _AllReduceList: _list_shapes(2),
        _BroadcastList: _list_shapes(2),
        _ReduceList: _list_shapes(3),
        _AllGatherList: _gathered_shapes,
        _ReduceScatterList: _scattered_shapes,
    }
)


#: The raw forward of ``all_reduce_coalesced`` (``(xs, op, pg) -> list``) and the debug-mode
#: cross-rank check of a tensor list, for op families built on them (the coalesced
#: ``diffcomm.parallel`` mappings).
raw_all_reduce_coalesced = _AllReduceList.run
check_lists_consistent = _debug_check
