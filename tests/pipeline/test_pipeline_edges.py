"""Programs that ended in a torch error on one rank while the others waited for it (a
collective timeout under ``torchrun``), now run as serially or are refused on every rank:
a reentrant activation checkpoint inside a stage whose backward the schedule splits into
``I`` and ``W`` (against the float64 serial model), and a non-reentrant one, which
recomputed its region in both (a BatchNorm's running statistics counted it); a parallel layer (an
``ExpertParallelMoE``) over the pipeline's own ranks. And one left to the user, pinned as
documented: a ``GradScaler`` across stages needs ``parallel.sync_found_inf``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

import diffcomm as dc
from diffcomm.parallel import ColumnParallelLinear, ExpertParallelMoE
from diffcomm.pipeline import PipelineRunner, partition

F64 = torch.float64


class _Checkpointed(nn.Module):
    """``tanh(lin(x))`` under ``torch.utils.checkpoint`` (reentrant or not)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=F64)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(lambda t: torch.tanh(self.lin(t)), x, use_reentrant=self.reentrant)


def _checkpointed_pipeline(
    schedule: str, grad_first: bool | str | None, reentrant: bool
) -> tuple[float, float]:
    """Every stage a plain Linear then a checkpointed one; the loss's difference to the
    serial model's, and this rank's largest gradient difference."""
    torch.manual_seed(0)
    r, p = dist.get_rank(), dist.get_world_size()
    v = 2 if schedule in ("interleaved", "zbv", "dualpipev") else 1
    model = nn.Sequential(
        *[m for _ in range(p * v) for m in (nn.Linear(4, 4, dtype=F64), _Checkpointed(reentrant))]
    )
    serial = copy.deepcopy(model)
    parts = partition(model, p * v, balance=[2] * (p * v))
    mine = [parts[r], parts[2 * p - 1 - r]] if schedule in ("zbv", "dualpipev") else parts[r::p]
    runner = PipelineRunner(mine if v > 1 else mine[0], schedule, loss_fn=F.mse_loss, grad_first=grad_first)
    x, y = torch.randn(8, 4, dtype=F64), torch.randn(8, 4, dtype=F64)
    loss = runner.step(x, y, n_micro=4)
    ref = F.mse_loss(serial(x), y)
    ref.backward()
    assert loss is not None
    assert all(q.grad is not None for c in mine for q in c.parameters())
    pairs = [(a, b) for a, b in zip(model.parameters(), serial.parameters()) if a.grad is not None]
    return float(loss) - float(ref), max(float((a.grad - b.grad).abs().max()) for a, b in pairs)


@pytest.mark.parametrize(
    "schedule, grad_first",
    [
        ("1f1b", None),  # the default "cooldown": the B steps after the last F split
        ("1f1b", True),
        ("interleaved", None),
        ("zb-h1", None),
        ("zbv", None),
        ("dualpipev", None),
    ],
)
def test_a_reentrant_checkpoint_in_a_split_backward_matches_serial(
    world2: dc.LocalWorld, schedule: str, grad_first: bool | None
) -> None:
    """``checkpoint(..., use_reentrant=True)`` refuses a backward restricted to
    ``inputs=`` (torch's RuntimeError pointing to ``use_reentrant=False``), which both
    ``I`` and ``W`` are: the rank that split a ``B`` raised and its peer waited for the
    gradient. A micro-batch whose graph holds one now runs its backward whole in ``I``
    (the same messages at the same step), equal to the serial model."""
    for loss_diff, grad_diff in world2.run(_checkpointed_pipeline, schedule, grad_first, True):
        assert abs(loss_diff) < 1e-13 and grad_diff < 1e-13


def test_a_non_reentrant_checkpoint_matches_serial(world2: dc.LocalWorld) -> None:
    """``use_reentrant=False`` in a split backward: equal to the serial model, to 1e-13
    (its micro-batches run their backward whole in ``I``: see the next test)."""
    for loss_diff, grad_diff in world2.run(_checkpointed_pipeline, "zb-h1", None, False):
        assert abs(loss_diff) < 1e-13 and grad_diff < 1e-13


class _CheckpointedNorm(nn.Module):
    """``tanh(bn(lin(x)))`` under a non-reentrant checkpoint; the norm's running mean is a
    cumulative average (``momentum=None``), the same in any order of its updates."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=F64)
        self.bn = nn.BatchNorm1d(4, momentum=None, dtype=F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(lambda t: torch.tanh(self.bn(self.lin(t))), x, use_reentrant=False)


def _checkpointed_norm_pipeline(schedule: str, grad_first: bool | str | None) -> list[tuple[int, int, float]]:
    """Per norm of this rank: (batches it counted, the serial model's, running mean off)."""
    torch.manual_seed(0)
    r, p = dist.get_rank(), dist.get_world_size()
    v = 2 if schedule in ("interleaved", "zbv", "dualpipev") else 1
    model = nn.Sequential(*[_CheckpointedNorm() for _ in range(p * v)])
    serial = copy.deepcopy(model)
    parts = partition(model, p * v, balance=[1] * (p * v))
    mine = [parts[r], parts[2 * p - 1 - r]] if schedule in ("zbv", "dualpipev") else parts[r::p]
    runner = PipelineRunner(mine if v > 1 else mine[0], schedule, loss_fn=F.mse_loss, grad_first=grad_first)
    x, y = torch.randn(8, 4, dtype=F64), torch.randn(8, 4, dtype=F64)
    runner.step(x, y, n_micro=4)
    sum(F.mse_loss(serial(xm), ym) for xm, ym in zip(x.chunk(4), y.chunk(4))).backward()
    out = []
    for a, b in zip(model, serial, strict=True):
        if any(a is c[0] for c in mine):
            err = float((a.bn.running_mean - b.bn.running_mean).abs().max())
            out.append((int(a.bn.num_batches_tracked), int(b.bn.num_batches_tracked), err))
    return out


@pytest.mark.diffcomm_in_process
@pytest.mark.parametrize(
    "schedule, grad_first",
    [("gpipe", None), ("1f1b", None), ("1f1b", True), ("interleaved", None), ("zb-h1", None), ("zbv", False)],
)
def test_a_non_reentrant_checkpoint_recomputes_once_per_micro_batch(
    world2: dc.LocalWorld, schedule: str, grad_first: bool | None
) -> None:
    """A non-reentrant checkpoint recomputes its region once per backward call, and a
    split ``B`` is two (``I``, then ``W``): a BatchNorm in it counted each micro-batch three
    times, not twice as serially (``num_batches_tracked`` 16 against 8 at 4 micro-batches;
    its running mean 0.027 off under 1F1B's cooldown, 0.048 under interleaved; no error).
    A micro-batch whose graph holds one now runs its backward whole in ``I``, as for a
    reentrant checkpoint."""
    for per_rank in world2.run(_checkpointed_norm_pipeline, schedule, grad_first):
        assert per_rank
        for counted, serial_counted, err in per_rank:
            assert counted == serial_counted == 8 and err < 1e-13


def _layer_over_the_pipeline(layer: str, where: str) -> str | None:
    """Build this rank's runner with ``layer`` over the world (the pipeline's own group) in
    the stages named by ``where``; the error it raised, or ``None``."""
    r = dist.get_rank()
    if layer == "moe":
        inner: nn.Module = ExpertParallelMoE(4, 6, num_experts=2, k=1, seed=0, dtype=F64)
    else:
        inner = ColumnParallelLinear(4, 4, gather_output=True, seed=0, dtype=F64)
    mine = where == "every" or r == 1
    stage = nn.Sequential(nn.Linear(4, 4, dtype=F64), *([inner] if mine else []))
    try:
        PipelineRunner(stage, "1f1b", loss_fn=F.mse_loss)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("layer", ["moe", "tp"])
@pytest.mark.parametrize("where", ["every", "last"])
def test_a_parallel_layer_over_the_pipelines_ranks_is_refused_at_construction(
    world2: dc.LocalWorld, layer: str, where: str
) -> None:
    """An ``ExpertParallelMoE`` (or a tensor-parallel layer) over the pipeline's own group:
    stage 0's first forward waited in the MoE's counts exchange (the layer's all_gather)
    for rank 1, which waited for stage 0's activation, until the collective timeout. Now
    every rank whose stage holds such a layer refuses it when building the runner, before
    any communication, naming ``stage``, the layer and the way out."""
    errors = world2.run(_layer_over_the_pipeline, layer, where)
    holders = [0, 1] if where == "every" else [1]
    for r, err in enumerate(errors):
        if r not in holders:
            assert err is None
            continue
        assert err is not None
        name = "ExpertParallelMoE" if layer == "moe" else "ColumnParallelLinear"
        assert "`stage`" in err and f"({name}) over the global ranks [0, 1]" in err
        assert "the pipeline's stages [0, 1]" in err and "mesh.get_group('ep')" in err


def _scaled_pipeline_step(sync: bool) -> tuple[bool, float, bool]:
    """One GradScaler step of a 2-stage pipeline, as docs/pipeline.md says (the loss scaled
    in ``loss_fn``, ``scaler.scale(torch.zeros(()))`` on the rank without a loss), with an
    overflow in rank 1's gradients: whether this rank skipped (``sync_found_inf``'s
    answer, or the parameters unchanged), its scale after ``update()``, and whether its
    parameters moved."""
    torch.manual_seed(0)
    r = dist.get_rank()
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    stage = partition(model, 2, balance=[2, 1])[r]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    runner = PipelineRunner(stage, "1f1b", loss_fn=lambda out, t: scaler.scale(F.mse_loss(out, t)))
    if r != runner.last_rank:
        scaler.scale(torch.zeros(()))  # this rank's scaler gets its scale
    before = [q.detach().clone() for q in stage.parameters()]
    runner.step(torch.randn(4, 4), torch.randn(4, 2), n_micro=2)
    if r == 1:
        stage[0].weight.grad[0, 0] = float("inf")  # type: ignore[index]
    scaler.unscale_(opt)
    skipped = dc.parallel.sync_found_inf(scaler, opt) if sync else None
    scaler.step(opt)
    scaler.update()
    moved = any(not torch.equal(a, b) for a, b in zip(before, stage.parameters()))
    return (not moved) if skipped is None else skipped, scaler.get_scale(), moved


@pytest.mark.parametrize("sync", [False, True])
def test_a_grad_scaler_across_stages_needs_sync_found_inf(world2: dc.LocalWorld, sync: bool) -> None:
    """What docs/pipeline.md's recipe is for: ``unscale_`` finds an overflow in stage 1's
    gradients only, so stage 1 skipped its step and halved its scale while stage 0 stepped
    (silently: the runner sees neither the scaler nor the optimizer step, so it has no
    cheap way to tell; see the docs). With ``parallel.sync_found_inf`` both skip."""
    (skip0, scale0, moved0), (skip1, scale1, moved1) = world2.run(_scaled_pipeline_step, sync)
    assert skip1 and not moved1 and scale1 == 2.0**15
    if sync:
        assert skip0 and not moved0 and scale0 == 2.0**15
    else:
        assert moved0 and scale0 == 2.0**16
