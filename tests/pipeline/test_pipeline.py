"""Tests for diffcomm.pipeline: schedules as data, partition, and pipelined == serial.

The parity tests build the model with the same seed on every rank, keep a deep copy as
the serial reference, and compare the loss and every parameter gradient of the rank's
stage (float64, tight tolerance) inside the rank function.
"""

from __future__ import annotations

import copy
import functools
import gc
import time
import warnings
import weakref
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

import diffcomm as dc
from diffcomm import backend as B
from diffcomm.ops import wire
from diffcomm.pipeline import (
    SCHEDULES,
    PipelineRunner,
    ScheduleError,
    Step,
    bubble_fraction,
    check_schedule,
    gpipe_schedule,
    interleaved_1f1b_schedule,
    max_in_flight,
    one_f_one_b_schedule,
    partition,
    replayed_bubble,
    theoretical_bubble,
    zb_h1_schedule,
)

# The schedules' values and gradients need no real transport: this module's shared worlds are in-
# process (the same values as gloo processes: tests/runtime/test_in_process.py). A test that needs a
# process per rank says why and stays on processes.
pytestmark = pytest.mark.diffcomm_in_process


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


def _shared_activation_model() -> nn.Sequential:
    torch.manual_seed(0)
    act = nn.Tanh()  # one activation object at three positions
    return nn.Sequential(
        nn.Linear(4, 4), act, nn.Linear(4, 4), act, nn.Linear(4, 4), act, nn.Linear(4, 1)
    ).double()


def _shared_activation_pipeline() -> tuple[float, float]:
    model = _shared_activation_model()
    g = torch.Generator().manual_seed(1)
    x, y = (
        torch.randn(8, 4, dtype=torch.float64, generator=g),
        torch.randn(8, 1, dtype=torch.float64, generator=g),
    )
    ref = nn.functional.mse_loss(copy.deepcopy(model)(x), y)
    stage = partition(model, dc.get_world_size())[dc.get_rank()]
    loss = PipelineRunner(stage, "1f1b", loss_fn=nn.functional.mse_loss).step(x, y, n_micro=2)
    return float(loss), float(ref)


def test_partition_keeps_every_use_of_a_module_used_twice(world2: dc.LocalWorld) -> None:
    """A module at several positions of an ``nn.Sequential`` (a shared activation): partition
    walked ``children()``, which lists it once, so the 7 layers became 4 over the stages and
    the pipeline trained another model, silently (loss 2.019 for the serial 1.880). A module
    *with parameters* in two stages warns: on different ranks its gradient is split."""
    model = _shared_activation_model()
    stages = partition(model, 2)
    assert sum(len(s) for s in stages) == 7
    x = torch.randn(5, 4, dtype=torch.float64)
    assert torch.equal(nn.Sequential(*stages)(x), model(x))
    for loss, ref in world2.run(_shared_activation_pipeline):
        assert loss == pytest.approx(ref, rel=1e-12)
    shared = nn.Linear(4, 4)
    with pytest.warns(UserWarning, match=r"Linear with parameters is used in stages 0 and 1"):
        partition(nn.Sequential(shared, nn.Tanh(), nn.Linear(4, 4), shared), 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        partition(nn.Sequential(shared, nn.Tanh(), shared, nn.Linear(4, 4)), 2, balance=[3, 1])


class _TiedHead(nn.Module):
    """An output projection reusing the input embedding's weight (tied weights)."""

    def __init__(self, emb: nn.Linear) -> None:
        super().__init__()
        self.emb = emb

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.emb.weight


def test_partition_warns_of_a_weight_tied_between_two_stages() -> None:
    """A weight tied between two modules (the classic input embedding reused as the output
    projection) in the first and the last stage: each rank gets only its stage's part of
    the gradient, as for a module used twice — but partition compared modules, not
    parameters, so it said nothing and the pipeline's gradients were silently partial."""
    emb = nn.Linear(3, 4, bias=False)
    model = nn.Sequential(emb, nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), _TiedHead(emb))
    want = (
        r"a parameter is tied between Linear \(\.weight, stage 0\) and _TiedHead \(\.emb\.weight, stage 1\)"
    )
    with pytest.warns(UserWarning, match=want):
        partition(model, 2)
    head = nn.Linear(4, 3, bias=False)
    head.weight = nn.Parameter(torch.randn(3, 4))
    twin = nn.Linear(4, 3, bias=False)
    twin.weight = head.weight  # the same Parameter in two Linear modules
    with pytest.warns(UserWarning, match=r"tied between Linear \(\.weight, stage 0\) and Linear"):
        partition(nn.Sequential(head, nn.Linear(3, 4), twin), 2, balance=[1, 2])
    with warnings.catch_warnings():  # both uses in one stage: nothing to sum
        warnings.simplefilter("error")
        square = nn.Linear(4, 4, bias=False)
        partition(nn.Sequential(nn.Tanh(), square, nn.Tanh(), _TiedHead(square)), 2, balance=[1, 3])


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


# shared: the rank body of the built-in schedules' test and the custom schedule's
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
    assert wire.SENDS.pending() == 0
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


class _KeepRows(nn.Module):
    """Keeps the rows whose first entry is positive: an output shape that depends on the data."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[x[:, 0] > 0]


class _SumRows(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(0, keepdim=True)


@pytest.mark.parametrize("prepost", [True, False])
def test_activations_whose_shape_varies_within_a_step(world2: dc.LocalWorld, prepost: bool) -> None:
    def varying_shapes(prepost: bool) -> list[int]:
        # stage 0's output has as many rows as its micro-batch has positive first entries;
        # stage 1 sums them: every activation of another shape than the channel's first goes
        # plainly, the fused receive takes it (and the ones of the first shape come fused)
        rank = dist.get_rank()
        torch.manual_seed(7)
        model = nn.Sequential(
            nn.Linear(3, 4, dtype=torch.float64),
            _KeepRows(),
            _SumRows(),
            nn.Linear(4, 2, dtype=torch.float64),
        )
        serial = copy.deepcopy(model)
        stage = model[:2] if rank == 0 else model[2:]
        x = torch.randn(24, 3, dtype=torch.float64)
        y = torch.randn(6, 2, dtype=torch.float64)
        runner = PipelineRunner(stage, "1f1b", loss_fn=nn.functional.mse_loss, prepost=prepost)
        with B.log_comms() as log:
            loss = runner.step(x, y, n_micro=6)
        ref = sum(nn.functional.mse_loss(serial(xm), ym) for xm, ym in zip(x.chunk(6), y.chunk(6))) / 6
        ref.backward()
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-13, atol=1e-15)
        mine = serial[:2] if rank == 0 else serial[2:]
        for p, q in zip(stage.parameters(), mine.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)
        with torch.no_grad():
            rows = [len(serial[:2](xm)) for xm in x.chunk(6)]
        assert len(set(rows)) > 1  # the shapes do vary
        if rank == 0:  # one message for each activation of the first shape after the first
            want = [1 if k and r == rows[0] else 1 + (r > 0) for k, r in enumerate(rows)]
            sends = [r for r in log.records if r.op == "send"]
            # (and, once per runner, the context-parallel records: test_pipeline_context.py)
            assert len(sends) == sum(want) + 1, (rows, [(r.label, r.nbytes) for r in sends])
        return rows

    world2.run(varying_shapes, prepost)


# on processes: a cross-rank diagnosis (debug mode, the p2p protocol) needs per-rank state
@pytest.mark.diffcomm_in_process(False)
def test_debug_mode_checks_that_ranks_agree_on_the_step(world2: dc.LocalWorld) -> None:
    def debug_checks_n_micro() -> None:
        runner = PipelineRunner(nn.Linear(2, 2), loss_fn=nn.functional.mse_loss)
        with (
            dc.debug(True),
            pytest.raises(dc.CrossRankMismatchError, match=r"n_micro differs \(rank 0: 1, rank 1: 2\)"),
        ):
            runner.step(torch.zeros(4, 2), torch.zeros(4, 2), 1 + dist.get_rank())

    world2.run(debug_checks_n_micro)


def test_1f1b_holds_fewer_activations_than_gpipe(world4: dc.LocalWorld) -> None:
    def memory(n_micro: int) -> list[int]:
        rank, n = dist.get_rank(), dist.get_world_size()
        peaks = []
        for schedule in ("gpipe", "1f1b"):
            torch.manual_seed(0)
            model = _mlp(width=8, depth=n)
            runner = PipelineRunner(partition(model, n)[rank], schedule, loss_fn=nn.functional.mse_loss)
            runner.step(
                torch.randn(16, 3, dtype=torch.float64), torch.randn(16, 2, dtype=torch.float64), n_micro
            )
            peaks.append(runner.peak_activation_bytes)
        return peaks

    # stage r holds min(4 - r, 8) micro-batches under 1F1B, all 8 under GPipe
    for rank, (gpipe, one_f) in enumerate(world4.run(memory, 8)):
        assert gpipe > 0
        assert one_f * 8 == gpipe * (4 - rank), (rank, gpipe, one_f)


class _FailsOnCall(nn.Module):
    """``inner``, raising on its ``fail_at``-th call (counted from 1; ``None``: never)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.calls, self.fail_at = inner, 0, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("stage fails on purpose")
        return self.inner(x)


@pytest.mark.parametrize(
    ("schedule", "v"), [("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-h1", 2)]
)
def test_every_schedule_over_steps_of_changing_micro_batch_size(
    world2: dc.LocalWorld, schedule: str, v: int
) -> None:
    def steps_of_changing_size(schedule: str, v: int) -> None:
        # the agreed activation shapes kept across steps: micro-batches of 2, 2, 4, 4, 1, 2,
        # 2, 8, 8 rows (fused while a step keeps the last one's shape, plainly at a change,
        # also to a size larger than the receive posted for the agreed one), every step
        # equal to the serial model
        rank = dist.get_rank()
        torch.manual_seed(11)
        model = nn.Sequential(
            *[nn.Sequential(nn.Linear(4, 4, dtype=torch.float64), nn.Tanh()) for _ in range(4)]
        )
        serial = copy.deepcopy(model)
        mine = partition(model, 2 * v)[rank::2]
        runner = PipelineRunner(mine if v > 1 else mine[0], schedule, loss_fn=nn.functional.mse_loss, tag=950)
        x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
        for n_micro in (4, 4, 2, 2, 8, 4, 4, 1, 1):
            for chunk in mine:
                chunk.zero_grad(set_to_none=True)
            serial.zero_grad(set_to_none=True)
            loss = runner.step(x, y, n_micro)
            ref = sum(
                nn.functional.mse_loss(serial(a), b) for a, b in zip(x.chunk(n_micro), y.chunk(n_micro))
            )
            (ref / n_micro).backward()
            torch.testing.assert_close(loss, ref.detach() / n_micro, rtol=1e-13, atol=1e-15)
            for chunk, ref_chunk in zip(mine, partition(serial, 2 * v)[rank::2], strict=True):
                for p, q in zip(chunk.parameters(), ref_chunk.parameters(), strict=True):
                    torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)

    world2.run(steps_of_changing_size, schedule, v)


def test_activation_shapes_are_agreed_across_steps(world2: dc.LocalWorld) -> None:
    def fused_across_steps() -> list[list[int]]:
        # the shape agreed on a channel is kept across steps: from the second step on, a
        # step's first activation goes fused too (one message); a new micro-batch size goes
        # plainly once (two) and is the agreed shape after it; a step that raised on both
        # ranks midway leaves the next one correct (the sender forgets its shapes)
        rank = dist.get_rank()
        torch.manual_seed(11)
        model = _mlp(width=4, depth=4)
        serial = copy.deepcopy(model)
        stage = _FailsOnCall(partition(model, 2)[rank])
        runner = PipelineRunner(stage, "1f1b", loss_fn=nn.functional.mse_loss, tag=900)
        x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
        sends = []

        def step(n_micro: int) -> None:
            stage.zero_grad(set_to_none=True)
            serial.zero_grad(set_to_none=True)
            with B.log_comms() as log:
                loss = runner.step(x, y, n_micro)
            sends.append(sum(r.op == "send" for r in log.records))
            ref = sum(
                nn.functional.mse_loss(serial(a), b) for a, b in zip(x.chunk(n_micro), y.chunk(n_micro))
            )
            (ref / n_micro).backward()
            torch.testing.assert_close(loss, ref.detach() / n_micro, rtol=1e-13, atol=1e-15)
            for p, q in zip(stage.parameters(), partition(serial, 2)[rank].parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)

        step(4)
        step(4)
        step(2)
        step(2)
        # rank 0 fails in its second forward (after sending the first), rank 1 in its first
        # (after receiving it): both raise, nothing waits for what the other never sends
        stage.fail_at = stage.calls + (2 if rank == 0 else 1)
        with pytest.raises(RuntimeError, match="stage fails on purpose"):
            runner.step(x, y, 2)
        stage.fail_at = None
        step(2)
        return [sends] if rank == 0 else [[]]

    sends, _ = world2.run(fused_across_steps)
    # rank 0's messages per step: 4 micro-batches (the first header first, 5; and, once
    # per runner, its context-parallel records: 6), 4 fused, 2 of a new size (the first
    # plainly, 3), 2 fused, and after the failed step 2 again with the first plainly (3)
    assert sends == [[6, 4, 3, 2, 3]]


def test_gradients_accumulate_over_steps_and_timeline_is_recorded(world2: dc.LocalWorld) -> None:
    def accumulate_and_timeline() -> list[float]:
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
        (
            nn.functional.mse_loss(serial(x[:4]), y[:4]) + nn.functional.mse_loss(serial(x[4:]), y[4:])
        ).backward()
        for p, q in zip(partition(model, n)[rank].parameters(), partition(serial, n)[rank].parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)
        tl = runner.timeline
        assert len(tl) == 4 and all(e.end >= e.start and 0 <= e.wait and e.busy >= 0 for e in tl)
        return [e.start for e in tl]

    starts = world2.run(accumulate_and_timeline)
    assert all(a <= b for a, b in zip(starts[0], starts[0][1:]))


@pytest.mark.parametrize("grad_first", [True, False])
def test_timeline_marks_when_a_split_backward_sent_its_input_gradient(
    world2: dc.LocalWorld, grad_first: bool
) -> None:
    def sent_marks(grad_first: bool) -> list[tuple[str, float | None, float]]:
        torch.manual_seed(0)
        stage = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3))
        runner = PipelineRunner(stage, "1f1b", loss_fn=lambda out: out.pow(2).sum(), grad_first=grad_first)
        runner.step(torch.randn(4, 3), n_micro=2)
        return [(e.kind, e.sent, e.busy) for e in runner.timeline]

    # grad_first: stage 1's B runs I then W and its input gradient leaves after I (the
    # replay lets stage 0 start then); stage 0 has no input gradient, so never splits
    stage0, stage1 = world2.run(sent_marks, grad_first)
    assert sorted(k for k, _, _ in stage1) == ["B", "B", "F", "F"] == sorted(k for k, _, _ in stage0)
    assert all(sent is None for _, sent, _ in stage0)
    for kind, sent, busy in stage1:
        if kind == "B" and grad_first:
            assert sent is not None and 0.0 <= sent <= busy
        else:
            assert sent is None


class _Slow(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return self.lin(x)


# on processes: it patches a module attribute in its rank function (one module per process)
@pytest.mark.diffcomm_in_process(False)
def test_receive_waits_are_timed_by_the_host_clock_without_the_comms_logger(world2: dc.LocalWorld) -> None:
    def waits_without_the_logger() -> list[tuple[str, float, float]]:
        from diffcomm import backend as B

        def no_logger(*_: object, **__: object) -> None:
            raise AssertionError("PipelineRunner opened the comms logger")

        rank = dist.get_rank()
        torch.manual_seed(0)
        # stage 0 computes slowly in forward; stage 1 is quick
        stage = _Slow(0.3) if rank == 0 else nn.Linear(3, 1)
        runner = PipelineRunner(stage, "gpipe", loss_fn=lambda out: out.sum(), prepost=False)
        real, B.log_comms = B.log_comms, no_logger  # type: ignore[assignment]
        dist.barrier()
        try:
            runner.step(torch.randn(2, 3), n_micro=1)
        finally:
            B.log_comms = real  # type: ignore[assignment]
        return [(e.kind, e.start, e.wait) for e in runner.timeline]

    stage0, stage1 = world2.run(waits_without_the_logger)
    assert [k for k, _, _ in stage0] == [k for k, _, _ in stage1] == ["F", "B"]
    (_, f0_start, f0_wait), (_, _, b0_wait) = stage0
    (_, f1_start, f1_wait), _ = stage1
    assert f0_wait == 0.0  # stage 0 receives nothing in forward
    # stage 1's F blocks until stage 0 has slept 0.3 s in its forward and sent (start
    # stamps are comparable across the processes of one machine)
    assert f1_wait >= f0_start + 0.3 - f1_start - 0.05 and f1_wait > 0, (stage0, stage1)
    assert b0_wait >= 0  # stage 0's B waits for the gradient only as long as stage 1 takes


def test_bubble_fraction_of_a_perfect_pipeline() -> None:
    from diffcomm.pipeline import TimelineEntry

    # p=2, m=2, unit F and B: stage 0 F0 F1 . . B0 B1? Build an ideal GPipe timeline.
    s0 = [TimelineEntry("F", 0, 0, 1, 0), TimelineEntry("F", 1, 1, 2, 0)]
    s0 += [TimelineEntry("B", 0, 3, 4, 0), TimelineEntry("B", 1, 4, 5, 0)]
    s1 = [TimelineEntry("F", 0, 1, 2, 0), TimelineEntry("F", 1, 2, 3, 0)]
    s1 += [TimelineEntry("B", 0, 3, 4, 1), TimelineEntry("B", 1, 4, 5, 0)]
    # span 5; stage 0 busy 4, stage 1 busy 3 (B0 waited 1 s): idle (1 + 2) / 2 / 5
    assert bubble_fraction([s0, s1]) == pytest.approx(0.3)


def _uniform(schedule: list[list[Step]], f: float, b: float, i: float, w: float) -> list:
    from diffcomm.pipeline import TimelineEntry

    dur = {"F": f, "B": b, "I": i, "W": w}  # start/end only give the busy time here
    return [
        [TimelineEntry(st.kind, st.micro, 0.0, dur[st.kind], 0.0, st.chunk) for st in steps]
        for steps in schedule
    ]


@pytest.mark.parametrize(
    ("name", "p", "m"),
    [
        (name, p, m)
        for name in ("gpipe", "1f1b", "interleaved")
        for p in (2, 3, 4)
        for m in (1, 2, 4, 8)
        if name != "interleaved" or m % p == 0  # interleaved 1F1B needs p to divide m
    ],
)
def test_replayed_bubble_of_uniform_stages_is_the_theory(name: str, p: int, m: int) -> None:
    # the replay of a schedule with uniform stage times (B = 2F, as a Linear's backward)
    # and free communication is exactly the textbook bubble (p-1)/(v*m+p-1)
    v = 2 if name == "interleaved" else 1
    schedule = SCHEDULES[name](p, m, v)
    assert replayed_bubble(_uniform(schedule, 1.0 / v, 2.0 / v, 1.0, 1.0)) == pytest.approx(
        theoretical_bubble(p, m, v), abs=1e-12
    )


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_replayed_bubble_of_zb_h1(p: int, m: int) -> None:
    replay = replayed_bubble(_uniform(zb_h1_schedule(p, m), 1.0, 2.0, 1.0, 1.0))
    if m >= p:  # the paper's ZB-H1 bubble (p-1)(F+I-W) / (m(F+I+W) + (p-1)(F+I-W)), F=I=W
        assert replay == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
    # with W filling the drain, never worse than 1F1B on the same stage times (B = I + W)
    one_f = replayed_bubble(_uniform(one_f_one_b_schedule(p, m), 1.0, 2.0, 1.0, 1.0))
    assert replay <= one_f + 1e-12


def test_replayed_bubble_keeps_measured_stage_times() -> None:
    from diffcomm.pipeline import TimelineEntry

    # GPipe, p=2, m=2, unit F and B; stage 1's F1 was blocked 1 s in its receive (a slow
    # message), which delayed everything after it: span 7, busy 4 + 4
    s0 = [TimelineEntry("F", 0, 0, 1, 0), TimelineEntry("F", 1, 1, 2, 0)]
    s0 += [TimelineEntry("B", 0, 5, 6, 0), TimelineEntry("B", 1, 6, 7, 0)]
    s1 = [TimelineEntry("F", 0, 1, 2, 0), TimelineEntry("F", 1, 2, 4, 1)]
    s1 += [TimelineEntry("B", 0, 4, 5, 0), TimelineEntry("B", 1, 5, 6, 0)]
    assert bubble_fraction([s0, s1]) == pytest.approx(1 - 4 / 7)
    # the replay keeps every busy time and drops the wait: span 6, the theory's 1/3
    assert replayed_bubble([s0, s1]) == pytest.approx(1 - 4 / 6)
    assert replayed_bubble([s0, s1]) == pytest.approx(theoretical_bubble(2, 2))
    # p=2, m=1: stage 1's B sent its input gradient 1 s into its 2 s (input gradient
    # first): stage 0's B starts then, span 6 -> 5
    s0 = [TimelineEntry("F", 0, 0, 1, 0), TimelineEntry("B", 0, 0, 2, 0)]
    s1 = [TimelineEntry("F", 0, 0, 1, 0), TimelineEntry("B", 0, 0, 2, 0)]
    assert replayed_bubble([s0, s1]) == pytest.approx(1 - 3 / 6)
    s1[1].sent = 1.0
    assert replayed_bubble([s0, s1]) == pytest.approx(1 - 3 / 5)
    # a rank-1 step whose input never comes is an error naming it
    with pytest.raises(ValueError, match="rank 1 step 0"):
        replayed_bubble([[TimelineEntry("F", 1, 0, 1, 0)], [TimelineEntry("F", 0, 0, 1, 0)]])


def _costed(schedule: list[list], costs: list[dict[str, float]], placement: str = "loop") -> list:
    from diffcomm.pipeline import TimelineEntry, expand_steps

    return [
        [TimelineEntry(s.kind, s.micro, 0.0, costs[r][s.kind], 0.0, s.chunk) for s in expand_steps(steps)]
        for r, steps in enumerate(schedule)
    ]


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [2, 4, 8])
def test_bubble_bound_of_uniform_stages_is_the_theory(p: int, m: int) -> None:
    from diffcomm.pipeline import bubble_bound, dualpipev_schedule, zbv_schedule

    unit = [{"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}] * p
    # 1F1B (B indivisible): no order of these steps beats (p-1)/(m+p-1)
    assert bubble_bound(_costed(one_f_one_b_schedule(p, m), unit)) == pytest.approx(
        theoretical_bubble(p, m), abs=1e-12
    )
    # split backward: the paper's ZB-H1 bubble (p-1)F / (3mF + (p-1)F), which ZB-H1 reaches for m >= p
    zb = _costed(zb_h1_schedule(p, m), unit)
    assert bubble_bound(zb) == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
    if m >= p:
        assert replayed_bubble(zb) == pytest.approx(bubble_bound(zb), abs=1e-12)
    half = [{"F": 0.5, "B": 1.0, "I": 0.5, "W": 0.5}] * p  # V: a chunk is half a stage
    for sched in (zbv_schedule(p, m), *([dualpipev_schedule(p, m)] if m >= 2 * p else [])):
        v = _costed(sched, half, "v")
        if m >= 2 * p:  # the V schedules reach it with m >= 2p (below, their ramp is longer)
            assert bubble_bound(v, "v") == pytest.approx(replayed_bubble(v, "v"), abs=1e-12)
        else:
            assert bubble_bound(v, "v") <= replayed_bubble(v, "v") + 1e-12


def test_bubble_bound_is_below_every_replay_and_counts_unequal_stages() -> None:
    import random

    from diffcomm.pipeline import bubble_bound, interleaved_1f1b_schedule, zbv_schedule

    rng = random.Random(0)
    for _ in range(20):
        p, m = rng.choice([(2, 4), (2, 8), (3, 6), (4, 8)])
        costs = []
        for _ in range(p):
            c = {k: rng.uniform(0.2, 3.0) for k in "FIW"}
            costs.append({**c, "B": c["I"] + c["W"]})
        for sched, place in (
            (one_f_one_b_schedule(p, m), "loop"),
            (zb_h1_schedule(p, m), "loop"),
            (zb_h1_schedule(p, m, costs=costs), "loop"),
            (interleaved_1f1b_schedule(p, m, 2), "loop"),
            (zbv_schedule(p, m, costs=costs), "v"),
        ):
            tl = _costed(sched, costs, place)
            assert bubble_bound(tl, place) <= replayed_bubble(tl, place) + 1e-12
    # p = 2, m = 8, the benchmark's measured step times (ms): stage 0's input needs no
    # gradient (I ~ 0, W the whole backward), so rank 0 is busy 21.8 per micro-batch,
    # rank 1 25.4. Rank 1 cannot start before rank 0's F0 and must run all its steps:
    # the step is >= 8.1 + 8 * 25.4 = 211.3, and rank 0 idles >= 211.3 - 174.4 of it
    # in any order: a bubble of 0.107, not the 0.04 of uniform stages. ZB-H1 reaches it,
    # with W placed by these times or by unit times alike: no placement can do better.
    costs = [{"F": 8.1, "I": 0.3, "W": 13.4, "B": 13.7}, {"F": 8.0, "I": 8.1, "W": 9.3, "B": 17.4}]
    span, busy = 8.1 + 8 * 25.4, 8 * 21.8 + 8 * 25.4
    for sched in (zb_h1_schedule(2, 8, costs=costs), zb_h1_schedule(2, 8)):
        tl = _costed(sched, costs)
        assert bubble_bound(tl) == pytest.approx(1 - busy / (2 * span), abs=1e-9)
        assert replayed_bubble(tl) == pytest.approx(bubble_bound(tl), abs=1e-9)
    # a rank-1 step whose input never comes is an error naming it
    from diffcomm.pipeline import TimelineEntry

    with pytest.raises(ValueError, match="rank 1's F0"):
        bubble_bound([[TimelineEntry("F", 1, 0, 1, 0)], [TimelineEntry("F", 0, 0, 1, 0)]])


def test_stage_without_parameters_and_loss_without_targets(world2: dc.LocalWorld) -> None:
    def no_grad_stage() -> float:
        # stage 0 has no parameters and the input needs no grad: nothing flows back to it
        rank = dist.get_rank()
        torch.manual_seed(0)
        stage = nn.Tanh() if rank == 0 else nn.Linear(3, 1, dtype=torch.float64)
        runner = PipelineRunner(stage, "gpipe", loss_fn=lambda out: out.pow(2).mean())
        loss = runner.step(torch.randn(4, 3, dtype=torch.float64), None, 2)
        return float(loss)

    a, b = world2.run(no_grad_stage)
    assert a == b


def _unreduced_loss() -> None:
    stage = nn.Linear(2, 2)
    runner = PipelineRunner(stage, "1f1b", loss_fn=nn.MSELoss(reduction="none"))
    runner.step(torch.ones(4, 2), torch.zeros(4, 2), n_micro=2)


def test_a_loss_fn_that_returns_no_scalar_is_named(world2: dc.LocalWorld) -> None:
    """``loss_fn`` with ``reduction="none"``: the last stage failed inside the runner's sum
    with torch's "output with shape [] doesn't match the broadcast shape [2, 2]"; now a
    TypeError naming ``loss_fn`` and what it returned."""
    want = r"rank\(s\) \[1\] raised: TypeError: .*`loss_fn` must be a function returning a scalar tensor"
    with pytest.raises(dc.RankError, match=want + r".*got Tensor of shape \(2, 2\)"):
        world2.run(_unreduced_loss)


def test_runner_rejects_bad_arguments_before_communicating(world2: dc.LocalWorld) -> None:
    def runner_bad_args() -> None:
        rank = dist.get_rank()
        stage = nn.Linear(2, 2)
        names = r"\['gpipe', '1f1b', 'interleaved', 'zb-h1', 'zbv', 'dualpipev'\]"
        with pytest.raises(ValueError, match=r"`schedule` must be one of " + names):
            PipelineRunner(stage, "zero-bubble", loss_fn=nn.functional.mse_loss)
        with pytest.raises(TypeError, match="`stage` must be an nn.Module"):
            PipelineRunner("linear", loss_fn=nn.functional.mse_loss)  # type: ignore[arg-type]
        bad = "`grad_first` must be True, False, \"cooldown\" or None, got 'drain'"
        with pytest.raises(ValueError, match=bad):
            PipelineRunner(stage, loss_fn=nn.functional.mse_loss, grad_first="drain")
        if rank == 1:
            with pytest.raises(TypeError, match="`loss_fn` must be a loss function on the last stage"):
                PipelineRunner(stage)
        runner = PipelineRunner(stage, loss_fn=nn.functional.mse_loss)
        # the default input-gradient-first: only the cooldown's B steps split, with one chunk
        # per rank or several (interleaved)
        assert runner.grad_first == "cooldown"
        two = PipelineRunner(
            [nn.Linear(2, 2), nn.Linear(2, 2)], "interleaved", loss_fn=nn.functional.mse_loss
        )
        assert two.grad_first == "cooldown"
        with pytest.raises(ValueError, match="`n_micro` must be an int >= 1"):
            runner.step(torch.zeros(4, 2), torch.zeros(4, 2), 0)
        with pytest.raises(
            ValueError, match=r"size along dim 0 is divisible by n_micro=3, got shape \(4, 2\)"
        ):
            runner.step(torch.zeros(4, 2), torch.zeros(4, 2), 3)
        # nobody is left waiting: a real step still works
        runner.step(torch.zeros(4, 2), torch.zeros(4, 2), 2)

    world2.run(runner_bad_args)


def _integer_inputs_with_input_grad() -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    stage = nn.Embedding(10, 2, dtype=torch.float64) if rank == 0 else nn.Linear(2, 2, dtype=torch.float64)
    runner = PipelineRunner(stage, "1f1b", loss_fn=nn.functional.mse_loss)
    ids, y = torch.randint(0, 10, (4,)), torch.zeros(4, 2, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"`input_grad` must be False for inputs that cannot have a gradient"):
        runner.step(ids, y, 2, input_grad=True)
    runner.step(ids, y, 2)  # nobody is left waiting: a real step still works


def test_input_grad_of_integer_inputs_is_refused_before_communicating(world2: dc.LocalWorld) -> None:
    """Token ids into a first-stage embedding with ``input_grad=True``: rank 0 raised
    torch's "only Tensors of floating point dtype can require gradients" at its first
    forward, naming no argument, and rank 1 waited for its activation until the timeout."""
    world2.run(_integer_inputs_with_input_grad)


class _TwoOutputs(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x + 1


# debug mode pinned off: only rank 0 calls step here, and debug mode's argument check
# (a collective before the first forward) would wait for rank 1
@pytest.mark.usefixtures("debug_off")
def test_a_stage_returning_a_tuple_is_named(world2: dc.LocalWorld) -> None:
    """A stage other than the last returns one tensor (its activation travels); a tuple
    is an error naming the stage, not an AttributeError from inside the runner."""

    def tuple_stage() -> None:
        rank = dist.get_rank()
        stage = _TwoOutputs() if rank == 0 else nn.Identity()
        runner = PipelineRunner(stage, "gpipe", loss_fn=lambda out: out.sum(), prepost=False)
        if rank == 0:  # it raises at its first forward, before sending anything
            with pytest.raises(TypeError, match=r"`the output of stage 0` must be one tensor .*got a tuple"):
                runner.step(torch.ones(4, 2), None, 2)

    world2.run(tuple_stage)


def _two_pipelines_on_subgroups(m: int) -> tuple[float, float, float]:
    """Pipelines {0, 2} and {1, 3} (data parallel x pipeline), each on its own data: this
    rank's loss, the serial one, and the largest gradient difference of its stage."""
    r = dc.get_rank()
    pp = [dist.new_group([0, 2]), dist.new_group([1, 3])][r % 2]
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3), nn.Tanh()).double()
    serial = copy.deepcopy(net)
    g = torch.Generator().manual_seed(1 + r % 2)
    x, y = (torch.randn(2 * m, 3, dtype=torch.float64, generator=g) for _ in range(2))
    stage = partition(net, 2)[r // 2]
    loss = PipelineRunner(stage, "1f1b", group=pp, loss_fn=nn.functional.mse_loss).step(x, y, n_micro=m)
    ref = nn.functional.mse_loss(serial(x), y)
    ref.backward()
    pairs = zip(stage.parameters(), partition(serial, 2)[r // 2].parameters())
    return float(loss), float(ref), max((a.grad - b.grad).abs().max().item() for a, b in pairs)


@pytest.mark.parametrize("m", [1, 3])
def test_two_pipelines_on_subgroups_match_serial(world4: dc.LocalWorld, m: int) -> None:
    """Two pipelines in one world, on subgroups whose ranks are not the world's. In-process,
    a rank waiting on a subgroup took another rank's state (its group rank's), so at m = 3
    the runner raised a wrong "send/recv out of step" error."""
    for loss, ref, worst in world4.run(_two_pipelines_on_subgroups, m):
        assert loss == pytest.approx(ref, rel=1e-12) and worst < 1e-12


# ======================================================================================
# interleaved 1F1B and ZB-H1: schedules, bounds, the validator
# ======================================================================================

ALL = [gpipe_schedule, one_f_one_b_schedule, interleaved_1f1b_schedule, zb_h1_schedule]


@pytest.mark.parametrize("make", ALL)
@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("v", [1, 2, 3])
def test_every_schedule_is_valid_for_every_shape(make: Callable, p: int, m: int, v: int) -> None:
    if p == 1 and v > 1:
        with pytest.raises(ValueError, match=r"`n_chunks` must be 1 when n_stages is 1"):
            make(p, m, v)
        return
    schedule = make(p, m, v)
    check_schedule(schedule, p, m, v)  # structure and the deadlock simulation
    kinds = {st.kind for steps in schedule for st in steps}
    assert kinds == ({"F", "I", "W"} if make is zb_h1_schedule else {"F", "B"})
    for steps in schedule:
        assert len(steps) == m * v * (3 if make is zb_h1_schedule else 2)


def test_interleaved_schedules_are_valid_when_p_does_not_divide_m() -> None:
    """The interleaved order grouped the micro-batches by ``p`` with a smaller last group:
    for 22 shapes up to p = 6 (p = 4, v = 3, m = 5 among them) the built-in schedule was a
    deadlock its own validator refused (``step`` raised ScheduleError). Now torch's rounds:
    ``max(1, m // p)`` groups, the larger first (torch refuses m not a multiple of them)."""
    for p in range(2, 7):
        for v in (2, 3, 4):
            for m in range(1, 13):
                for make in (interleaved_1f1b_schedule, zb_h1_schedule):
                    check_schedule(make(p, m, v), p, m, v)


@pytest.mark.parametrize(
    ("p", "m", "v"), [(2, 4, 2), (2, 8, 2), (4, 4, 2), (4, 8, 2), (4, 2, 2), (3, 7, 3), (4, 5, 3), (4, 10, 2)]
)
def test_interleaved_memory_bound_and_zb_h1_keeps_its_base_bound(p: int, m: int, v: int) -> None:
    group = -(-m // max(1, m // p))  # the first (largest) group of micro-batches: min(p, m) if p | m
    for r, steps in enumerate(interleaved_1f1b_schedule(p, m, v)):
        assert max_in_flight(steps) == min(2 * (p - r - 1) + (v - 1) * group + 1, v * m)
    for v_ in (1, v):
        base = one_f_one_b_schedule(p, m, v_)
        for zb, b in zip(zb_h1_schedule(p, m, v_, memory="rank"), base, strict=True):
            assert max_in_flight(zb) <= max_in_flight(b)  # counted until W
        # the paper's ZB-H1: no rank above the base's busiest rank
        peak = max(max_in_flight(b) for b in base)
        assert max(max_in_flight(zb) for zb in zb_h1_schedule(p, m, v_)) == peak
    for r, steps in enumerate(zb_h1_schedule(p, m, memory="rank")):
        assert max_in_flight(steps) == min(p - r, m)  # each rank within its own 1F1B bound
    for steps in zb_h1_schedule(p, m):
        assert max_in_flight(steps) <= min(p, m)  # every rank within 1F1B's peak (rank 0's)


def _unit_cost_bubble(schedule: list[list[Step]], p: int, v: int) -> float:
    """Idle share when every F, I, W costs 1 and B costs 2 (free messages)."""
    cost = {"F": 1, "I": 1, "W": 1, "B": 2}
    done: dict[tuple[str, int, int], int] = {}
    free, pc = [0] * p, [0] * p
    while any(pc[r] < len(schedule[r]) for r in range(p)):
        for r in range(p):
            while pc[r] < len(schedule[r]):
                st = schedule[r][pc[r]]
                g = st.chunk * p + r
                dep = ("F", g - 1, st.micro) if st.kind == "F" and g else None
                if st.kind in "BI" and g < p * v - 1:
                    dep = ("G", g + 1, st.micro)
                if dep is not None and dep not in done:
                    break
                free[r] = max(free[r], done.get(dep, 0) if dep else 0) + cost[st.kind]
                if st.kind != "W":
                    done[("F" if st.kind == "F" else "G", g, st.micro)] = free[r]
                pc[r] += 1
    busy = sum(cost[st.kind] for st in schedule[0])
    return 1 - busy / max(free)


@pytest.mark.parametrize(("p", "m"), [(2, 4), (2, 8), (4, 4), (4, 8)])
def test_schedules_reach_their_ideal_bubble_with_unit_costs(p: int, m: int) -> None:
    assert _unit_cost_bubble(one_f_one_b_schedule(p, m), p, 1) == pytest.approx(theoretical_bubble(p, m))
    assert _unit_cost_bubble(gpipe_schedule(p, m), p, 1) == pytest.approx(theoretical_bubble(p, m))
    assert _unit_cost_bubble(interleaved_1f1b_schedule(p, m, 2), p, 2) == pytest.approx(
        theoretical_bubble(p, m, 2)
    )
    # ZB-H1: (p-1)(F+I-W) idle of m(F+I+W) + (p-1)(F+I-W) with F = I = W = 1
    zb = _unit_cost_bubble(zb_h1_schedule(p, m), p, 1)
    assert zb == pytest.approx((p - 1) / (3 * m + (p - 1)))
    # held to each rank's own 1F1B bound no W can wait before the drain: 2(p-1) idle
    zb_rank = _unit_cost_bubble(zb_h1_schedule(p, m, memory="rank"), p, 1)
    assert zb_rank == pytest.approx(2 * (p - 1) / (3 * m + 2 * (p - 1)))
    assert zb < zb_rank < theoretical_bubble(p, m)


F, B_, I_, W_ = (lambda m, c=0, k=k: Step(k, m, c) for k in "FBIW")


@pytest.mark.parametrize(
    ("schedule", "n_micro", "n_chunks", "match"),
    [
        # 1F1B steady state with stage 1 starting F1 before B0 while stage 0 needs B0's
        # gradient before it sends F1: a wait cycle
        (
            [[F(0), B_(0), F(1), B_(1)], [F(0), F(1), B_(0), B_(1)]],
            2,
            1,
            r"deadlock: stage 0 step 1 \(B0\) waits for the gradient of micro-batch 0 from virtual "
            r"stage 1 \(rank 1\); stage 1 step 1 \(F1\) waits for the activation F1 of virtual "
            r"stage 0 \(rank 0\)",
        ),
        # interleaved: rank 0 runs chunk 1 of micro 0 before rank 1 sent it
        (
            [[F(0, 1), F(0), B_(0, 1), B_(0)], [F(0), F(0, 1), B_(0, 1), B_(0)]],
            1,
            2,
            r"deadlock: stage 0 step 0 \(F0c1\) waits for the activation F0 of virtual stage 1 \(rank 1\)",
        ),
        ([[F(0), I_(0), W_(0)], [F(0), W_(0), I_(0)]], 1, 1, r"each I before its W, got stage 1: W0 first"),
        ([[F(0), I_(0), B_(0)], [F(0), B_(0)]], 1, 1, r"one backward per micro-batch \(B, or I and W\)"),
        ([[F(0), I_(0)], [F(0), B_(0)]], 1, 1, r"micro-batch 0, got stage 0: \['I0'\]"),
        ([[F(0), B_(0), B_(0)], [F(0), B_(0)]], 1, 1, r"each step once, got stage 0: B0 twice \(steps 1 and"),
        ([[F(1), F(0), B_(0), B_(1)], [F(0), F(1), B_(0), B_(1)]], 2, 1, r"forwards F0..F\(m-1\) in order"),
        ([[F(0), B_(0)], [F(0, 1), B_(0, 1)]], 1, 1, r"chunk in \[0, 1\), got stage 1 step 0: F0c1"),
    ],
)
def test_check_schedule_names_the_broken_step(
    schedule: list, n_micro: int, n_chunks: int, match: str
) -> None:
    with pytest.raises(ScheduleError, match=match):
        check_schedule(schedule, 2, n_micro, n_chunks)


def test_schedule_errors_are_value_errors_and_steps_print_with_chunks() -> None:
    assert issubclass(ScheduleError, ValueError)
    assert str(zb_h1_schedule(2, 2)) == "[[F0, F1, I0, W0, I1, W1], [F0, I0, F1, I1, W0, W1]]"
    assert str(zb_h1_schedule(2, 2, memory="rank")) == "[[F0, F1, I0, W0, I1, W1], [F0, I0, W0, F1, I1, W1]]"
    with pytest.raises(ValueError, match="`memory` must be 'peak' or 'rank'"):
        zb_h1_schedule(2, 2, memory="none")  # type: ignore[arg-type]
    assert str(Step("F", 3, 1)) == "F3c1"
    assert set(SCHEDULES) == {"gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev"}


def deadlocking(n_stages: int, n_micro: int) -> list[list[Step]]:
    return [[F(0), B_(0), F(1), B_(1)], [F(0), F(1), B_(0), B_(1)]]


def test_runner_validates_the_schedule_before_communicating(world2: dc.LocalWorld) -> None:
    def runner_rejects_deadlock() -> float:
        runner = PipelineRunner(nn.Linear(2, 2), deadlocking, loss_fn=nn.functional.mse_loss)
        with pytest.raises(ScheduleError, match=r"stage 0 step 1 \(B0\) waits for the gradient"):
            runner.step(torch.zeros(4, 2), torch.zeros(4, 2), 2)
        # nothing was sent: the same ranks still run a real step
        return float(PipelineRunner(nn.Linear(2, 2), "zb-h1", loss_fn=nn.functional.mse_loss).step(
            torch.zeros(4, 2), torch.zeros(4, 2), 2
        ))  # fmt: skip

    world2.run(runner_rejects_deadlock)


# ======================================================================================
# every schedule == serial: p in {2, 4}, m in {1, 2, 4, 8}, v in {1, 2}
# ======================================================================================


# shared: the rank body of the every-schedule test and its cooldown grad_first variant
def _parity_all(schedule: str, v: int, grad_first: bool | str | None = None) -> list[int]:
    """Pipelined == serial for m = 1, 2, 4, 8; ``grad_first`` given: that B path at every m
    (else the default path at m = 1, 4, 8 and the plain B at m = 2)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    peaks = []
    for n_micro in (1, 2, 4, 8):
        torch.manual_seed(n_micro)
        model = _mlp(width=5, depth=n * v)
        serial = copy.deepcopy(model)
        x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
        mine = partition(model, n * v)[rank::n]  # rank r holds virtual stages r, r + n, ...
        input_grad = n_micro == 2
        # one configuration also without pre-posted receives, one with plain (not
        # input-gradient-first) B steps: same numbers (the default path at m = 1, 4, 8)
        runner = PipelineRunner(
            mine if v > 1 else mine[0],
            functools.partial(zb_h1_schedule, memory="rank") if schedule == "zb-h1-rank" else schedule,
            loss_fn=nn.functional.mse_loss,
            prepost=n_micro != 4,
            grad_first=n_micro != 2 if grad_first is None else grad_first,
        )
        loss = runner.step(x, y, n_micro=n_micro, input_grad=input_grad)
        xs = x.clone().requires_grad_()
        ref = nn.functional.mse_loss(serial(xs), y)
        ref.backward()
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-13, atol=1e-15)
        theirs = partition(serial, n * v)[rank::n]
        for chunk, ref_chunk in zip(mine, theirs, strict=True):
            pairs = list(zip(chunk.parameters(), ref_chunk.parameters(), strict=True))
            assert pairs
            for p, q in pairs:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)
        if input_grad and rank == 0:
            torch.testing.assert_close(runner.input_grad, xs.grad, rtol=1e-12, atol=1e-14)
        got = [(e.kind, e.micro, e.chunk) for e in runner.timeline]
        assert got == [(s.kind, s.micro, s.chunk) for s in runner.steps(n_micro)]
        assert wire.SENDS.pending() == 0
        peaks.append(runner.peak_activation_bytes)
    return peaks


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h1-rank"])
@pytest.mark.parametrize("v", [1, 2])
@pytest.mark.parametrize("n", [2, 4])
def test_every_schedule_matches_the_serial_model(
    local_worlds: Callable[[int], dc.LocalWorld], schedule: str, v: int, n: int
) -> None:
    peaks = local_worlds(n).run(_parity_all, schedule, v)
    assert all(all(b > 0 for b in per_rank) for per_rank in peaks)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
@pytest.mark.parametrize("v", [1, 2])
@pytest.mark.parametrize("n", [2, 4])
def test_cooldown_grad_first_matches_the_serial_model(
    local_worlds: Callable[[int], dc.LocalWorld], schedule: str, v: int, n: int
) -> None:
    # split B steps (after the last F) and plain ones in the same step: same numbers
    # (zb-h1 has no B steps: its I and W are steps of their own)
    peaks = local_worlds(n).run(_parity_all, schedule, v, "cooldown")
    assert all(all(b > 0 for b in per_rank) for per_rank in peaks)


@pytest.mark.parametrize(
    ("schedule", "v", "grad_first"),
    [
        ("1f1b", 1, True),
        ("1f1b", 1, "cooldown"),
        ("1f1b", 1, False),
        ("zb-h1", 1, True),
        ("interleaved", 2, True),
    ],
)
def test_every_micro_batch_graph_is_freed_after_the_step(
    world2: dc.LocalWorld, schedule: str, v: int, grad_first: bool | str
) -> None:
    def graphs_freed(schedule: str, v: int, grad_first: bool | str) -> int:
        """Every micro-batch's graph dies with its step: the chunks' inputs (received, or the
        micro-batches of the batch) are unreachable afterwards, also where a B split into a
        retained I and a W (Tanh saves its output: a packed tensor must not hold its node)."""
        rank, n = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        mine = partition(_mlp(width=5, depth=n * v), n * v)[rank::n]
        refs: list[weakref.ref] = []
        hooks = [c.register_forward_pre_hook(lambda _, args: refs.append(weakref.ref(args[0]))) for c in mine]
        runner = PipelineRunner(
            mine if v > 1 else mine[0], schedule, loss_fn=nn.functional.mse_loss, grad_first=grad_first
        )
        for _ in range(2):
            runner.step(torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64), 4)
        for h in hooks:
            h.remove()
        gc.collect()
        alive = sum(r() is not None for r in refs)
        assert refs and alive == 0, f"{alive} of {len(refs)} micro-batch inputs still alive"
        return len(refs)

    assert world2.run(graphs_freed, schedule, v, grad_first) == [8 * v, 8 * v]


def test_zb_h1_computes_weight_gradients_in_w_only(world2: dc.LocalWorld) -> None:
    def weights_only_in_w() -> list[str]:
        """ZB-H1: a parameter's gradient lands during a W step, never during I."""
        rank, n = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        stage = partition(_mlp(width=4, depth=n), n)[rank]
        runner = PipelineRunner(stage, "zb-h1", loss_fn=nn.functional.mse_loss)
        seen: list[str] = []
        for p in stage.parameters():
            p.register_post_accumulate_grad_hook(lambda _: seen.append(runner._current))
        orig_i, orig_w = runner._backward_input, runner._backward_weight

        def tagged(kind: str, fn: Callable) -> Callable:
            def run(st: Step, stash: dict, **kw: bool) -> None:
                runner._current = kind
                fn(st, stash, **kw)
                runner._current = "-"

            return run

        runner._current = "-"
        runner._backward_input, runner._backward_weight = tagged("I", orig_i), tagged("W", orig_w)
        runner.step(torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64), 4)
        return sorted(set(seen))

    assert world2.run(weights_only_in_w) == [["W"], ["W"]]


@pytest.mark.parametrize(
    ("grad_first", "split"),
    [(True, [True, True]), (False, [False, False]), ("cooldown", [False, True])],
)
# on processes: it patches a module attribute in its rank function (one module per process)
@pytest.mark.diffcomm_in_process(False)
def test_b_sends_the_input_gradient_before_the_weight_gradients(
    world2: dc.LocalWorld, grad_first: bool | str, split: list[bool]
) -> None:
    def send_order(grad_first: bool | str) -> list[list[str]]:
        """Per B step of the last stage: the order of its events, "send" (the input gradient
        leaves for the previous stage) and "W" (a weight gradient accumulates)."""
        rank, n = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        stage = partition(_mlp(width=4, depth=2 * n), n)[rank]
        runner = PipelineRunner(stage, "1f1b", loss_fn=nn.functional.mse_loss, grad_first=grad_first)
        events: list[str] = []
        hooks = [
            p.register_post_accumulate_grad_hook(lambda _: events.append("W")) for p in stage.parameters()
        ]
        orig = wire.send_grad

        def send_grad(*args: object, **kwargs: object) -> None:
            events.append("send")
            orig(*args, **kwargs)  # type: ignore[arg-type]

        wire.send_grad = send_grad  # type: ignore[assignment]
        try:
            runner.step(torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64), 2)
        finally:
            wire.send_grad = orig
            for h in hooks:
                h.remove()
        k = len(list(stage.parameters())) + 1  # events per B step
        return [events[i : i + k] for i in range(0, len(events), k)] if rank == n - 1 else []

    _, last = world2.run(send_order, grad_first)
    assert len(last) == 2  # two micro-batches: F0 B0 F1 B1 on the last stage
    for b, first in zip(last, split, strict=True):
        n_weights = len(b) - 1
        assert n_weights >= 2 and sorted(b) == ["W"] * n_weights + ["send"], b
        # a split B: the previous stage gets its gradient before the weights' work; a
        # plain backward reaches the receive's node last ("cooldown": only B1, after
        # the last F, splits)
        assert b.index("send") == (0 if first else n_weights), b


def test_receives_are_posted_before_the_peer_sends(world2: dc.LocalWorld) -> None:
    """A sent activation's gradient is received into a receive posted at the send, and a
    channel's next activation into one posted when the previous arrived — not only one
    step ahead: a message that finds its receive posted is written at once, one that does
    not waits for the sender's side to answer the receive (tens of ms on a loaded machine,
    where the sender computes; docs/pipeline.md, "Where the gap is")."""

    def posted_at_each_forward(schedule: str) -> list[tuple[list[tuple[int, int]], int]]:
        rank = dist.get_rank()
        torch.manual_seed(3)
        seen: list[tuple[list[tuple[int, int]], int]] = []
        grads0 = [0]

        class Spy(nn.Module):
            def __init__(self, inner: nn.Module) -> None:
                super().__init__()
                self.inner = inner

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                # the activation receives posted, and the gradient receives posted this step
                seen.append((sorted(runner._posted), len(wire._GRADS) - grads0[0]))
                return self.inner(x)

        runner = PipelineRunner(
            Spy(partition(_mlp(width=4, depth=4), 2)[rank]), schedule, loss_fn=nn.functional.mse_loss
        )
        x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
        for _ in range(2):  # the second step: the activations' shape agreed (fused receives)
            grads0[0] = len(wire._GRADS)
            runner.step(x, y, 4)
        return seen[4:]

    r0, _ = world2.run(posted_at_each_forward, "gpipe")
    # rank 0 under GPipe (F0 F1 F2 F3 B0 ..): at micro k's forward the gradients of the k
    # activations sent before it are posted (one step ahead only: none before B0's turn)
    assert [g for _, g in r0] == [0, 1, 2, 3]
    _, r1 = world2.run(posted_at_each_forward, "1f1b")
    # rank 1 (the last) under 1F1B (F0 B0 F1 B1 ..): at micro k's forward micro k + 1's
    # activation is posted (one step ahead only: never, a B comes next)
    assert [p for p, _ in r1] == [[(1, 0)], [(2, 0)], [(3, 0)], []]
