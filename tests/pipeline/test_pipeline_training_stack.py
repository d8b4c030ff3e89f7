"""Pipelines inside torch's training stack: ``DistributedDataParallel`` around each stage
over the data-parallel axis (pp x dp on 4 ranks), against the serial float64 model.

Real processes: torch's DDP needs real process groups (no in-process world).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import diffcomm as dc
from diffcomm.pipeline import PipelineRunner, partition

F = nn.functional


def _pp_dp(m: int, schedule: str, accum: int) -> float:
    """Pipelines {0, 2} and {1, 3}; DDP over {0, 1} (stage 0) and {2, 3} (stage 1); each
    pipeline its own data; ``accum`` steps, all but the last under ``no_sync()``. Returns
    the largest difference of this stage's gradients from the serial model's (the loss:
    the mean over both replicas' batches, summed over the accumulated steps)."""
    r = dist.get_rank()
    pp = [dist.new_group([0, 2]), dist.new_group([1, 3])][r % 2]
    dp = [dist.new_group([0, 1]), dist.new_group([2, 3])][r // 2]
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh()).double()
    serial = copy.deepcopy(net)
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(4 * m, 4, dtype=torch.float64, generator=g) for _ in range(2 * accum)]
    ys = [torch.randn(4 * m, 4, dtype=torch.float64, generator=g) for _ in range(2 * accum)]
    stage = partition(net, 2)[r // 2]
    wrapped = DDP(stage, process_group=dp)
    runner = PipelineRunner(wrapped, schedule, group=pp, loss_fn=F.mse_loss)
    for a in range(accum):
        x, y = xs[2 * a + r % 2], ys[2 * a + r % 2]
        if a < accum - 1:
            with wrapped.no_sync():
                runner.step(x, y, n_micro=m)
        else:
            runner.step(x, y, n_micro=m)
    for a in range(accum):
        (sum(F.mse_loss(serial(xs[2 * a + i]), ys[2 * a + i]) for i in range(2)) / 2).backward()
    pairs = zip(stage.parameters(), partition(serial, 2)[r // 2].parameters(), strict=True)
    return max((p.grad - q.grad).abs().max().item() for p, q in pairs)


@pytest.mark.parametrize(("m", "schedule", "accum"), [(2, "1f1b", 1), (2, "zb-h1", 1), (2, "gpipe", 2)])
def test_ddp_around_each_stage_matches_serial(
    world4: dc.LocalWorld, m: int, schedule: str, accum: int
) -> None:
    """DDP arms its reduction in each forward for the backward after it; a pipeline runs
    several micro-batches' forwards before their backwards, so DDP averaged part of the
    micro-batches' gradients and left the rest unsynced: 0.11 (1F1B, stage 0) to 0.13
    (GPipe, ZB-H1, both stages) off the serial gradients at ``n_micro=2``, no error. The
    runner now runs DDP's forwards under ``no_sync()`` and averages once per step."""
    for worst in world4.run(_pp_dp, m, schedule, accum):
        assert worst < 1e-12


def _ddp_over_the_pipeline() -> None:
    r = dist.get_rank()
    pp = [dist.new_group([0, 2]), dist.new_group([1, 3])][r % 2]
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh()).double()
    wrapped = DDP(partition(net, 2)[r // 2])  # the world: both stages in one DDP group
    with pytest.raises(ValueError, match=r"`stage` must be a stage in DistributedDataParallel over the "
                       r"data-parallel group only .*got DDP over the ranks \[0, 1, 2, 3\]"):  # fmt: skip
        PipelineRunner(wrapped, "1f1b", group=pp, loss_fn=F.mse_loss)


def test_ddp_over_the_pipelines_ranks_is_refused(world4: dc.LocalWorld) -> None:
    """``DDP(stage)`` over the world around equal-shaped stages broadcast stage 0's
    weights over stage 1 and averaged the two stages' gradients: 0.24 / 0.31 off serial
    after one step, no error. Refused by the runner, on every rank, before communicating."""
    world4.run(_ddp_over_the_pipeline)


def test_grad_norm_of_a_pipeline_stage_needs_the_pipeline_group() -> None:
    """``clip_grad_norm_(stage, max_norm)`` without ``pipeline_group`` took one stage's norm
    (stage 0: 1.72 of the serial 7.27 here) and each stage clipped by its own factor, no
    error. A stage of :func:`partition` now needs ``pipeline_group`` (no communication)."""
    from diffcomm import parallel

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).double()
    net(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
    stages = partition(net, 2)
    for fn in (parallel.grad_norm, lambda m: parallel.clip_grad_norm_(m, 0.1)):
        with pytest.raises(ValueError, match=r"`pipeline_group` must be the group over the pipeline's "
                           r"stages .*got None for partition's stage\(s\) \[0\] of 2"):  # fmt: skip
            fn(stages[0])
    # every stage in one module (one process): the model's norm, as torch's
    whole = nn.ModuleList(stages)
    want = torch.nn.utils.get_total_norm([p.grad for p in net.parameters()])
    torch.testing.assert_close(parallel.grad_norm(whole), want, rtol=1e-12, atol=0)


class _Head(nn.Module):
    """A tied LM head: the embedding's weight, transposed."""

    def __init__(self, emb: nn.Embedding) -> None:
        super().__init__()
        self.emb = emb

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.emb.weight)


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _tied_pp_dp_accumulated() -> tuple[dict[str, float], torch.Tensor]:
    """Pipelines {0, 2} and {1, 3} of a tied LM (embedding in stage 0, its head in stage
    1), DDP over {0, 1} and {2, 3}; two runner steps per optimizer step, the first under
    ``no_sync()``; clipped with ``pipeline_group=`` and stepped twice. The largest
    difference of this stage's gradients and parameters from the serial model's, and the
    tied weight (for the copies on ranks 0 and 2)."""
    import warnings

    from diffcomm import parallel

    r = dist.get_rank()
    pp = [dist.new_group([0, 2]), dist.new_group([1, 3])][r % 2]
    dp = [dist.new_group([0, 1]), dist.new_group([2, 3])][r // 2]
    torch.manual_seed(0)
    emb = nn.Embedding(11, 6, dtype=torch.float64)
    model = nn.Sequential(emb, nn.Linear(6, 6, dtype=torch.float64), nn.Tanh(), _Head(emb))
    serial = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (partition's warning about the tie)
        stage, serial_stage = (partition(m, 2, balance=[2, 2])[r // 2] for m in (model, serial))
    wrapped = DDP(stage, process_group=dp)
    runner = PipelineRunner(wrapped, "1f1b", group=pp, loss_fn=_lm_loss)
    opt = torch.optim.SGD(stage.parameters(), lr=0.5, momentum=0.9)
    serial_opt = torch.optim.SGD(serial.parameters(), lr=0.5, momentum=0.9)
    g = torch.Generator().manual_seed(7)
    out = {"grads": 0.0, "norm": 0.0}
    for _ in range(2):
        for a in range(2):
            ids, tgt = (torch.randint(11, (2, 4, 3), generator=g) for _ in range(2))
            with wrapped.no_sync() if a == 0 else contextlib.nullcontext():
                runner.step(ids[r % 2], tgt[r % 2], n_micro=2)
            (sum(_lm_loss(serial(ids[i]), tgt[i]) for i in range(2)) / 2).backward()
        pairs = list(zip(stage.parameters(), serial_stage.parameters(), strict=True))
        out["grads"] = max([out["grads"]] + [(p.grad - q.grad).abs().max().item() for p, q in pairs])
        total = parallel.clip_grad_norm_(wrapped, 0.05, pipeline_group=pp)
        ref = torch.nn.utils.clip_grad_norm_(serial.parameters(), 0.05)
        out["norm"] = max(out["norm"], float((total - ref).abs()))
        opt.step()
        serial_opt.step()
        opt.zero_grad()
        serial_opt.zero_grad()
    pairs = list(zip(stage.parameters(), serial_stage.parameters(), strict=True))
    out["params"] = max((p - q).abs().max().item() for p, q in pairs)
    return out, emb.weight.detach().clone()


def test_a_tied_weight_accumulated_under_no_sync_is_averaged(world4: dc.LocalWorld) -> None:
    """The runner set a tied weight's gradient from before the step aside, averaged the
    step's part over DDP's group and added the held part back: a part accumulated under the
    user's ``no_sync()`` was never averaged (the tied embedding 0.09 off the serial
    gradient, the parameters 0.002 after two clipped steps, no error). The ties are now
    summed first and DDP averages the whole accumulated gradient; the copies stay equal."""
    res = world4.run(_tied_pp_dp_accumulated)
    for out, _ in res:
        assert max(out.values()) < 1e-12, out
    assert torch.equal(res[0][1], res[2][1]) and torch.equal(res[1][1], res[3][1])
