"""Pipeline parallelism on diffcomm's differentiable send/recv: GPipe and 1F1B.

A model (an ``nn.Sequential`` or a list of modules) is cut into contiguous stages with
:func:`partition`; rank ``s`` of the group runs stage ``s`` under a
:class:`PipelineRunner`. A step splits the batch into micro-batches and runs a
**schedule**: per rank, a list of :class:`Step` s — ``F`` (forward of one micro-batch) and
``B`` (its backward). Schedules are plain data (:func:`gpipe_schedule`,
:func:`one_f_one_b_schedule`), so they can be printed, checked and swapped.

How the autograd graph crosses ranks (the design, in short — see ``docs/pipeline.md``):

* ``F`` on stage ``s``: ``x = dc.recv(src=s-1)`` (stage 0 takes its micro-batch), ``y =
  stage(x)``, then ``token = dc.send(y, dst=s+1)`` — or, on the last stage, ``loss_m =
  loss_fn(y, target_m) / n_micro``. The token (or the loss) is stashed.
* ``B``: ``token.backward()`` (``loss_m.backward()`` on the last stage). The send's
  backward receives ``dL/dy`` from stage ``s+1``, autograd carries it through the stage
  into the parameters and into ``x``, and ``x``'s recv-backward sends ``dL/dx`` to
  ``s-1``. No gradient is handled by hand: activations and gradients move only through
  :func:`diffcomm.send` / :func:`diffcomm.recv`.

Because diffcomm sends are asynchronous and receives block, any schedule whose data
dependencies are acyclic (both built-in ones) runs without deadlock; gradients pair
with their activations by sequence number, whatever order backward steps run in.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn

from . import _args as A
from . import _config, p2p
from . import backend as B

__all__ = [
    "Step",
    "gpipe_schedule",
    "one_f_one_b_schedule",
    "SCHEDULES",
    "check_schedule",
    "max_in_flight",
    "partition",
    "PipelineRunner",
    "TimelineEntry",
    "bubble_fraction",
    "theoretical_bubble",
]

ScheduleFn = Callable[[int, int], list[list["Step"]]]


# ======================================================================================
# schedules (data)
# ======================================================================================


@dataclass(frozen=True)
class Step:
    """One step of a schedule: ``kind`` ``"F"`` (forward) or ``"B"`` (backward) of
    micro-batch ``micro``. Prints as ``F0``, ``B3``..."""

    kind: Literal["F", "B"]
    micro: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}"

    __repr__ = __str__


def _check_counts(n_stages: Any, n_micro: Any, op: str) -> tuple[int, int]:
    n_stages = A.check_int(n_stages, op, "n_stages")
    n_micro = A.check_int(n_micro, op, "n_micro")
    if n_stages < 1:
        raise A.arg_error(op, "n_stages", "an int >= 1", n_stages)
    if n_micro < 1:
        raise A.arg_error(op, "n_micro", "an int >= 1", n_micro)
    return n_stages, n_micro


def gpipe_schedule(n_stages: int, n_micro: int) -> list[list[Step]]:
    """GPipe: every stage runs all forwards, then all backwards.

    Args:
        n_stages: number of pipeline stages (ranks).
        n_micro: number of micro-batches.

    Returns:
        One list of steps per stage: ``F0 .. F(m-1), B0 .. B(m-1)``. Every stage holds
        the activations of all ``m`` micro-batches at its peak.

    Example::

        >>> gpipe_schedule(2, 2)
        [[F0, F1, B0, B1], [F0, F1, B0, B1]]
    """
    n_stages, n_micro = _check_counts(n_stages, n_micro, "gpipe_schedule")
    one = [Step("F", i) for i in range(n_micro)] + [Step("B", i) for i in range(n_micro)]
    return [list(one) for _ in range(n_stages)]


def one_f_one_b_schedule(n_stages: int, n_micro: int) -> list[list[Step]]:
    """1F1B (PipeDream-flush): warm-up forwards, then alternate one forward, one backward.

    Stage ``s`` runs ``min(n_stages - s - 1, n_micro)`` warm-up forwards, then ``F, B``
    pairs, then the remaining backwards. Same bubble as GPipe, but stage ``s`` never holds
    more than ``min(n_stages - s, n_micro)`` micro-batches' activations (GPipe: all).

    Args:
        n_stages: number of pipeline stages (ranks).
        n_micro: number of micro-batches.

    Returns:
        One list of steps per stage.

    Example::

        >>> one_f_one_b_schedule(2, 3)
        [[F0, F1, B0, F2, B1, B2], [F0, B0, F1, B1, F2, B2]]
    """
    n_stages, n_micro = _check_counts(n_stages, n_micro, "one_f_one_b_schedule")
    out = []
    for s in range(n_stages):
        warm = min(n_stages - s - 1, n_micro)
        steps = [Step("F", i) for i in range(warm)]
        f, b = warm, 0
        while f < n_micro:
            steps += [Step("F", f), Step("B", b)]
            f, b = f + 1, b + 1
        steps += [Step("B", i) for i in range(b, n_micro)]
        out.append(steps)
    return out


#: Built-in schedules by name.
SCHEDULES: dict[str, ScheduleFn] = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule}


def max_in_flight(steps: Sequence[Step]) -> int:
    """Most micro-batches whose forward ran and whose backward has not, at any point."""
    live = peak = 0
    for st in steps:
        live += 1 if st.kind == "F" else -1
        peak = max(peak, live)
    return peak


def check_schedule(schedule: Sequence[Sequence[Step]], n_stages: int, n_micro: int) -> None:
    """Raise ``ValueError`` unless every stage runs each micro-batch's ``F`` exactly once,
    then its ``B`` exactly once, with forwards (and backwards) in micro-batch order — the
    order the activations (gradients) travel in between neighbouring stages."""
    if len(schedule) != n_stages:
        raise A.arg_error("check_schedule", "schedule", f"{n_stages} per-stage lists", len(schedule))
    for s, steps in enumerate(schedule):
        for st in steps:
            if not isinstance(st, Step) or st.kind not in ("F", "B") or not 0 <= st.micro < n_micro:
                raise A.arg_error("check_schedule", "schedule", f"Steps F/B with micro in [0, {n_micro})", st)
        fs = [st.micro for st in steps if st.kind == "F"]
        bs = [st.micro for st in steps if st.kind == "B"]
        if fs != list(range(n_micro)):
            raise A.arg_error(
                "check_schedule", "schedule", "forwards F0..F(m-1) in order", f"stage {s}: {fs}"
            )
        if sorted(bs) != list(range(n_micro)):
            raise A.arg_error(
                "check_schedule", "schedule", "one backward per micro-batch", f"stage {s}: {bs}"
            )
        pos = {(st.kind, st.micro): i for i, st in enumerate(steps)}
        late = [m for m in range(n_micro) if pos[("B", m)] < pos[("F", m)]]
        if late:
            raise A.arg_error(
                "check_schedule", "schedule", "each F before its B", f"stage {s}: B{late[0]} first"
            )


# ======================================================================================
# partition
# ======================================================================================


def _n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def partition(
    model: nn.Sequential | Sequence[nn.Module], n_stages: int, balance: Sequence[int] | None = None
) -> list[nn.Sequential]:
    """Cut a sequential model into ``n_stages`` contiguous stages.

    Args:
        model: an ``nn.Sequential`` or a list of modules applied in order.
        n_stages: number of stages (>= 1, at most the number of layers).
        balance: layers per stage (``n_stages`` positive ints summing to the number of
            layers); default: minimise the largest stage's parameter count.

    Returns:
        ``n_stages`` ``nn.Sequential`` s sharing the model's modules (no copies), so the
        parameters of stage ``s`` are the model's own.

    Example::

        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        stages = partition(model, 2)       # [Linear, ReLU, Linear] | [ReLU, Linear] (by params)
        stage = stages[dc.get_rank()]
    """
    layers = list(model.children()) if isinstance(model, nn.Sequential) else list(model)
    if not all(isinstance(m, nn.Module) for m in layers):
        raise A.arg_error("partition", "model", "an nn.Sequential or a list of nn.Modules", model, TypeError)
    n_stages = A.check_int(n_stages, "partition", "n_stages")
    n = len(layers)
    if not 1 <= n_stages <= n:
        raise A.arg_error("partition", "n_stages", f"an int in [1, {n}] (the number of layers)", n_stages)
    if balance is not None:
        sizes = [A.check_int(b, "partition", "balance") for b in balance]
        if len(sizes) != n_stages or any(b < 1 for b in sizes) or sum(sizes) != n:
            raise A.arg_error(
                "partition", "balance", f"{n_stages} positive ints summing to {n} (the layers)", list(balance)
            )
    else:
        sizes = _balanced_sizes([_n_params(m) for m in layers], n_stages)
    out, start = [], 0
    for size in sizes:
        out.append(nn.Sequential(*layers[start : start + size]))
        start += size
    return out


def _balanced_sizes(costs: list[int], k: int) -> list[int]:
    """Contiguous split of ``costs`` into ``k`` non-empty parts minimising the largest sum
    (ties broken towards equal layer counts), by dynamic programming."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = (float("inf"), float("inf"))
    # best[j][i]: (max part cost, max part length) splitting the first i layers into j parts
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = (0, 0)
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for t in range(j - 1, i):
                prev = best[j - 1][t]
                cand = (max(prev[0], prefix[i] - prefix[t]), max(prev[1], i - t))
                if cand < best[j][i]:
                    best[j][i], cut[j][i] = cand, t
    sizes, i = [], n
    for j in range(k, 0, -1):
        t = cut[j][i]
        sizes.append(i - t)
        i = t
    return sizes[::-1]


# ======================================================================================
# the runner
# ======================================================================================


@dataclass
class TimelineEntry:
    """One executed step: wall-clock ``start``/``end`` (``time.perf_counter``, comparable
    across processes of one machine) and ``wait``, the seconds spent blocked in receives
    (so ``end - start - wait`` is this stage's busy time)."""

    kind: str
    micro: int
    start: float
    end: float
    wait: float

    @property
    def busy(self) -> float:
        return max(0.0, self.end - self.start - self.wait)


@dataclass
class _Stash:
    """What one in-flight micro-batch keeps until its backward."""

    handle: Tensor  # the send token, or the scaled loss on the last stage
    nbytes: int
    input: Tensor | None = None
    storages: set[tuple[int, int, torch.dtype]] = field(default_factory=set)


class PipelineRunner:
    """Run one pipeline stage: micro-batched forward and backward under a schedule.

    Every rank of ``group`` builds a runner for its own stage (stage index = group-local
    rank) and calls :meth:`step` with the same ``n_micro``. Activations and gradients
    move only through :func:`diffcomm.send` / :func:`diffcomm.recv`.

    Args:
        stage: this rank's stage (e.g. ``partition(model, n)[rank]``).
        schedule: ``"1f1b"`` (default), ``"gpipe"``, or a function
            ``(n_stages, n_micro) -> per-stage lists of Step``.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        loss_fn: ``loss_fn(output, target) -> scalar`` (``loss_fn(output)`` when no
            targets are given); needed on the last stage. Use a *mean*-reduced loss for
            the step loss to equal the full-batch loss.
        broadcast_loss: return the loss on every rank (one small broadcast per step);
            otherwise non-last stages return ``None``.
        tag: p2p tag of this pipeline's messages (two pipelines on one group need two).

    Attributes:
        timeline: after a step, a list of :class:`TimelineEntry`, one per executed step.
        peak_activation_bytes: after a step, the most bytes of saved-for-backward tensors
            (activations, parameters excluded) alive at once on this stage during it.
        input_grad: after a step, on stage 0 with ``step(..., input_grad=True)``: gradient
            of the loss with respect to ``inputs``; else ``None``.

    Example::

        def train():
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
            stage = partition(model, dc.get_world_size())[dc.get_rank()]
            runner = PipelineRunner(stage, "1f1b", loss_fn=nn.functional.mse_loss)
            x, y = torch.randn(8, 4), torch.randn(8, 1)     # same on every rank (seeded)
            return runner.step(x, y, n_micro=4)             # mean over micro-batches

        with dc.LocalWorld(2) as world:
            world.run(train)     # [loss, loss]; .grad of each stage's parameters filled
    """

    def __init__(
        self,
        stage: nn.Module,
        schedule: str | ScheduleFn = "1f1b",
        group: A.GroupLike = None,
        loss_fn: Callable[..., Tensor] | None = None,
        broadcast_loss: bool = True,
        tag: int = 0,
    ) -> None:
        if not isinstance(stage, nn.Module):
            raise A.arg_error("PipelineRunner", "stage", "an nn.Module", type(stage).__name__, TypeError)
        if isinstance(schedule, str):
            key = schedule.lower()
            if key not in SCHEDULES:
                raise A.arg_error(
                    "PipelineRunner", "schedule", f"one of {list(SCHEDULES)} or a function", schedule
                )
            self.schedule_name, self._schedule_fn = key, SCHEDULES[key]
        elif callable(schedule):
            self.schedule_name, self._schedule_fn = getattr(schedule, "__name__", "custom"), schedule
        else:
            raise A.arg_error(
                "PipelineRunner",
                "schedule",
                "a schedule name or function",
                type(schedule).__name__,
                TypeError,
            )
        self.pg = A.resolve_group(group, "PipelineRunner")
        self.rank = B.get_backend().rank(self.pg)
        self.n_stages = B.get_backend().world_size(self.pg)
        self.is_first, self.is_last = self.rank == 0, self.rank == self.n_stages - 1
        if self.is_last and loss_fn is None:
            raise A.arg_error(
                "PipelineRunner", "loss_fn", "a loss function on the last stage", None, TypeError
            )
        if loss_fn is not None and not callable(loss_fn):
            raise A.arg_error("PipelineRunner", "loss_fn", "callable", type(loss_fn).__name__, TypeError)
        self.stage = stage
        self.loss_fn = loss_fn
        self.broadcast_loss = bool(broadcast_loss)
        self.tag = p2p._check_tag(tag, "PipelineRunner")
        self.timeline: list[TimelineEntry] = []
        self.peak_activation_bytes = 0
        self.input_grad: Tensor | None = None

    # ---- the schedule --------------------------------------------------------------
    def steps(self, n_micro: int) -> list[Step]:
        """This stage's steps for ``n_micro`` micro-batches (validated)."""
        schedule = self._schedule_fn(self.n_stages, n_micro)
        check_schedule(schedule, self.n_stages, n_micro)
        return list(schedule[self.rank])

    # ---- one step --------------------------------------------------------------------
    def step(
        self,
        inputs: Tensor | None = None,
        targets: Tensor | None = None,
        n_micro: int = 1,
        input_grad: bool = False,
    ) -> Tensor | None:
        """Forward and backward of one batch, split into ``n_micro`` micro-batches.

        Every rank may pass the same ``inputs``/``targets`` (SPMD style): stage 0 uses
        only ``inputs``, the last stage only ``targets``; others may pass ``None``.
        Parameter gradients **accumulate** into ``.grad`` (as ``loss.backward()`` does;
        zero them between steps) and are those of the step loss.

        Args:
            inputs: the batch (stage 0): a tensor split along dim 0.
            targets: the targets (last stage), split along dim 0 like ``inputs``; or
                ``None`` when ``loss_fn`` takes only the output.
            n_micro: number of micro-batches; must divide the batch size.
            input_grad: stage 0 keeps the gradient of the loss w.r.t. ``inputs`` in
                :attr:`input_grad`.

        Returns:
            The step loss — the **mean over micro-batches** of ``loss_fn(out_m,
            target_m)``, equal to ``loss_fn`` on the full batch for a mean-reduced loss —
            as a detached 0-dim tensor: on every rank with ``broadcast_loss``, else on the
            last stage (``None`` elsewhere).

        Gradient:
            Each micro-batch's loss is scaled by ``1/n_micro`` before its backward, so the
            accumulated gradient is that of the returned mean loss.
        """
        n_micro = A.check_int(n_micro, "PipelineRunner.step", "n_micro")
        if n_micro < 1:
            raise A.arg_error("PipelineRunner.step", "n_micro", "an int >= 1", n_micro)
        in_chunks = self._split(inputs, n_micro, "inputs") if self.is_first else None
        tgt_chunks = (
            self._split(targets, n_micro, "targets") if self.is_last and targets is not None else None
        )
        steps = self.steps(n_micro)
        if _config.DEBUG.get():
            B.get_backend().check_consistent(  # type: ignore[attr-defined]
                "PipelineRunner.step", {"n_micro": n_micro, "schedule": self.schedule_name}, self.pg
            )
        self.timeline, self.peak_activation_bytes, self.input_grad = [], 0, None
        self._param_storages = {p.untyped_storage().data_ptr() for p in self.stage.parameters()}
        self._live_bytes = 0
        self._inputs_kept: list[Tensor] = []
        stash: dict[int, _Stash] = {}
        total = torch.zeros((), dtype=torch.float64)
        for st in steps:
            with B.log_comms() as log:
                start = time.perf_counter()
                if st.kind == "F":
                    loss_m = self._forward(st.micro, in_chunks, tgt_chunks, n_micro, stash, input_grad)
                    if loss_m is not None:
                        total += loss_m.detach().to(total.device, torch.float64)
                else:
                    self._backward(st.micro, stash)
                end = time.perf_counter()
            wait = sum(r.seconds for r in log.records if r.op == "recv")
            self.timeline.append(TimelineEntry(st.kind, st.micro, start, end, wait))
        p2p.wait_sends()
        if input_grad and self.is_first:
            grads = [s.grad if s.grad is not None else torch.zeros_like(s) for s in self._inputs_kept]
            self.input_grad = torch.cat(grads)
        self._inputs_kept = []
        if self.broadcast_loss and self.n_stages > 1:
            out = B.get_backend().broadcast(total.to(B._comm_device(self.pg)), self.n_stages - 1, self.pg)
            return out.cpu()
        return total if self.is_last else None

    def _split(self, t: Tensor | None, n_micro: int, arg: str) -> list[Tensor]:
        if t is None:
            raise A.arg_error("PipelineRunner.step", arg, f"a tensor on stage {self.rank}", None, TypeError)
        t = A.check_tensor(t, "PipelineRunner.step", arg)
        if t.ndim == 0 or t.shape[0] % n_micro != 0:
            raise A.arg_error(
                "PipelineRunner.step",
                arg,
                f"a batch whose size along dim 0 is divisible by n_micro={n_micro}",
                f"shape {tuple(t.shape)}",
            )
        return list(t.chunk(n_micro))

    def _forward(
        self,
        m: int,
        in_chunks: list[Tensor] | None,
        tgt_chunks: list[Tensor] | None,
        n_micro: int,
        stash: dict[int, _Stash],
        input_grad: bool,
    ) -> Tensor | None:
        kept: _Stash = _Stash(handle=torch.zeros(()), nbytes=0)
        if self.is_first:
            assert in_chunks is not None
            x = in_chunks[m]
            if input_grad:
                x = x.detach().requires_grad_()
                self._inputs_kept.append(x)
        else:
            x = p2p.recv(self.rank - 1, group=self.pg, tag=self.tag)

        def pack(t: Tensor) -> Tensor:
            # distinct saved tensors (a ReLU output saved twice counts once), by their own
            # bytes (a micro-batch view of the batch counts its slice), parameters excluded
            key = (t.data_ptr(), t.numel(), t.dtype)
            if t.untyped_storage().data_ptr() not in self._param_storages and key not in kept.storages:
                kept.storages.add(key)
                kept.nbytes += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = self.stage(x)
            if self.is_last:
                assert self.loss_fn is not None
                tgt = None if tgt_chunks is None else tgt_chunks[m]
                loss = self.loss_fn(y) if tgt is None else self.loss_fn(y, tgt)
                kept.handle = loss / n_micro
            else:
                kept.handle = p2p.send(y, self.rank + 1, group=self.pg, tag=self.tag)
        stash[m] = kept
        self._live_bytes += kept.nbytes
        self.peak_activation_bytes = max(self.peak_activation_bytes, self._live_bytes)
        return kept.handle if self.is_last else None

    def _backward(self, m: int, stash: dict[int, _Stash]) -> None:
        kept = stash.pop(m)
        # the token (or loss) requires grad iff anything upstream does; recv on the next
        # stage made the same decision from the header, so skipping here is symmetric
        if kept.handle.requires_grad:
            kept.handle.backward()
        self._live_bytes -= kept.nbytes


def bubble_fraction(timelines: Sequence[Sequence[TimelineEntry]]) -> float:
    """Measured bubble of one step: the mean over stages of the idle share of the step.

    The step spans from the earliest start to the latest end over all stages; a stage is
    busy for the sum of its steps' ``busy`` time (time blocked in receives excluded).
    Compare with the ideal ``(p - 1) / (m + p - 1)`` for uniform stages and free comms.
    """
    t0 = min(e.start for tl in timelines for e in tl)
    t1 = max(e.end for tl in timelines for e in tl)
    span = t1 - t0
    if span <= 0:
        return 0.0
    return sum(1.0 - sum(e.busy for e in tl) / span for tl in timelines) / len(timelines)


def theoretical_bubble(n_stages: int, n_micro: int) -> float:
    """``(p - 1) / (m + p - 1)``: the idle share of GPipe and 1F1B with uniform stages."""
    return (n_stages - 1) / (n_micro + n_stages - 1)
