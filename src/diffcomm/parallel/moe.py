"""Expert parallelism: a mixture-of-experts layer whose experts are sharded over a group.

A top-k router picks ``k`` experts per token; the experts are split over the ranks of an
expert-parallel (EP) group, ``num_experts / world`` per rank, and every rank holds its own
tokens. One step:

.. code-block:: text

    rank r: x (T_r, H) --router--> top-k expert ids, gate weights (T_r, k)
       |  counts: tokens per expert, exchanged ONCE (all ranks learn the (world, E) table)
       v
    dispatch: rows of x permuted by expert (a token once per chosen expert), dropped
              beyond capacity, sent with ONE uneven all_to_all (split sizes from the table)
       v
    expert inputs, expert-major (experts of rank r, each a contiguous block of rows)
       |  local experts
       v
    combine: ONE uneven all_to_all back (split sizes swapped), each row weighted by its
             gate weight and added into its token's row: y (T_r, H)

``dispatch`` and ``combine`` are ordinary differentiable compositions of
:func:`diffcomm.all_to_all` (given both split sizes, so its backward is the exact
adjoint — the all_to_all with the sizes swapped — and nothing is exchanged again) and
index gathers/adds. So the backward of the dispatch *is* a combine (without weights) and
the backward of the combine a dispatch: the counts learned in forward are reused, and
double backward and ``torch.autograd.grad`` work as for any torch code.

Gradient convention (that of every diffcomm op): the objective is the **sum of the
per-rank objectives**. With each rank's loss taken over its own tokens, the sum over ranks
is the serial MoE's loss over all tokens (rank 0's tokens first); then the experts'
gradients equal the serial ones exactly, and the replicated parameters (router, shared
expert) get on each rank that rank's share, which sum to the serial gradient
(:meth:`ExpertParallelMoE.sync_replicated_grads` all-reduces them in one coalesced call).

Capacity: with ``capacity_factor`` each expert takes at most
``C = ceil(capacity_factor * N * k / E)`` tokens, ``N`` the tokens of **all** ranks, in the
order of the serial MoE (rank 0's tokens first, then token by token; or, given
``positions=`` — each token's serial index, for a context-parallel sequence shard — by
position); the rest of that expert's assignments are dropped (their tokens get nothing
from that expert). Every rank computes the same drops from the exchanged tables, so the
parallel layer drops exactly the tokens the serial one drops. ``None`` (the default) is
dropless.
"""

# Size: ~870 lines, over the ~600 guideline: the serial MoE, its expert-parallel twin and the
# name maps between them (serial_names, from_serial, state dicts) are read together.

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _torch
from .. import backend as B
from .._replication import PARTIAL, LayerRule, R, V, annotate_params_for_spmd_types, spmd_types_checking
from .._torch import IncompatibleKeys, active_ddp, local_tensor_mode_off, local_tensor_mode_on
from ..backend import args as A
from ..backend.local_tensor import RANK_WHY, LocalTensorBackend, refuse
from ..ops import coalesced, collectives
from ..ops import engine as _async
from ._check import check_replicas_agree
from ._module import (
    ParallelModule,
    check_positive,
    check_serial_value,
    deepcopy_sharing_groups,
    guard_shard_loading,
    init_generator,
    note_drawn,
    resolve_parallel_group,
    serial_shape,
)
from ._seams import (
    VARIES_NOTE,
    check_not_synced_by_ddp,
    grads_to_sum,
    keeping_marks,
    note_summed,
    note_varying,
    refuse_pickling,
)
from .blocks import MLP
from .layers import LayerOptions
from .routing import (
    DispatchPlan,
    check_positions,
    combine,
    dispatch,
    load_balancing_loss,
    refuse_batched_routing,
    route,
)

__all__ = ["MoE", "ExpertParallelMoE"]

#: the :class:`~diffcomm.parallel.LayerOptions` both MoE layers read: how the parameters
#: are drawn and where they live (the expert-parallel layer also its ``group``)
_INIT_OPTIONS = ("seed", "generator", "dtype", "device")


# ======================================================================================
# the serial reference and the expert-parallel layer
# ======================================================================================


def _serial_forward(
    x2: Tensor,
    router: nn.Linear,
    experts: Sequence[nn.Module],
    k: int,
    capacity_factor: float | None,
    renormalize: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """The serial MoE on ``(N, H)`` tokens (no communication): ``(y, aux, tokens per expert)``."""
    e = len(experts)
    n = x2.shape[0]
    gate, index, probs = route(router(x2), k, renormalize=renormalize)
    flat = index.reshape(-1)
    counts = torch.bincount(flat, minlength=e)
    keep = torch.ones_like(flat, dtype=torch.bool)
    if capacity_factor is not None:
        cap = math.ceil(capacity_factor * n * k / e)
        onehot = F.one_hot(flat, e)
        pos = (onehot.cumsum(0) - 1).gather(1, flat.unsqueeze(1)).squeeze(1)  # order within expert
        keep = pos < cap
    tok = torch.arange(n, device=x2.device).repeat_interleave(k)
    gflat = gate.reshape(-1)
    y = None
    for j, expert in enumerate(experts):
        sel = ((flat == j) & keep).nonzero().squeeze(1)
        out_j = expert(x2.index_select(0, tok[sel])) * gflat[sel].unsqueeze(1).to(x2.dtype)
        if y is None:
            y = x2.new_zeros(n, out_j.shape[1])
        y = y.index_add(0, tok[sel], out_j)
    assert y is not None
    f = counts.to(probs.dtype) / max(n * k, 1)
    aux = e * (probs.mean(dim=0) * f).sum() if n else probs.sum() * 0.0
    return y, aux, counts


def _check_sizes(
    op: str,
    hidden_size: Any,
    ffn_hidden_size: Any,
    num_experts: Any,
    k: Any,
    capacity_factor: Any,
    shared_expert_size: Any,
) -> tuple[int, int, int, float | None]:
    """The size arguments of both layers, checked with the calling layer named:
    ``(hidden_size, num_experts, k, capacity_factor)``."""
    hidden_size = check_positive(op, "hidden_size", hidden_size)
    check_positive(op, "ffn_hidden_size", ffn_hidden_size)
    num_experts = check_positive(op, "num_experts", num_experts)
    k = check_positive(op, "k", k)
    if k > num_experts:
        raise A.arg_error(op, "k", f"at most num_experts={num_experts}", k)
    if capacity_factor is not None and (
        isinstance(capacity_factor, bool)
        or not isinstance(capacity_factor, int | float)
        or not float(capacity_factor) > 0
    ):
        raise A.arg_error(op, "capacity_factor", "None or a positive float", capacity_factor)
    if shared_expert_size is not None:
        check_positive(op, "shared_expert_size", shared_expert_size)
    return hidden_size, num_experts, k, None if capacity_factor is None else float(capacity_factor)


def _tokens(op: str, x: Any, hidden_size: int, dtype: torch.dtype | None = None) -> Tensor:
    """``x`` (``(..., H)``) as ``(N, H)`` rows; anything else is named before any
    communication. ``dtype``: the layer's parameter dtype, which ``x`` must have (outside
    autocast, where torch's matmul would fail later without naming ``x``)."""
    A.check_tensor(x, op, "x")  # (a DTensor too: this rank's tokens are a plain tensor)
    if x.ndim < 1 or x.shape[-1] != hidden_size:
        raise A.arg_error(op, "x", f"a (..., hidden_size={hidden_size}) tensor", f"shape {tuple(x.shape)}")
    if not x.dtype.is_floating_point:
        raise A.arg_error(op, "x", "a floating-point tensor", x.dtype, TypeError)
    if dtype is not None and x.dtype != dtype and not torch.is_autocast_enabled(x.device.type):
        raise A.arg_error(
            op, "x", f"of the layer's dtype {dtype} (cast the batch or the layer)", x.dtype, TypeError
        )
    return x.reshape(-1, hidden_size)


def _expert_group(op: str, group: A.GroupLike) -> tuple[Any, int, int | None]:
    """``(group, size, this rank)`` of an expert-parallel layer; the rank ``None`` under
    torch's ``LocalTensorMode`` (each simulated rank's experts: :func:`_experts_per_rank`)."""
    if local_tensor_mode_on():
        pg = A.resolve_group(group, op)
        return pg, B.get_backend().world_size(pg), None
    return resolve_parallel_group(op, group)


def _experts_per_rank(full: MoE, per_rank: int, pg: Any) -> list[nn.Module]:
    """Under torch's ``LocalTensorMode``: local expert ``i`` of every simulated rank as one
    module, each parameter a ``LocalTensor`` holding rank ``r``'s own (the serial expert
    ``g * per_rank + i`` of ``r``'s serial layer, ``g`` its group rank)."""
    every = B.get_backend()
    assert isinstance(every, LocalTensorBackend)  # (the adapter while a mode is on)
    names = [n for n, _ in full.experts[0].named_parameters()]
    m = len(names)
    every_param = [p for e in full.experts for _, p in e.named_parameters()]  # (each rank's)
    out = []
    for i in range(per_rank):

        def mine(g: int, *ps: Tensor, i: int = i) -> tuple[Tensor, ...]:
            first = (g * per_rank + i) * m
            return tuple(ps[first : first + m])

        values = every.each_rank(pg, mine, *every_param)
        with local_tensor_mode_off():
            local = copy.deepcopy(full.experts[i])
        for n, v in zip(names, values, strict=True):
            mod, _, attr = n.rpartition(".")
            setattr(local.get_submodule(mod), attr, nn.Parameter(v))
        out.append(local)
    return out


def _refuse_experts_tied_across_ranks(op: str, moe: MoE, world: int) -> None:
    """A parameter shared by serial experts that land on different ranks (``experts.0``
    and ``experts.2`` at world 2): every rank would keep its own copy and update it with
    its own part of the gradient, so the copies drift apart silently (0.13 after one SGD
    step). Refused, before any communication; experts tied on one rank are right."""
    per_rank = moe.num_experts // world
    owner: dict[int, tuple[str, int]] = {}
    for j, expert in enumerate(moe.experts):
        for name, p in expert.named_parameters(remove_duplicate=False):
            first = owner.setdefault(id(p), (f"experts.{j}.{name}", j // per_rank))
            if first[1] != j // per_rank:
                raise A.arg_error(
                    op,
                    "moe",
                    "a MoE whose experts on different ranks share no parameter (each rank would "
                    "update its own copy with its part of the gradient): untie them, or use a "
                    "group size that keeps the tied experts on one rank",
                    f"{first[0]} (rank {first[1]}) and experts.{j}.{name} (rank {j // per_rank}) "
                    "are one parameter",
                )


def _check_experts(experts: Sequence[nn.Module], pg: Any) -> None:
    """The ``experts=`` of an :class:`ExpertParallelMoE`, refused (naming the layer, before
    any communication) where a tensor-parallel layer inside one would silently compute
    another function than the serial expert:

    * a layer over a group holding another rank of the expert-parallel group (a
      ``ParallelMLP`` left on ``group=None``, the world, as the MoE): its shards on those
      ranks are shards of *other* experts, summed as one MLP (0.35 off the serial rows at
      world 2 with ``k = E``, where the row counts agree; a gloo abort where they do not);
    * a layer built ``sequence_parallel=True``: it all_gathers the dispatched rows over its
      TP group as a sequence shard, though the TP ranks hold the same rows (the routing is
      replicated over TP), so each row counted once per TP rank: the expert's weight
      gradients were the TP size times the serial ones (1.50 off at EP 2 x TP 2; outputs
      and input gradients right), with no error."""
    ep_ranks = set(dist.get_process_group_ranks(pg if pg is not None else dist.group.WORLD))
    for i, expert in enumerate(experts):
        for name, m in expert.named_modules():
            where = f"experts[{i}]" + (f".{name}" if name else "") + f" ({type(m).__name__})"
            if getattr(m, "sequence_parallel", False) is True:
                raise A.arg_error(
                    "parallel.ExpertParallelMoE",
                    "experts",
                    "experts mapping the dispatched rows, the same on every rank of a tensor-parallel "
                    "expert's group, to their rows: build a tensor-parallel expert with "
                    "sequence_parallel=False (a sequence-parallel one all_gathers the rows as a "
                    "sequence shard, counting each once per TP rank: weight gradients TP-size times "
                    "the serial ones)",
                    f"{where} with sequence_parallel=True",
                )
            if isinstance(m, ParallelModule) and "_pg" in m.__dict__:  # (not: a container)
                ranks = dist.get_process_group_ranks(m._pg if m._pg is not None else dist.group.WORLD)
                shared = sorted(set(ranks) & ep_ranks)
                if len(shared) > 1:
                    raise A.arg_error(
                        "parallel.ExpertParallelMoE",
                        "experts",
                        "tensor-parallel experts over a group orthogonal to the expert-parallel one "
                        "(another mesh axis: ParallelMLP.from_serial(mlp, group=(mesh, 'tp')) with "
                        "ExpertParallelMoE(..., group=(mesh, 'ep'))), holding no other rank of it",
                        f"{where} over the global ranks {list(ranks)}, which hold the expert-parallel "
                        f"ranks {shared}: its shards there belong to other experts, and would be "
                        "summed as one",
                    )


def _guard_loading(moe: ExpertParallelMoE) -> None:
    """``load_state_dict`` refuses another rank's experts (the rank note) and a state dict
    with more experts than this rank holds: a serial MoE's (or another layout's without the
    note). Its ``experts.0``.. have this rank's shapes, so with ``strict=False`` every rank
    took the serial experts ``0..E/W-1`` for its own, silently (rank 1 of EP=2 computed
    with expert 0 where the serial MoE has expert 6)."""
    guard_shard_loading(moe, ExpertParallelMoE._experts_position)  # another rank's experts: refused

    def check(m: nn.Module, sd: Any, prefix: str, meta: Any, strict: bool, *lists: list[str]) -> None:
        head, held = f"{prefix}experts.", getattr(m, "experts_per_rank", None)
        numbers = {k[len(head) :].split(".", 1)[0] for k in sd if k.startswith(head)}
        extra = sorted(int(j) for j in numbers if j.isdigit() and isinstance(held, int) and int(j) >= held)
        if extra and isinstance(held, int):
            name = prefix.rstrip(".") or type(m).__name__
            lists[-1].append(
                f"diffcomm: `{name}` (ExpertParallelMoE) holds {held} experts on this rank "
                f"(experts.0..{held - 1}), but the state dict has experts.{extra[0]}"
                f"{'..' + str(extra[-1]) if len(extra) > 1 else ''}: a serial MoE's state dict "
                "(or another layout's), whose experts.0.. are not this rank's. Load it with "
                "load_serial_state_dict (or torch.distributed.checkpoint through dcp_state_dict)."
            )

    moe.register_load_state_dict_pre_hook(check)


class MoE(nn.Module):
    """The serial mixture-of-experts layer: the reference of :class:`ExpertParallelMoE`.

    ``y = sum_j gate_j(x) * expert_{index_j(x)}(x) [+ shared_expert(x)]`` with a top-``k``
    softmax router (``route``) and MLP experts (:class:`~diffcomm.parallel.MLP`).

    Args:
        hidden_size: input and output size ``H``.
        ffn_hidden_size: each expert's inner size.
        num_experts: ``E``.
        k: experts per token.
        capacity_factor: ``None`` (dropless) or each expert's capacity
            ``ceil(capacity_factor * N * k / E)`` for ``N`` tokens, first come first served
            in token order.
        renormalize: see :func:`route`.
        shared_expert_size: inner size of a shared expert every token goes through
            (``None``: none).
        bias, activation: of the expert MLPs.
        seed, generator, dtype, device: initialisation as the parallel layers.
        options: those four as one :class:`~diffcomm.parallel.LayerOptions` (keywords
            given too override its fields; the fields it does not read must keep their
            defaults), as every layer of this package takes it.

    After ``forward``: ``self.aux_loss`` (the Switch load-balancing loss, a 0-dim tensor
    in the graph), ``self.tokens_per_expert`` (``(E,)`` int64, the routing histogram) and
    ``self.dropped`` (assignments dropped by the capacity, 0 when dropless).
    """

    #: what a forward leaves on the layer with its graph: a deepcopy copies it detached
    FORWARD_RESULTS = ("aux_loss",)

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int,
        k: int = 2,
        *,
        capacity_factor: float | None = None,
        renormalize: bool = False,
        shared_expert_size: int | None = None,
        bias: bool = True,
        activation: str | Callable[[Tensor], Tensor] = "gelu",
        options: LayerOptions | None = None,
        **keywords: Any,
    ) -> None:
        super().__init__()
        op = "parallel.MoE"
        opts = LayerOptions.of(op, options, keywords, _INIT_OPTIONS)
        hidden_size, num_experts, self.k, capacity_factor = _check_sizes(
            op, hidden_size, ffn_hidden_size, num_experts, k, capacity_factor, shared_expert_size
        )
        self.capacity_factor = capacity_factor
        self.renormalize = bool(renormalize)
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        gen = init_generator(op, opts.seed, opts.generator)
        dtype = opts.dtype
        with _DrawnFrom(gen):  # drawn on the CPU (the same numbers on any device), then moved
            self.router = nn.Linear(hidden_size, num_experts, bias=False, dtype=dtype)
            self.experts = nn.ModuleList(
                MLP(hidden_size, ffn_hidden_size, bias, activation=activation, dtype=dtype)
                for _ in range(num_experts)
            )
            self.shared_expert = (
                None
                if shared_expert_size is None
                else MLP(hidden_size, shared_expert_size, bias, activation=activation, dtype=dtype)
            )
        if opts.device is not None:
            self.to(opts.device)
        self.aux_loss: Tensor | None = None
        self.tokens_per_expert: Tensor | None = None
        self.dropped = 0

    def __deepcopy__(self, memo: dict[int, Any]) -> MoE:
        """A copy whose ``aux_loss`` holds the last value without its graph (torch's
        deepcopy refuses a non-leaf tensor)."""
        return deepcopy_sharing_groups(self, memo)  # type: ignore[return-value]

    def forward(self, x: Tensor) -> Tensor:
        """``x``: ``(..., H)``; returns ``(..., H)``."""
        x2 = _tokens("parallel.MoE", x, self.hidden_size, self.router.weight.dtype)
        y, aux, counts = _serial_forward(
            x2, self.router, list(self.experts), self.k, self.capacity_factor, self.renormalize
        )
        if self.shared_expert is not None:
            y = y + self.shared_expert(x2)
        self.aux_loss, self.tokens_per_expert = aux, counts
        if self.capacity_factor is None:
            self.dropped = 0
        else:  # the assignments past each expert's capacity (ExpertParallelMoE's rule)
            cap = math.ceil(self.capacity_factor * x2.shape[0] * self.k / self.num_experts)
            self.dropped = int((counts - cap).clamp(min=0).sum())
        return y.reshape(x.shape[:-1] + (y.shape[-1],))


class _DrawnFrom:
    """Draw the initial weights from ``gen`` (``None``: the global RNG, as torch does)."""

    def __init__(self, gen: torch.Generator | None) -> None:
        self.gen = gen

    def __enter__(self) -> None:
        if self.gen is not None:
            self._devices = torch.random.fork_rng(devices=[])
            self._devices.__enter__()
            torch.default_generator.manual_seed(int(torch.randint(0, 2**62, (1,), generator=self.gen)))

    def __exit__(self, *exc: Any) -> None:
        if self.gen is not None:
            self._devices.__exit__(*exc)


_FUNCTION_ATTRS = torch.autograd.Function.__dict__  # (see _replication.spmd_types_checking)


class ExpertParallelMoE(nn.Module):
    """Mixture of experts with the experts sharded over an expert-parallel group.

    Rank ``r`` holds experts ``[r * E / world, (r + 1) * E / world)`` and its own tokens;
    the router (and the optional shared expert) are replicated. A step exchanges the
    per-expert counts once, dispatches with one uneven all_to_all, runs the local experts
    and combines with one all_to_all back (see :func:`dispatch` / :func:`combine`). The
    shared expert's compute overlaps the dispatch all_to_all (``async_op``).

    Args:
        hidden_size: input and output size ``H``.
        ffn_hidden_size: each expert's inner size.
        num_experts: ``E`` over the whole group, divisible by the group size.
        k: experts per token.
        capacity_factor: ``None`` (dropless) or as :class:`MoE`, over all ranks' tokens.
        renormalize: see :func:`route`.
        shared_expert_size: inner size of a replicated shared expert (``None``: none).
        bias: biases in the expert MLPs.
        activation: of the expert MLPs.
        group: the expert-parallel group: ``None`` (world), a ``ProcessGroup`` or
            ``(DeviceMesh, axis)``.
        experts: this rank's experts, if not the MLPs drawn from ``seed`` (e.g.
            tensor-parallel :class:`~diffcomm.parallel.ParallelMLP` over another axis);
            ``E / world`` modules mapping ``(n, H) -> (n, H)``.
        overlap_shared: run the shared expert while the dispatch is in flight (not under
            torch's ``LocalTensorMode``: no communication thread there).
        seed, generator, dtype, device: the parameters are this rank's part of
            ``MoE(..., seed=seed)`` (the same draws), so a serial MoE built with the same
            seed is the reference. (Every rank draws all the experts once and keeps its
            own; for experts too large for that, pass ``experts=``.) With neither
            ``seed`` nor ``generator`` the global RNG draws, and it must then be in the
            same state on every rank: the router and shared expert are replicas.
        options: ``group`` and those four as one :class:`~diffcomm.parallel.LayerOptions`
            (as :class:`MoE`; a ``group`` given too overrides its field).

    Shapes:
        input ``(..., H)``, this rank's tokens (the token count may differ between ranks);
        output the same shape.

    Gradient:
        sum convention: with each rank's loss over its own tokens, the expert gradients
        equal the serial MoE's; the router's and shared expert's are this rank's share
        (their sum over ranks is the serial gradient: :meth:`sync_replicated_grads`).

    After ``forward``: ``self.aux_loss`` (this rank's share of the load-balancing loss;
    summed over ranks it is the serial one), ``self.tokens_per_expert`` (``(E,)`` int64
    over the whole group, before dropping), ``self.dropped`` and ``self.plan``.

    Example::

        def f():
            moe = dc.parallel.ExpertParallelMoE(8, 16, num_experts=4, k=2, seed=0)
            y = moe(torch.randn(5, 8))
            return y.shape, moe.tokens_per_expert.tolist()
        with dc.LocalWorld(2) as world:
            world.run(f)
    """

    #: what a forward leaves on the layer with its graph: a deepcopy copies it detached
    FORWARD_RESULTS = ("aux_loss",)

    spmd = LayerRule(
        lambda m: (V, R),
        why=lambda m: "its tokens",
        params=lambda m: {n: V for n, _ in m.experts.named_parameters(prefix="experts")},
        doc="varying or replicated (its tokens); the experts' parameters varying, the router's replicated",
        replicated_grad=PARTIAL,
    )

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int,
        k: int = 2,
        group: A.GroupLike = None,
        *,
        capacity_factor: float | None = None,
        renormalize: bool = False,
        shared_expert_size: int | None = None,
        bias: bool = True,
        activation: str | Callable[[Tensor], Tensor] = "gelu",
        experts: Sequence[nn.Module] | None = None,
        overlap_shared: bool = True,
        options: LayerOptions | None = None,
        **keywords: Any,
    ) -> None:
        super().__init__()
        op = "parallel.ExpertParallelMoE"
        if group is not None:  # (positional, as before LayerOptions; it overrides options.group)
            keywords["group"] = group
        opts = LayerOptions.of(op, options, keywords, ("group", *_INIT_OPTIONS))
        _check_sizes(op, hidden_size, ffn_hidden_size, num_experts, k, capacity_factor, shared_expert_size)
        note_drawn(self, init_generator(op, opts.seed, opts.generator))  # (checked: names this class)
        self._pg, self.world, self.rank = _expert_group(op, opts.group)
        _guard_loading(self)
        if num_experts % self.world:
            raise A.arg_error(
                op,
                "num_experts",
                f"divisible by the group size {self.world} (experts are split evenly)",
                num_experts,
            )
        with local_tensor_mode_off():  # (under torch's LocalTensorMode: drawn once, plain)
            full = MoE(
                hidden_size,
                ffn_hidden_size,
                num_experts,
                k,
                capacity_factor=capacity_factor,
                renormalize=renormalize,
                shared_expert_size=shared_expert_size,
                bias=bias,
                activation=activation,
                options=replace(opts, group=None),
            )
        self._adopt(full, experts)
        self.overlap_shared = (
            bool(overlap_shared) and self.rank is not None
        )  # (no async under LocalTensorMode)

    def _adopt(self, full: MoE, experts: Sequence[nn.Module] | None) -> None:
        per_rank = full.num_experts // self.world
        self.num_experts, self.k = full.num_experts, full.k
        self.hidden_size = full.hidden_size
        self.capacity_factor, self.renormalize = full.capacity_factor, full.renormalize
        self.experts_per_rank = per_rank
        self.first_expert = None if self.rank is None else self.rank * per_rank
        self.router = full.router
        self.shared_expert = full.shared_expert
        if self.first_expert is None:  # torch's LocalTensorMode: every simulated rank's own
            if experts is not None:
                raise refuse("parallel.ExpertParallelMoE(experts=...)", RANK_WHY)
            local = _experts_per_rank(full, per_rank, self._pg)
        elif experts is None:
            local = list(full.experts)[self.first_expert : self.first_expert + per_rank]
        else:
            local = list(experts)
            if len(local) != per_rank:
                raise A.arg_error(
                    "parallel.ExpertParallelMoE",
                    "experts",
                    f"{per_rank} modules (num_experts / world)",
                    len(local),
                )
            _check_experts(local, self._pg)
        self.experts = nn.ModuleList(local)
        self._note_experts()  # (a model only ever run compiled is marked too)
        self.aux_loss: Tensor | None = None
        self.tokens_per_expert: Tensor | None = None
        self.dropped = 0
        self.plan: DispatchPlan | None = None

    @classmethod
    def from_serial(
        cls, moe: MoE, group: A.GroupLike = None, *, overlap_shared: bool = True
    ) -> ExpertParallelMoE:
        """This rank's part of the serial :class:`MoE` (copies of its router, shared
        expert and this rank's experts; the serial module is not modified)."""
        import copy

        self = cls.__new__(cls)
        nn.Module.__init__(self)
        op = "parallel.ExpertParallelMoE.from_serial"
        self._pg, self.world, self.rank = _expert_group(op, group)
        _guard_loading(self)
        if moe.num_experts % self.world:
            raise A.arg_error(
                op, "moe", f"num_experts divisible by the group size {self.world}", moe.num_experts
            )
        _refuse_experts_tied_across_ranks(op, moe, self.world)
        # the last step's aux loss and histogram are not copied (a graph, not state); nor
        # are gradients
        memo: dict[int, Any] = {id(moe.aux_loss): None, id(moe.tokens_per_expert): None}
        full = copy.deepcopy(moe, memo)
        for p in full.parameters():
            p.grad = None
        self._adopt(full, None)
        self.overlap_shared = (
            bool(overlap_shared) and self.rank is not None
        )  # (no async under LocalTensorMode)
        return self

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise refuse_pickling(self)  # (its experts are this rank's, always)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> ExpertParallelMoE:
        """``nn.Module._apply``, the experts keeping their marks (``_seams.keeping_marks``)."""
        return keeping_marks(self, lambda: super(ExpertParallelMoE, self)._apply(fn, recurse))  # type: ignore[return-value]

    def __deepcopy__(self, memo: dict[int, Any]) -> ExpertParallelMoE:
        """A copy over the same group (see :class:`~diffcomm.parallel.ParallelModule`)."""
        return deepcopy_sharing_groups(self, memo)  # type: ignore[return-value]

    # ---- the serial mapping (as the tensor-parallel layers' ParallelModule) -----------

    def serial_names(self) -> dict[str, str]:
        """The serial :class:`MoE`'s name of each parameter: this rank's local expert
        ``experts.i`` is the serial ``experts.{rank * E / world + i}``; the router and the
        shared expert keep their names.

        Returns:
            ``{parameter name: serial parameter name}`` (what
            :func:`diffcomm.testing.assert_matches_serial` and the state-dict helpers use,
            so a comparison needs no hand-written map).
        """
        first = self.first_expert
        if first is None:  # torch's LocalTensorMode: the expert's serial name differs per rank
            raise refuse("parallel.ExpertParallelMoE.serial_names", RANK_WHY)
        out = {}
        for name, _ in self.named_parameters():
            if name.startswith("experts."):
                i, rest = name[len("experts.") :].split(".", 1)
                out[name] = f"experts.{first + int(i)}.{rest}"
            else:
                out[name] = name
        return out

    def serial_slices(self) -> dict[str, tuple[Any, ...]]:
        """Which part of its serial parameter (:meth:`serial_names`) each parameter is:
        the whole of it (an expert lives on one rank; router and shared expert are
        replicas), or the expert's own ``serial_slices()`` for experts that are shards
        themselves (e.g. a tensor-parallel ``ParallelMLP`` passed as ``experts=``)."""
        out: dict[str, tuple[Any, ...]] = {}
        for name, p in self.named_parameters():
            out[name] = (slice(None),) * p.dim()
        for i, expert in enumerate(self.experts):
            inner = getattr(expert, "serial_slices", None)
            if callable(inner):
                for name, index in inner().items():
                    out[f"experts.{i}.{name}"] = tuple(index)
        return out

    def partial_gradients(self) -> list[str]:
        """Names of the parameters whose gradient on a rank is that rank's **share** (sum
        convention: the replicated router and shared expert, see
        :meth:`sync_replicated_grads`); their sum over the group is the serial gradient."""
        ids = {id(p) for p in self.replicated_parameters()}
        return [name for name, p in self.named_parameters() if id(p) in ids]

    @torch.no_grad()
    def load_serial_state_dict(self, state_dict: dict[str, Tensor], strict: bool = True) -> IncompatibleKeys:
        """Copy this rank's parameters out of a serial :class:`MoE`'s state dict (its
        router, shared expert and this rank's experts; no communication).

        Returns:
            ``(missing_keys, unexpected_keys)`` (serial names; this rank's missing ones),
            as ``nn.Module.load_state_dict`` returns them: what ``strict=False`` skipped.

        Raises:
            KeyError: with ``strict``, a serial name this rank needs is missing, or a key
                is no parameter of the serial MoE this layer shards (e.g. a shared expert
                this layer lacks: silently dropped before), as ``load_state_dict``.
            ValueError: a serial tensor's shape does not fit.
        """
        op = "parallel.ExpertParallelMoE.load_serial_state_dict"
        self._refuse_expert_buffers(op)
        names, slices = self.serial_names(), self.serial_slices()
        local = [n.split(".", 2)[2] for n in names if n.startswith("experts.0.")]
        known = {s for n, s in names.items() if not n.startswith("experts.")}
        known |= {f"experts.{j}.{n}" for j in range(self.num_experts) for n in local}
        unexpected = sorted(k for k in state_dict if k not in known)
        if strict:
            if unexpected:
                raise KeyError(
                    f"diffcomm.{op}(): unexpected keys {unexpected}: not parameters of the serial "
                    f"MoE this layer shards (pass strict=False to ignore them)"
                )
        # every key checked before any is copied (a misfit raised after the router was copied)
        shapes = {name: tuple(p.shape) for name, p in self.named_parameters()}
        for i, expert in enumerate(self.experts):  # experts that are shards themselves
            if isinstance(expert, ParallelModule):
                for n, (t, dim, pg) in expert._serial_specs(op, buffers=False).items():
                    shapes[f"experts.{i}.{n}"] = serial_shape(t, dim, pg)
        for name, shape in list(shapes.items()):  # every rank checks every expert: all agree
            if name.startswith("experts.0."):
                rest = name[len("experts.0.") :]
                for j in range(self.num_experts):
                    other = state_dict.get(f"experts.{j}.{rest}")
                    if isinstance(other, Tensor) and tuple(other.shape) != shape:
                        raise A.arg_error(
                            op, "state_dict", f"'experts.{j}.{rest}' of shape {shape}", tuple(other.shape)
                        )
        copies, missing = [], []
        for name, p in self.named_parameters():
            s_name = names[name]
            if s_name not in state_dict:
                if strict:
                    raise KeyError(f"diffcomm.{op}(): serial key {s_name!r} (for {name!r}) is missing")
                missing.append(s_name)
                continue
            check_serial_value(op, s_name, state_dict[s_name])
            if tuple(state_dict[s_name].shape) != shapes[name]:
                raise A.arg_error(
                    op, "state_dict", f"{s_name!r} of shape {shapes[name]}", tuple(state_dict[s_name].shape)
                )
            copies.append((p, state_dict[s_name][slices[name]]))
        for p, src in copies:
            p.copy_(src)
        return IncompatibleKeys(missing, unexpected)

    @torch.no_grad()
    def to_serial_state_dict(self) -> dict[str, Tensor]:
        """The serial :class:`MoE`'s parameters, on every rank: the experts all_gathered
        over the group (one all_gather per parameter of an expert, in the same order on
        every rank, so call it on every rank), the replicas copied. Experts that are
        shards themselves (a tensor-parallel ``ParallelMLP`` passed as ``experts=``) are
        first made whole by their own ``to_serial_state_dict()`` (over their own group:
        call it on every rank of both groups).

        Returns:
            ``{serial name: tensor}``, the serial shapes, loadable with
            ``MoE.load_state_dict(...)``.
        """
        self._refuse_expert_buffers("parallel.ExpertParallelMoE.to_serial_state_dict")
        out: dict[str, Tensor] = {}
        names = self.serial_names()
        per_rank = self.experts_per_rank
        # each local expert's whole tensors: a sharded expert's gathered over its group (its
        # shards under the serial names were returned before: fc1.weight (3, H) for the
        # serial (6, H) at TP 2, silently)
        expert_params: list[dict[str, Tensor]] = []
        for e in self.experts:
            whole = getattr(e, "to_serial_state_dict", None)
            expert_params.append(
                whole() if callable(whole) else {n: p.detach() for n, p in e.named_parameters()}
            )
        for name, p in self.named_parameters():
            if not name.startswith("experts."):
                out[names[name]] = p.detach().clone()
        for pname in expert_params[0] if expert_params else {}:
            mine = torch.stack([ps[pname].detach() for ps in expert_params])  # (E / world, ...)
            full = collectives.all_gather(mine, 0, self._pg, split_sizes=[per_rank] * self.world)
            for j in range(full.shape[0]):
                out[f"experts.{j}.{pname}"] = full[j].clone()
        return out

    def _refuse_expert_buffers(self, op: str) -> None:
        """A persistent buffer of an expert (a running statistic) is in no serial state dict
        here (parameters only): ``to_serial_state_dict`` dropped it and a round trip reset
        it, silently. Refused, as ``dcp_state_dict`` does, before any communication."""
        params = {n for n, _ in self.experts.named_parameters(prefix="experts", remove_duplicate=False)}
        kept = [n for n in self.experts.state_dict(prefix="experts.", keep_vars=True) if n not in params]
        if kept:
            raise ValueError(
                f"diffcomm.{op}(): `{kept[0]}` is a persistent buffer of an expert: the serial "
                "state dict holds the experts' parameters only, so it would be dropped (make it a "
                "parameter or a non-persistent buffer)"
            )

    def replicated_parameters(self) -> list[nn.Parameter]:
        """The parameters every rank of the group holds (router, shared expert)."""
        params = list(self.router.parameters())
        if self.shared_expert is not None:
            params += list(self.shared_expert.parameters())
        return params

    def _experts_position(self) -> tuple[int, int] | None:
        """Whose experts this module holds: ``(rank, world)`` of its group (``None`` where
        the rank is no plain int: all ranks in one program under LocalTensorMode)."""
        rank, world = self.rank, self.world
        return (rank, world) if isinstance(rank, int) and isinstance(world, int) else None

    def sync_replicated_grads(self) -> None:
        """Sum the replicated parameters' gradients over the group (one coalesced
        all_reduce): afterwards they equal the serial MoE's gradients on every rank.

        Call it once per optimizer step, after the last backward: it sums the gradients
        as they are, so with gradient accumulation a call after every micro-batch's
        backward would count the earlier micro-batches ``world`` times again: such a call
        (a backward added onto the gradients the last call summed, not zeroed between,
        also when they were scaled in place before it) is a ``ValueError`` before any
        communication; a second call with no backward between
        sums nothing again (also after an in-place scaling: a clipping). Under FSDP2's
        ``fully_shard`` over another mesh axis each gradient is a ``DTensor``: its local
        shards are summed, in place; FSDP2 accumulates into them in place, unseen by the
        check above: a second call sums nothing again only while the gradients are as the
        last call left them (not after an in-place scaling, a clipping, in between)."""
        named = [(n, p) for n, p in self.named_parameters() if n.startswith(("router.", "shared_expert."))]
        params = grads_to_sum("parallel.ExpertParallelMoE.sync_replicated_grads", named)
        # a DTensor gradient (FSDP2's fully_shard over another mesh axis): its local shard,
        # the same part of the parameter on every rank of this group, summed in place
        grads: list[Any] = [p.grad for p in params]
        grads = [g.to_local() if A.is_dtensor(g) else g for g in grads]
        if not grads:
            return
        with torch.no_grad():
            summed = coalesced.all_reduce_coalesced(grads, "sum", self._pg)
            for p, g, total in zip(params, grads, summed):
                if g is p.grad:  # (a tensor of its own, not a part of the coalesced buffer,
                    # whose version counter counts every part's changes: see note_summed)
                    p.grad = total.clone()
                else:
                    g.copy_(total)
        note_summed(params)  # (a second call before the next backward sums nothing again)

    def _note_experts(self) -> None:
        """Mark the experts as differing between the group's ranks, for the ZeRO check."""
        if any(VARIES_NOTE not in p.__dict__ for p in self.experts.parameters()):
            for n, p in self.experts.named_parameters(prefix="experts"):
                note_varying(p, f"ExpertParallelMoE.{n}", self._pg)

    def forward(self, x: Tensor, *, positions: Tensor | None = None) -> Tensor:
        """``x``: ``(..., H)`` this rank's tokens; returns ``(..., H)``.

        ``positions``: ``None`` or each token's index in the serial model's token order,
        shaped ``x.shape[:-1]`` or flat ``(T,)`` (for a ``(B, S_local, H)`` sequence shard
        of a ``(B, S, H)`` activation: ``b * S + s`` of each local token), distinct over
        the ranks. With a capacity factor the drops then follow the serial MoE on the
        tokens in that order (see :func:`~diffcomm.parallel.dispatch`); without, rank
        order (right when the ranks hold consecutive runs of the serial tokens)."""
        if spmd_types_checking(_FUNCTION_ATTRS):  # spmd_types' checker: type the parameters
            annotate_params_for_spmd_types(self)
        if _torch.transforms_active():  # before any communication (the replicas' check)
            batched = _torch.vmap_batched(x) or _torch.vmap_batched(self.router.weight)
            refuse_batched_routing("parallel.ExpertParallelMoE", "the input or the router", batched)
        x2 = _tokens("parallel.ExpertParallelMoE", x, self.hidden_size, self.router.weight.dtype)
        if positions is not None:  # before any communication (the replicas' check, the dispatch)
            if isinstance(positions, Tensor) and positions.ndim > 1 and positions.shape == x.shape[:-1]:
                positions = positions.reshape(-1)
            check_positions("parallel.ExpertParallelMoE", positions, x2)
        if not _torch.compiling():  # (dynamo cannot read a tensor's __dict__; noted in _adopt too)
            self._note_experts()
        if active_ddp() is not None:  # torch's DDP over ranks holding other experts: refused
            experts = [(n, p, self._pg) for n, p in self.experts.named_parameters(prefix="experts")]
            check_not_synced_by_ddp(self, "parallel.ExpertParallelMoE", experts)
        if self.__dict__.pop("_replicas_unchecked", False):  # drawn unseeded: once, they agree
            replicas = [self.router, self.shared_expert]
            named = [
                (f"{n}.{k}", p)
                for n, m in zip(("router", "shared_expert"), replicas)
                if m is not None
                for k, p in m.named_parameters()
            ]
            check_replicas_agree(named, "ExpertParallelMoE (first forward)", self._pg)
        gate, index, probs = route(self.router(x2), self.k, renormalize=self.renormalize)
        overlap = self.overlap_shared and self.shared_expert is not None
        h, plan = dispatch(
            x2,
            index,
            self.num_experts,
            self._pg,
            capacity_factor=self.capacity_factor,
            async_op=overlap,
            positions=positions,
        )
        shared = self.shared_expert(x2) if self.shared_expert is not None else None  # overlaps the dispatch
        if overlap:
            h = _async.wait(h)
        outs = [expert(part) for expert, part in zip(self.experts, h.split(list(plan.expert_splits)))]
        y_experts = torch.cat(outs) if outs else h
        # the gates in the tokens' dtype, as the serial MoE weighs them (under autocast
        # the expert rows are bf16: combine sums them in the promoted, the tokens', dtype)
        y = combine(y_experts, gate.to(x2.dtype), plan)
        if shared is not None:
            y = y + shared
        self.aux_loss = load_balancing_loss(probs, plan)
        self.tokens_per_expert = plan.tokens_per_expert
        self.dropped = plan.dropped
        self.plan = plan
        return y.reshape(x.shape[:-1] + (y.shape[-1],))
