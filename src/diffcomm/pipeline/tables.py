"""Schedule tables in torch.distributed.pipelining's format: per-rank action lists, CSV.

torch writes a schedule (``PipelineScheduleMulti._dump_csv(..., format="compute_only")``,
read back by ``_load_csv``) as one CSV row per rank, one action per cell, each action as
``_Action.__repr__`` prints it: ``{stage}{kind}{micro}`` with the *global* stage index
(``2F0``, ``3I1``, ``0W3``, ``1B2``), an overlapped step as
``({forward};{backward})OVERLAP_F_B``, and non-compute actions (``0REDUCE_GRAD``,
``UNSHARD``, ``SEND_F``...) where its lowering passes add them. :func:`to_actions` /
:func:`dump_csv` write diffcomm schedules that way; :func:`from_actions` /
:func:`load_csv` read torch's (compute actions only; the rest is how torch runs them,
diffcomm's runner does its own communication), inferring the placement from which
stages each rank holds.
"""

from __future__ import annotations

import csv
import os
import re
from collections.abc import Sequence

from ..backend import args as A
from .schedules import Overlap, Step, expand_steps, stage_owner, virtual_stage

__all__ = ["to_actions", "from_actions", "dump_csv", "load_csv", "same_actions"]

_ACTION = re.compile(r"^(\d+)(F|I|B|W)(\d+)$")
_OVERLAP = re.compile(r"^\((.*)\)OVERLAP_F_B$")
_OTHER = re.compile(r"^\d*(UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)\d*$")


def _action(st: Step, rank: int, p: int, placement: str) -> str:
    return f"{virtual_stage(rank, st.chunk, p, placement)}{st.kind}{st.micro}"


def to_actions(schedule: Sequence[Sequence[Step | Overlap]], placement: str = "loop") -> list[list[str]]:
    """Every rank's steps as torch's action strings (global stage indices).

    Args:
        schedule: one list of :class:`Step` / :class:`Overlap` per rank.
        placement: ``"loop"`` or ``"v"`` (how chunks map to global stages).

    Returns:
        One list of strings per rank, e.g. ``[["0F0", "0F1", "0B0", "0B1"], ...]``.
    """
    if placement not in ("loop", "v"):
        raise A.arg_error("to_actions", "placement", "'loop' or 'v'", placement)
    p = len(schedule)
    out = []
    for r, steps in enumerate(schedule):
        row = []
        for st in steps:
            if isinstance(st, Overlap):
                f, b = _action(st.forward, r, p, placement), _action(st.backward, r, p, placement)
                row.append(f"({f};{b})OVERLAP_F_B")
            else:
                row.append(_action(st, r, p, placement))
        out.append(row)
    return out


def _parse(cell: str, where: str) -> list[tuple[int, str, int]]:
    cell = cell.strip()
    m = _OVERLAP.match(cell)
    if m:
        parts = [_parse(sub, where) for sub in m.group(1).split(";")]
        if len(parts) != 2 or any(len(x) != 1 for x in parts):
            raise A.arg_error(
                "from_actions", "actions", "an OVERLAP_F_B of two actions", f"{where}: {cell!r}"
            )
        return [parts[0][0], parts[1][0]]
    m = _ACTION.match(cell)
    if m is None:
        raise A.arg_error(
            "from_actions", "actions", "actions like 2F0, 3I1, (0F3;3B1)OVERLAP_F_B", f"{where}: {cell!r}"
        )
    return [(int(m.group(1)), m.group(2), int(m.group(3)))]


def from_actions(rows: Sequence[Sequence[str]]) -> tuple[list[list[Step | Overlap]], int, str]:
    """torch's per-rank action strings as a diffcomm schedule.

    Compute actions (``F``, ``I``, ``W``, ``B``, ``OVERLAP_F_B``) are kept; empty cells
    and communication/sharding actions are dropped. The placement is inferred: rank ``r``
    holding stages ``r, r + p, ...`` is ``"loop"``, ``r`` and ``2p - 1 - r`` is ``"v"``.

    Args:
        rows: one list of action strings per rank.

    Returns:
        ``(schedule, n_chunks, placement)``, ready for
        :func:`~diffcomm.pipeline.check_schedule`.
    """
    p = len(rows)
    parsed: list[list[list[tuple[int, str, int]]]] = []
    stages: set[int] = set()
    for r, row in enumerate(rows):
        mine = []
        for i, cell in enumerate(row):
            if cell is None or not str(cell).strip() or _OTHER.match(str(cell).strip()):
                continue
            acts = _parse(str(cell), f"rank {r} cell {i}")
            stages.update(a[0] for a in acts)
            mine.append(acts)
        parsed.append(mine)
    if p == 0 or not stages:
        raise A.arg_error("from_actions", "actions", "one row of compute actions per rank", rows)
    n_total = max(stages) + 1
    if n_total % p:
        raise A.arg_error("from_actions", "actions", f"a multiple of {p} stages", n_total)
    v = n_total // p
    placement = "loop"
    for cand in ("loop", "v"):
        if cand == "v" and v != 2:
            continue
        ok = all(
            stage_owner(a[0], p, cand)[0] == r for r, mine in enumerate(parsed) for acts in mine for a in acts
        )
        if ok:
            placement = cand
            break
    else:
        raise A.arg_error("from_actions", "actions", "a loop or V placement of stages on ranks", rows)
    out: list[list[Step | Overlap]] = []
    for mine in parsed:
        steps: list[Step | Overlap] = []
        for acts in mine:
            conv = [Step(k, mb, stage_owner(s, p, placement)[1]) for s, k, mb in acts]  # type: ignore[arg-type]
            steps.append(conv[0] if len(conv) == 1 else Overlap(conv[0], conv[1]))
        out.append(steps)
    return out, v, placement


def dump_csv(
    schedule: Sequence[Sequence[Step | Overlap]], path: str | os.PathLike[str], placement: str = "loop"
) -> None:
    """Write ``schedule`` as torch's compute-only CSV (one row per rank)."""
    rows = to_actions(schedule, placement)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        for row in rows:
            writer.writerow(row)


def load_csv(path: str | os.PathLike[str]) -> tuple[list[list[Step | Overlap]], int, str]:
    """Read a torch schedule CSV (as ``_dump_csv`` writes it): see :func:`from_actions`."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return from_actions(rows)


def same_actions(a: Sequence[Sequence[Step | Overlap]], b: Sequence[Sequence[Step | Overlap]]) -> bool:
    """Whether every rank runs the same steps in both schedules (an :class:`Overlap`
    counts as its two steps; order and fusion aside)."""
    return len(a) == len(b) and all(
        sorted(map(str, expand_steps(x))) == sorted(map(str, expand_steps(y))) for x, y in zip(a, b)
    )
