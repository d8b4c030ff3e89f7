"""The pipeline runner: one rank's stage (or chunks) under a schedule.

How the autograd graph crosses ranks (see ``docs/pipeline.md``): ``F`` receives the
activation with :func:`diffcomm.recv` (it requires grad), runs the chunk and sends the
output with :func:`diffcomm.send`, keeping the token (the last virtual stage keeps its
scaled loss instead). ``B`` is ``token.backward()``: the send's backward receives the
output gradient, autograd carries it into the parameters and into the input, whose
recv-backward sends it on. No gradient is handled by hand; where none exists (a
received input the backward did not reach) the runner answers "no gradient"
(``p2p.send_no_grad``, one byte in the gradient message), the upstream token's backward
raises ``p2p.NoGradient`` before anything else ran, and that micro-batch runs no backward
there: the parameters keep ``.grad`` as serially (``None`` stays ``None``).

The zero-bubble split: ``I`` runs the same backward restricted to the input
(``torch.autograd.backward(token, inputs=[the receive's input edge])``, graph retained),
so the send and receive of gradients happen exactly as in ``B``; hooks on the nodes where
the parameters' branches leave the input path keep the gradients arriving there. ``W``
starts from those nodes with those gradients and runs only the parameters' branches
(``torch.autograd.backward(edges, grads, inputs=params)``), so no input-gradient work is
repeated. Where the input's path runs through a ``torch.compile``'d region (AOTAutograd:
one node computing the input's and the weights' gradients at once), ``I`` runs the
micro-batch's whole backward once and ``W`` nothing (``TimelineEntry.whole``).

Input gradient first: a ``B`` step runs ``I`` then ``W`` back to back, so the input
gradient leaves for the previous stage before the weight gradients are computed (the
message travels during ``W``; a plain ``token.backward()`` reaches the receive's node,
which sends it, last). ``grad_first=False`` runs one plain backward;
``grad_first="cooldown"`` splits only the ``B`` steps after this rank's last ``F`` (where
every upstream stage has nothing left but backwards that wait for this gradient) and runs
the others as one plain backward, which is cheaper where the split costs more than the
message it hides (see ``docs/pipeline.md``); it is the default.

Pre-posted receives: before computing step ``k`` the runner posts the receive step
``k + 1`` will need (the next activation with :func:`diffcomm.ops.p2p.irecv`, or the next
gradient with :func:`diffcomm.ops.p2p.post_grad_recv`), so that message travels while step
``k`` computes. Earlier still: a sent activation's gradient receive is posted at the send,
and a channel's next activation receive as soon as the previous one arrived (one per
channel, so they complete in order), so the peer's message finds its receive posted even
when the peer sends it before this rank reaches step ``k``: a gloo message that finds no
receive posted waits for the sender's side to answer the receive once it is posted,
which a sender busy computing does late (in the V schedules 16-40 ms on the loaded
2-core machine, where step ``k`` was long; docs/pipeline.md). A step that raises leaves
its posted activation receives to the next step's first receives on their channels (a
posted receive cannot be taken back, and takes its channel's next message).

One message per activation: the first activation on a channel goes as
:func:`diffcomm.send` does (a header, then the data; the receiver learns the shape), every
later one of the channel's agreed shape and dtype with its header fused in front of its
data (``p2p.send_owned(..., fused=True)``, received with ``p2p.irecv_fused`` expecting
that shape): one gloo message instead of two, into a receive posted before it was sent.
The agreed shape is that of the channel's first activation in the last step, kept across
steps by both ends (so a step's first activation is fused too, from the second step on):
both ends decide from facts they share, so they always agree; an activation of another
shape (a chunk whose output shape depends on the data, a new micro-batch size) goes
plainly, the fused receive takes it too, and the first one of a step becomes the agreed
shape. A header-first message costs more than its latency: its data receive is posted
only once the header is in, so the transfer waits for the sender's side to answer it, and
a sender that went on computing answers late (measured here: 2-5 ms on 2 cores, for a
message the fused form delivers in ~0.2 ms). A step that raises forgets the shapes this
rank sends (its next activations go plainly, which any receive takes).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from .. import _config
from .. import backend as B
from .._replication import varying_parameters
from ..backend import args as A
from ..ops import p2p
from ..ops.wire import recv_wait_seconds as _recv_wait_seconds
from . import aux as _aux
from ._context import note_records, records
from ._ddp import average_grads, check_ddp_groups, ddp_modules, no_sync
from ._layer_groups import check_layer_groups
from ._split import Whole, capture, cooldown, group_plan, input_edge, reaches, weight_plan
from .partition import has_running_stats
from .schedules import (
    SCHEDULES,
    Overlap,
    ScheduleFn,
    Step,
    expand_steps,
    schedule_placement,
    stage_owner,
    virtual_stage,
)
from .timeline import TimelineEntry
from .validate import check_schedule

# Size: ~1360 lines, over the ~600 guideline: one class (PipelineRunner) whose step loop, forward,
# split backward, pre-posted receives, the V placement's local turn and the phased forward of
# an Overlap share one step's state (and the tied weights' gradients, summed at its end).

__all__ = ["PipelineRunner"]


@dataclass
class _Stash:
    """What one in-flight (micro-batch, chunk) keeps until its backward."""

    handle: Tensor  # the send token, or the scaled loss on the last virtual stage
    nbytes: int
    input: Tensor | None = None  # the chunk's input (received, or a stage-0 leaf)
    # the leaf its gradient flows into (input_edge), found before the chunk ran: a chunk
    # that modifies its input in place (nn.ReLU(inplace=True) first) moves its grad_fn
    target: Tensor | None = None
    output: Tensor | None = None  # the sent output (kept only for a split backward)
    storages: set[tuple[int, int, torch.dtype]] = field(default_factory=set)
    # after I: what W needs
    groups: list[tuple[list[Node], list[tuple[Tensor | None, ...]], list[Node]]] | None = None
    d_output: Tensor | None = None
    full_in_w: bool = False
    grad_bytes: int = 0
    local: bool = False  # the next virtual stage is on this rank (V placement's turn)
    grad_posted: bool = False  # the receive of the output's gradient is posted
    # a received input that requires grad: [True] once its gradient was computed (the
    # receive's backward, which sends it upstream, ran), and the receive's node (taken
    # before the chunk could modify the input in place), to answer "no gradient"
    reached: list[bool] | None = None
    recv_node: Node | None = None
    given: bool = True  # False: W has nothing to run (no gradient downstream, or I ran it all)


@dataclass
class _Batch:
    """One :meth:`PipelineRunner.step`'s state, read by every step it runs."""

    steps: list[Step]  # this rank's steps, Overlaps unfolded
    fused: list[bool]  # per step: part of an Overlap (its timeline entry says so)
    in_chunks: list[Tensor] | None  # the first stage's micro-batches
    tgt_chunks: list[Tensor] | None  # the last stage's targets, per micro-batch
    n_micro: int
    input_grad: bool  # keep the gradient of the inputs (step(..., input_grad=True))
    total: Tensor  # the sum of the micro-batch losses, float64 (added to in place)
    stash: dict[tuple[int, int], _Stash] = field(default_factory=dict)  # (micro, chunk) in flight


#: one rank's steps (Overlaps unfolded), per step whether it is half of an Overlap, the B
#: steps that split (None: all, by grad_first), and per F step (micro, chunk) the next F on
#: its chunk — see PipelineRunner._plan
_Plan = tuple[list[Step], list[bool], set[tuple[int, int]] | None, dict[tuple[int, int], Step]]


class _LocalSend(torch.autograd.Function):
    """The token of an activation handed to the next virtual stage on the same rank (the
    V placement's turn at rank ``p - 1``): its backward returns the gradient that stage's
    backward left in its input leaf (``box[0].grad``), as a send token's backward returns
    the gradient it receives, and raises ``p2p.NoGradient`` where it left none, as a
    send token's does on "no gradient"."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, y: Tensor, box: list[Tensor]) -> Tensor:
        ctx.box = box  # type: ignore[attr-defined]
        return y.new_zeros((), dtype=y.real.dtype if y.is_complex() else y.dtype)  # (as a send token)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, _: Tensor) -> tuple[Tensor, None]:
        g = ctx.box[0].grad  # type: ignore[attr-defined]
        if g is None:  # (nothing else of the backward ran: this node is its first)
            raise p2p.NoGradient("the V turn's next chunk left its input no gradient")
        return g, None


class _TurnInput(torch.autograd.Function):
    """The V turn's input as chunk 1 sees it: an alias of the leaf whose ``.grad``
    :class:`_LocalSend` returns, made by a node (as a received input is made by the
    receive's) so that the chunk may modify it in place — a leaf that requires grad
    refuses that (an ``nn.ReLU(inplace=True)`` first in the chunk raised on rank ``p-1``
    where the serial model ran). It aliases the previous chunk's output, as the serial
    model's next layer does."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, leaf: Tensor) -> Tensor:
        return leaf.detach()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> Tensor:
        return grad


class _Inner:
    """The backward of an :class:`Overlap` run in pieces between the phases of its
    forward (the overlap hook): each call runs the next piece — a ``B`` that can split
    runs its ``I`` (the input gradient leaves) then, at the forward's next ``yield``, its
    ``W``; an ``I``, or a ``B`` that cannot split, is one piece — so a chunk whose forward
    yields twice (:class:`~diffcomm.pipeline.MoEStage`: dispatch, then combine in flight)
    hides both communications under the other micro-batch's compute. :meth:`finish`
    runs what the forward's phases left; :meth:`entry` is the step's timeline entry (its
    pieces' busy time, from the first piece's start)."""

    def __init__(
        self,
        runner: PipelineRunner,
        k: int,
        steps: list[Step],
        stash: dict[tuple[int, int], _Stash],
        fused: list[bool],
    ) -> None:
        self.runner, self.k, self.steps, self.stash, self.fused = runner, k, steps, stash, fused
        self.start: float | None = None
        self.span = self.wait = 0.0
        self.sent: float | None = None
        self.whole = False  # its I ran the whole backward (a compiled region)
        self.pieces = [self._first, self._weight]

    def __call__(self) -> None:
        if self.pieces:
            piece = self.pieces.pop(0)
            waited = _recv_wait_seconds()
            t0 = time.perf_counter()
            piece()
            self.span += time.perf_counter() - t0
            self.wait += _recv_wait_seconds() - waited
            if self.start is None:
                self.start = t0
            if piece == self._first and self.pieces:  # a split B: its input gradient has left
                self.sent = max(0.0, self.span - self.wait)

    def finish(self) -> None:
        while self.pieces:
            self()

    def _first(self) -> None:
        run, st = self.runner, self.steps[self.k]
        nxt = self.steps[self.k + 1] if self.k + 1 < len(self.steps) else None
        run._prepost(nxt, self.stash)
        kept = self.stash[(st.micro, st.chunk)]
        run._whole = False
        if st.kind == "B" and kept.handle.requires_grad:
            # (a chunk whose input needs no gradient: I takes the output gradient, W the
            # whole backward, so the second communication still has compute to hide under)
            run._backward_input(st, self.stash, hold=False)  # the W piece comes next
            self.whole = run._whole
            return
        self.pieces.clear()  # one piece: the whole step
        if st.kind == "B":
            run._backward(st, self.stash)
        else:
            own_w = nxt is not None and (nxt.kind, nxt.micro, nxt.chunk) == ("W", st.micro, st.chunk)
            run._backward_input(st, self.stash, hold=not own_w)
        self.whole = run._whole

    def _weight(self) -> None:
        self.runner._backward_weight(self.steps[self.k], self.stash)

    def entry(self) -> TimelineEntry:
        st, start = self.steps[self.k], self.start if self.start is not None else time.perf_counter()
        return TimelineEntry(
            st.kind, st.micro, start, start + self.span, self.wait, st.chunk, self.sent, self.fused[self.k],
            self.whole,
        )  # fmt: skip


class PipelineRunner:
    """Run one pipeline rank: micro-batched forward and backward under a schedule.

    Every rank of ``group`` builds a runner for its own stage (stage index = group-local
    rank) — or, for a schedule with ``v`` virtual stages per rank, its ``v`` chunks — and
    calls :meth:`step` with the same ``n_micro``. Activations and gradients move only
    through :func:`diffcomm.send` / :func:`diffcomm.recv` (and their posted forms).

    Args:
        stage: this rank's stage (e.g. ``partition(model, p)[rank]``), or a list of its
            ``v`` chunks (``partition(model, p * v)[rank::p]``: rank ``r`` holds virtual
            stages ``r, r + p, ...``).
        schedule: ``"1f1b"`` (default), ``"gpipe"``, ``"interleaved"``, ``"zb-h1"``,
            ``"zbv"``, ``"dualpipev"``, or a function ``(n_stages, n_micro[, n_chunks]) ->
            per-rank lists of Step`` (called with ``n_chunks`` only when ``v > 1``; a
            function with ``placement = "v"`` uses the V placement). ``"zbv"`` and
            ``"dualpipev"`` use the V placement: ``stage`` is the rank's two chunks,
            virtual stages ``r`` and ``2p - 1 - r`` (``partition(model, 2p)``: ``[parts[r],
            parts[2p - 1 - r]]``), and rank 0 computes the loss.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        loss_fn: ``loss_fn(output, target) -> scalar`` (``loss_fn(output)`` when no
            targets are given); needed on the last rank. Use a *mean*-reduced loss for
            the step loss to equal the full-batch loss.
        broadcast_loss: return the loss on every rank (one small broadcast per step);
            otherwise other ranks return ``None``.
        tag: p2p tag of this pipeline's messages; chunk ``c`` sends on ``tag + c`` (two
            pipelines on one group need disjoint ranges, ``tag`` to ``tag + n_chunks``:
            the gradients of a weight tied across ranks' stages, see :func:`partition`, go
            on ``tag + n_chunks``).
        prepost: post the next step's receive before computing the current step
            (default); ``False`` receives only when a step needs the data.
        grad_first: in a ``B`` step, compute the input gradient first and send it
            upstream, then the weight gradients (``True``; the same work as one
            backward, split as ``I`` + ``W``); ``False`` runs one plain backward, which
            sends the input gradient only after every weight gradient; ``"cooldown"``
            splits only the ``B`` steps after this rank's last ``F`` and runs the others
            plainly. Default ``None``: ``"cooldown"`` (in the steady state a split
            ``B`` costs CPU and the gradient it sends early only moves an upstream
            rank's idle time; in the cooldown every upstream stage waits for it;
            measured in ``docs/pipeline.md``).
        costs: step times for a schedule that places ``W`` steps by them (``"zb-h1"``,
            ``"zbv"``): ``None`` (unit times; ZB-V: torch's order), a mapping (or one per
            rank) ``{"F", "I", "W"}``, or ``"measure"``: the first step (the warm-up, run
            with unit times) measures every rank's median busy time per kind (one small
            all-reduce), the second (placed by those) measures again, warm, and every
            later step's ``W`` steps are placed by the second's times
            (:meth:`remeasure` profiles again on the next two steps).

    Attributes:
        timeline: after a step, a list of :class:`TimelineEntry`, one per executed step.
        peak_activation_bytes: after a step, the most bytes of saved-for-backward tensors
            (activations, parameters excluded; for a split backward also the gradients
            kept from ``I`` for ``W``) alive at once on this rank during it.
        input_grad: after a step, on rank 0 with ``step(..., input_grad=True)``: gradient
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
        stage: nn.Module | Sequence[nn.Module],
        schedule: str | ScheduleFn = "1f1b",
        group: A.GroupLike = None,
        loss_fn: Callable[..., Tensor] | None = None,
        broadcast_loss: bool = True,
        tag: int = 0,
        prepost: bool = True,
        grad_first: bool | str | None = None,
        costs: object = None,
    ) -> None:
        if isinstance(stage, nn.Module):
            chunks = [stage]
        elif isinstance(stage, Sequence) and stage and all(isinstance(c, nn.Module) for c in stage):
            chunks = list(stage)
        else:
            raise A.arg_error(
                "PipelineRunner",
                "stage",
                "an nn.Module or a non-empty list of them",
                type(stage).__name__,
                TypeError,
            )
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
        info = B.group_info(self.pg)
        self.rank, self.n_stages = info.rank, info.size
        self.n_chunks = len(chunks)
        if self.n_chunks > 1 and self.n_stages < 2:
            raise A.arg_error(
                "PipelineRunner", "stage", "one module when the group has one rank", f"{self.n_chunks} chunks"
            )
        self.placement = schedule_placement(self._schedule_fn)
        if self.placement == "v" and (self.n_chunks != 2 or self.n_stages < 2):
            raise A.arg_error(
                "PipelineRunner",
                "stage",
                "2 chunks per rank on >= 2 ranks for a V-placed schedule (stages r and 2p-1-r)",
                f"{self.n_chunks} chunk(s) on {self.n_stages} rank(s)",
            )
        # the rank that holds the last virtual stage (computes the loss)
        self.last_rank = 0 if self.placement == "v" else self.n_stages - 1
        self.is_first, self.is_last = self.rank == 0, self.rank == self.last_rank
        if not (costs is None or costs == "measure" or isinstance(costs, (dict, list, tuple))):
            raise A.arg_error(
                "PipelineRunner", "costs", 'None, "measure" or step times', repr(costs), TypeError
            )
        self.costs = costs
        self._measured: list[dict[str, float]] | None = None
        # steps left to measure: the first (cold: one-time costs) and the second (warm)
        self._measures_left = 2
        self._validated: dict[tuple[int, str], list[list[Step | Overlap]]] = {}
        self._planned: tuple[tuple[int, str], _Plan] | None = None  # the last _plan, by its key
        # per chunk, receives a step that raised had posted ahead (still posted, in order)
        self._carried: dict[int, list[p2p.RecvHandle]] = {}
        if self.is_last and loss_fn is None:
            raise A.arg_error(
                "PipelineRunner", "loss_fn", "a loss function on the last stage", None, TypeError
            )
        if loss_fn is not None and not callable(loss_fn):
            raise A.arg_error("PipelineRunner", "loss_fn", "callable", type(loss_fn).__name__, TypeError)
        self.chunks = chunks
        self._gs = [virtual_stage(self.rank, c, self.n_stages, self.placement) for c in range(self.n_chunks)]
        self._check_positions()
        self.stage = chunks[0] if len(chunks) == 1 else nn.ModuleList(chunks)
        self.loss_fn = loss_fn
        self.broadcast_loss = bool(broadcast_loss)
        self.tag = p2p.check_tag(tag, "PipelineRunner")
        # the tags used: one per chunk, and one for the gradients of weights tied across
        # ranks (reserved on every rank: a bound that only the ranks holding a tie knew
        # would refuse the tag on those while the others went on and waited)
        n_tags = self.n_chunks + 1
        if self.tag + n_tags > p2p.MAX_TAG:
            raise A.arg_error(
                "PipelineRunner",
                "tag",
                f"an int <= {p2p.MAX_TAG - n_tags} ({self.n_chunks} chunk(s), tied weights' gradients)",
                tag,
            )
        self._ties = self._tied_across_ranks()
        self._shared_stats = self._shared_statistics()
        # stages in DDP over the data-parallel group: run without its hooks, averaged per step
        self._ddps = ddp_modules(chunks)
        check_ddp_groups(self._ddps, self.pg)
        check_layer_groups(chunks, self.pg)  # an ExpertParallelMoE over the pipeline's ranks
        # per chunk: its virtual stage's neighbours, (rank, tag) or None (this rank: the V
        # turn), and the last virtual stage — looked up on every step, computed once here
        self._srcs = [self._src(c) for c in range(self.n_chunks)]
        self._dsts = [self._dst(c) for c in range(self.n_chunks)]
        self._last = self._last_g()
        self.prepost = bool(prepost)
        if grad_first is None:
            grad_first = "cooldown"
        if grad_first not in (True, False, "cooldown"):
            raise A.arg_error(
                "PipelineRunner", "grad_first", 'True, False, "cooldown" or None', repr(grad_first)
            )
        self.grad_first: bool | str = grad_first if grad_first == "cooldown" else bool(grad_first)
        self._split_b: set[tuple[int, int]] | None = None  # the B steps that split (None: all)
        self.timeline: list[TimelineEntry] = []
        self.peak_activation_bytes = 0
        self._grad_sent_at: float | None = None  # when the running split B sent its input gradient
        self._whole = False  # the running I (or split B) ran the whole backward (a compiled region)
        # per channel (chunk), the shape and dtype agreed for fused activations: that of the
        # channel's first activation in the last step, as received (_like) and as sent (_sent)
        self._like: dict[int, Tensor] = {}
        self._sent: dict[int, tuple[torch.Size, torch.dtype]] = {}
        self.input_grad: Tensor | None = None
        # the pipeline ranks this one sent its context-parallel records to / got theirs from
        # (once each, with the first activation: see _forward)
        self._records_to: set[int] = set()
        self._records_from: set[int] = set()

    # ---- the schedule --------------------------------------------------------------
    def _check_positions(self) -> None:
        """A chunk cut by :func:`partition` must be the virtual stage the placement runs it
        as: chunk ``c`` of rank ``r`` is stage ``r + c p`` (loop) or ``r`` / ``2p-1-r`` (V)."""
        n = self.n_stages * self.n_chunks
        for c, chunk in enumerate(self.chunks):
            pos = getattr(chunk, "partition_position", None)
            if pos is None or pos == (self._gs[c], n):
                continue
            p, r = self.n_stages, self.rank
            give = (
                f"[parts[{r}], parts[{2 * p - 1 - r}]]"
                if self.placement == "v"
                else (f"parts[{r}::{p}]" if self.n_chunks > 1 else f"parts[{r}]")
            )
            raise A.arg_error(
                "PipelineRunner",
                "stage",
                f"this rank's stages in the schedule's {self.placement} placement: chunk {c} "
                f"of rank {r} runs virtual stage {self._gs[c]} of {n} (with parts = "
                f"partition(model, {n}), give rank {r} {give})",
                f"partition's stage {pos[0]} of {pos[1]} as chunk {c}",
            )

    def _tied_across_ranks(self) -> list[tuple[int, list[tuple[int, str]], tuple[int, ...]]]:
        """The parameters :func:`partition` found shared by stages, used by this rank, that
        need summing: ``(tie, copies, ranks)`` per tie, in the order of ``tie`` (the same
        on every rank), ``copies`` the ``(chunk, name)`` of each distinct parameter object
        holding it here (one, unless chunks were copied apart, e.g. ``copy.deepcopy`` of
        each chunk), ``ranks`` the ranks holding its stages (ascending, this one among
        them). A tie with one copy on one rank needs nothing: autograd adds its uses up in
        the one ``.grad``."""
        ties: dict[int, tuple[int, list[tuple[int, str]], tuple[int, ...]]] = {}
        objects: dict[int, set[int]] = {}  # tie -> id() of the copies found
        n = self.n_stages * self.n_chunks
        for c, chunk in enumerate(self.chunks):
            # the partition stage itself, or inside a wrapper (as parallel.grad_norm finds it)
            for prefix, m in chunk.named_modules():
                if "partition_ties" not in m.__dict__:
                    continue
                pos = m.__dict__.get("partition_position")
                if m.__dict__["partition_ties"] and pos != (self._gs[c], n):
                    raise A.arg_error(
                        "PipelineRunner",
                        "stage",
                        f"chunks that are partition(model, {n}) stages, each at its virtual stage "
                        f"(chunk {c} of rank {self.rank}: stage {self._gs[c]}), to place the "
                        "weights tied across stages",
                        f"partition's stage {pos[0]} of {pos[1]} in chunk {c}" if pos else pos,
                    )
                for tie, stages, name in m.__dict__["partition_ties"]:
                    ranks = tuple(sorted({stage_owner(s, self.n_stages, self.placement)[0] for s in stages}))
                    entry = ties.setdefault(tie, (tie, [], ranks))
                    if id(m.get_parameter(name)) not in objects.setdefault(tie, set()):
                        objects[tie].add(id(m.get_parameter(name)))
                        entry[1].append((c, f"{prefix}.{name}" if prefix else name))
        return [ties[t] for t in sorted(ties) if len(ties[t][2]) > 1 or len(ties[t][1]) > 1]

    def _shared_statistics(self) -> list[tuple[nn.Module, str, tuple[int, ...], bool]]:
        """Norm modules with running statistics (:func:`has_running_stats`) used by two
        virtual stages: ``(module, name, stages, recorded)`` — recorded by
        :func:`partition` (on every stage, so every rank knows them, also one holding
        none of those stages), or the same module in two chunks here (stages cut by hand:
        known to this rank only)."""
        found: dict[int, tuple[nn.Module, str, set[int], bool]] = {}
        for chunk in self.chunks:
            for m in chunk.modules():
                for stages, owner in m.__dict__.get("partition_shared_stats", ()):
                    where = "a module partition found in several stages"
                    found[id(owner)] = (owner, where, set(stages), True)
        for c, chunk in enumerate(self.chunks):
            for prefix, m in chunk.named_modules():
                if has_running_stats(m) and not found.get(id(m), (None, "", set(), False))[3]:
                    found.setdefault(id(m), (m, f"chunk {c}'s `{prefix}`", set(), False))[2].add(self._gs[c])
        return [(m, w, tuple(sorted(s)), r) for m, w, s, r in found.values() if len(s) > 1]

    def _check_shared_statistics(self, n_micro: int) -> None:
        """Refuse, before any communication, a norm module updating its running statistics
        (training, ``track_running_stats``) in two virtual stages on several ranks (each
        rank's copy would get only its own stages' updates: after one step 0.028 and 0.032
        off the serial running mean, with no error), or on one rank with ``n_micro > 1``
        (updated in the schedule's order, not micro-batch after micro-batch: 0.005 off at
        ``n_micro=2``, 0.009 at 4). In eval mode, or without running statistics, it runs;
        on one rank with one micro-batch the updates come in the serial order."""
        for m, where, stages, _ in self._shared_stats:
            ranks = sorted({stage_owner(s, self.n_stages, self.placement)[0] for s in stages})
            across = len(ranks) > 1
            if not (m.training and getattr(m, "track_running_stats", False)) or not (across or n_micro > 1):
                continue
            why = (
                f"on the ranks {ranks}: each rank's copy would get only its own stages' updates"
                if across
                else f"on rank {ranks[0]} with n_micro={n_micro}: they come in the schedule's "
                "order, not micro-batch after micro-batch as serially"
            )
            raise ValueError(
                f"diffcomm.PipelineRunner.step(): {where} ({type(m).__name__}) updates its running "
                f"statistics in training mode in the virtual stages {list(stages)}, {why} (a wrong "
                "model in eval mode, no error otherwise). Put it in eval mode (`.eval()`), build it "
                "with track_running_stats=False, or give each stage its own module"
                + ("" if across else ", or step with n_micro=1")
                + f" (rank {self.rank})"
            )

    def _sync_tied(self, held: list[list[Tensor | None]]) -> Exception | None:
        """Sum this step's part of every tied weight's gradient over its copies on this rank
        and over the ranks holding it (each sends its part to the others; every rank adds
        the parts in rank order, so the copies are bitwise equal), then add the sum to each
        copy's gradient held before the step (``held``, taken off in :meth:`step`):
        accumulation over steps counts every part once. A tie that got no gradient on any
        of its ranks this step keeps the gradient it held (``None`` stays ``None``, as
        serially: an optimizer skips a parameter without one, where a zero gradient
        would still decay and move it): the ranks first tell each other which ties got a
        part, and whether their copies require grad (:meth:`_tie_flags`). Called on every
        holder after the step, in the same order.

        Returns the error :meth:`step` raises once its communication is done (``None``: no
        error): a tie whose copies require grad on some of its ranks (or copies) and are
        frozen (``requires_grad=False``) on others. Serially the tie is one parameter,
        trained or frozen; here the trained copies would move and the frozen ones not,
        drifting apart silently. Such a tie is left out of the exchange on every rank
        holding it (the same verdict everywhere: each has every holder's flags), its
        copies keeping their own parts added to the gradient held, as without a tie."""
        tag = self.tag + self.n_chunks
        copies_of = [
            [self.chunks[c].get_parameter(name) for c, name in copies] for _, copies, _ in self._ties
        ]
        flags = self._tie_flags(
            [
                (any(q.grad is not None for q in qs), [q.requires_grad for q in qs].count(True), len(qs))
                for qs in copies_of
            ],
            tag,
        )
        mixed: list[str] = []
        for (tie, copies, ranks), qs, olds, (some, trained) in zip(
            self._ties, copies_of, held, flags, strict=True
        ):
            if 0 < sum(n for n, _ in trained.values()) < sum(k for _, k in trained.values()):
                # (the same verdict on every rank holding it: no exchange)
                for q, old in zip(qs, olds):
                    if old is not None:
                        q.grad = old if q.grad is None else old.add_(q.grad)
                on = [r for r in ranks if trained[r][0] > 0]
                off = [r for r in ranks if trained[r][0] < trained[r][1]]
                mine = ", ".join(
                    f"chunk {c} `{name}` ({'trained' if q.requires_grad else 'frozen'})"
                    for (c, name), q in zip(copies, qs)
                )
                mixed.append(
                    f"tie {tie} (held by ranks {list(ranks)}; here: {mine}) requires grad on "
                    f"rank(s) {on} and is frozen on rank(s) {off}"
                )
                continue
            if not some:  # (the same verdict on every rank holding it: no exchange)
                for q, old in zip(qs, olds):
                    q.grad = old
                continue
            with torch.no_grad():
                part = qs[0].grad if qs[0].grad is not None else torch.zeros_like(qs[0])
                for q in qs[1:]:  # (copies apart on this rank: autograd did not add them up)
                    if q.grad is not None:
                        part.add_(q.grad)
                # (an embedding is large: its part goes without a copy and the sum is made in
                # the buffers at hand, in rank order on every rank)
                for r in ranks:
                    if r != self.rank:
                        p2p.send_owned(part, r, group=self.pg, tag=tag)
                got = {r: p2p.recv(r, like=part, group=self.pg, tag=tag) for r in ranks if r != self.rank}
                if got:
                    p2p.wait_sends()  # part is on the wire until then
                got[self.rank] = part
                total = got[ranks[0]]
                for r in ranks[1:]:
                    total.add_(got[r])
                # each copy its own tensor (clip_grad_norm_ scales each .grad in place)
                news = [total] + [total.clone() for _ in qs[1:]]
                news = [new if old is None else old.add_(new) for old, new in zip(olds, news)]
            for q, g in zip(qs, news):
                if q.requires_grad:
                    q.grad = g
        if not mixed:
            return None
        return A.arg_error(
            "PipelineRunner.step",
            "requires_grad",
            "the same on every copy of a weight tied across stages (it is one parameter: "
            "freeze it on every rank holding it, or on none), else the trained copies move "
            "and the frozen ones do not",
            "; ".join(mixed) + "; its gradient was not exchanged",
        )

    def _tie_flags(
        self, mine: list[tuple[bool, int, int]], tag: int
    ) -> list[tuple[bool, dict[int, tuple[int, int]]]]:
        """Per tie, whether any rank holding it got a part of its gradient this step, and
        per rank holding it how many of its copies there require grad, of how many
        (``mine``: this rank's, as ``(got a part, copies requiring grad, copies)``), from
        one small message to each rank sharing a tie with this one (the flags of the ties
        they share, in tie order)."""
        out = [(got, {self.rank: (n, k)}) for got, n, k in mine]
        peers = sorted({r for _, _, ranks in self._ties for r in ranks if r != self.rank})
        if not peers:
            return out
        shared = {r: [i for i, (_, _, ranks) in enumerate(self._ties) if r in ranks] for r in peers}
        with torch.no_grad():
            for r in peers:
                flags = torch.tensor(
                    [float(v) for i in shared[r] for v in mine[i]], device=self._tie_device()
                )
                p2p.send_owned(flags, r, group=self.pg, tag=tag)
            like = {r: torch.zeros(3 * len(shared[r]), device=self._tie_device()) for r in peers}
            got = {r: p2p.recv(r, like=like[r], group=self.pg, tag=tag).tolist() for r in peers}
            p2p.wait_sends()
        for r in peers:
            for j, i in enumerate(shared[r]):
                some, n, k = got[r][3 * j : 3 * j + 3]
                out[i][1][r] = (int(n), int(k))
                out[i] = (out[i][0] or some > 0, out[i][1])
        return out

    def _tie_device(self) -> torch.device:
        """Where the tied weights' flags travel: the first tied parameter's device."""
        _, copies, _ = self._ties[0]
        c, name = copies[0]
        return self.chunks[c].get_parameter(name).device

    def schedule(self, n_micro: int) -> list[list[Step | Overlap]]:
        """Every rank's steps for ``n_micro`` micro-batches, validated by
        :func:`~diffcomm.pipeline.check_schedule` (a ``ScheduleError`` names the step)."""
        return [list(steps) for steps in self._schedule(n_micro)[1]]

    def _schedule(self, n_micro: int) -> tuple[tuple[int, str] | None, list[list[Step | Overlap]]]:
        """The validated schedule (not to be modified) and its cache key (``None``: a
        user's function, generated and validated on every call)."""
        costs = self._measured if self.costs == "measure" else self.costs
        kw = {} if costs is None else {"costs": costs}
        builtin = self._schedule_fn in SCHEDULES.values()
        # a built-in generator is a pure function of its arguments: validated once per key
        key = (n_micro, repr(costs)) if builtin else None
        if key is not None and key in self._validated:
            return key, self._validated[key]
        if self.n_chunks == 1 and not builtin:
            sched = self._schedule_fn(self.n_stages, n_micro, **kw)  # a user's (p, m) function
        else:
            sched = self._schedule_fn(self.n_stages, n_micro, self.n_chunks, **kw)
        check_schedule(sched, self.n_stages, n_micro, self.n_chunks, self.placement)
        if key is not None:
            self._validated = {key: sched}  # the last one only (n_micro may change every step)
        return key, sched

    def steps(self, n_micro: int) -> list[Step | Overlap]:
        """This rank's steps for ``n_micro`` micro-batches (validated)."""
        return list(self.schedule(n_micro)[self.rank])

    def _plan(self, n_micro: int) -> _Plan:
        """What :meth:`step` runs: this rank's steps with every ``Overlap`` unfolded, per
        step whether it is half of one, the ``B`` steps that split (``None``: all, by
        ``grad_first``), and for every ``F`` the next ``F`` on its chunk (whose receive it
        posts). Derived from the validated schedule, and reused with it while the schedule
        is (a built-in one, same ``n_micro`` and costs): read-only to the step."""
        key, sched = self._schedule(n_micro)
        if key is not None and self._planned is not None and self._planned[0] == key:
            return self._planned[1]
        raw = sched[self.rank]
        steps = expand_steps(raw)
        fused = [part for st in raw for part in ((True, True) if isinstance(st, Overlap) else (False,))]
        next_f: dict[tuple[int, int], Step] = {}
        last_f: dict[int, Step] = {}  # chunk -> its F steps so far, the last one
        for st in steps:
            if st.kind == "F":
                prev = last_f.get(st.chunk)
                if prev is not None:
                    next_f[(prev.micro, prev.chunk)] = st
                last_f[st.chunk] = st
        plan = (steps, fused, cooldown(steps) if self.grad_first == "cooldown" else None, next_f)
        self._planned = None if key is None else (key, plan)
        return plan

    # ---- virtual stages --------------------------------------------------------------
    def _g(self, chunk: int) -> int:
        return self._gs[chunk]

    def _last_g(self) -> int:
        return self.n_stages * self.n_chunks - 1

    def _src(self, chunk: int) -> tuple[int, int] | None:
        """(rank, tag) the activation of ``chunk`` comes from; ``None``: from this rank."""
        p, r = self.n_stages, self.rank
        if self.placement == "v":
            if chunk == 0:
                return r - 1, self.tag
            return None if r == p - 1 else (r + 1, self.tag + 1)
        return (r - 1) % p, self.tag + (chunk if r > 0 else chunk - 1)

    def _dst(self, chunk: int) -> tuple[int, int] | None:
        """(rank, tag) the output of ``chunk`` goes to; ``None``: to this rank."""
        p, r = self.n_stages, self.rank
        if self.placement == "v":
            if chunk == 0:
                return None if r == p - 1 else (r + 1, self.tag)
            return r - 1, self.tag + 1
        return (r + 1) % p, self.tag + chunk

    def remeasure(self) -> None:
        """Profile the step times again: the next step runs with unit-time placement and
        measures, the one after it measures again (a warm step), and the steps after
        those place ``W`` by the last times measured (``costs="measure"``)."""
        self._measured, self._measures_left = None, 2

    def _measure(self) -> None:
        """Every rank's median busy time per step kind (``F``, ``I``, ``W``) of the step
        just run, shared by one all-reduce: later steps' schedules place ``W`` by them."""
        row = torch.zeros(self.n_stages, 3, dtype=torch.float64)
        for j, kind in enumerate("FIW"):
            times = sorted(e.busy for e in self.timeline if e.kind == kind)
            row[self.rank, j] = times[len(times) // 2] if times else 0.0
        be = B.get_backend()
        allr = be.all_reduce(row.to(be.comm_device(self.pg)), "sum", self.pg).cpu()
        if bool((allr > 0).all()):
            self._measured = [dict(zip("FIW", map(float, allr[r]))) for r in range(self.n_stages)]
            self._measures_left -= 1

    # ---- one step --------------------------------------------------------------------
    def step(
        self,
        inputs: Tensor | None = None,
        targets: Tensor | None = None,
        n_micro: int = 1,
        input_grad: bool = False,
    ) -> Tensor | None:
        """Forward and backward of one batch, split into ``n_micro`` micro-batches.

        Every rank may pass the same ``inputs``/``targets`` (SPMD style): rank 0 uses
        only ``inputs``, the last rank only ``targets``; others may pass ``None``.
        Parameter gradients **accumulate** into ``.grad`` (as ``loss.backward()`` does;
        zero them between steps) and are those of the step loss; a parameter the loss
        does not reach in any micro-batch (a later stage's use under ``torch.no_grad``)
        keeps its ``.grad``, ``None`` included, as serially. A weight
        :func:`partition` found tied between stages on several ranks (a tied LM's
        embedding and head) gets the sum of every stage's part on every rank holding it,
        as serially: the step's parts are exchanged between those ranks at its end (do not
        sum them again). Such a weight frozen (``requires_grad=False``) on some of those
        ranks and not on others is a ``ValueError`` naming ``requires_grad`` on each of
        them, at the end of the step (its copies would drift apart).

        Args:
            inputs: the batch (rank 0): a tensor split along dim 0. One that requires grad
                (a leaf, or the output of layers run before the step) gets the loss's
                gradient after the step, once, as ``loss.backward()`` gives it.
            targets: the targets (last rank), split along dim 0 like ``inputs``; or
                ``None`` when ``loss_fn`` takes only the output. Targets that require grad
                (a teacher's output) get the loss's gradient after the step, once.
            n_micro: number of micro-batches; must divide the batch size.
            input_grad: rank 0 keeps the gradient of the loss w.r.t. ``inputs`` in
                :attr:`input_grad` (floating-point ``inputs`` only: integer ones are a
                ``TypeError`` on every rank given them, before any communication).

        Returns:
            The step loss — the **mean over micro-batches** of ``loss_fn(out_m,
            target_m)``, equal to ``loss_fn`` on the full batch for a mean over samples of
            equal weight (not for a mean whose denominator depends on the micro-batch:
            ``ignore_index``, class weights, a mask; see ``docs/pipeline.md``) —
            as a detached 0-dim tensor: on every rank with ``broadcast_loss``, else on the
            last rank (``None`` elsewhere).

        Gradient:
            Each micro-batch's loss is scaled by ``1/n_micro`` before its backward, so the
            accumulated gradient is that of the returned mean loss.
        """
        n_micro = A.check_int(n_micro, "PipelineRunner.step", "n_micro")
        varying_parameters(self.stage, self.pg)  # each stage's own (dc.spmd_check; else a no-op)
        if n_micro < 1:
            raise A.arg_error("PipelineRunner.step", "n_micro", "an int >= 1", n_micro)
        if self._shared_stats:
            self._check_shared_statistics(n_micro)
        if (
            input_grad
            and isinstance(inputs, Tensor)
            and not (inputs.is_floating_point() or inputs.is_complex())
        ):
            # (checked on every rank given the inputs: the first one raised torch's
            # RuntimeError at its first forward, and the others waited for its activation)
            raise A.arg_error(
                "PipelineRunner.step",
                "input_grad",
                "False for inputs that cannot have a gradient (integer ids: take the gradient "
                "of the embedding's output in the stage instead)",
                f"True with inputs of dtype {inputs.dtype}",
                TypeError,
            )
        in_chunks = self._split(inputs, n_micro, "inputs") if self.is_first else None
        # inputs made by a graph outside the pipeline (an embedding applied before step):
        # its micro-batches become leaves, and their gradients go into that graph once,
        # after the step — each micro-batch's backward through the shared graph freed it
        # for the next ("backward through the graph a second time" on stage 0)
        outer = in_chunks is not None and isinstance(inputs, Tensor) and inputs.requires_grad
        outer = outer and torch.is_grad_enabled()
        tgt_chunks = (
            self._split(targets, n_micro, "targets") if self.is_last and targets is not None else None
        )
        # targets made by a graph outside the pipeline (a teacher's output, a learned
        # target) as inputs are: micro-batch leaves, whose gradients go into that graph
        # once, after the step (each micro-batch's backward freed the shared graph, and a
        # split backward's W did not reach it: the graph got no gradient, or a part)
        tgt_outer = tgt_chunks is not None and isinstance(targets, Tensor) and targets.requires_grad
        tgt_outer = tgt_outer and torch.is_grad_enabled()
        if tgt_outer:
            assert tgt_chunks is not None  # (tgt_outer)
            tgt_chunks = [c.detach().requires_grad_() for c in tgt_chunks]
        steps, fused, split_b, self._next_f = self._plan(n_micro)
        if _config.DEBUG.get():
            B.get_backend().check_consistent(
                "PipelineRunner.step",
                {"n_micro": n_micro, "schedule": self.schedule_name, "n_chunks": self.n_chunks},
                self.pg,
            )
        self.timeline, self.peak_activation_bytes, self.input_grad = [], 0, None
        params = [list(c.parameters()) for c in self.chunks]  # once per step, not per I step
        self._param_storages = {p.untyped_storage().data_ptr() for ps in params for p in ps}
        self._grad_params = [[p for p in ps if p.requires_grad] for ps in params]
        # per chunk, its parameters' gradient nodes (found at the step's first I; held for the
        # step so every micro-batch's graph meets the same AccumulateGrad nodes)
        self._param_nodes: list[list[Node] | None] = [None] * self.n_chunks
        self._live_bytes = 0
        self._inputs_kept: list[Tensor] = []
        self._posted: dict[tuple[int, int], p2p.RecvHandle] = {}
        self._local: dict[int, Tensor] = {}  # micro -> the V turn's input leaf (rank p-1's chunk 1)
        self._fresh_in = set(range(self.n_chunks))  # channels with no activation in yet this step
        self._fresh_out = set(range(self.n_chunks))  # channels with none sent yet this step
        self._split_b = split_b
        total = torch.zeros((), dtype=torch.float64)
        # a tied weight's gradient before the step, taken off so that .grad holds this
        # step's part alone, which _sync_tied sums over its ranks and adds back
        held = [
            q for _, copies, _ in self._ties for q in (self.chunks[c].get_parameter(n) for c, n in copies)
        ]
        held_grads = [q.grad for q in held]
        for q in held:
            q.grad = None
        # each micro-batch's loss weighs 1 / n_micro: so does an auxiliary loss (add_aux_loss)
        outer_scale, _aux._SCALE[0] = _aux._SCALE[0], 1.0 / n_micro
        try:
            self._run_steps(_Batch(steps, fused, in_chunks, tgt_chunks, n_micro, input_grad or outer, total))
            inputs_kept = self._inputs_kept
        except BaseException:
            for q, old in zip(held, held_grads):  # as without the tie: the parts accumulate
                if old is not None and q.grad is not None:
                    q.grad = old.add_(q.grad)
                elif old is not None:
                    q.grad = old
            self._sent.clear()  # this rank's next activations go plainly: any receive takes them
            # a receive posted ahead stays posted (gloo cannot take it back) and takes its
            # channel's next message: the next step's first receive there is that one
            for (_, c), handle in self._posted.items():  # in the order they were posted
                self._carried.setdefault(c, []).append(handle)
            raise
        finally:
            _aux._SCALE[0] = outer_scale
            self._inputs_kept, self._posted, self._local = [], {}, {}
            self._param_nodes = [None] * self.n_chunks
        # the graphs outside the step (of the inputs, of the targets) take their gradients
        # in one backward: one graph may make both (step(h, h) on the rank holding the
        # first and the last stage: the V placement, one stage)
        roots: list[Tensor] = []
        root_grads: list[Tensor] = []
        if (input_grad or outer) and self.is_first:
            grads = [s.grad if s.grad is not None else torch.zeros_like(s) for s in inputs_kept]
            g_full = torch.cat(grads)
            if input_grad:
                self.input_grad = g_full
            # (no micro-batch's gradient reached the inputs: the graph outside keeps its
            # parameters' .grad, None included, as serially)
            if outer and any(s.grad is not None for s in inputs_kept):
                assert isinstance(inputs, Tensor)  # (outer: a tensor that requires grad)
                roots.append(inputs)
                root_grads.append(g_full)
        if tgt_outer and any(c.grad is not None for c in tgt_chunks or []):
            assert isinstance(targets, Tensor) and tgt_chunks is not None  # (tgt_outer)
            roots.append(targets)
            root_grads.append(
                torch.cat([c.grad if c.grad is not None else torch.zeros_like(c) for c in tgt_chunks])
            )
        if roots:
            torch.autograd.backward(roots, root_grads)
        refused = None
        if self._ties:  # (the same on every rank holding one: all of them exchange)
            olds = iter(held_grads)
            refused = self._sync_tied([[next(olds) for _ in copies] for _, copies, _ in self._ties])
        if self._ddps:  # DDP's average over its group, once for the step's gradients
            # after the ties' sum, which adds back what a tied weight held before the step:
            # DDP averages the whole accumulated .grad (before, a tied weight's part from
            # steps under the user's no_sync() was never averaged: 0.09 off serial)
            average_grads(self._ddps)
        out: Tensor | None = total if self.is_last else None
        if self.broadcast_loss and self.n_stages > 1:
            be = B.get_backend()
            out = be.broadcast(total.to(be.comm_device(self.pg)), self.last_rank, self.pg).cpu()
        if self.costs == "measure" and self._measures_left > 0 and self.n_stages > 1:
            self._measure()
        if refused is not None:  # (raised once the step's communication is done: no rank waits)
            raise refused
        return out

    def _run_steps(self, batch: _Batch) -> None:
        steps, fused = batch.steps, batch.fused
        k = 0
        while k < len(steps):
            st = steps[k]
            phased = (
                fused[k]
                and st.kind == "F"
                and hasattr(self.chunks[st.chunk], "forward_phases")
                and k + 1 < len(steps)
                and (steps[k + 1].micro, steps[k + 1].chunk) != (st.micro, st.chunk)
            )
            inner = _Inner(self, k + 1, steps, batch.stash, fused) if phased else None
            self._run_one(k, batch, inner)
            if inner is not None:
                e = self.timeline[-1]  # the forward's busy time excludes the backward inside it
                span, waited = inner.span, inner.wait
                inner.finish()  # what the forward's phases left of the backward
                e.start, e.wait = min(e.end, e.start + span), max(0.0, e.wait - waited)
                self.timeline.append(inner.entry())
                k += 1
            k += 1
        p2p.wait_sends()

    def _run_one(self, k: int, batch: _Batch, between: Callable[[], None] | None) -> None:
        """Run step ``k`` and append its timeline entry; ``between``: run it between the
        phases of a forward whose chunk has ``forward_phases`` (the overlap hook)."""
        steps, stash, total = batch.steps, batch.stash, batch.total
        st = steps[k]
        nxt = steps[k + 1] if k + 1 < len(steps) else None
        # the receive waits by the host clock (no comms logger: it would synchronise
        # the device around every raw op on a GPU)
        waited = _recv_wait_seconds()
        self._grad_sent_at = None
        self._whole = False
        start = time.perf_counter()
        if st.kind == "F":
            loss_m = self._forward(st, batch, nxt, between)
            if loss_m is not None:
                total += loss_m.detach().to(total.device, torch.float64)
        else:
            self._prepost(nxt, stash)
            if st.kind == "B":
                self._backward(st, stash)
            elif st.kind == "I":
                # an I whose W is the very next step holds its gradients no longer than a
                # split B does: a backward's transient buffers, not held memory (so ZB-V's
                # steady-state I W pairs count as 1F1B's B; see docs/pipeline.md)
                own_w = nxt is not None and (nxt.kind, nxt.micro, nxt.chunk) == ("W", st.micro, st.chunk)
                self._backward_input(st, stash, hold=not own_w)
            else:
                self._backward_weight(st, stash)
        end = time.perf_counter()
        wait = _recv_wait_seconds() - waited
        # a split B's receives all come before its input gradient leaves (W receives nothing)
        sent = None if self._grad_sent_at is None else max(0.0, self._grad_sent_at - start - wait)
        entry = TimelineEntry(st.kind, st.micro, start, end, wait, st.chunk, sent, batch.fused[k])
        entry.whole = self._whole
        self.timeline.append(entry)

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

    # ---- pre-posted receives ---------------------------------------------------------
    def _prepost(self, st: Step | None, stash: dict[tuple[int, int], _Stash]) -> None:
        """Post the receive ``st`` will need (if any, and not posted yet)."""
        if st is None or not self.prepost:
            return
        if st.kind == "F":
            where = self._srcs[st.chunk]
            if self._gs[st.chunk] == 0 or where is None or (st.micro, st.chunk) in self._posted:
                return
            carried = self._carried.get(st.chunk)
            if carried:  # posted by a step that raised: it takes this channel's next message
                self._posted[(st.micro, st.chunk)] = carried.pop(0)
                return
            src, tag = where
            like = self._like.get(st.chunk)
            if like is None:  # shape not known yet: post the header only
                handle = p2p.irecv(src, group=self.pg, tag=tag)
            else:  # header and data in one message (see the module docstring)
                handle = p2p.irecv_fused(src, like, group=self.pg, tag=tag)
            self._posted[(st.micro, st.chunk)] = handle
        elif st.kind in ("B", "I"):
            kept = stash.get((st.micro, st.chunk))
            if (
                kept is not None
                and not kept.grad_posted
                and not kept.local
                and self._gs[st.chunk] != self._last
            ):
                kept.grad_posted = p2p.post_grad_recv(kept.handle)

    # ---- forward ---------------------------------------------------------------------
    def _forward(
        self, st: Step, batch: _Batch, nxt: Step | None, between: Callable[[], None] | None = None
    ) -> Tensor | None:
        m, c = st.micro, st.chunk
        in_chunks, tgt_chunks, stash = batch.in_chunks, batch.tgt_chunks, batch.stash
        g = self._gs[c]
        kept = _Stash(handle=torch.zeros(()), nbytes=0)
        if g == 0:
            assert in_chunks is not None
            x = in_chunks[m]
            if batch.input_grad:
                x = x.detach().requires_grad_()
                self._inputs_kept.append(x)
        elif self._srcs[c] is None:  # the V turn: the previous virtual stage is this rank's
            x = self._local.pop(m)
            if x.requires_grad:
                x = _TurnInput.apply(x)
        else:
            handle = self._posted.pop((m, c), None)
            if handle is None and self._carried.get(c):
                handle = self._carried[c].pop(0)
            if handle is not None:
                x = handle.wait()
            else:
                src, tag = self._srcs[c]  # type: ignore[misc]
                like = self._like.get(c)
                if like is None:
                    x = p2p.recv(src, group=self.pg, tag=tag)
                else:
                    x = p2p.irecv_fused(src, like, group=self.pg, tag=tag).wait()
            src = self._srcs[c][0]  # type: ignore[index]
            if src not in self._records_from:  # its context-parallel records (see _send_records)
                note_records(p2p.recv(src, group=self.pg, tag=self.tag + self.n_chunks), src)
                self._records_from.add(src)
            if x.requires_grad:  # the previous stage waits for this input's gradient
                kept.reached = reached = [False]
                kept.recv_node = x.grad_fn
                x.register_hook(lambda _, reached=reached: reached.__setitem__(0, True))
            if c in self._fresh_in:  # the step's first activation here: the agreed shape now
                self._fresh_in.discard(c)
                # shape, dtype and device only: a zero-stride tensor of one element
                self._like[c] = torch.empty_strided(x.shape, (0,) * x.ndim, dtype=x.dtype, device=x.device)
        # the previous receive on every channel is complete: post the next step's now, and
        # this channel's next activation (its sender may send it before this rank reaches
        # the step before it; a message whose receive is posted is written at once, one
        # that finds none waits for the sender's side to answer the receive: see the
        # module docstring)
        self._prepost(nxt, stash)
        nxt_f = self._next_f.get((m, c))
        if nxt_f is not nxt:
            self._prepost(nxt_f, stash)
        kept.input, kept.target = x, input_edge(x)

        # The hook holds nothing of the graph: a saved tensor keeps its pack hook (and what
        # the hook returned) until its node is released, and a node that only ran in a
        # retained backward (the input path of a split B) is released when the graph dies.
        # A hook holding the stash (whose handle holds the graph), or a packed tensor
        # holding its own node as grad_fn (a ReLU's saved output), would keep the graph
        # alive for ever: a leak of one micro-batch's activations per split B.
        storages, nbytes, params = kept.storages, [0], self._param_storages

        def pack(t: Tensor) -> Tensor:
            # distinct saved tensors (a ReLU output saved twice counts once), by their own
            # bytes (a micro-batch view of the batch counts its slice), parameters excluded
            key = (t.data_ptr(), t.numel(), t.dtype)
            if t.untyped_storage().data_ptr() not in params and key not in storages:
                storages.add(key)
                nbytes[0] += t.numel() * t.element_size()
            return t.detach()  # autograd restores the graph metadata when unpacking

        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            if between is None:
                with no_sync(self._ddps):  # (DDP's own reduction: see _ddp.py)
                    y = self.chunks[c](x)
            else:  # the overlap hook: phase 1, the other step, the rest
                phases = self.chunks[c].forward_phases(x)  # type: ignore[operator]
                try:
                    next(phases)
                    while True:  # at every yield, the next piece of the other backward
                        between()  # a backward saves no tensors: the hooks see nothing of it
                        next(phases)
                except StopIteration as done:
                    y = done.value
            if g != self._last and not isinstance(y, Tensor):
                raise A.arg_error(
                    "PipelineRunner.step",
                    f"the output of stage {g}",
                    "one tensor (the activation the next stage receives; only the last "
                    "stage's output goes to loss_fn as it is)",
                    f"a {type(y).__name__}",
                    TypeError,
                )
            if g == self._last:
                assert self.loss_fn is not None
                tgt = None if tgt_chunks is None else tgt_chunks[m]
                loss = self.loss_fn(y) if tgt is None else self.loss_fn(y, tgt)
                if not isinstance(loss, Tensor) or loss.numel() != 1:
                    raise A.arg_error(
                        "PipelineRunner.step",
                        "loss_fn",
                        "a function returning a scalar tensor (reduce it: reduction='mean' or 'sum')",
                        f"{type(loss).__name__} of shape {tuple(loss.shape)}"
                        if isinstance(loss, Tensor)
                        else type(loss).__name__,
                        TypeError,
                    )
                # a one-element loss of any shape (1,), (1, 1) is a scalar to backward;
                # the step's 0-dim float64 sum refused it (torch's broadcast error)
                kept.handle = loss.reshape(()) / batch.n_micro
            elif self._dsts[c] is None:  # the next virtual stage is this rank's (the V turn)
                nxt_in = y.detach().requires_grad_(y.requires_grad)
                self._local[m] = nxt_in
                kept.handle = _LocalSend.apply(y, [nxt_in]) if y.requires_grad else y.new_zeros(())
                kept.output, kept.local = y, True
            else:
                dst, dtag = self._dsts[c]  # type: ignore[misc]
                self._send_records(dst)
                # y is ours and nothing writes to it before wait_sends() at the end of
                # the step: send it without the private copy dc.send makes; fused with
                # its header when it has the channel's agreed shape (see the module
                # docstring), which the step's first activation here then sets
                sent = (y.shape, y.dtype)
                fused = self._sent.get(c) == sent
                if c in self._fresh_out:
                    self._fresh_out.discard(c)
                    self._sent[c] = sent
                kept.handle = p2p.send_owned(y, dst, group=self.pg, tag=dtag, fused=fused)
                kept.output = y
                if self.prepost:  # its gradient's receive, now: posted whenever the peer sends
                    kept.grad_posted = p2p.post_grad_recv(kept.handle)
        kept.nbytes = nbytes[0]
        stash[(m, c)] = kept
        self._live_bytes += kept.nbytes
        self.peak_activation_bytes = max(self.peak_activation_bytes, self._live_bytes)
        return kept.handle if g == self._last else None

    def _send_records(self, dst: int) -> None:
        """Before the first activation to ``dst``: this program's context-parallel records
        (the layouts it used, the sequences it padded; those received from upstream too),
        once per runner and peer, on the tied weights' tag (FIFO before their exchange).
        The stage that sharded the batch (zigzag, on stage 0's ranks) is another process
        than the stage whose attention reads the received activation, which carries no
        placement: without them that attention took the default layout, silently wrong
        (``tests/pipeline/test_pipeline_context.py``); with them it refuses to guess."""
        if dst not in self._records_to:
            p2p.send(records(), dst, group=self.pg, tag=self.tag + self.n_chunks)
            self._records_to.add(dst)

    # ---- backward ----------------------------------------------------------------------
    def _backward(self, st: Step, stash: dict[tuple[int, int], _Stash]) -> None:
        kept = stash[(st.micro, st.chunk)]
        split = self.grad_first is True or (
            self._split_b is not None and (st.micro, st.chunk) in self._split_b
        )
        if split and self._gs[st.chunk] != 0 and kept.handle.requires_grad:
            # the input gradient first (its recv-backward sends it upstream at once), then
            # the weight gradients while it travels: the same work as one backward, but the
            # previous stage's wait no longer includes this stage's weight gradients
            # (the gradients kept between the two are a backward's transient buffers,
            # as in a plain backward: not counted as activations)
            self._backward_input(st, stash, hold=False)
            self._grad_sent_at = time.perf_counter()  # the input gradient has left
            self._backward_weight(st, stash)
            return
        del stash[(st.micro, st.chunk)]
        # the token (or loss) requires grad iff anything upstream does; recv on the next
        # stage made the same decision from the header, so skipping here is symmetric
        if kept.handle.requires_grad:
            try:
                kept.handle.backward()
            except p2p.NoGradient:  # nothing ran: see _send_unreached
                pass
        _send_unreached(kept)
        self._live_bytes -= kept.nbytes

    def _backward_input(self, st: Step, stash: dict[tuple[int, int], _Stash], hold: bool = True) -> None:
        """``I``: the gradient of the chunk's input only; keep what ``W`` needs (counted as
        held memory when ``hold``: a ``W`` in a later step)."""
        kept = stash[(st.micro, st.chunk)]
        root = kept.handle
        if not root.requires_grad:
            kept.full_in_w = True  # nothing flows back at all
            _send_unreached(kept)
            return
        target = kept.target
        plan = None
        if target is not None:
            param_nodes = self._param_nodes[st.chunk]
            if param_nodes is None:
                param_nodes = [get_gradient_edge(q).node for q in self._grad_params[st.chunk]]
                self._param_nodes[st.chunk] = param_nodes
            plan = weight_plan(root, target, param_nodes)
        if isinstance(plan, Whole):
            # a compiled region's backward is one node computing the input's and the
            # weights' gradients at once, and a reentrant checkpoint refuses a backward
            # restricted to inputs: run the whole backward now, once (its graph freed, as
            # AOTAutograd requires of a backward compiled with donated buffers); W has
            # nothing left (docs/pipeline.md, "Compiled stages")
            self._whole = True
            try:
                root.backward()
            except p2p.NoGradient:  # nothing ran
                kept.given = False
            _send_unreached(kept)
            kept.groups = []
            self._live_bytes -= kept.nbytes  # the activations are freed now, not at W
            kept.nbytes = 0
            return
        if plan is None:
            # no input path to split off (stage 0, or an unusual graph): take the output
            # gradient now, as every I does, and run the whole backward in W
            kept.full_in_w = True
            if target is not None and not reaches(root, target):
                # the output does not depend on the received input: its (zero) gradient
                # leaves now, as an I's would — in W it came after steps that wait for it
                # (a deadlock in ZB-V, where the upstream rank's I waits for this one)
                _send_unreached(kept)
            if kept.output is not None and kept.output.requires_grad:
                try:
                    (kept.d_output,) = torch.autograd.grad(root, [kept.output])
                except p2p.NoGradient:  # W has nothing to do
                    kept.given = False
                    _send_unreached(kept)
            return
        assert target is not None  # (a plan needs the input's edge)
        captured: dict[Node, tuple[Tensor | None, ...]] = {}
        hooks = [n.register_prehook(capture(captured, n)) for n, _ in plan]
        try:
            torch.autograd.backward(root, inputs=[target], retain_graph=True)
        except p2p.NoGradient:  # nothing ran (the send's node is the first): W has nothing to do
            kept.full_in_w, kept.given = True, False
            _send_unreached(kept)
            return
        finally:
            for h in hooks:
                h.remove()
        _send_unreached(kept)
        groups = []
        for nodes, param_nodes in group_plan(plan):
            groups.append((nodes, [captured.get(n, ()) for n in nodes], param_nodes))
        kept.groups = groups
        if not hold:
            return
        kept.grad_bytes = sum(
            g.numel() * g.element_size() for _, gs, _ in groups for t in gs for g in t if g is not None
        )
        self._live_bytes += kept.grad_bytes
        self.peak_activation_bytes = max(self.peak_activation_bytes, self._live_bytes)

    def _backward_weight(self, st: Step, stash: dict[tuple[int, int], _Stash]) -> None:
        """``W``: the parameters' gradients from what ``I`` kept (accumulated in ``.grad``)."""
        kept = stash.pop((st.micro, st.chunk))
        if kept.full_in_w:
            if not kept.given:
                pass  # no gradient downstream: nothing to run
            elif kept.d_output is not None:
                assert kept.output is not None  # (d_output is its gradient)
                torch.autograd.backward(kept.output, kept.d_output)
            elif kept.handle.requires_grad and kept.output is None:
                kept.handle.backward()  # the last virtual stage with no input path
            _send_unreached(kept)
        elif kept.groups:
            for i, (nodes, grads, param_nodes) in enumerate(kept.groups):
                edges, seeds = [], []
                for n, gs in zip(nodes, grads):
                    for j, g in enumerate(gs):
                        if g is not None:
                            edges.append(GradientEdge(n, j))
                            seeds.append(g)
                if not edges:
                    continue
                # a group whose nodes feed each other: what arrives from a sibling is
                # already in the kept gradient, so replace it (no double counting)
                clamps = (
                    [n.register_prehook(lambda _, gs=gs: gs) for n, gs in zip(nodes, grads)]
                    if len(nodes) > 1
                    else []
                )
                try:
                    torch.autograd.backward(
                        edges, seeds, inputs=[GradientEdge(pn, 0) for pn in param_nodes],
                        retain_graph=i < len(kept.groups) - 1,
                    )  # fmt: skip
                finally:
                    for h in clamps:
                        h.remove()
        self._live_bytes -= kept.nbytes + kept.grad_bytes


def _unpack(t: Tensor) -> Tensor:
    return t


def _send_unreached(kept: _Stash) -> None:
    """A received input that the chunk's backward did not reach — its output does not
    depend on it (a ``detach``, a ``torch.no_grad`` block, an unused input), needs no
    gradient, or got none downstream — still owes the previous stage a message, which
    that stage's token is waiting for: "no gradient" (``p2p.send_no_grad``), so that
    stage runs no backward for this micro-batch and its parameters keep ``.grad`` as it
    was (``None`` included), as serially; zeros would be a gradient (AdamW's weight
    decay moves a parameter with a zero gradient and skips one with ``None``). Without
    the message the previous stage waits until the timeout."""
    if kept.reached is not None and not kept.reached[0]:
        kept.reached[0] = True
        p2p.send_no_grad(kept.recv_node)
