"""Unusual but legitimate programs under :class:`~diffcomm.pipeline.PipelineRunner`, each
against the float64 serial model on the full batch: inputs made by a graph outside the
pipeline, a ``loss_fn`` with a parameter of its own, targets made by a graph outside the
pipeline, a one-element loss that is not 0-dim, and the loss convention over
micro-batches (the mean of ``loss_fn`` per micro-batch) with a loss whose mean is not
over equal micro-batches (``ignore_index``), and complex activations between stages.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import diffcomm as dc
from diffcomm.pipeline import PipelineRunner, partition

pytestmark = pytest.mark.diffcomm_in_process

SCHEDULES_PARTS = {"gpipe": 1, "1f1b": 1, "zb-h1": 1, "interleaved": 2, "zbv": 2}


def _model(out: int = 2) -> nn.Sequential:
    f64 = torch.float64
    return nn.Sequential(
        nn.Linear(3, 5, dtype=f64), nn.Tanh(), nn.Linear(5, 5, dtype=f64), nn.Tanh(),
        nn.Linear(5, 5, dtype=f64), nn.Tanh(), nn.Linear(5, out, dtype=f64),
    )  # fmt: skip


def _stages(model: nn.Sequential, schedule: str) -> list[nn.Sequential]:
    """This rank's chunks of ``model`` in ``schedule``'s placement."""
    r, p = dist.get_rank(), dist.get_world_size()
    v = SCHEDULES_PARTS[schedule]
    parts = partition(model, p * v)
    if schedule == "zbv":
        return [parts[r], parts[2 * p - 1 - r]]
    return parts[r::p] if v > 1 else [parts[r]]


def _grad_diff(stages: Sequence[nn.Module], serial: Sequence[nn.Module]) -> float:
    pairs = [
        pair for s, t in zip(stages, serial, strict=True) for pair in zip(s.parameters(), t.parameters())
    ]
    return max(float((a.grad - b.grad).abs().max()) for a, b in pairs)


def _outer_graph_inputs(schedule: str) -> tuple[float, float, float, float]:
    """The inputs come out of a Linear applied before ``step`` (an embedding outside the
    pipeline): the loss, the serial loss, this rank's largest gradient difference and the
    outer Linear's (on rank 0, which holds the inputs)."""
    torch.manual_seed(0)
    model, outer = _model(), nn.Linear(3, 3, dtype=torch.float64)
    serial, serial_outer = copy.deepcopy(model), copy.deepcopy(outer)
    stages, serial_stages = _stages(model, schedule), _stages(serial, schedule)
    runner = PipelineRunner(stages if len(stages) > 1 else stages[0], schedule, loss_fn=F.mse_loss)
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    loss = runner.step(outer(x), y, n_micro=4)
    ref = F.mse_loss(serial(serial_outer(x)), y)
    ref.backward()
    outer_diff = 0.0
    if dist.get_rank() == 0:
        assert outer.weight.grad is not None
        outer_diff = _grad_diff([outer], [serial_outer])
    assert loss is not None
    return float(loss), float(ref), _grad_diff(stages, serial_stages), outer_diff


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "interleaved", "zbv"])
def test_inputs_made_by_a_graph_outside_the_pipeline_get_their_gradient(
    world2: dc.LocalWorld, schedule: str
) -> None:
    """``step(outer(x), ...)``: every micro-batch's backward ran through the graph the
    micro-batches share (the split of ``outer(x)``), so the second one raised torch's
    "Trying to backward through the graph a second time" on rank 0 where the serial
    model runs. Now the micro-batches are leaves and their gradient goes into the outer
    graph once, after the step: the outer Linear's gradient is the serial one's."""
    for loss, ref, diff, outer_diff in world2.run(_outer_graph_inputs, schedule):
        assert loss == pytest.approx(ref, rel=1e-13)
        assert diff < 1e-13 and outer_diff < 1e-13


SPLIT_SCHEDULES = ["gpipe", "1f1b", "zb-h1", "interleaved", "zbv"]


def _learned_temperature(schedule: str) -> tuple[float, float, float, float]:
    """``loss_fn`` scales the output by a learned temperature (CLIP's ``logit_scale``), a
    parameter of no stage: the loss, the serial loss, this rank's largest stage gradient
    difference and, on the loss's rank, the temperature's."""
    torch.manual_seed(0)
    model = _model()
    serial = copy.deepcopy(model)
    stages, serial_stages = _stages(model, schedule), _stages(serial, schedule)
    temp = nn.Parameter(torch.tensor(0.3, dtype=torch.float64))
    serial_temp = nn.Parameter(torch.tensor(0.3, dtype=torch.float64))
    runner = PipelineRunner(
        stages if len(stages) > 1 else stages[0], schedule, loss_fn=lambda o, t: F.mse_loss(o * temp.exp(), t)
    )
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    loss = runner.step(x, y, n_micro=4)
    ref = F.mse_loss(serial(x) * serial_temp.exp(), y)
    ref.backward()
    temp_diff = 0.0
    if runner.is_last:
        assert temp.grad is not None
        temp_diff = abs(float(temp.grad) - float(serial_temp.grad))  # type: ignore[arg-type]
    assert loss is not None
    return float(loss), float(ref), _grad_diff(stages, serial_stages), temp_diff


def _equal_to_serial(results: list[tuple[float, float, float, float]]) -> None:
    """Every rank's (loss, serial loss, stage gradient difference, outer gradient difference)."""
    for loss, ref, diff, outer_diff in results:
        assert loss == pytest.approx(ref, rel=1e-13)
        assert diff < 1e-13 and outer_diff < 1e-13


@pytest.mark.parametrize("schedule", SPLIT_SCHEDULES)
def test_a_loss_fn_with_a_parameter_of_its_own_gets_its_gradient(
    world2: dc.LocalWorld, schedule: str
) -> None:
    """A split backward's ``W`` computed the gradients of the chunk's parameters only: a
    parameter the loss reaches outside every stage (a learned temperature in ``loss_fn``)
    kept ``.grad`` None under GPipe and ZB-H1 (serially 0.362 at one micro-batch), and
    1F1B gave it the unsplit micro-batches' part only (0.228 for 0.215, 0.043 for 0.150 at
    4). ``W`` now computes every leaf's gradient the micro-batch's graph reaches."""
    _equal_to_serial(world2.run(_learned_temperature, schedule))


def _outer_graph_targets(schedule: str) -> tuple[float, float, float, float]:
    """The targets come out of a Linear applied before ``step`` (a teacher trained with
    the model): the loss, the serial loss, this rank's largest stage gradient difference
    and, on the loss's rank, the teacher's."""
    torch.manual_seed(0)
    model, teacher = _model(), nn.Linear(3, 2, dtype=torch.float64)
    serial, serial_teacher = copy.deepcopy(model), copy.deepcopy(teacher)
    stages, serial_stages = _stages(model, schedule), _stages(serial, schedule)
    runner = PipelineRunner(stages if len(stages) > 1 else stages[0], schedule, loss_fn=F.mse_loss)
    x, z = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    loss = runner.step(x, teacher(z), n_micro=4)
    ref = F.mse_loss(serial(x), serial_teacher(z))
    ref.backward()
    teacher_diff = 0.0
    if runner.is_last:
        assert teacher.weight.grad is not None
        teacher_diff = _grad_diff([teacher], [serial_teacher])
    assert loss is not None
    return float(loss), float(ref), _grad_diff(stages, serial_stages), teacher_diff


@pytest.mark.parametrize("schedule", SPLIT_SCHEDULES)
def test_targets_made_by_a_graph_outside_the_pipeline_get_their_gradient(
    world2: dc.LocalWorld, schedule: str
) -> None:
    """``step(x, teacher(z))``: the teacher got no gradient from a split backward (its
    ``W`` stopped at the chunk's parameters: None under GPipe and ZB-H1), or the unsplit
    micro-batches' part under 1F1B — whose backward through the graph the micro-batches
    share freed it for the next. Now the targets' micro-batches are leaves, and their
    gradient goes into the outer graph once, after the step, as for the inputs."""
    _equal_to_serial(world2.run(_outer_graph_targets, schedule))


def _one_outer_graph_for_inputs_and_targets() -> tuple[float, float, float, float]:
    """``step(h, h)`` with ``h = outer(z)`` (an autoencoder behind an outer layer) under
    ZB-V, whose rank 0 holds the first and the last stage: the loss, the serial loss, this
    rank's largest stage gradient difference and rank 0's outer-layer difference."""
    torch.manual_seed(0)
    model, outer = _model(out=3), nn.Linear(3, 3, dtype=torch.float64)
    serial, serial_outer = copy.deepcopy(model), copy.deepcopy(outer)
    stages, serial_stages = _stages(model, "zbv"), _stages(serial, "zbv")
    runner = PipelineRunner(stages, "zbv", loss_fn=F.mse_loss)
    z = torch.randn(8, 3, dtype=torch.float64)
    h = outer(z)
    loss = runner.step(h, h, n_micro=4)
    hs = serial_outer(z)
    ref = F.mse_loss(serial(hs), hs)
    ref.backward()
    outer_diff = _grad_diff([outer], [serial_outer]) if dist.get_rank() == 0 else 0.0
    assert loss is not None
    return float(loss), float(ref), _grad_diff(stages, serial_stages), outer_diff


def test_inputs_and_targets_of_one_outer_graph_on_one_rank(world2: dc.LocalWorld) -> None:
    """The inputs' and the targets' gradients go into a graph outside the step in one
    backward: each alone freed the graph the other needed (torch's "backward through the
    graph a second time" on rank 0, holding both ends of the V)."""
    for loss, ref, diff, outer_diff in world2.run(_one_outer_graph_for_inputs_and_targets):
        assert loss == pytest.approx(ref, rel=1e-13)
        assert diff < 1e-13 and outer_diff < 1e-13


def _loss_of_shape_1(schedule: str) -> tuple[float, float, float]:
    torch.manual_seed(0)
    model = _model()
    serial = copy.deepcopy(model)
    stages, serial_stages = _stages(model, schedule), _stages(serial, schedule)

    def loss_fn(out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, tgt).reshape(1)  # one element, not 0-dim (a keepdim sum)

    runner = PipelineRunner(stages if len(stages) > 1 else stages[0], schedule, loss_fn=loss_fn)
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    loss = runner.step(x, y, n_micro=3)
    ref = loss_fn(serial(x), y)
    ref.backward()
    assert loss is not None and loss.shape == ()
    return float(loss), float(ref), _grad_diff(stages, serial_stages)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_a_one_element_loss_that_is_not_0_dim_is_a_scalar(world2: dc.LocalWorld, schedule: str) -> None:
    """A ``loss_fn`` returning shape ``(1,)`` passed the scalar check (one element) and
    then failed on the last stage inside the runner's sum with torch's "output with shape
    [] doesn't match the broadcast shape [1]"; ``loss.backward()`` takes it serially."""
    for loss, ref, diff in world2.run(_loss_of_shape_1, schedule):
        assert loss == pytest.approx(ref, rel=1e-13)
        assert diff < 1e-13


def _ignore_index_losses() -> tuple[float, float, float, float]:
    """Cross-entropy with ``ignore_index``, 3 of the first micro-batch's 4 targets ignored:
    the step loss as documented (the mean over micro-batches), the full-batch loss, and
    with a sum-reduced loss over the batch's count of kept targets: its loss and gradient
    difference against the full batch's."""
    torch.manual_seed(0)
    model = _model(out=4)
    serial = copy.deepcopy(model)
    stages, serial_stages = _stages(model, "1f1b"), _stages(serial, "1f1b")
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randint(0, 4, (8,))
    y[:3] = -100
    m = 2
    plain = PipelineRunner(stages[0], "1f1b", loss_fn=F.cross_entropy)
    per_micro = plain.step(x, y, n_micro=m)
    model.zero_grad()
    kept = int((y != -100).sum())  # of the whole batch, known on the last stage

    def token_mean(out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        # the step divides by n_micro: undo it, and divide by the batch's kept targets
        return F.cross_entropy(out, tgt, reduction="sum") * m / kept

    loss = PipelineRunner(stages[0], "1f1b", loss_fn=token_mean).step(x, y, n_micro=m)
    ref = F.cross_entropy(serial(x), y)
    ref.backward()
    assert per_micro is not None and loss is not None
    return float(per_micro), float(ref), float(loss) - float(ref), _grad_diff(stages, serial_stages)


def test_a_mean_over_unequal_micro_batches_is_the_mean_of_their_means(world2: dc.LocalWorld) -> None:
    """The step loss is the mean over micro-batches of ``loss_fn``: for a mean whose
    denominator differs per micro-batch (``ignore_index``, class weights, a mask) that is
    not the full-batch loss (1.085 against 1.157 here, with no error). A sum-reduced
    ``loss_fn`` scaled by ``n_micro`` over the batch's count gives the full batch's."""
    for per_micro, ref, diff, grad_diff in world2.run(_ignore_index_losses):
        assert abs(per_micro - ref) > 0.01
        assert abs(diff) < 1e-13 and grad_diff < 1e-13


class _ToComplex(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.complex(x, x.flip(-1))


class _ToReal(nn.Module):
    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.view_as_real(z).flatten(-2)


def _complex_activations(schedule: str) -> tuple[float, float, float]:
    """Complex activations across every stage boundary (the V turn's too)."""
    torch.manual_seed(0)
    c128 = torch.complex128
    model = nn.Sequential(
        _ToComplex(), nn.Linear(3, 3, dtype=c128), nn.Linear(3, 3, dtype=c128),
        nn.Linear(3, 3, dtype=c128), nn.Linear(3, 3, dtype=c128), _ToReal(),
    )  # fmt: skip
    serial = copy.deepcopy(model)
    stages, serial_stages = _stages(model, schedule), _stages(serial, schedule)
    runner = PipelineRunner(stages if len(stages) > 1 else stages[0], schedule, loss_fn=F.mse_loss)
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 6, dtype=torch.float64)
    loss = runner.step(x, y, n_micro=3)
    ref = F.mse_loss(serial(x), y)
    ref.backward()
    assert loss is not None
    return float(loss), float(ref), _grad_diff(stages, serial_stages)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "interleaved", "zbv"])
def test_complex_activations_between_stages(world2: dc.LocalWorld, schedule: str) -> None:
    """A complex activation's send token was complex, and its backward raised torch's
    "grad can be implicitly created only for real scalar outputs" on the sending rank
    (the others waited for its gradient); the token is real now."""
    for loss, ref, diff in world2.run(_complex_activations, schedule):
        assert loss == pytest.approx(ref, rel=1e-13)
        assert diff < 1e-13
