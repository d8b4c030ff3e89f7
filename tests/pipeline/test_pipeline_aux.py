"""An auxiliary loss of an earlier pipeline stage: the load-balancing loss of an
ExpertParallelMoE in stage 0, attached to the stage's output with ``add_aux_loss``.

World 4 as a 2 x 2 mesh: pipeline groups {0, 2} and {1, 3} (stage = rank // 2), expert
groups {0, 1} and {2, 3} (the two data shards of a stage). The reference is the serial
float64 model on both shards' tokens: per micro-batch the two shards' mse losses plus
``C`` times the serial MoE's aux loss over both shards' tokens of that micro-batch (the
shards' micro-batch ``m`` are dispatched together), averaged over micro-batches.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import diffcomm as dc
from diffcomm.parallel import ExpertParallelMoE, MoE
from diffcomm.pipeline import PipelineRunner, add_aux_loss

F64 = torch.float64
H, E, K, C = 4, 4, 2, 0.5


class _MoEStage(nn.Module):
    def __init__(self, lin: nn.Module, moe: nn.Module) -> None:
        super().__init__()
        self.lin, self.moe = lin, moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return add_aux_loss(self.moe(self.lin(x)), C * self.moe.aux_loss)

    def serial(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference: the output, and the aux loss to add to the objective by hand
        (add_aux_loss weighs it 1 outside a step, whatever the loss is later scaled by)."""
        return self.moe(self.lin(x)), C * self.moe.aux_loss


def _aux_of_stage_0(schedule: str, n_micro: int) -> float:
    r = dist.get_rank()
    groups = {k: dist.new_group(list(k)) for k in [(0, 2), (1, 3), (0, 1), (2, 3)]}
    pp, ep = groups[(0, 2) if r % 2 == 0 else (1, 3)], groups[(0, 1) if r < 2 else (2, 3)]
    torch.manual_seed(3)
    lin, moe, head = (
        nn.Linear(3, H, dtype=F64),
        MoE(H, 6, E, K, activation="tanh", dtype=F64, seed=1),
        nn.Linear(H, 2, dtype=F64),
    )
    ref = _MoEStage(copy.deepcopy(lin), copy.deepcopy(moe))
    ref_head = copy.deepcopy(head)
    stage = _MoEStage(lin, ExpertParallelMoE.from_serial(moe, ep)) if r < 2 else head
    runner = PipelineRunner(stage, schedule, group=pp, loss_fn=nn.functional.mse_loss)
    xs = [torch.randn(2 * n_micro, 3, dtype=F64, generator=torch.Generator().manual_seed(s)) for s in (0, 1)]
    ys = [
        torch.randn(2 * n_micro, 2, dtype=F64, generator=torch.Generator().manual_seed(9 + s)) for s in (0, 1)
    ]
    runner.step(xs[r % 2], ys[r % 2], n_micro=n_micro)
    if r < 2:
        stage.moe.sync_replicated_grads()
    for q in (stage.lin if r < 2 else stage).parameters():
        assert q.grad is not None
        q.grad = dc.all_reduce(q.grad, "sum", ep)  # the data shards' parts
    total = torch.zeros((), dtype=F64)
    for x0, x1, y0, y1 in zip(*(t.chunk(n_micro) for t in (*xs, *ys))):
        z, aux = ref.serial(torch.cat([x0, x1]))
        out = ref_head(z)
        total = (
            total + nn.functional.mse_loss(out[: len(x0)], y0) + nn.functional.mse_loss(out[len(x0) :], y1)
        )
        total = total + aux
    (total / n_micro).backward()
    if r >= 2:
        pairs = list(zip(stage.parameters(), ref_head.parameters(), strict=True))
    else:
        per = E // 2
        experts = list(ref.moe.experts)[(r % 2) * per : (r % 2 + 1) * per]
        mine = [*stage.lin.parameters(), *stage.moe.router.parameters(), *stage.moe.experts.parameters()]
        theirs = [*ref.lin.parameters(), *ref.moe.router.parameters()]
        theirs += [q for e in experts for q in e.parameters()]
        pairs = list(zip(mine, theirs, strict=True))
    return max(float((a.grad - b.grad).abs().max()) for a, b in pairs)


@pytest.mark.parametrize("schedule, n_micro", [("1f1b", 2), ("zb-h1", 3)])
def test_aux_loss_of_an_earlier_stage_counts_once_per_micro_batch(
    world4: dc.LocalWorld, schedule: str, n_micro: int
) -> None:
    # Without add_aux_loss an earlier stage's aux loss had no way into the objective (a
    # stage sends one tensor; loss_fn runs on the last): the router trained without it.
    assert max(world4.run(_aux_of_stage_0, schedule, n_micro)) < 1e-12


def test_add_aux_loss_checks_its_arguments() -> None:
    y = torch.ones(2, requires_grad=True)
    with pytest.raises(ValueError, match=r"add_aux_loss\(\): `aux` must be one element"):
        add_aux_loss(y, torch.ones(2, requires_grad=True))
    with pytest.raises(TypeError, match=r"`aux` must be a floating-point tensor"):
        add_aux_loss(y, torch.ones((), dtype=torch.int64))
    # integer ids (for the next stage's embedding) have no backward to carry aux's
    # gradient: it was None, with no error
    w = torch.ones(3, dtype=F64, requires_grad=True)
    with pytest.raises(TypeError, match=r"add_aux_loss\(\): `y` must be a floating-point tensor"):
        add_aux_loss(torch.tensor([1, 0]), w.square().sum())
    assert add_aux_loss(torch.tensor([1, 0]), torch.ones((), dtype=F64)).dtype == torch.int64
    aux = torch.tensor(2.0, requires_grad=True)
    out = add_aux_loss(y * 3, aux * 5)
    out.sum().backward()  # outside a step: weight 1
    assert torch.equal(y.grad, torch.full((2,), 3.0)) and torch.equal(aux.grad, torch.tensor(5.0))


# --------------------------------------------------------------------------------------
# add_aux_loss under a GradScaler (docs/pipeline.md, "Mixed precision")
# --------------------------------------------------------------------------------------

_SCALE = 2.0**10


class _AuxStage(nn.Module):
    """Stage 0: ``tanh(lin(x))`` with an auxiliary loss of its own weight, scaled by
    ``scaler`` as the docs say, or attached unscaled (the old recipe)."""

    def __init__(self, lin: nn.Module, scaler: torch.amp.GradScaler | None) -> None:
        super().__init__()
        self.lin, self.scaler = lin, scaler

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        aux = 0.5 * self.lin.weight.square().sum()
        return add_aux_loss(torch.tanh(self.lin(x)), aux if self.scaler is None else self.scaler.scale(aux))


def _scaled_aux_step(scale_aux: bool) -> float:
    """One GradScaler step of a 2-stage pipeline (the loss scaled in ``loss_fn``), stage 0
    with an auxiliary loss; the unscaled gradients against the serial float64 model's
    ``mean_m(mse_m + aux_m)``."""
    r = dist.get_rank()
    torch.manual_seed(0)
    lin, head = nn.Linear(4, 4, dtype=F64), nn.Linear(4, 2, dtype=F64)
    ref_lin, ref_head = copy.deepcopy(lin), copy.deepcopy(head)
    scaler = torch.amp.GradScaler("cpu", init_scale=_SCALE)
    stage = _AuxStage(lin, scaler if scale_aux else None) if r == 0 else head
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    mse = nn.functional.mse_loss
    runner = PipelineRunner(stage, "1f1b", loss_fn=lambda out, t: scaler.scale(mse(out, t)))
    if r != runner.last_rank:
        scaler.scale(torch.zeros((), dtype=F64))  # (the docs' recipe: every rank has a scale)
    g = torch.Generator().manual_seed(1)
    x, t = torch.randn(4, 4, dtype=F64, generator=g), torch.randn(4, 2, dtype=F64, generator=g)
    runner.step(x, t, n_micro=2)
    scaler.unscale_(opt)
    assert not dc.parallel.sync_found_inf(scaler, opt)
    total = torch.zeros((), dtype=F64)
    for xm, tm in zip(x.chunk(2), t.chunk(2), strict=True):
        total = total + mse(ref_head(torch.tanh(ref_lin(xm))), tm) + 0.5 * ref_lin.weight.square().sum()
    (total / 2).backward()
    ref = ref_lin if r == 0 else ref_head
    return max(float((a.grad - b.grad).abs().max()) for a, b in zip(stage.parameters(), ref.parameters()))


def test_an_aux_loss_under_a_grad_scaler_is_scaled_as_the_loss(world2: dc.LocalWorld) -> None:
    """docs/pipeline.md's GradScaler recipe with an earlier stage's ``add_aux_loss``: the
    aux loss attached as ``scaler.scale(aux)`` gives the serial gradients. Attached
    unscaled (what the two recipes gave together before the docs said to scale it), its
    gradient is divided by the scale at ``unscale_``: stage 0's weight 0.47 off, silently."""
    assert max(world2.run(_scaled_aux_step, True)) < 1e-12
    off, last = world2.run(_scaled_aux_step, False)
    assert last < 1e-12 and off > 0.1  # the aux loss's gradient / 1024 on stage 0 only
    text = " ".join((Path(__file__).resolve().parents[2] / "docs" / "pipeline.md").read_text().split())
    assert "add_aux_loss(y, scaler.scale(0.01 * moe.aux_loss))" in text  # the recipe says so
