"""Golden tables: diffcomm's schedules against the tables torch.distributed.pipelining
generates for the same (p, m), in torch's own format (per-rank action lists, CSV).

torch's tables come from its visualizer's ``get_schedule_ops`` (the schedule classes'
``pipeline_order``), are written as torch's ``_dump_csv`` writes them (one
``csv.writer`` row of ``_Action`` s per rank), and read with :func:`load_csv`. Each test
checks: torch's table passes diffcomm's validator (or fails it in the one known way),
every rank runs the same actions in both, and the order is identical where it is (the
differences are explained in docs/pipeline.md, "Golden tables").
"""

from __future__ import annotations

import csv
import warnings
from pathlib import Path

import pytest

from diffcomm.pipeline import (
    SCHEDULES,
    ScheduleError,
    Step,
    check_schedule,
    dump_csv,
    expand_steps,
    from_actions,
    load_csv,
    max_in_flight,
    same_actions,
    schedule_placement,
    to_actions,
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    from torch.distributed.pipelining.schedules import _Action

# diffcomm name -> (torch schedule class name, chunks per rank)
PEERS = {
    "gpipe": ("GPipe", 1),
    "1f1b": ("1F1B", 1),
    "interleaved": ("Interleaved1F1B", 2),
    "zb-h1": ("InterleavedZeroBubble", 2),  # torch's ZB-H1 family member; it has none at v = 1
    "zbv": ("ZBVZeroBubble", 2),
    "dualpipev": ("DualPipeV", 2),
}
SHAPES = [(2, 4), (2, 8), (4, 8), (4, 10)]
# where the two orders differ (same actions; both valid): see docs/pipeline.md
REORDERED = {("zb-h1", p, m) for p, m in SHAPES}


def _torch_csv(name: str, p: int, m: int, path: Path) -> Path:
    cls, v = PEERS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ops = get_schedule_ops(cls, p, m, v if v > 1 else None)
    with open(path, "w", newline="") as f:  # as PipelineScheduleMulti._dump_csv writes it
        writer = csv.writer(f)
        for row in ops:
            writer.writerow(["" if a is None else a for a in row])
    return path


@pytest.mark.parametrize(("p", "m"), SHAPES)
@pytest.mark.parametrize("name", list(PEERS))
def test_schedule_matches_torchs_golden_table(name: str, p: int, m: int, tmp_path: Path) -> None:
    v = PEERS[name][1]
    ours = SCHEDULES[name](p, m, v) if v > 1 else SCHEDULES[name](p, m)
    placement = schedule_placement(SCHEDULES[name])
    theirs, v_t, placement_t = load_csv(_torch_csv(name, p, m, tmp_path / "torch.csv"))
    assert (v_t, placement_t) == (v, placement)
    if name == "1f1b":
        # torch's Schedule1F1B._get_pipeline_order numbers the last rank's forwards 1..m
        # (its steady-state counter starts after a warm-up that rank does not have); the
        # validator names it, and with that rank's forwards renumbered the tables agree
        with pytest.raises(ScheduleError, match=rf"got stage {p - 1} step \d+: F{m}"):
            check_schedule(theirs, p, m, v_t, placement_t)
        theirs[p - 1] = [Step("F", st.micro - 1) if st.kind == "F" else st for st in theirs[p - 1]]
    check_schedule(theirs, p, m, v_t, placement_t)
    check_schedule(ours, p, m, v, placement)
    assert same_actions(ours, theirs)
    identical = [list(map(str, s)) for s in ours] == [list(map(str, s)) for s in theirs]
    assert identical == ((name, p, m) not in REORDERED)
    if name == "zb-h1":  # torch's interleaved zero bubble holds fewer activations
        assert max(map(max_in_flight, theirs)) <= max(map(max_in_flight, ours))


@pytest.mark.parametrize("name", list(PEERS))
def test_exported_tables_are_read_by_torch(name: str, tmp_path: Path) -> None:
    p, m = 4, 8
    v = PEERS[name][1]
    ours = SCHEDULES[name](p, m, v) if v > 1 else SCHEDULES[name](p, m)
    placement = schedule_placement(SCHEDULES[name])
    path = tmp_path / "ours.csv"
    dump_csv(ours, path, placement)
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    # torch's parser takes every cell and prints it back the same
    assert [[str(_Action.from_str(c)) for c in row] for row in rows] == to_actions(ours, placement)
    back, v_b, placement_b = load_csv(path)
    assert (back, v_b, placement_b) == (ours, v, placement)
    if name == "dualpipev":
        assert any("OVERLAP_F_B" in c for row in rows for c in row)
        assert all(str(a).startswith(f"{r}") or str(a).startswith(f"{2 * p - 1 - r}") or "(" in str(a)
                   for r, row in enumerate(rows) for a in row)  # fmt: skip


def test_tables_refuse_what_they_cannot_read() -> None:
    with pytest.raises(ValueError, match=r"`actions` must be actions like 2F0.*rank 0 cell 1: 'FX'"):
        from_actions([["0F0", "FX"], ["1F0"]])
    with pytest.raises(ValueError, match="`actions` must be a loop or V placement"):
        from_actions([["1F0"], ["0F0"]])
    with pytest.raises(ValueError, match="`placement` must be 'loop' or 'v'"):
        to_actions([[Step("F", 0)]], "w")
    # communication and sharding actions are not steps: dropped
    sched, v, placement = from_actions(
        [["0F0", "0SEND_F0", "", "0B0", "0REDUCE_GRAD"], ["1RECV_F0", "1F0", "1B0"]]
    )
    assert (sched, v, placement) == ([[Step("F", 0), Step("B", 0)], [Step("F", 0), Step("B", 0)]], 1, "loop")
    assert expand_steps(sched[0]) == sched[0]
