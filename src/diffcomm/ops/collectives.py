"""The eight differentiable collectives and the op -> adjoint table.

Gradient convention: the objective is the **sum of the per-rank objectives**. Then every
collective is a linear map ``A`` on the concatenation of all ranks' tensors (max/min/
product are linearised at the point), and its backward is ``A^T``, built from the public
ops below so double backward, ``torch.func`` and nested transforms work:

=================  ===============================================================
op                 backward (adjoint)
=================  ===============================================================
all_reduce         all_reduce of the gradients (sum -> sum, avg -> avg; max/min send
                   the summed gradient to the arg-extreme ranks, ties split evenly;
                   product multiplies by the zero-safe product of the others)
broadcast          reduce(sum) to ``src``: ``src`` gets the sum, others exact zeros
reduce             broadcast from ``dst``
all_gather         reduce_scatter(sum) with the same (possibly uneven) split
reduce_scatter     all_gather with the same split
gather             scatter from ``dst`` with the same split
scatter            gather to ``src`` with the same split (non-src inputs get zeros)
all_to_all         all_to_all with ``split_dim``/``concat_dim`` and split sizes swapped
=================  ===============================================================

Each op has one home: the public function (validation first, before any communication,
with the checks the ops share in :mod:`diffcomm.ops.validation`) and its
:class:`~diffcomm.ops.base.CommOp` subclass, which states the raw forward, the transpose (the
dual op) and which arguments are dims. all_reduce, broadcast / reduce and all_gather /
reduce_scatter live below; gather / scatter in :mod:`diffcomm.ops.gather_scatter`,
all_to_all in :mod:`diffcomm.ops.all_to_all`; the serial references of the registry entries
in :mod:`diffcomm.ops.references`. The base derives
``setup_context`` / ``backward`` / ``jvp`` (the tangent goes through the same linear op) /
``vmap`` (batch dim moved, one call for the whole batch) and the compile twin.

Rules that keep the SPMD program deadlock-free: backward rules never branch on
rank-local facts that could differ between ranks, and only call public diffcomm ops
(never raw backend calls), so every rank runs the same collectives in backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .. import _config
from ..backend import args as A
from . import engine as _async
from . import references as R
from .all_to_all import all_to_all
from .base import CommOp, call
from .base import apply as _apply
from .base import apply_async as _apply_async
from .base import only_on as _only_on
from .gather_scatter import gather, scatter
from .registry import OpSpec, markdown, register
from .validation import PG
from .validation import Gathered as _Gathered
from .validation import check_input as _check_input
from .validation import current_backend as _b
from .validation import debug_check as _debug_check
from .validation import debug_check_input as _debug_check_input
from .validation import gathered_sizes as _gathered_sizes
from .validation import given_sizes as _given_sizes
from .validation import other_dims as _other_dims
from .validation import rank as _rank
from .validation import with_sizes as _with
from .validation import world as _world

__all__ = [
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "reduce_scatter",
    "gather",
    "scatter",
    "all_to_all",
    "DUALS",
    "OPS",
    "dual",
]

# Size: ~620 lines, just over the ~600 guideline: about 200 of them are the public
# docstrings (Args / Returns / Gradient / Example for five ops); the rest is one CommOp
# block, one public function and one registry entry per op, and the zero-safe weight of
# product's backward (gather / scatter and all_to_all have modules of their own).


# ======================================================================================
# all_reduce
# ======================================================================================

_DEBUG = _config.DEBUG  # read inline as ``value if loaded else get()`` (the hot path)
#: ``"<op>(<reduce op>)"``, made once: a label is asked for on every call (the flight
#: recorder keys its call-site cache by it, and the same string object keeps its hash).
_LABELS = {
    name: {r: f"{name}({r})" for r in A.REDUCE_OPS} for name in ("all_reduce", "reduce", "reduce_scatter")
}


class _AllReduce(CommOp):
    """Self-adjoint for sum/avg; max/min/product are the sum composed with a weight."""

    name = "all_reduce"
    elementwise = True

    @staticmethod
    def run(x: Tensor, op: str, pg: PG) -> Tensor:
        return _b().all_reduce(x, op, pg)

    @staticmethod
    def label(op: str, pg: PG) -> str:
        return _LABELS["all_reduce"][op]

    @staticmethod
    def transpose(g: Tensor, op: str, pg: PG) -> Tensor:
        return call(_AllReduce, g, op, pg)

    @staticmethod
    def linearize(args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        return None if args[0] in A.LINEAR_OPS else ("sum", args[1])

    @staticmethod
    def weight(x: Tensor, y: Tensor, op: str, pg: PG) -> Tensor:
        return _nonlinear_weight(op, x, y, pg)


#: The raw forward of ``all_reduce`` (``(x, op, pg) -> Tensor``: no validation, no
#: autograd), for op families built on the collectives (the ``diffcomm.parallel`` mappings).
raw_all_reduce = _AllReduce.run


def _nonlinear_weight(op: str, x: Tensor, y: Tensor, pg: PG) -> Tensor:
    """d y / d x_r for max/min/product on this rank (y = op over ranks of x).

    max/min: ``[x_r == y] / #ties`` — the gradient goes to the rank(s) holding the extreme,
    split evenly among ties. product: the product of the other ranks' values,
    ``prod_{j != r} x_j``, from two all_reduces of (about) ``x``'s size — O(n) memory per
    rank at any world size, where an all_gather of every rank's ``x`` would be
    O(world * n): see :func:`product_weight`.
    """
    if op in ("max", "min"):
        mask = (x.detach() == y.detach()).to(x.dtype)
        count = all_reduce(mask, "sum", pg)
        return mask / count
    xw = x.to(WEIGHT_DTYPE.get(x.dtype, x.dtype))  # float16/bfloat16: the weight in float32
    zero, x_z, x_nz = product_parts(xw)
    count, s = all_reduce(torch.stack([zero.to(xw.dtype), x_z]), "sum", pg).unbind(0)
    return product_weight(zero, x_z, x_nz, count, s, all_reduce(x_nz, "product", pg)).to(x.dtype)


#: Dtypes whose product weight is computed in a wider dtype (then rounded once): the
#: weight divides a product of every rank's values, and in half precision each extra
#: rounding is ~1e-3 relative.
WEIGHT_DTYPE = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def product_parts(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(zero, x_z, x_nz)``: where ``x`` is zero, ``x`` there (zeros elsewhere: carries the
    derivative), and ``x`` with its zeros replaced by ones (see :func:`product_weight`)."""
    zero = x.detach() == 0
    x_z = torch.where(zero, x, torch.zeros((), dtype=x.dtype, device=x.device))
    x_nz = torch.where(zero, torch.ones((), dtype=x.dtype, device=x.device), x)
    return zero, x_z, x_nz


def product_weight(zero: Tensor, x_z: Tensor, x_nz: Tensor, count: Tensor, s: Tensor, p: Tensor) -> Tensor:
    """``prod_{j != r} x_j`` on rank ``r`` from all_reduced facts, exact with zeros.

    ``count`` = the number of ranks holding a zero (sum over ranks of ``zero``), ``s`` =
    the sum over ranks of ``x_z`` (value 0), ``p`` = the product over ranks of ``x_nz``
    (the non-zero values). Cases, per element: no zero anywhere: ``p / x_r`` (torch.prod's
    own rule); ``x_r`` the only zero: ``p``; one zero, on another rank ``k``:
    ``x_k * p / x_r``; two zeros, ``x_r`` one of them: ``x_k * p``; else 0. The factor
    ``x_k`` is written as ``s - x_z`` (the other ranks' zero entries): its value is 0 but
    its derivative is right, so the weight's first derivatives — and so double backward —
    are exact (higher orders are exact while at most one rank holds a zero).
    """
    one = torch.ones((), dtype=p.dtype, device=p.device)
    none = torch.zeros((), dtype=p.dtype, device=p.device)
    s_other = s - x_z
    w_nz = p / x_nz * torch.where(count == 0, one, torch.where(count == 1, s_other, none))
    w_z = p * torch.where(count == 1, one, torch.where(count == 2, s_other, none))
    return torch.where(zero, w_z, w_nz)


def all_reduce(x: Tensor, op: Any = "sum", group: A.GroupLike = None, *, async_op: bool = False) -> Tensor:
    """Reduce ``x`` over the ranks of ``group``; every rank gets the result.

    Args:
        x: tensor of the same shape and dtype on every rank.
        op: ``"sum"``, ``"avg"``, ``"max"``, ``"min"``, ``"product"`` (any case) or a
            ``torch.distributed.ReduceOp``. ``max``/``min`` need a real dtype; ``avg`` a
            floating or complex one.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        async_op: return at once an :class:`~diffcomm.AsyncTensor` that waits for the
            communication on first use (``.wait()`` returns the finished tensor); values
            and gradients equal the blocking op's, and the backward is asynchronous too
            (``docs/async.md``).

    Returns:
        A new tensor of ``x.shape``: the reduction over ranks.

    Gradient:
        all_reduce of the output gradients (self-adjoint for sum/avg). ``max``/``min``:
        the summed gradient goes to the rank(s) holding the extreme value, split evenly
        among ties. ``product``: ``sum_k g_k * prod_{j != r} x_j`` (zero-safe).

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: dc.all_reduce(torch.tensor([1.0 + dc.get_rank()])))
            # [tensor([3.]), tensor([3.])]
    """
    x = _check_input(x, "all_reduce")
    op_name = A.normalize_op(op, "all_reduce", x)
    pg = A.resolve_group(group, "all_reduce")
    if _DEBUG.value if _DEBUG.loaded else _DEBUG.get():  # inline: no call, no kwargs, when off
        _debug_check_input("all_reduce", pg, x, op=op_name)
    return (_apply_async if async_op else _apply)(_AllReduce, x, op_name, pg)


# ======================================================================================
# broadcast / reduce (a dual pair)
# ======================================================================================


class _Broadcast(CommOp):
    name = "broadcast"
    elementwise = True

    @staticmethod
    def run(x: Tensor, src: int, pg: PG) -> Tensor:
        return _b().broadcast(x, src, pg)

    @staticmethod
    def transpose(g: Tensor, src: int, pg: PG) -> Tensor:
        return call(_Reduce, g, src, "sum", pg)


def broadcast(x: Tensor, src: int = 0, group: A.GroupLike = None, *, async_op: bool = False) -> Tensor:
    """Every rank gets rank ``src``'s ``x``.

    Args:
        x: tensor of the same shape and dtype on every rank (only ``src``'s values matter).
        src: group-local rank whose tensor is sent.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        async_op: return at once an :class:`~diffcomm.AsyncTensor` that waits for the
            communication on first use (``.wait()`` returns the finished tensor); values
            and gradients equal the blocking op's, and the backward is asynchronous too
            (``docs/async.md``).

    Returns:
        A new tensor of ``x.shape`` holding ``src``'s values.

    Gradient:
        ``reduce(grad, dst=src, op="sum")``: ``src`` gets the sum of every rank's output
        gradient, every other rank gets exact zeros (its values were ignored).

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: dc.broadcast(torch.tensor([float(dc.get_rank())]), src=1))
            # [tensor([1.]), tensor([1.])]
    """
    x = _check_input(x, "broadcast")
    pg = A.resolve_group(group, "broadcast")
    src = A.check_rank(src, "broadcast", "src", _world(pg))
    if _DEBUG.value if _DEBUG.loaded else _DEBUG.get():  # inline: no call, no kwargs, when off
        _debug_check_input("broadcast", pg, x, src=src)
    return (_apply_async if async_op else _apply)(_Broadcast, x, src, pg)


class _Reduce(CommOp):
    """Linear reduce (sum/avg) to ``dst``; max/min/product are composed in :func:`reduce`."""

    name = "reduce"
    elementwise = True

    @staticmethod
    def run(x: Tensor, dst: int, op: str, pg: PG) -> Tensor:
        return _b().reduce(x, dst, op, pg)

    @staticmethod
    def label(dst: int, op: str, pg: PG) -> str:
        return _LABELS["reduce"][op]

    @staticmethod
    def transpose(g: Tensor, dst: int, op: str, pg: PG) -> Tensor:
        out = call(_Broadcast, g, dst, pg)
        return out / _world(pg) if op == "avg" else out


def reduce(
    x: Tensor, dst: int = 0, op: Any = "sum", group: A.GroupLike = None, *, async_op: bool = False
) -> Tensor:
    """Reduce ``x`` over ranks onto ``dst``; other ranks get zeros of the same shape.

    Args:
        x: tensor of the same shape and dtype on every rank.
        dst: group-local rank that receives the reduction.
        op: reduce op as for :func:`all_reduce`.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        async_op: return at once an :class:`~diffcomm.AsyncTensor` that waits for the
            communication on first use (``.wait()`` returns the finished tensor); values
            and gradients equal the blocking op's, and the backward is asynchronous too
            (``docs/async.md``).

    Returns:
        A new tensor of ``x.shape``: the reduction on ``dst``, zeros elsewhere (uniform
        shapes keep SPMD code rank-free).

    Gradient:
        ``broadcast(grad, src=dst)`` (scaled by ``1/world`` for avg); for max/min/product
        ``dst``'s gradient is routed as in :func:`all_reduce`.

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: dc.reduce(torch.ones(2), dst=0))
            # [tensor([2., 2.]), tensor([0., 0.])]
    """
    x = _check_input(x, "reduce")
    op_name = A.normalize_op(op, "reduce", x)
    pg = A.resolve_group(group, "reduce")
    dst = A.check_rank(dst, "reduce", "dst", _world(pg))
    if _DEBUG.value if _DEBUG.loaded else _DEBUG.get():  # inline: no call, no kwargs, when off
        _debug_check_input("reduce", pg, x, op=op_name, dst=dst)
    apply = _apply_async if async_op else _apply
    if op_name in A.LINEAR_OPS:
        return apply(_Reduce, x, dst, op_name, pg)
    # max/min/product: every rank needs the extreme/product for its gradient anyway
    return _only_on(apply(_AllReduce, x, op_name, pg), _rank(pg) == dst)


# ======================================================================================
# all_gather / reduce_scatter (a dual pair)
# ======================================================================================


class _AllGather(CommOp):
    name = "all_gather"
    dims = (0,)

    @staticmethod
    def run(x: Tensor, dim: int, pg: PG, sizes: tuple[int, ...]) -> Tensor:
        if type(sizes) is _Gathered and sizes.box:  # gathered with its counts already
            return sizes.box.pop()
        out = _b().all_gather(x if dim == 0 else x.movedim(dim, 0), pg, sizes)
        return out if dim == 0 else out.movedim(0, dim)

    @staticmethod
    def transpose(g: Tensor, dim: int, pg: PG, sizes: tuple[int, ...]) -> Tensor:
        return call(_ReduceScatter, g, dim, "sum", pg, sizes)


def all_gather(
    x: Tensor,
    dim: int = 0,
    group: A.GroupLike = None,
    *,
    split_sizes: Sequence[int] | None = None,
    sizes: Sequence[int] | None = None,
    async_op: bool = False,
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
        async_op: return at once an :class:`~diffcomm.AsyncTensor` that waits for the
            communication on first use (``.wait()`` returns the finished tensor); values
            and gradients equal the blocking op's, and the backward is asynchronous too
            (``docs/async.md``).

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
    x = _check_input(x, "all_gather")
    dim = A.check_dim(x, dim, "all_gather")
    pg = A.resolve_group(group, "all_gather")
    sizes, arg = A.renamed_sizes(split_sizes, sizes, "all_gather")
    if sizes is not None:
        sizes = _given_sizes(sizes, x, dim, pg, "all_gather", arg)
    if _DEBUG.value if _DEBUG.loaded else _DEBUG.get():
        rest = _other_dims(x, dim)
        _debug_check("all_gather", pg, dim=dim, other_dims=rest, dtype=x.dtype, grad=x.requires_grad)
    if sizes is None:  # learned with the rows where the backend can, else exchanged first
        sizes = _gathered_sizes(x, dim, pg, async_op)
    else:
        sizes = tuple(sizes)
    return (_apply_async if async_op else _apply)(_AllGather, x, dim, pg, sizes)


class _ReduceScatter(CommOp):
    """Linear reduce_scatter (sum/avg); max/min/product are composed in :func:`reduce_scatter`."""

    name = "reduce_scatter"
    dims = (0,)

    @staticmethod
    def run(x: Tensor, dim: int, op: str, pg: PG, sizes: tuple[int, ...]) -> Tensor:
        out = _b().reduce_scatter(x if dim == 0 else x.movedim(dim, 0), op, pg, sizes)
        return out if dim == 0 else out.movedim(0, dim)

    @staticmethod
    def label(dim: int, op: str, pg: PG, sizes: tuple[int, ...]) -> str:
        return _LABELS["reduce_scatter"][op]

    @staticmethod
    def transpose(g: Tensor, dim: int, op: str, pg: PG, sizes: tuple[int, ...]) -> Tensor:
        out = call(_AllGather, g, dim, pg, sizes)
        return out / _world(pg) if op == "avg" else out


#: The raw forwards of ``all_gather`` (``(x, dim, pg, sizes)``) and ``reduce_scatter``
#: (``(x, dim, op, pg, sizes)``), for op families built on the collectives.
raw_all_gather = _AllGather.run
raw_reduce_scatter = _ReduceScatter.run


def reduce_scatter(
    x: Tensor,
    dim: int = 0,
    op: Any = "sum",
    group: A.GroupLike = None,
    split_sizes: Sequence[int] | None = None,
    *,
    async_op: bool = False,
) -> Tensor:
    """Reduce ``x`` over ranks and give rank ``r`` chunk ``r`` of the result along ``dim``.

    Args:
        x: tensor of the same shape and dtype on every rank.
        dim: the dimension to split.
        op: reduce op as for :func:`all_reduce`.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        split_sizes: per-rank chunk sizes along ``dim`` (summing to ``x.shape[dim]``);
            ``None`` splits evenly (then ``x.shape[dim]`` must divide by the group size).
        async_op: return at once an :class:`~diffcomm.AsyncTensor` that waits for the
            communication on first use (``.wait()`` returns the finished tensor); values
            and gradients equal the blocking op's, and the backward is asynchronous too
            (``docs/async.md``).

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
    x = _check_input(x, "reduce_scatter")
    dim = A.check_dim(x, dim, "reduce_scatter")
    op_name = A.normalize_op(op, "reduce_scatter", x)
    pg = A.resolve_group(group, "reduce_scatter")
    sizes = A.check_split_sizes(split_sizes, x.shape[dim], _world(pg), "reduce_scatter")
    if _DEBUG.value if _DEBUG.loaded else _DEBUG.get():  # inline: no call, no kwargs, when off
        _debug_check_input("reduce_scatter", pg, x, op=op_name, dim=dim, split_sizes=sizes)
    apply = _apply_async if async_op else _apply
    if op_name in A.LINEAR_OPS:
        return apply(_ReduceScatter, x, dim, op_name, pg, tuple(sizes))
    full = apply(_AllReduce, x, op_name, pg)
    rank = _rank(pg)
    return full.narrow(dim, sum(sizes[:rank]), sizes[rank])


# ======================================================================================
# asynchronous ops: the output shape of each Function, known before it communicates
# ======================================================================================

# arguments: (x, op, pg) (x, src, pg) (x, dst, op, pg) (x, dim, pg, sizes) (x, dim, op, pg, sizes)
# (gather / scatter / all_to_all register theirs in their modules)
_async.OUT_SHAPES.update(
    {
        _AllReduce: lambda a: tuple(a[0].shape),
        _Broadcast: lambda a: tuple(a[0].shape),
        _Reduce: lambda a: tuple(a[0].shape),
        _AllGather: lambda a: _with(a[0].shape, {a[1]: sum(a[3])}),
        _ReduceScatter: lambda a: _with(a[0].shape, {a[1]: a[4][_rank(a[3])]}),
    }
)


# ======================================================================================
# the op -> adjoint table
# ======================================================================================


OPS: dict[str, OpSpec] = register(
    "collective",
    OpSpec(
        "all_reduce",
        all_reduce,
        "all_reduce",
        "op over ranks, on every rank",
        "all_reduce of grads (max/min: to arg-extreme ranks, ties split; product: zero-safe)",
        lambda kw, w: ({"op": kw.get("op", "sum")}, 1.0),
        R.all_reduce,
    ),
    OpSpec(
        "broadcast",
        broadcast,
        "reduce",
        "src's x on every rank",
        "reduce(sum) to src; other ranks exact zeros",
        lambda kw, w: ({"dst": kw.get("src", 0)}, 1.0),
        R.broadcast,
    ),
    OpSpec(
        "reduce",
        reduce,
        "broadcast",
        "op over ranks on dst, zeros elsewhere",
        "broadcast from dst",
        lambda kw, w: ({"src": kw.get("dst", 0)}, R.avg_scale(kw, w)),
        R.reduce,
    ),
    OpSpec(
        "all_gather",
        all_gather,
        "reduce_scatter",
        "concat of every rank's x along dim",
        "reduce_scatter(sum) with the same split",
        lambda kw, w: ({"dim": kw.get("dim", 0), "split_sizes": kw.get("split_sizes")}, 1.0),
        R.all_gather,
    ),
    OpSpec(
        "reduce_scatter",
        reduce_scatter,
        "all_gather",
        "chunk r of the reduction",
        "all_gather with the same split",
        lambda kw, w: (
            {"dim": kw.get("dim", 0), "split_sizes": kw.get("split_sizes")},
            R.avg_scale(kw, w),
        ),
        R.reduce_scatter,
    ),
    OpSpec(
        "gather",
        gather,
        "scatter",
        "concat on dst, zeros elsewhere",
        "scatter from dst with the same split",
        lambda kw, w: (
            {"src": kw.get("dst", 0), "dim": kw.get("dim", 0), "split_sizes": kw.get("split_sizes")},
            1.0,
        ),
        R.gather,
    ),
    OpSpec(
        "scatter",
        scatter,
        "gather",
        "chunk r of src's x",
        "gather to src with the same split",
        lambda kw, w: (
            {"dst": kw.get("src", 0), "dim": kw.get("dim", 0), "split_sizes": kw.get("split_sizes")},
            1.0,
        ),
        R.scatter,
    ),
    OpSpec(
        "all_to_all",
        all_to_all,
        "all_to_all",
        "chunk r of every rank's x, concatenated",
        "all_to_all with dims and split sizes swapped",
        lambda kw, w: (
            {
                "split_dim": kw.get("concat_dim", 0),
                "concat_dim": kw.get("split_dim", 0),
                "input_split_sizes": kw.get("output_split_sizes"),
                "output_split_sizes": kw.get("input_split_sizes"),
            },
            1.0,
        ),
        R.all_to_all,
    ),
)

#: op name -> name of its adjoint (the table the tests walk and the docs are built from).
DUALS: dict[str, str] = {name: spec.dual for name, spec in OPS.items()}


def dual(op: str) -> str:
    """Name of the adjoint of collective ``op`` (``dual(dual(op)) == op``)."""
    if op not in DUALS:
        raise ValueError(f"diffcomm.dual(): unknown op {op!r}; known: {sorted(DUALS)}")
    return DUALS[op]


def duals_markdown() -> str:
    """The op -> adjoint table as Markdown (the docs include this)."""
    return markdown("collective")
