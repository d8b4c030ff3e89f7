"""``benchmarks/bench_in_process.py`` stays runnable and reports what it claims. Its times
are not checked: a benchmark, not a timed test. Run in this process (its worlds come
from this worker's fork server; no fresh interpreter to import torch again)."""

from __future__ import annotations

import statistics

import pytest
from _shared import benchmark_json_here


def test_bench_in_process_pairs_every_case(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    args = ("--rounds", "2", "--world", "2", "--examples", "3")
    rows = benchmark_json_here("bench_in_process.py", *args, monkeypatch=monkeypatch, capsys=capsys)
    assert [r["case"] for r in rows] == ["check_adjoint", "hypothesis", "assert_matches_serial"]
    for r in rows:
        assert len(r["in_process_s"]) == len(r["processes_s"]) == 2
        assert min(r["in_process_s"]) > 0 and min(r["processes_s"]) > 0
        pairs = [p / q for p, q in zip(r["processes_s"], r["in_process_s"])]
        assert r["ratio"] == statistics.median(pairs)
