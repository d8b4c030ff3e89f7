"""``benchmarks/bench_pipeline.py`` stays runnable and reports what it claims.

A tiny model (width 32, 2 ranks, 2 micro-batches, 2 rounds) in a subprocess; the checks
are on what does not depend on timing: equal gradients to torch.distributed.pipelining,
the textbook theory, and that the replayed bubble (free communication) is a bubble.
"""

from __future__ import annotations

import pytest
from _shared import benchmark_json


def test_bench_pipeline_reports_every_column() -> None:
    args = ("--width", "32", "--depth", "4", "--batch", "8", "--micro", "2", "--rounds", "2")
    rows = benchmark_json("bench_pipeline.py", *args, "--schedules", "1f1b", "zb-h1", timeout=300)
    assert [(r["p"], r["m"], r["schedule"]) for r in rows] == [(2, 2, "1f1b"), (2, 2, "zb-h1")]
    assert rows[0]["theory"] == pytest.approx(1 / 3)  # (p-1)/(m+p-1)
    for r in rows:
        assert r["torch_error"] is None and r["grad_diff"] is not None and r["grad_diff"] < 1e-5
        assert 0.0 <= r["replay"] < 1.0 and 0.0 <= r["bubble"] < 1.0
        assert r["ms_per_step"] > 0 and r["vs_torch"] > 0
        assert len(r["peak_bytes"]) == 2


def test_bench_pipeline_runs_the_v_schedules_and_placed_w_against_torch() -> None:
    args = ("--width", "32", "--depth", "4", "--batch", "8", "--micro", "4", "--rounds", "2")
    rows = benchmark_json(
        "bench_pipeline.py", *args, "--schedules", "zb-h1-placed", "zbv", "dualpipev", timeout=300
    )
    assert [r["schedule"] for r in rows] == ["zb-h1-placed", "zbv", "dualpipev"]
    for r in rows:
        # same gradients as torch's ScheduleZBVZeroBubble / ScheduleDualPipeV / ZB class
        assert r["torch_error"] is None and r["grad_diff"] is not None and r["grad_diff"] < 1e-5
        assert 0.0 <= r["theory"] < 1.0 and 0.0 <= r["replay"] < 1.0 and 0.0 <= r["bubble"] < 1.0
        assert r["calls"] > 0 and len(r["peak_bytes"]) == 2
