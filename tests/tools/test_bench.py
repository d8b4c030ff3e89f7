"""The benchmark's non-timing parts: argument checks, the plot extra, paired ratios.

No assertion here depends on how fast anything ran (performance is read from the
benchmark's own output, never asserted in a unit test).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from diffcomm.tools import bench, cli


def test_paired_ratios_are_per_round() -> None:
    # round 2 is slow for both: a ratio of medians would say 2.0, the paired ratio says 2.0 too,
    # but a one-sided slow round must not move the paired median
    impl = [2.0, 20.0, 2.0, 2.0]
    raw = [1.0, 10.0, 1.0, 1.0]
    q1, med, q3 = bench.paired_ratios(impl, raw)
    assert (q1, med, q3) == (2.0, 2.0, 2.0)
    q1, med, q3 = bench.paired_ratios([1.0, 1.0, 1.0, 9.0], [1.0, 1.0, 1.0, 1.0])
    assert med == 1.0 and q1 == 1.0 and q3 == 9.0


def test_paired_ratios_reject_mismatched_rounds() -> None:
    with pytest.raises(ValueError, match="one time per round"):
        bench.paired_ratios([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="positive"):
        bench.paired_ratios([1.0], [0.0])


def test_round_order_is_drawn_per_round_the_same_on_every_rank() -> None:
    """Each round runs every implementation once; the order is a permutation drawn from
    the round's index (so every rank, drawing separately, agrees), and unlike a rotation
    it does not keep who runs right after whom."""
    from diffcomm.tools.bench import round_order

    names = ["raw", "floor", "torch.distributed.nn", "funcol", "diffcomm"]
    orders = [round_order(names, i) for i in range(40)]
    assert all(sorted(o) == sorted(names) for o in orders)
    assert orders == [round_order(list(names), i) for i in range(40)]  # reproducible
    assert len({tuple(o) for o in orders}) > 20
    for k in names:  # each implementation follows several different ones
        before = {o[o.index(k) - 1] for o in orders if o.index(k) > 0}
        assert len(before) >= 3, (k, before)
    assert {o[0] for o in orders} == set(names)  # none always goes first


def test_geomean() -> None:
    assert bench.geomean([1.0, 4.0]) == pytest.approx(2.0)
    assert bench.geomean([1.5]) == pytest.approx(1.5)
    with pytest.raises(ValueError):
        bench.geomean([])


def _cell(op: str, nbytes: int, world: int, factor: dict[str, float]) -> list[bench.BenchRow]:
    raw = [1e-3, 2e-3, 1e-3, 1.5e-3, 1e-3]
    times = {k: [t * f for t in raw] for k, f in factor.items()}
    return bench.rows_from_times(op, nbytes, world, times)


def test_rows_from_times_pairs_against_raw_and_floor() -> None:
    rows = _cell("all_gather", 1 << 20, 2, {"raw": 1.0, "floor": 1.25, "diffcomm": 1.5, "funcol": 2.0})
    by = {r.impl: r for r in rows}
    assert [r.impl for r in rows] == ["raw", "floor", "funcol", "diffcomm"]  # fixed order
    assert by["raw"].ratio_vs_raw == 1.0
    assert by["floor"].ratio_vs_raw == pytest.approx(1.25)
    assert by["diffcomm"].ratio_vs_raw == pytest.approx(1.5)
    assert by["diffcomm"].ratio_vs_floor == pytest.approx(1.2)
    assert by["diffcomm"].ratio_vs_raw_q1 <= by["diffcomm"].ratio_vs_raw <= by["diffcomm"].ratio_vs_raw_q3
    assert by["raw"].median_ms == pytest.approx(1.0)
    no_floor = bench.rows_from_times("all_reduce", 1024, 1, {"raw": [1.0, 1.0, 1.0]})
    assert math.isnan(no_floor[0].ratio_vs_floor)


def test_rows_pair_diffcomm_against_torch_distributed_nn() -> None:
    base = [1e-3, 2e-3, 1e-3, 1.5e-3]
    times = {"raw": base, "torch.distributed.nn": [t * 2 for t in base]}
    # slower than nn in 3 rounds of 4 (by 10%), faster in one: median and q1 above 1
    rows = bench.rows_from_times(
        "all_reduce", 1024, 2, {**times, "diffcomm": [t * 2.2 for t in base[:3]] + [2.7e-3]}
    )
    # slower in 2 of 4 rounds, level in one: the median is above 1, the first quartile is not
    rows += bench.rows_from_times(
        "all_gather", 1024, 2, {**times, "diffcomm": [1.8e-3, 4.0e-3, 2.4e-3, 3.6e-3]}
    )
    rows += bench.rows_from_times("all_reduce", 1024, 4, {**times, "diffcomm": [t * 1.8 for t in base]})
    by = {(r.op, r.world): r for r in rows if r.impl == "diffcomm"}
    assert by[("all_reduce", 2)].ratio_vs_nn == pytest.approx(1.1)
    assert by[("all_reduce", 2)].ratio_vs_nn_q1 == pytest.approx(1.1)
    assert by[("all_gather", 2)].ratio_vs_nn > 1.0 >= by[("all_gather", 2)].ratio_vs_nn_q1
    assert by[("all_reduce", 4)].ratio_vs_nn == pytest.approx(0.9)
    assert bench.slower_than_nn(rows) == {2: (2, 2, 1), 4: (1, 0, 0)}
    assert math.isnan(rows[0].ratio_vs_nn) is False and math.isnan(
        _cell("all_reduce", 1, 1, {"raw": 1.0})[0].ratio_vs_nn
    )
    text = bench.format_rows(rows)
    assert max(len(line) for line in text.splitlines()) <= 100, text
    words = " ".join(text.split())
    assert (
        "world 2: diffcomm was slower than torch.distributed.nn in 2 of 2 cells by the median of the "
        "paired rounds (x nn above 1.00: all_reduce 1KiB 1.10*, all_gather 1KiB 1.10); of these 2 cells, "
        "1 read slower in at least 3 of every 4 rounds" in words
    )
    # all_reduce: slower in 3 rounds of 4, yet its median time (2.45 ms) is below nn's (2.5 ms)
    assert "*: diffcomm's median ms is the lower of the two there: read it as level." in words
    assert "world 4: diffcomm was not slower than torch.distributed.nn in any of the 1 cell" in words
    assert "for scale" not in text  # no control rows, no control line


def test_a_ratio_that_prints_as_1_00_is_not_counted_slower() -> None:
    """The count follows the printed column (two decimals): 1.004 reads level, 1.006 slower."""
    base = [1e-3, 1e-3, 1e-3]
    times = {"raw": base, "torch.distributed.nn": base}
    rows = bench.rows_from_times("all_reduce", 1024, 2, {**times, "diffcomm": [t * 1.004 for t in base]})
    assert bench.slower_than_nn(rows) == {2: (1, 0, 0)}
    rows = bench.rows_from_times("all_reduce", 1024, 2, {**times, "diffcomm": [t * 1.006 for t in base]})
    assert bench.slower_than_nn(rows) == {2: (1, 1, 1)}


def test_control_counts_nn_against_itself() -> None:
    """``control=True`` times torch.distributed.nn twice; the copy is paired against nn
    as diffcomm is, and counted on its own line: how often an equal pair reads slower."""
    base = [1e-3, 2e-3, 1e-3, 1.5e-3]
    nn = [t * 2 for t in base]
    again = [nn[0] * 1.05, nn[1] * 0.9, nn[2] * 1.02, nn[3] * 1.01]  # slower in 3 rounds of 4
    cell = {"raw": base, "torch.distributed.nn": nn, "diffcomm": [t * 0.9 for t in nn], bench.CONTROL: again}
    rows = bench.rows_from_times("all_reduce", 1024, 2, cell)
    rows += bench.rows_from_times("broadcast", 1024, 2, {**cell, bench.CONTROL: [t * 0.95 for t in nn]})
    control = next(r for r in rows if r.impl == bench.CONTROL)
    assert control.ratio_vs_nn == pytest.approx(1.015) and control.ratio_vs_nn_q1 > 1.0
    assert bench.slower_than_nn(rows) == {2: (2, 0, 0)}
    assert bench.slower_than_nn(rows, bench.CONTROL) == {2: (2, 1, 1)}
    verdict, scale = (" ".join(p.split()) for p in bench.slower_than_nn_lines(rows))
    assert verdict == (
        "world 2: diffcomm was not slower than torch.distributed.nn in any of the 2 cells (x nn, the "
        "median of the paired rounds, at most 1.00 in every one)."
    )
    assert scale == (
        "world 2, for scale: torch.distributed.nn timed twice read slower than itself in 1 of 2 cells, "
        "and in 1 of them in at least 3 of every 4 rounds: what noise alone does here."
    )
    assert bench.impl_colour(bench.CONTROL) not in {bench.impl_colour(i) for i in bench.IMPLS}


def test_summarize_geomeans_per_world() -> None:
    rows = _cell("all_reduce", 1024, 2, {"raw": 1.0, "floor": 1.0, "diffcomm": 2.0})
    rows += _cell("all_gather", 1024, 2, {"raw": 1.0, "floor": 2.0, "diffcomm": 2.0, "funcol": 3.0})
    rows += _cell("all_reduce", 1024, 4, {"raw": 1.0, "floor": 1.0, "diffcomm": 1.1})
    s = bench.summarize(rows)
    assert set(s) == {2, 4}
    assert s[2]["diffcomm/raw"] == pytest.approx(2.0)
    assert s[2]["floor/raw"] == pytest.approx(math.sqrt(2.0))
    assert s[2]["diffcomm/floor"] == pytest.approx(math.sqrt(2.0))
    assert s[2]["funcol/raw"] == pytest.approx(3.0) and s[2]["funcol/raw cells"] == 1
    assert s[4]["diffcomm/floor"] == pytest.approx(1.1) and "funcol/raw" not in s[4]
    assert "raw/raw" not in s[2]
    text = bench.format_rows(rows)
    assert "geomean world 2" in text and "diffcomm/floor 1.414" in text


def test_defaults_and_colours() -> None:
    assert len(bench.DEFAULT_SIZES) >= 5
    colours = [bench.impl_colour(i) for i in bench.IMPLS]
    assert len(set(colours)) == len(colours)  # one colour per implementation, fixed by name
    assert bench.impl_colour("diffcomm") == bench.impl_colour("diffcomm")


def test_bench_rejects_bad_arguments_before_measuring() -> None:
    assert cli.main(["bench", "--sizes", "lots"]) == 2
    assert cli.main(["bench", "--rounds", "2"]) == 2
    assert cli.main(["bench", "-n", "0"]) == 2
    assert cli.main(["bench", "--ops", "allreduce"]) == 2  # argparse lists the choices
    with pytest.raises(ValueError, match="unknown op"):
        bench.run_benchmark(object(), ops=["allreduce"])
    with pytest.raises(ValueError, match="rounds"):
        bench.run_benchmark(object(), ops=["all_reduce"], rounds=1)


def test_plot_without_matplotlib_fails_before_measuring(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import diffcomm.runtime.world

    class NoWorld:
        def __init__(self, *a: object, **k: object) -> None:
            raise AssertionError("bench started measuring although --plot cannot work")

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    monkeypatch.setattr(diffcomm.runtime.world, "LocalWorld", NoWorld)
    out = tmp_path / "b.png"
    assert cli.main(["bench", "-n", "1", "--sizes", "4KiB", "--rounds", "3", "--plot", str(out)]) == 2
    text = capsys.readouterr().err  # a usage error: one line on stderr
    assert 'pip install "diffcomm[plot]"' in text and text.count("\n") == 1
    assert not out.exists()
    assert bench.plot_missing() is not None
    with pytest.raises(ImportError, match=r"diffcomm\[plot\]"):
        bench.plot_rows([], str(out))


def test_plot_has_title_with_world_and_machine(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    rows = []
    for n in bench.DEFAULT_SIZES:
        rows += _cell("all_reduce", n, 2, {"raw": 1.0, "floor": 1.2, "diffcomm": 1.3})
    out = tmp_path / "b.png"
    bench.plot_rows(rows, str(out))
    assert out.stat().st_size > 1000
    assert "cores" in bench.machine_label()


def test_plot_title_sizes_and_one_colour_per_implementation() -> None:
    """Titled with worlds, backend and machine; every line has all default sizes; an
    implementation has the same colour in every panel."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    rows = []
    for w in (2, 3):
        for op in ("all_reduce", "all_gather"):
            for n in bench.DEFAULT_SIZES:
                impls = {"raw": 1.0, "floor": 1.2, "diffcomm": 1.3}
                if op == "all_gather":  # a panel without funcol must not shift the colours
                    impls["torch.distributed.nn"] = 1.5
                else:
                    impls["funcol"] = 1.4
                rows += _cell(op, n, w, impls)
    fig = bench.plot_figure(rows, backend="gloo")
    try:
        title = fig._suptitle.get_text()
        assert "world 2, 3 (gloo)" in title and bench.machine_label() in title
        colours: dict[str, set[str]] = {}
        axes = fig.get_axes()
        assert len(axes) == 4
        for ax in axes:
            for line in ax.get_lines():
                assert len(line.get_xdata()) == len(bench.DEFAULT_SIZES) >= 5
                colours.setdefault(line.get_label(), set()).add(line.get_color())
        assert set(colours) == {"raw", "floor", "diffcomm", "funcol", "torch.distributed.nn"}
        assert all(len(c) == 1 for c in colours.values()), colours
        assert len({next(iter(c)) for c in colours.values()}) == len(colours)
    finally:
        plt.close(fig)
