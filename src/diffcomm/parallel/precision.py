"""The ``diffcomm.parallel`` mappings with ``precision=`` (``docs/precision.md``).

Each mapping keeps its replicated-objective meaning (``docs/parallel.md``); the
communicating side(s) run the quantized collective of :mod:`diffcomm.ops.precision`:
the forward's communication with the :class:`~diffcomm.Precision`'s forward settings,
the backward's with its ``backward`` settings (``copy_to_region``: identity forward, so
only its backward all_reduce is quantized, with the backward settings). Local sides
(identity, keep own chunk) are exact. The backward is the conjugate quantized mapping,
so double backward uses the forward settings again.

Debug mode runs the plain mappings' checks here too: a copy forward's input is replicated,
an identity backward's gradient is replicated, the shapes agree.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from .. import _torch
from ..backend import args
from ..backend.local_tensor import RANK_WHY, refuse
from ..ops.base import apply, call
from ..ops.precision import (
    QUANTIZED,
    Layout,
    Precision,
    QuantizedOp,
    _a2a_run,
    _all_reduce_run,
    _gather_run,
    _reduce_scatter_run,
)
from ..ops.precision import check as check_precision
from ..ops.registry import SELF
from ..ops.validation import PG
from . import mappings

# the mappings' quantized forwards: ``(x, *args, p)``, the communicating side through
# :mod:`diffcomm.ops.precision`'s runs; local sides exact. The replicated-objective pairs
# carry ``debug`` (debug mode at the call) as the plain mappings do: an identity backward
# checks its gradient is replicated, as the plain one does (else a wrong choice of mapping
# is a silent 2x under precision= only)


def _identity(x: Tensor, pg: PG, debug: bool, p: Precision) -> Tensor:
    return x.view_as(x)


def _sum(x: Tensor, pg: PG, debug: bool, p: Precision) -> Tensor:
    return _all_reduce_run(x, "sum", pg, p)


def _own_chunk(x: Tensor, dim: int, pg: PG, rank: int, world: int, debug: bool, p: Precision) -> Tensor:
    n = x.shape[dim] // world
    return x.narrow(dim, rank * n, n).clone()


def _gather_rows(x: Tensor, dim: int, pg: PG, rank: int, world: int, debug: bool, p: Precision) -> Tensor:
    return _gather_run(x, dim, pg, (x.shape[dim],) * world, p)


def _sum_scatter(x: Tensor, dim: int, pg: PG, world: int, p: Precision) -> Tensor:
    return _reduce_scatter_run(x, dim, "sum", pg, (x.shape[dim] // world,) * world, p)


def _gather(x: Tensor, dim: int, pg: PG, world: int, p: Precision) -> Tensor:
    return _gather_run(x, dim, pg, (x.shape[dim],) * world, p)


def _checked_identity(plain: type[mappings._Mapping], local: type[QuantizedOp], instead: str) -> Any:
    """The transpose of a quantized mapping whose backward is local (``local``: its
    conjugate, a quantized copy / keep-own-chunk): debug mode's check that the gradient is
    replicated (at the call or now), as the plain mapping's, then ``local`` with the
    backward settings (its own transpose checks nothing again: ``debug`` False)."""
    name = plain.name.removeprefix("parallel.")

    def transpose(g: Tensor, *args: Any) -> Tensor:
        *rest, debug, p = args  # (pg, ...) or (dim, pg, ...)
        pg = rest[0] if len(rest) == 1 else rest[1]
        mappings._check_identity_backward(name, instead, g, pg, debug)
        return call(local, g, *rest, False, p.transposed())

    return staticmethod(transpose)


def _pair(
    copy: type[mappings._Mapping],
    copy_run: Any,
    identity: type[mappings._Mapping],
    identity_run: Any,
    instead: str,
) -> tuple[type[QuantizedOp], type[QuantizedOp]]:
    """A quantized replicated-objective pair: ``copy`` (a local forward, its backward the
    communicating conjugate) and ``identity`` (communicating forward, local backward,
    checked in debug mode)."""
    q_copy = QuantizedOp.of(copy, copy_run)  # (never elementwise: see QuantizedOp)
    members = {
        "plain": identity,
        "run": staticmethod(identity_run),
        "adjoint": q_copy,
        "transpose": _checked_identity(identity, q_copy, instead),
        "__module__": __name__,
        "__doc__": f"{identity.name} with a Precision.",
    }
    q_identity = type(f"_Q{identity.__name__.lstrip('_')}", (QuantizedOp,), members)
    return q_copy, q_identity


# the quantized mappings, typed as the plain ones; the second of each conjugate pair names
# the first (its adjoint: the same arguments, the backward settings)
_QCopyToRegion, _QReduceFromRegion = _pair(
    mappings._CopyToRegion, _identity, mappings._ReduceFromRegion, _sum, "diffcomm.all_reduce"
)
_QScatterToRegion, _QGatherFromRegion = _pair(
    mappings._ScatterToRegion, _own_chunk, mappings._GatherFromRegion, _gather_rows, "diffcomm.all_gather"
)
_QScatterToSequence, _QGatherFromSequence = _pair(
    mappings._ScatterToSequence,
    _own_chunk,
    mappings._GatherFromSequence,
    _gather_rows,
    "parallel.all_gather_from_sequence",
)
_QReduceScatterToSequence = QuantizedOp.of(mappings._ReduceScatterToSequence, _sum_scatter)
_QAllGatherFromSequence = QuantizedOp.of(
    mappings._AllGatherFromSequence, _gather, adjoint=_QReduceScatterToSequence
)


def _region_a2a(x: Tensor, split_dim: int, concat_dim: int, pg: PG, world: int, p: Precision) -> Tensor:
    ins, outs = mappings.region_a2a_sizes(x, split_dim, concat_dim, world)
    return _a2a_run(x, split_dim, concat_dim, pg, ins, outs, p)


class _QAllToAllRegion(QuantizedOp):
    """all_to_all_region with a :class:`Precision` (typed as the mapping: ``{V: V}``);
    adjoint: itself with the dims swapped."""

    plain = mappings._AllToAllRegion
    adjoint = SELF
    run = staticmethod(_region_a2a)

    @staticmethod
    def adjoint_args(split_dim: int, concat_dim: int, pg: PG, world: int) -> tuple[Any, ...]:
        return concat_dim, split_dim, pg, world


# ------------------------------------------------------------------ entry points


#: the mappings whose forward copies a replicated input (debug mode checks it is)
_COPIES = ("copy_to_region", "scatter_to_region", "scatter_to_sequence")


def _check_input(name: str, x: Tensor, pg: PG, debug: bool, p: Precision, **dims: int) -> None:
    """Debug mode: what the plain mapping checks of its input (communicates; after every
    local check), in the same collectives, with the ranks' settings (one rank's bf16 bytes
    read as fp16 by another are garbage): a copy forward's input is replicated, else the
    shapes agree; with the mapping's ``dims``, as the plain mapping passes them. A rank
    calling the plain mapping passes no ``precision``: the message names it."""
    if not debug:
        return
    if name in _COPIES:
        mappings._check_copied(name, x, pg, precision=p.key, **dims)
    else:
        mappings._check_shape(name, x, pg, precision=p.key, **dims)


def _last(x: Tensor) -> int:
    return x.shape[-1] if x.ndim else 1


def mapping(name: str, x: Any, group: args.GroupLike, precision: Any, **kw: Any) -> Tensor:
    """``parallel.<name>(x, ..., precision=...)``: validate (forward and backward
    layouts, before any communication), then apply the quantized mapping."""
    x, pg = mappings._prepare(name, x, group)
    if _torch.local_tensor_mode_on():  # (as the core quantized ops: named, before any exchange)
        raise refuse(f"parallel.{name}(precision=...)", f"its quantized wire {RANK_WHY[3:]}")
    b = mappings._b()
    world, rank = b.world_size(pg), b.rank(pg)
    debug = mappings._debug()  # the plain mapping's checks (after the local validation)
    if name == "all_to_all_region":  # the mapping's own op (its typing rule, even chunks)
        split_dim = mappings._even_dim(name, x, kw["split_dim"], world, "split_dim")
        concat_dim = args.check_dim(x, kw["concat_dim"], f"parallel.{name}", "concat_dim")
        ins, outs = mappings.region_a2a_sizes(x, split_dim, concat_dim, world)
        end, n = x.ndim - 1, _last(x)
        fwd = (n, list(ins) if split_dim == end else ([n] if concat_dim == end else None))
        out_last = sum(outs) if concat_dim == end else (ins[rank] if split_dim == end else n)
        bwd = (out_last, list(outs) if concat_dim == end else None)
        p = check_precision(x, precision, f"parallel.{name}", fwd, bwd)
        _check_input(name, x, pg, debug, p, split_dim=split_dim, concat_dim=concat_dim)
        return apply(_QAllToAllRegion, x, split_dim, concat_dim, pg, world, p)
    if name in ("copy_to_region", "reduce_from_region"):
        p = check_precision(x, precision, f"parallel.{name}", reduces=name == "reduce_from_region")
        _check_input(name, x, pg, debug, p)
        fn = _QCopyToRegion if name == "copy_to_region" else _QReduceFromRegion
        return apply(fn, x, pg, debug, p)
    splits = name in ("scatter_to_region", "scatter_to_sequence", "reduce_scatter_to_sequence")
    dim = mappings._even_dim(name, x, kw["dim"], world) if splits else args.check_dim(x, kw["dim"], name)
    last = dim == x.ndim - 1
    n = x.shape[dim]
    split_side: Layout | None
    gather_side: Layout | None
    if splits:  # the split side: chunks of n / world along dim; the gather side: whole rows
        chunks = [n // world] * world
        split_side = (n, chunks) if last else None
        gather_side = (n // world, None) if last else None
    else:
        chunks = [n] * world
        split_side = (n * world, chunks) if last else None
        gather_side = (n, chunks) if last else None
    if name == "reduce_scatter_to_sequence":
        p = check_precision(x, precision, f"parallel.{name}", split_side, gather_side, reduces=True)
        _check_input(name, x, pg, debug, p, dim=dim)
        return apply(_QReduceScatterToSequence, x, dim, pg, world, p)
    if name == "all_gather_from_sequence":
        p = check_precision(x, precision, f"parallel.{name}", gather_side, split_side)
        _check_input(name, x, pg, debug, p, dim=dim)
        return apply(_QAllGatherFromSequence, x, dim, pg, world, p)
    if splits:  # scatter: only the backward (all_gather of the gradient chunks) travels
        p = check_precision(x, precision, f"parallel.{name}", None, (n // world, None) if last else None)
        _check_input(name, x, pg, debug, p, dim=dim)
        fn = _QScatterToRegion if name == "scatter_to_region" else _QScatterToSequence
        return apply(fn, x, dim, pg, rank, world, debug, p)
    # gather_from_*: forward all_gather; backward keeps own chunk (local)
    p = check_precision(x, precision, f"parallel.{name}", gather_side, None)
    _check_input(name, x, pg, debug, p, dim=dim)
    fn = _QGatherFromRegion if name == "gather_from_region" else _QGatherFromSequence
    return apply(fn, x, dim, pg, rank, world, debug, p)


QUANTIZED["mapping"] = mapping  # copy_to_region(..., precision=...) and the other mappings
