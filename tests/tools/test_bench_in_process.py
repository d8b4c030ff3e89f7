"""``benchmarks/bench_in_process.py`` stays runnable and reports what it claims. Its times
are not checked: a benchmark, not a timed test. Run in this process (its worlds come
from this worker's fork server; no fresh interpreter to import torch again)."""

from __future__ import annotations

import json
import runpy
import statistics
import sys

import pytest
from _shared import BENCHMARKS


def test_bench_in_process_pairs_every_case(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["bench_in_process.py", "--json", "--rounds", "2", "--world", "2", "--examples", "3"]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    runpy.run_path(str(BENCHMARKS / "bench_in_process.py"), run_name="__main__")
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["case"] for r in rows] == ["check_adjoint", "hypothesis", "assert_matches_serial"]
    for r in rows:
        assert len(r["in_process_s"]) == len(r["processes_s"]) == 2
        assert min(r["in_process_s"]) > 0 and min(r["processes_s"]) > 0
        pairs = [p / q for p, q in zip(r["processes_s"], r["in_process_s"])]
        assert r["ratio"] == statistics.median(pairs)
