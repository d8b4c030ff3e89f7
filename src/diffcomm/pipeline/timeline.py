"""Timelines of pipeline steps, and the bubble measured from them.

:class:`TimelineEntry` is one executed step of a :class:`~diffcomm.pipeline.PipelineRunner`
(``runner.timeline`` lists a rank's last step). :func:`bubble_fraction` turns the
timelines of all ranks into the measured idle share; :func:`replayed_bubble` replays the
same steps, with their measured busy times, on the schedule's dependencies with free
communication: the bubble the schedule itself implies for these stage times. The
difference of the two is what communication and the runtime cost; the replay differs
from :func:`~diffcomm.pipeline.theoretical_bubble` where stage times are not uniform
(a last stage that also computes the loss, a first stage whose input needs no gradient,
compute that runs slower while every rank computes at once).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from .schedules import makes, needs, stage_owner, walk

__all__ = ["TimelineEntry", "bubble_fraction", "replayed_bubble", "bubble_bound"]


@dataclass
class TimelineEntry:
    """One executed step: wall-clock ``start``/``end`` (``time.perf_counter``, comparable
    across processes of one machine) and ``wait``, the seconds spent blocked in receives
    (so ``end - start - wait`` is this stage's busy time); ``chunk`` is the rank's chunk
    (virtual stage ``chunk * p + rank``, or in the V placement ``rank`` / ``2p - 1 -
    rank``). ``sent``: for a ``B`` run as ``I`` then ``W``
    (input gradient first), the busy seconds into the step at which the input gradient
    left for the previous stage (the end of ``I``); ``None`` where the step's output leaves
    at its end.

    ``wait`` is host time around the blocking receive calls (activations, and the
    gradients a send's backward receives), the device is never synchronised for it: on a
    GPU whose backend completes receives asynchronously (NCCL) it counts only the host's
    part of the wait.

    ``overlap``: this step is half of an :class:`~diffcomm.pipeline.Overlap` (the
    forward, or the backward that follows it in the same fused step).

    ``whole``: an ``I`` (or a ``B`` asked to split) that ran the micro-batch's whole
    backward, the weight gradients included, because its input gradient's path runs
    through a compiled region's backward (one node: ``torch.compile`` with AOTAutograd,
    see ``docs/pipeline.md``); that micro-batch's ``W`` then does nothing."""

    kind: str
    micro: int
    start: float
    end: float
    wait: float
    chunk: int = 0
    sent: float | None = None
    overlap: bool = False
    whole: bool = False

    @property
    def busy(self) -> float:
        return max(0.0, self.end - self.start - self.wait)


def bubble_fraction(timelines: Sequence[Sequence[TimelineEntry]]) -> float:
    """Measured bubble of one step: the mean over stages of the idle share of the step.

    The step spans from the earliest start to the latest end over all stages; a stage is
    busy for the sum of its steps' ``busy`` time (time blocked in receives excluded).
    Compare with :func:`~diffcomm.pipeline.theoretical_bubble` and
    :func:`replayed_bubble`.
    """
    t0 = min(e.start for tl in timelines for e in tl)
    t1 = max(e.end for tl in timelines for e in tl)
    span = t1 - t0
    if span <= 0:
        return 0.0
    return sum(1.0 - sum(e.busy for e in tl) / span for tl in timelines) / len(timelines)


def replayed_bubble(timelines: Sequence[Sequence[TimelineEntry]], placement: str = "loop") -> float:
    """The bubble of the same steps with free communication: a replay of the schedule.

    ``timelines[r]`` is rank ``r``'s steps in the order it ran them (``runner.timeline``
    of every rank, one step). Each step keeps its measured ``busy`` time and starts as
    soon as its rank is free and its input is there: ``F`` of a micro-batch on virtual
    stage ``g`` after ``F`` on ``g - 1``; ``B`` / ``I`` on ``g`` after ``B`` / ``I`` on
    ``g + 1`` (on the last virtual stage, its own ``F``), where ``g + 1``'s gradient left
    at the end of that step, or ``sent`` seconds into it; ``W`` runs in its rank's order.
    Returns :func:`bubble_fraction` of that replay: the idle share the schedule implies
    for these stage times, with messages taking no time and ranks never blocked by
    anything but data. With uniform stage times it equals
    :func:`~diffcomm.pipeline.theoretical_bubble` (GPipe, 1F1B, interleaved 1F1B) and
    ZB-H1's ``(p-1)(F+I-W) / (m(F+I+W) + (p-1)(F+I-W))``. ``placement``: ``"loop"`` or
    ``"v"`` (the schedule's, see :func:`~diffcomm.pipeline.virtual_stage`).

    Raises ``ValueError`` when the steps cannot all run (a step waits for one that no
    rank runs before it: not the timelines of one step of a valid schedule).
    """
    p = len(timelines)
    last = p * (1 + max((e.chunk for tl in timelines for e in tl), default=0)) - 1
    done: dict[tuple[str, int, int], float] = {}  # what a step sends -> when it left
    free = [0.0] * p
    replay: list[list[TimelineEntry]] = [[] for _ in range(p)]

    def run(r: int, e: TimelineEntry, dep: tuple[str, int, int] | None) -> None:
        start = max(free[r], done[dep] if dep is not None else 0.0)
        end = free[r] = start + e.busy
        replay[r].append(TimelineEntry(e.kind, e.micro, start, end, 0.0, e.chunk, e.sent, e.overlap))
        out = makes(r, e, p, placement)
        if out is not None:
            done[out] = end if e.sent is None else start + min(e.sent, e.busy)

    pc = walk(timelines, p, last, done, run, placement)
    stuck = [f"rank {r} step {pc[r]} ({timelines[r][pc[r]].kind}{timelines[r][pc[r]].micro})"
             for r in range(p) if pc[r] < len(timelines[r])]  # fmt: skip
    if stuck:
        raise ValueError(
            "diffcomm.pipeline.replayed_bubble(): `timelines` must be one step of a valid "
            f"schedule on every rank; these steps wait for data no rank makes: {', '.join(stuck)}"
        )
    return bubble_fraction([tl for tl in replay if tl])


def bubble_bound(timelines: Sequence[Sequence[TimelineEntry]], placement: str = "loop") -> float:
    """The least bubble **any order** of these steps on their ranks can have, free messages.

    ``timelines`` as for :func:`replayed_bubble`: every step keeps its rank and its
    measured ``busy`` time, and its data dependencies (``F`` after the previous virtual
    stage's ``F``; ``B``/``I`` after the next stage's ``B``/``I`` — or ``sent`` seconds
    into it — and after its own ``F``; ``W`` after its own ``I``); the rank's order and
    any memory bound are dropped. Then no schedule can end before

    * the critical path (the longest chain of dependent steps), nor
    * for every rank ``r``: ``head_r + busy_r + tail_r`` — the earliest any of its steps
      can start (the forward chain of micro-batch 0 to it), all its busy time, and the
      least work that must still follow its last step (the gradient chain back to stage
      0, unless a ``W`` can end the rank),

    the classic lower bound of a makespan with precedences on dedicated machines. The
    returned bubble is :func:`bubble_fraction` of a step of that length: with uniform
    stages it is the schedule family's theory (1F1B's ``(p-1)/(m+p-1)``; ZB-H1's
    ``(p-1)F / (3mF + (p-1)F)`` at ``F = I = W``); with unequal stages it counts what the
    imbalance costs — rank ``r``'s ``busy_r`` below the busiest rank's is idle in every
    order. A schedule whose :func:`replayed_bubble` equals this bound is optimal for these
    step times: no ``W`` placement (nor any other order) can do better.
    """
    p = len(timelines)
    last = p * (1 + max((e.chunk for tl in timelines for e in tl), default=0)) - 1
    nodes = [(r, e) for r in range(p) for e in timelines[r]]
    maker: dict[tuple[str, int, int], tuple[int, TimelineEntry]] = {}
    own: dict[tuple[int, str, int, int], TimelineEntry] = {}  # (rank, kind, micro, chunk)
    for r, e in nodes:
        out = makes(r, e, p, placement)
        if out is not None:
            maker[out] = (r, e)
        own[(r, e.kind, e.micro, e.chunk)] = e

    def release(e: TimelineEntry) -> float:  # when what e sends has left, from e's start
        return e.busy if e.sent is None else min(e.sent, e.busy)

    preds: dict[int, list[tuple[TimelineEntry, float]]] = {id(e): [] for _, e in nodes}
    succs: dict[int, list[tuple[TimelineEntry, float]]] = {id(e): [] for _, e in nodes}

    def edge(a: TimelineEntry, b: TimelineEntry, lag: float) -> None:  # b starts >= a's start + lag
        preds[id(b)].append((a, lag))
        succs[id(a)].append((b, lag))

    for r, e in nodes:
        dep = needs(r, e, p, last, placement)
        if dep is not None:
            if dep not in maker:
                raise ValueError(
                    "diffcomm.pipeline.bubble_bound(): `timelines` must be one step of a valid schedule "
                    f"on every rank; rank {r}'s {e.kind}{e.micro} needs {dep}, which rank "
                    f"{stage_owner(dep[1], p, placement)[0]} never makes"
                )
            a = maker[dep][1]
            edge(a, e, release(a))
        first = {"B": "F", "I": "F", "W": "I"}.get(e.kind)
        if first is not None and (r, first, e.micro, e.chunk) in own:
            a = own[(r, first, e.micro, e.chunk)]
            edge(a, e, a.busy)
    head: dict[int, float] = {}  # earliest start
    rest: dict[int, float] = {}  # longest chain from the start to the end of everything after

    def earliest(e: TimelineEntry) -> float:
        if id(e) not in head:
            head[id(e)] = max((earliest(a) + lag for a, lag in preds[id(e)]), default=0.0)
        return head[id(e)]

    def longest(e: TimelineEntry) -> float:
        if id(e) not in rest:
            rest[id(e)] = max([e.busy] + [lag + longest(b) for b, lag in succs[id(e)]])
        return rest[id(e)]

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(nodes) + 100))
    try:
        span = max((earliest(e) + longest(e) for _, e in nodes), default=0.0)
        busy = [sum(e.busy for e in tl) for tl in timelines]
        for r in range(p):
            if timelines[r]:
                h = min(earliest(e) for e in timelines[r])
                t = min(longest(e) - e.busy for e in timelines[r])
                span = max(span, h + busy[r] + t)
    finally:
        sys.setrecursionlimit(limit)
    if span <= 0:
        return 0.0
    return sum(1.0 - b / span for b in busy) / p
