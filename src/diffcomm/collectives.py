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

Each op has one home below: the public function (validation first, before any
communication) and its :class:`~diffcomm._op.CommOp` subclass, which states the raw
forward, the transpose (the dual op) and which arguments are dims; the base derives
``setup_context`` / ``backward`` / ``jvp`` (the tangent goes through the same linear op) /
``vmap`` (batch dim moved, one call for the whole batch) and the compile twin.

Rules that keep the SPMD program deadlock-free: backward rules never branch on
rank-local facts that could differ between ranks, and only call public diffcomm ops
(never raw backend calls), so every rank runs the same collectives in backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from . import _args as A
from . import _async, _config
from . import backend as B
from ._op import CommOp, FastFunction, call, fn, jvp_free_twin, movedim0, only_on, unwrap_if_dead
from ._op import apply as _apply
from ._registry import Kwargs, OpSpec, markdown, register

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

PG = Any  # resolved ProcessGroup (or None for the default group)


def _b() -> B.Backend:
    return B.get_backend()


def _rank(pg: PG) -> int:
    return _b().rank(pg)


def _world(pg: PG) -> int:
    return _b().world_size(pg)


def _debug_check(opname: str, pg: PG, /, **fields: Any) -> None:
    if _config.DEBUG.get():
        _b().check_consistent(opname, fields, pg)


def _check_input(x: Any, op: str) -> Tensor:
    x = A.check_tensor(x, op, "x")
    A.check_grad_dtype(x, op, "x")
    return x


_movedim0 = movedim0
_only_on = only_on
_fn = fn
_Collective = FastFunction  # the cheap-apply base (coalesced ops build on it)
_NO_ASYNC = contextlib.nullcontext()


def _async_if(async_op: bool) -> Any:
    """``with`` block around a public op's ``apply``: with ``async_op=True`` the op's
    Function is launched on the communication engine (:mod:`diffcomm._async`), where
    that is possible (not under ``torch.func`` / ``torch.compile``: then it runs blocking)."""
    return _async.async_mode() if async_op and _async.available() else _NO_ASYNC


_jvp_free_twin = jvp_free_twin
_unwrap_if_dead = unwrap_if_dead


# ======================================================================================
# all_reduce
# ======================================================================================


class _AllReduce(CommOp):
    """Self-adjoint for sum/avg; max/min/product are the sum composed with a weight."""

    name = "all_reduce"
    elementwise = True

    @staticmethod
    def run(x: Tensor, op: str, pg: PG) -> Tensor:
        return _b().all_reduce(x, op, pg)

    @staticmethod
    def label(op: str, pg: PG) -> str:
        return f"all_reduce({op})"

    @staticmethod
    def transpose(g: Tensor, op: str, pg: PG) -> Tensor:
        return call(_AllReduce, g, op, pg)

    @staticmethod
    def linearize(args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        return None if args[0] in A.LINEAR_OPS else ("sum", args[1])

    @staticmethod
    def weight(x: Tensor, y: Tensor, op: str, pg: PG) -> Tensor:
        return _nonlinear_weight(op, x, y, pg)


def _nonlinear_weight(op: str, x: Tensor, y: Tensor, pg: PG) -> Tensor:
    """d y / d x_r for max/min/product on this rank (y = op over ranks of x).

    max/min: ``[x_r == y] / #ties`` — the gradient goes to the rank(s) holding the extreme,
    split evenly among ties. product: the product of the other ranks' values, computed
    from an all_gather with prefix/suffix products (exact with zeros; differentiable, so
    double backward is exact too).
    """
    if op in ("max", "min"):
        mask = (x.detach() == y.detach()).to(x.dtype)
        count = all_reduce(mask, "sum", pg)
        return mask / count
    rank, world = _rank(pg), _world(pg)
    xs = all_gather(x.unsqueeze(0), 0, pg, split_sizes=[1] * world)
    return xs[:rank].prod(0) * xs[rank + 1 :].prod(0)


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
    _debug_check("all_reduce", pg, op=op_name, shape=tuple(x.shape), dtype=x.dtype, grad=x.requires_grad)
    with _async_if(async_op):
        return _apply(_AllReduce, x, op_name, pg)


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
    _debug_check("broadcast", pg, src=src, shape=tuple(x.shape), dtype=x.dtype, grad=x.requires_grad)
    with _async_if(async_op):
        return _apply(_Broadcast, x, src, pg)


class _Reduce(CommOp):
    """Linear reduce (sum/avg) to ``dst``; max/min/product are composed in :func:`reduce`."""

    name = "reduce"
    elementwise = True

    @staticmethod
    def run(x: Tensor, dst: int, op: str, pg: PG) -> Tensor:
        return _b().reduce(x, dst, op, pg)

    @staticmethod
    def label(dst: int, op: str, pg: PG) -> str:
        return f"reduce({op})"

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
    _debug_check("reduce", pg, op=op_name, dst=dst, shape=tuple(x.shape), dtype=x.dtype, grad=x.requires_grad)
    with _async_if(async_op):
        if op_name in A.LINEAR_OPS:
            return _apply(_Reduce, x, dst, op_name, pg)
        # max/min/product: every rank needs the extreme/product for its gradient anyway
        return _only_on(_apply(_AllReduce, x, op_name, pg), _rank(pg) == dst)


# ======================================================================================
# all_gather / reduce_scatter (a dual pair)
# ======================================================================================


class _AllGather(CommOp):
    name = "all_gather"
    dims = (0,)

    @staticmethod
    def run(x: Tensor, dim: int, pg: PG, sizes: tuple[int, ...]) -> Tensor:
        out = _b().all_gather(_movedim0(x, dim), pg, sizes)
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
            it the sizes are exchanged first (one tiny all_gather of host integers on a CPU
            channel of the same ranks), so uneven sizes just work.
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
    world = _world(pg)
    sizes, arg = A.renamed_sizes(split_sizes, sizes, "all_gather")
    if sizes is not None:
        sizes = A.check_split_sizes(sizes, sum(int(s) for s in sizes), world, "all_gather", arg)
        if sizes[_rank(pg)] != x.shape[dim]:
            raise A.arg_error(
                "all_gather", arg, f"to list x.shape[{dim}]={x.shape[dim]} at this rank's position", sizes
            )
    if _config.DEBUG.get():
        rest = tuple(s for i, s in enumerate(x.shape) if i != dim)
        _debug_check("all_gather", pg, dim=dim, other_dims=rest, dtype=x.dtype, grad=x.requires_grad)
    if sizes is None:
        with B.label("all_gather (size exchange)"):
            sizes = _b().exchange_sizes(x.shape[dim], pg)
    with _async_if(async_op):
        return _apply(_AllGather, x, dim, pg, tuple(sizes))


class _ReduceScatter(CommOp):
    """Linear reduce_scatter (sum/avg); max/min/product are composed in :func:`reduce_scatter`."""

    name = "reduce_scatter"
    dims = (0,)

    @staticmethod
    def run(x: Tensor, dim: int, op: str, pg: PG, sizes: tuple[int, ...]) -> Tensor:
        out = _b().reduce_scatter(_movedim0(x, dim), op, pg, sizes)
        return out if dim == 0 else out.movedim(0, dim)

    @staticmethod
    def label(dim: int, op: str, pg: PG, sizes: tuple[int, ...]) -> str:
        return f"reduce_scatter({op})"

    @staticmethod
    def transpose(g: Tensor, dim: int, op: str, pg: PG, sizes: tuple[int, ...]) -> Tensor:
        out = call(_AllGather, g, dim, pg, sizes)
        return out / _world(pg) if op == "avg" else out


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
    world, rank = _world(pg), _rank(pg)
    sizes = A.check_split_sizes(split_sizes, x.shape[dim], world, "reduce_scatter")
    _debug_check(
        "reduce_scatter",
        pg,
        op=op_name,
        dim=dim,
        shape=tuple(x.shape),
        dtype=x.dtype,
        split_sizes=tuple(sizes),
        grad=x.requires_grad,
    )
    with _async_if(async_op):
        if op_name in A.LINEAR_OPS:
            return _apply(_ReduceScatter, x, dim, op_name, pg, tuple(sizes))
        full = _apply(_AllReduce, x, op_name, pg)
        return full.narrow(dim, sum(sizes[:rank]), sizes[rank])


# ======================================================================================
# gather / scatter (a dual pair)
# ======================================================================================


class _Gather(CommOp):
    name = "gather"
    dims = (1,)

    @staticmethod
    def run(x: Tensor, dst: int, dim: int, pg: PG, sizes: tuple[int, ...]) -> Tensor:
        out = _b().gather(_movedim0(x, dim), dst, pg, sizes)
        return out if dim == 0 else out.movedim(0, dim)

    @staticmethod
    def transpose(g: Tensor, dst: int, dim: int, pg: PG, sizes: tuple[int, ...]) -> Tensor:
        return call(_Scatter, g, dst, dim, pg, sizes)


def gather(
    x: Tensor,
    dst: int = 0,
    dim: int = 0,
    group: A.GroupLike = None,
    *,
    split_sizes: Sequence[int] | None = None,
    sizes: Sequence[int] | None = None,
    async_op: bool = False,
) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim`` on ``dst``; zeros elsewhere.

    Args:
        x: tensor; shapes agree between ranks except along ``dim``.
        dst: group-local rank that receives the concatenation.
        dim: the dimension to concatenate along.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        split_sizes: keyword-only; every rank's ``x.shape[dim]`` if known (else exchanged).
        sizes: the old name of ``split_sizes`` (works, with a ``DeprecationWarning``).
        async_op: return at once an :class:`~diffcomm.AsyncTensor` that waits for the
            communication on first use (``.wait()`` returns the finished tensor); values
            and gradients equal the blocking op's, and the backward is asynchronous too
            (``docs/async.md``).

    Returns:
        A new tensor of ``x.shape`` with ``dim`` of size ``sum(sizes)``: the concatenation
        on ``dst``, zeros of that shape on the other ranks.

    Gradient:
        ``scatter(grad, src=dst, dim, split_sizes=sizes)``: rank ``r`` gets block ``r`` of
        ``dst``'s output gradient (the other ranks' output gradients are ignored, as their
        outputs were constant zeros).

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: dc.gather(torch.tensor([1.0 * dc.get_rank()]), dst=0))
            # [tensor([0., 1.]), tensor([0., 0.])]
    """
    x = _check_input(x, "gather")
    dim = A.check_dim(x, dim, "gather")
    pg = A.resolve_group(group, "gather")
    world = _world(pg)
    dst = A.check_rank(dst, "gather", "dst", world)
    sizes, arg = A.renamed_sizes(split_sizes, sizes, "gather")
    if sizes is not None:
        sizes = A.check_split_sizes(sizes, sum(int(s) for s in sizes), world, "gather", arg)
        if sizes[_rank(pg)] != x.shape[dim]:
            raise A.arg_error("gather", arg, f"to list x.shape[{dim}]={x.shape[dim]} at this rank", sizes)
    if _config.DEBUG.get():
        rest = tuple(s for i, s in enumerate(x.shape) if i != dim)
        _debug_check("gather", pg, dst=dst, dim=dim, other_dims=rest, dtype=x.dtype, grad=x.requires_grad)
    if sizes is None:
        with B.label("gather (size exchange)"):
            sizes = _b().exchange_sizes(x.shape[dim], pg)
    with _async_if(async_op):
        return _apply(_Gather, x, dst, dim, pg, tuple(sizes))


class _Scatter(CommOp):
    name = "scatter"
    dims = (1,)

    @staticmethod
    def run(x: Tensor, src: int, dim: int, pg: PG, sizes: tuple[int, ...]) -> Tensor:
        out = _b().scatter(_movedim0(x, dim), src, pg, sizes)
        return out if dim == 0 else out.movedim(0, dim)

    @staticmethod
    def transpose(g: Tensor, src: int, dim: int, pg: PG, sizes: tuple[int, ...]) -> Tensor:
        return call(_Gather, g, src, dim, pg, sizes)


def scatter(
    x: Tensor,
    src: int = 0,
    dim: int = 0,
    group: A.GroupLike = None,
    split_sizes: Sequence[int] | None = None,
    *,
    async_op: bool = False,
) -> Tensor:
    """Give rank ``r`` chunk ``r`` (along ``dim``) of rank ``src``'s ``x``.

    Args:
        x: tensor of the same shape on every rank; only ``src``'s values are used (the
            others pass a same-shape placeholder, whose gradient is zero).
        src: group-local rank whose tensor is split.
        dim: the dimension to split.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        split_sizes: per-rank chunk sizes along ``dim``; ``None`` splits evenly.
        async_op: return at once an :class:`~diffcomm.AsyncTensor` that waits for the
            communication on first use (``.wait()`` returns the finished tensor); values
            and gradients equal the blocking op's, and the backward is asynchronous too
            (``docs/async.md``).

    Returns:
        A new tensor: ``x.shape`` with ``dim`` of size ``split_sizes[rank]``.

    Gradient:
        ``gather(grad, dst=src, dim, split_sizes=split_sizes)``: ``src`` gets every rank's chunk
        gradient in place; the other ranks get exact zeros.

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: dc.scatter(torch.arange(4.0), src=0))
            # [tensor([0., 1.]), tensor([2., 3.])]
    """
    x = _check_input(x, "scatter")
    dim = A.check_dim(x, dim, "scatter")
    pg = A.resolve_group(group, "scatter")
    world = _world(pg)
    src = A.check_rank(src, "scatter", "src", world)
    sizes = A.check_split_sizes(split_sizes, x.shape[dim], world, "scatter")
    _debug_check(
        "scatter",
        pg,
        src=src,
        dim=dim,
        shape=tuple(x.shape),
        dtype=x.dtype,
        split_sizes=tuple(sizes),
        grad=x.requires_grad,
    )
    with _async_if(async_op):
        return _apply(_Scatter, x, src, dim, pg, tuple(sizes))


# ======================================================================================
# all_to_all (self-dual with dims and splits swapped)
# ======================================================================================


class _AllToAll(CommOp):
    name = "all_to_all"
    dims = (0, 1)

    @staticmethod
    def run(
        x: Tensor, split_dim: int, concat_dim: int, pg: PG, ins: tuple[int, ...], outs: tuple[int, ...]
    ) -> Tensor:
        return _all_to_all_raw(x, split_dim, concat_dim, pg, ins, outs)

    @staticmethod
    def transpose(
        g: Tensor, split_dim: int, concat_dim: int, pg: PG, ins: tuple[int, ...], outs: tuple[int, ...]
    ) -> Tensor:
        return call(_AllToAll, g, concat_dim, split_dim, pg, outs, ins)


def _all_to_all_raw(
    x: Tensor, split_dim: int, concat_dim: int, pg: PG, ins: tuple[int, ...], outs: tuple[int, ...]
) -> Tensor:
    """all_to_all over the raw backend (dim-0, contiguous) for any pair of dims."""
    if split_dim == concat_dim:
        out = _b().all_to_all(_movedim0(x, split_dim), pg, list(ins), list(outs))
        return out if split_dim == 0 else out.movedim(0, split_dim)
    # split along split_dim, concatenate along concat_dim. Chunks travel flat in the layout
    # (concat_dim, split_dim, other dims...); every rank sends me a chunk of split size
    # ins[me] (validated equal across ranks) whose concat_dim size is outs[j].
    world, rank = _world(pg), _rank(pg)
    order = [concat_dim, split_dim] + [i for i in range(x.ndim) if i not in (split_dim, concat_dim)]
    rest = [x.shape[i] for i in order[2:]]
    rest_n = 1
    for s in rest:
        rest_n *= s
    c_in = ins[rank]
    send = x.permute(order).split(list(ins), dim=1)
    flat_in = torch.cat([ch.reshape(-1) for ch in send]) if world > 1 else send[0].reshape(-1)
    in_counts = [ins[j] * x.shape[concat_dim] * rest_n for j in range(world)]
    out_counts = [outs[j] * c_in * rest_n for j in range(world)]
    flat = _b().all_to_all(flat_in, pg, in_counts, out_counts)
    blocks = [p.reshape(outs[j], c_in, *rest) for j, p in enumerate(flat.split(out_counts))]
    full = torch.cat(blocks, dim=0) if world > 1 else blocks[0]  # (sum outs, c_in, *rest)
    inverse = [order.index(i) for i in range(x.ndim)]
    return full.permute(inverse)


def all_to_all(
    x: Tensor,
    split_dim: int = 0,
    concat_dim: int = 0,
    group: A.GroupLike = None,
    input_split_sizes: Sequence[int] | None = None,
    output_split_sizes: Sequence[int] | None = None,
    *,
    async_op: bool = False,
) -> Tensor:
    """Send chunk ``j`` of ``x`` (along ``split_dim``) to rank ``j``; concatenate what
    arrives from every rank along ``concat_dim``.

    Args:
        x: tensor; same shape on every rank (except along ``split_dim`` when uneven).
        split_dim: dimension split into per-destination chunks.
        concat_dim: dimension the received chunks are concatenated along (in rank order).
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        input_split_sizes: sizes of the chunks sent to each rank along ``split_dim``
            (``None``: even).
        output_split_sizes: sizes along ``concat_dim`` of the chunks received from each
            rank. ``None``: inferred — exchanged when ``split_dim == concat_dim`` and
            ``input_split_sizes`` is given, else ``x``'s size (even split) or
            ``x.shape[concat_dim]`` (different dims).
        async_op: return at once an :class:`~diffcomm.AsyncTensor` that waits for the
            communication on first use (``.wait()`` returns the finished tensor); values
            and gradients equal the blocking op's, and the backward is asynchronous too
            (``docs/async.md``).

    Returns:
        A new tensor. ``split_dim == concat_dim == d``: ``x.shape`` with ``d`` of size
        ``sum(output_split_sizes)``. Otherwise ``x.shape`` with ``split_dim`` of size
        ``input_split_sizes[rank]`` (every rank must send rank ``r`` the same size) and
        ``concat_dim`` of size ``sum(output_split_sizes)``.

    Gradient:
        ``all_to_all(grad, split_dim=concat_dim, concat_dim=split_dim,
        input_split_sizes=output_split_sizes, output_split_sizes=input_split_sizes)``.

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: dc.all_to_all(torch.arange(2.0) + 2 * dc.get_rank()))
            # [tensor([0., 2.]), tensor([1., 3.])]
    """
    op = "all_to_all"
    x = _check_input(x, op)
    split_dim = A.check_dim(x, split_dim, op, "split_dim")
    concat_dim = A.check_dim(x, concat_dim, op, "concat_dim")
    pg = A.resolve_group(group, op)
    world, rank = _world(pg), _rank(pg)
    ins = A.check_split_sizes(input_split_sizes, x.shape[split_dim], world, op, "input_split_sizes")
    if split_dim == concat_dim:
        if output_split_sizes is not None:
            outs = A.check_split_sizes(
                output_split_sizes, sum(int(s) for s in output_split_sizes), world, op, "output_split_sizes"
            )
        elif input_split_sizes is None:
            outs = list(ins)
        else:
            outs = None  # exchanged below, after the debug check
    else:
        if input_split_sizes is not None and any(s != ins[0] for s in ins):
            raise A.arg_error(
                op,
                "input_split_sizes",
                "equal sizes when split_dim != concat_dim (received chunks are concatenated along "
                "another dim, so their split_dim sizes must agree)",
                list(ins),
            )
        if output_split_sizes is None:
            outs = [x.shape[concat_dim]] * world
        else:
            outs = A.check_split_sizes(
                output_split_sizes, sum(int(s) for s in output_split_sizes), world, op, "output_split_sizes"
            )
            if outs[rank] != x.shape[concat_dim]:
                raise A.arg_error(
                    op,
                    "output_split_sizes",
                    f"to list this rank's x.shape[concat_dim]={x.shape[concat_dim]} at its own position",
                    outs,
                )
    if _config.DEBUG.get():
        rest = tuple(s for i, s in enumerate(x.shape) if i not in (split_dim, concat_dim))
        _debug_check(
            op,
            pg,
            split_dim=split_dim,
            concat_dim=concat_dim,
            other_dims=rest,
            dtype=x.dtype,
            grad=x.requires_grad,
        )
    if outs is None:
        if torch.compiler.is_compiling():
            raise A.arg_error(
                op,
                "output_split_sizes",
                "given under torch.compile when `input_split_sizes` is and split_dim == concat_dim "
                "(the received sizes would be exchanged with a host read, which dynamo cannot trace)",
                None,
            )
        with B.label("all_to_all (size exchange)"):
            sent = torch.tensor(ins, dtype=torch.int64, device=_b().comm_device(pg))
            outs = _b().all_to_all(sent, pg, [1] * world, [1] * world).tolist()
    with _async_if(async_op):
        return _apply(_AllToAll, x, split_dim, concat_dim, pg, tuple(ins), tuple(int(o) for o in outs))


# ======================================================================================
# asynchronous ops: the output shape of each Function, known before it communicates
# ======================================================================================


def _with(shape: Any, sizes: dict[int, int]) -> tuple[int, ...]:
    """``shape`` with ``shape[d] = n`` for every ``d: n`` in ``sizes``."""
    return tuple(sizes.get(i, s) for i, s in enumerate(shape))


def _all_to_all_shape(a: tuple[Any, ...]) -> tuple[int, ...]:
    x, split_dim, concat_dim, pg, ins, outs = a
    if split_dim == concat_dim:
        return _with(x.shape, {split_dim: sum(outs)})
    return _with(x.shape, {split_dim: ins[_rank(pg)], concat_dim: sum(outs)})


# arguments: (x, op, pg) (x, src, pg) (x, dst, op, pg) (x, dim, pg, sizes)
# (x, dim, op, pg, sizes) (x, dst, dim, pg, sizes) (x, src, dim, pg, sizes)
_async.OUT_SHAPES.update(
    {
        _AllReduce: lambda a: tuple(a[0].shape),
        _Broadcast: lambda a: tuple(a[0].shape),
        _Reduce: lambda a: tuple(a[0].shape),
        _AllGather: lambda a: _with(a[0].shape, {a[1]: sum(a[3])}),
        _ReduceScatter: lambda a: _with(a[0].shape, {a[1]: a[4][_rank(a[3])]}),
        _Gather: lambda a: _with(a[0].shape, {a[2]: sum(a[4])}),
        _Scatter: lambda a: _with(a[0].shape, {a[2]: a[4][_rank(a[3])]}),
        _AllToAll: _all_to_all_shape,
    }
)


# ======================================================================================
# the op -> adjoint table
# ======================================================================================


def _avg_scale(kw: Kwargs, world: int) -> float:
    return 1.0 / world if kw.get("op", "sum") == "avg" else 1.0


def reduce_serial(xs: Sequence[Tensor], op: str) -> Tensor:
    """The reduction over ranks of ``xs`` with plain torch ops (serial references)."""
    st = torch.stack(list(xs))
    if op in ("sum", "avg"):
        return st.sum(0) / len(xs) if op == "avg" else st.sum(0)
    return {"max": st.amax, "min": st.amin, "product": st.prod}[op](0)


def _even(total: int, world: int) -> list[int]:
    return [total // world] * world


def _ref_all_reduce(xs: list[Tensor], kws: list[Kwargs]) -> list[Tensor]:
    red = reduce_serial(xs, kws[0].get("op", "sum"))
    return [red for _ in xs]


def _ref_broadcast(xs: list[Tensor], kws: list[Kwargs]) -> list[Tensor]:
    return [xs[kws[0].get("src", 0)] for _ in xs]


def _ref_reduce(xs: list[Tensor], kws: list[Kwargs]) -> list[Tensor]:
    red, dst = reduce_serial(xs, kws[0].get("op", "sum")), kws[0].get("dst", 0)
    return [red if r == dst else torch.zeros_like(red) for r in range(len(xs))]


def _ref_all_gather(xs: list[Tensor], kws: list[Kwargs]) -> list[Tensor]:
    full = torch.cat(xs, dim=kws[0].get("dim", 0))
    return [full for _ in xs]


def _ref_gather(xs: list[Tensor], kws: list[Kwargs]) -> list[Tensor]:
    full, dst = torch.cat(xs, dim=kws[0].get("dim", 0)), kws[0].get("dst", 0)
    return [full if r == dst else torch.zeros_like(full) for r in range(len(xs))]


def _ref_reduce_scatter(xs: list[Tensor], kws: list[Kwargs]) -> list[Tensor]:
    kw, w = kws[0], len(xs)
    red, dim = reduce_serial(xs, kw.get("op", "sum")), kw.get("dim", 0)
    return list(red.split(list(kw.get("split_sizes") or _even(red.shape[dim], w)), dim=dim))


def _ref_scatter(xs: list[Tensor], kws: list[Kwargs]) -> list[Tensor]:
    kw, w = kws[0], len(xs)
    dim, src = kw.get("dim", 0), kw.get("src", 0)
    return list(xs[src].split(list(kw.get("split_sizes") or _even(xs[src].shape[dim], w)), dim=dim))


def _ref_all_to_all(xs: list[Tensor], kws: list[Kwargs]) -> list[Tensor]:
    w = len(xs)
    sd, cd = kws[0].get("split_dim", 0), kws[0].get("concat_dim", 0)
    splits = [kws[j].get("input_split_sizes") or _even(xs[j].shape[sd], w) for j in range(w)]
    chunks = [xs[j].split(list(splits[j]), dim=sd) for j in range(w)]
    return [torch.cat([chunks[j][r] for j in range(w)], dim=cd) for r in range(w)]


OPS: dict[str, OpSpec] = register(
    "collective",
    OpSpec(
        "all_reduce",
        all_reduce,
        "all_reduce",
        "op over ranks, on every rank",
        "all_reduce of grads (max/min: to arg-extreme ranks, ties split; product: zero-safe)",
        lambda kw, w: ({"op": kw.get("op", "sum")}, 1.0),
        _ref_all_reduce,
    ),
    OpSpec(
        "broadcast",
        broadcast,
        "reduce",
        "src's x on every rank",
        "reduce(sum) to src; other ranks exact zeros",
        lambda kw, w: ({"dst": kw.get("src", 0)}, 1.0),
        _ref_broadcast,
    ),
    OpSpec(
        "reduce",
        reduce,
        "broadcast",
        "op over ranks on dst, zeros elsewhere",
        "broadcast from dst",
        lambda kw, w: ({"src": kw.get("dst", 0)}, _avg_scale(kw, w)),
        _ref_reduce,
    ),
    OpSpec(
        "all_gather",
        all_gather,
        "reduce_scatter",
        "concat of every rank's x along dim",
        "reduce_scatter(sum) with the same split",
        lambda kw, w: ({"dim": kw.get("dim", 0), "split_sizes": kw.get("split_sizes")}, 1.0),
        _ref_all_gather,
    ),
    OpSpec(
        "reduce_scatter",
        reduce_scatter,
        "all_gather",
        "chunk r of the reduction",
        "all_gather with the same split",
        lambda kw, w: (
            {"dim": kw.get("dim", 0), "split_sizes": kw.get("split_sizes")},
            _avg_scale(kw, w),
        ),
        _ref_reduce_scatter,
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
        _ref_gather,
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
        _ref_scatter,
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
        _ref_all_to_all,
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
