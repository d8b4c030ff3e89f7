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
communication), its ``torch.autograd.Function`` (``forward`` / ``setup_context`` /
``backward`` / ``jvp`` / ``vmap``). Linear ops share one forward-mode rule (the tangent
goes through the same op) and one batching rule shape (move the batch dim out of the way,
call the op once for the whole batch).

Rules that keep the SPMD program deadlock-free: backward rules never branch on
rank-local facts that could differ between ranks, and only call public diffcomm ops
(never raw backend calls), so every rank runs the same collectives in backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from . import _args as A
from . import _config
from . import backend as B

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
        _b().check_consistent(opname, fields, pg)  # type: ignore[attr-defined]


def _check_input(x: Any, op: str) -> Tensor:
    x = A.check_tensor(x, op, "x")
    A.check_grad_dtype(x, op, "x")
    return x


def _movedim0(x: Tensor, dim: int) -> Tensor:
    return x if dim == 0 else x.movedim(dim, 0)


def _batched(x: Tensor, bdim: int | None) -> Tensor:
    """Move the vmap batch dim to the front (every rule below puts it at 0)."""
    return x if bdim is None or bdim == 0 else x.movedim(bdim, 0)


def _fn(fn_cls: Any) -> Any:
    """The autograd Function a public op applies: ``fn_cls``, or while ``torch.compile``
    traces, its twin without the custom ``jvp`` (see :func:`_jvp_free_twin`)."""
    if not torch.compiler.is_compiling():
        return fn_cls
    if not _only_grad_transforms():
        raise RuntimeError(
            "diffcomm: torch.func.jvp / jvp-based transforms (jacfwd, forward_ad) and vmap "
            "cannot run inside a torch.compile'd function: dynamo ignores a custom "
            "autograd.Function's jvp and vmap rules and traces its forward instead, which "
            "would give wrong tangents and unbatched collectives. Apply the transform outside "
            "the compiled function, or leave that function uncompiled "
            "(torch.func.grad / vjp inside torch.compile are fine)."
        )
    return fn_cls._compiled()


def _only_grad_transforms() -> bool:
    """No forward-AD level and no functorch transform, or a single ``grad``/``vjp`` level,
    is active (traceable).

    Levels count from 1 at the outermost transform, so a grad at level 1 is alone.
    (Dynamo can read the top level's kind and number, not walk the stack below it.)
    """
    if torch.autograd.forward_ad._current_level >= 0:  # inside fwAD.dual_level()
        return False
    if not torch._C._are_functorch_transforms_active():
        return True
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import coerce_cinterpreter

    level = coerce_cinterpreter(torch._C._functorch.peek_interpreter_stack())
    return level.key() == TransformType.Grad and level.level() == 1


class _Collective(torch.autograd.Function):
    """Base of the collectives' autograd Functions: a cheaper ``apply`` in plain eager mode.

    ``torch.autograd.Function.apply`` binds default arguments with ``inspect.signature``
    on every call (tens of microseconds). Our ``forward``s are always called with every
    argument positionally, so in eager mode without torch.func transforms we go straight
    to the C++ ``apply``; under transforms or torch.compile the full path is used.
    """

    @classmethod
    @torch.compiler.disable  # dynamo must never trace this frame (see below)
    def apply(cls, *args: Any) -> Any:  # type: ignore[override]
        # Inside a traced frame dynamo handles ``X.apply(...)`` itself and never runs this
        # method. It only enters it as a frame of its own when eager code runs under an
        # active torch.compile (after a graph break), and it cannot trace ``super().apply``
        # ("AutogradFunctionVariable() is not a constant"): so run it eagerly (~1 us).
        if torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling():
            return super().apply(*args)
        return super(torch.autograd.Function, cls).apply(*_unwrap_dead(args))


def _unwrap_dead(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """What ``Function.apply`` does for tensors that escaped a torch.func transform; every
    collective's only tensor argument is its first."""
    return (_unwrap_if_dead(args[0]), *args[1:])


try:
    from torch._C._functorch import unwrap_if_dead as _unwrap_if_dead
except ImportError:  # pragma: no cover - older torch

    def _unwrap_if_dead(t: Any) -> Any:
        from torch._functorch.utils import unwrap_dead_wrappers

        return unwrap_dead_wrappers((t,))[0]


# ======================================================================================
# all_reduce
# ======================================================================================


class _AllReduce(_Collective):
    @staticmethod
    def forward(x: Tensor, op: str, pg: PG) -> Tensor:
        with B.label(f"all_reduce({op})"):
            return _b().all_reduce(x, op, pg)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        x, op, pg = inputs
        ctx.op, ctx.pg = op, pg
        if op in ("max", "min", "product"):
            ctx.save_for_backward(x, output)
            ctx.save_for_forward(x, output)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, None, None]:
        op, pg = ctx.op, ctx.pg
        with B.label(f"all_reduce({op}) backward"):
            if op in ("sum", "avg"):
                return all_reduce(g, op, pg), None, None
            x, y = ctx.saved_tensors
            g_total = all_reduce(g, "sum", pg)
            return g_total * _nonlinear_weight(op, x, y, pg).conj(), None, None

    @staticmethod
    def jvp(ctx: Any, t: Tensor, *_: Any) -> Tensor:
        op, pg = ctx.op, ctx.pg
        if op in ("sum", "avg"):
            return _AllReduce.apply(t, op, pg)
        x, y = ctx.saved_tensors
        return _AllReduce.apply(t * _nonlinear_weight(op, x, y, pg), "sum", pg)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], x: Tensor, op: str, pg: PG) -> tuple[Tensor, int]:
        # elementwise over ranks: the batch dim is just another dim, one collective
        return _AllReduce.apply(x, op, pg), in_dims[0]


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
    xs = all_gather(x.unsqueeze(0), 0, pg, sizes=[1] * world)
    return xs[:rank].prod(0) * xs[rank + 1 :].prod(0)


def all_reduce(x: Tensor, op: Any = "sum", group: A.GroupLike = None) -> Tensor:
    """Reduce ``x`` over the ranks of ``group``; every rank gets the result.

    Args:
        x: tensor of the same shape and dtype on every rank.
        op: ``"sum"``, ``"avg"``, ``"max"``, ``"min"``, ``"product"`` (any case) or a
            ``torch.distributed.ReduceOp``. ``max``/``min`` need a real dtype; ``avg`` a
            floating or complex one.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.

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
    return _fn(_AllReduce).apply(x, op_name, pg)


# ======================================================================================
# broadcast / reduce (a dual pair)
# ======================================================================================


class _Broadcast(_Collective):
    @staticmethod
    def forward(x: Tensor, src: int, pg: PG) -> Tensor:
        with B.label("broadcast"):
            return _b().broadcast(x, src, pg)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.src, ctx.pg = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        with B.label("broadcast backward"):
            return _Reduce.apply(g, ctx.src, "sum", ctx.pg), None, None

    @staticmethod
    def jvp(ctx: Any, t: Tensor, *_: Any) -> Tensor:
        return _Broadcast.apply(t, ctx.src, ctx.pg)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], x: Tensor, src: int, pg: PG) -> tuple[Tensor, int]:
        return _Broadcast.apply(x, src, pg), in_dims[0]


def broadcast(x: Tensor, src: int = 0, group: A.GroupLike = None) -> Tensor:
    """Every rank gets rank ``src``'s ``x``.

    Args:
        x: tensor of the same shape and dtype on every rank (only ``src``'s values matter).
        src: group-local rank whose tensor is sent.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.

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
    return _fn(_Broadcast).apply(x, src, pg)


class _Reduce(_Collective):
    """Linear reduce (sum/avg) to ``dst``; max/min/product are composed in :func:`reduce`."""

    @staticmethod
    def forward(x: Tensor, dst: int, op: str, pg: PG) -> Tensor:
        with B.label(f"reduce({op})"):
            return _b().reduce(x, dst, op, pg)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.dst, ctx.op, ctx.pg = inputs[1], inputs[2], inputs[3]

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None, None]:
        with B.label(f"reduce({ctx.op}) backward"):
            out = _Broadcast.apply(g, ctx.dst, ctx.pg)
            if ctx.op == "avg":
                out = out / _world(ctx.pg)
            return out, None, None, None

    @staticmethod
    def jvp(ctx: Any, t: Tensor, *_: Any) -> Tensor:
        return _Reduce.apply(t, ctx.dst, ctx.op, ctx.pg)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], x: Tensor, dst: int, op: str, pg: PG) -> tuple[Tensor, int]:
        return _Reduce.apply(x, dst, op, pg), in_dims[0]


def _only_on(x: Tensor, keep: bool) -> Tensor:
    """``x`` where ``keep`` else exact zeros — still connected to ``x``'s graph, so the
    backward of whatever produced ``x`` runs on every rank (the SPMD rule)."""
    return torch.where(
        torch.tensor(keep, device=x.device), x, torch.zeros((), dtype=x.dtype, device=x.device)
    )


def reduce(x: Tensor, dst: int = 0, op: Any = "sum", group: A.GroupLike = None) -> Tensor:
    """Reduce ``x`` over ranks onto ``dst``; other ranks get zeros of the same shape.

    Args:
        x: tensor of the same shape and dtype on every rank.
        dst: group-local rank that receives the reduction.
        op: reduce op as for :func:`all_reduce`.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.

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
    if op_name in A.LINEAR_OPS:
        return _fn(_Reduce).apply(x, dst, op_name, pg)
    # max/min/product: every rank needs the extreme/product for its gradient anyway
    return _only_on(_fn(_AllReduce).apply(x, op_name, pg), _rank(pg) == dst)


# ======================================================================================
# all_gather / reduce_scatter (a dual pair)
# ======================================================================================


class _AllGather(_Collective):
    @staticmethod
    def forward(x: Tensor, dim: int, pg: PG, sizes: tuple[int, ...]) -> Tensor:
        with B.label("all_gather"):
            out = _b().all_gather(_movedim0(x, dim), pg, sizes)
        return out if dim == 0 else out.movedim(0, dim)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.dim, ctx.pg, ctx.sizes = inputs[1], inputs[2], inputs[3]

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None, None]:
        with B.label("all_gather backward"):
            return _ReduceScatter.apply(g, ctx.dim, "sum", ctx.pg, ctx.sizes), None, None, None

    @staticmethod
    def jvp(ctx: Any, t: Tensor, *_: Any) -> Tensor:
        return _AllGather.apply(t, ctx.dim, ctx.pg, ctx.sizes)

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[Any, ...], x: Tensor, dim: int, pg: PG, sizes: tuple[int, ...]
    ) -> tuple[Tensor, int]:
        return _AllGather.apply(_batched(x, in_dims[0]), dim + 1, pg, sizes), 0


def all_gather(
    x: Tensor, dim: int = 0, group: A.GroupLike = None, *, sizes: Sequence[int] | None = None
) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim``; every rank gets the result.

    Args:
        x: tensor; shapes agree between ranks except along ``dim``, where they may differ.
        dim: the dimension to concatenate along.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        sizes: keyword-only; every rank's ``x.shape[dim]`` if already known. Without it the
            sizes are exchanged first (one tiny all_gather), so uneven sizes just work.

    Returns:
        A new tensor: ``x.shape`` with ``dim`` of size ``sum(sizes)``; rank ``r``'s block
        sits at ``sum(sizes[:r])``.

    Gradient:
        ``reduce_scatter(grad, dim, op="sum", split_sizes=sizes)``: each rank gets the sum
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
    if sizes is not None:
        sizes = A.check_split_sizes(sizes, sum(int(s) for s in sizes), world, "all_gather", "sizes")
        if sizes[_rank(pg)] != x.shape[dim]:
            raise A.arg_error(
                "all_gather", "sizes", f"to list x.shape[{dim}]={x.shape[dim]} at this rank's position", sizes
            )
    rest = tuple(s for i, s in enumerate(x.shape) if i != dim)
    _debug_check("all_gather", pg, dim=dim, other_dims=rest, dtype=x.dtype, grad=x.requires_grad)
    if sizes is None:
        with B.label("all_gather (size exchange)"):
            sizes = _b().exchange_sizes(x.shape[dim], pg)
    return _fn(_AllGather).apply(x, dim, pg, tuple(sizes))


class _ReduceScatter(_Collective):
    """Linear reduce_scatter (sum/avg); max/min/product are composed in :func:`reduce_scatter`."""

    @staticmethod
    def forward(x: Tensor, dim: int, op: str, pg: PG, sizes: tuple[int, ...]) -> Tensor:
        with B.label(f"reduce_scatter({op})"):
            out = _b().reduce_scatter(_movedim0(x, dim), op, pg, sizes)
        return out if dim == 0 else out.movedim(0, dim)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.dim, ctx.op, ctx.pg, ctx.sizes = inputs[1], inputs[2], inputs[3], inputs[4]

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None, None, None]:
        with B.label(f"reduce_scatter({ctx.op}) backward"):
            out = _AllGather.apply(g, ctx.dim, ctx.pg, ctx.sizes)
            if ctx.op == "avg":
                out = out / _world(ctx.pg)
            return out, None, None, None, None

    @staticmethod
    def jvp(ctx: Any, t: Tensor, *_: Any) -> Tensor:
        return _ReduceScatter.apply(t, ctx.dim, ctx.op, ctx.pg, ctx.sizes)

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[Any, ...], x: Tensor, dim: int, op: str, pg: PG, sizes: tuple[int, ...]
    ) -> tuple[Tensor, int]:
        return _ReduceScatter.apply(_batched(x, in_dims[0]), dim + 1, op, pg, sizes), 0


def reduce_scatter(
    x: Tensor,
    dim: int = 0,
    op: Any = "sum",
    group: A.GroupLike = None,
    split_sizes: Sequence[int] | None = None,
) -> Tensor:
    """Reduce ``x`` over ranks and give rank ``r`` chunk ``r`` of the result along ``dim``.

    Args:
        x: tensor of the same shape and dtype on every rank.
        dim: the dimension to split.
        op: reduce op as for :func:`all_reduce`.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        split_sizes: per-rank chunk sizes along ``dim`` (summing to ``x.shape[dim]``);
            ``None`` splits evenly (then ``x.shape[dim]`` must divide by the group size).

    Returns:
        A new tensor: ``x.shape`` with ``dim`` of size ``split_sizes[rank]``.

    Gradient:
        ``all_gather(grad, dim, sizes=split_sizes)`` (divided by the world size for avg;
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
    if op_name in A.LINEAR_OPS:
        return _fn(_ReduceScatter).apply(x, dim, op_name, pg, tuple(sizes))
    full = _fn(_AllReduce).apply(x, op_name, pg)
    return full.narrow(dim, sum(sizes[:rank]), sizes[rank])


# ======================================================================================
# gather / scatter (a dual pair)
# ======================================================================================


class _Gather(_Collective):
    @staticmethod
    def forward(x: Tensor, dst: int, dim: int, pg: PG, sizes: tuple[int, ...]) -> Tensor:
        with B.label("gather"):
            out = _b().gather(_movedim0(x, dim), dst, pg, sizes)
        return out if dim == 0 else out.movedim(0, dim)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.dst, ctx.dim, ctx.pg, ctx.sizes = inputs[1], inputs[2], inputs[3], inputs[4]

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None, None, None]:
        with B.label("gather backward"):
            return _Scatter.apply(g, ctx.dst, ctx.dim, ctx.pg, ctx.sizes), None, None, None, None

    @staticmethod
    def jvp(ctx: Any, t: Tensor, *_: Any) -> Tensor:
        return _Gather.apply(t, ctx.dst, ctx.dim, ctx.pg, ctx.sizes)

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[Any, ...], x: Tensor, dst: int, dim: int, pg: PG, sizes: tuple[int, ...]
    ) -> tuple[Tensor, int]:
        return _Gather.apply(_batched(x, in_dims[0]), dst, dim + 1, pg, sizes), 0


def gather(
    x: Tensor,
    dst: int = 0,
    dim: int = 0,
    group: A.GroupLike = None,
    *,
    sizes: Sequence[int] | None = None,
) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim`` on ``dst``; zeros elsewhere.

    Args:
        x: tensor; shapes agree between ranks except along ``dim``.
        dst: group-local rank that receives the concatenation.
        dim: the dimension to concatenate along.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        sizes: keyword-only; every rank's ``x.shape[dim]`` if known (else exchanged).

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
    if sizes is not None:
        sizes = A.check_split_sizes(sizes, sum(int(s) for s in sizes), world, "gather", "sizes")
        if sizes[_rank(pg)] != x.shape[dim]:
            raise A.arg_error("gather", "sizes", f"to list x.shape[{dim}]={x.shape[dim]} at this rank", sizes)
    rest = tuple(s for i, s in enumerate(x.shape) if i != dim)
    _debug_check("gather", pg, dst=dst, dim=dim, other_dims=rest, dtype=x.dtype, grad=x.requires_grad)
    if sizes is None:
        with B.label("gather (size exchange)"):
            sizes = _b().exchange_sizes(x.shape[dim], pg)
    return _fn(_Gather).apply(x, dst, dim, pg, tuple(sizes))


class _Scatter(_Collective):
    @staticmethod
    def forward(x: Tensor, src: int, dim: int, pg: PG, sizes: tuple[int, ...]) -> Tensor:
        with B.label("scatter"):
            out = _b().scatter(_movedim0(x, dim), src, pg, sizes)
        return out if dim == 0 else out.movedim(0, dim)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.src, ctx.dim, ctx.pg, ctx.sizes = inputs[1], inputs[2], inputs[3], inputs[4]

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None, None, None]:
        with B.label("scatter backward"):
            return _Gather.apply(g, ctx.src, ctx.dim, ctx.pg, ctx.sizes), None, None, None, None

    @staticmethod
    def jvp(ctx: Any, t: Tensor, *_: Any) -> Tensor:
        return _Scatter.apply(t, ctx.src, ctx.dim, ctx.pg, ctx.sizes)

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[Any, ...], x: Tensor, src: int, dim: int, pg: PG, sizes: tuple[int, ...]
    ) -> tuple[Tensor, int]:
        return _Scatter.apply(_batched(x, in_dims[0]), src, dim + 1, pg, sizes), 0


def scatter(
    x: Tensor,
    src: int = 0,
    dim: int = 0,
    group: A.GroupLike = None,
    split_sizes: Sequence[int] | None = None,
) -> Tensor:
    """Give rank ``r`` chunk ``r`` (along ``dim``) of rank ``src``'s ``x``.

    Args:
        x: tensor of the same shape on every rank; only ``src``'s values are used (the
            others pass a same-shape placeholder, whose gradient is zero).
        src: group-local rank whose tensor is split.
        dim: the dimension to split.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        split_sizes: per-rank chunk sizes along ``dim``; ``None`` splits evenly.

    Returns:
        A new tensor: ``x.shape`` with ``dim`` of size ``split_sizes[rank]``.

    Gradient:
        ``gather(grad, dst=src, dim, sizes=split_sizes)``: ``src`` gets every rank's chunk
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
    return _fn(_Scatter).apply(x, src, dim, pg, tuple(sizes))


# ======================================================================================
# all_to_all (self-dual with dims and splits swapped)
# ======================================================================================


class _AllToAll(_Collective):
    @staticmethod
    def forward(
        x: Tensor, split_dim: int, concat_dim: int, pg: PG, ins: tuple[int, ...], outs: tuple[int, ...]
    ) -> Tensor:
        with B.label("all_to_all"):
            return _all_to_all_raw(x, split_dim, concat_dim, pg, ins, outs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _, ctx.split_dim, ctx.concat_dim, ctx.pg, ctx.ins, ctx.outs = inputs

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None, None, None, None]:
        with B.label("all_to_all backward"):
            gx = _AllToAll.apply(g, ctx.concat_dim, ctx.split_dim, ctx.pg, ctx.outs, ctx.ins)
        return gx, None, None, None, None, None

    @staticmethod
    def jvp(ctx: Any, t: Tensor, *_: Any) -> Tensor:
        return _AllToAll.apply(t, ctx.split_dim, ctx.concat_dim, ctx.pg, ctx.ins, ctx.outs)

    @staticmethod
    def vmap(
        info: Any,
        in_dims: tuple[Any, ...],
        x: Tensor,
        split_dim: int,
        concat_dim: int,
        pg: PG,
        ins: tuple[int, ...],
        outs: tuple[int, ...],
    ) -> tuple[Tensor, int]:
        xb = _batched(x, in_dims[0])
        return _AllToAll.apply(xb, split_dim + 1, concat_dim + 1, pg, ins, outs), 0


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
            sent = torch.tensor(ins, dtype=torch.int64, device=B._comm_device(pg))
            outs = _b().all_to_all(sent, pg, [1] * world, [1] * world).tolist()
    return _fn(_AllToAll).apply(x, split_dim, concat_dim, pg, tuple(ins), tuple(int(o) for o in outs))


# ======================================================================================
# torch.compile: jvp-free twins
# ======================================================================================


def _jvp_free_twin(fn_cls: Any) -> Any:
    """``fn_cls`` with ``jvp`` reset to torch's default, reachable as ``fn_cls._compiled()``.

    Dynamo refuses to trace an autograd.Function that defines a custom ``jvp``
    ("Unsupported custom jvp"). A compiled graph needs only forward and backward, so while
    compiling, the public ops apply this twin (same forward / setup_context / backward /
    vmap). Backward rules keep applying the originals: dynamo traces them without grad,
    where the check does not apply. (A staticmethod, because dynamo can call one on an
    autograd.Function class but cannot look a class up in a dict or compare it.)
    """
    twin = type(f"{fn_cls.__name__}Traced", (fn_cls,), {"jvp": staticmethod(torch.autograd.Function.jvp)})
    fn_cls._compiled = staticmethod(lambda: twin)
    return twin


for _cls in (_AllReduce, _Broadcast, _Reduce, _AllGather, _ReduceScatter, _Gather, _Scatter, _AllToAll):
    _jvp_free_twin(_cls)


# ======================================================================================
# the op -> adjoint table
# ======================================================================================


@dataclass(frozen=True)
class OpSpec:
    """One collective: its public function, its adjoint's name and the rule in words."""

    name: str
    fn: Any
    dual: str
    forward: str
    backward: str


OPS: dict[str, OpSpec] = {
    s.name: s
    for s in (
        OpSpec(
            "all_reduce",
            all_reduce,
            "all_reduce",
            "op over ranks, on every rank",
            "all_reduce of grads (max/min: to arg-extreme ranks, ties split; product: zero-safe)",
        ),
        OpSpec(
            "broadcast",
            broadcast,
            "reduce",
            "src's x on every rank",
            "reduce(sum) to src; other ranks exact zeros",
        ),
        OpSpec("reduce", reduce, "broadcast", "op over ranks on dst, zeros elsewhere", "broadcast from dst"),
        OpSpec(
            "all_gather",
            all_gather,
            "reduce_scatter",
            "concat of every rank's x along dim",
            "reduce_scatter(sum) with the same split",
        ),
        OpSpec(
            "reduce_scatter",
            reduce_scatter,
            "all_gather",
            "chunk r of the reduction",
            "all_gather with the same split",
        ),
        OpSpec(
            "gather",
            gather,
            "scatter",
            "concat on dst, zeros elsewhere",
            "scatter from dst with the same split",
        ),
        OpSpec("scatter", scatter, "gather", "chunk r of src's x", "gather to src with the same split"),
        OpSpec(
            "all_to_all",
            all_to_all,
            "all_to_all",
            "chunk r of every rank's x, concatenated",
            "all_to_all with dims and split sizes swapped",
        ),
    )
}

#: op name -> name of its adjoint (the table the tests walk and the docs are built from).
DUALS: dict[str, str] = {name: spec.dual for name, spec in OPS.items()}


def dual(op: str) -> str:
    """Name of the adjoint of collective ``op`` (``dual(dual(op)) == op``)."""
    if op not in DUALS:
        raise ValueError(f"diffcomm.dual(): unknown op {op!r}; known: {sorted(DUALS)}")
    return DUALS[op]


def duals_markdown() -> str:
    """The op -> adjoint table as Markdown (the docs include this)."""
    lines = ["| op | forward (rank r) | adjoint | backward rule |", "|---|---|---|---|"]
    for s in OPS.values():
        lines.append(f"| `{s.name}` | {s.forward} | `{s.dual}` | {s.backward} |")
    return "\n".join(lines)
