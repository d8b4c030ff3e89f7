"""``all_reduce_coalesced``, ``broadcast_coalesced`` and ``reduce_coalesced``: the list ops
whose outputs are shaped like their inputs (one communication per dtype; re-exported by
:mod:`diffcomm.ops.coalesced`, their public home, which explains the packing).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

from torch import Tensor

from ..backend import args as A
from ..backend.args import PG
from . import references
from .all_reduce import WEIGHT_DTYPE, _AllReduce, product_parts, product_weight
from .base import ListOp, apply, call, list_args
from .base import only_on as _only_on
from .broadcast_reduce import _Broadcast, _Reduce
from .packing import case_specs as _case_specs
from .packing import check_list as _check_list
from .packing import check_op as _check_op
from .packing import debug_check as _debug_check
from .packing import packed as _packed
from .precision_format import Precision, quantized
from .registry import SELF, Kwargs
from .shared_args import shared_args
from .validation import current_backend as _b
from .validation import rank_is as _rank_is
from .validation import world as _world

# ======================================================================================
# the list ops (one autograd node for the whole list; one raw call per dtype), on the
# ListOp base of diffcomm.ops.base: each states run / transpose / label, the base the rest
# ======================================================================================


class _AllReduceList(ListOp):
    """Self-adjoint for sum/avg; max/min/product are the sum composed with a weight."""

    name = "all_reduce_coalesced"
    family = "coalesced"
    order = 10
    dual = SELF
    nmeta = 2  # op, pg
    same_shapes = True
    forward_text = "op over ranks of each tensor, on every rank"
    backward_text = (
        "all_reduce_coalesced of grads (max/min: to arg-extreme ranks, ties split; product: "
        "zero-safe, plus one all_reduce per dtype)"
    )
    # element i is all_reduce(tensors[i]): its rule, in the list's words
    spmd = replace(
        _AllReduce.spmd,
        instead="parallel.reduce_from_region_coalesced",
    )

    @staticmethod
    def run(xs: Sequence[Tensor], op: str, pg: PG) -> list[Tensor]:
        return _packed(_b().all_reduce_coalesced, xs, op, pg, owned=True)

    @staticmethod
    def label(op: str, pg: PG) -> str:
        return f"all_reduce_coalesced({op})"

    @staticmethod
    def transpose(ctx: Any, gs: list[Tensor], idx: list[int], op: str, pg: PG) -> Any:
        if op in A.LINEAR_OPS:
            return call(_AllReduceList, *list_args(gs, op, pg))
        saved, n = ctx.saved_tensors, len(ctx.meta)
        xs = [saved[i] for i in idx]
        if op == "product":  # the gradients and the zero counts share the sum buffers
            ws, g_total = _product_weights(xs, pg, gs)
            return [g * w.conj() for g, w in zip(g_total, ws)]
        # max/min: the gradients and the tie masks share the buffers (same dtypes): one
        # call per dtype
        masks = [(x.detach() == saved[n + i].detach()).to(x.dtype) for x, i in zip(xs, idx)]
        both = call(_AllReduceList, *list_args([*gs, *masks], "sum", pg))
        k = len(gs)
        return [g * (m / c).conj() for g, m, c in zip(both[:k], masks, both[k:])]

    @staticmethod
    def nonlinear(meta: tuple[Any, ...]) -> bool:
        return meta[0] not in A.LINEAR_OPS

    @staticmethod
    def tangent(ctx: Any, ts: list[Tensor], op: str, pg: PG) -> Any:
        n = len(ts)
        saved = ctx.saved_tensors
        xs, ys = saved[:n], saved[n:]
        if op == "product":
            ws = _product_weights(xs, pg)[0]
        else:
            masks = [(x == y).to(x.dtype) for x, y in zip(xs, ys)]
            ws = [m / c for m, c in zip(masks, call(_AllReduceList, *list_args(masks, "sum", pg)))]
        return call(_AllReduceList, *list_args([t * w for t, w in zip(ts, ws)], "sum", pg))

    @staticmethod
    def out_shape(xs: Sequence[Tensor], op: str, pg: PG) -> list[tuple[int, ...]]:
        return [tuple(x.shape) for x in xs]

    @staticmethod
    def dual_args(kw: Kwargs, world: int) -> tuple[Kwargs, float]:
        return {"op": kw.get("op", "sum")}, 1.0

    @staticmethod
    def cases(world: int) -> Iterator[Kwargs]:
        mixed, no_int, _ = _case_specs(world)
        for rop in ("sum", "avg", "max", "min", "product"):
            yield {"specs": no_int if rop == "avg" else mixed, "kwargs": {"op": rop}}
        yield {"specs": (((4,), "complex128", True, True), *mixed[:2]), "kwargs": {"op": "sum"}}


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
    both = call(_AllReduceList, *list_args([*summed, *zs, *(xz for _, xz, _ in parts)], "sum", pg))
    prods = call(_AllReduceList, *list_args([xn for _, _, xn in parts], "product", pg))
    ws = [
        product_weight(z, xz, xn, c, s, p).to(x.dtype)
        for (z, xz, xn), c, s, p, x in zip(parts, both[k : k + n], both[k + n :], prods, xs)
    ]
    return ws, list(both[:k])


class _BroadcastList(ListOp):
    name = "broadcast_coalesced"
    family = "coalesced"
    order = 20
    nmeta = 2  # src, pg
    same_shapes = True
    forward_text = "src's tensors on every rank"
    backward_text = "reduce_coalesced(sum) to src; other ranks exact zeros"
    spmd = _Broadcast.spmd  # broadcast's, per element

    @staticmethod
    def run(xs: Sequence[Tensor], src: int, pg: PG) -> list[Tensor]:
        return _packed(_b().broadcast_coalesced, xs, src, pg, owned=True)

    @staticmethod
    def transpose(ctx: Any, gs: list[Tensor], idx: list[int], src: int, pg: PG) -> Any:
        return call(_ReduceList, *list_args(gs, src, "sum", pg))

    @staticmethod
    def out_shape(xs: Sequence[Tensor], src: int, pg: PG) -> list[tuple[int, ...]]:
        return [tuple(x.shape) for x in xs]

    @staticmethod
    def dual_args(kw: Kwargs, world: int) -> tuple[Kwargs, float]:
        return {"dst": kw.get("src", 0)}, 1.0

    @staticmethod
    def cases(world: int) -> Iterator[Kwargs]:
        yield {"specs": _case_specs(world)[0], "kwargs": {"src": world - 1}}


class _ReduceList(ListOp):
    """Linear (sum/avg) reduce to ``dst``, zeros elsewhere: the dual of broadcast."""

    name = "reduce_coalesced"
    family = "coalesced"
    order = 21
    dual = _BroadcastList
    nmeta = 3  # dst, op, pg
    same_shapes = True
    forward_text = "op over ranks on dst, zeros elsewhere"
    backward_text = "broadcast_coalesced from dst"
    spmd = _Reduce.spmd  # reduce's, per element

    @staticmethod
    def run(xs: Sequence[Tensor], dst: int, op: str, pg: PG) -> list[Tensor]:
        return _packed(_b().reduce_coalesced, xs, dst, op, pg)

    @staticmethod
    def label(dst: int, op: str, pg: PG) -> str:
        return f"reduce_coalesced({op})"

    @staticmethod
    def transpose(ctx: Any, gs: list[Tensor], idx: list[int], dst: int, op: str, pg: PG) -> Any:
        out = call(_BroadcastList, *list_args(gs, dst, pg))
        if op != "avg":
            return out
        world = _world(pg)
        return [o / world for o in out]

    @staticmethod
    def out_shape(xs: Sequence[Tensor], dst: int, op: str, pg: PG) -> list[tuple[int, ...]]:
        return [tuple(x.shape) for x in xs]

    @staticmethod
    def dual_args(kw: Kwargs, world: int) -> tuple[Kwargs, float]:
        return {"src": kw.get("dst", 0)}, references.avg_scale(kw, world)

    @staticmethod
    def cases(world: int) -> Iterator[Kwargs]:
        mixed, no_int, _ = _case_specs(world)
        yield {"specs": no_int, "kwargs": {"dst": world // 2, "op": "sum"}}
        yield {"specs": mixed, "kwargs": {"dst": 0, "op": "max"}}


@shared_args
def all_reduce_coalesced(
    tensors: Sequence[Tensor],
    op: Any = "sum",
    group: A.GroupLike = None,
    *,
    async_op: bool = False,
    precision: Precision | None = None,
) -> list[Tensor]:
    """Reduce every tensor of ``tensors`` over the ranks: one communication per dtype.

    Args:
        tensors: a non-empty list or tuple of tensors (any shapes, mixed dtypes, one
            device); the same list (length, shapes, dtypes) on every rank.
        op: reduce op as for :func:`diffcomm.all_reduce` (checked against every dtype).
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        async_op: {async_op_list}

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
    if precision is not None:  # each tensor its own quantized all_reduce (docs/precision.md)
        return quantized("coalesced")("all_reduce", tensors, precision, async_op, op=op, group=group)
    name = "all_reduce_coalesced"
    ts = _check_list(tensors, name)
    op_name = _check_op(op, ts, name)
    pg = A.resolve_group(group, name)
    _debug_check(name, pg, ts, op=op_name)
    return list(apply(_AllReduceList, *list_args(ts, op_name, pg), async_op=async_op))


@shared_args
def broadcast_coalesced(
    tensors: Sequence[Tensor], src: int = 0, group: A.GroupLike = None, *, async_op: bool = False
) -> list[Tensor]:
    """Every rank gets rank ``src``'s tensors: one communication per dtype.

    Args:
        tensors: a non-empty list or tuple of tensors (any shapes, mixed dtypes, one
            device), same shapes and dtypes on every rank (only ``src``'s values matter).
        src: group-local rank whose tensors are sent.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        async_op: {async_op_list}

    Returns:
        A list of new tensors, ``out[i]`` of ``tensors[i].shape`` holding ``src``'s
        values (``dc.broadcast(tensors[i], src)``).

    Gradient:
        ``reduce_coalesced(sum)`` to ``src`` (one communication per dtype): ``src``
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
    return list(apply(_BroadcastList, *list_args(ts, src, pg), async_op=async_op))


@shared_args
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
        async_op: {async_op_list}

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
    if op_name in A.LINEAR_OPS:
        return list(apply(_ReduceList, *list_args(ts, dst, op_name, pg), async_op=async_op))
    # max/min/product: every rank needs the result for its gradient anyway (as dc.reduce)
    full = apply(_AllReduceList, *list_args(ts, op_name, pg), async_op=async_op)
    keep = _rank_is(pg, dst, full[0].device) if full else False
    return [_only_on(y, keep) for y in full]
