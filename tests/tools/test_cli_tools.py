"""`python -m diffcomm check` and `bench`: real runs on local ranks.

One run of each command goes through a fresh ``python -m diffcomm`` (the entry point, a
world of its own); the others call :func:`diffcomm.tools.cli.main` in this process on the
session's shared worlds (:func:`_on_shared_worlds`): the same command, argument parsing,
cases, measurements and output, without a Python, a torch import and a world started per
test.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from diffcomm import LocalWorld
from diffcomm.testing.cases import Case
from diffcomm.tools import bench, cli, commands
from diffcomm.tools.commands import _merge, parse_size


def _run(*args: str, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "diffcomm", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )


def _on_shared_worlds(
    local_worlds: Callable[..., LocalWorld], monkeypatch: pytest.MonkeyPatch, started: list[int]
) -> None:
    """Make ``check`` and ``bench`` run on the session's shared world of each size (left
    running: the command's ``with`` block does not close it) instead of starting their own;
    ``started`` records the world sizes the command asked for."""

    @contextlib.contextmanager
    def shared(args: object, world: int, timeout: float) -> Iterator[LocalWorld]:
        started.append(world)
        yield local_worlds(world)

    monkeypatch.setattr(commands, "local_world", shared)


def _main_json(
    local_worlds: Callable[..., LocalWorld],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    *argv: str,
) -> object:
    """``python -m diffcomm *argv`` (with ``--json``) run in this process on the shared
    worlds: exit code 0, and the JSON it printed."""
    started: list[int] = []
    _on_shared_worlds(local_worlds, monkeypatch, started)
    code = cli.main([*argv, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert started, "the command did not run on the shared worlds"
    return json.loads(out)


def test_check_passes_and_prints_the_table() -> None:
    """At 80 columns: one line per op, nothing cut or wrapped; per-case detail is --json's."""
    p = _run("check", "-n", "3", "--ops", "all_gather", "all_to_all", env={"COLUMNS": "80"})
    assert p.returncode == 0, p.stdout + p.stderr
    assert "all checks passed" in p.stdout
    lines = p.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, p.stdout
    header = next(line for line in lines if line.startswith("op "))
    assert header.split() == ["op", "cases", "forward", "adjoint", "grad", "2nd-order", "ok"]
    for op in ("all_gather", "all_to_all"):
        (row,) = [line.split() for line in lines if line.startswith(op + " ")]
        assert row[0] == op and int(row[1]) >= 2 and row[-1] == "✓"
        assert all(float(e) <= 1e-6 for e in row[2:6])
    assert "float64 [" not in p.stdout  # case labels (dtype, shape, kwargs) only in --json


def test_check_json_lists_every_case(local_worlds, monkeypatch, capsys) -> None:
    data = _main_json(local_worlds, monkeypatch, capsys, "check", "-n", "2", "--ops", "reduce")
    assert data["ok"] and data["failures"] == 0
    assert {c["op"] for c in data["cases"]} == {"reduce"} and len(data["cases"]) == 4
    assert all(c["grad_err"] <= 1e-10 for c in data["cases"])


def test_check_covers_the_coalesced_ops(local_worlds, monkeypatch, capsys) -> None:
    ops = ["all_reduce_coalesced", "broadcast_coalesced", "reduce_coalesced"]
    ops += ["all_gather_coalesced", "reduce_scatter_coalesced"]
    data = _main_json(local_worlds, monkeypatch, capsys, "check", "-n", "3", "--ops", *ops)
    assert data["ok"] and {c["op"] for c in data["cases"]} == set(ops)
    linear = [c for c in data["cases"] if "max" not in c["case"] and "min" not in c["case"]]
    linear = [c for c in linear if "product" not in c["case"]]
    assert all(c["adjoint_err"] is not None and c["adjoint_err"] <= 2e-5 for c in linear)  # float32 tol


def test_check_covers_point_to_point_and_the_mappings(local_worlds, monkeypatch, capsys) -> None:
    ops = ["send", "sendrecv", "shift", "ppermute", "copy_to_region", "gather_from_region"]
    ops += ["reduce_scatter_to_sequence", "all_to_all_region"]
    data = _main_json(local_worlds, monkeypatch, capsys, "check", "-n", "3", "--ops", *ops)
    want = {"send/recv", *ops[1:]}  # send and recv are checked together
    assert data["ok"] and {c["op"] for c in data["cases"]} == want
    for c in data["cases"]:  # forward, the gradient and the adjoint test, on every case
        assert c["forward_err"] <= 1e-10 and c["grad_err"] <= 1e-10, c
        assert c["adjoint_err"] is not None and c["adjoint_err"] <= 1e-10, c


def _bench_text(rows: list[bench.BenchRow], world: int) -> str:
    """What ``bench`` prints for ``rows`` (table, legend, verdict) at 100 columns."""
    from rich.console import Console

    from diffcomm.tools.commands import bench_legend, bench_table

    console = Console(width=100, record=True, file=open(os.devnull, "w"))
    console.print(bench_table(rows, world))
    console.print(bench_legend(rows))
    for paragraph in bench.slower_than_nn_lines(rows):
        console.print(paragraph, soft_wrap=True)
    return console.export_text()


def test_the_bench_table_fits_100_columns_and_the_legend_names_every_row() -> None:
    impls = ["raw", "floor", "torch.distributed.nn", "funcol", "diffcomm", "diffcomm(sizes=)", bench.CONTROL]
    rows = []
    for op in ("reduce_scatter", "all_to_all"):
        for nbytes in (16 * 1024, 16 * 2**20):
            times = {i: [1e-3 * (1 + k) for k in range(4)] for i in impls}
            rows += bench.rows_from_times(op, nbytes, 4, times)
    text = _bench_text(rows, 4)
    assert max(len(line) for line in text.splitlines()) <= 100, text
    assert "…" not in text and "16MiB" in text and "nn (again)" in text
    legend = " ".join(text.split())
    for name in ("raw:", "floor:", "nn:", "nn (again):", "funcol:", "diffcomm:", "diffcomm(sizes=):"):
        assert f"; {name}" in legend or f" {name} " in legend, name
    assert "world 4: diffcomm was not slower than torch.distributed.nn in any of the 4 cells" in legend
    assert "for scale" in legend and "what noise alone does here." in legend


def test_the_legend_lists_only_the_rows_shown() -> None:
    times = [1e-3, 2e-3, 1e-3]
    rows = bench.rows_from_times("all_reduce", 1024, 2, {"raw": times, "diffcomm": times})
    text = " ".join(_bench_text(rows, 2).split())
    assert "raw: torch.distributed, no autograd" in text and "diffcomm: the public op" in text
    for absent in ("floor:", "nn:", "funcol:", "nn (again)", "sizes=", "x nn", "*:"):
        assert absent not in text, absent


def test_the_verdict_says_slower_where_the_table_shows_diffcomm_slower() -> None:
    """diffcomm 1.5x nn's time in every round of every cell: the x nn column reads 1.50 and
    the words say slower in every cell, in at least 3 of every 4 rounds; where it is
    faster, the words say not slower. Every sentence ends (no "... rounds in 0")."""
    base = [1e-3, 2e-3, 1.5e-3, 1e-3]
    rows = []
    for op in ("all_reduce", "all_gather"):
        for nbytes in (16 * 1024, 2**20):
            nn = [2 * t for t in base]
            cell = {"raw": base, "floor": base, "torch.distributed.nn": nn, "diffcomm": [1.5 * t for t in nn]}
            rows += bench.rows_from_times(op, nbytes, 2, cell)
            cell = {**cell, "diffcomm": [0.5 * t for t in nn]}
            rows += bench.rows_from_times(op, nbytes, 3, cell)
    two = _bench_text([r for r in rows if r.world == 2], 2)
    assert max(len(line) for line in two.splitlines()) <= 100, two
    cells = [
        ln.split()
        for ln in two.splitlines()
        if ln.split()[:3:2] in (["all_reduce", "diffcomm"], ["all_gather", "diffcomm"])
    ]
    assert len(cells) == 4 and all(c[5] == "1.50" for c in cells), two  # the x nn column
    words = " ".join(two.split())
    assert (
        "world 2: diffcomm was slower than torch.distributed.nn in 4 of 4 cells by the median of the "
        "paired rounds (x nn above 1.00: all_reduce 16KiB 1.50, all_reduce 1MiB 1.50, all_gather "
        "16KiB 1.50, all_gather 1MiB 1.50); of these 4 cells, 4 read slower in at least 3 of every 4 "
        "rounds (the bracket's lower end above 1.00)." in words
    )
    assert "*" not in two  # the ms columns agree: nothing marked
    three = " ".join(_bench_text([r for r in rows if r.world == 3], 3).split())
    assert "world 3: diffcomm was not slower than torch.distributed.nn in any of the 4 cells" in three
    assert "slower than torch.distributed.nn in 0" not in three


def test_a_paired_ratio_the_medians_contradict_is_marked() -> None:
    """diffcomm slower than nn in 3 rounds of 4 by a little, much faster in the fourth, and
    nn's slow rounds differ: x nn reads above 1 while diffcomm's median ms is the lower. The
    cell is marked ``*``, the legend and the verdict say to read it as level."""
    nn = [1.0e-3, 1.0e-3, 3.0e-3, 3.0e-3]
    dc = [1.1e-3, 1.1e-3, 3.3e-3, 0.5e-3]  # ratios 1.1, 1.1, 1.1, 0.17: median 1.1; ms 1.1 < 2.0
    rows = bench.rows_from_times(
        "all_reduce", 1024, 2, {"raw": nn, "torch.distributed.nn": nn, "diffcomm": dc}
    )
    row = next(r for r in rows if r.impl == "diffcomm")
    assert bench.above_one(row.ratio_vs_nn) and row.median_ms < rows[1].median_ms
    assert bench.disagrees_with_nn(row, rows)
    text = _bench_text(rows, 2)
    assert "1.10 (" in text and ")*" in text
    words = " ".join(text.split())
    assert "*: the paired ratio and the two rows' median ms disagree" in words
    assert "all_reduce 1KiB 1.10*" in words and "read it as level" in words


def test_a_failing_case_fails_the_row() -> None:
    case = Case("all_reduce", 2, (2,))
    good = {
        "forward_err": 0.0,
        "grad_err": 0.0,
        "adjoint_err": 0.0,
        "double_err": 0.0,
        "tol": 1e-10,
        "input_unchanged": True,
        "no_alias": True,
        "ok": True,
    }
    bad = {**good, "grad_err": 0.5, "ok": False}
    assert _merge(case, 2, [good, good], None, 0.1)["ok"]
    row = _merge(case, 2, [good, bad], None, 0.1)
    assert not row["ok"] and row["grad_err"] == 0.5 and row["forward_ok"]
    crashed = _merge(case, 2, [], "RankError: boom", 0.1)
    assert not crashed["ok"] and not crashed["forward_ok"]


def test_usage_errors_exit_2() -> None:
    assert cli.main(["check", "-n", "0"]) == 2
    assert cli.main(["bench", "--sizes", "lots"]) == 2
    assert cli.main(["bench", "--rounds", "1"]) == 2


def test_parse_size() -> None:
    assert parse_size("16KiB") == 16384 and parse_size("1MiB") == 1 << 20 and parse_size("512") == 512


def test_bench_runs_and_plots(tmp_path: Path, local_worlds, monkeypatch, capsys) -> None:
    out = tmp_path / "bench.png"
    argv = ["bench", "-n", "2", "--ops", "all_gather", "--sizes", "4KiB", "--rounds", "3", "--control"]
    rows = _main_json(local_worlds, monkeypatch, capsys, *argv, "--plot", str(out))
    assert isinstance(rows, list)
    impls = {r["impl"] for r in rows}
    assert {"diffcomm", "raw", "floor", "funcol", "torch.distributed.nn", bench.CONTROL} <= impls
    control = next(r for r in rows if r["impl"] == bench.CONTROL)  # nn timed again, paired against nn
    assert control["ratio_vs_nn"] > 0 and control["ratio_vs_nn_q1"] <= control["ratio_vs_nn"]
    assert all(r["median_ms"] > 0 for r in rows)
    assert [r["ratio_vs_raw"] for r in rows if r["impl"] == "raw"] == [1.0]
    assert [r["ratio_vs_floor"] for r in rows if r["impl"] == "floor"] == [1.0]
    assert out.exists() and out.stat().st_size > 1000


def test_bench_coalesced_reports_every_cell(local_worlds, monkeypatch, capsys) -> None:
    argv = ["bench", "--coalesced", "all_reduce", "all_gather", "-n", "2", "--rounds", "3", "--tensors", "8"]
    data = _main_json(local_worlds, monkeypatch, capsys, *argv)
    assert isinstance(data, dict)
    assert len(data["load_before"]) == 3 and [r["op"] for r in data["rows"]] == ["all_reduce", "all_gather"]
    for r in data["rows"]:
        assert r["world"] == 2 and r["tensors"] == 8 and r["payload_bytes"] == 8 * 4096
        times = ("coalesced_ms", "loop_ms", "flat_ms", "list_floor_ms")
        for key in (*times, "loop_over_coalesced", "coalesced_over_flat", "coalesced_over_floor"):
            q1, med, q3 = r[key]
            assert 0 < q1 <= med <= q3
        assert r["coalesced_peak_x_payload"] > 0
    assert cli.main(["bench", "--coalesced", "gather"]) == 2
