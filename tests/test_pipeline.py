"""Tests for diffcomm.pipeline: schedules as data, partition, and pipelined == serial.

The parity tests build the model with the same seed on every rank, keep a deep copy as
the serial reference, and compare the loss and every parameter gradient of the rank's
stage (float64, tight tolerance) inside the rank function.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

import diffcomm as dc
from diffcomm import p2p
from diffcomm.pipeline import (
    PipelineRunner,
    Step,
    bubble_fraction,
    check_schedule,
    gpipe_schedule,
    max_in_flight,
    one_f_one_b_schedule,
    partition,
    theoretical_bubble,
)

# ======================================================================================
# schedules are data
# ======================================================================================


@pytest.mark.parametrize("make", [gpipe_schedule, one_f_one_b_schedule])
@pytest.mark.parametrize(("p", "m"), [(1, 1), (2, 1), (2, 2), (2, 4), (4, 1), (4, 3), (4, 4), (4, 8), (3, 7)])
def test_schedules_run_each_micro_batch_forward_then_backward_once(make: Callable, p: int, m: int) -> None:
    schedule = make(p, m)
    check_schedule(schedule, p, m)
    assert len(schedule) == p
    for steps in schedule:
        assert len(steps) == 2 * m
        assert sum(st.kind == "F" for st in steps) == m
        for micro in range(m):
            assert steps.index(Step("F", micro)) < steps.index(Step("B", micro))


@pytest.mark.parametrize(("p", "m"), [(2, 1), (2, 4), (4, 2), (4, 4), (4, 8), (3, 7)])
def test_1f1b_bounds_in_flight_activations_gpipe_does_not(p: int, m: int) -> None:
    for rank, steps in enumerate(one_f_one_b_schedule(p, m)):
        assert max_in_flight(steps) == min(p - rank, m)
    for steps in gpipe_schedule(p, m):
        assert max_in_flight(steps) == m


def test_schedules_print_readably() -> None:
    assert str(one_f_one_b_schedule(2, 3)) == "[[F0, F1, B0, F2, B1, B2], [F0, B0, F1, B1, F2, B2]]"
    assert str(gpipe_schedule(2, 2)) == "[[F0, F1, B0, B1], [F0, F1, B0, B1]]"


@pytest.mark.parametrize(
    ("schedule", "match"),
    [
        ([[Step("F", 0), Step("B", 0)]], r"`schedule` must be 2 per-stage lists"),
        (
            [[Step("F", 0), Step("B", 0)], [Step("B", 0), Step("F", 0)]],
            "each F before its B, got stage 1: B0",
        ),
        ([[Step("F", 0), Step("B", 0)], [Step("F", 0)]], "one backward per micro-batch"),
        ([[Step("F", 0), Step("B", 0)], [Step("F", 1), Step("B", 0)]], r"micro in \[0, 1\)"),
    ],
)
def test_check_schedule_rejects_bad_schedules(schedule: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_schedule(schedule, 2, 1)


def test_schedule_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match=r"one_f_one_b_schedule\(\): `n_micro` must be an int >= 1"):
        one_f_one_b_schedule(2, 0)
    with pytest.raises(TypeError, match=r"gpipe_schedule\(\): `n_stages` must be an int"):
        gpipe_schedule(2.0, 1)  # type: ignore[arg-type]


def test_theoretical_bubble() -> None:
    assert theoretical_bubble(4, 4) == pytest.approx(3 / 7)
    assert theoretical_bubble(1, 8) == 0.0


# ======================================================================================
# partition
# ======================================================================================


def _mlp(width: int = 6, depth: int = 4, dtype: torch.dtype = torch.float64) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(depth):
        layers.append(nn.Linear(width if i else 3, width if i < depth - 1 else 2, dtype=dtype))
        if i < depth - 1:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


def test_partition_by_parameter_count_and_by_balance() -> None:
    model = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 1), nn.Linear(1, 1), nn.Linear(1, 1))
    stages = partition(model, 2)
    assert [len(s) for s in stages] == [2, 3]  # 110 | 15 params (ReLU joins the smaller count)
    assert stages[0][0] is model[0]  # shared, not copied
    assert [len(s) for s in partition(model, 3, balance=[2, 2, 1])] == [2, 2, 1]
    assert [len(s) for s in partition(list(model), 5)] == [1] * 5
    assert sum(len(s) for s in partition(_mlp(depth=6), 4)) == 11


@pytest.mark.parametrize(
    ("args", "exc", "match"),
    [
        ((_mlp(), 8), ValueError, r"`n_stages` must be an int in \[1, 7\]"),
        ((_mlp(), 2, [3, 3]), ValueError, r"`balance` must be 2 positive ints summing to 7"),
        ((_mlp(), 2, [0, 7]), ValueError, "`balance` must be"),
        (
            ([nn.Linear(1, 1), "relu"], 1),
            TypeError,
            "`model` must be an nn.Sequential or a list of nn.Modules",
        ),
    ],
)
def test_partition_rejects_bad_arguments(args: tuple, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        partition(*args)


# ======================================================================================
# pipelined == serial
# ======================================================================================


def gpipe_reversed_backward(n_stages: int, n_micro: int) -> list[list[Step]]:
    """A custom schedule: GPipe with backwards in reverse micro-batch order."""
    return [[s for s in steps if s.kind == "F"] + [Step("B", m) for m in reversed(range(n_micro))]
            for steps in gpipe_schedule(n_stages, n_micro)]  # fmt: skip


def _parity(schedule: str, n_micro: int, batch: int, input_grad: bool) -> dict[str, float]:
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)
    model = _mlp(width=5, depth=max(n, 3))
    serial = copy.deepcopy(model)
    x = torch.randn(batch, 3, dtype=torch.float64)
    y = torch.randn(batch, 2, dtype=torch.float64)
    stage = partition(model, n)[rank]
    runner = PipelineRunner(
        stage, gpipe_reversed_backward if schedule == "custom" else schedule, loss_fn=nn.functional.mse_loss
    )
    loss = runner.step(x, y, n_micro=n_micro, input_grad=input_grad)

    xs = x.clone().requires_grad_()
    ref = nn.functional.mse_loss(serial(xs), y)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-13, atol=1e-15)
    # every parameter of this stage: same gradient as the serial model's counterpart
    serial_stage = partition(serial, n)[rank]
    pairs = list(zip(stage.parameters(), serial_stage.parameters(), strict=True))
    for p, q in pairs:
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)
    if input_grad and rank == 0:
        torch.testing.assert_close(runner.input_grad, xs.grad, rtol=1e-12, atol=1e-14)
    else:
        assert runner.input_grad is None
    assert [(e.kind, e.micro) for e in runner.timeline] == [(s.kind, s.micro) for s in runner.steps(n_micro)]
    assert p2p._SENDS.pending() == 0
    return {"loss": float(loss), "params": len(pairs), "peak": runner.peak_activation_bytes}


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("n_micro", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [2, 4])
def test_pipeline_matches_serial_model(
    local_worlds: Callable[[int], dc.LocalWorld], schedule: str, n_micro: int, n: int
) -> None:
    out = local_worlds(n).run(_parity, schedule, n_micro, 12, n_micro == 3)
    assert len({o["loss"] for o in out}) == 1  # broadcast: the same loss on every rank
    assert all(o["params"] > 0 for o in out)


def test_a_custom_schedule_function_with_reversed_backwards(world4: dc.LocalWorld) -> None:
    # backward steps in another order than the forwards: gradients still meet their tokens
    world4.run(_parity, "custom", 4, 8, True)


def _debug_checks_n_micro() -> None:
    runner = PipelineRunner(nn.Linear(2, 2), loss_fn=nn.functional.mse_loss)
    with (
        dc.debug(True),
        pytest.raises(dc.CrossRankMismatchError, match=r"n_micro differs \(rank 0: 1, rank 1: 2\)"),
    ):
        runner.step(torch.zeros(4, 2), torch.zeros(4, 2), 1 + dist.get_rank())


def test_debug_mode_checks_that_ranks_agree_on_the_step(world2: dc.LocalWorld) -> None:
    world2.run(_debug_checks_n_micro)


def _memory(n_micro: int) -> list[int]:
    rank, n = dist.get_rank(), dist.get_world_size()
    peaks = []
    for schedule in ("gpipe", "1f1b"):
        torch.manual_seed(0)
        model = _mlp(width=8, depth=n)
        runner = PipelineRunner(partition(model, n)[rank], schedule, loss_fn=nn.functional.mse_loss)
        runner.step(torch.randn(16, 3, dtype=torch.float64), torch.randn(16, 2, dtype=torch.float64), n_micro)
        peaks.append(runner.peak_activation_bytes)
    return peaks


def test_1f1b_holds_fewer_activations_than_gpipe(world4: dc.LocalWorld) -> None:
    # stage r holds min(4 - r, 8) micro-batches under 1F1B, all 8 under GPipe
    for rank, (gpipe, one_f) in enumerate(world4.run(_memory, 8)):
        assert gpipe > 0
        assert one_f * 8 == gpipe * (4 - rank), (rank, gpipe, one_f)


def _accumulate_and_timeline() -> list[float]:
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(5)
    model = _mlp(width=4, depth=3)
    serial = copy.deepcopy(model)
    runner = PipelineRunner(
        partition(model, n)[rank], "1f1b", loss_fn=nn.functional.mse_loss, broadcast_loss=False
    )
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    losses = [runner.step(x[:4], y[:4], 2), runner.step(x[4:], y[4:], 2)]
    assert (losses[0] is None) == (rank != n - 1)
    # two steps accumulate like two serial backward calls
    (nn.functional.mse_loss(serial(x[:4]), y[:4]) + nn.functional.mse_loss(serial(x[4:]), y[4:])).backward()
    for p, q in zip(partition(model, n)[rank].parameters(), partition(serial, n)[rank].parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)
    tl = runner.timeline
    assert len(tl) == 4 and all(e.end >= e.start and 0 <= e.wait and e.busy >= 0 for e in tl)
    return [e.start for e in tl]


def test_gradients_accumulate_over_steps_and_timeline_is_recorded(world2: dc.LocalWorld) -> None:
    starts = world2.run(_accumulate_and_timeline)
    assert all(a <= b for a, b in zip(starts[0], starts[0][1:]))


def test_bubble_fraction_of_a_perfect_pipeline() -> None:
    from diffcomm.pipeline import TimelineEntry

    # p=2, m=2, unit F and B: stage 0 F0 F1 . . B0 B1? Build an ideal GPipe timeline.
    s0 = [TimelineEntry("F", 0, 0, 1, 0), TimelineEntry("F", 1, 1, 2, 0)]
    s0 += [TimelineEntry("B", 0, 3, 4, 0), TimelineEntry("B", 1, 4, 5, 0)]
    s1 = [TimelineEntry("F", 0, 1, 2, 0), TimelineEntry("F", 1, 2, 3, 0)]
    s1 += [TimelineEntry("B", 0, 3, 4, 1), TimelineEntry("B", 1, 4, 5, 0)]
    # span 5; stage 0 busy 4, stage 1 busy 3 (B0 waited 1 s): idle (1 + 2) / 2 / 5
    assert bubble_fraction([s0, s1]) == pytest.approx(0.3)


def _no_grad_stage() -> float:
    # stage 0 has no parameters and the input needs no grad: nothing flows back to it
    rank = dist.get_rank()
    torch.manual_seed(0)
    stage = nn.Tanh() if rank == 0 else nn.Linear(3, 1, dtype=torch.float64)
    runner = PipelineRunner(stage, "gpipe", loss_fn=lambda out: out.pow(2).mean())
    loss = runner.step(torch.randn(4, 3, dtype=torch.float64), None, 2)
    return float(loss)


def test_stage_without_parameters_and_loss_without_targets(world2: dc.LocalWorld) -> None:
    a, b = world2.run(_no_grad_stage)
    assert a == b


def _runner_bad_args() -> None:
    rank = dist.get_rank()
    stage = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"`schedule` must be one of \['gpipe', '1f1b'\]"):
        PipelineRunner(stage, "zero-bubble", loss_fn=nn.functional.mse_loss)
    with pytest.raises(TypeError, match="`stage` must be an nn.Module"):
        PipelineRunner("linear", loss_fn=nn.functional.mse_loss)  # type: ignore[arg-type]
    if rank == 1:
        with pytest.raises(TypeError, match="`loss_fn` must be a loss function on the last stage"):
            PipelineRunner(stage)
    runner = PipelineRunner(stage, loss_fn=nn.functional.mse_loss)
    with pytest.raises(ValueError, match="`n_micro` must be an int >= 1"):
        runner.step(torch.zeros(4, 2), torch.zeros(4, 2), 0)
    with pytest.raises(ValueError, match=r"size along dim 0 is divisible by n_micro=3, got shape \(4, 2\)"):
        runner.step(torch.zeros(4, 2), torch.zeros(4, 2), 3)
    # nobody is left waiting: a real step still works
    runner.step(torch.zeros(4, 2), torch.zeros(4, 2), 2)


def test_runner_rejects_bad_arguments_before_communicating(world2: dc.LocalWorld) -> None:
    world2.run(_runner_bad_args)
