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
* ``interleaved``: ``min(2(p-r-1) + (v-1)*min(p, m) + 1, v*m)`` chunk-sized activations
  (each ``1/v`` of a stage's); bubble ``(p-1) / (v*m + p-1)`` when ``p`` divides ``m``.
* ``zb-h1``: the bound of its base's busiest rank on every rank (1F1B: ``min(p, m)``;
  ``memory="rank"``: each rank's own base bound), counted until ``W``, plus the
  gradients ``I`` keeps for ``W`` (at the nodes where the weights' branches leave the
  input path: about one activation per layer); bubble ``(p-1)(F+I-W)`` of a step of
  ``m(F+I+W) + (p-1)(F+I-W)`` (``v = 1``), against 1F1B's ``(p-1)(F+I+W)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..backend import args as A

__all__ = [
    "Step",
    "gpipe_schedule",
    "one_f_one_b_schedule",
    "interleaved_1f1b_schedule",
    "zb_h1_schedule",
    "SCHEDULES",
    "max_in_flight",
    "theoretical_bubble",
]

ScheduleFn = Callable[..., list[list["Step"]]]
Kind = Literal["F", "B", "I", "W"]


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


def _micro_order(n_stages: int, n_micro: int, n_chunks: int, backward: bool) -> list[tuple[int, int]]:
    """``(micro, chunk)`` in the order one rank runs them: micro-batches in groups of
    ``min(p, m)``, each group through every chunk (ascending forward, descending backward)."""
    group = min(n_stages, n_micro)
    out: list[tuple[int, int]] = []
    for g0 in range(0, n_micro, group):
        micros = range(g0, min(n_micro, g0 + group))
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

    Each rank runs its ``(micro, chunk)`` forwards in groups of ``min(p, m)`` micro-batches,
    each group through chunk 0, 1, ..; rank ``r`` warms up with ``2(p - r - 1) + (v - 1) *
    min(p, m)`` forwards, then alternates one forward and one backward, then drains. A
    chunk is ``1/v`` of a stage, so the ramp-up and drain shrink ``v``-fold: the ideal
    bubble is ``(p - 1) / (v*m + p - 1)`` when ``p`` divides ``m`` (more otherwise), for
    ``v`` times as many messages.

    Args:
        n_stages: number of pipeline ranks (>= 2 when ``n_chunks > 1``).
        n_micro: number of micro-batches.
        n_chunks: virtual stages per rank; 1 gives :func:`one_f_one_b_schedule`.

    Returns:
        One list of steps per rank; rank ``r`` holds at most ``min(2(p-r-1) + (v-1) *
        min(p, m) + 1, v*m)`` (micro-batch, chunk) activations.

    Example::

        >>> interleaved_1f1b_schedule(2, 2, 2)
        [[F0, F1, F0c1, F1c1, B0c1, B1c1, B0, B1], [F0, F1, F0c1, B0c1, F1c1, B1c1, B0, B1]]
    """
    n_stages, n_micro, n_chunks = _check_counts(n_stages, n_micro, n_chunks, "interleaved_1f1b_schedule")
    if n_chunks == 1:
        return one_f_one_b_schedule(n_stages, n_micro)
    fwd = _micro_order(n_stages, n_micro, n_chunks, backward=False)
    bwd = _micro_order(n_stages, n_micro, n_chunks, backward=True)
    group = min(n_stages, n_micro)
    out = []
    for r in range(n_stages):
        warm = min(2 * (n_stages - r - 1) + (n_chunks - 1) * group, n_micro * n_chunks)
        steps = [Step("F", m, c) for m, c in fwd[:warm]]
        for i, (m, c) in enumerate(fwd[warm:]):
            steps += [Step("F", m, c), Step("B", *bwd[i])]
        steps += [Step("B", m, c) for m, c in bwd[len(fwd) - warm :]]
        out.append(steps)
    return out


def zb_h1_schedule(
    n_stages: int, n_micro: int, n_chunks: int = 1, memory: Literal["peak", "rank"] = "peak"
) -> list[list[Step]]:
    """ZB-H1 (zero bubble, Qi et al., ICLR 2024): 1F1B with each backward split in two.

    ``I`` (input gradient) keeps 1F1B's place, so the previous stage gets its gradient as
    early as before; ``W`` (weight gradient) is needed by no other stage, so it waits for
    a slot where the rank would otherwise idle. The order is found by simulating the
    pipeline with unit-cost ``F``, ``I``, ``W``: run the base order (1F1B, or interleaved
    1F1B for ``n_chunks > 1``); whenever its next step would wait, run the oldest pending
    ``W`` instead; and never let a rank hold more forwards without their ``W`` than the
    memory rule allows:

    * ``memory="peak"`` (the paper's ZB-H1): every rank holds at most what the base
      schedule's busiest rank holds (1F1B: ``min(p, m)``, rank 0's bound), so the peak
      over ranks is the base's. Ranks after the first may then defer their ``W`` and keep
      passing input gradients back: with ``F = I = W`` the bubble is ``(p-1)(F+I-W)`` of
      ``m(F+I+W) + (p-1)(F+I-W)`` (``v = 1``), against 1F1B's ``(p-1)(F+I+W)``.
    * ``memory="rank"``: every rank holds at most its own base bound (1F1B: ``min(p-r,
      m)``). No ``W`` can wait before the drain, so this is 1F1B with every ``B`` run as
      ``I`` then ``W`` (bubble ``2(p-1)`` units at ``F = I = W``).

    Args:
        n_stages: number of pipeline ranks.
        n_micro: number of micro-batches.
        n_chunks: virtual stages per rank.
        memory: ``"peak"`` or ``"rank"``, the activation bound above.

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
    base = one_f_one_b_schedule(n_stages, n_micro, n_chunks)
    bounds = [max_in_flight(steps) for steps in base]
    caps = [max(bounds)] * n_stages if memory == "peak" else bounds
    return _fill_with_w(base, n_stages, n_chunks, caps)


def _fill_with_w(base: list[list[Step]], p: int, v: int, cap: list[int]) -> list[list[Step]]:
    """Split every ``B`` of ``base`` into ``I`` + ``W``, placing each ``W`` by simulation;
    rank ``r`` never holds more than ``cap[r]`` forwards without their ``W``."""
    last = p * v - 1
    order = [[Step("I", s.micro, s.chunk) if s.kind == "B" else s for s in steps] for steps in base]
    out: list[list[Step]] = [[] for _ in range(p)]
    pc, free, live = [0] * p, [0] * p, [0] * p
    pending: list[list[Step]] = [[] for _ in range(p)]
    done: dict[tuple[str, int, int], int] = {}  # (kind, virtual stage, micro) -> finish time

    def ready(r: int) -> int | None:
        st = order[r][pc[r]]
        g = st.chunk * p + r
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
        best: tuple[int, int, bool] | None = None  # (start time, rank, is W)
        for r in range(p):
            t = ready(r) if pc[r] < len(order[r]) else None
            if t is not None and (not pending[r] or t <= free[r]):
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
        free[r] = t + 1
        out[r].append(st)
        if st.kind != "W":
            done[(st.kind, st.chunk * p + r, st.micro)] = t + 1
    return out


#: Built-in schedules by name (``PipelineRunner(schedule=...)``).
SCHEDULES: dict[str, ScheduleFn] = {
    "gpipe": gpipe_schedule,
    "1f1b": one_f_one_b_schedule,
    "interleaved": interleaved_1f1b_schedule,
    "zb-h1": zb_h1_schedule,
}


def max_in_flight(steps: Sequence[Step]) -> int:
    """Most (micro-batch, chunk) pairs whose forward ran and whose backward has not
    finished (``B``, or ``W`` for a split backward), at any point of one rank's steps."""
    live = peak = 0
    for st in steps:
        live += 1 if st.kind == "F" else -1 if st.kind in ("B", "W") else 0
        peak = max(peak, live)
    return peak


def theoretical_bubble(n_stages: int, n_micro: int, n_chunks: int = 1) -> float:
    """``(p - 1) / (v*m + p - 1)``: the idle share of GPipe and 1F1B (``v = 1``) and of
    interleaved 1F1B (``v`` chunks, ``p`` dividing ``m``) with uniform stages, free comms."""
    return (n_stages - 1) / (n_chunks * n_micro + n_stages - 1)
