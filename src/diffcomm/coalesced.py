"""Coalesced collectives: one communication per dtype for a whole list of tensors.

``all_reduce_coalesced``, ``broadcast_coalesced``, ``all_gather_coalesced`` and
``reduce_scatter_coalesced`` take a list (or tuple) of tensors of any shapes and mixed
dtypes and return a list in the same order; element ``i`` equals the single-tensor op
applied to ``tensors[i]``, with the same gradient. Real models move many small tensors
(biases, layer-norm weights, statistics); one collective each pays the per-collective
latency many times over.

How: the tensors are grouped by dtype (in order of first appearance); each group is
**packed** into one flat buffer (``torch.cat`` of the flattened tensors, laid out so the
op becomes a plain dim-0 op on the buffer), **one** raw collective runs per buffer, and
the result is **split back with views** (``split`` + ``view`` / ``movedim``; only
``all_gather_coalesced`` copies, because the gathered buffer is rank-major and each
result must be tensor-major).

Gradient convention as for every collective (the objective is the sum of the per-rank
objectives): the backward of a coalesced op is its **dual coalesced op**, again one
communication per dtype:

==========================  =========================================================
op                          backward (adjoint)
==========================  =========================================================
all_reduce_coalesced        all_reduce_coalesced of the gradients (sum/avg); max/min:
                            the summed gradient goes to the arg-extreme ranks, ties split
                            (the tie counts travel in the same buffer: still one call per
                            dtype); product: zero-safe product of the others (one more
                            all_gather per dtype, as the single op)
broadcast_coalesced         reduce_coalesced(sum) to ``src``; other ranks exact zeros
reduce_coalesced            broadcast_coalesced from ``dst`` (divided by the world for avg)
all_gather_coalesced        reduce_scatter_coalesced(sum)
reduce_scatter_coalesced    all_gather_coalesced (divided by the world size for avg)
==========================  =========================================================

The packing (``cat`` / ``split`` / ``view``) is ordinary differentiable torch, so the
autograd Functions below only ever see flat buffers, one per dtype. Every rank runs the
same backward collectives: the gradient of a buffer covers every tensor packed into it,
with zeros where an output got no gradient or its input does not require grad.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from . import _args as A
from . import _async, _config
from . import backend as B
from ._errors import CrossRankMismatchError
from ._op import FastFunction as _Collective
from ._op import fn as _fn
from ._op import jvp_free_twin as _jvp_free_twin
from ._op import only_on as _only_on
from ._op import unwrap_if_dead as _unwrap_if_dead
from ._registry import OpSpec, markdown, register
from .collectives import _async_if

__all__ = [
    "all_reduce_coalesced",
    "broadcast_coalesced",
    "reduce_coalesced",
    "all_gather_coalesced",
    "reduce_scatter_coalesced",
    "COALESCED_OPS",
    "coalesced_markdown",
]

PG = Any


def _b() -> B.Backend:
    return B.get_backend()


def _world(pg: PG) -> int:
    return _b().world_size(pg)


def _rank(pg: PG) -> int:
    return _b().rank(pg)


class _CoalescedFn(_Collective):
    """Base of the flat-buffer Functions.

    Call them as ``_call(Cls, n, *meta, *buffers)`` (``n`` non-tensor arguments, then one
    buffer per dtype). The autograd Function itself takes ``(buffers[0], *meta,
    *buffers[1:])`` (a tensor first, like every collective's Function);
    :func:`_logical` / :func:`_physical` convert between the two orders. Dynamo, tracing
    a nested ``apply`` without grad (inside a backward rule), passes a ctx first to a
    ``forward`` with ``*args`` (it counts parameters to tell old-style from new-style
    Functions), so ``forward`` drops one (:func:`_logical`).
    """

    _NMETA = 0

    @classmethod
    @torch.compiler.disable
    def apply(cls, *args: Any) -> Any:  # type: ignore[override]
        if torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling():
            return super(_Collective, cls).apply(*args)
        if _async.launching(cls):  # async_op=True, or an asynchronous op's backward
            return _async.launch_fn(cls, args)
        n = cls._NMETA
        return super(torch.autograd.Function, cls).apply(
            _unwrap_if_dead(args[0]), *args[1 : n + 1], *(_unwrap_if_dead(a) for a in args[n + 1 :])
        )


def _call(fn_cls: Any, n: int, *args: Any) -> Any:
    """``fn_cls.apply`` with arguments in the logical order ``(*meta, *buffers)``
    (``n`` = number of meta arguments; passed, as dynamo cannot read a Function's class
    attributes)."""
    return fn_cls.apply(args[n], *args[:n], *args[n + 1 :])


def _logical(n: int, args: Sequence[Any]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """``(buffers[0], *meta, *buffers[1:])`` -> ``(meta, buffers)`` (a leading ctx dropped)."""
    if isinstance(args[0], torch.autograd.function.FunctionCtx):
        args = args[1:]
    return tuple(args[1 : n + 1]), (args[0], *args[n + 1 :])


def _physical(n: int, per_buffer: Sequence[Any]) -> tuple[Any, ...]:
    """Per-buffer values (gradients, in_dims) -> the Function's argument order."""
    return (per_buffer[0], *([None] * n), *per_buffer[1:])


def _zeros_for(meta: Sequence[tuple[Any, torch.dtype, Any]], ts: Sequence[Tensor | None]) -> list[Tensor]:
    """``None`` (no gradient / tangent) becomes zeros shaped like ``meta``."""
    return [torch.zeros(s, dtype=d, device=v) if t is None else t for t, (s, d, v) in zip(ts, meta)]


def _on_differentiable(ctx: Any, gs: Sequence[Tensor | None], rule: Any) -> list[Any]:
    """Input gradients: ``rule(idx, gs[idx])`` for the floating/complex tensors ``idx``
    only, ``None`` for integer/bool ones (a dtype fact, equal on every rank, so every rank
    runs the same backward collectives; integer tensors are not communicated). Outputs
    without a gradient take part with zeros."""
    idx = [i for i, (_, d, _) in enumerate(ctx.meta) if d.is_floating_point or d.is_complex]
    res: list[Any] = [None] * len(gs)
    if not idx:
        return res
    out_meta = [ctx.out_meta[i] for i in idx]
    for i, g in zip(idx, rule(idx, _zeros_for(out_meta, [gs[i] for i in idx]))):
        res[i] = g
    return res


def _batch_all(info: Any, in_dims: Sequence[Any], xs: Sequence[Tensor]) -> list[Tensor]:
    """Every tensor with its batch dim at 0 (unbatched ones expanded): one call per dtype."""
    out = []
    for x, d in zip(xs, in_dims):
        if d is None:
            out.append(x.unsqueeze(0).expand(info.batch_size, *x.shape))
        else:
            out.append(x if d == 0 else x.movedim(d, 0))
    return out


def _meta(xs: Sequence[Tensor]) -> list[tuple[torch.Size, torch.dtype, torch.device]]:
    return [(x.shape, x.dtype, x.device) for x in xs]


def _setup(
    ctx: Any, n: int, inputs: tuple[Any, ...], output: tuple[Tensor, ...], same_shapes: bool = False
) -> tuple[Any, ...]:
    meta, xs = _logical(n, inputs)
    ctx.meta = _meta(xs)
    ctx.out_meta = ctx.meta if same_shapes else _meta(output)
    return meta


# --------------------------------------------------------------------------------------
# packing (inside the Functions' forward: no autograd nodes per tensor)
# --------------------------------------------------------------------------------------


def _by_dtype(ts: Sequence[Tensor]) -> list[list[int]]:
    """Positions of ``ts`` grouped by dtype, groups in order of first appearance."""
    first = ts[0].dtype
    if all(t.dtype == first for t in ts):
        return [list(range(len(ts)))]
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(ts):
        groups.setdefault(t.dtype, []).append(i)
    return list(groups.values())


def _flatten(ts: Sequence[Tensor]) -> Tensor:
    """A new contiguous 1-D buffer holding ``ts`` one after another (never an input)."""
    if len(ts) == 1:
        return ts[0].reshape(-1).clone()
    if torch.compiler.is_compiling():
        return torch.cat([t.reshape(-1) for t in ts])
    return torch._C._nn.flatten_dense_tensors(list(ts))  # one C++ call (DDP's packing)


def _pack(ts: Sequence[Tensor], groups: list[list[int]]) -> list[Tensor]:
    """One new contiguous buffer per dtype group (the caller owns it)."""
    if len(groups) == 1:
        return [_flatten(ts)]
    return [_flatten([ts[i] for i in g]) for g in groups]


def _unpack_like(xs: Sequence[Tensor], groups: list[list[int]], bufs: Sequence[Tensor]) -> list[Tensor]:
    """Outputs shaped like the inputs ``xs``: views of the buffers, detached (see
    :func:`_unpack`)."""
    if torch.compiler.is_compiling():
        return _unpack([x.shape for x in xs], groups, bufs)
    if len(groups) == 1:
        return [v.detach() for v in torch._C._nn.unflatten_dense_tensors(bufs[0], list(xs))]
    out: list[Any] = [None] * len(xs)
    for g, buf in zip(groups, bufs):
        for i, v in zip(g, torch._C._nn.unflatten_dense_tensors(buf, [xs[i] for i in g])):
            out[i] = v.detach()
    return out


def _unpack(shapes: Sequence[Sequence[int]], groups: list[list[int]], bufs: Sequence[Tensor]) -> list[Tensor]:
    """Split each buffer back into tensors of ``shapes``: views of the buffer, detached so
    autograd sees independent outputs (each may be modified in place)."""
    out: list[Any] = [None] * len(shapes)
    for g, buf in zip(groups, bufs):
        sizes = [math.prod(shapes[i]) for i in g]
        for i, piece in zip(g, buf.split(sizes)):
            shape = shapes[i]
            out[i] = (piece if len(shape) == 1 else piece.view(shape)).detach()
    return out


def _moved(xs: Sequence[Tensor], dims: Sequence[int]) -> list[Tensor]:
    return [x if d == 0 else x.movedim(d, 0) for x, d in zip(xs, dims)]


def _back(ys: Sequence[Tensor], dims: Sequence[int]) -> list[Tensor]:
    return [(y if d == 0 else y.movedim(0, d)).detach() for y, d in zip(ys, dims)]


# ======================================================================================
# the autograd Functions over a whole list (one node; one raw call per dtype)
# ======================================================================================


class _AllReduceList(_CoalescedFn):
    _NMETA = 2  # op, pg

    @staticmethod
    def forward(x0: Tensor, *args: Any) -> tuple[Tensor, ...]:
        (op, pg), xs = _logical(2, (x0, *args))
        groups = _by_dtype(xs)
        with B.label(f"all_reduce_coalesced({op})"):
            bufs = _b().all_reduce_coalesced(_pack(xs, groups), op, pg, owned=True)
        return tuple(_unpack_like(xs, groups, bufs))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
        ctx.op, ctx.pg = _setup(ctx, 2, inputs, output, same_shapes=True)
        if ctx.op in ("max", "min", "product"):
            xs = _logical(2, inputs)[1]
            ctx.save_for_backward(*xs, *output)
            ctx.save_for_forward(*xs, *output)

    @staticmethod
    def backward(ctx: Any, *gs: Tensor) -> tuple[Any, ...]:
        op, pg = ctx.op, ctx.pg
        n = len(gs)
        saved = ctx.saved_tensors

        def rule(idx: list[int], gs: list[Tensor]) -> list[Tensor]:
            if op in ("sum", "avg"):
                return list(_call(_AllReduceList, 2, op, pg, *gs))
            xs = [saved[i] for i in idx]
            if op == "product":
                g_total = _call(_AllReduceList, 2, "sum", pg, *gs)
                return [g * w.conj() for g, w in zip(g_total, _product_of_others(xs, pg))]
            # max/min: the gradients and the tie masks share the buffers (same dtypes): one
            # call per dtype
            ys = [saved[n + i] for i in idx]
            masks = [(x.detach() == y.detach()).to(x.dtype) for x, y in zip(xs, ys)]
            both = _call(_AllReduceList, 2, "sum", pg, *gs, *masks)
            k = len(gs)
            return [g * (m / c).conj() for g, m, c in zip(both[:k], masks, both[k:])]

        with B.label(f"all_reduce_coalesced({op}) backward"):
            return _physical(2, _on_differentiable(ctx, gs, rule))

    @staticmethod
    def jvp(ctx: Any, *ts: Any) -> tuple[Tensor, ...]:
        op, pg = ctx.op, ctx.pg
        ts = _zeros_for(ctx.meta, _logical(2, ts)[1])
        if op in ("sum", "avg"):
            return _call(_AllReduceList, 2, op, pg, *ts)
        n = len(ts)
        saved = ctx.saved_tensors
        xs, ys = saved[:n], saved[n:]
        if op == "product":
            ws = _product_of_others(xs, pg)
        else:
            masks = [(x == y).to(x.dtype) for x, y in zip(xs, ys)]
            ws = [m / c for m, c in zip(masks, _call(_AllReduceList, 2, "sum", pg, *masks))]
        return _call(_AllReduceList, 2, "sum", pg, *(t * w for t, w in zip(ts, ws)))

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], x0: Tensor, *args: Any) -> tuple[Any, Any]:
        # elementwise over ranks: batch dims are just more elements, one call per dtype
        (op, pg), xs = _logical(2, (x0, *args))
        return _call(_AllReduceList, 2, op, pg, *xs), _logical(2, in_dims)[1]


def _product_of_others(xs: Sequence[Tensor], pg: PG) -> list[Tensor]:
    """``prod_{j != r} x_j`` per tensor, from one coalesced all_gather (zero-safe)."""
    rank = _rank(pg)
    gathered = _call(_AllGatherList, 2, (0,) * len(xs), pg, *(x.unsqueeze(0) for x in xs))
    return [g[:rank].prod(0) * g[rank + 1 :].prod(0) for g in gathered]


class _BroadcastList(_CoalescedFn):
    _NMETA = 2  # src, pg

    @staticmethod
    def forward(x0: Tensor, *args: Any) -> tuple[Tensor, ...]:
        (src, pg), xs = _logical(2, (x0, *args))
        groups = _by_dtype(xs)
        with B.label("broadcast_coalesced"):
            bufs = _b().broadcast_coalesced(_pack(xs, groups), src, pg, owned=True)
        return tuple(_unpack_like(xs, groups, bufs))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
        ctx.src, ctx.pg = _setup(ctx, 2, inputs, output, same_shapes=True)

    @staticmethod
    def backward(ctx: Any, *gs: Tensor) -> tuple[Any, ...]:
        with B.label("broadcast_coalesced backward"):
            rule = lambda _, gs: _call(_ReduceList, 3, ctx.src, "sum", ctx.pg, *gs)
            return _physical(2, _on_differentiable(ctx, gs, rule))

    @staticmethod
    def jvp(ctx: Any, *ts: Any) -> tuple[Tensor, ...]:
        return _call(_BroadcastList, 2, ctx.src, ctx.pg, *_zeros_for(ctx.meta, _logical(2, ts)[1]))

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], x0: Tensor, *args: Any) -> tuple[Any, Any]:
        (src, pg), xs = _logical(2, (x0, *args))
        return _call(_BroadcastList, 2, src, pg, *xs), _logical(2, in_dims)[1]


class _ReduceList(_CoalescedFn):
    """Linear (sum/avg) reduce to ``dst``, zeros elsewhere: the dual of broadcast."""

    _NMETA = 3  # dst, op, pg

    @staticmethod
    def forward(x0: Tensor, *args: Any) -> tuple[Tensor, ...]:
        (dst, op, pg), xs = _logical(3, (x0, *args))
        groups = _by_dtype(xs)
        with B.label(f"reduce_coalesced({op})"):
            bufs = _b().reduce_coalesced(_pack(xs, groups), dst, op, pg)
        return tuple(_unpack_like(xs, groups, bufs))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
        ctx.dst, ctx.op, ctx.pg = _setup(ctx, 3, inputs, output, same_shapes=True)

    @staticmethod
    def backward(ctx: Any, *gs: Tensor) -> tuple[Any, ...]:
        world = _world(ctx.pg) if ctx.op == "avg" else None

        def rule(_: list[int], gs: list[Tensor]) -> list[Tensor]:
            out = _call(_BroadcastList, 2, ctx.dst, ctx.pg, *gs)
            return [o / world for o in out] if world is not None else list(out)

        with B.label(f"reduce_coalesced({ctx.op}) backward"):
            return _physical(3, _on_differentiable(ctx, gs, rule))

    @staticmethod
    def jvp(ctx: Any, *ts: Any) -> tuple[Tensor, ...]:
        return _call(_ReduceList, 3, ctx.dst, ctx.op, ctx.pg, *_zeros_for(ctx.meta, _logical(3, ts)[1]))

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], x0: Tensor, *args: Any) -> tuple[Any, Any]:
        (dst, op, pg), xs = _logical(3, (x0, *args))
        return _call(_ReduceList, 3, dst, op, pg, *xs), _logical(3, in_dims)[1]


class _AllGatherList(_CoalescedFn):
    """Even all_gather of every tensor ``i`` along ``dims[i]``."""

    _NMETA = 2  # dims, pg

    @staticmethod
    def forward(x0: Tensor, *args: Any) -> tuple[Tensor, ...]:
        (dims, pg), xs = _logical(2, (x0, *args))
        world = _world(pg)
        moved = _moved(xs, dims)
        groups = _by_dtype(moved)
        with B.label("all_gather_coalesced"):
            bufs = _b().all_gather_coalesced(_pack(moved, groups), pg)
        out: list[Any] = [None] * len(xs)
        for g, buf in zip(groups, bufs):  # rank-major -> tensor-major (one copy each)
            rows = buf.view(world, buf.numel() // world).split([moved[i].numel() for i in g], dim=1)
            for i, block in zip(g, rows):
                m = moved[i]
                out[i] = block.reshape(world * m.shape[0], *m.shape[1:])
        return tuple(_back(out, dims))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
        ctx.dims, ctx.pg = _setup(ctx, 2, inputs, output)

    @staticmethod
    def backward(ctx: Any, *gs: Tensor) -> tuple[Any, ...]:
        def rule(idx: list[int], gs: list[Tensor]) -> Any:
            dims = tuple(ctx.dims[i] for i in idx)
            return _call(_ReduceScatterList, 3, dims, "sum", ctx.pg, *gs)

        with B.label("all_gather_coalesced backward"):
            return _physical(2, _on_differentiable(ctx, gs, rule))

    @staticmethod
    def jvp(ctx: Any, *ts: Any) -> tuple[Tensor, ...]:
        return _call(_AllGatherList, 2, ctx.dims, ctx.pg, *_zeros_for(ctx.meta, _logical(2, ts)[1]))

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], x0: Tensor, *args: Any) -> tuple[Any, Any]:
        (dims, pg), xs = _logical(2, (x0, *args))
        xb = _batch_all(info, _logical(2, in_dims)[1], xs)
        return _call(_AllGatherList, 2, tuple(d + 1 for d in dims), pg, *xb), (0,) * len(xs)


class _ReduceScatterList(_CoalescedFn):
    """Even linear (sum/avg) reduce_scatter of every tensor ``i`` along ``dims[i]``."""

    _NMETA = 3  # dims, op, pg

    @staticmethod
    def forward(x0: Tensor, *args: Any) -> tuple[Tensor, ...]:
        (dims, op, pg), xs = _logical(3, (x0, *args))
        world = _world(pg)
        moved = _moved(xs, dims)
        groups = _by_dtype(moved)
        # rank-major layout: row r of each buffer holds chunk r of every tensor of the dtype
        bufs = [torch.cat([moved[i].reshape(world, moved[i].numel() // world) for i in g], 1) for g in groups]
        with B.label(f"reduce_scatter_coalesced({op})"):
            parts = _b().reduce_scatter_coalesced([b.view(-1) for b in bufs], op, pg)
        shapes = [(m.shape[0] // world, *m.shape[1:]) for m in moved]
        return tuple(_back(_unpack(shapes, groups, parts), dims))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
        ctx.dims, ctx.op, ctx.pg = _setup(ctx, 3, inputs, output)

    @staticmethod
    def backward(ctx: Any, *gs: Tensor) -> tuple[Any, ...]:
        world = _world(ctx.pg) if ctx.op == "avg" else None

        def rule(idx: list[int], gs: list[Tensor]) -> list[Tensor]:
            dims = tuple(ctx.dims[i] for i in idx)
            out = _call(_AllGatherList, 2, dims, ctx.pg, *gs)
            return [o / world for o in out] if world is not None else list(out)

        with B.label(f"reduce_scatter_coalesced({ctx.op}) backward"):
            return _physical(3, _on_differentiable(ctx, gs, rule))

    @staticmethod
    def jvp(ctx: Any, *ts: Any) -> tuple[Tensor, ...]:
        ts = _zeros_for(ctx.meta, _logical(3, ts)[1])
        return _call(_ReduceScatterList, 3, ctx.dims, ctx.op, ctx.pg, *ts)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], x0: Tensor, *args: Any) -> tuple[Any, Any]:
        (dims, op, pg), xs = _logical(3, (x0, *args))
        xb = _batch_all(info, _logical(3, in_dims)[1], xs)
        return _call(_ReduceScatterList, 3, tuple(d + 1 for d in dims), op, pg, *xb), (0,) * len(xs)


for _cls in (_AllReduceList, _BroadcastList, _ReduceList, _AllGatherList, _ReduceScatterList):
    _jvp_free_twin(_cls)


# ======================================================================================
# validation (before any communication) and the debug-mode cross-rank check
# ======================================================================================


def _check_list(tensors: Any, op: str) -> list[Tensor]:
    """The list, validated: non-empty, dense tensors, one device, no integer tensor
    asked for grad. (One cheap pass: this runs on every call, for hundreds of tensors.)"""
    if isinstance(tensors, Tensor) or not isinstance(tensors, list | tuple):
        raise A.arg_error(op, "tensors", "a list or tuple of tensors", type(tensors).__name__, TypeError)
    if len(tensors) == 0:
        raise A.arg_error(op, "tensors", "a non-empty list of tensors", "an empty list")
    first = tensors[0].device if isinstance(tensors[0], Tensor) else None
    for i, t in enumerate(tensors):
        if type(t) is not Tensor and not isinstance(t, Tensor) or t.is_sparse:
            A.check_tensor(t, op, f"tensors[{i}]")  # raises the standard message
        if t.requires_grad and not (t.is_floating_point() or t.is_complex()):
            A.check_grad_dtype(t, op, f"tensors[{i}]")
        if t.device != first:
            raise A.arg_error(
                op,
                "tensors",
                "tensors on one device (one buffer per dtype is communicated)",
                f"tensors[0] on {first} and tensors[{i}] on {t.device}",
            )
    return list(tensors)


def _check_op(op_arg: Any, ts: Sequence[Tensor], opname: str) -> str:
    """The reduce op, checked against every dtype present (once per dtype)."""
    name = A.normalize_op(op_arg, opname)
    if name in ("sum", "product"):
        return name  # legal for every dtype
    seen: set[torch.dtype] = set()
    for i, t in enumerate(ts):
        if t.dtype in seen:
            continue
        seen.add(t.dtype)
        try:
            A.normalize_op(name, opname, t)
        except ValueError as err:
            raise ValueError(f"{err} (for tensors[{i}], dtype {t.dtype})") from None
    return name


_DTYPE_CODES: dict[torch.dtype, int] = {}


def _dtype_code(d: torch.dtype) -> int:
    return _DTYPE_CODES.setdefault(d, sum(str(d).encode()) * 131 + len(str(d)))


def _debug_check(opname: str, pg: PG, ts: Sequence[Tensor], /, **fields: Any) -> None:
    """Debug mode: the arguments, and the list's length, shapes and dtypes, must agree on
    every rank; else an error naming the ranks and the first differing position."""
    if not _config.DEBUG.get() or torch.compiler.is_compiling():
        return
    b = _b()
    b.check_consistent(opname, {**fields, "length": len(ts)}, pg)
    world = _world(pg)
    if world == 1:
        return
    row: list[int] = []
    for t in ts:
        row += [_dtype_code(t.dtype), int(t.requires_grad), t.ndim, *t.shape]
    device = _b().comm_device(pg)
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    width = int(b.all_gather(torch.tensor([mine.numel()], dtype=torch.int64, device=device), pg).max())
    padded = torch.full((1, width), -1, dtype=torch.int64, device=device)
    padded[0, : mine.numel()] = mine
    table = b.all_gather(padded, pg).cpu().tolist()
    if all(r == table[0] for r in table):
        return
    descs = [_decode(r, len(ts)) for r in table]
    for i in range(len(ts)):
        per_rank = [d[i] for d in descs]
        if any(p != per_rank[0] for p in per_rank):
            by_value: dict[str, list[int]] = {}
            for r, p in enumerate(per_rank):
                by_value.setdefault(p, []).append(r)
            listing = "; ".join(f"ranks {rs}: {v}" for v, rs in by_value.items())
            raise CrossRankMismatchError(
                f"diffcomm.{opname}(): the tensor lists differ between ranks, first at position {i} "
                f"(tensors[{i}]): {listing}. Every rank must pass the same number of tensors "
                "with the same shapes, dtypes and requires_grad, in the same order"
            )


def _decode(row: list[int], n: int) -> list[str]:
    names = {v: str(k).replace("torch.", "") for k, v in _DTYPE_CODES.items()}
    out, i = [], 0
    for _ in range(n):
        code, grad, nd = row[i], row[i + 1], row[i + 2]
        shape = tuple(row[i + 3 : i + 3 + nd])
        i += 3 + nd
        out.append(f"shape {list(shape)} dtype {names.get(code, code)} requires_grad={bool(grad)}")
    return out


# ======================================================================================
# the public ops
# ======================================================================================


def all_reduce_coalesced(
    tensors: Sequence[Tensor], op: Any = "sum", group: A.GroupLike = None, *, async_op: bool = False
) -> list[Tensor]:
    """Reduce every tensor of ``tensors`` over the ranks: one communication per dtype.

    Args:
        tensors: a non-empty list or tuple of tensors (any shapes, mixed dtypes, one
            device); the same list (length, shapes, dtypes) on every rank.
        op: reduce op as for :func:`diffcomm.all_reduce` (checked against every dtype).
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        async_op: return at once a list of :class:`~diffcomm.AsyncTensor` that wait for
            the one communication on first use; values and gradients equal the blocking
            op's, and the backward is asynchronous too (``docs/async.md``).

    Returns:
        A list of new tensors, ``out[i]`` of ``tensors[i].shape`` equal to
        ``dc.all_reduce(tensors[i], op)``. Outputs of one dtype are views of one buffer.

    Gradient:
        ``all_reduce_coalesced`` of the output gradients (sum/avg), one communication
        per dtype. ``max``/``min``: the summed gradient to the arg-extreme ranks, ties
        split evenly (still one communication per dtype); ``product``: zero-safe
        product of the others (one more all_gather per dtype, like
        :func:`diffcomm.all_reduce`).

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: dc.all_reduce_coalesced([torch.ones(2), torch.arange(3)]))
            # [[tensor([2., 2.]), tensor([0, 2, 4])], ...] on both ranks
    """
    name = "all_reduce_coalesced"
    ts = _check_list(tensors, name)
    op_name = _check_op(op, ts, name)
    pg = A.resolve_group(group, name)
    _debug_check(name, pg, ts, op=op_name)
    with _async_if(async_op):
        return list(_call(_fn(_AllReduceList), 2, op_name, pg, *ts))


def broadcast_coalesced(
    tensors: Sequence[Tensor], src: int = 0, group: A.GroupLike = None, *, async_op: bool = False
) -> list[Tensor]:
    """Every rank gets rank ``src``'s tensors: one communication per dtype.

    Args:
        tensors: a non-empty list or tuple of tensors (any shapes, mixed dtypes, one
            device), same shapes and dtypes on every rank (only ``src``'s values matter).
        src: group-local rank whose tensors are sent.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        async_op: return at once a list of :class:`~diffcomm.AsyncTensor` that wait for
            the one communication on first use; values and gradients equal the blocking
            op's, and the backward is asynchronous too (``docs/async.md``).

    Returns:
        A list of new tensors, ``out[i]`` of ``tensors[i].shape`` holding ``src``'s
        values (``dc.broadcast(tensors[i], src)``).

    Gradient:
        a coalesced ``reduce(sum)`` to ``src`` (one communication per dtype): ``src``
        gets the sum of every rank's output gradients, the other ranks exact zeros.

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: dc.broadcast_coalesced([torch.tensor([1.0 * dc.get_rank()])], src=1))
            # [[tensor([1.])], [tensor([1.])]]
    """
    name = "broadcast_coalesced"
    ts = _check_list(tensors, name)
    pg = A.resolve_group(group, name)
    src = A.check_rank(src, name, "src", _world(pg))
    _debug_check(name, pg, ts, src=src)
    with _async_if(async_op):
        return list(_call(_fn(_BroadcastList), 2, src, pg, *ts))


def reduce_coalesced(
    tensors: Sequence[Tensor],
    dst: int = 0,
    op: Any = "sum",
    group: A.GroupLike = None,
    *,
    async_op: bool = False,
) -> list[Tensor]:
    """Reduce every tensor over the ranks onto ``dst``; zeros elsewhere. One communication
    per dtype (the dual of :func:`broadcast_coalesced`).

    Args:
        tensors: a non-empty list or tuple of tensors (any shapes, mixed dtypes, one
            device), same shapes and dtypes on every rank.
        dst: group-local rank that receives the reductions.
        op: reduce op as for :func:`diffcomm.all_reduce`.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        async_op: return at once a list of :class:`~diffcomm.AsyncTensor` that wait for
            the one communication on first use; values and gradients equal the blocking
            op's, and the backward is asynchronous too (``docs/async.md``).

    Returns:
        A list of new tensors, ``out[i]`` of ``tensors[i].shape``: ``dc.reduce(tensors[i],
        dst, op)`` (the reduction on ``dst``, zeros of that shape elsewhere).

    Gradient:
        ``broadcast_coalesced(grad, src=dst)`` (divided by the world size for avg);
        ``max``/``min``/``product`` reduce on every rank (:func:`all_reduce_coalesced`
        and its rule) and keep the result on ``dst``, like :func:`diffcomm.reduce`.

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: dc.reduce_coalesced([torch.ones(2)], dst=1))
            # [[tensor([0., 0.])], [tensor([2., 2.])]]
    """
    name = "reduce_coalesced"
    ts = _check_list(tensors, name)
    op_name = _check_op(op, ts, name)
    pg = A.resolve_group(group, name)
    dst = A.check_rank(dst, name, "dst", _world(pg))
    _debug_check(name, pg, ts, op=op_name, dst=dst)
    with _async_if(async_op):
        if op_name in A.LINEAR_OPS:
            return list(_call(_fn(_ReduceList), 3, dst, op_name, pg, *ts))
        # max/min/product: every rank needs the result for its gradient anyway (as dc.reduce)
        full = _call(_fn(_AllReduceList), 2, op_name, pg, *ts)
        return [_only_on(y, _rank(pg) == dst) for y in full]


def _check_dims(ts: Sequence[Tensor], dim: Any, op: str) -> list[int]:
    dims = []
    for i, t in enumerate(ts):
        if t.ndim == 0:
            raise A.arg_error(op, f"tensors[{i}]", "a tensor with at least one dimension", "a 0-dim tensor")
        dims.append(A.check_dim(t, dim, op))
    return dims


def all_gather_coalesced(
    tensors: Sequence[Tensor], dim: int = 0, group: A.GroupLike = None, *, async_op: bool = False
) -> list[Tensor]:
    """Concatenate every rank's ``tensors[i]`` along ``dim``: one communication per dtype.

    Args:
        tensors: a non-empty list or tuple of tensors with at least one dimension (any
            shapes, mixed dtypes, one device); the **same shapes on every rank** (for
            sizes along ``dim`` that differ between ranks use :func:`diffcomm.all_gather`).
        dim: the dimension to concatenate along (negative counts from each tensor's end).
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        async_op: return at once a list of :class:`~diffcomm.AsyncTensor` that wait for
            the one communication on first use; values and gradients equal the blocking
            op's, and the backward is asynchronous too (``docs/async.md``).

    Returns:
        A list of new tensors: ``out[i]`` is ``tensors[i].shape`` with ``dim`` of size
        ``world * tensors[i].shape[dim]``, rank ``r``'s block at ``r * shape[dim]``.

    Gradient:
        ``reduce_scatter_coalesced(grad, dim, op="sum")`` (one communication per dtype):
        each rank gets the sum over ranks of the gradient of its own block.

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: dc.all_gather_coalesced([torch.tensor([1.0 * dc.get_rank()])]))
            # [[tensor([0., 1.])], [tensor([0., 1.])]]
    """
    name = "all_gather_coalesced"
    ts = _check_list(tensors, name)
    dims = _check_dims(ts, dim, name)
    pg = A.resolve_group(group, name)
    _debug_check(name, pg, ts, dim=dim)
    with _async_if(async_op):
        return list(_call(_fn(_AllGatherList), 2, tuple(dims), pg, *ts))


def reduce_scatter_coalesced(
    tensors: Sequence[Tensor],
    dim: int = 0,
    op: Any = "sum",
    group: A.GroupLike = None,
    *,
    async_op: bool = False,
) -> list[Tensor]:
    """Reduce every tensor over ranks and give rank ``r`` chunk ``r`` of each along ``dim``.

    Args:
        tensors: a non-empty list or tuple of tensors with at least one dimension (any
            shapes, mixed dtypes, one device), same shapes on every rank; each
            ``shape[dim]`` divisible by the group size (even split).
        dim: the dimension to split (negative counts from each tensor's end).
        op: reduce op as for :func:`diffcomm.all_reduce`.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        async_op: return at once a list of :class:`~diffcomm.AsyncTensor` that wait for
            the one communication on first use; values and gradients equal the blocking
            op's, and the backward is asynchronous too (``docs/async.md``).

    Returns:
        A list of new tensors: ``out[i]`` is ``tensors[i].shape`` with ``dim`` of size
        ``shape[dim] // world`` (``dc.reduce_scatter(tensors[i], dim, op)``).

    Gradient:
        ``all_gather_coalesced(grad, dim)`` (one communication per dtype; divided by the
        world size for avg). ``max``/``min``/``product`` reduce the whole buffers
        (:func:`all_reduce_coalesced` and its rule) and keep the own chunk, like
        :func:`diffcomm.reduce_scatter`.

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: dc.reduce_scatter_coalesced([torch.arange(4.0)]))
            # [[tensor([0., 2.])], [tensor([4., 6.])]]
    """
    name = "reduce_scatter_coalesced"
    ts = _check_list(tensors, name)
    dims = _check_dims(ts, dim, name)
    op_name = _check_op(op, ts, name)
    pg = A.resolve_group(group, name)
    world, rank = _world(pg), _rank(pg)
    for i, (t, d) in enumerate(zip(ts, dims)):
        if t.shape[d] % world:
            raise A.arg_error(
                name,
                f"tensors[{i}]",
                f"of a size along dim {d} divisible by the group size {world}",
                f"shape {list(t.shape)}",
            )
    _debug_check(name, pg, ts, op=op_name, dim=dim)
    with _async_if(async_op):
        if op_name in A.LINEAR_OPS:
            return list(_call(_fn(_ReduceScatterList), 3, tuple(dims), op_name, pg, *ts))
        # max/min/product: reduce everything, keep the own chunk (as dc.reduce_scatter)
        full = _call(_fn(_AllReduceList), 2, op_name, pg, *ts)
        out = []
        for y, d in zip(full, dims):
            c = y.shape[d] // world
            out.append(y.narrow(d, rank * c, c))
        return out


# ======================================================================================
# the coalesced op -> adjoint table (tests walk it; the docs' table is generated from it)
# ======================================================================================

COALESCED_OPS: dict[str, OpSpec] = register(
    "coalesced",
    OpSpec(
        "all_reduce_coalesced",
        all_reduce_coalesced,
        "all_reduce_coalesced",
        "op over ranks of each tensor, on every rank",
        "all_reduce_coalesced of grads (max/min: to arg-extreme ranks, ties split; product: "
        "zero-safe, plus one all_gather per dtype)",
    ),
    OpSpec(
        "broadcast_coalesced",
        broadcast_coalesced,
        "reduce_coalesced",
        "src's tensors on every rank",
        "reduce_coalesced(sum) to src; other ranks exact zeros",
    ),
    OpSpec(
        "reduce_coalesced",
        reduce_coalesced,
        "broadcast_coalesced",
        "op over ranks on dst, zeros elsewhere",
        "broadcast_coalesced from dst",
    ),
    OpSpec(
        "all_gather_coalesced",
        all_gather_coalesced,
        "reduce_scatter_coalesced",
        "each tensor concatenated over ranks along dim",
        "reduce_scatter_coalesced(sum)",
    ),
    OpSpec(
        "reduce_scatter_coalesced",
        reduce_scatter_coalesced,
        "all_gather_coalesced",
        "chunk r of each tensor's reduction along dim",
        "all_gather_coalesced",
    ),
)


def coalesced_markdown() -> str:
    """The coalesced op -> adjoint table as Markdown (the docs include this)."""
    return markdown("coalesced")


# asynchronous coalesced ops: output shapes (Function arguments: tensor, *meta, *tensors)


def _list_shapes(n: int, scale: Any = None) -> Any:
    def shapes(a: tuple[Any, ...]) -> list[tuple[int, ...]]:
        ts = [a[0], *a[n + 1 :]]
        if scale is None:
            return [tuple(t.shape) for t in ts]
        dims, world = a[1], _world(a[n])
        return [
            tuple(scale(s, world) if i == d else s for i, s in enumerate(t.shape)) for t, d in zip(ts, dims)
        ]

    return shapes


_async.OUT_SHAPES.update(
    {
        _AllReduceList: _list_shapes(2),
        _BroadcastList: _list_shapes(2),
        _ReduceList: _list_shapes(3),
        _AllGatherList: _list_shapes(2, lambda s, w: s * w),
        _ReduceScatterList: _list_shapes(3, lambda s, w: s // w),
    }
)
