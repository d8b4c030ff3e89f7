"""``benchmarks/bench_world1.py`` stays runnable and reports what it claims (on gloo here;
on a GPU machine it picks nccl). Its times are not checked: a benchmark, not a timed test."""

from __future__ import annotations

import pytest
from _shared import benchmark_json


def test_bench_world1_times_every_implementation() -> None:
    rows = benchmark_json(
        "bench_world1.py", "--cpu", "--ops", "all_reduce", "all_gather", "--calls", "70", timeout=300
    )
    assert [r["op"] for r in rows] == ["all_reduce", "all_gather"]
    for r in rows:
        assert r["device"] == "cpu" and r["nbytes"] == 16384
        for impl in ("raw", "floor", "torch.distributed.nn", "diffcomm"):
            assert r[f"{impl}_us"] > 0
        assert r["diffcomm_vs_floor"] == pytest.approx(r["diffcomm_us"] / r["floor_us"])
        assert r["nn_vs_floor"] == pytest.approx(r["torch.distributed.nn_us"] / r["floor_us"])
