"""``copy_to_region`` / ``reduce_from_region`` for a list of tensors: one communication
per dtype (public as :func:`diffcomm.parallel.mappings.copy_to_region_coalesced` and
:func:`diffcomm.parallel.mappings.reduce_from_region_coalesced`).

Both stand on :class:`~diffcomm.ops.base.ListOp`, the list form of the op base (as the
coalesced collectives of :mod:`diffcomm.ops.coalesced`): each states its raw forward over the
whole list and its transpose, the other one of the pair (one ``all_reduce_coalesced`` of
the gradients, or their identity), so double backward keeps the replicated objective;
the base writes backward, jvp, vmap, the cheap ``apply`` and the compile twin.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from .. import _config
from .._replication import PARTIAL, REPLICATED, TWICE, P, R, Rule, V
from ..backend import args as A
from ..backend.args import PG
from ..ops import coalesced
from ..ops.base import ListOp, apply, call, list_args
from ._check import COPY_HINT, IDENTITY_HINT, check_replicated

__all__ = ["copy_to_region_coalesced", "reduce_from_region_coalesced"]


def _debug() -> bool:
    return bool(_config.DEBUG.get())


class _CopyToRegionCoalesced(ListOp):
    """Identity forward of every tensor (views); transpose: reduce_from_region_coalesced."""

    name = "parallel.copy_to_region_coalesced"
    nmeta = 2  # pg, debug
    same_shapes = True
    spmd = Rule(
        {R: R},
        out_grad=PARTIAL,
        in_grad=REPLICATED,
        backward="all_reduce_coalesced",
        refuse={V: "a varying value needs no copy into the region", P: "reduce it first"},
    )

    @staticmethod
    def run(xs: Sequence[Tensor], pg: PG, debug: bool) -> tuple[Tensor, ...]:
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def transpose(ctx: Any, gs: list[Tensor], idx: list[int], pg: PG, debug: bool) -> Any:
        return call(_ReduceFromRegionCoalesced, *list_args(gs, pg, debug))


class _ReduceFromRegionCoalesced(ListOp):
    """One coalesced all_reduce(sum) forward (one call per dtype); transpose:
    copy_to_region_coalesced (identity, every gradient checked replicated in debug mode)."""

    name = "parallel.reduce_from_region_coalesced"
    nmeta = 2  # pg, debug
    same_shapes = True
    spmd = Rule({V: R, P: R}, out_grad=REPLICATED, refuse={R: TWICE}, backward="identity")

    @staticmethod
    def run(xs: Sequence[Tensor], pg: PG, debug: bool) -> Any:
        return coalesced.raw_all_reduce_coalesced(xs, "sum", pg)

    @staticmethod
    def transpose(ctx: Any, gs: list[Tensor], idx: list[int], pg: PG, debug: bool) -> Any:
        if debug or _debug():
            hint = IDENTITY_HINT.format(
                name="reduce_from_region_coalesced", instead="diffcomm.all_reduce_coalesced"
            )
            for g in gs:
                check_replicated(
                    g, "parallel.reduce_from_region_coalesced backward", "an incoming gradient", hint, pg
                )
        return call(_CopyToRegionCoalesced, *list_args(gs, pg, False))


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
    debug = _debug()
    if debug:
        for x in ts:
            check_replicated(x, "parallel.copy_to_region_coalesced", "an input", COPY_HINT, pg)
    return list(apply(_CopyToRegionCoalesced, *list_args(ts, pg, debug)))


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
    debug = _debug()
    if debug:
        coalesced.check_lists_consistent("parallel.reduce_from_region_coalesced", pg, ts)
    return list(apply(_ReduceFromRegionCoalesced, *list_args(ts, pg, debug)))
