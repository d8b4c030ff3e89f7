"""``benchmarks/bench_in_process.py`` stays runnable and reports what it claims. Its times
are not checked: a benchmark, not a timed test."""

from __future__ import annotations

import statistics

from _shared import benchmark_json


def test_bench_in_process_pairs_every_case() -> None:
    rows = benchmark_json(
        "bench_in_process.py", "--rounds", "2", "--world", "2", "--examples", "3", timeout=300
    )
    assert [r["case"] for r in rows] == ["check_adjoint", "hypothesis", "assert_matches_serial"]
    for r in rows:
        assert len(r["in_process_s"]) == len(r["processes_s"]) == 2
        assert min(r["in_process_s"]) > 0 and min(r["processes_s"]) > 0
        pairs = [p / q for p, q in zip(r["processes_s"], r["in_process_s"])]
        assert r["ratio"] == statistics.median(pairs)
