"""``benchmarks/bench_pipeline.py`` stays runnable and reports what it claims.

A tiny model (width 32, 2 ranks, 2 micro-batches, 2 rounds), run as ``__main__`` in the
test's process (its worlds from the worker's fork server); the checks
are on what does not depend on timing: equal gradients to torch.distributed.pipelining,
the textbook theory, and that the replayed bubble (free communication) is a bubble. The
stage balancing (the sized model, its cost model and the calibration loop) is checked in
this process on counted multiply-adds and synthetic step times.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
from types import ModuleType
from typing import Any

import pytest
from _shared import BENCHMARKS, benchmark_json_here
from torch import nn


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_pipeline", BENCHMARKS / "bench_pipeline.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _stage_macs(bench: ModuleType, width: int, depth: int, widths: list[int]) -> list[int]:
    """Multiply-adds of F + I + W per row of every stage of the sized model, counted from
    its Linear layers (three products each; stage 0's first Linear has no input gradient)."""
    parts = bench.partition(bench.make_model(width, depth, widths), len(widths))
    out = []
    for g, part in enumerate(parts):
        lins = [mod for mod in part.modules() if isinstance(mod, nn.Linear)]
        macs = sum(3 * lin.in_features * lin.out_features for lin in lins)
        out.append(macs - (lins[0].in_features * lins[0].out_features if g == 0 else 0))
    return out


@pytest.mark.parametrize("depth", [8, 16])
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("layout", ["plain", "loop", "v"])
def test_cost_model_widths_give_every_rank_the_same_multiply_adds(layout: str, p: int, depth: int) -> None:
    bench = _bench()
    widths = bench._model_widths(1024, depth, p, layout)
    stage = _stage_macs(bench, 1024, depth, widths)
    per_rank = [sum(stage[g] for g in bench._rank_stages(r, p, layout)) for r in range(p)]
    assert max(per_rank) / min(per_rank) - 1 < 0.01, (widths, per_rank)
    # without the sizing, stage 0's missing input gradient leaves rank 0 light
    even = _stage_macs(bench, 1024, depth, [512] * len(widths))
    even_rank = [sum(even[g] for g in bench._rank_stages(r, p, layout)) for r in range(p)]
    assert max(even_rank) / min(even_rank) - 1 > 0.02


class _SyntheticWorld:
    """Stands in for a LocalWorld running ``_rank_profile``: stage ``g``'s F + I + W per
    micro-batch is its multiply-adds at its rank's ``speed[r]``, plus a fixed ``extra[r]``
    (the loss, the runtime) on rank ``r``'s last stage; split 1 : 1 : 1 into F, I, W."""

    def __init__(self, bench: ModuleType, p: int, speed: list[float], extra: list[float]) -> None:
        self.bench, self.p, self.speed, self.extra = bench, p, speed, extra
        self.calls = 0

    def stages(self, width: int, depth: int, layout: str, widths: list[int]) -> dict[int, float]:
        """Every virtual stage's F + I + W seconds per micro-batch."""
        macs = _stage_macs(self.bench, width, depth, widths)
        out = {}
        for r in range(self.p):
            mine = self.bench._rank_stages(r, self.p, layout)
            for g in mine:
                out[g] = self.speed[r] * macs[g] * 1e-9 + (self.extra[r] if g == mine[-1] else 0.0)
        return out

    def t(self, width: int, depth: int, layout: str, widths: list[int]) -> list[float]:
        """Every rank's F + I + W seconds per micro-batch."""
        stage = self.stages(width, depth, layout, widths)
        return [sum(stage[g] for g in self.bench._rank_stages(r, self.p, layout)) for r in range(self.p)]

    def run(self, fn: Any, width: int, depth: int, batch: int, m: int, layout: str, widths: list[int],
            *rest: Any) -> list[dict[str, Any]]:  # fmt: skip
        assert fn is self.bench._rank_profile
        self.calls += 1
        stage = self.stages(width, depth, layout, widths)
        return [
            {
                "total": [x / 3] * 3,
                "stages": {g: stage[g] for g in self.bench._rank_stages(r, self.p, layout)},
            }
            for r, x in enumerate(self.t(width, depth, layout, widths))
        ]


@pytest.mark.parametrize("layout", ["plain", "loop", "v"])
@pytest.mark.parametrize("p", [2, 4])
def test_calibration_equalises_ranks_whose_speed_and_fixed_costs_differ(layout: str, p: int) -> None:
    bench = _bench()
    speed = [1.0 + 0.15 * r for r in range(p)]
    extra = [0.0] * (p - 1) + [0.002]  # e.g. the loss on the last rank
    world = _SyntheticWorld(bench, p, speed, extra)
    args = argparse.Namespace(width=1024, depth=8, batch=512, balance_iters=8, balance_steps=1,
                              balance_tol=0.01, pin=False)  # fmt: skip
    start = world.t(1024, 8, layout, bench._model_widths(1024, 8, p, layout))
    assert max(start) / min(start) - 1 > 0.1  # the cost model alone does not know the speeds
    widths, fiw = bench._calibrate(world, args, p, 8, layout)
    t = world.t(1024, 8, layout, widths)
    assert max(t) / min(t) - 1 < 0.01, (widths, t)
    assert [sum(x) for x in fiw] == pytest.approx(t)  # the profile returned is that of `widths`
    assert world.calls < args.balance_iters  # stopped at the tolerance
    assert statistics.mean(widths) == pytest.approx(512, rel=0.25)


@pytest.mark.parametrize("p", [2, 4])
def test_v_layout_is_sized_per_stage_so_a_ranks_two_stages_are_equal(
    p: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A V schedule's theory assumes equal stages: the V layout sizes every stage, not only
    every rank, even where one stage of a rank carries a fixed cost (the loss on the last
    stage) and stage 0 computes no input gradient; the other layouts size ranks."""
    bench = _bench()
    assert bench.SIZED_BY == {"plain": "rank", "loop": "rank", "v": "stage"}
    # the cost model alone: equal multiply-adds per stage (stage 0 lacks an input gradient)
    macs = _stage_macs(bench, 1024, 8, bench._model_widths(1024, 8, p, "v"))
    assert max(macs) / min(macs) - 1 < 0.01, macs
    speed = [1.0 + 0.15 * r for r in range(p)]
    extra = [0.002] + [0.0] * (p - 1)  # rank 0's last stage (2p - 1) computes the loss
    world = _SyntheticWorld(bench, p, speed, extra)
    args = argparse.Namespace(width=1024, depth=8, batch=512, balance_iters=8, balance_steps=1,
                              balance_tol=0.01, pin=False)  # fmt: skip
    widths, _ = bench._calibrate(world, args, p, 8, "v")
    stage = world.stages(1024, 8, "v", widths)
    assert max(stage.values()) / min(stage.values()) - 1 < 0.01, (widths, stage)
    assert widths[0] > widths[2 * p - 1]  # the loss stage gets the narrower sizing block
    # sized per rank instead (as before), rank 0's two stages differ by the loss
    monkeypatch.setitem(bench.SIZED_BY, "v", "rank")
    by_rank, _ = bench._calibrate(world, args, p, 8, "v")
    stage = world.stages(1024, 8, "v", by_rank)
    assert max(stage.values()) / min(stage.values()) - 1 > 0.05, (by_rank, stage)


def test_bench_pipeline_reports_every_column(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ("--width", "32", "--depth", "4", "--batch", "8", "--micro", "2", "--rounds", "2")
    rows = benchmark_json_here(
        "bench_pipeline.py", *args, "--schedules", "1f1b", "zb-h1", monkeypatch=monkeypatch, capsys=capsys
    )
    assert [(r["p"], r["m"], r["schedule"]) for r in rows] == [(2, 2, "1f1b"), (2, 2, "zb-h1")]
    assert rows[0]["theory"] == pytest.approx(1 / 3)  # (p-1)/(m+p-1)
    for r in rows:
        assert r["torch_error"] is None and r["grad_diff"] is not None and r["grad_diff"] < 1e-5
        assert 0.0 <= r["replay"] < 1.0 and 0.0 <= r["bubble"] < 1.0
        assert r["ms_per_step"] > 0 and r["vs_torch"] > 0
        assert len(r["peak_bytes"]) == 2
        assert (
            0.0 <= r["theory_measured"] < 1.0 and r["imbalance"] >= 0.0 and len(r["rank_ms_per_micro"]) == 2
        )
        assert r["widths"] is not None and len(r["widths"]) == 2  # balanced by default, one per stage


def test_bench_pipeline_runs_the_v_schedules_and_placed_w_against_torch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ("--width", "32", "--depth", "4", "--batch", "8", "--micro", "4", "--rounds", "2")
    rows = benchmark_json_here(
        "bench_pipeline.py",
        *args,
        "--schedules",
        "zb-h1-placed",
        "zbv",
        "zbv-placed",
        "dualpipev",
        "--balance",
        "model",
        monkeypatch=monkeypatch,
        capsys=capsys,
    )
    assert [r["schedule"] for r in rows] == ["zb-h1-placed", "zbv", "zbv-placed", "dualpipev"]
    for r in rows:
        # same gradients as torch's ScheduleZBVZeroBubble / ScheduleDualPipeV / ZB class
        assert r["torch_error"] is None and r["grad_diff"] is not None and r["grad_diff"] < 1e-5
        assert 0.0 <= r["theory"] < 1.0 and 0.0 <= r["replay"] < 1.0 and 0.0 <= r["bubble"] < 1.0
        assert r["calls"] > 0 and len(r["peak_bytes"]) == 2
        assert len(r["widths"]) == (2 if r["schedule"] == "zb-h1-placed" else 4)  # V placement: 2p stages


def test_bench_pipeline_unbalanced_runs_the_plain_model(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ("--width", "32", "--depth", "4", "--batch", "8", "--micro", "2", "--rounds", "2")
    rows = benchmark_json_here(
        "bench_pipeline.py",
        *(*args, "--schedules", "1f1b", "--balance", "none"),
        monkeypatch=monkeypatch,
        capsys=capsys,
    )
    assert rows[0]["widths"] is None and rows[0]["grad_diff"] < 1e-5


def test_bench_pipeline_emulated_compute_sleeps_each_step_as_asked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--emulate F,I,W``: every block's steps sleep the given milliseconds (no core used),
    so each rank's busy time per micro-batch is at least its blocks' ``F + I + W``; the
    stages are equal blocks (no balancing) and torch runs the same model."""
    args = ("--emulate", "1,2,3", "--depth", "4", "--micro", "2", "--rounds", "1")
    rows = benchmark_json_here(
        "bench_pipeline.py", *args, "--schedules", "1f1b", "zbv", monkeypatch=monkeypatch, capsys=capsys
    )
    assert [r["schedule"] for r in rows] == ["1f1b", "zbv"]
    assert rows[0]["theory"] == pytest.approx(1 / 3)  # (p-1)/(m+p-1): equal stages
    for r in rows:
        assert r["widths"] is None  # emulated stages are equal blocks, never sized
        assert r["torch_error"] is None and r["grad_diff"] < 1e-5
        # 2 blocks per rank, each (1 + 2 + 3) ms per micro-batch, slept
        assert min(r["rank_ms_per_micro"]) >= 2 * 6.0, r["rank_ms_per_micro"]
        assert r["ms_per_step"] >= 2 * 2 * 6.0


@pytest.mark.parametrize("spec", ["1,2", "a,b,c", "1,-1,1"])
def test_bench_pipeline_emulate_needs_three_milliseconds(
    spec: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        _bench().main(["--emulate", spec])
    assert "--emulate: expected three milliseconds F,I,W" in capsys.readouterr().err
