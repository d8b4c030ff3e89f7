"""The schedule validator: every send has its receive, and no rank waits in a cycle.

:class:`~diffcomm.pipeline.PipelineRunner` runs :func:`check_schedule` on every schedule
before it communicates, so a wrong schedule (a hand-written one, or a bug in a generator)
is a :class:`ScheduleError` naming the stage and the step, never a hang.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..backend import args as A
from .schedules import Overlap, Step, halves, makes, needs, stage_owner, walk

__all__ = ["ScheduleError", "check_schedule"]


class ScheduleError(ValueError):
    """A pipeline schedule that cannot run: a step missing, repeated or out of order, or
    a set of ranks that would wait for each other forever. The message names the stage
    (rank) and the step."""


def _err(expected: str, got: object) -> ScheduleError:
    return A.arg_error("check_schedule", "schedule", expected, got, ScheduleError)


def check_schedule(
    schedule: Sequence[Sequence[Step | Overlap]],
    n_stages: int,
    n_micro: int,
    n_chunks: int = 1,
    placement: str = "loop",
) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` runs to the end on every rank.

    Checked, in this order:

    1. shape: ``n_stages`` lists of :class:`Step` (or :class:`Overlap` of an ``F`` and a
       ``B``/``I``, checked as the two steps in that order) with ``micro`` in ``[0,
       n_micro)`` and ``chunk`` in ``[0, n_chunks)`` (an ``Overlap`` starts when what
       both halves need is there and sends both outputs at its end); with ``placement="v"`` exactly two
       chunks per rank (rank ``r`` holds stages ``r`` and ``2p - 1 - r``: an even number
       of virtual stages);
    2. every send has its receive: on every rank, each (micro-batch, chunk) has exactly
       one ``F`` and either one ``B`` or one ``I`` and one ``W``, in the order ``F`` before
       ``B`` (``F``, ``I``, ``W``); and each chunk's forwards run in micro-batch order, the
       order activations travel in between two virtual stages (gradients carry sequence
       numbers, so backwards may run in any order);
    3. no deadlock: the ranks are simulated step by step — sends never block (diffcomm's
       sends are asynchronous), an ``F`` waits for the previous virtual stage's ``F`` of
       the same micro-batch, an ``I``/``B`` for the next virtual stage's ``I``/``B`` — and
       if they get stuck, the error names the first waiting step of each stuck rank and
       what it waits for (the cycle).

    Args:
        schedule: one list of steps per rank.
        n_stages: number of ranks.
        n_micro: number of micro-batches.
        n_chunks: virtual stages per rank.
        placement: ``"loop"`` (rank ``r`` holds virtual stages ``r, r + p, ...``) or
            ``"v"`` (rank ``r`` holds ``r`` and ``2p - 1 - r``).

    Raises:
        ScheduleError: (a ``ValueError``) naming the stage and the step.
    """
    p, v = n_stages, n_chunks
    if placement not in ("loop", "v"):
        raise A.arg_error("check_schedule", "placement", "'loop' or 'v'", placement, ScheduleError)
    if not isinstance(schedule, Sequence) or len(schedule) != p:
        raise _err(f"{p} per-stage lists", len(schedule) if isinstance(schedule, Sequence) else schedule)
    flat: list[list[Step]] = []
    for s, steps in enumerate(schedule):
        if placement == "v" and (v != 2 or p < 2):
            where = f"stage {s} step 0 ({steps[0]})" if steps else f"stage {s}"
            raise _err(
                "a V placement with exactly 2 chunks per rank on >= 2 ranks (rank r holds stages r "
                "and 2p-1-r: an even number of virtual stages)",
                f"{where}: {p} ranks x {v} chunks = {p * v} virtual stages",
            )
        mine: list[Step] = []
        where_at: list[int] = []  # each part's step index in the rank's list
        for i, st in enumerate(steps):
            parts = [st.forward, st.backward] if isinstance(st, Overlap) else [st]
            if isinstance(st, Overlap) and (st.forward.kind != "F" or st.backward.kind not in ("B", "I")):
                raise _err("an Overlap of an F and a B or I", f"stage {s} step {i}: {st!r}")
            for part in parts:
                if (
                    not isinstance(part, Step)
                    or part.kind not in ("F", "B", "I", "W")
                    or not isinstance(part.micro, int)
                    or not 0 <= part.micro < n_micro
                    or not isinstance(part.chunk, int)
                    or not 0 <= part.chunk < v
                ):
                    raise _err(
                        f"Steps F/B/I/W with micro in [0, {n_micro}) and chunk in [0, {v})",
                        f"stage {s} step {i}: {st!r}",
                    )
            mine += parts
            where_at += [i] * len(parts)
        for c in range(v):
            _check_chunk(s, c, [(where_at[j], st) for j, st in enumerate(mine) if st.chunk == c], n_micro)
        flat.append(mine)
    _check_no_deadlock(schedule, p, v, placement)


def _check_chunk(s: int, c: int, steps: list[tuple[int, Step]], n_micro: int) -> None:
    where = f"stage {s}" + (f" chunk {c}" if c else "")
    fs = [st.micro for _, st in steps if st.kind == "F"]
    if fs != list(range(n_micro)):
        raise _err("forwards F0..F(m-1) in order", f"{where}: {fs}")
    pos: dict[tuple[str, int], int] = {}
    for i, st in steps:
        if (st.kind, st.micro) in pos:
            raise _err("each step once", f"{where}: {st} twice (steps {pos[(st.kind, st.micro)]} and {i})")
        pos[(st.kind, st.micro)] = i
    for m in range(n_micro):
        has_b, has_i, has_w = (("B", m) in pos), (("I", m) in pos), (("W", m) in pos)
        if not (has_b and not has_i and not has_w) and not (has_i and has_w and not has_b):
            got = [k + str(m) for k in "BIW" if (k, m) in pos] or "none"
            at = max(pos.get((k, m), -1) for k in "FBIW")
            raise _err(
                f"one backward per micro-batch (B, or I and W); micro-batch {m}",
                f"{where}: {got} (its last step at step {at})",
            )
        first = "B" if has_b else "I"
        if pos[(first, m)] < pos[("F", m)]:
            raise _err(
                f"each F before its {first}",
                f"{where}: {first}{m} first (step {pos[(first, m)]}; F{m} at step {pos[('F', m)]})",
            )
        if has_i and pos[("W", m)] < pos[("I", m)]:
            raise _err(
                "each I before its W",
                f"{where}: W{m} first (step {pos[('W', m)]}; I{m} at step {pos[('I', m)]})",
            )


def _check_no_deadlock(schedule: Sequence[Sequence[Step | Overlap]], p: int, v: int, placement: str) -> None:
    """Simulate the ranks; an :class:`Overlap` is one step: it starts when what both its
    halves need is there, and what both make leaves at its end (torch's ``OVERLAP_F_B``;
    the runner may run the backward between the forward's phases)."""
    last = p * v - 1
    done: set[tuple[str, int, int]] = set()  # ("F" | "G", virtual stage, micro); G: gradient sent

    def run(r: int, st: Step | Overlap, _: Any) -> None:
        for x in halves(st):
            out = makes(r, x, p, placement)
            if out is not None:
                done.add(out)

    pc = walk(schedule, p, last, done, run, placement)
    stuck = [r for r in range(p) if pc[r] < len(schedule[r])]
    if not stuck:
        return
    lines = []
    for r in stuck:
        st = schedule[r][pc[r]]
        dep = next(
            d
            for d in (needs(r, x, p, last, placement) for x in halves(st))
            if d is not None and d not in done
        )
        what, g, m = dep
        src = stage_owner(g, p, placement)[0]
        lines.append(
            f"stage {r} step {pc[r]} ({st}) waits for the "
            + (f"activation F{m} of virtual stage {g} (rank {src})" if what == "F"
               else f"gradient of micro-batch {m} from virtual stage {g} (rank {src})")
        )  # fmt: skip
    raise _err("a schedule without a wait cycle (deadlock-free)", "a deadlock: " + "; ".join(lines))
