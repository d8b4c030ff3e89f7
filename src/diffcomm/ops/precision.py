"""Low-precision collectives: :class:`Precision` and the quantized forms of ``all_reduce``,
``reduce_scatter``, ``all_gather`` and ``all_to_all`` (``precision=`` on each; see
``docs/precision.md``).

Semantics, forward: quantize -> communicate -> dequantize. A reduction never lets the
backend sum in the wire dtype (a bf16 ring rounds at every hop): each rank's quantized
contribution travels (an ``all_to_all`` of the chunks), is dequantized and summed in the
accumulation dtype, and the sum is rounded **once** (to the output dtype for
``reduce_scatter``; to the wire dtype for ``all_reduce``, whose second phase all_gathers
the reduced chunks in the wire dtype).

Backward: the adjoint of the exact linear map (the quantizer is straight-through), sent
in the backward's settings (:attr:`Precision.backward`); the backward op is itself a
quantized op whose own backward uses the forward settings again, so double backward is
defined. Forward mode (``torch.func.jvp``): the tangent goes through the same quantized
op with the forward settings. ``vmap``: one collective for the batch (blocks stay along
the last dim).

Wire formats: ``bfloat16`` / ``float16`` are plain casts (no scales; values beyond the
dtype's range become inf). ``float8_e4m3fn`` / ``float8_e5m2`` carry one float32 scale
per block of ``block_size`` elements along the last dim (``None``: one per row, the whole
last dim): ``scale = amax(|block|) / fp8_max`` (1 for an all-zero block), the payload
``clamp(x / scale)`` in fp8. A block with a non-finite value (or a float64 block whose
scale overflows float32) gets a NaN scale, so all of it decodes to NaN, never to a
finite number. The scales travel as a second (float32) communication.
Where a backend has no fp8 type (gloo) the payload travels as bytes
(:func:`diffcomm.backend.torch_distributed.wire`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor

from .. import _config, _torch
from .. import backend as B
from ..backend import args as A
from ..backend.local_tensor import RANK_WHY, refuse
from .all_gather import _AllGather, _ReduceScatter, raw_all_gather, raw_reduce_scatter
from .all_reduce import _AllReduce, raw_all_reduce
from .all_to_all import _AllToAll, raw_all_to_all
from .all_to_all import _debug_check_transposed as _debug_check_sizes
from .base import CommOp, apply, call
from .packing import check_dims as _check_dims
from .packing import check_list as _check_list
from .packing import check_op as _check_op
from .packing import check_split_sizes_list as _check_sizes
from .packing import debug_check as _debug_check_list
from .packing import even_split_sizes as _even_sizes
from .precision_format import (  # the option and its wire formats (no import cycle)
    FP8_MAX as FP8_MAX,
)
from .precision_format import (
    QUANTIZED,
    _block,
    _scale_sizes,
    block_widths,
)
from .precision_format import (
    WIRE_DTYPES as WIRE_DTYPES,
)
from .precision_format import (
    Layout as Layout,
)
from .precision_format import (
    Precision as Precision,
)
from .precision_format import (
    check as check,
)
from .precision_format import (
    decode as decode,
)
from .precision_format import (
    encode as encode,
)
from .precision_format import (
    quantize as quantize,
)
from .precision_format import (
    unit_roundoff as unit_roundoff,
)
from .registry import SELF
from .validation import PG
from .validation import all_to_all_received as _all_to_all_received
from .validation import all_to_all_split_sizes as _all_to_all_split_sizes
from .validation import check_input as _check_input
from .validation import debug_check as _debug_check
from .validation import debug_check_input as _debug_check_input
from .validation import exchanged_split_sizes as _exchanged_split_sizes
from .validation import given_split_sizes as _given_split_sizes
from .validation import other_dims as _other_dims
from .validation import rank as _rank
from .validation import records_grad as _records_grad
from .validation import world as _world

#: this module's own names; the option and its wire formats (``Precision``, ``encode`` ...)
#: are re-exported above, listed in their home's ``__all__`` (:mod:`.precision_format`)
__all__ = [
    "QuantizedOp",
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "all_to_all",
    "coalesced",
]


def _check_linear(op_name: str, opname: str) -> None:
    if op_name not in A.LINEAR_OPS:
        raise ValueError(
            f"diffcomm.{opname}(): precision= supports op='sum' or 'avg' (a linear reduction), "
            f"got op={op_name!r}"
        )


def _no_async(async_op: bool, opname: str) -> None:
    """What a quantized op does not run with: ``async_op=True``, and torch's
    ``LocalTensorMode`` (each rank encodes its own chunk, read with this rank as a Python
    int: refused naming the op, before any communication)."""
    if async_op:
        raise ValueError(f"diffcomm.{opname}(): async_op=True with precision= is not supported (yet)")
    if _torch.local_tensor_mode_on():
        raise refuse(f"{opname}(precision=...)", f"its quantized wire {RANK_WHY[3:]}")


# ----------------------------------------------------------------------------- runs


def _gather_run(x: Tensor, dim: int, pg: PG, sizes: tuple[int, ...], p: Precision) -> Tensor:
    if p.wire is None:
        return raw_all_gather(x, dim, pg, sizes)
    q, s = encode(x, p)
    out_q = raw_all_gather(q, dim, pg, sizes)
    out_s = None if s is None else raw_all_gather(s, dim, pg, _scale_sizes(sizes, dim, x, p))
    return decode(out_q, out_s, x.dtype, block_widths(sizes, dim, x, p))


def _a2a_run(
    x: Tensor,
    split_dim: int,
    concat_dim: int,
    pg: PG,
    ins: tuple[int, ...],
    outs: tuple[int, ...],
    p: Precision,
) -> Tensor:
    if p.wire is None:
        return raw_all_to_all(x, split_dim, concat_dim, pg, ins, outs)
    q, s = encode(x, p)
    out_q = raw_all_to_all(q, split_dim, concat_dim, pg, ins, outs)
    if s is None:
        return decode(out_q, None, x.dtype)
    s_ins = _scale_sizes(ins, split_dim, x, p)
    s_outs = _scale_sizes(outs, concat_dim, x, p)
    out_s = raw_all_to_all(s, split_dim, concat_dim, pg, s_ins, s_outs)
    return decode(out_q, out_s, x.dtype, block_widths(outs, concat_dim, x, p))


def _reduce_scatter_acc(x: Tensor, dim: int, op: str, pg: PG, sizes: tuple[int, ...], p: Precision) -> Tensor:
    """Chunk ``rank`` of the reduction, in the accumulation dtype (not yet rounded)."""
    world, rank = _world(pg), _rank(pg)
    acc = p.accumulate_for(x.dtype)
    mine = sizes[rank]
    outs = (mine,) * world
    q, s = encode(x, p)
    parts_q = raw_all_to_all(q, dim, dim, pg, tuple(sizes), outs)
    parts_s = None
    if s is not None:
        parts_s = raw_all_to_all(
            s, dim, dim, pg, _scale_sizes(sizes, dim, x, p), _scale_sizes(outs, dim, x, p)
        )
    parts = decode(parts_q, parts_s, acc).unflatten(dim, (world, mine))  # every rank's chunk
    if acc.itemsize >= 4:
        total = parts.sum(dim)
    else:  # torch sums bf16 / fp16 in float32: add in ``acc`` itself, rank by rank
        total = parts.select(dim, 0)
        for j in range(1, world):
            total = total + parts.select(dim, j)
    return total / world if op == "avg" else total


def _reduce_scatter_run(x: Tensor, dim: int, op: str, pg: PG, sizes: tuple[int, ...], p: Precision) -> Tensor:
    if p.wire is None:
        return raw_reduce_scatter(x, dim, op, pg, sizes)
    return _reduce_scatter_acc(x, dim, op, pg, sizes, p).to(x.dtype)


def _all_reduce_run(x: Tensor, op: str, pg: PG, p: Precision) -> Tensor:
    """Reduce-scatter phase (quantized all_to_all, sum in the accumulation dtype, one
    rounding to the wire dtype) then all_gather of the reduced rows in the wire dtype.
    ``x`` is laid out as rows of one block (fp8) or one last-dim row, padded to a
    multiple of the world size."""
    if p.wire is None:
        return raw_all_reduce(x, op, pg)
    world = _world(pg)
    shape = x.shape
    n = shape[-1] if x.ndim else 1
    width = max(_block(p, n) if p.wire in FP8_MAX else n, 1)
    flat = x.reshape(-1)
    rows = -(-flat.numel() // width) if width else 0
    padded_rows = -(-rows // world) * world
    pad = padded_rows * width - flat.numel()
    if pad:  # (not cat: CPU autocast's refuses a float16 x)
        flat = torch.nn.functional.pad(flat, (0, pad))
    x2 = flat.reshape(padded_rows, width)
    chunk = padded_rows // world
    mine = _reduce_scatter_acc(x2, 0, op, pg, (chunk,) * world, p)
    q, s = encode(mine, p)  # the one rounding of the sum (to the wire dtype)
    full_q = raw_all_gather(q, 0, pg, (chunk,) * world)
    full_s = None if s is None else raw_all_gather(s, 0, pg, (chunk,) * world)
    full = decode(full_q, full_s, x.dtype).reshape(-1)
    return full[: x.numel()].reshape(shape)


# ------------------------------------------------------------------------ the ops


class QuantizedOp(CommOp):
    """Base of the quantized ops and mappings: a plain op with a :class:`Precision`.

    A subclass states ``plain`` (the plain op's class: the quantized op takes its
    ``name`` and ``dims``, and ``dc.spmd_check`` types it as the plain op, one row in the
    typing table), ``run`` (the quantized forward, ``(x, *args, p)`` with ``p`` the
    :class:`Precision` last), ``op_at`` (the position in ``args`` of the reduce op the
    label shows, if any) and its adjoint:
    ``adjoint`` is the quantized op the transpose applies (``SELF`` for a self-adjoint op;
    the class defined second of a pair names the first, which gets it too),
    ``adjoint_args(*args)`` maps the arguments (default: the same). The base writes
    ``spmd``, ``label`` (``"name(op, tag)"``) and ``transpose``: the adjoint applied to
    the gradient with the backward settings (``p.transposed()``), whose own transpose
    uses the forward settings again (double backward), and ``vmap`` (:func:`_vmap`). An
    op whose adjoint is more than that states its ``transpose`` itself. :meth:`of` makes
    one from a line of a table.

    A quantized op is never ``elementwise`` (the plain mapping it stands for may be): fp8
    blocks run along the last dim, so the vmap batch dim must not stay there. (Kept in
    place, a ``copy_to_region`` batched along its last dim all_reduced its gradient with
    one fp8 scale across the examples: a small example's gradient came back as zeros.)
    """

    plain: ClassVar[type[CommOp]]
    adjoint: ClassVar[Any] = None
    op_at: ClassVar[int | None] = None
    _adjoint: ClassVar[list[Any]]  # [the adjoint's class], filled in by the second of a pair

    @staticmethod
    def adjoint_args(*args: Any) -> tuple[Any, ...]:
        return args

    def __init_subclass__(cls, **kwargs: Any) -> None:
        if "plain" not in cls.__dict__:  # the compile twin (a subclass of an op): nothing new
            super().__init_subclass__(**kwargs)
            return
        op: Any = cls  # the generated members, written as _derive_rules writes its own
        plain = cls.__dict__["plain"]
        op.name, op.dims = plain.name, plain.dims
        op.spmd = plain.spmd  # dc.spmd_check types it as the plain op
        plain.spmd.__set_name__(cls, "spmd")
        op.spmd_same_as = plain  # (one row in the typing table)
        adjoint = cls.__dict__.get("adjoint")
        op._adjoint = [cls if adjoint is SELF else adjoint]  # a cell: the first of a pair
        if isinstance(adjoint, type) and issubclass(adjoint, QuantizedOp):  # learns it here
            adjoint._adjoint[0] = cls
        if "label" not in cls.__dict__:
            op.label = staticmethod(_label(cls.name, cls.op_at))
        if "transpose" not in cls.__dict__:
            op.transpose = staticmethod(_transpose(op._adjoint, cls.adjoint_args))
        super().__init_subclass__(**kwargs)  # (the base derives the rules, vmap too)
        op.vmap = staticmethod(_vmap(cls, cls.__dict__["vmap"].__func__))

    @classmethod
    def of(cls, plain: type[CommOp], run: Any, *, adjoint: Any = None) -> type[QuantizedOp]:
        """The quantized form of ``plain`` with forward ``run`` (a module-level function,
        whose module the class reports), named ``_Q<plain's name>``."""
        members = {"plain": plain, "run": staticmethod(run), "adjoint": adjoint}
        members |= {"__module__": run.__module__, "__doc__": f"{plain.name} with a Precision."}
        return type(f"_Q{plain.__name__.lstrip('_')}", (cls,), members)


def _vmap(cls: Any, batched: Any) -> Any:
    """The batching rule of quantized op ``cls``: the base's (``batched``: the batch dim
    first, one collective), and where each example is 0-dim (``all_reduce`` of a scalar,
    a mapping of one), the batch as rows of one element each, as every example is alone:
    as ``(batch,)`` the batch was one row, one fp8 scale (or block) across the examples,
    and a small example came back as zeros. (An op with a dim never takes a 0-dim ``x``.)"""

    def vmap(info: Any, in_dims: tuple[Any, ...], x: Tensor, *args: Any) -> tuple[Tensor, int]:
        if in_dims[0] is None or x.ndim != 1:
            return batched(info, in_dims, x, *args)
        return call(cls, x.unsqueeze(-1), *args).squeeze(-1), 0

    return vmap


def _label(name: str, op_at: int | None) -> Any:
    def label(*args: Any) -> str:
        p = args[-1]
        return f"{name}({p.tag})" if op_at is None else f"{name}({args[op_at]}, {p.tag})"

    return label


def _transpose(adjoint: list[Any], adjoint_args: Any) -> Any:
    def transpose(g: Tensor, *args: Any) -> Tensor:
        return call(adjoint[0], g, *adjoint_args(*args[:-1]), args[-1].transposed())

    return transpose


class _QAllReduce(QuantizedOp):
    """all_reduce (sum/avg) with a :class:`Precision`; self-adjoint (backward settings)."""

    plain = _AllReduce
    adjoint = SELF
    op_at = 0
    run = staticmethod(_all_reduce_run)


class _QAllGather(QuantizedOp):
    """all_gather with a :class:`Precision`; adjoint: the quantized reduce_scatter(sum)."""

    plain = _AllGather
    run = staticmethod(_gather_run)

    @staticmethod
    def adjoint_args(dim: int, pg: PG, sizes: tuple[int, ...]) -> tuple[Any, ...]:
        return dim, "sum", pg, sizes


class _QReduceScatter(QuantizedOp):
    """reduce_scatter (sum/avg) with a :class:`Precision`; adjoint: the quantized all_gather
    (divided by the world size for avg)."""

    plain = _ReduceScatter
    adjoint = _QAllGather
    op_at = 1
    run = staticmethod(_reduce_scatter_run)

    @staticmethod
    def transpose(g: Tensor, dim: int, op: str, pg: PG, sizes: tuple[int, ...], p: Precision) -> Tensor:
        out = call(_QAllGather, g, dim, pg, sizes, p.transposed())
        return out / _world(pg) if op == "avg" else out


class _QAllToAll(QuantizedOp):
    """all_to_all with a :class:`Precision`; adjoint: itself with dims and sizes swapped."""

    plain = _AllToAll
    adjoint = SELF
    run = staticmethod(_a2a_run)

    @staticmethod
    def adjoint_args(
        split_dim: int, concat_dim: int, pg: PG, ins: tuple[int, ...], outs: tuple[int, ...]
    ) -> tuple[Any, ...]:
        return concat_dim, split_dim, pg, outs, ins


# ------------------------------------------------------------- public entry points
# (called by the public ops when ``precision`` is given; validation first)


def all_reduce(x: Any, op: Any, group: A.GroupLike, precision: Any, async_op: bool = False) -> Tensor:
    """``dc.all_reduce(x, op, group, precision=...)`` (see the module docstring)."""
    name = "all_reduce"
    x = _check_input(x, name)
    p = check(x, precision, name, reduces=True)
    op_name = A.normalize_op(op, name, x)
    _check_linear(op_name, name)
    _no_async(async_op, name)
    pg = A.resolve_group(group, name)
    # debug mode: the plain op's cross-rank check, and the settings (before, skipped here:
    # shapes (4, 6) and (2, 2, 6) all_reduced silently)
    if _config.DEBUG.get():  # (Precision.key costs ~1 us: built in debug mode only)
        _debug_check_input(name, pg, x, op=op_name, precision=p.key)
    return apply(_QAllReduce, x, op_name, pg, p)


def reduce_scatter(
    x: Any, dim: Any, op: Any, group: A.GroupLike, split_sizes: Any, precision: Any, async_op: bool = False
) -> Tensor:
    """``dc.reduce_scatter(..., precision=...)``."""
    name = "reduce_scatter"
    x = _check_input(x, name)
    dim = A.check_dim(x, dim, name)
    op_name = A.normalize_op(op, name, x)
    _check_linear(op_name, name)
    _no_async(async_op, name)
    pg = A.resolve_group(group, name)
    sizes = tuple(A.check_split_sizes(split_sizes, x.shape[dim], _world(pg), name))
    check(x, precision, name, *_scatter_layouts(x, dim, sizes, pg), reduces=True)
    if _config.DEBUG.get():
        _debug_check_input(name, pg, x, op=op_name, dim=dim, split_sizes=sizes, precision=precision.key)
    return apply(_QReduceScatter, x, dim, op_name, pg, sizes, precision)


def all_gather(
    x: Any, dim: Any, group: A.GroupLike, split_sizes: Any, precision: Any, async_op: bool = False
) -> Tensor:
    """``dc.all_gather(..., precision=...)``."""
    name = "all_gather"
    x = _check_input(x, name)
    dim = A.check_dim(x, dim, name)
    _no_async(async_op, name)
    # types first, before the size exchange communicates; fp8 blocks along the last dim
    # (the one gathered) see this rank's own row length, which may differ between ranks:
    # such a refusal is every rank's, agreed first (as all_to_all's), never one alone
    per_rank = dim == x.ndim - 1 and _blocks(precision)
    refused = _refusal(lambda: check(x, precision, name), per_rank)
    pg = A.resolve_group(group, name)
    if split_sizes is not None:
        sizes = tuple(_given_split_sizes(split_sizes, x, dim, pg, name, "split_sizes"))
    if _config.DEBUG.get():  # the plain op's cross-rank check, and the settings
        fields = dict(other_dims=_other_dims(x, dim), dtype=x.dtype, grad=_records_grad(x))
        given = None if split_sizes is None else sizes
        _debug_check(name, pg, dim=dim, split_sizes=given, precision=precision.key, **fields)
    if split_sizes is None:
        sizes = tuple(_exchanged_split_sizes(x, dim, pg, name))
    fwd, bwd = _gather_layouts(x, dim, sizes, precision)
    if fwd is not None and refused is None:  # (else checked above)
        refused = _refusal(lambda: check(x, precision, name, fwd, bwd), per_rank)
    if per_rank:
        _refuse_together(refused, pg, name)
    return apply(_QAllGather, x, dim, pg, sizes, precision)


Layouts = tuple[Layout | None, Layout | None]  # what the forward and the backward encode


def _scatter_layouts(x: Tensor, dim: int, sizes: tuple[int, ...], pg: PG) -> Layouts:
    """What a reduce_scatter of ``x`` along ``dim`` encodes, for :func:`check`: along the
    last dim, the forward splits it into ``sizes`` and the backward gathers this rank's
    chunks; along another dim, ``x``'s own last dim both ways (``None``)."""
    if dim != x.ndim - 1:
        return None, None
    return (x.shape[dim], sizes), (sizes[_rank(pg)], None)


def _gather_layouts(x: Tensor, dim: int, sizes: tuple[int, ...], p: Precision) -> Layouts:
    """What an all_gather of ``x`` along ``dim`` encodes, for :func:`check`: along the last
    dim, the pieces of every rank's row, and the backward splits the gathered row (forward:
    every rank's piece a whole number of blocks, so all ranks refuse alike; one scale per
    row, ``block_size=None``, fits rows of any lengths); along another dim ``None``."""
    if dim != x.ndim - 1:
        return None, None
    return (x.shape[dim], sizes if p.block_size else None), (sum(sizes), sizes)


def all_to_all(
    x: Any,
    split_dim: Any,
    concat_dim: Any,
    group: A.GroupLike,
    input_split_sizes: Any,
    output_split_sizes: Any,
    precision: Any,
    async_op: bool = False,
) -> Tensor:
    """``dc.all_to_all(..., precision=...)``."""
    name = "all_to_all"
    x = _check_input(x, name)
    split_dim = A.check_dim(x, split_dim, name, "split_dim")
    concat_dim = A.check_dim(x, concat_dim, name, "concat_dim")
    _no_async(async_op, name)
    last = x.ndim - 1
    # fp8 blocks along a last dim the op splits or joins: what each rank encodes differs
    # between ranks (its own sizes), so one rank may refuse where the others would not: the
    # ranks agree (one tiny exchange) and all refuse together, never one alone (a desync)
    per_rank = x.ndim > 0 and last in (split_dim, concat_dim) and _blocks(precision)
    refused = _refusal(lambda: check(x, precision, name), per_rank)
    pg = A.resolve_group(group, name)
    ins, outs = _all_to_all_split_sizes(x, split_dim, concat_dim, pg, input_split_sizes, output_split_sizes)
    if _config.DEBUG.get():  # the plain op's cross-rank checks, and the settings
        rest = _other_dims(x, split_dim, concat_dim)
        fields = dict(other_dims=rest, dtype=x.dtype, grad=_records_grad(x), precision=precision.key)
        _debug_check(name, pg, split_dim=split_dim, concat_dim=concat_dim, **fields)
        if outs is not None:
            _debug_check_sizes(name, pg, ins, outs, split_dim, concat_dim, x)
    if outs is None:
        outs = _all_to_all_received(ins, pg)
    n = x.shape[last]
    out_last = sum(outs) if concat_dim == last else (ins[_rank(pg)] if split_dim == last else n)
    fwd_chunks = list(ins) if split_dim == last else ([n] if concat_dim == last else None)
    bwd_chunks = list(outs) if concat_dim == last else None
    if refused is None:
        layouts = ((n, fwd_chunks), (out_last, bwd_chunks))
        refused = _refusal(lambda: check(x, precision, name, *layouts), per_rank)
    if per_rank:
        _refuse_together(refused, pg, name)
    return apply(_QAllToAll, x, split_dim, concat_dim, pg, tuple(ins), outs, precision)


def _blocks(precision: Any) -> bool:
    """Whether ``precision`` encodes fp8 blocks (forward or backward)."""
    if not isinstance(precision, Precision):
        return False
    return bool(FP8_MAX.keys() & {precision.wire, precision.transposed().wire})


def _refusal(run_check: Callable[[], object], per_rank: bool) -> ValueError | None:
    """``run_check()``'s ValueError where ranks may differ in it (``per_rank``: kept for
    :func:`_refuse_together`); else it propagates at once, as do its TypeErrors (the same
    on every rank)."""
    try:
        run_check()
    except ValueError as err:
        if not per_rank:
            raise
        return err
    return None


def _refuse_together(refused: ValueError | None, pg: PG, name: str) -> None:
    """Every rank of ``pg`` raises if any refused: the refusing ranks their own error, the
    others one naming them (one small all_gather of a flag, before the op's data moves)."""
    with B.label(f"{name} (precision check)"):
        flags = B.get_backend().exchange_size_lists([int(refused is not None)], pg)
    bad = [r for r, (flag,) in enumerate(flags) if flag]
    if refused is not None:
        raise refused
    if bad:
        raise ValueError(
            f"diffcomm.{name}(): group rank(s) {bad} cannot encode their part with this precision "
            "(fp8 blocks along the last dim, which the op splits or joins; their error says why), so "
            "every rank refuses the op"
        )


# ------------------------------------------------------------------- coalesced lists


def coalesced(name: str, tensors: Any, precision: Any, async_op: bool = False, **kw: Any) -> list[Tensor]:
    """``dc.<name>_coalesced(tensors, ..., precision=...)``: the quantized single op on each
    tensor, in order (values and gradients equal the single ops'). Not one communication
    per dtype: each tensor is its own quantized op (fp8: payload and scales).

    Every tensor is validated before the first one is sent, as a list (the errors name
    ``tensors[i]`` / ``split_sizes[i]``): its dtype for the wire, the reduce op, ``dim``,
    the split sizes and the fp8 blocks of what each direction encodes. (Each tensor's
    single op once checked its own dim, sizes and blocks in its turn, after the tensors
    before it had moved.) An ``all_gather`` without ``split_sizes`` first exchanges every
    tensor's sizes; its fp8 blocks along a last dim whose pieces come from the other ranks
    are checked then, on every rank alike, before any data moves."""
    op = f"{name}_coalesced"
    xs = _check_list(tensors, op)
    _no_async(async_op, op)
    for i, x in enumerate(xs):
        check(x, precision, op, arg=f"tensors[{i}]", reduces=name != "all_gather")
    pg = A.resolve_group(kw.get("group"), op)
    if name == "all_reduce":
        op_name = _check_op(kw.get("op", "sum"), xs, op)
        _check_linear(op_name, op)
        if _config.DEBUG.get():
            _debug_check_list(op, pg, xs, op=op_name, precision=precision.key)
        return [apply(_QAllReduce, x, op_name, pg, precision) for x in xs]
    dims = _check_dims(xs, kw.get("dim", 0), op)
    world, split_sizes = _world(pg), kw.get("split_sizes")
    if name == "reduce_scatter":
        op_name = _check_op(kw.get("op", "sum"), xs, op)
        _check_linear(op_name, op)
        if split_sizes is None:
            sizes = _even_sizes(xs, dims, world, op)
        else:
            sizes = _check_sizes(split_sizes, xs, dims, world, op, False, _rank(pg))
        for i, (x, d, s) in enumerate(zip(xs, dims, sizes)):
            fwd, bwd = _scatter_layouts(x, d, s, pg)
            check(x, precision, op, fwd, bwd, arg=f"tensors[{i}]")
        if _config.DEBUG.get():  # (the plain op's fields, and the precision)
            flat = () if split_sizes is None else tuple(v for s in sizes for v in s)
            _debug_check_list(
                op, pg, xs, op=op_name, dim=tuple(dims), split_sizes=flat, precision=precision.key
            )
        return [apply(_QReduceScatter, x, d, op_name, pg, s, precision) for x, d, s in zip(xs, dims, sizes)]
    if split_sizes is not None:
        sizes = _check_sizes(split_sizes, xs, dims, world, op, True, _rank(pg))
    if _config.DEBUG.get():  # (the plain op's fields, and the precision)
        flat = () if split_sizes is None else tuple(v for s in sizes for v in s)
        _debug_check_list(op, pg, xs, vary=dims, dim=tuple(dims), split_sizes=flat, precision=precision.key)
    if split_sizes is None:  # every tensor's sizes, exchanged before any data moves
        sizes = tuple(tuple(_exchanged_split_sizes(x, d, pg, op)) for x, d in zip(xs, dims))
    for i, (x, d, s) in enumerate(zip(xs, dims, sizes)):
        fwd, bwd = _gather_layouts(x, d, s, precision)
        if fwd is not None:  # (else checked above)
            check(x, precision, op, fwd, bwd, arg=f"tensors[{i}]")
    return [apply(_QAllGather, x, d, pg, s, precision) for x, d, s in zip(xs, dims, sizes)]


QUANTIZED.update(
    all_reduce=all_reduce,
    reduce_scatter=reduce_scatter,
    all_gather=all_gather,
    all_to_all=all_to_all,
    coalesced=coalesced,
)
