"""A stage whose output gets no gradient downstream keeps ``.grad`` as serially.

A later stage that uses the previous stage's output only under ``torch.no_grad`` (here a
``detach``), or a loss that does not depend on the output for a micro-batch: serially the
earlier parameters' gradient stays ``None`` (or, accumulated from earlier steps,
unchanged), and AdamW skips them. Before, the runner sent zeros upstream and the earlier
stages' parameters got zero gradients, which AdamW's weight decay moved. Checked against
the serial float64 model run micro-batch by micro-batch (its gradients accumulated), on
every schedule, 2 and 3 ranks, in-process.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import diffcomm as dc
from diffcomm.pipeline import PipelineRunner, partition

pytestmark = pytest.mark.diffcomm_in_process

#: a target whose first entry is this marks a micro-batch whose loss takes no gradient
_MARK = 1000.0


class _Cut(nn.Module):
    """The identity; ``x.detach()`` when ``off`` is True (the earlier stages get no
    gradient); ``x * 0`` when it is ``"zero"`` (a gradient exactly zero: a zero tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.off: bool | str = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.off == "zero":
            return x * 0.0
        return x.detach() if self.off else x


def _loss(out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    """MSE; without gradient for a micro-batch whose target is marked."""
    if float(tgt[0, 0]) == _MARK:
        return nn.functional.mse_loss(out.detach(), tgt)
    return nn.functional.mse_loss(out, tgt)


def _model(n: int) -> nn.Sequential:
    """``n`` blocks (one per virtual stage); block ``n // 2`` starts with the cut."""
    torch.manual_seed(0)
    blocks = []
    for i in range(n):
        layers: list[nn.Module] = [_Cut()] if i == n // 2 else []
        layers += [nn.Linear(4, 4, dtype=torch.float64), nn.Tanh()]
        blocks.append(nn.Sequential(*layers))
    return nn.Sequential(*blocks)


def _none_like_serial(schedule: str) -> list[str]:
    rank, p = dist.get_rank(), dist.get_world_size()
    v = 2 if schedule in ("interleaved", "zbv", "dualpipev") else 1
    n, n_micro = p * v, 2 * p
    model = _model(n)
    serial = copy.deepcopy(model)
    parts = partition(model, n, balance=[1] * n)
    mine = [parts[rank], parts[n - 1 - rank]] if schedule in ("zbv", "dualpipev") else parts[rank::p]
    theirs = partition(serial, n, balance=[1] * n)
    refs = [theirs[rank], theirs[n - 1 - rank]] if schedule in ("zbv", "dualpipev") else theirs[rank::p]
    runner = PipelineRunner(mine if v > 1 else mine[0], schedule, loss_fn=_loss)
    opt = torch.optim.AdamW([q for c in mine for q in c.parameters()], lr=0.1)
    opt_ref = torch.optim.AdamW(serial.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    errors: list[str] = []
    # (cut, marked micro-batches, zero the gradients first, optimizer step after)
    plan: list[tuple[bool | str, set[int], bool, bool]] = [
        (False, set(), True, True),
        (True, set(), True, True),  # no gradient upstream of the cut in the whole step
        (False, {1, 3}, True, True),  # some micro-batches without gradient anywhere
        (True, {0, 1, 2, 3, 4, 5}, True, True),  # none anywhere: every .grad stays None
        (False, set(), True, False),
        (True, set(), False, True),  # on top of the last step's gradients: unchanged
        ("zero", set(), True, True),  # a gradient exactly zero stays a zero tensor
    ]
    for k, (cut, marked, zero, step) in enumerate(plan):
        for m in [*model.modules(), *serial.modules()]:
            if isinstance(m, _Cut):
                m.off = cut
        x = torch.randn(2 * n_micro, 4, dtype=torch.float64, generator=g)
        y = torch.randn(2 * n_micro, 4, dtype=torch.float64, generator=g)
        for i in marked:
            if i < n_micro:
                y[2 * i, 0] = _MARK
        if zero:
            opt.zero_grad()
            opt_ref.zero_grad()
        runner.step(x, y, n_micro=n_micro)
        for xm, ym in zip(x.chunk(n_micro), y.chunk(n_micro), strict=True):
            loss = _loss(serial(xm), ym) / n_micro
            if loss.requires_grad:
                loss.backward()
        for c, (chunk, ref) in enumerate(zip(mine, refs, strict=True)):
            for (name, a), b in zip(chunk.named_parameters(), ref.parameters(), strict=True):
                where = f"step {k}, chunk {c} {name}"
                ga, gb = a.grad, b.grad
                if ga is None or gb is None:
                    if (ga is None) != (gb is None):
                        errors.append(f"{where}: grad {'None' if ga is None else 'a tensor'}, serially not")
                elif not torch.allclose(ga, gb, rtol=1e-12, atol=1e-14):
                    errors.append(f"{where}: grad off by {float((ga - gb).abs().max())}")
        if step:
            opt.step()
            opt_ref.step()
    for c, (chunk, ref) in enumerate(zip(mine, refs, strict=True)):
        for (name, a), b in zip(chunk.named_parameters(), ref.parameters(), strict=True):
            err = float((a - b).detach().abs().max())
            if err > 1e-12:
                errors.append(f"after AdamW: chunk {c} {name} off by {err}")
    return errors


_SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev"]


@pytest.mark.parametrize("schedule", _SCHEDULES)
def test_no_gradient_downstream_keeps_none_on_2_ranks(world2: dc.LocalWorld, schedule: str) -> None:
    """Before: the stages before the cut (and, for a marked micro-batch, every stage) got
    zero gradients where the serial model's are None; AdamW then moved them."""
    for errors in world2.run(_none_like_serial, schedule):
        assert not errors, errors


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "zb-h1", "zbv", "dualpipev"])
def test_no_gradient_downstream_keeps_none_on_3_ranks(world3: dc.LocalWorld, schedule: str) -> None:
    """The "no gradient" goes on through a stage that got none (3 ranks: the cut's
    stage is in the middle, or the V turn's)."""
    for errors in world3.run(_none_like_serial, schedule):
        assert not errors, errors
