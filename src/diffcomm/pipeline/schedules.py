"""Pipeline schedules as data: GPipe, 1F1B, interleaved 1F1B and ZB-H1.

A schedule is, per rank, a list of :class:`Step` s. With ``n_chunks = v`` virtual stages
per rank, the model is cut into ``p * v`` stages and rank ``r`` holds stages ``r, r + p,
r + 2p, ...`` (its chunks ``0 .. v-1``, Megatron's placement): a micro-batch visits rank 0,
1, .., p-1, then rank 0 again for chunk 1, and so on.

Step kinds: ``F`` forward; ``B`` full backward; or the zero-bubble split of ``B`` into
``I`` (input gradient only — it unblocks the previous stage) and ``W`` (weight gradient,
needed by nobody else, so it can wait for an idle slot).

Memory bounds — (micro-batch, chunk) pairs whose activations rank ``r`` holds at once
(``p`` ranks, ``m`` micro-batches, ``v`` chunks; :func:`max_in_flight` computes it from the
data, tests check it) — and the ideal bubble (uniform stages, free messages):

* ``gpipe``: all ``v*m``; bubble ``(p-1) / (v*m + p-1)``.
* ``1f1b`` (``v = 1``): ``min(p - r, m)``; bubble ``(p-1) / (m + p-1)``.
* ``interleaved``: ``min(2(p-r-1) + (v-1)*G + 1, v*m)`` chunk-sized activations (``G``:
  the first group of micro-batches, ``min(p, m)`` when ``p`` divides ``m``)
  (each ``1/v`` of a stage's); bubble ``(p-1) / (v*m + p-1)`` when ``p`` divides ``m``.
* ``zb-h1``: the bound of its base's busiest rank on every rank (1F1B: ``min(p, m)``;
  ``memory="rank"``: each rank's own base bound), counted until ``W``, plus the
  gradients ``I`` keeps for ``W`` (at the nodes where the weights' branches leave the
  input path: about one activation per layer); bubble ``(p-1)(F+I-W)`` of a step of
  ``m(F+I+W) + (p-1)(F+I-W)`` (``v = 1``), against 1F1B's ``(p-1)(F+I+W)``.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..backend import args as A

# Size: ~700 lines, over the ~600 guideline: every generator (six schedules) with its docstring,
# the W-placement they share and the one simulation of a schedule (``needs`` / ``makes`` /
# ``walk``, also the validator's and the replayed bubble's); a third is the public docstrings.

__all__ = [
    "Step",
    "Overlap",
    "Placement",
    "virtual_stage",
    "stage_owner",
    "expand_steps",
    "zbv_schedule",
    "dualpipev_schedule",
    "schedule_placement",
    "gpipe_schedule",
    "one_f_one_b_schedule",
    "interleaved_1f1b_schedule",
    "zb_h1_schedule",
    "SCHEDULES",
    "max_in_flight",
    "theoretical_bubble",
]

ScheduleFn = Callable[..., list[list[Any]]]
Kind = Literal["F", "B", "I", "W"]
#: How virtual stages sit on ranks: ``"loop"`` (rank ``r`` holds ``r, r + p, ...``) or
#: ``"v"`` (two chunks per rank: rank ``r`` holds stage ``r`` and stage ``2p - 1 - r``).
Placement = Literal["loop", "v"]


@dataclass(frozen=True)
class Step:
    """One step of a schedule: ``kind`` of micro-batch ``micro`` on the rank's chunk ``chunk``.

    ``kind``: ``"F"`` forward, ``"B"`` full backward, ``"I"`` input-gradient backward,
    ``"W"`` weight-gradient backward (``I`` then ``W`` replace one ``B``). Prints as
    ``F0``, ``B3`` (chunk 0) or ``F0c1`` (chunk 1)."""

    kind: Kind
    micro: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}" + (f"c{self.chunk}" if self.chunk else "")

    __repr__ = __str__


@dataclass(frozen=True)
class Overlap:
    """One fused step: the forward ``forward`` of one micro-batch and the backward
    ``backward`` (``B`` or ``I``) of another, run as one step (DualPipeV's overlapped
    forward-and-backward; torch.distributed.pipelining's ``OVERLAP_F_B``).

    The runner posts both steps' receives before either computes, so the backward's
    gradient arrives while the forward computes and the forward's activation travels while
    the backward computes. The validator and the replay treat it as ``forward`` then
    ``backward`` on the rank (sends never block, so the order is the dependency order).
    Prints as ``(F3;B1c1)``."""

    forward: Step
    backward: Step

    @property
    def kind(self) -> str:
        return "O"

    def __str__(self) -> str:
        return f"({self.forward};{self.backward})"

    __repr__ = __str__


def expand_steps(steps: Sequence[Step | Overlap]) -> list[Step]:
    """One rank's steps with every :class:`Overlap` replaced by its forward then backward."""
    out: list[Step] = []
    for st in steps:
        if isinstance(st, Overlap):
            out += [st.forward, st.backward]
        else:
            out.append(st)
    return out


def virtual_stage(rank: int, chunk: int, n_stages: int, placement: str = "loop") -> int:
    """The virtual stage (index in the model's ``p * v`` pieces) of ``chunk`` on ``rank``:
    ``chunk * p + rank`` (``"loop"``), or ``rank`` / ``2p - 1 - rank`` for chunk 0 / 1
    (``"v"``)."""
    if placement == "v":
        return rank if chunk == 0 else 2 * n_stages - 1 - rank
    return chunk * n_stages + rank


def stage_owner(stage: int, n_stages: int, placement: str = "loop") -> tuple[int, int]:
    """``(rank, chunk)`` holding virtual stage ``stage``; inverse of :func:`virtual_stage`."""
    if placement == "v":
        return (stage, 0) if stage < n_stages else (2 * n_stages - 1 - stage, 1)
    return stage % n_stages, stage // n_stages


def halves(st: Any) -> tuple[Any, ...]:
    """An :class:`Overlap`'s forward and backward; any other step alone."""
    return (st.forward, st.backward) if isinstance(st, Overlap) else (st,)


def needs(r: int, st: Any, p: int, last: int, placement: str = "loop") -> tuple[str, int, int] | None:
    """What step ``st`` (a :class:`Step` or anything with its ``kind``, ``micro`` and
    ``chunk``) of rank ``r`` waits for from another rank: ``("F", g, m)``, the activation
    of micro-batch ``m`` from virtual stage ``g``, or ``("G", g, m)``, its gradient;
    ``None`` for a step that needs nothing (``last``: the last virtual stage)."""
    g = virtual_stage(r, st.chunk, p, placement)
    if st.kind == "F":
        return None if g == 0 else ("F", g - 1, st.micro)
    if st.kind in ("B", "I"):
        return None if g == last else ("G", g + 1, st.micro)
    return None


def makes(r: int, st: Any, p: int, placement: str = "loop") -> tuple[str, int, int] | None:
    """What step ``st`` of rank ``r`` sends on (the key :func:`needs` names it by)."""
    if st.kind == "W":
        return None
    return ("F" if st.kind == "F" else "G", virtual_stage(r, st.chunk, p, placement), st.micro)


def walk(
    schedule: Sequence[Sequence[Any]],
    p: int,
    last: int,
    done: Container[tuple[str, int, int]],
    run: Callable[[int, Any, tuple[str, int, int] | None], None],
    placement: str = "loop",
) -> list[int]:
    """Run every rank's steps in its order, each as soon as what it :func:`needs` is in
    ``done`` (which ``run(rank, step, needed)`` adds to); returns each rank's position
    where it stopped (its length when it ran every step). The one simulation of a
    schedule (the validator's deadlock check, the W placement's step time, the replayed
    bubble). An :class:`Overlap` is one step: it runs when what both its halves need is
    in ``done`` (``needed``: ``None`` for it)."""
    pc = [0] * p
    moved = True
    while moved:
        moved = False
        for r in range(p):
            while pc[r] < len(schedule[r]):
                st = schedule[r][pc[r]]
                deps = [needs(r, x, p, last, placement) for x in halves(st)]
                if any(d is not None and d not in done for d in deps):
                    break
                run(r, st, deps[0] if len(deps) == 1 else None)
                pc[r] += 1
                moved = True
    return pc


def schedule_placement(fn: Any) -> Placement:
    """The placement a schedule function's steps assume (its ``placement`` attribute;
    ``"loop"`` when it has none)."""
    while hasattr(fn, "func"):  # functools.partial
        fn = fn.func
    return "v" if getattr(fn, "placement", "loop") == "v" else "loop"


def _check_counts(n_stages: Any, n_micro: Any, n_chunks: Any, op: str) -> tuple[int, int, int]:
    n_stages = A.check_int(n_stages, op, "n_stages")
    n_micro = A.check_int(n_micro, op, "n_micro")
    n_chunks = A.check_int(n_chunks, op, "n_chunks")
    for name, val in (("n_stages", n_stages), ("n_micro", n_micro), ("n_chunks", n_chunks)):
        if val < 1:
            raise A.arg_error(op, name, "an int >= 1", val)
    if n_chunks > 1 and n_stages < 2:
        raise A.arg_error(op, "n_chunks", "1 when n_stages is 1 (chunks live on different ranks)", n_chunks)
    return n_stages, n_micro, n_chunks


def _micro_groups(n_stages: int, n_micro: int) -> list[range]:
    """The micro-batches in ``max(1, m // p)`` consecutive groups (torch's rounds), the
    larger first: each holds at least ``min(p, m)``, so a micro-batch's output of one chunk
    is back on rank 0 before its next chunk (``p`` groups of ``p`` when ``p`` divides ``m``;
    a last group smaller than ``p`` deadlocked, e.g. p = 4, v = 3, m = 5)."""
    rounds = max(1, n_micro // n_stages)
    base, extra = divmod(n_micro, rounds)
    out, start = [], 0
    for i in range(rounds):
        size = base + (i < extra)
        out.append(range(start, start + size))
        start += size
    return out


def _micro_order(n_stages: int, n_micro: int, n_chunks: int, backward: bool) -> list[tuple[int, int]]:
    """``(micro, chunk)`` in the order one rank runs them: micro-batches in the groups of
    :func:`_micro_groups`, each group through every chunk (ascending forward, descending
    backward)."""
    out: list[tuple[int, int]] = []
    for micros in _micro_groups(n_stages, n_micro):
        chunks = reversed(range(n_chunks)) if backward else range(n_chunks)
        for c in chunks:
            out += [(m, c) for m in micros]
    return out


def gpipe_schedule(n_stages: int, n_micro: int, n_chunks: int = 1) -> list[list[Step]]:
    """GPipe: every stage runs all forwards, then all backwards.

    With ``n_chunks > 1`` this is the looped (breadth-first) GPipe: all micro-batches
    through chunk 0, then chunk 1, ...; backwards in reverse chunk order.

    Args:
        n_stages: number of pipeline ranks.
        n_micro: number of micro-batches.
        n_chunks: virtual stages (model chunks) per rank.

    Returns:
        One list of steps per rank. Every rank holds the activations of all ``m * v``
        (micro-batch, chunk) pairs at its peak.

    Example::

        >>> gpipe_schedule(2, 2)
        [[F0, F1, B0, B1], [F0, F1, B0, B1]]
    """
    n_stages, n_micro, n_chunks = _check_counts(n_stages, n_micro, n_chunks, "gpipe_schedule")
    fwd = [Step("F", m, c) for c in range(n_chunks) for m in range(n_micro)]
    bwd = [Step("B", m, c) for c in reversed(range(n_chunks)) for m in range(n_micro)]
    return [fwd + bwd for _ in range(n_stages)]


def one_f_one_b_schedule(n_stages: int, n_micro: int, n_chunks: int = 1) -> list[list[Step]]:
    """1F1B (PipeDream-flush): warm-up forwards, then alternate one forward, one backward.

    Stage ``s`` runs ``min(n_stages - s - 1, n_micro)`` warm-up forwards, then ``F, B``
    pairs, then the remaining backwards. Same bubble as GPipe, but stage ``s`` never holds
    more than ``min(n_stages - s, n_micro)`` micro-batches' activations (GPipe: all).
    With ``n_chunks > 1`` it is :func:`interleaved_1f1b_schedule`.

    Args:
        n_stages: number of pipeline ranks.
        n_micro: number of micro-batches.
        n_chunks: virtual stages per rank.

    Returns:
        One list of steps per rank.

    Example::

        >>> one_f_one_b_schedule(2, 3)
        [[F0, F1, B0, F2, B1, B2], [F0, B0, F1, B1, F2, B2]]
    """
    n_stages, n_micro, n_chunks = _check_counts(n_stages, n_micro, n_chunks, "one_f_one_b_schedule")
    if n_chunks > 1:
        return interleaved_1f1b_schedule(n_stages, n_micro, n_chunks)
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


def interleaved_1f1b_schedule(n_stages: int, n_micro: int, n_chunks: int = 2) -> list[list[Step]]:
    """Interleaved 1F1B (Megatron-LM's virtual pipeline): ``n_chunks`` stages per rank.

    Each rank runs its ``(micro, chunk)`` forwards in groups of micro-batches (torch's
    rounds: ``max(1, m // p)`` groups of ``G = min(p, m)`` when ``p`` divides ``m``, else
    of sizes that differ by one, the larger ``G`` first), each group through chunk 0, 1,
    ..; rank ``r`` warms up with ``2(p - r - 1) + (v - 1) * G`` forwards, then alternates
    one forward and one backward, then drains. A
    chunk is ``1/v`` of a stage, so the ramp-up and drain shrink ``v``-fold: the ideal
    bubble is ``(p - 1) / (v*m + p - 1)`` when ``p`` divides ``m`` (more otherwise), for
    ``v`` times as many messages.

    Args:
        n_stages: number of pipeline ranks (>= 2 when ``n_chunks > 1``).
        n_micro: number of micro-batches.
        n_chunks: virtual stages per rank; 1 gives :func:`one_f_one_b_schedule`.

    Returns:
        One list of steps per rank; rank ``r`` holds at most ``min(2(p-r-1) + (v-1) *
        G + 1, v*m)`` (micro-batch, chunk) activations.

    Example::

        >>> interleaved_1f1b_schedule(2, 2, 2)
        [[F0, F1, F0c1, F1c1, B0c1, B1c1, B0, B1], [F0, F1, F0c1, B0c1, F1c1, B1c1, B0, B1]]
    """
    n_stages, n_micro, n_chunks = _check_counts(n_stages, n_micro, n_chunks, "interleaved_1f1b_schedule")
    if n_chunks == 1:
        return one_f_one_b_schedule(n_stages, n_micro)
    fwd = _micro_order(n_stages, n_micro, n_chunks, backward=False)
    bwd = _micro_order(n_stages, n_micro, n_chunks, backward=True)
    group = len(_micro_groups(n_stages, n_micro)[0])  # min(p, m) when p divides m
    out = []
    for r in range(n_stages):
        warm = min(2 * (n_stages - r - 1) + (n_chunks - 1) * group, n_micro * n_chunks)
        steps = [Step("F", m, c) for m, c in fwd[:warm]]
        for i, (m, c) in enumerate(fwd[warm:]):
            steps += [Step("F", m, c), Step("B", *bwd[i])]
        steps += [Step("B", m, c) for m, c in bwd[len(fwd) - warm :]]
        out.append(steps)
    return out


Costs = Mapping[str, float] | Sequence[Mapping[str, float]]


def _check_costs(costs: Any, p: int, op: str) -> list[dict[str, float]]:
    """Per-rank ``{"F", "I", "W"}`` step times from ``costs`` (one mapping for every rank,
    or one per rank); ``None``: unit costs."""
    if costs is None:
        return [{"F": 1.0, "I": 1.0, "W": 1.0} for _ in range(p)]
    per_rank = [costs] * p if isinstance(costs, Mapping) else costs
    if not isinstance(per_rank, Sequence) or len(per_rank) != p:
        raise A.arg_error(op, "costs", f"a mapping or {p} mappings of F, I, W step times", costs)
    out = []
    for r, c in enumerate(per_rank):
        if not isinstance(c, Mapping) or not all(k in c for k in "FIW"):
            raise A.arg_error(op, "costs", "mappings with keys 'F', 'I', 'W'", f"rank {r}: {c!r}")
        row = {k: float(c[k]) for k in "FIW"}
        if not all(v > 0 and v < float("inf") for v in row.values()):
            raise A.arg_error(op, "costs", "finite step times > 0", f"rank {r}: {row}")
        out.append(row)
    return out


def zb_h1_schedule(
    n_stages: int,
    n_micro: int,
    n_chunks: int = 1,
    memory: Literal["peak", "rank"] = "peak",
    costs: Costs | None = None,
) -> list[list[Step]]:
    """ZB-H1 (zero bubble, Qi et al., ICLR 2024): 1F1B with each backward split in two.

    ``I`` (input gradient) keeps 1F1B's place, so the previous stage gets its gradient as
    early as before; ``W`` (weight gradient) is needed by no other stage, so it waits for
    a slot where the rank would otherwise idle. The order is found by simulating the
    pipeline with the step times ``costs`` (unit ``F``, ``I``, ``W`` when ``None``): run
    the base order (1F1B, or interleaved 1F1B for ``n_chunks > 1``); whenever its next step
    would wait, run the oldest pending ``W`` instead; and never let a rank hold more
    forwards without their ``W`` than the memory rule allows:

    * ``memory="peak"`` (the paper's ZB-H1): every rank holds at most what the base
      schedule's busiest rank holds (1F1B: ``min(p, m)``, rank 0's bound), so the peak
      over ranks is the base's. Ranks after the first may then defer their ``W`` and keep
      passing input gradients back: with ``F = I = W`` the bubble is ``(p-1)(F+I-W)`` of
      ``m(F+I+W) + (p-1)(F+I-W)`` (``v = 1``), against 1F1B's ``(p-1)(F+I+W)``.
    * ``memory="rank"``: every rank holds at most its own base bound (1F1B: ``min(p-r,
      m)``). No ``W`` can wait before the drain, so this is 1F1B with every ``B`` run as
      ``I`` then ``W`` (bubble ``2(p-1)`` units at ``F = I = W``).

    With measured, unequal ``costs`` (the zero-bubble paper's automatic scheduler, greedy)
    the ``W`` steps go where these stage times leave holes, not where unit times would —
    when that is simulated to shorten the step by more than ``MIN_GAIN`` (0.5 %);
    otherwise the unit-time order is kept (one step's measured times are noisier than
    that on a loaded machine).

    Args:
        n_stages: number of pipeline ranks.
        n_micro: number of micro-batches.
        n_chunks: virtual stages per rank.
        memory: ``"peak"`` or ``"rank"``, the activation bound above.
        costs: step times ``{"F": .., "I": .., "W": ..}`` (seconds or any unit), one
            mapping for every rank or one per rank; ``None``: all 1.

    Returns:
        One list of steps per rank, with ``I`` and ``W`` (no ``B``).

    Example::

        >>> zb_h1_schedule(2, 2)
        [[F0, F1, I0, W0, I1, W1], [F0, I0, F1, I1, W0, W1]]
        >>> zb_h1_schedule(2, 2, memory="rank")
        [[F0, F1, I0, W0, I1, W1], [F0, I0, W0, F1, I1, W1]]
    """
    n_stages, n_micro, n_chunks = _check_counts(n_stages, n_micro, n_chunks, "zb_h1_schedule")
    if memory not in ("peak", "rank"):
        raise A.arg_error("zb_h1_schedule", "memory", "'peak' or 'rank'", memory)
    cost = _check_costs(costs, n_stages, "zb_h1_schedule")
    base = one_f_one_b_schedule(n_stages, n_micro, n_chunks)
    bounds = [max_in_flight(steps) for steps in base]
    caps = [max(bounds)] * n_stages if memory == "peak" else bounds
    return _place_w(_WFill(base, n_stages, n_chunks, caps, "loop"), cost, costs is not None)


@dataclass(frozen=True)
class _WFill:
    """What a ``W`` placement fills: a ``base`` schedule of ``p`` ranks with ``v`` chunks
    each, whose ``B`` steps split into ``I`` + ``W``; rank ``r`` never holds more than
    ``cap[r]`` forwards without their ``W``; the stages placed by ``placement``."""

    base: list[list[Step]]
    p: int
    v: int
    cap: list[int]
    placement: str


def _place_w(job: _WFill, cost: list[dict[str, float]], tune: bool) -> list[list[Step]]:
    """The ``W`` placement of :func:`_fill_with_w`; with ``tune`` (given step times) the
    best, by the simulated step time under ``cost``, of three greedy rules: ``W`` in every
    hole by unit times, by these times, and by these times only where it fits the hole."""
    unit = [{"F": 1.0, "I": 1.0, "W": 1.0}] * job.p
    plain = _fill_with_w(job, unit)
    if not tune:
        return plain
    cands = [_fill_with_w(job, cost), _fill_with_w(job, cost, fit=True)]
    return _prefer(plain, cands, job.p, job.v, cost, job.placement)


#: A placement from step times replaces the standard one only if its simulated step is
#: shorter by more than this share: measured times vary more than that from step to step
#: on a loaded machine, and a placement chosen on noise loses in the next steps (measured:
#: ``docs/pipeline.md``).
MIN_GAIN = 0.005


def _prefer(
    plain: list[list[Any]],
    cands: list[list[list[Any]]],
    p: int,
    v: int,
    cost: list[dict[str, float]],
    placement: str,
) -> list[list[Any]]:
    """``plain`` unless the best of ``cands`` is simulated to be more than ``MIN_GAIN`` shorter."""
    base = _makespan(plain, p, v, cost, placement)
    best = min(cands, key=lambda sched: _makespan(sched, p, v, cost, placement))
    return best if _makespan(best, p, v, cost, placement) < base * (1 - MIN_GAIN) else plain


def _makespan(sched: list[list[Step]], p: int, v: int, cost: list[dict[str, float]], placement: str) -> float:
    """When the last rank finishes ``sched`` with step times ``cost`` and free messages."""
    done: dict[tuple[str, int, int], float] = {}  # what each step makes: when it is made
    free = [0.0] * p

    def run(r: int, st: Step, dep: tuple[str, int, int] | None) -> None:
        free[r] = max(free[r], done[dep] if dep else 0.0) + cost[r][st.kind]
        out = makes(r, st, p, placement)
        if out is not None:
            done[out] = free[r]

    walk(sched, p, p * v - 1, done, run, placement)
    return max(free)


def _fill_with_w(job: _WFill, cost: list[dict[str, float]], fit: bool = False) -> list[list[Step]]:
    """Split every ``B`` of ``job.base`` into ``I`` + ``W`` (dropping the ``W`` it has),
    placing each ``W`` by simulating the steps with times ``cost``; rank ``r`` never holds
    more than ``job.cap[r]`` forwards without their ``W``. ``fit``: a ``W`` goes before a
    step that waits only if it ends by the time that step can start (or that step's input
    is not due yet)."""
    base, p, v, cap, placement = job.base, job.p, job.v, job.cap, job.placement
    last = p * v - 1
    order = [
        [Step("I", s.micro, s.chunk) if s.kind == "B" else s for s in steps if s.kind != "W"]
        for steps in base
    ]
    out: list[list[Step]] = [[] for _ in range(p)]
    pc, live = [0] * p, [0] * p
    free = [0.0] * p
    pending: list[list[Step]] = [[] for _ in range(p)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, micro) -> finish time

    def ready(r: int) -> float | None:
        st = order[r][pc[r]]
        g = virtual_stage(r, st.chunk, p, placement)
        if st.kind == "F":
            if live[r] >= cap[r]:
                return None
            dep = None if g == 0 else ("F", g - 1, st.micro)
        else:
            dep = None if g == last else ("I", g + 1, st.micro)
        if dep is None:
            return free[r]
        return None if dep not in done else max(free[r], done[dep])

    while any(pc[r] < len(order[r]) or pending[r] for r in range(p)):
        best: tuple[float, int, bool] | None = None  # (start time, rank, is W)
        for r in range(p):
            t = ready(r) if pc[r] < len(order[r]) else None
            if t is not None and (not pending[r] or t <= free[r] or (fit and free[r] + cost[r]["W"] > t)):
                cand = (t, r, False)
            elif pending[r]:
                cand = (free[r], r, True)
            else:
                continue
            if best is None or cand[:2] < best[:2]:
                best = cand
        if best is None:  # cannot happen for a valid base schedule
            raise RuntimeError("zb_h1_schedule: the base schedule does not run to the end")
        t, r, is_w = best
        if is_w:
            st = pending[r].pop(0)
            live[r] -= 1
        else:
            st = order[r][pc[r]]
            pc[r] += 1
            if st.kind == "F":
                live[r] += 1
            else:
                pending[r].append(Step("W", st.micro, st.chunk))
        free[r] = t + cost[r][st.kind]
        out[r].append(st)
        if st.kind != "W":
            done[(st.kind, virtual_stage(r, st.chunk, p, placement), st.micro)] = free[r]
    return out


def _check_v(n_stages: Any, n_micro: Any, n_chunks: Any, op: str) -> tuple[int, int]:
    n_stages, n_micro, n_chunks = _check_counts(n_stages, n_micro, n_chunks, op)
    if n_chunks != 2:
        raise A.arg_error(op, "n_chunks", "2 (V placement: rank r holds stages r and 2p-1-r)", n_chunks)
    if n_stages < 2:
        raise A.arg_error(op, "n_stages", "an int >= 2 (V placement)", n_stages)
    return n_stages, n_micro


def zbv_schedule(
    n_stages: int, n_micro: int, n_chunks: int = 2, costs: Costs | None = None
) -> list[list[Step]]:
    """ZB-V (zero bubble, V-shaped; Qi et al., section 6): two chunks per rank in the V
    placement — rank ``r`` holds virtual stage ``r`` (chunk 0) and ``2p - 1 - r`` (chunk
    1), so a micro-batch goes down the ranks and back up, and rank 0 computes the loss.

    With ``costs=None`` the order is torch.distributed.pipelining's
    ``ScheduleZBVZeroBubble`` (warm-up forwards, a steady ``F I W`` on both chunks, an
    ``I``-only cool-down, then the pending ``W``); with uniform ``F = I = W`` its bubble
    is zero after the ramp. Every rank holds at most ``2p`` chunk activations (``p``
    micro-batches' worth of a full stage: 1F1B's rank 0, on every rank). With ``costs``
    (measured step times), the ``F`` and ``I`` order is kept and every ``W`` is placed
    by simulating these times, within the same activation bound (see
    :func:`zb_h1_schedule`).

    Args:
        n_stages: number of pipeline ranks (>= 2).
        n_micro: number of micro-batches.
        n_chunks: must be 2.
        costs: step times (see :func:`zb_h1_schedule`), or ``None``.

    Returns:
        One list of ``F``, ``I``, ``W`` steps per rank (V placement).

    Example::

        >>> zbv_schedule(2, 2)[1]
        [F0, F0c1, F1, F1c1, I0c1, W0c1, I0, W0, I1c1, W1c1, I1, W1]
    """
    p, m = _check_v(n_stages, n_micro, n_chunks, "zbv_schedule")
    cost = _check_costs(costs, p, "zbv_schedule")
    out = [_zbv_rank(p, m, r) for r in range(p)]
    if costs is None:
        return out
    caps = [max(max_in_flight(steps) for steps in out)] * p
    placed = _place_w(_WFill(out, p, 2, caps, "v"), cost, True)
    return _prefer(out, [placed], p, 2, cost, "v")  # torch's order unless placing gains


def _zbv_rank(p: int, m: int, rank: int) -> list[Step]:
    """One rank of torch's ScheduleZBVZeroBubble, as diffcomm steps."""
    n = max(2 * p - 1, m)
    ops: list[Step] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (p - rank) - 1):
        ops.append(Step("F", f0, 0))
        f0 += 1
    for _ in range(rank):
        ops += [Step("F", f1, 1), Step("F", f0, 0)]
        f1, f0 = f1 + 1, f0 + 1
    for _ in range(p - rank):
        ops += [Step("F", f1, 1), Step("I", b1, 1), Step("W", b1, 1)]
        f1, b1 = f1 + 1, b1 + 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            ops.append(Step("F", f0, 0))
            f0 += 1
        ops += [Step("I", b0, 0), Step("W", b0, 0), Step("F", f1, 1), Step("I", b1, 1), Step("W", b1, 1)]
        b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
    w0, w1 = b0, b1
    for _ in range(rank):
        ops += [Step("I", b0, 0), Step("I", b1, 1)]
        b0, b1 = b0 + 1, b1 + 1
    for _ in range(p - rank):
        ops += [Step("I", b0, 0), Step("W", w0, 0)]
        b0, w0 = b0 + 1, w0 + 1
    ops += [Step("W", i, 1) for i in range(w1, b1)] + [Step("W", i, 0) for i in range(w0, b0)]
    return [st for st in ops if st.micro < m]


def dualpipev_schedule(n_stages: int, n_micro: int, n_chunks: int = 2) -> list[list[Step | Overlap]]:
    """DualPipeV (DeepSeek's DualPipe folded into the V placement; torch's
    ``ScheduleDualPipeV``): rank ``r`` holds virtual stages ``r`` and ``2p - 1 - r``; in
    the steady state every step is an :class:`Overlap` of one micro-batch's forward on one
    chunk with another's full backward on the other chunk, so each one's messages travel
    while the other computes; the ramp uses ``I``/``W`` splits (zero bubble) to fill.

    Args:
        n_stages: number of pipeline ranks (>= 2).
        n_micro: number of micro-batches, at least ``2 * n_stages``.
        n_chunks: must be 2.

    Returns:
        One list of steps per rank: :class:`Step` s and :class:`Overlap` s.

    Example::

        >>> dualpipev_schedule(2, 4)[1]
        [F0, F0c1, F1, F1c1, F2, B0c1, (F2c1;B0), (F3;B1c1), (F3c1;B1), B2c1, B2, I3c1, I3, W3c1, W3]
    """
    p, m = _check_v(n_stages, n_micro, n_chunks, "dualpipev_schedule")
    if m < 2 * p:
        raise A.arg_error("dualpipev_schedule", "n_micro", f"an int >= 2 * n_stages = {2 * p}", m)
    return [_dualpipev_rank(p, m, r) for r in range(p)]


def _dualpipev_rank(p: int, m: int, rank: int) -> list[Step | Overlap]:
    """One rank of torch's ScheduleDualPipeV, as diffcomm steps (chunk 0: stage ``rank``)."""
    acts: list[Step | Overlap] = []
    nxt = {("F", 0): 0, ("F", 1): 0, ("I", 0): 0, ("I", 1): 0}  # next micro-batch per (kind, chunk)
    wq: list[Step] = []

    def take(kind: str, c: int) -> Step:
        key = ("F" if kind == "F" else "I", c)
        mb = nxt[key]
        nxt[key] = mb + 1
        if kind == "I":
            wq.append(Step("W", mb, c))
        return Step(kind, mb, c)  # type: ignore[arg-type]

    def w() -> None:
        if wq:
            acts.append(wq.pop(0))

    for _ in range((p - rank - 1) * 2):
        acts.append(take("F", 0))
    for _ in range(rank + 1):
        acts += [take("F", 0), take("F", 1)]
    for _ in range(p - rank - 1):
        acts.append(take("I", 1))
        w()
        acts.append(take("F", 1))
    for i in range(m - 2 * p + rank + 1):
        if i == 0 and rank == p - 1:  # not overlapped: a smaller bubble
            acts += [take("F", 0), take("B", 1)]
        else:
            f = take("F", 0)
            acts.append(Overlap(f, take("B", 1)))
        f = take("F", 1)
        acts.append(Overlap(f, take("B", 0)))
    for _ in range(p - rank - 1):
        acts.append(take("B", 1))
        f = take("F", 1)
        acts.append(Overlap(f, take("B", 0)))
    zb = False
    for i in range(rank + 1):
        if i == (rank + 1) // 2 and rank % 2 == 1:
            zb = True
        acts.append(take("I" if zb else "B", 1))
        if i == (rank + 1) // 2 and rank % 2 == 0:
            zb = True
        acts.append(take("I" if zb else "B", 0))
    for _ in range(p - rank - 1):
        w()
        acts.append(take("I" if zb else "B", 0))
    for _ in range(rank + 1):
        w()
    return acts


zbv_schedule.placement = "v"  # type: ignore[attr-defined]
dualpipev_schedule.placement = "v"  # type: ignore[attr-defined]


#: Built-in schedules by name (``PipelineRunner(schedule=...)``).
SCHEDULES: dict[str, ScheduleFn] = {
    "gpipe": gpipe_schedule,
    "1f1b": one_f_one_b_schedule,
    "interleaved": interleaved_1f1b_schedule,
    "zb-h1": zb_h1_schedule,
    "zbv": zbv_schedule,
    "dualpipev": dualpipev_schedule,
}


def max_in_flight(steps: Sequence[Step | Overlap]) -> int:
    """Most (micro-batch, chunk) pairs whose forward ran and whose backward has not
    finished (``B``, or ``W`` for a split backward), at any point of one rank's steps."""
    live = peak = 0
    for st in expand_steps(steps):
        live += 1 if st.kind == "F" else -1 if st.kind in ("B", "W") else 0
        peak = max(peak, live)
    return peak


def theoretical_bubble(n_stages: int, n_micro: int, n_chunks: int = 1) -> float:
    """``(p - 1) / (v*m + p - 1)``: the idle share of GPipe and 1F1B (``v = 1``) and of
    interleaved 1F1B (``v`` chunks, ``p`` dividing ``m``) with uniform stages, free comms."""
    return (n_stages - 1) / (n_chunks * n_micro + n_stages - 1)
