"""``gather`` and ``scatter``, a dual pair: the rooted collectives along any dim, with
uneven per-rank sizes (given, or exchanged as host integers when not). Re-exported by
:mod:`diffcomm.ops.collectives` (their public home, with the op -> adjoint table).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from torch import Tensor

from .. import _config
from .._replication import PARTIAL, SHARES, Rule, T
from ..backend import args as A
from ..backend.args import PG
from . import references
from .base import CommOp, apply, call
from .base import movedim0 as _movedim0
from .registry import Kwargs
from .shared_args import shared_args
from .validation import check_input as _check_input
from .validation import current_backend as _b
from .validation import debug_check as _debug_check
from .validation import debug_check_input as _debug_check_input
from .validation import exchanged_split_sizes as _exchanged_split_sizes
from .validation import given_split_sizes as _given_split_sizes
from .validation import other_dims as _other_dims
from .validation import rank as _rank
from .validation import records_grad as _records_grad
from .validation import with_sizes as _with
from .validation import world as _world


class _Gather(CommOp):
    name = "gather"
    family = "collective"
    order = 40
    dims = (1,)
    forward_text = "concat on dst, zeros elsewhere"
    backward_text = "scatter from dst with the same split"
    spmd = Rule({T.V: T.V, T.R: T.V}, in_grad=PARTIAL, refuse={T.P: SHARES})

    @staticmethod
    def run(x: Tensor, dst: int, dim: int, pg: PG, split_sizes: tuple[int, ...]) -> Tensor:
        out = _b().gather(_movedim0(x, dim), dst, pg, split_sizes)
        return out if dim == 0 else out.movedim(0, dim)

    @staticmethod
    def transpose(g: Tensor, dst: int, dim: int, pg: PG, split_sizes: tuple[int, ...]) -> Tensor:
        return call(_Scatter, g, dst, dim, pg, split_sizes)

    @staticmethod
    def out_shape(x: Tensor, dst: int, dim: int, pg: PG, split_sizes: tuple[int, ...]) -> tuple[int, ...]:
        return _with(x.shape, {dim: sum(split_sizes)})

    reference = references.gather

    @staticmethod
    def dual_args(kw: Kwargs, world: int) -> tuple[Kwargs, float]:
        return {"src": kw.get("dst", 0), "dim": kw.get("dim", 0), "split_sizes": kw.get("split_sizes")}, 1.0

    @staticmethod
    def cases(world: int) -> Iterator[Kwargs]:
        yield {"shape": (2, 2), "kwargs": {"dst": world - 1, "dim": 1}}
        yield {"shape": (3, 2), "kwargs": {"dst": 0, "dim": 0}, "sizes": tuple(r + 1 for r in range(world))}


@shared_args
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
        async_op: {async_op}

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
    split_sizes, arg = A.renamed_sizes(split_sizes, sizes, "gather")
    if split_sizes is not None:
        split_sizes = _given_split_sizes(split_sizes, x, dim, pg, "gather", arg)
    if _config.DEBUG.get():
        rest = _other_dims(x, dim)
        _debug_check("gather", pg, dst=dst, dim=dim, other_dims=rest, dtype=x.dtype, grad=_records_grad(x))
    if split_sizes is None:
        split_sizes = _exchanged_split_sizes(x, dim, pg, "gather")
    return apply(_Gather, x, dst, dim, pg, tuple(split_sizes), async_op=async_op)


class _Scatter(CommOp):
    name = "scatter"
    family = "collective"
    order = 41
    dual = _Gather
    dims = (1,)
    forward_text = "chunk r of src's x"
    backward_text = "gather to src with the same split"
    spmd = Rule({T.R: T.V, T.V: T.V}, in_grad=PARTIAL, refuse={T.P: SHARES})

    @staticmethod
    def run(x: Tensor, src: int, dim: int, pg: PG, split_sizes: tuple[int, ...]) -> Tensor:
        out = _b().scatter(_movedim0(x, dim), src, pg, split_sizes)
        return out if dim == 0 else out.movedim(0, dim)

    @staticmethod
    def transpose(g: Tensor, src: int, dim: int, pg: PG, split_sizes: tuple[int, ...]) -> Tensor:
        return call(_Gather, g, src, dim, pg, split_sizes)

    @staticmethod
    def out_shape(x: Tensor, src: int, dim: int, pg: PG, split_sizes: tuple[int, ...]) -> tuple[int, ...]:
        return _with(x.shape, {dim: split_sizes[_rank(pg)]})

    reference = references.scatter

    @staticmethod
    def dual_args(kw: Kwargs, world: int) -> tuple[Kwargs, float]:
        return {"dst": kw.get("src", 0), "dim": kw.get("dim", 0), "split_sizes": kw.get("split_sizes")}, 1.0

    @staticmethod
    def cases(world: int) -> Iterator[Kwargs]:
        uneven = [r + 1 for r in range(world)]
        yield {"shape": (world, 3), "kwargs": {"src": 0, "dim": 0}}
        yield {"shape": (2, sum(uneven)), "kwargs": {"src": world - 1, "dim": 1, "split_sizes": uneven}}


@shared_args
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
        async_op: {async_op}

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
    split_sizes = A.check_split_sizes(split_sizes, x.shape[dim], world, "scatter")
    _debug_check_input("scatter", pg, x, src=src, dim=dim, split_sizes=split_sizes)
    return apply(_Scatter, x, src, dim, pg, tuple(split_sizes), async_op=async_op)
