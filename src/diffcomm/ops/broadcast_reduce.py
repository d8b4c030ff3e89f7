"""``broadcast`` and ``reduce``, a dual pair (``reduce`` with max/min/product is composed
from :mod:`~diffcomm.ops.all_reduce`). Re-exported by :mod:`diffcomm.ops.collectives`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import Tensor

from .._config import DEBUG as _DEBUG
from .._replication import PARTIAL, SHARES, TWICE, Rule, T
from ..backend import args as A
from ..backend.args import PG
from . import engine as _async
from . import references
from .all_reduce import _AllReduce
from .base import CommOp, apply, call, only_on, op_labels
from .registry import Kwargs
from .shared_args import shared_args
from .validation import check_input as _check_input
from .validation import current_backend as _b
from .validation import debug_check_input as _debug_check_input
from .validation import rank_is as _rank_is
from .validation import world as _world

_LABELS = op_labels("reduce")


class _Broadcast(CommOp):
    name = "broadcast"
    family = "collective"
    order = 20
    elementwise = True
    forward_text = "src's x on every rank"
    backward_text = "reduce(sum) to src; other ranks exact zeros"
    spmd = Rule(
        {T.R: T.R, T.V: T.R},
        out_grad=PARTIAL,
        in_grad=PARTIAL,
        refuse={T.P: SHARES},
    )

    @staticmethod
    def run(x: Tensor, src: int, pg: PG) -> Tensor:
        return _b().broadcast(x, src, pg)

    @staticmethod
    def transpose(g: Tensor, src: int, pg: PG) -> Tensor:
        return call(_Reduce, g, src, "sum", pg)

    @staticmethod
    def out_shape(x: Tensor, src: int, pg: PG) -> tuple[int, ...]:
        return tuple(x.shape)

    reference = references.broadcast

    @staticmethod
    def dual_args(kw: Kwargs, world: int) -> tuple[Kwargs, float]:
        return {"dst": kw.get("src", 0)}, 1.0

    @staticmethod
    def cases(world: int) -> Iterator[Kwargs]:
        yield {"shape": (2, 3), "kwargs": {"src": world - 1}}


@shared_args
def broadcast(x: Tensor, src: int = 0, group: A.GroupLike = None, *, async_op: bool = False) -> Tensor:
    """Every rank gets rank ``src``'s ``x``.

    Args:
        x: tensor of the same shape and dtype on every rank (only ``src``'s values matter).
        src: group-local rank whose tensor is sent.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        async_op: {async_op}

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
    return apply(_Broadcast, x, src, pg, async_op=async_op)


class _Reduce(CommOp):
    """Linear reduce (sum/avg) to ``dst``; max/min/product are composed in :func:`reduce`."""

    name = "reduce"
    family = "collective"
    order = 21
    dual = _Broadcast
    elementwise = True
    forward_text = "op over ranks on dst, zeros elsewhere"
    backward_text = "broadcast from dst"
    spmd = Rule({T.V: T.V, T.P: T.V}, refuse={T.R: TWICE})

    @staticmethod
    def run(x: Tensor, dst: int, op: str, pg: PG) -> Tensor:
        return _b().reduce(x, dst, op, pg)

    @staticmethod
    def label(dst: int, op: str, pg: PG) -> str:
        return _LABELS[op]

    @staticmethod
    def transpose(g: Tensor, dst: int, op: str, pg: PG) -> Tensor:
        out = call(_Broadcast, g, dst, pg)
        return out / _world(pg) if op == "avg" else out

    @staticmethod
    def out_shape(x: Tensor, dst: int, op: str, pg: PG) -> tuple[int, ...]:
        return tuple(x.shape)

    reference = references.reduce

    @staticmethod
    def dual_args(kw: Kwargs, world: int) -> tuple[Kwargs, float]:
        return {"src": kw.get("dst", 0)}, references.avg_scale(kw, world)

    @staticmethod
    def cases(world: int) -> Iterator[Kwargs]:
        for rop in ("sum", "avg", "max", "product"):
            yield {"shape": (2, 3), "kwargs": {"dst": world // 2, "op": rop}, "ints": rop != "sum"}


@shared_args
def reduce(
    x: Tensor, dst: int = 0, op: Any = "sum", group: A.GroupLike = None, *, async_op: bool = False
) -> Tensor:
    """Reduce ``x`` over ranks onto ``dst``; other ranks get zeros of the same shape.

    Args:
        x: tensor of the same shape and dtype on every rank.
        dst: group-local rank that receives the reduction.
        op: reduce op as for :func:`all_reduce`.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        async_op: {async_op}

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
    if op_name in A.LINEAR_OPS:
        return apply(_Reduce, x, dst, op_name, pg, async_op=async_op)
    # max/min/product: every rank needs the extreme/product for its gradient anyway
    y = apply(_AllReduce, x, op_name, pg, async_op=async_op)
    keep = _rank_is(pg, dst, y.device)
    if isinstance(y, _async.AsyncTensor):  # the mask runs after the all_reduce, on the engine:
        # an AsyncTensor as every asynchronous op's (it returned a plain tensor, no .wait())
        mask = lambda t: only_on(t, keep)  # (the value and its gradient alike)
        return _async.launch(y, f"reduce({op_name})", mask, y.shape, mask, private=True)
    return only_on(y, keep)
