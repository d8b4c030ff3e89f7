"""The ``diffcomm.parallel`` mappings with ``precision=`` (``docs/precision.md``).

Each mapping keeps its replicated-objective meaning (``docs/parallel.md``); the
communicating side(s) run the quantized collective of :mod:`diffcomm.ops.precision`:
the forward's communication with the :class:`~diffcomm.Precision`'s forward settings,
the backward's with its ``backward`` settings (``copy_to_region``: identity forward, so
only its backward all_reduce is quantized, with the backward settings). Local sides
(identity, keep own chunk) are exact. The backward is the conjugate quantized mapping,
so double backward uses the forward settings again.

Not done yet: debug mode's run-time checks of the plain mappings (replicated inputs and
gradients) are not run on the quantized path.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..backend import args as A
from ..ops import precision as Q
from ..ops.base import CommOp, apply, call
from ..ops.validation import PG
from . import mappings as M


class _QCopyToRegion(CommOp):
    name = "parallel.copy_to_region"
    spmd = M._CopyToRegion.spmd  # dc.spmd_check types it as the plain mapping
    spmd_same_as = M._CopyToRegion
    elementwise = True

    @staticmethod
    def run(x: Tensor, pg: PG, p: Q.Precision) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def label(pg: PG, p: Q.Precision) -> str:
        return f"parallel.copy_to_region({p.tag})"

    @staticmethod
    def transpose(g: Tensor, pg: PG, p: Q.Precision) -> Tensor:
        return call(_QReduceFromRegion, g, pg, p.transposed())


class _QReduceFromRegion(CommOp):
    name = "parallel.reduce_from_region"
    spmd = M._ReduceFromRegion.spmd  # dc.spmd_check types it as the plain mapping
    spmd_same_as = M._ReduceFromRegion

    @staticmethod
    def run(x: Tensor, pg: PG, p: Q.Precision) -> Tensor:
        return Q._all_reduce_run(x, "sum", pg, p)

    @staticmethod
    def label(pg: PG, p: Q.Precision) -> str:
        return f"parallel.reduce_from_region({p.tag})"

    @staticmethod
    def transpose(g: Tensor, pg: PG, p: Q.Precision) -> Tensor:
        return call(_QCopyToRegion, g, pg, p.transposed())


class _QKeepChunk(CommOp):
    """scatter_to_region / scatter_to_sequence: keep own chunk; transpose: all_gather."""

    name = "parallel.scatter_to_region"
    spmd = M._ScatterToRegion.spmd  # dc.spmd_check types it as the plain mapping
    spmd_same_as = M._ScatterToRegion
    dims = (0,)

    @staticmethod
    def run(x: Tensor, dim: int, pg: PG, rank: int, world: int, p: Q.Precision) -> Tensor:
        n = x.shape[dim] // world
        return x.narrow(dim, rank * n, n).clone()

    @staticmethod
    def label(dim: int, pg: PG, rank: int, world: int, p: Q.Precision) -> str:
        return f"parallel.scatter_to_region({p.tag})"

    @staticmethod
    def transpose(g: Tensor, dim: int, pg: PG, rank: int, world: int, p: Q.Precision) -> Tensor:
        return call(_QGatherReplicated, g, dim, pg, rank, world, p.transposed())


class _QGatherReplicated(CommOp):
    """gather_from_region / gather_from_sequence: all_gather; transpose: keep own chunk."""

    name = "parallel.gather_from_region"
    spmd = M._GatherFromRegion.spmd  # dc.spmd_check types it as the plain mapping
    spmd_same_as = M._GatherFromRegion
    dims = (0,)

    @staticmethod
    def run(x: Tensor, dim: int, pg: PG, rank: int, world: int, p: Q.Precision) -> Tensor:
        return Q._gather_run(x, dim, pg, (x.shape[dim],) * world, p)

    @staticmethod
    def label(dim: int, pg: PG, rank: int, world: int, p: Q.Precision) -> str:
        return f"parallel.gather_from_region({p.tag})"

    @staticmethod
    def transpose(g: Tensor, dim: int, pg: PG, rank: int, world: int, p: Q.Precision) -> Tensor:
        return call(_QKeepChunk, g, dim, pg, rank, world, p.transposed())


class _QReduceScatterToSequence(CommOp):
    name = "parallel.reduce_scatter_to_sequence"
    spmd = M._ReduceScatterToSequence.spmd  # dc.spmd_check types it as the plain mapping
    spmd_same_as = M._ReduceScatterToSequence
    dims = (0,)

    @staticmethod
    def run(x: Tensor, dim: int, pg: PG, world: int, p: Q.Precision) -> Tensor:
        return Q._reduce_scatter_run(x, dim, "sum", pg, (x.shape[dim] // world,) * world, p)

    @staticmethod
    def label(dim: int, pg: PG, world: int, p: Q.Precision) -> str:
        return f"parallel.reduce_scatter_to_sequence({p.tag})"

    @staticmethod
    def transpose(g: Tensor, dim: int, pg: PG, world: int, p: Q.Precision) -> Tensor:
        return call(_QAllGatherFromSequence, g, dim, pg, world, p.transposed())


class _QAllGatherFromSequence(CommOp):
    name = "parallel.all_gather_from_sequence"
    spmd = M._AllGatherFromSequence.spmd  # dc.spmd_check types it as the plain mapping
    spmd_same_as = M._AllGatherFromSequence
    dims = (0,)

    @staticmethod
    def run(x: Tensor, dim: int, pg: PG, world: int, p: Q.Precision) -> Tensor:
        return Q._gather_run(x, dim, pg, (x.shape[dim],) * world, p)

    @staticmethod
    def label(dim: int, pg: PG, world: int, p: Q.Precision) -> str:
        return f"parallel.all_gather_from_sequence({p.tag})"

    @staticmethod
    def transpose(g: Tensor, dim: int, pg: PG, world: int, p: Q.Precision) -> Tensor:
        return call(_QReduceScatterToSequence, g, dim, pg, world, p.transposed())


# ------------------------------------------------------------------ entry points


def _last(x: Tensor) -> int:
    return x.shape[-1] if x.ndim else 1


def mapping(name: str, x: Any, group: A.GroupLike, precision: Any, **kw: Any) -> Tensor:
    """``parallel.<name>(x, ..., precision=...)``: validate (forward and backward
    layouts, before any communication), then apply the quantized mapping."""
    x, pg = M._prepare(name, x, group)
    b = M._b()
    world, rank = b.world_size(pg), b.rank(pg)
    if name == "all_to_all_region":
        from ..ops.precision import all_to_all

        return all_to_all(x, kw["split_dim"], kw["concat_dim"], pg, None, None, precision)
    if name in ("copy_to_region", "reduce_from_region"):
        p = Q.check(x, precision, f"parallel.{name}")
        fn = _QCopyToRegion if name == "copy_to_region" else _QReduceFromRegion
        return apply(fn, x, pg, p)
    splits = name in ("scatter_to_region", "scatter_to_sequence", "reduce_scatter_to_sequence")
    dim = M._even_dim(name, x, kw["dim"], world) if splits else A.check_dim(x, kw["dim"], name)
    last = dim == x.ndim - 1
    n = x.shape[dim]
    split_side: Q.Layout | None
    gather_side: Q.Layout | None
    if splits:  # the split side: chunks of n / world along dim; the gather side: whole rows
        chunks = [n // world] * world
        split_side = (n, chunks) if last else None
        gather_side = (n // world, None) if last else None
    else:
        chunks = [n] * world
        split_side = (n * world, chunks) if last else None
        gather_side = (n, chunks) if last else None
    if name == "reduce_scatter_to_sequence":
        p = Q.check(x, precision, f"parallel.{name}", split_side, gather_side)
        return apply(_QReduceScatterToSequence, x, dim, pg, world, p)
    if name == "all_gather_from_sequence":
        p = Q.check(x, precision, f"parallel.{name}", gather_side, split_side)
        return apply(_QAllGatherFromSequence, x, dim, pg, world, p)
    if splits:  # scatter: only the backward (all_gather of the gradient chunks) travels
        p = Q.check(x, precision, f"parallel.{name}", None, (n // world, None) if last else None)
        return apply(_QKeepChunk, x, dim, pg, rank, world, p)
    # gather_from_*: forward all_gather; backward keeps own chunk (local)
    p = Q.check(x, precision, f"parallel.{name}", gather_side, None)
    return apply(_QGatherReplicated, x, dim, pg, rank, world, p)


Q.QUANTIZED["mapping"] = mapping  # copy_to_region(..., precision=...) and the other mappings
