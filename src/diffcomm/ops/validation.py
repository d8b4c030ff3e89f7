"""Validation and group facts shared by the collectives (:mod:`diffcomm.ops.collectives`,
:mod:`diffcomm.ops.gather_scatter`, :mod:`diffcomm.ops.all_to_all`).

Every public collective validates its arguments here before any communication (errors
name the argument), asks the current backend for the group's rank and size, and in
debug mode (``DIFFCOMM_DEBUG=1``) compares its arguments across ranks. The per-rank
split sizes of the gathers (given or exchanged) and of an uneven ``all_to_all`` are
settled here too, so the ops that share them share one code path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .. import _config, _torch
from .. import backend as B
from .._replication import spmd_types_untyped
from .._torch import compiling
from ..backend import args as A
from ..backend.args import PG
from ..backend.sized_gather import exchange_first

#: The backend adapter the raw ops run on now (see :func:`diffcomm.backend.get_backend`).
current_backend = B.get_backend
_group_info = B.group_info


def rank(pg: PG) -> int:
    """This process's rank in ``pg``: ``current_backend().rank(pg)``; eagerly, with the
    default adapter, read straight off the group record (two call frames fewer)."""
    b = current_backend()
    if b is not B.DEFAULT:  # compiling, another adapter installed, or LocalTensorMode on
        return b.rank(pg)
    return _group_info(pg).rank


def rank_is(pg: PG, r: int, device: torch.device) -> Tensor:
    """A 0-dim bool tensor: whether this rank is group rank ``r`` (under torch's
    ``LocalTensorMode`` one per simulated rank, where a Python bool cannot say it)."""
    per_rank = getattr(current_backend(), "rank_is", None)
    if per_rank is not None:
        return per_rank(pg, r, device)
    return torch.tensor(rank(pg) == r, device=device)


def rank_start(pg: PG, size: int, device: torch.device) -> int | Tensor:
    """``rank * size``: where this rank's block of ``size`` rows starts, to compute with
    (``ids - start``, ``ids >= start``). An int, read as :func:`rank`; under torch's
    ``LocalTensorMode`` a 0-dim int64 tensor holding each simulated rank's own (an int
    cannot hold one value per rank in tensor arithmetic)."""
    b = current_backend()
    if b is B.DEFAULT:
        return _group_info(pg).rank * size
    per_rank = getattr(b, "rank_tensor", None)
    if per_rank is not None:
        return per_rank(pg, device) * size
    return b.rank(pg) * size


def own_slice(sizes: Sequence[int], pg: PG) -> tuple[int, int]:
    """(start, length) of this rank's chunk of a dim split into ``sizes``: under torch's
    ``LocalTensorMode`` ints that hold one value per simulated rank (for ``narrow``)."""
    per_rank = getattr(current_backend(), "own_slice", None)
    if per_rank is not None:
        return per_rank(sizes, pg)
    r = rank(pg)
    return sum(sizes[:r]), sizes[r]


def rank_index(pg: PG) -> int:
    """This rank in ``pg``, to index or slice tensors with (``narrow``): under torch's
    ``LocalTensorMode`` an int holding each simulated rank's own; never to compare (a
    comparison of it is one answer for every rank: compare with :func:`rank_is`)."""
    return own_slice([1] * world(pg), pg)[0]


def world(pg: PG) -> int:
    """The size of ``pg``: ``current_backend().world_size(pg)``, read as :func:`rank`."""
    if compiling() or B.INSTALLED is not B.DEFAULT:
        return current_backend().world_size(pg)
    return _group_info(pg).size


def debug_check(opname: str, pg: PG, /, **fields: Any) -> None:
    """In debug mode, compare ``fields`` across the ranks of ``pg`` (one tiny all_gather)."""
    if _config.DEBUG.get():
        current_backend().check_consistent(opname, fields, pg)


def debug_check_input(opname: str, pg: PG, x: Tensor, /, **fields: Any) -> None:
    """:func:`debug_check` of ``fields`` and ``x``'s shape, dtype and whether it requires
    grad (nothing is computed outside debug mode)."""
    debug = _config.DEBUG
    if debug.value if debug.loaded else debug.get():
        fields.update(shape=tuple(x.shape), dtype=x.dtype, grad=records_grad(x))
        current_backend().check_consistent(opname, fields, pg)


def records_grad(x: Tensor) -> bool:
    """Whether this call records ``x``'s op for backward: ``x.requires_grad`` under grad
    mode. Debug mode compares this across the ranks, not ``x.requires_grad`` alone: a rank
    inside ``torch.no_grad()`` / ``torch.inference_mode()`` records nothing, so it skips
    the backward collective the other ranks run, as a rank whose ``x`` needs no grad does."""
    return x.requires_grad and torch.is_grad_enabled()


def check_input(x: Any, op: str) -> Tensor:
    """``x`` as a collective's input: a dense tensor of a dtype gradients can flow in."""
    if A.plain_data(x) and (not x.requires_grad or x.is_floating_point()):
        return x  # the common case, decided without a further call
    x = A.check_tensor(x, op, "x")
    A.check_grad_dtype(x, op, "x")
    return x


def other_dims(x: Tensor, *dims: int) -> tuple[int, ...]:
    """``x.shape`` without ``dims`` (what must agree across ranks when ``dims`` may differ)."""
    return tuple(s for i, s in enumerate(x.shape) if i not in dims)


def with_sizes(shape: Any, sizes: dict[int, int]) -> tuple[int, ...]:
    """``shape`` with ``shape[d] = n`` for every ``d: n`` in ``sizes``."""
    return tuple(sizes.get(i, s) for i, s in enumerate(shape))


def given_split_sizes(sizes: Sequence[int], x: Tensor, dim: int, pg: PG, op: str, arg: str) -> list[int]:
    """The per-rank sizes along ``dim`` a gather (``all_gather``, ``gather``) was given:
    one per rank, this rank's equal to ``x.shape[dim]``."""
    b = current_backend()
    total = sum(sizes) if A.plain_ints(sizes) else sum(int(s) for s in sizes)
    sizes = A.check_split_sizes(sizes, total, b.world_size(pg), op, arg)
    if own_slice(sizes, pg)[1] != x.shape[dim]:  # (per simulated rank: true if any differs)
        raise A.arg_error(op, arg, f"to list x.shape[{dim}]={x.shape[dim]} at this rank's position", sizes)
    return sizes


def exchanged_split_sizes(x: Tensor, dim: int, pg: PG, op: str) -> list[int]:
    """Every rank's ``x.shape[dim]``: one tiny all_gather of host integers (labelled
    ``"<op> (size exchange)"``) on a CPU channel of the same ranks; none in a world of one.
    The integers are each rank's shape record, so a rank whose ``x`` differs in another
    dim or the dtype is a ``CrossRankMismatchError`` on every rank (no extra
    communication)."""
    if world(pg) == 1:
        return [x.shape[dim]]
    b = current_backend()
    records = getattr(b, "exchange_records", None)
    with B.label(f"{op} (size exchange)"):
        if records is None:  # an adapter without it: the sizes alone, unchecked
            return b.exchange_sizes(x.shape[dim], pg)
        return exchange_first(x, lambda rec: records(rec, pg), op, dim)


class Learned(list[int]):
    """Split sizes an op learns while it communicates: empty when the op is applied,
    filled by its ``run`` (the one place it communicates) with every rank's size, so the
    autograd context, which keeps this object, has them for the backward."""


def gathered_split_sizes(x: Tensor, dim: int, pg: PG, async_op: bool) -> tuple[int, ...] | Learned:
    """Every rank's ``x.shape[dim]`` for an ``all_gather`` that was given none.

    Where the backend can (:mod:`diffcomm.backend.sized_gather`: eager, blocking, a world of two
    or more), the gather itself learns them: an empty :class:`Learned` its ``run`` fills.
    Else they are exchanged first (:func:`exchanged_split_sizes`); in a world of one they are
    just ``(x.shape[dim],)``.
    """
    b = current_backend()
    if b.world_size(pg) == 1:
        return (x.shape[dim],)
    unsized = getattr(b, "all_gather_unsized", None)
    if unsized is None or async_op or compiling() or _transforms_active() or _fwad._current_level >= 0:
        return tuple(exchanged_split_sizes(x, dim, pg, "all_gather"))
    return Learned()


_transforms_active = _torch.transforms_active
_fwad = torch.autograd.forward_ad


def all_to_all_split_sizes(
    x: Tensor,
    split_dim: int,
    concat_dim: int,
    pg: PG,
    input_split_sizes: Sequence[int] | None,
    output_split_sizes: Sequence[int] | None,
) -> tuple[list[int], tuple[int, ...] | None]:
    """``all_to_all``'s validated ``(input split sizes, output split sizes)``, the output
    sizes as the tuple of ints the op runs with; they are ``None`` when they must be
    exchanged (:func:`all_to_all_received`, after the caller's debug check)."""
    op = "all_to_all"
    size = world(pg)
    ins = A.check_split_sizes(input_split_sizes, x.shape[split_dim], size, op, "input_split_sizes", True)
    if split_dim == concat_dim:
        if output_split_sizes is not None:
            outs = _output_sizes(output_split_sizes, size)
        elif input_split_sizes is None:
            outs = ins
        else:
            return ins, None  # exchanged later
    elif input_split_sizes is not None and ins and ins.count(ins[0]) != len(ins):
        raise A.arg_error(
            op,
            "input_split_sizes",
            "equal sizes when split_dim != concat_dim (received chunks are concatenated along "
            "another dim, so their split_dim sizes must agree)",
            list(ins),
        )
    elif output_split_sizes is None:
        outs = [x.shape[concat_dim]] * size
    else:
        outs = _output_sizes(output_split_sizes, size)
        if own_slice(outs, pg)[1] != x.shape[concat_dim]:  # (as given_split_sizes)
            raise A.arg_error(
                op,
                "output_split_sizes",
                f"to list this rank's x.shape[concat_dim]={x.shape[concat_dim]} at its own position",
                outs,
            )
    try:
        return ins, tuple(map(int, outs))
    except AttributeError:  # (ints holding one value per simulated rank: torch's LocalTensorMode)
        if not _torch.local_tensor_mode_on():
            raise
        return ins, tuple(outs)


def _output_sizes(sizes: Sequence[int], size: int) -> list[int]:
    if A.plain_ints(sizes):
        total = sum(sizes)
    else:  # (a SymInt holding one int per simulated rank sums as one; see A.check_split_sizes)
        total = sum(s if isinstance(s, torch.SymInt) else int(s) for s in sizes)
    return A.check_split_sizes(sizes, total, size, "all_to_all", "output_split_sizes", True)


def all_to_all_received(ins: Sequence[int], pg: PG) -> tuple[int, ...]:
    """The sizes every rank sends this one (an uneven ``all_to_all`` along one dim without
    ``output_split_sizes``): the send sizes exchanged as a tiny all_to_all, as a tuple (of
    ints, as :func:`all_to_all_split_sizes` gives the output sizes)."""
    if compiling():
        raise A.arg_error(
            "all_to_all",
            "output_split_sizes",
            "given under torch.compile when `input_split_sizes` is and split_dim == concat_dim "
            "(the received sizes would be exchanged with a host read, which dynamo cannot trace)",
            None,
        )
    return _exchange_received(ins, pg)


#: (see _replication.spmd_types_checking)
_FUNCTION_ATTRS = torch.autograd.Function.__dict__


def untyped() -> Any:
    """:func:`~diffcomm._replication.spmd_types_untyped`: spmd_types' checker paused around
    an exchange of host integers (sizes, debug mode's codes), no program data."""
    return spmd_types_untyped(_FUNCTION_ATTRS)


@_torch.compiler_disable
def _exchange_received(ins: Sequence[int], pg: PG) -> tuple[int, ...]:
    """:func:`all_to_all_received`'s exchange, eagerly under torch.compile without
    fullgraph (a graph break): reached from the eager part of a broken frame, dynamo traced
    on into the raw all_to_all and failed on the group object (InternalTorchDynamoError
    "Member '_size' is not registered for this opaque object type" in an in-process world)."""
    size = world(pg)
    with B.label("all_to_all (size exchange)"), untyped():  # (host integers)
        b, dev = current_backend(), current_backend().comm_device(pg)
        per_rank = None if A.plain_ints(ins) else getattr(b, "ints_tensor", None)
        sent = (
            torch.tensor(list(ins), dtype=torch.int64, device=dev) if per_rank is None else per_rank(ins, dev)
        )
        got = b.all_to_all(sent, pg, [1] * size, [1] * size).tolist()
    # (under torch's LocalTensorMode, sizes that differ between the simulated ranks are
    # SymInts holding each rank's: the backend's per-rank all_to_all takes them as they are)
    return tuple(got)
