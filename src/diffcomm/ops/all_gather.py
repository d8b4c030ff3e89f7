"""``all_gather`` and ``reduce_scatter``, a dual pair along any dim with uneven per-rank
sizes (``reduce_scatter`` with max/min/product is composed from
:mod:`~diffcomm.ops.all_reduce`). Re-exported by :mod:`diffcomm.ops.collectives`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from .._config import DEBUG as _DEBUG
from .._replication import PARTIAL, SHARES, TWICE, Rule, T
from ..backend import args as A
from ..backend.args import PG
from . import engine as _async
from . import references
from .all_reduce import _AllReduce
from .base import CommOp, apply, call, op_labels
from .precision_format import Precision, quantized
from .registry import Kwargs
from .shared_args import shared_args
from .validation import Learned
from .validation import check_input as _check_input
from .validation import current_backend as _b
from .validation import debug_check as _debug_check
from .validation import debug_check_input as _debug_check_input
from .validation import gathered_split_sizes as _gathered_split_sizes
from .validation import given_split_sizes as _given_split_sizes
from .validation import other_dims as _other_dims
from .validation import own_slice as _own_slice
from .validation import rank as _rank
from .validation import records_grad as _records_grad
from .validation import with_sizes as _with
from .validation import world as _world

_LABELS = op_labels("reduce_scatter")


class _AllGather(CommOp):
    name = "all_gather"
    family = "collective"
    order = 30
    dims = (0,)
    forward_text = "concat of every rank's x along dim"
    backward_text = "reduce_scatter(sum) with the same split"
    spmd = Rule(
        {T.V: T.R, T.R: T.R},
        out_grad=PARTIAL,
        in_grad=PARTIAL,
        refuse={T.P: SHARES},
        instead="parallel.gather_from_region",
    )

    @staticmethod
    def run(x: Tensor, dim: int, pg: PG, split_sizes: tuple[int, ...] | Learned) -> Tensor:
        x0 = x if dim == 0 else x.movedim(dim, 0)
        if type(split_sizes) is Learned and not split_sizes:  # learned with the rows
            out, got = _b().all_gather_unsized(x0, pg, dim)
            split_sizes.extend(got)
        else:
            out = _b().all_gather(x0, pg, split_sizes)
        return out if dim == 0 else out.movedim(0, dim)

    @staticmethod
    def transpose(g: Tensor, dim: int, pg: PG, split_sizes: tuple[int, ...]) -> Tensor:
        return call(_ReduceScatter, g, dim, "sum", pg, split_sizes)

    @staticmethod
    def out_shape(x: Tensor, dim: int, pg: PG, split_sizes: tuple[int, ...]) -> tuple[int, ...]:
        return _with(x.shape, {dim: sum(split_sizes)})

    reference = references.all_gather

    @staticmethod
    def dual_args(kw: Kwargs, world: int) -> tuple[Kwargs, float]:
        return {"dim": kw.get("dim", 0), "split_sizes": kw.get("split_sizes")}, 1.0

    @staticmethod
    def cases(world: int) -> Iterator[Kwargs]:
        yield {"shape": (2, 3), "kwargs": {"dim": 1}}
        yield {"shape": (4, 2), "kwargs": {"dim": 0}, "sizes": tuple(r % 3 + 1 for r in range(world))}


@shared_args
def all_gather(
    x: Tensor,
    dim: int = 0,
    group: A.GroupLike = None,
    *,
    split_sizes: Sequence[int] | None = None,
    sizes: Sequence[int] | None = None,
    async_op: bool = False,
    precision: Precision | None = None,
) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim``; every rank gets the result.

    Args:
        x: tensor; shapes agree between ranks except along ``dim``, where they may differ.
        dim: the dimension to concatenate along.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        split_sizes: keyword-only; every rank's ``x.shape[dim]`` if already known. Without
            it uneven sizes just work: exchanged first (a tiny all_gather of host integers
            on a CPU channel) or, once the group has gathered such rows, sent with the
            rows (CPU groups, up to 256 KiB per rank; ``diffcomm.backend.sized_gather``).
        sizes: the old name of ``split_sizes`` (works, with a ``DeprecationWarning``).
        async_op: {async_op}
        precision: {precision}

    Returns:
        A new tensor: ``x.shape`` with ``dim`` of size ``sum(sizes)``; rank ``r``'s block
        sits at ``sum(sizes[:r])``.

    Gradient:
        ``reduce_scatter(grad, dim, op="sum", split_sizes=split_sizes)``: each rank gets the sum
        over ranks of the gradient of its own block.

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: dc.all_gather(torch.full((dc.get_rank() + 1,), 1.0 * dc.get_rank())))
            # [tensor([0., 1., 1.]), tensor([0., 1., 1.])]
    """
    if precision is not None:
        split_sizes, _ = A.renamed_sizes(split_sizes, sizes, "all_gather")
        return quantized("all_gather")(x, dim, group, split_sizes, precision, async_op)
    x = _check_input(x, "all_gather")
    dim = A.check_dim(x, dim, "all_gather")
    pg = A.resolve_group(group, "all_gather")
    split_sizes, arg = A.renamed_sizes(split_sizes, sizes, "all_gather")
    if split_sizes is not None:
        split_sizes = _given_split_sizes(split_sizes, x, dim, pg, "all_gather", arg)
    if _DEBUG.value if _DEBUG.loaded else _DEBUG.get():
        rest = _other_dims(x, dim)
        # split_sizes lists every rank's length: the same list on every rank (or on none).
        # Without it, a blocking gather sends the sizes with the rows once the group has
        # gathered and an asynchronous one exchanges them first: mixed, the ranks' bytes
        # differ and gloo aborts one (so an unsized asynchronous call says so; a field
        # only then, as the quantized gather, which always exchanges first, passes none)
        sizes_given = None if split_sizes is None else tuple(split_sizes)
        _debug_check(
            "all_gather",
            pg,
            dim=dim,
            other_dims=rest,
            dtype=x.dtype,
            grad=_records_grad(x),
            split_sizes=sizes_given,
            **({"async_op": True} if async_op and split_sizes is None else {}),
        )
    if split_sizes is None:  # learned with the rows where the backend can, else exchanged first
        split_sizes = _gathered_split_sizes(x, dim, pg, async_op)
    else:
        split_sizes = tuple(split_sizes)
    return apply(_AllGather, x, dim, pg, split_sizes, async_op=async_op)


class _ReduceScatter(CommOp):
    """Linear reduce_scatter (sum/avg); max/min/product are composed in :func:`reduce_scatter`."""

    name = "reduce_scatter"
    family = "collective"
    order = 31
    dual = _AllGather
    dims = (0,)
    forward_text = "chunk r of the reduction"
    backward_text = "all_gather with the same split"
    spmd = Rule({T.V: T.V, T.P: T.V}, refuse={T.R: TWICE})

    @staticmethod
    def run(x: Tensor, dim: int, op: str, pg: PG, split_sizes: tuple[int, ...]) -> Tensor:
        out = _b().reduce_scatter(x if dim == 0 else x.movedim(dim, 0), op, pg, split_sizes)
        return out if dim == 0 else out.movedim(0, dim)

    @staticmethod
    def label(dim: int, op: str, pg: PG, split_sizes: tuple[int, ...]) -> str:
        return _LABELS[op]

    @staticmethod
    def transpose(g: Tensor, dim: int, op: str, pg: PG, split_sizes: tuple[int, ...]) -> Tensor:
        out = call(_AllGather, g, dim, pg, split_sizes)
        return out / _world(pg) if op == "avg" else out

    @staticmethod
    def out_shape(x: Tensor, dim: int, op: str, pg: PG, split_sizes: tuple[int, ...]) -> tuple[int, ...]:
        return _with(x.shape, {dim: split_sizes[_rank(pg)]})

    reference = references.reduce_scatter

    @staticmethod
    def dual_args(kw: Kwargs, world: int) -> tuple[Kwargs, float]:
        return {"dim": kw.get("dim", 0), "split_sizes": kw.get("split_sizes")}, references.avg_scale(
            kw, world
        )

    @staticmethod
    def cases(world: int) -> Iterator[Kwargs]:
        uneven = [r + 1 for r in range(world)]
        yield {"shape": (2 * world, 3), "kwargs": {"dim": 0}}
        yield {"shape": (3, sum(uneven)), "kwargs": {"dim": 1, "split_sizes": uneven}}
        yield {"shape": (world, 2), "kwargs": {"dim": 0, "op": "max"}, "ints": True}


#: The raw forwards of ``all_gather`` (``(x, dim, pg, sizes)``) and ``reduce_scatter``
#: (``(x, dim, op, pg, sizes)``), for op families built on the collectives.
raw_all_gather = _AllGather.run
raw_reduce_scatter = _ReduceScatter.run


@shared_args
def reduce_scatter(
    x: Tensor,
    dim: int = 0,
    op: Any = "sum",
    group: A.GroupLike = None,
    split_sizes: Sequence[int] | None = None,
    *,
    async_op: bool = False,
    precision: Precision | None = None,
) -> Tensor:
    """Reduce ``x`` over ranks and give rank ``r`` chunk ``r`` of the result along ``dim``.

    Args:
        x: tensor of the same shape and dtype on every rank.
        dim: the dimension to split.
        op: reduce op as for :func:`all_reduce`.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        split_sizes: per-rank chunk sizes along ``dim`` (summing to ``x.shape[dim]``);
            ``None`` splits evenly (then ``x.shape[dim]`` must divide by the group size).
        async_op: {async_op}
        precision: {precision}

    Returns:
        A new tensor: ``x.shape`` with ``dim`` of size ``split_sizes[rank]``.

    Gradient:
        ``all_gather(grad, dim, split_sizes=split_sizes)`` (divided by the world size for avg;
        max/min/product route through :func:`all_reduce`'s rule).

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: dc.reduce_scatter(torch.arange(4.0)))
            # [tensor([0., 2.]), tensor([4., 6.])]
    """
    if precision is not None:
        return quantized("reduce_scatter")(x, dim, op, group, split_sizes, precision, async_op)
    x = _check_input(x, "reduce_scatter")
    dim = A.check_dim(x, dim, "reduce_scatter")
    op_name = A.normalize_op(op, "reduce_scatter", x)
    pg = A.resolve_group(group, "reduce_scatter")
    split_sizes = A.check_split_sizes(split_sizes, x.shape[dim], _world(pg), "reduce_scatter")
    if _DEBUG.value if _DEBUG.loaded else _DEBUG.get():  # inline: no call, no kwargs, when off
        _debug_check_input("reduce_scatter", pg, x, op=op_name, dim=dim, split_sizes=split_sizes)
    if op_name in A.LINEAR_OPS:
        return apply(_ReduceScatter, x, dim, op_name, pg, tuple(split_sizes), async_op=async_op)
    full = apply(_AllReduce, x, op_name, pg, async_op=async_op)
    start, length = _own_slice(split_sizes, pg)
    if isinstance(full, _async.AsyncTensor):  # the own chunk taken after the all_reduce, on the
        # engine: an AsyncTensor as every asynchronous op's (it returned a plain tensor, no .wait())
        shape = list(full.shape)
        shape[dim] = length
        return _async.launch(
            full,
            f"reduce_scatter({op_name})",
            # (a tensor of its own: a view would share the all_reduce's output, which
            # max / min / product's backward reads, with whoever changes the result in place)
            lambda t: t.narrow(dim, start, length).clone(),
            shape,
            lambda g: torch.slice_scatter(g.new_zeros(full.shape), g, dim, start, start + length),
            private=True,
        )
    return full.narrow(dim, start, length)
