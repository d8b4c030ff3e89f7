"""``benchmarks/bench_scaling.py`` runs at a single world size: its growth-exponent table
divided by log(1) = 0 (``--worlds 2`` stopped with a ZeroDivisionError after the table).
Checked on made-up rows: nothing measured, no process group."""

from __future__ import annotations

import sys

from _shared import BENCHMARKS

sys.path.insert(0, str(BENCHMARKS))

from bench_scaling import growth_report


def _row(world: int, lines: int) -> dict:
    return {
        "op": "all_reduce",
        "world": world,
        "expected": "1",
        "lines": lines,
        "py_bytes": 10,
        "cpu_us": 5.0,
    }


def test_one_world_size_prints_no_growth_exponent() -> None:
    assert growth_report([_row(2, 100)]) == []


def test_two_world_sizes_print_the_slope() -> None:
    out = growth_report([_row(2, 100), _row(8, 400)])
    assert len(out) == 2 and out[1].split()[-3:] == ["1.00", "0.00", "0.00"]
