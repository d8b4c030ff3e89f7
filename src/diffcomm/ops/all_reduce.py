"""``all_reduce``: self-adjoint for sum/avg; max/min/product are the linear sum composed
with an elementwise weight (``linearize`` / ``weight``), the product's weight zero-safe.
Re-exported by :mod:`diffcomm.ops.collectives` (the collectives' public home).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from .._config import DEBUG as _DEBUG
from .._replication import PARTIAL, TWICE, Rule, T
from ..backend import args as A
from ..backend.args import PG
from . import references
from .base import CommOp, apply, call, op_labels
from .precision_format import Precision, quantized
from .registry import SELF, Kwargs
from .shared_args import shared_args
from .validation import check_input as _check_input
from .validation import current_backend as _b
from .validation import debug_check_input as _debug_check_input

_LABELS = op_labels("all_reduce")


class _AllReduce(CommOp):
    """Self-adjoint for sum/avg; max/min/product are the sum composed with a weight."""

    name = "all_reduce"
    family = "collective"
    order = 10
    dual = SELF
    elementwise = True
    forward_text = "op over ranks, on every rank"
    backward_text = "all_reduce of grads (max/min: to arg-extreme ranks, ties split; product: zero-safe)"
    spmd = Rule(
        {T.V: T.R, T.P: T.R},
        out_grad=PARTIAL,
        refuse={T.R: TWICE},
        no_grad=T.R,
        instead="parallel.reduce_from_region",
        nonlinear=Rule(
            {T.V: T.R},
            out_grad=PARTIAL,
            refuse={T.R: TWICE, T.P: "max/min/product of the shares is not that of the sum: reduce first"},
            no_grad=T.R,
        ),
    )

    @staticmethod
    def run(x: Tensor, op: str, pg: PG) -> Tensor:
        return _b().all_reduce(x, op, pg)

    @staticmethod
    def label(op: str, pg: PG) -> str:
        return _LABELS[op]

    @staticmethod
    def transpose(g: Tensor, op: str, pg: PG) -> Tensor:
        return call(_AllReduce, g, op, pg)

    @staticmethod
    def linearize(args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        return None if args[0] in A.LINEAR_OPS else ("sum", args[1])

    @staticmethod
    def weight(x: Tensor, y: Tensor, op: str, pg: PG) -> Tensor:
        return _nonlinear_weight(op, x, y, pg)

    @staticmethod
    def out_shape(x: Tensor, op: str, pg: PG) -> tuple[int, ...]:
        return tuple(x.shape)

    reference = references.all_reduce

    @staticmethod
    def dual_args(kw: Kwargs, world: int) -> tuple[Kwargs, float]:
        return {"op": kw.get("op", "sum")}, 1.0

    @staticmethod
    def cases(world: int) -> Iterator[Kwargs]:
        for rop in ("sum", "avg", "max", "min", "product"):
            yield {"shape": (3, 4), "kwargs": {"op": rop}, "ints": rop in ("max", "min", "product")}
        for dt in ("float32", "float16", "bfloat16", "complex128"):
            yield {"shape": (5,), "dtype": dt, "kwargs": {"op": "sum"}, "ints": dt in ("float16", "bfloat16")}
        yield {"shape": (5,), "dtype": "complex64", "kwargs": {"op": "product"}, "ints": True}
        yield {"shape": (4,), "dtype": "int64", "kwargs": {"op": "sum"}, "ints": True}


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


@shared_args
def all_reduce(
    x: Tensor,
    op: Any = "sum",
    group: A.GroupLike = None,
    *,
    async_op: bool = False,
    precision: Precision | None = None,
) -> Tensor:
    """Reduce ``x`` over the ranks of ``group``; every rank gets the result.

    Args:
        x: tensor of the same shape and dtype on every rank.
        op: ``"sum"``, ``"avg"``, ``"max"``, ``"min"``, ``"product"`` (any case) or a
            ``torch.distributed.ReduceOp``. ``max``/``min`` need a real dtype; ``avg`` a
            floating or complex one.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        async_op: {async_op}
        precision: a :class:`~diffcomm.Precision` (wire dtype, accumulation dtype,
            fp8 block size, backward settings; sum/avg only): quantized contributions,
            summed in the accumulation dtype, rounded once (``docs/precision.md``).

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
    if precision is not None:
        return quantized("all_reduce")(x, op, group, precision, async_op)
    x = _check_input(x, "all_reduce")
    op_name = A.normalize_op(op, "all_reduce", x)
    pg = A.resolve_group(group, "all_reduce")
    if _DEBUG.value if _DEBUG.loaded else _DEBUG.get():  # inline: no call, no kwargs, when off
        _debug_check_input("all_reduce", pg, x, op=op_name)
    return apply(_AllReduce, x, op_name, pg, async_op=async_op)
