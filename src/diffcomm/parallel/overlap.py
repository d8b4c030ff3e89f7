"""Tensor-parallel linears that hide their communication behind computation.

Used by :class:`~diffcomm.parallel.ColumnParallelLinear`,
:class:`~diffcomm.parallel.RowParallelLinear` and :class:`~diffcomm.parallel.ParallelMLP`
with ``overlap=`` (default ``False``: the blocking mappings). Two mechanisms, both run
their communication on the communication engine of :mod:`diffcomm.ops.engine`:

``"comm"`` — the column-parallel backward launches the input-gradient communication
(the ``copy_to_region`` all_reduce, or with sequence parallelism the
``all_gather_from_sequence`` reduce_scatter) **before** the weight-gradient matmul and
waits where the input gradient is consumed (the previous layer's backward). Every
computation is the blocking path's own (the local linear's backward matmuls, evaluated in
two parts) and the collective is the same raw op on the same data, so outputs and
gradients are **bit-identical** to ``overlap=False``.

``"ring"`` (sequence parallelism) — the all_gather -> matmul of the column-parallel
forward (and of the row-parallel backward) becomes ``world`` ring steps: while block
``j``'s matmul runs, the block needed next travels one hop around the ring
(``batch_p2p`` send/recv, what :func:`diffcomm.shift` runs). Its mirror, matmul ->
reduce_scatter (row-parallel forward, column-parallel backward), computes the partial
product of one sequence block per step and sends the running sum one hop on while the
next block's product is computed; after ``world`` steps each rank holds its block's
sum. The communication volume equals the blocking collectives'. The results equal the
blocking path's up to the order of floating-point additions: the ring adds the ranks'
partial sums in ring order (gloo's reduce_scatter uses its own order), and a matmul of a
block of rows may round differently from the same rows of the full matmul. On exactly
representable data (integers in floating point) the two paths agree bit for bit; on
random data to a few ulps.

Both modes support first-order gradients (``backward()``, ``torch.autograd.grad``, a
retained graph's second backward); double backward through an overlapped layer raises
(use ``overlap=False``). Under a ``torch.func`` transform (``grad``, ``vmap``, ...) or
forward-mode AD (``torch.autograd.forward_ad``) the layers run the blocking mappings
instead: the same values and gradients.

The three autograd Functions here (``_ColumnComm``, ``_ColumnRing``, ``_RowRing``) are
not ``diffcomm.ops.base.CommOp`` / ``ListOp`` ops: that base derives
backward, jvp and vmap from a **linear** communication op's transpose (the dual op on the
gradient, the same op on the tangent). Each Function here fuses a matmul with its
communication: it is bilinear in ``(x, w)`` (not linear in one tensor), takes the weight
and bias as inputs, and its backward is local matmuls (the weight and bias gradients)
interleaved with the input gradient's communication — the interleaving is the point, so
there is no single transpose to state. Their communication is the public collectives
(``_ColumnComm``) or the ring steps below, each labelled for the logger and the flight
recorder.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _torch
from .. import backend as B
from .._replication import REPLICATED, P, R, Rule, V
from ..backend.args import PG
from ..ops import collectives
from ..ops import engine as _async
from . import mappings
from ._autocast import autocast_dtype, run_lowered
from ._once import first_order

#: Modes of the ``overlap=`` argument (``True`` picks ``"ring"`` with sequence
#: parallelism, ``"comm"`` without).
MODES = ("comm", "ring")
_RING_TAG = (1 << 16) + 7  # p2p tag of the ring steps (user tags are < 2**16)


_HINT = "Use overlap=False for double backward."


def resolve_mode(op: str, overlap: Any, sequence_parallel: bool) -> str | None:
    """``overlap=`` -> ``None`` (blocking), ``"comm"`` or ``"ring"``; ValueError otherwise."""
    if overlap is False or overlap is None:
        return None
    if overlap is True:
        return "ring" if sequence_parallel else "comm"
    if overlap == "ring" and not sequence_parallel:
        raise ValueError(
            f"diffcomm.{op}(): `overlap` must be False, True or 'comm' without sequence parallelism "
            "(the ring decomposes the sequence-parallel all_gather/reduce_scatter), got 'ring'"
        )
    if overlap not in MODES:
        raise ValueError(f"diffcomm.{op}(): `overlap` must be False, True, 'comm' or 'ring', got {overlap!r}")
    return str(overlap)


# ======================================================================================
# ring steps
# ======================================================================================


def _hop(x: Tensor, pg: PG, name: str) -> Tensor:
    """Launch: send ``x`` to rank r+1 and receive rank r-1's (same shape) on the engine."""
    b = B.get_backend()
    rank, world = b.rank(pg), b.world_size(pg)

    def raw(t: Tensor) -> Tensor:
        t = t.contiguous()
        out = torch.empty_like(t)
        with B.label(name):
            b.batch_p2p(
                [("send", t, (rank + 1) % world, _RING_TAG), ("recv", out, (rank - 1) % world, _RING_TAG)], pg
            )
        return out

    # private: the caller waits for every hop before it returns (nothing changes x meanwhile)
    return _async.launch(x, name, raw, x.shape, private=True)


def ring_all_gather_matmul(
    x: Tensor, fn: Any, dim: int, pg: PG, name: str, keep_gathered: bool = False
) -> tuple[Tensor, Tensor | None]:
    """``cat_j fn(x_j)`` along ``dim`` (``x_j``: rank j's ``x``), and optionally
    ``cat_j x_j`` (the all_gather), in ``world`` ring steps: step k computes ``fn`` of the
    block of rank ``r - k`` while that block travels on to rank ``r + 1``."""
    b = B.get_backend()
    rank, world = b.rank(pg), b.world_size(pg)
    outs: list[Tensor | None] = [None] * world
    blocks: list[Tensor | None] = [None] * world
    cur = x
    for k in range(world):
        j = (rank - k) % world
        nxt = _hop(cur, pg, f"{name} ring step {k + 1}/{world - 1}") if k < world - 1 else None
        cur = _async.wait(cur)
        blocks[j] = cur
        outs[j] = fn(cur)
        if nxt is not None:
            cur = nxt
    y = torch.cat(outs, dim)  # type: ignore[arg-type]
    gathered = torch.cat(blocks, dim) if keep_gathered else None  # type: ignore[arg-type]
    return y, gathered


def ring_matmul_reduce_scatter(fn: Any, pg: PG, name: str) -> Tensor:
    """``sum over ranks i of fn_i(r)`` on rank ``r``, where ``fn(j)`` is this rank's partial
    product for sequence block ``j``: a ring reduce_scatter whose step k computes the
    partial for block ``r - k - 1`` and adds the running sum that arrived from rank
    ``r - 1``, then sends it on while the next partial is computed."""
    b = B.get_backend()
    rank, world = b.rank(pg), b.world_size(pg)
    acc: Tensor | None = None
    for k in range(world):
        j = (rank - k - 1) % world
        part = fn(j)
        acc = part if acc is None else _async.wait(acc) + part
        if k < world - 1:
            acc = _hop(acc, pg, f"{name} ring step {k + 1}/{world - 1}")
    assert acc is not None
    return _async.wait(acc)


def _chunks(x: Tensor, dim: int, world: int) -> list[Tensor]:
    return list(x.chunk(world, dim))


# ======================================================================================
# column-parallel linear
# ======================================================================================


class _ColumnComm(torch.autograd.Function):
    """``F.linear(region(x), w, b)`` whose backward launches the input-gradient
    all_reduce / reduce_scatter before computing the weight and bias gradients.

    Not a ``CommOp``: a matmul fused with its communication (see the module docstring)."""

    spmd = Rule(
        {R: V, V: V},
        in_grad=REPLICATED,
        refuse={P: "reduce it first"},
        backward="input gradient all_reduced / reduce_scattered, overlapped",
    )

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, w: Tensor, b: Tensor | None, sp_dim: int | None, pg: PG, low: torch.dtype | None
    ) -> Tensor:
        if sp_dim is None:
            x_in = x.detach()
        else:
            world = B.get_backend().world_size(pg)
            with B.label("parallel.all_gather_from_sequence"):
                x_in = collectives.all_gather(x.detach(), sp_dim, pg, split_sizes=[x.shape[sp_dim]] * world)
        x_in = _lower(ctx, x_in, low)
        w_ = w.detach()
        # saved (not an inner graph kept on ctx): autograd's checks of in-place changes,
        # and a retained graph (backward(retain_graph=True)) runs its backward twice
        _keep(ctx, x_in, w_, sp_dim, pg, b)
        return F.linear(x_in, w_, None if b is None else b.detach())

    @staticmethod
    @first_order("parallel.ColumnParallelLinear(overlap='comm')", _HINT)
    def backward(ctx: Any, g: Tensor) -> tuple[Any, ...]:
        x_in, w = ctx.saved_tensors
        gx = None
        if ctx.needs_input_grad[0]:
            gx_part = g.matmul(w).to(ctx.x_dtype)  # (communicated in the input's dtype)
            pg, dim = ctx.pg, ctx.dim
            if dim is None:
                name = "parallel.copy_to_region backward"
                gx = _async.launch(
                    gx_part,
                    name,
                    lambda t: _labelled(name, collectives.all_reduce, t, "sum", pg),
                    gx_part.shape,
                    private=True,  # (computed here for the launch)
                )
            else:
                name = "parallel.all_gather_from_sequence backward"
                shape = list(gx_part.shape)
                shape[dim] //= B.get_backend().world_size(pg)
                gx = _async.launch(
                    gx_part,
                    name,
                    lambda t: _labelled(name, collectives.reduce_scatter, t, dim, "sum", pg),
                    shape,
                    private=True,  # (computed here for the launch)
                )
        # the weight and bias gradients while the input gradient's communication runs
        return (gx, *_weight_and_bias_grads(ctx, g, x_in), None, None, None)


def _keep(ctx: Any, x: Tensor | None, w: Tensor, dim: int | None, pg: PG, b: Tensor | None) -> None:
    """What a column linear's backward reads: the (gathered) input and the weight, saved;
    the sequence dim, the group and whether there is a bias."""
    ctx.save_for_backward(x, w)
    ctx.dim, ctx.pg, ctx.has_bias = dim, pg, b is not None


def _lower(ctx: Any, x: Tensor, low: torch.dtype | None) -> Tensor:
    """``x`` in ``low`` (the autocast dtype, or ``None``) for the matmul, as autocast casts
    ``F.linear``'s input; ``ctx.x_dtype``: the input's own dtype, in which the input
    gradient is communicated (as the blocking mapping before ``F.linear`` does)."""
    ctx.x_dtype = x.dtype
    return x if low is None else x.to(low)


def _weight_and_bias_grads(ctx: Any, g: Tensor, x: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """A column linear's weight and bias gradients from the output gradient ``g`` and the
    (gathered) input ``x``, those its inputs 1 and 2 need."""
    g2 = g.reshape(-1, g.shape[-1])
    gw = g2.t().mm(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
    gb = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return gw, gb


def _labelled(name: str, fn: Any, *args: Any) -> Tensor:
    with B.label(name):
        return fn(*args)


def _ring_rule(shard: str, backward: str) -> Rule:
    """The typing rule of a ring Function: its input is this rank's ``shard`` (varying)."""
    return Rule(
        {V: V},
        refuse={R: f"the input must be this rank's {shard}", P: "reduce it first"},
        backward=backward,
    )


class _ColumnRing(torch.autograd.Function):
    """Sequence-parallel column linear: ring all_gather -> matmul forward, ring
    matmul -> reduce_scatter backward.

    Not a ``CommOp``: a matmul fused with its communication (see the module docstring)."""

    spmd = _ring_rule("sequence chunk", "ring matmul -> reduce_scatter")

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, w: Tensor, b: Tensor | None, dim: int, pg: PG, low: torch.dtype | None
    ) -> Tensor:
        x, w_, b_ = x.detach(), w.detach(), None if b is None else b.detach()
        y, x_full = ring_all_gather_matmul(
            x,
            lambda xj: F.linear(xj if low is None else xj.to(low), w_, b_),
            dim,
            pg,
            "parallel.all_gather_from_sequence",
            keep_gathered=True,
        )
        assert x_full is not None
        _keep(ctx, _lower(ctx, x_full, low), w_, dim, pg, b)
        return y

    @staticmethod
    @first_order("parallel.ColumnParallelLinear(overlap='ring')", _HINT)
    def backward(ctx: Any, g: Tensor) -> tuple[Any, ...]:
        x_full, w = ctx.saved_tensors
        dim, pg = ctx.dim, ctx.pg
        world = B.get_backend().world_size(pg)
        gx = None
        if ctx.needs_input_grad[0]:
            g_blocks = _chunks(g, dim, world)
            name = "parallel.all_gather_from_sequence backward"
            # summed in the input's dtype
            gx = ring_matmul_reduce_scatter(lambda j: g_blocks[j].matmul(w).to(ctx.x_dtype), pg, name)
        return (gx, *_weight_and_bias_grads(ctx, g, x_full), None, None, None)


def _blocking() -> bool:
    """Whether to run the blocking mappings: a ``torch.func`` transform or a forward-mode
    AD level (``torch.autograd.forward_ad.dual_level()``) is active, or torch's
    ``LocalTensorMode`` (one program for every rank: no transport to overlap, and the ring
    reads this rank as a Python int)."""
    return _torch.transforms_active() or _torch.forward_ad_level() >= 0 or _torch.local_tensor_mode_on()


def column_linear(x: Tensor, w: Tensor, b: Tensor | None, mode: str, sp_dim: int | None, pg: PG) -> Tensor:
    """The overlapped ``ColumnParallelLinear`` forward (before any ``gather_output``);
    under a ``torch.func`` transform or forward-mode AD, the blocking mappings (the same
    values and gradients: the transforms see every op, and nothing runs behind them to
    overlap; the fused Functions here have no forward-mode rule). The ring, while
    ``torch.compile`` traces, also runs the blocking mappings: its steps are point-to-point
    exchanges on the communication engine, which dynamo cannot trace (the traceable
    backend has no ``batch_p2p``: every compiled ``overlap="ring"`` layer failed with
    ``AttributeError: 'TraceableBackend' object has no attribute 'batch_p2p'``); the graph
    gets the all_gather / reduce_scatter the ring decomposes, which a compiler's own
    scheduling may overlap."""
    if _blocking() or (mode == "ring" and sp_dim is not None and _torch.compiling()):
        if sp_dim is None:
            return F.linear(mappings.copy_to_region(x, pg), w, b)
        return F.linear(mappings.all_gather_from_sequence(x, sp_dim, pg), w, b)
    fused = _ColumnRing if mode == "ring" and sp_dim is not None else _ColumnComm
    low = autocast_dtype(x)
    if low is None:
        return fused.apply(x, w, b, sp_dim, pg, None)
    # under autocast, as the blocking path: the input communicated in its own dtype, the
    # matmuls in autocast's (torch's autocast does not see into the Function)
    with torch.autocast(x.device.type, enabled=False):
        return fused.apply(x, w.to(low), None if b is None else b.to(low), sp_dim, pg, low)


# ======================================================================================
# row-parallel linear (sequence parallel, ring)
# ======================================================================================


class _RowRing(torch.autograd.Function):
    """``reduce_scatter_to_sequence(F.linear(x, w))`` with the ring: matmul ->
    reduce_scatter forward, all_gather -> matmul backward.

    Not a ``CommOp``: a matmul fused with its communication (see the module docstring)."""

    spmd = _ring_rule("feature shard", "all_gather -> matmul ring")

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, dim: int, pg: PG) -> Tensor:
        x, w_ = x.detach(), w.detach()
        world = B.get_backend().world_size(pg)
        x_blocks = _chunks(x, dim, world)
        y = ring_matmul_reduce_scatter(
            lambda j: F.linear(x_blocks[j], w_), pg, "parallel.reduce_scatter_to_sequence"
        )
        ctx.save_for_backward(x, w_)
        ctx.dim, ctx.pg = dim, pg
        return y

    @staticmethod
    @first_order("parallel.RowParallelLinear(overlap='ring')", _HINT)
    def backward(ctx: Any, g: Tensor) -> tuple[Any, ...]:
        x, w = ctx.saved_tensors
        gx, g_full = ring_all_gather_matmul(
            g.contiguous(),
            lambda gj: gj.matmul(w),
            ctx.dim,
            ctx.pg,
            "parallel.reduce_scatter_to_sequence backward",
            keep_gathered=ctx.needs_input_grad[1],
        )
        gw = None
        if ctx.needs_input_grad[1]:
            assert g_full is not None
            gw = g_full.reshape(-1, g_full.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))
        return (gx if ctx.needs_input_grad[0] else None), gw, None, None


def row_linear_sequence_ring(x: Tensor, w: Tensor, dim: int, pg: PG) -> Tensor:
    """The overlapped sequence-parallel ``RowParallelLinear`` matmul + reduce_scatter
    (under a ``torch.func`` transform or forward-mode AD the blocking mapping, as
    :func:`column_linear`)."""
    if _blocking() or _torch.compiling():  # (the ring does not trace: see column_linear)
        return mappings.reduce_scatter_to_sequence(F.linear(x, w), dim, pg)
    return run_lowered(_RowRing.apply, (x, w), dim, pg)  # (under autocast: as F.linear)
