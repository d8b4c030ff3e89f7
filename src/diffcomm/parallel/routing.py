"""Token routing for expert parallelism: ``route``, the differentiable pair ``dispatch`` /
``combine`` and ``load_balancing_loss``; the layer built on them is in
:mod:`diffcomm.parallel.moe` (whose docstring has the picture and the convention).

``dispatch`` sends every token to the ranks holding its chosen experts with one uneven
:func:`diffcomm.all_to_all`, after **one** exchange of the per-expert counts (the
:class:`DispatchPlan`, the same table on every rank, from which the split sizes, the
capacity drops and the permutations follow); ``combine`` brings the experts' outputs
back with the all_to_all of the other direction and adds them, weighted by the gates,
into their tokens. Both are compositions of differentiable ops whose adjoints are exact
(the all_to_all with the split sizes swapped, gathers and index-adds), so the backward of
the dispatch is a combine and the backward of the combine a dispatch, with the counts
of the forward: nothing is exchanged again.
"""

# Size: ~840 lines, over the ~600 guideline: route, the dispatch plan (with the drops by
# position), dispatch and combine with their asynchronous variants are one data flow (the
# plan travels between them).

from __future__ import annotations

import functools
import importlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .. import _config, _torch
from .. import backend as B
from .._replication import HOOK, spmd_types_checking, spmd_types_invariant, spmd_types_like
from ..backend import args as A
from ..backend.args import PG
from ..backend.consistency import check_settings
from ..backend.local_tensor import LocalTensorBackend
from ..ops import collectives
from ..ops import engine as _async
from ._module import check_positive, resolve_parallel_group

if TYPE_CHECKING:
    from ..ops.precision import Precision
_FUNCTION_ATTRS = torch.autograd.Function.__dict__  # (see _replication.spmd_types_checking)

__all__ = ["DispatchPlan", "route", "dispatch", "combine", "load_balancing_loss"]


# ======================================================================================
# routing
# ======================================================================================


def route(logits: Tensor, k: int, *, renormalize: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Top-``k`` routing of tokens to experts.

    Args:
        logits: ``(T, E)`` router scores.
        k: experts per token (``1 <= k <= E``).
        renormalize: divide each token's ``k`` gate weights by their sum (Mixtral);
            ``False`` keeps the softmax probabilities (Switch, GShard).

    Returns:
        ``(gate_weights (T, k), expert_index (T, k) int64, probs (T, E))``: the weights of
        the chosen experts, their ids (in decreasing probability) and the softmax of
        ``logits``.

    Gradient:
        through the softmax (``gate_weights`` and ``probs``); ``expert_index`` is discrete.
    """
    if not isinstance(logits, Tensor):
        raise A.arg_error("parallel.route", "logits", "a tensor", type(logits).__name__, TypeError)
    if logits.ndim != 2:
        raise A.arg_error(
            "parallel.route", "logits", "a (tokens, experts) tensor", f"shape {list(logits.shape)}"
        )
    if not logits.dtype.is_floating_point:
        raise A.arg_error("parallel.route", "logits", "a floating-point tensor", logits.dtype, TypeError)
    e = logits.shape[1]
    k = check_positive("parallel.route", "k", k)
    if k > e:
        raise A.arg_error("parallel.route", "k", f"at most the number of experts {e}", k)
    probs = logits.softmax(dim=-1)
    gate, index = probs.topk(k, dim=-1)
    if renormalize:
        gate = gate / gate.sum(dim=-1, keepdim=True)
    return gate, index, probs


# ======================================================================================
# dispatch / combine
# ======================================================================================


@dataclass(frozen=True)
class DispatchPlan:
    """Where every token assignment goes: made by :func:`dispatch`, used by :func:`combine`.

    Attributes:
        num_experts: ``E``, experts over the whole group.
        world, rank: the expert-parallel group's size and this rank.
        counts: ``(world, E)`` assignments per source rank and expert before dropping
            (the exchanged table; the same on every rank).
        accepted: ``(world, E)`` the same after dropping (equal to ``counts`` when dropless).
        capacity: tokens an expert takes (``None``: dropless).
        send_splits / recv_splits: rows this rank sends to / receives from each rank.
        expert_splits: rows of each local expert in the expert-major input (sum of
            ``recv_splits``).
        token_index: ``(n_sent,)`` the token of each row sent (in send order).
        slot_index: ``(n_sent,)`` its position in the flattened ``(T, k)`` assignments.
        recv_order: ``(n_recv,)`` received rows in expert-major order (indices into the
            received, source-major rows); ``recv_inverse`` its inverse permutation.
        source_major: the two orders coincide (one expert per rank, or a world of one).
        num_tokens: ``T`` of this rank; ``total_tokens``: ``N`` of all ranks.
        group: the resolved group.
        k: experts per token (the columns of ``expert_index``; ``combine``'s
            ``gate_weights`` must have as many).
        routing: ``(T, k)`` int64, a copy of the ``expert_index`` the plan was made from
            (a reused plan is checked against the new index locally, no communication).
        capacity_factor: the ``capacity_factor`` the plan was made with.
        positions: ``(T,)`` int64, a copy of the ``positions`` the plan was made with
            (``None``: none; the drops then follow rank order).

    Under torch's ``LocalTensorMode`` (one program for every simulated rank) the
    rank's own fields hold each simulated rank's: ``rank``, the splits and
    ``num_tokens`` as ints that differ per rank (``SymInt`` s), the index tensors as
    ``LocalTensor`` s.
    """

    num_experts: int
    world: int
    rank: int
    counts: tuple[tuple[int, ...], ...]
    accepted: tuple[tuple[int, ...], ...]
    capacity: int | None
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    expert_splits: tuple[int, ...]
    token_index: Tensor
    slot_index: Tensor
    recv_order: Tensor
    recv_inverse: Tensor
    source_major: bool
    num_tokens: int
    total_tokens: int
    group: PG
    k: int = 1
    routing: Tensor | None = None
    capacity_factor: float | None = None
    positions: Tensor | None = None

    @property
    def tokens_per_expert(self) -> Tensor:
        """``(E,)`` int64: assignments each expert got over the whole group, before dropping
        (the routing histogram)."""
        return torch.tensor([sum(col) for col in zip(*self.counts)], dtype=torch.int64)

    @property
    def dropped(self) -> int:
        """Assignments dropped over the whole group (0 when dropless)."""
        return sum(map(sum, self.counts)) - sum(map(sum, self.accepted))


@functools.partial(
    _torch.compiler_disable,
    reason=(
        "diffcomm.parallel.dispatch: the routing plan exchanges every rank's per-expert "
        "token counts as host integers (the all_to_all's split sizes), which dynamo cannot "
        "trace; under torch.compile it runs eagerly between the graphs (a graph break). "
        "For fullgraph=True, compute the plan outside the compiled function and pass plan="
    ),
)
def _plan(
    expert_index: Tensor,
    num_experts: int,
    pg: PG,
    capacity_factor: float | None,
    mine: list[int] | None = None,
    positions: Tensor | None = None,
) -> DispatchPlan:
    """The routing plan: one exchange of this rank's per-expert counts (``mine``, when
    the caller counted them) and token count; with ``positions`` and a capacity, a second
    one of every rank's positions and expert ids (:func:`_drops_by_position`)."""
    b = B.get_backend()
    world = b.world_size(pg)
    t, k = expert_index.shape
    e = num_experts
    per_rank = e // world
    flat = expert_index.reshape(-1)
    dev = flat.device
    if mine is None:
        mine = _local_counts(flat, e)  # the host read the exchange needs anyway
    # the settings that shape the plan travel with the counts (free: the same exchange), so
    # ranks that disagree on them raise here instead of sending by plans that do not match
    settings = [k, A.float_bits(capacity_factor), int(positions is not None)]
    with B.label("parallel.dispatch (counts exchange)"):  # the step's one exchange
        table = b.exchange_size_lists([*mine, t, *settings], pg)
    _check_settings([row[e + 1 :] for row in table])
    counts = tuple(tuple(row[:e]) for row in table)
    total = sum(row[e] for row in table)
    capacity = None
    accepted = counts
    if capacity_factor is not None:
        capacity = math.ceil(capacity_factor * total * k / e)
        taken = [0] * e
        acc = []
        for row in counts:  # rank order = the serial MoE's token order
            got = tuple(min(c, max(0, capacity - taken[j])) for j, c in enumerate(row))
            taken = [a + g for a, g in zip(taken, got)]
            acc.append(got)
        accepted = tuple(acc)
    if capacity is not None and positions is not None:  # the serial order is the positions'
        sizes = [row[e] for row in table]
        mine_rows = torch.cat([positions.long().unsqueeze(1), expert_index.long()], 1)
        with B.label("parallel.dispatch (positions exchange)"):
            every = b.all_gather(mine_rows, pg, sizes)

        def part_of(r: int, f: Tensor, g: Tensor) -> tuple[Any, ...]:
            acc, keep = _drops_by_position(g, sizes, r, k, e, capacity)
            return acc, _rank_part(r, f, world, e, k, counts, acc, capacity, keep.to(f.device))

        if isinstance(b, LocalTensorBackend):
            accepted, part = b.each_rank(pg, part_of, flat, every)
        else:
            accepted, part = part_of(b.rank(pg), flat, every)
    else:
        plan = (world, e, k, counts, accepted, capacity)
        if isinstance(b, LocalTensorBackend):  # torch's LocalTensorMode: each simulated rank's
            part = b.each_rank(pg, lambda r, f: _rank_part(r, f, *plan), flat)  # from its routing
        else:
            part = _rank_part(b.rank(pg), flat, *plan)
    rank, send, recv, expert_splits, token_index, order, recv_order, recv_inverse = part
    return DispatchPlan(
        num_experts=e,
        world=world,
        rank=rank,
        counts=counts,
        accepted=accepted,
        capacity=capacity,
        send_splits=send,
        recv_splits=recv,
        expert_splits=expert_splits,
        token_index=token_index.to(dev),
        slot_index=order.to(dev),
        recv_order=recv_order.to(dev),
        recv_inverse=recv_inverse.to(dev),
        source_major=per_rank == 1 or world == 1,
        num_tokens=t,
        total_tokens=total,
        group=pg,
        k=k,
        routing=expert_index.detach().clone(),
        capacity_factor=capacity_factor,
        positions=None if positions is None else positions.detach().to(torch.int64, copy=True),
    )


def _check_settings(rows: list[list[int]]) -> None:
    """Raise :class:`~diffcomm.CrossRankMismatchError` naming the ranks and their values when
    the group's ranks called :func:`dispatch` with another ``k`` (expert_index.shape[1]),
    ``capacity_factor`` or ``positions`` given on some only (``rows``: each rank's
    settings, from the counts exchange). Each would plan other split sizes than its peers:
    rows sent where none are expected (silently wrong values, before), or an exchange of
    positions some ranks never join."""
    check_settings("parallel.dispatch", _SHOWN_SETTINGS, rows)


#: :func:`_check_settings`'s settings in the order they ride, with their values' words
_SHOWN_SETTINGS = (
    ("k (expert_index.shape[1])", lambda v: v),
    ("capacity_factor", A.float_of_bits),
    ("positions", lambda v: "given" if v else "None"),
)


def _drops_by_position(
    every: Tensor, sizes: list[int], rank: int, k: int, e: int, capacity: int
) -> tuple[tuple[tuple[int, ...], ...], Tensor]:
    """The capacity drops in the serial order given by the positions: ``every`` is the
    ``(N, 1 + k)`` rows ``[position, expert ids]`` of all ranks' tokens (rank-major,
    ``sizes[s]`` rows of rank ``s``). Each expert keeps its first ``capacity`` assignments
    sorted by (position, slot) — the serial MoE's order on its tokens in position order,
    flattened ``(N, k)``. Returns ``(accepted (world, E), keep (T_rank * k,) bool)``: the
    kept assignments per rank and expert, and which of this rank's flattened assignments
    are kept. A position given twice raises ``ValueError`` (on every rank: all see it)."""
    every = every.cpu()
    n, world = every.shape[0], len(sizes)
    pos = every[:, 0]
    if pos.unique().numel() != n:
        raise A.arg_error(
            "parallel.dispatch",
            "positions",
            "distinct global token positions over all ranks (one per token)",
            f"{n - pos.unique().numel()} position(s) given more than once",
        )
    ids = every[:, 1:].reshape(-1)
    by_token = torch.sort(pos, stable=True).indices  # the serial token order
    serial = (by_token.unsqueeze(1) * k + torch.arange(k)).reshape(-1)  # then slot order
    ids_serial = ids[serial]
    by_expert = torch.sort(ids_serial, stable=True).indices
    per_expert = torch.bincount(ids_serial, minlength=e)
    starts = torch.cumsum(per_expert, 0) - per_expert
    within = torch.empty_like(by_expert)
    within[by_expert] = torch.arange(ids.numel()) - starts[ids_serial[by_expert]]
    keep = torch.empty(ids.numel(), dtype=torch.bool)
    keep[serial] = within < capacity
    source = torch.arange(world).repeat_interleave(torch.tensor(sizes, dtype=torch.int64) * k)
    table = torch.bincount(source * e + ids, weights=keep.double(), minlength=world * e)
    accepted = tuple(tuple(int(v) for v in row) for row in table.view(world, e).tolist())
    lo = sum(sizes[:rank]) * k
    return accepted, keep[lo : lo + sizes[rank] * k]


def _rank_part(
    rank: int,
    flat: Tensor,
    world: int,
    e: int,
    k: int,
    counts: tuple[tuple[int, ...], ...],
    accepted: tuple[tuple[int, ...], ...],
    capacity: int | None,
    keep: Tensor | None = None,
) -> tuple[Any, ...]:
    """Rank ``rank``'s part of the plan from its flattened routing ``flat`` and the
    exchanged tables: ``(rank, send, recv, expert_splits, token_index, slot_index,
    recv_order, recv_inverse)``. ``keep``: which of ``flat`` are kept (the drops by
    position); without it an expert keeps a prefix of this rank's assignments."""
    per_rank = e // world
    dev = flat.device
    # this rank's assignments sorted by expert (stable: token order within an expert)
    order = torch.sort(flat, stable=True).indices
    keep_n = accepted[rank]
    if keep is not None:
        order = order[keep[order]]
    elif capacity is not None and flat.numel():
        sorted_e = flat[order]
        starts = torch.tensor([sum(counts[rank][:j]) for j in range(e)], dtype=torch.int64, device=dev)
        pos = torch.arange(flat.numel(), device=dev) - starts[sorted_e]
        order = order[pos < torch.tensor(keep_n, dtype=torch.int64, device=dev)[sorted_e]]
    token_index = order // k if k > 1 else order
    send = tuple(sum(keep_n[q * per_rank : (q + 1) * per_rank]) for q in range(world))
    mine_lo = rank * per_rank
    recv = tuple(sum(accepted[s][mine_lo : mine_lo + per_rank]) for s in range(world))
    # received rows are source-major (then expert); the experts want expert-major
    pieces, start = [], 0
    offsets = []
    for s in range(world):
        at = start
        starts_here = []
        for j in range(per_rank):
            starts_here.append(at)
            at += accepted[s][mine_lo + j]
        offsets.append(starts_here)
        start += recv[s]
    for j in range(per_rank):
        for s in range(world):
            n = accepted[s][mine_lo + j]
            if n:
                pieces.append(torch.arange(offsets[s][j], offsets[s][j] + n))
    recv_order = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)
    recv_inverse = torch.empty_like(recv_order)
    recv_inverse[recv_order] = torch.arange(recv_order.numel())
    expert_splits = tuple(sum(accepted[s][mine_lo + j] for s in range(world)) for j in range(per_rank))
    return rank, send, recv, expert_splits, token_index, order, recv_order, recv_inverse


def refuse_batched_routing(op: str, what: str, batched: bool) -> None:
    """``ValueError`` when the routing is batched by ``torch.func.vmap`` (``batched``, about
    ``what``): each batch element routes its tokens to other experts, so each needs its own
    split sizes, which one all_to_all for the whole batch cannot have (the counts' host read
    saw the batch as one: a misleading "expert ids out of range" before)."""
    if batched:
        raise ValueError(
            f"diffcomm.{op}(): {what} is batched by torch.func.vmap (an ensemble from "
            "stack_module_state, per-example gradients, jacrev): the token routing is "
            "data-dependent, each batch element would send its tokens to other experts with "
            "other split sizes, which one all_to_all for the whole batch cannot do. Loop over "
            "the batch (ensemble members, examples) in Python instead; torch.func.grad / vjp "
            "without vmap work"
        )


def _local_counts(flat: Tensor, e: int) -> list[int]:
    """Assignments per expert on this rank; ids outside ``[0, e)`` raise (named) here,
    before any communication."""
    if not flat.numel():
        return [0] * e
    try:
        mine = torch.bincount(flat, minlength=e).tolist()
    except RuntimeError:  # a negative id
        mine = [0] * (e + 1)
    if len(mine) > e:
        raise A.arg_error("parallel.dispatch", "expert_index", f"expert ids in [0, {e})", "ids out of range")
    return mine


def check_positions(op: str, positions: Any, x: Tensor) -> None:
    """``positions`` of :func:`dispatch`: ``(T,)`` integers on ``x``'s device (checked
    before any communication; duplicates over the ranks only after the exchange)."""
    if not isinstance(positions, Tensor):
        raise A.arg_error(op, "positions", "None or a tensor", type(positions).__name__, TypeError)
    if positions.ndim != 1 or positions.shape[0] != x.shape[0]:
        want = f"a ({x.shape[0]},) tensor (one per token of x)"
        raise A.arg_error(op, "positions", want, f"shape {list(positions.shape)}")
    if positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool:
        raise A.arg_error(op, "positions", "an integer tensor", positions.dtype, TypeError)
    if positions.device != x.device:
        raise A.arg_error(op, "positions", f"a tensor on x's device {x.device}", positions.device)


def _same_positions(made: Tensor | None, given: Tensor | None) -> bool:
    """Whether a reused plan's ``positions`` are the ones given now (a local comparison)."""
    if made is None or given is None:
        return made is None and given is None
    return tuple(made.shape) == tuple(given.shape) and torch.equal(
        made, given.to(device=made.device, dtype=torch.int64)
    )


def _no_async_precision(op: str, async_op: Any) -> None:
    """``async_op=True`` with ``precision=`` (not supported: the quantized all_to_all is
    blocking), refused naming ``op`` before any communication."""
    if async_op:
        raise A.arg_error(op, "async_op", "False with precision= (not supported yet)", async_op)


class _Permute(torch.autograd.Function):
    """Rows of ``x`` in the order ``perm`` (a permutation, ``inverse`` its inverse).

    ``x.index_select(0, perm)`` would do, but its backward scatters the gradient into
    zeros (``index_add``); for a permutation the adjoint is the gather with the inverse,
    about half the memory traffic. The backward applies this Function again (so double
    backward works); the tangent goes through the same permutation."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, perm: Tensor, inverse: Tensor) -> Tensor:
        return x.index_select(0, perm)

    @staticmethod
    def spmd_typecheck(*, x: Tensor, perm: Tensor, inverse: Tensor) -> Tensor:
        """spmd_types' rule (read only by its checker): local, no communication; the
        output has ``x``'s type (the permutation is this rank's own index data)."""
        importlib.import_module("spmd_types.rules").ignore(perm, inverse)
        return x

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.perm, ctx.inverse = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        return _Permute.apply(g, ctx.inverse, ctx.perm), None, None

    @staticmethod
    def jvp(ctx: Any, t: Tensor, *_: Any) -> Tensor:
        return _Permute.apply(t, ctx.perm, ctx.inverse)


def _permute(x: Tensor, perm: Tensor, inverse: Tensor, identity: bool) -> Tensor:
    return x if identity else _Permute.apply(x, perm, inverse)


def dispatch(
    x: Tensor,
    expert_index: Tensor,
    num_experts: int,
    group: A.GroupLike = None,
    *,
    capacity_factor: float | None = None,
    plan: DispatchPlan | None = None,
    async_op: bool = False,
    precision: Precision | None = None,
    positions: Tensor | None = None,
) -> tuple[Tensor, DispatchPlan]:
    """Send every token to the ranks holding its chosen experts (one uneven all_to_all).

    Args:
        x: ``(T, H)`` this rank's tokens (``T`` may differ between ranks, also 0).
        expert_index: ``(T, k)`` int64 expert ids in ``[0, num_experts)`` (from
            :func:`route`); the same ``k`` on every rank.
        num_experts: ``E`` over the whole group, divisible by the group size; rank ``r``
            holds experts ``[r * E / world, (r + 1) * E / world)``.
        group: the expert-parallel group: ``None`` (world), a ``ProcessGroup`` or
            ``(DeviceMesh, axis)``.
        capacity_factor: ``None`` (dropless) or a positive float: each expert takes at
            most ``ceil(capacity_factor * N * k / E)`` assignments of the ``N`` tokens of
            all ranks, first come first served in the serial order: rank order then token
            order (the serial MoE's when the ranks hold consecutive runs of its tokens),
            or by ``positions``; the rest are dropped.
        plan: the :class:`DispatchPlan` of an earlier dispatch of the **same routing**
            (``expert_index``, ``capacity_factor`` and ``positions`` unchanged: activation
            recomputation, a second tensor routed alike): reused, nothing exchanged.
            The plan keeps a copy of its ``expert_index`` and ``positions``: a different
            one (or ``capacity_factor``) raises ``ValueError`` naming ``plan`` (a local
            comparison: one device-to-host read of a bool, no communication).
        async_op: ``expert_inputs`` is returned at once as an
            :class:`~diffcomm.AsyncTensor` that waits on first use (usable in any torch
            op; ``.wait()`` gives the finished tensor): compute something else (a shared
            expert) meanwhile. (Blocking, a plain tensor, where asynchronous ops cannot
            run — ``torch.compile``, ``torch.func`` — and with more than one expert per
            rank under ``dc.spmd_check``, which types the finished rows.)
        precision: a :class:`~diffcomm.Precision` for the all_to_all (forward settings)
            and its backward (``backward`` settings); fp8 blocks run along ``H``
            (``docs/precision.md``).
        positions: ``(T,)`` integer tensor (on ``x``'s device), each token's index in
            the serial model's token order (for a ``(B, S, H)`` activation sharded along
            ``S``: ``b * S + s``), distinct over all ranks. With ``capacity_factor`` the
            drops follow it: each expert keeps the ``C`` assignments first by (position,
            then the token's ``k`` slots in order), exactly the serial MoE's drops on the
            tokens in position order, whatever the ranks hold (a context-parallel sequence
            shard). Costs a second exchange (``T * (k + 1)`` ints per rank, labelled
            ``parallel.dispatch (positions exchange)``); a position given twice raises
            ``ValueError`` on every rank. ``None``: rank order. (Dropless: not exchanged,
            the order does not matter.)

    Returns:
        ``(expert_inputs, plan)``: ``expert_inputs`` is ``(sum(plan.expert_splits), H)``,
        the rows of this rank's experts, expert by expert (split it with
        ``plan.expert_splits``); ``plan`` is the :class:`DispatchPlan` for :func:`combine`.

    Gradient:
        the adjoint: the all_to_all back with the split sizes swapped (no exchange), the
        rows added into their tokens' gradients (a token sent to ``k`` experts gets the sum).
        The counts are exchanged once, here (a host read); nothing else synchronises.

    Example::

        def f():
            x = torch.randn(4, 8)
            gate, idx, _ = dc.parallel.route(torch.randn(4, 4), k=2)
            h, plan = dc.parallel.dispatch(x, idx, num_experts=4)
            return h.shape, plan.expert_splits
        with dc.LocalWorld(2) as world:
            world.run(f)   # each rank: its 2 experts' rows
    """
    op = "parallel.dispatch"
    if not isinstance(x, Tensor) or x.ndim != 2:
        raise A.arg_error(op, "x", "a (tokens, hidden) tensor", getattr(x, "shape", type(x).__name__))
    if (
        not isinstance(expert_index, Tensor)
        or expert_index.ndim != 2
        or expert_index.shape[0] != x.shape[0]
        or expert_index.shape[1] < 1
    ):
        raise A.arg_error(
            op,
            "expert_index",
            f"a ({x.shape[0]}, k) tensor of expert ids, k >= 1 (one row per token of x)",
            getattr(expert_index, "shape", type(expert_index).__name__),
        )
    if expert_index.dtype not in (torch.int64, torch.int32):
        raise A.arg_error(op, "expert_index", "an int64 tensor", expert_index.dtype, TypeError)
    pg, world, _ = resolve_parallel_group(op, group)
    num_experts = check_positive(op, "num_experts", num_experts)
    if num_experts % world:
        raise A.arg_error(op, "num_experts", f"divisible by the group size {world}", num_experts)
    if capacity_factor is not None and not (float(capacity_factor) > 0):
        raise A.arg_error(op, "capacity_factor", "None or a positive float", capacity_factor)
    if precision is not None:  # before the counts are exchanged
        from ..ops.precision import check as _check_precision

        _check_precision(x, precision, op)
        _no_async_precision(op, async_op)
    if positions is not None:
        check_positions(op, positions, x)
    if _torch.transforms_active():
        refuse_batched_routing(op, "`expert_index`", _torch.vmap_batched(expert_index))
    ids, mine = expert_index, None
    if plan is None:  # ids out of range are named here, before any communication
        ids = expert_index.long()
        mine = _local_counts(ids.reshape(-1), num_experts)
    elif not isinstance(plan, DispatchPlan):
        raise A.arg_error(
            op, "plan", "None or a DispatchPlan from dispatch()", type(plan).__name__, TypeError
        )
    elif (
        plan.num_tokens != x.shape[0]
        or plan.num_experts != num_experts
        or plan.world != world
        or plan.k != expert_index.shape[1]
    ):
        raise A.arg_error(
            op,
            "plan",
            f"a plan of the same routing ({x.shape[0]} tokens, k={expert_index.shape[1]}, "
            f"{num_experts} experts, {world} ranks)",
            f"a plan of {plan.num_tokens} tokens, k={plan.k}, {plan.num_experts} experts, {plan.world} ranks",
        )
    elif plan.routing is not None and not torch.equal(
        plan.routing, expert_index.to(device=plan.routing.device, dtype=torch.int64)
    ):  # a local comparison: the plan would send the rows by the old routing
        raise A.arg_error(
            op,
            "plan",
            "the plan of this same `expert_index` (the routing changed since the plan was made: "
            "dispatch without plan= to make a new one)",
            "a plan of another routing",
        )
    elif plan.routing is not None and plan.capacity_factor != (
        None if capacity_factor is None else float(capacity_factor)
    ):
        raise A.arg_error(
            op,
            "plan",
            f"a plan made with capacity_factor={capacity_factor}",
            f"a plan made with capacity_factor={plan.capacity_factor}",
        )
    elif plan.routing is not None and not _same_positions(plan.positions, positions):
        raise A.arg_error(
            op,
            "plan",
            "the plan of these same `positions` (dispatch without plan= to make a new one)",
            "a plan made without positions"
            if plan.positions is None
            else "a plan made with positions (none given now)"
            if positions is None
            else "a plan made with other positions",
        )
    if _config.DEBUG.get():  # the routing's shape must agree (else the splits would not)
        fields = {
            "num_experts": num_experts,
            "k": expert_index.shape[1],
            "capacity_factor": str(capacity_factor),
            "positions": "None" if positions is None else "given",
        }
        fields.update(hidden=tuple(x.shape[1:]), dtype=x.dtype, plan_given=plan is not None)
        B.get_backend().check_consistent(op, fields, pg)
    if plan is None:
        factor = None if capacity_factor is None else float(capacity_factor)
        plan = _plan(ids, num_experts, pg, factor, mine, positions)
    rows = x.index_select(0, plan.token_index)
    with B.label("parallel.dispatch"):
        got = collectives.all_to_all(
            rows,
            group=pg,
            input_split_sizes=plan.send_splits,
            output_split_sizes=plan.recv_splits,
            async_op=async_op,
            precision=precision,
        )
    if isinstance(got, _async.AsyncTensor) and not plan.source_major:
        if HOOK[0] is not None:  # under dc.spmd_check: blocking, so the rows keep their type
            got = _async.wait(got)
        else:
            return _permute_async(got, plan), plan
    return _permute(got, plan.recv_order, plan.recv_inverse, plan.source_major), plan


def _permute_async(got: _async.AsyncTensor, plan: DispatchPlan) -> _async.AsyncTensor:
    """The expert-major rows of an asynchronous dispatch, itself an
    :class:`~diffcomm.AsyncTensor`: the permutation runs on the communication engine right
    after the all_to_all (jobs run in launch order), so the caller gets the documented
    tensor that waits on first use, not a wrapper. Backward: the inverse permutation."""
    perm, inverse = plan.recv_order, plan.recv_inverse
    return _async.launch(
        got,
        "parallel.dispatch (expert order)",
        lambda t: t.index_select(0, perm),
        got.shape,
        backward=lambda g: _Permute.apply(g, inverse, perm),
        private=True,  # (dispatch's own rows: nothing else holds them)
    )


def combine(
    expert_outputs: Tensor,
    gate_weights: Tensor,
    plan: DispatchPlan,
    *,
    precision: Precision | None = None,
    async_op: bool = False,
) -> Tensor:
    """Bring the experts' outputs back to their tokens, weighted by the gate weights.

    Args:
        expert_outputs: ``(sum(plan.expert_splits), H_out)`` this rank's experts' outputs,
            expert-major as :func:`dispatch` gave the inputs.
        gate_weights: ``(T, k)`` the weight of each chosen expert (from :func:`route`).
        plan: the :class:`DispatchPlan` of the matching :func:`dispatch`.
        precision: a :class:`~diffcomm.Precision` for the all_to_all back (forward
            settings) and its backward (``backward`` settings) (``docs/precision.md``).
        async_op: the result is returned at once as an :class:`~diffcomm.AsyncTensor`
            (the all_to_all and then the weighting run on the communication engine; the
            first use waits): compute something else meanwhile, as with
            :func:`dispatch`. Values and gradients equal the blocking call's. (Blocking
            where asynchronous ops cannot run: under ``torch.func`` transforms and
            ``dc.spmd_check``.)

    Returns:
        ``(T, H_out)``: ``y[t] = sum_j gate_weights[t, j] * expert_{index[t, j]}(x[t])`` over
        the assignments not dropped (a token with every assignment dropped gets zeros).

    Gradient:
        the adjoint: the gradient rows gathered per assignment, weighted, and sent with the
        all_to_all of the dispatch direction (split sizes swapped, no exchange); the gate
        weights get ``<grad y[t], expert output>`` (the router's gradient).
    """
    op = "parallel.combine"
    if not isinstance(plan, DispatchPlan):
        raise A.arg_error(
            op, "plan", "the DispatchPlan returned by dispatch()", type(plan).__name__, TypeError
        )
    n = sum(plan.expert_splits)
    if not isinstance(expert_outputs, Tensor) or expert_outputs.ndim != 2 or expert_outputs.shape[0] != n:
        raise A.arg_error(
            op,
            "expert_outputs",
            f"a ({n}, hidden) tensor (the dispatched rows)",
            getattr(expert_outputs, "shape", type(expert_outputs).__name__),
        )
    if (
        not isinstance(gate_weights, Tensor)
        or gate_weights.ndim != 2
        or tuple(gate_weights.shape) != (plan.num_tokens, plan.k)
    ):
        raise A.arg_error(
            op,
            "gate_weights",
            f"a ({plan.num_tokens}, {plan.k}) tensor (tokens, k of the dispatch)",
            getattr(gate_weights, "shape", type(gate_weights).__name__),
        )
    if not (gate_weights.dtype.is_floating_point or gate_weights.dtype.is_complex):
        raise A.arg_error(op, "gate_weights", "a floating-point tensor", gate_weights.dtype, TypeError)
    if precision is not None:
        _no_async_precision(op, async_op)
    rows = _permute(expert_outputs, plan.recv_inverse, plan.recv_order, plan.source_major)  # source-major
    run_async = bool(async_op) and HOOK[0] is None and not _torch.transforms_active()
    with B.label("parallel.combine"):
        back = collectives.all_to_all(
            rows,
            group=plan.group,
            input_split_sizes=plan.recv_splits,
            output_split_sizes=plan.send_splits,
            precision=precision,
            async_op=run_async,
        )
    # weighted and summed in torch's promotion of the two (``rows * gate``): bf16 expert
    # rows with float32 gates (autocast) sum in float32, as the serial MoE does; the rows
    # travel in their own dtype (they were cast to bf16 and summed in bf16 before, the
    # output bf16 where the serial MoE's is float32)
    dtype = torch.promote_types(back.dtype, gate_weights.dtype)
    w = gate_weights.reshape(-1).index_select(0, plan.slot_index).to(dtype)
    if isinstance(back, _async.AsyncTensor):
        return _WeighAsync.apply(back, w, plan.token_index, plan.num_tokens)
    out = back.new_zeros(plan.num_tokens, back.shape[1], dtype=dtype)
    if spmd_types_checking(_FUNCTION_ATTRS):
        spmd_types_like(out, back)
    if _torch.transforms_active():  # (vmap: no in-place into unbatched zeros)
        return out.index_add(0, plan.token_index, back * w.unsqueeze(1))
    # into the fresh zeros in place (autograd records it: the zeros need no gradient)
    return out.index_add_(0, plan.token_index, back * w.unsqueeze(1))


class _WeighAsync(torch.autograd.Function):
    """``y = index_add(zeros(T, H), token_index, back * w)`` of an asynchronous combine's
    rows ``back`` (an :class:`~diffcomm.AsyncTensor`), run on the communication engine
    right after the all_to_all (jobs run in launch order), so the result is itself an
    AsyncTensor. Backward: ``back`` gets ``grad[token_index] * w``, the gate weights ``w``
    get ``<grad[token_index], back>`` (the blocking path's gradients; differentiable ops,
    so double backward works)."""

    @staticmethod
    def forward(ctx: Any, back: Tensor, w: Tensor, token_index: Tensor, num_tokens: int) -> Tensor:
        # kept on ctx, not saved tensors: a saved-tensor hook would read the AsyncTensor
        ctx.back, ctx.w, ctx.token_index = back, w, token_index
        w_col = w.detach().unsqueeze(1)

        def weigh(t: Tensor) -> Tensor:
            return t.new_zeros(num_tokens, t.shape[1], dtype=w.dtype).index_add_(0, token_index, t * w_col)

        return _async.launch(
            back,
            "parallel.combine (token order)",
            weigh,
            (num_tokens, back.shape[1]),
            dtype=w.dtype,  # (the promotion of rows and gates: see combine)
            private=True,  # (combine's own rows: nothing else holds them)
        )

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        g_rows = g.index_select(0, ctx.token_index)
        back = _async.wait(ctx.back) if ctx.needs_input_grad[1] else None
        g_back = (g_rows * ctx.w.unsqueeze(1)).to(ctx.back.dtype) if ctx.needs_input_grad[0] else None
        g_w = (g_rows * back).sum(1) if back is not None else None
        return g_back, g_w, None, None


def load_balancing_loss(probs: Tensor, plan: DispatchPlan) -> Tensor:
    """This rank's share of the Switch load-balancing loss ``E * sum_e f_e * P_e``.

    ``f_e`` is the fraction of all ranks' assignments routed to expert ``e`` (before
    dropping; from the exchanged counts, no communication) and ``P_e`` the mean router
    probability of ``e`` over all ``N`` tokens; this rank's share uses its own tokens'
    probabilities, so the **sum over ranks** is the serial loss (the sum convention).

    Args:
        probs: ``(T, E)`` this rank's router probabilities (from :func:`route`).
        plan: the step's :class:`DispatchPlan`.

    Returns:
        a 0-dim tensor; 1.0 summed over ranks when the routing is perfectly balanced.

    Gradient:
        ``E * f_e / N`` into ``probs[:, e]`` (``f`` is a constant).
    """
    e = plan.num_experts
    if not isinstance(probs, Tensor) or tuple(probs.shape) != (plan.num_tokens, e):
        raise A.arg_error(
            "parallel.load_balancing_loss",
            "probs",
            f"a ({plan.num_tokens}, {e}) tensor (this rank's tokens, experts)",
            getattr(probs, "shape", type(probs).__name__),
        )
    k_total = sum(map(sum, plan.counts))
    if plan.total_tokens == 0 or k_total == 0:
        return probs.sum() * 0.0
    f = plan.tokens_per_expert.to(probs.dtype).to(probs.device) / k_total
    if spmd_types_checking(_FUNCTION_ATTRS):  # the counts were exchanged: alike on every rank
        spmd_types_invariant(f, plan.group)
    return e * (probs.sum(dim=0) * f).sum() / plan.total_tokens
