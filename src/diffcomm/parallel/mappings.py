"""Megatron-style region mappings: the conjugate pairs of the replicated objective.

The core collectives (:mod:`diffcomm.collectives`) differentiate the **sum of the
per-rank objectives**. Tensor-parallel code is written under another convention, the
**replicated objective**: one loss ``L``, computed identically on every rank, and every
tensor that is *replicated* (the same on every rank) stands for **one** variable, not
``world`` copies. Under the sum convention that loss is counted ``world`` times — the
classic "gradient 2x too large at TP=2". The mappings below state, in their names, which
region transition the model makes, and carry the backward that is right for ``L``:

==============================  =======================  ===========================
mapping                          forward                  backward
==============================  =======================  ===========================
``copy_to_region``               identity                 all_reduce(sum)
``reduce_from_region``           all_reduce(sum)          identity
``scatter_to_region``            keep own chunk           all_gather
``gather_from_region``           all_gather               keep own chunk
``reduce_scatter_to_sequence``   reduce_scatter(sum)      all_gather
``all_gather_from_sequence``     all_gather               reduce_scatter(sum)
``all_to_all_region``            all_to_all               all_to_all, dims swapped
==============================  =======================  ===========================

Why these backwards. A replicated input ``X`` consumed *differently* on each rank (each
rank multiplies it by its own weight shard) contributes ``sum_r dL/dy_r``: the all_reduce
of ``copy_to_region``. A sum ``y = sum_r x_r`` that every rank then consumes *identically*
arrives with the same gradient ``dL/dy`` on every rank, and ``dL/dx_r = dL/dy``: the
identity of ``reduce_from_region``. The sequence-parallel pair and the all_to_all have no
replicated side at all, so they coincide with the core ops' adjoints; they are named here
so that model code reads as the region transitions it makes.

Debug mode (``diffcomm.debug(True)`` or ``DIFFCOMM_DEBUG=1``, set the same on every rank)
checks the assumption each mapping rests on, with one small all_gather of a fingerprint:

* a **copy forward** (``copy_to_region``, ``scatter_to_region``) checks that its input is
  equal on every rank;
* an **identity backward** (``reduce_from_region``, ``gather_from_region``) checks that
  the incoming gradient is equal on every rank;
* every mapping checks that the shapes agree across ranks.

A mismatch raises :class:`~diffcomm.CrossRankMismatchError` naming the ranks that differ,
so a wrong choice of mapping is an error, not a silent 2x. (The opposite assumptions —
"the gradient of a copy is a *partial* one on each rank" — cannot be checked: partial
gradients may legitimately be equal.)

Every mapping is a ``torch.autograd.Function`` with ``forward`` / ``setup_context`` /
``backward`` / ``jvp`` / ``vmap``. Its backward **is its conjugate mapping** (copy <->
reduce, scatter <-> gather, the sequence pair, all_to_all with dims swapped), built on
diffcomm's differentiable collectives — so double backward is right under the replicated
objective too (a gradient penalty through ``copy_to_region`` is not ``world`` times too
large, as it would be with the core all_reduce as backward), and
``torch.func.grad``/``vjp``/``jvp``/``vmap`` and ``jacrev`` work.
Shards are even: the split dimension must divide by the group size (a ``ValueError``
naming the argument otherwise, before any communication).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .. import _args as A
from .. import _config
from .. import backend as B
from .. import collectives as C
from ..coalesced import all_reduce_coalesced
from ._check import check_replicated

__all__ = [
    "copy_to_region",
    "reduce_from_region",
    "scatter_to_region",
    "gather_from_region",
    "reduce_scatter_to_sequence",
    "all_gather_from_sequence",
    "all_to_all_region",
    "copy_to_region_coalesced",
    "reduce_from_region_coalesced",
    "MAPPINGS",
]

PG = Any  # a resolved ProcessGroup, or None for the default group

_COPY_HINT = (
    "A copy into a tensor-parallel region assumes a replicated input (e.g. the activations "
    "entering a ColumnParallelLinear). If each rank holds a different tensor here (a shard, "
    "or a partial sum that still needs reducing) use reduce_from_region / "
    "gather_from_region first, or no mapping at all."
)
_IDENTITY_HINT = (
    "{name}'s identity backward assumes its output is consumed identically on every rank "
    "(replicated objective: the same loss on every rank), so the gradient arriving here "
    "must be replicated. If each rank consumes the output differently (e.g. feeds it into "
    "its own weight shard), the gradient is partial: use {instead} instead."
)


def _backend() -> B.Backend:
    return B.get_backend()


def _debug() -> bool:
    return bool(_config.DEBUG.get())


def _check_shape(name: str, x: Tensor, pg: PG) -> None:
    """Debug mode: the shapes and dtypes agree across ranks (raises naming the ranks)."""
    _backend().check_consistent(
        f"parallel.{name}", {"shape": tuple(x.shape), "dtype": x.dtype}, pg
    )


def _prepare(name: str, x: Any, group: A.GroupLike) -> tuple[Tensor, PG, int, int]:
    x = A.check_tensor(x, f"parallel.{name}", "x")
    A.check_grad_dtype(x, f"parallel.{name}", "x")
    pg = A.resolve_group(group, f"parallel.{name}")
    return x, pg, _backend().world_size(pg), _backend().rank(pg)


def _even_dim(name: str, x: Tensor, dim: Any, world: int, arg: str = "dim") -> tuple[int, int]:
    """Normalised ``dim`` and the chunk size; ValueError when it does not divide."""
    dim = A.check_dim(x, dim, f"parallel.{name}", arg)
    if x.shape[dim] % world != 0:
        raise A.arg_error(
            f"parallel.{name}",
            "x",
            f"of a size along {arg}={dim} divisible by the group size {world} (shards are even; "
            "pad the dimension to a multiple of the group size)",
            f"shape {tuple(x.shape)}",
        )
    return dim, x.shape[dim] // world


def _to_front(x: Tensor, bdim: int | None) -> Tensor:
    return x if bdim is None or bdim == 0 else x.movedim(bdim, 0)


# ======================================================================================
# copy_to_region / reduce_from_region
# ======================================================================================


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(x: Tensor, pg: PG, debug: bool) -> Tensor:
        if debug:
            check_replicated(x, "parallel.copy_to_region", "the input", _COPY_HINT, pg)
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.pg, ctx.debug = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        # the conjugate mapping (not the core all_reduce): double backward stays right
        # under the replicated objective, and checks the replicated grad-of-grad
        with B.label("parallel.copy_to_region backward"):
            return _ReduceFromRegion.apply(g, ctx.pg, ctx.debug), None, None

    @staticmethod
    def jvp(ctx: Any, t: Tensor, *_: Any) -> Tensor:
        return t.view_as(t)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], x: Tensor, pg: PG, debug: bool) -> tuple[Tensor, Any]:
        return _CopyToRegion.apply(x, pg, debug), in_dims[0]


def copy_to_region(x: Tensor, group: A.GroupLike = None) -> Tensor:
    """Enter a tensor-parallel region with a replicated tensor: identity forward.

    Convention (replicated objective): ``x`` is the same on every rank and stands for one
    variable; after this point each rank consumes it differently (e.g. with its own
    column shard of a weight), and the loss is the same on every rank.

    Args:
        x: tensor, equal on every rank.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.

    Returns:
        ``x`` itself (a view, no copy), shape ``x.shape``.

    Gradient:
        ``all_reduce(grad, "sum")``: the total derivative of the one variable ``x`` is the
        sum of what every rank's consumer contributed. Debug mode checks that ``x`` is
        equal on every rank.

    Example::

        with dc.LocalWorld(2) as world:
            def f():
                x = torch.ones(2, requires_grad=True)
                w = torch.tensor([1.0, 2.0]) * (dc.get_rank() + 1)   # rank-local shard
                (parallel.copy_to_region(x) * w).sum().backward()
                return x.grad
            world.run(f)   # [tensor([3., 6.]), tensor([3., 6.])]
    """
    x, pg, _, _ = _prepare("copy_to_region", x, group)
    return _CopyToRegion.apply(x, pg, _debug())


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(x: Tensor, pg: PG, debug: bool) -> Tensor:
        with B.label("parallel.reduce_from_region"):
            return C.all_reduce(x, "sum", pg)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.pg, ctx.debug = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        if ctx.debug or _debug():
            hint = _IDENTITY_HINT.format(name="reduce_from_region", instead="diffcomm.all_reduce")
            check_replicated(g, "parallel.reduce_from_region backward", "the incoming gradient", hint, ctx.pg)
        return _CopyToRegion.apply(g, ctx.pg, False), None, None

    @staticmethod
    def jvp(ctx: Any, t: Tensor, *_: Any) -> Tensor:
        return C.all_reduce(t, "sum", ctx.pg)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], x: Tensor, pg: PG, debug: bool) -> tuple[Tensor, Any]:
        return _ReduceFromRegion.apply(x, pg, debug), in_dims[0]


def reduce_from_region(x: Tensor, group: A.GroupLike = None) -> Tensor:
    """Leave a tensor-parallel region by summing the partial results: all_reduce forward.

    Convention (replicated objective): each rank holds a partial sum ``x_r`` (e.g. the
    output of its row shard of a weight); the sum is then consumed identically on every
    rank, and the loss is the same on every rank.

    Args:
        x: partial sum, same shape on every rank.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.

    Returns:
        A new tensor of ``x.shape``: ``sum_r x_r``, equal on every rank.

    Gradient:
        identity: ``dL/dx_r = dL/dy``, already the same on every rank. Debug mode checks
        that the incoming gradient is equal on every rank.

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: parallel.reduce_from_region(torch.ones(2)))
            # [tensor([2., 2.]), tensor([2., 2.])]
    """
    x, pg, _, _ = _prepare("reduce_from_region", x, group)
    return _ReduceFromRegion.apply(x, pg, _debug())


# ======================================================================================
# scatter_to_region / gather_from_region
# ======================================================================================


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(x: Tensor, dim: int, pg: PG, debug: bool) -> Tensor:
        if debug:
            check_replicated(x, "parallel.scatter_to_region", "the input", _COPY_HINT, pg)
        world, rank = _backend().world_size(pg), _backend().rank(pg)
        n = x.shape[dim] // world
        return x.narrow(dim, rank * n, n).contiguous()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.dim, ctx.pg, ctx.debug = inputs[1], inputs[2], inputs[3]

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None, None]:
        with B.label("parallel.scatter_to_region backward"):
            return _GatherFromRegion.apply(g, ctx.dim, ctx.pg, ctx.debug), None, None, None

    @staticmethod
    def jvp(ctx: Any, t: Tensor, *_: Any) -> Tensor:
        world, rank = _backend().world_size(ctx.pg), _backend().rank(ctx.pg)
        n = t.shape[ctx.dim] // world
        return t.narrow(ctx.dim, rank * n, n).contiguous()

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[Any, ...], x: Tensor, dim: int, pg: PG, debug: bool
    ) -> tuple[Tensor, int]:
        return _ScatterToRegion.apply(_to_front(x, in_dims[0]), dim + 1, pg, debug), 0


def scatter_to_region(x: Tensor, dim: int = -1, group: A.GroupLike = None) -> Tensor:
    """Enter a tensor-parallel region by keeping this rank's chunk of a replicated tensor.

    Convention (replicated objective): ``x`` is the same on every rank; rank ``r``
    continues with chunk ``r`` along ``dim`` (e.g. the input of a RowParallelLinear that
    is not already parallel), and the loss is the same on every rank.

    Args:
        x: tensor, equal on every rank; ``x.shape[dim]`` divisible by the group size.
        dim: the dimension to split (default: the last).
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.

    Returns:
        A new tensor: ``x.shape`` with ``dim`` of size ``x.shape[dim] // world``.

    Gradient:
        ``all_gather(grad, dim)``: the gradient of the one variable ``x`` is every rank's
        chunk gradient, put together. Debug mode checks that ``x`` is equal on every rank.

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: parallel.scatter_to_region(torch.arange(4.0)))
            # [tensor([0., 1.]), tensor([2., 3.])]
    """
    x, pg, world, _ = _prepare("scatter_to_region", x, group)
    dim, _ = _even_dim("scatter_to_region", x, dim, world)
    return _ScatterToRegion.apply(x, dim, pg, _debug())


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(x: Tensor, dim: int, pg: PG, debug: bool) -> Tensor:
        world = _backend().world_size(pg)
        with B.label("parallel.gather_from_region"):
            return C.all_gather(x, dim, pg, split_sizes=[x.shape[dim]] * world)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.dim, ctx.pg, ctx.debug = inputs[1], inputs[2], inputs[3]

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None, None]:
        if ctx.debug or _debug():
            hint = _IDENTITY_HINT.format(name="gather_from_region", instead="diffcomm.all_gather")
            check_replicated(g, "parallel.gather_from_region backward", "the incoming gradient", hint, ctx.pg)
        return _ScatterToRegion.apply(g, ctx.dim, ctx.pg, False), None, None, None

    @staticmethod
    def jvp(ctx: Any, t: Tensor, *_: Any) -> Tensor:
        world = _backend().world_size(ctx.pg)
        return C.all_gather(t, ctx.dim, ctx.pg, split_sizes=[t.shape[ctx.dim]] * world)

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[Any, ...], x: Tensor, dim: int, pg: PG, debug: bool
    ) -> tuple[Tensor, int]:
        return _GatherFromRegion.apply(_to_front(x, in_dims[0]), dim + 1, pg, debug), 0


def gather_from_region(x: Tensor, dim: int = -1, group: A.GroupLike = None) -> Tensor:
    """Leave a tensor-parallel region by concatenating every rank's chunk: all_gather.

    Convention (replicated objective): rank ``r`` holds chunk ``r`` (e.g. its columns of
    a ColumnParallelLinear output); the concatenation is then consumed identically on
    every rank, and the loss is the same on every rank.

    Args:
        x: this rank's chunk; same shape on every rank.
        dim: the dimension to concatenate along (default: the last).
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.

    Returns:
        A new tensor: ``x.shape`` with ``dim`` of size ``world * x.shape[dim]``, equal on
        every rank.

    Gradient:
        keep own chunk: ``dL/dx_r`` is chunk ``r`` of ``dL/dy``, which is the same on every
        rank. Debug mode checks that the incoming gradient is equal on every rank.

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: parallel.gather_from_region(torch.tensor([1.0 * dc.get_rank()])))
            # [tensor([0., 1.]), tensor([0., 1.])]
    """
    x, pg, _, _ = _prepare("gather_from_region", x, group)
    dim = A.check_dim(x, dim, "parallel.gather_from_region")
    if _debug():
        _check_shape("gather_from_region", x, pg)
    return _GatherFromRegion.apply(x, dim, pg, _debug())


# ======================================================================================
# sequence parallelism: reduce_scatter_to_sequence / all_gather_from_sequence
# ======================================================================================


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(x: Tensor, dim: int, pg: PG) -> Tensor:
        with B.label("parallel.reduce_scatter_to_sequence"):
            return C.reduce_scatter(x, dim, "sum", pg)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.dim, ctx.pg = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        with B.label("parallel.reduce_scatter_to_sequence backward"):
            return _AllGatherFromSequence.apply(g, ctx.dim, ctx.pg), None, None

    @staticmethod
    def jvp(ctx: Any, t: Tensor, *_: Any) -> Tensor:
        return C.reduce_scatter(t, ctx.dim, "sum", ctx.pg)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], x: Tensor, dim: int, pg: PG) -> tuple[Tensor, int]:
        return _ReduceScatterToSequence.apply(_to_front(x, in_dims[0]), dim + 1, pg), 0


def reduce_scatter_to_sequence(x: Tensor, dim: int = 0, group: A.GroupLike = None) -> Tensor:
    """Leave a tensor-parallel region into a sequence-parallel one: reduce_scatter.

    Convention (replicated objective): each rank holds a partial sum over the full
    sequence (e.g. a RowParallelLinear output); rank ``r`` continues with the sequence
    chunk ``r`` of the sum (dropout, residual, layer norm run on ``1/world`` of the
    tokens), and the loss is the same on every rank.

    Args:
        x: partial sum, same shape on every rank; ``x.shape[dim]`` divisible by the group
            size.
        dim: the sequence dimension (default 0, Megatron's ``[s, b, h]`` layout).
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.

    Returns:
        A new tensor: ``x.shape`` with ``dim`` of size ``x.shape[dim] // world``.

    Gradient:
        ``all_gather(grad, dim)`` — the core reduce_scatter's adjoint: no side of this
        mapping is replicated, so both conventions agree (debug mode checks shapes only).

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: parallel.reduce_scatter_to_sequence(torch.arange(4.0)))
            # [tensor([0., 2.]), tensor([4., 6.])]
    """
    x, pg, world, _ = _prepare("reduce_scatter_to_sequence", x, group)
    dim, _ = _even_dim("reduce_scatter_to_sequence", x, dim, world)
    return _ReduceScatterToSequence.apply(x, dim, pg)


class _AllGatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(x: Tensor, dim: int, pg: PG) -> Tensor:
        world = _backend().world_size(pg)
        with B.label("parallel.all_gather_from_sequence"):
            return C.all_gather(x, dim, pg, split_sizes=[x.shape[dim]] * world)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.dim, ctx.pg = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        with B.label("parallel.all_gather_from_sequence backward"):
            return _ReduceScatterToSequence.apply(g, ctx.dim, ctx.pg), None, None

    @staticmethod
    def jvp(ctx: Any, t: Tensor, *_: Any) -> Tensor:
        world = _backend().world_size(ctx.pg)
        return C.all_gather(t, ctx.dim, ctx.pg, split_sizes=[t.shape[ctx.dim]] * world)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], x: Tensor, dim: int, pg: PG) -> tuple[Tensor, int]:
        return _AllGatherFromSequence.apply(_to_front(x, in_dims[0]), dim + 1, pg), 0


def all_gather_from_sequence(x: Tensor, dim: int = 0, group: A.GroupLike = None) -> Tensor:
    """Enter a tensor-parallel region from a sequence-parallel one: all_gather.

    Convention (replicated objective): rank ``r`` holds sequence chunk ``r``; the full
    sequence is then consumed *differently* on each rank (e.g. by its column shard of a
    weight), and the loss is the same on every rank.

    Args:
        x: this rank's sequence chunk; same shape on every rank.
        dim: the sequence dimension (default 0, Megatron's ``[s, b, h]`` layout).
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.

    Returns:
        A new tensor: ``x.shape`` with ``dim`` of size ``world * x.shape[dim]``.

    Gradient:
        ``reduce_scatter(grad, dim, "sum")``: every rank's consumer contributed a partial
        gradient for the whole sequence; rank ``r`` gets the sum for its chunk. This is
        the core all_gather's adjoint (debug mode checks shapes only). If instead the
        gathered sequence is consumed identically on every rank, use
        :func:`gather_from_region` (keep-own-chunk backward).

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: parallel.all_gather_from_sequence(torch.tensor([1.0 * dc.get_rank()])))
            # [tensor([0., 1.]), tensor([0., 1.])]
    """
    x, pg, _, _ = _prepare("all_gather_from_sequence", x, group)
    dim = A.check_dim(x, dim, "parallel.all_gather_from_sequence")
    if _debug():
        _check_shape("all_gather_from_sequence", x, pg)
    return _AllGatherFromSequence.apply(x, dim, pg)


# ======================================================================================
# Ulysses: all_to_all_region
# ======================================================================================


class _AllToAllRegion(torch.autograd.Function):
    @staticmethod
    def forward(x: Tensor, split_dim: int, concat_dim: int, pg: PG) -> Tensor:
        with B.label("parallel.all_to_all_region"):
            return C.all_to_all(x, split_dim, concat_dim, pg)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.split_dim, ctx.concat_dim, ctx.pg = inputs[1], inputs[2], inputs[3]

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None, None]:
        with B.label("parallel.all_to_all_region backward"):
            return _AllToAllRegion.apply(g, ctx.concat_dim, ctx.split_dim, ctx.pg), None, None, None

    @staticmethod
    def jvp(ctx: Any, t: Tensor, *_: Any) -> Tensor:
        return C.all_to_all(t, ctx.split_dim, ctx.concat_dim, ctx.pg)

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[Any, ...], x: Tensor, split_dim: int, concat_dim: int, pg: PG
    ) -> tuple[Tensor, int]:
        xb = _to_front(x, in_dims[0])
        return _AllToAllRegion.apply(xb, split_dim + 1, concat_dim + 1, pg), 0


def all_to_all_region(x: Tensor, split_dim: int, concat_dim: int, group: A.GroupLike = None) -> Tensor:
    """Re-shard between two dimensions (Ulysses: sequence-sharded <-> head-sharded).

    Rank ``r`` sends chunk ``j`` of ``x`` along ``split_dim`` to rank ``j`` and
    concatenates what it receives along ``concat_dim``. Convention: neither side is
    replicated, so it is the core all_to_all (both conventions agree).

    Args:
        x: tensor, same shape on every rank; ``x.shape[split_dim]`` divisible by the group
            size.
        split_dim: the dimension that becomes sharded (e.g. heads).
        concat_dim: the dimension that stops being sharded (e.g. sequence).
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.

    Returns:
        A new tensor. ``split_dim != concat_dim``: ``x.shape`` with ``split_dim`` divided
        and ``concat_dim`` multiplied by ``world``; equal dims: ``x.shape``.

    Gradient:
        ``all_to_all(grad, split_dim=concat_dim, concat_dim=split_dim)`` (debug mode checks
        shapes, through the core op).

    Example::

        # sequence-sharded (s/2, heads) -> head-sharded (s, heads/2)
        with dc.LocalWorld(2) as world:
            world.run(lambda: parallel.all_to_all_region(torch.zeros(3, 4), 1, 0).shape)
            # [torch.Size([6, 2]), torch.Size([6, 2])]
    """
    x, pg, world, _ = _prepare("all_to_all_region", x, group)
    split_dim, _ = _even_dim("all_to_all_region", x, split_dim, world, "split_dim")
    concat_dim = A.check_dim(x, concat_dim, "parallel.all_to_all_region", "concat_dim")
    return _AllToAllRegion.apply(x, split_dim, concat_dim, pg)


# ======================================================================================
# copy_to_region / reduce_from_region for a list of tensors: one communication per dtype
# ======================================================================================


def _strip_ctx(args: tuple[Any, ...]) -> tuple[Any, ...]:
    # dynamo passes a ctx first to a nested no-grad apply of a ``*args`` forward
    return args[1:] if isinstance(args[0], torch.autograd.function.FunctionCtx) else args


class _CopyToRegionCoalesced(torch.autograd.Function):
    """Arguments ``(x0, pg, debug, *xs)``: identity forward of every tensor."""

    @staticmethod
    def forward(*args: Any) -> tuple[Tensor, ...]:
        x0, pg, debug, *rest = _strip_ctx(args)
        xs = (x0, *rest)
        if debug:
            for x in xs:
                check_replicated(x, "parallel.copy_to_region_coalesced", "an input", _COPY_HINT, pg)
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.pg, ctx.debug = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, *gs: Tensor) -> tuple[Any, ...]:
        with B.label("parallel.copy_to_region_coalesced backward"):
            out = _ReduceFromRegionCoalesced.apply(gs[0], ctx.pg, ctx.debug, *gs[1:])
        return (out[0], None, None, *out[1:])

    @staticmethod
    def jvp(ctx: Any, *ts: Any) -> tuple[Tensor, ...]:
        return tuple(t.view_as(t) for t in (ts[0], *ts[3:]))


class _ReduceFromRegionCoalesced(torch.autograd.Function):
    """Arguments ``(x0, pg, debug, *xs)``: one coalesced all_reduce(sum) forward,
    identity backward (checked replicated in debug mode)."""

    @staticmethod
    def forward(*args: Any) -> tuple[Tensor, ...]:
        x0, pg, _, *rest = _strip_ctx(args)
        with B.label("parallel.reduce_from_region_coalesced"):
            return tuple(all_reduce_coalesced([x0, *rest], "sum", pg))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.pg, ctx.debug = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, *gs: Tensor) -> tuple[Any, ...]:
        if ctx.debug or _debug():
            hint = _IDENTITY_HINT.format(
                name="reduce_from_region_coalesced", instead="diffcomm.all_reduce_coalesced"
            )
            for g in gs:
                check_replicated(
                    g, "parallel.reduce_from_region_coalesced backward", "an incoming gradient", hint, ctx.pg
                )
        out = _CopyToRegionCoalesced.apply(gs[0], ctx.pg, False, *gs[1:])
        return (out[0], None, None, *out[1:])

    @staticmethod
    def jvp(ctx: Any, *ts: Any) -> tuple[Tensor, ...]:
        return tuple(all_reduce_coalesced([ts[0], *ts[3:]], "sum", ctx.pg))


def _prepare_list(name: str, tensors: Any, group: A.GroupLike) -> tuple[list[Tensor], PG]:
    op = f"parallel.{name}"
    if isinstance(tensors, Tensor) or not isinstance(tensors, list | tuple) or not tensors:
        raise A.arg_error(
            op, "tensors", "a non-empty list or tuple of tensors", type(tensors).__name__, TypeError
        )
    ts = [A.check_tensor(t, op, f"tensors[{i}]") for i, t in enumerate(tensors)]
    for i, t in enumerate(ts):
        A.check_grad_dtype(t, op, f"tensors[{i}]")
    return ts, A.resolve_group(group, op)


def copy_to_region_coalesced(tensors: Sequence[Tensor], group: A.GroupLike = None) -> list[Tensor]:
    """:func:`copy_to_region` for a list of tensors: the backward is **one** coalesced
    all_reduce (one communication per dtype) instead of one per tensor.

    The tensor- and sequence-parallel layers use it for the replicated parameters whose
    gradients are per-rank partial sums (a sequence-parallel ``RowParallelLinear``'s
    bias, a :class:`~diffcomm.parallel.SequenceParallelLayerNorm`'s weight and bias): the
    outermost :class:`~diffcomm.parallel.ParallelModule` copies all of them into the
    region at the start of its forward, so a whole model step reduces them at once.

    Args:
        tensors: non-empty list or tuple of tensors, each equal on every rank.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.

    Returns:
        A list of views of the inputs (no copy), same shapes.

    Gradient:
        ``all_reduce_coalesced(grads, "sum")`` (through
        ``reduce_from_region_coalesced``, so double backward keeps the replicated
        objective). Debug mode checks that every input is equal on every rank.

    Example::

        with dc.LocalWorld(2) as world:
            def f():
                a, b = torch.ones(2, requires_grad=True), torch.ones((), requires_grad=True)
                a2, b2 = parallel.copy_to_region_coalesced([a, b])
                ((a2 + b2) * (dc.get_rank() + 1)).sum().backward()
                return a.grad, b.grad
            world.run(f)   # [(tensor([3., 3.]), tensor(6.)), ...]
    """
    ts, pg = _prepare_list("copy_to_region_coalesced", tensors, group)
    return list(_CopyToRegionCoalesced.apply(ts[0], pg, _debug(), *ts[1:]))


def reduce_from_region_coalesced(tensors: Sequence[Tensor], group: A.GroupLike = None) -> list[Tensor]:
    """:func:`reduce_from_region` for a list of tensors: one coalesced all_reduce(sum)
    forward (one communication per dtype), identity backward.

    Args:
        tensors: non-empty list or tuple of per-rank partial sums (same shapes and dtypes
            on every rank).
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.

    Returns:
        A list of new tensors: the sums over ranks, same shapes.

    Gradient:
        identity (replicated objective); debug mode checks that every incoming gradient is
        equal on every rank.

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: parallel.reduce_from_region_coalesced([torch.ones(2)]))
            # [[tensor([2., 2.])], [tensor([2., 2.])]]
    """
    ts, pg = _prepare_list("reduce_from_region_coalesced", tensors, group)
    return list(_ReduceFromRegionCoalesced.apply(ts[0], pg, _debug(), *ts[1:]))


#: mapping name -> (function, forward in words, backward in words); the docs' table.
MAPPINGS: dict[str, tuple[Any, str, str]] = {
    "copy_to_region": (copy_to_region, "identity", "all_reduce(sum)"),
    "reduce_from_region": (reduce_from_region, "all_reduce(sum)", "identity"),
    "scatter_to_region": (scatter_to_region, "keep own chunk", "all_gather"),
    "gather_from_region": (gather_from_region, "all_gather", "keep own chunk"),
    "reduce_scatter_to_sequence": (reduce_scatter_to_sequence, "reduce_scatter(sum)", "all_gather"),
    "all_gather_from_sequence": (all_gather_from_sequence, "all_gather", "reduce_scatter(sum)"),
    "all_to_all_region": (all_to_all_region, "all_to_all", "all_to_all, dims swapped"),
}
