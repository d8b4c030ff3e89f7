"""The expert-parallel overlap hook: a 2-stage pipeline whose stages each hold an
ExpertParallelMoE, run with 1F1B whose steady-state F and B are fused into Overlap steps,
so one micro-batch's dispatch all_to_all travels while another's backward computes.

World 4 as a 2 x 2 mesh: pipeline groups {0, 2} and {1, 3} (stage = rank // 2), expert
groups {0, 1} and {2, 3} (the two data shards of one stage). Each data shard trains on
its own tokens; the reference is the serial model on both shards' tokens with the sum of
the two losses (diffcomm's sum convention), in float64.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

import diffcomm as dc
from diffcomm.ops import wire
from diffcomm.parallel import ExpertParallelMoE, MoE
from diffcomm.parallel.routing import combine, dispatch, route
from diffcomm.pipeline import (
    MoEStage,
    Overlap,
    PipelineRunner,
    ScheduleError,
    Step,
    check_schedule,
    expand_steps,
    one_f_one_b_overlap_schedule,
    one_f_one_b_schedule,
)
from diffcomm.pipeline import overlap as overlap_module

F64 = torch.float64
H, E, K = 4, 4, 2


def _serial() -> tuple[nn.Sequential, nn.Sequential]:
    torch.manual_seed(3)
    s0 = nn.Sequential(nn.Linear(3, H, dtype=F64), MoE(H, 6, E, K, activation="tanh", dtype=F64, seed=1))
    s1 = nn.Sequential(MoE(H, 6, E, K, activation="tanh", dtype=F64, seed=2), nn.Linear(H, 2, dtype=F64))
    return s0, s1


def _phases_seen(stage: MoEStage) -> list[int]:
    """Wrap ``forward_phases`` to count the phased forwards (the hook really ran)."""
    seen = [0]
    inner = stage.forward_phases

    def counted(x: torch.Tensor):  # type: ignore[no-untyped-def]
        seen[0] += 1
        return (yield from inner(x))

    stage.forward_phases = counted  # type: ignore[method-assign]
    return seen


def _moe_pipeline(n_micro: int, schedule: str) -> dict[str, object]:
    r = dist.get_rank()
    groups = {k: dist.new_group(list(k)) for k in [(0, 2), (1, 3), (0, 1), (2, 3)]}
    pp = groups[(0, 2) if r % 2 == 0 else (1, 3)]
    ep = groups[(0, 1) if r < 2 else (2, 3)]
    stage_id, shard = r // 2, r % 2
    s0, s1 = _serial()
    ref0, ref1 = copy.deepcopy(s0), copy.deepcopy(s1)
    if stage_id == 0:
        stage = MoEStage(s0[0], ExpertParallelMoE.from_serial(s0[1], ep), nn.Identity())
    else:
        stage = MoEStage(nn.Identity(), ExpertParallelMoE.from_serial(s1[0], ep), s1[1])
    seen = _phases_seen(stage)
    combines: list[bool] = []  # per combine of the phased path: returned asynchronously?
    plain_combine = overlap_module.combine

    def recorded(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = plain_combine(*args, **kwargs)
        combines.append(isinstance(out, dc.AsyncTensor))
        return out

    overlap_module.combine = recorded  # type: ignore[assignment]
    fn = one_f_one_b_overlap_schedule if schedule == "overlap" else one_f_one_b_schedule
    runner = PipelineRunner(stage, fn, group=pp, loss_fn=nn.functional.mse_loss, broadcast_loss=False)
    xs = [torch.randn(2 * n_micro, 3, dtype=F64, generator=torch.Generator().manual_seed(s)) for s in (0, 1)]
    ys = [
        torch.randn(2 * n_micro, 2, dtype=F64, generator=torch.Generator().manual_seed(10 + s))
        for s in (0, 1)
    ]
    try:
        # input_grad: stage 0's B has an input path, so a fused B splits into I (under the
        # dispatch) and W (under the combine); without it stage 0's B is one piece
        runner.step(xs[shard], ys[shard], n_micro=n_micro, input_grad=schedule == "overlap")
    finally:
        overlap_module.combine = plain_combine  # type: ignore[assignment]
    # the replicated parameters (Linear, router): sum over the data shards
    stage.moe.sync_replicated_grads()
    for q in [*stage.pre.parameters(), *stage.post.parameters()]:
        assert q.grad is not None
        q.grad = dc.all_reduce(q.grad, "sum", ep)
    # the serial model over both shards, the two losses summed
    xs_ref = [x.clone().requires_grad_() for x in xs]
    loss = sum(nn.functional.mse_loss(ref1(ref0(x)), y) for x, y in zip(xs_ref, ys))
    loss.backward()  # type: ignore[union-attr]
    ref_stage = ref0 if stage_id == 0 else ref1
    ref_moe = ref_stage[1] if stage_id == 0 else ref_stage[0]
    ref_dense = ref_stage[0] if stage_id == 0 else ref_stage[1]
    mine_dense = stage.pre if stage_id == 0 else stage.post
    for a, b in zip(mine_dense.parameters(), ref_dense.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-11, atol=1e-13)
    for a, b in zip(stage.moe.router.parameters(), ref_moe.router.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-11, atol=1e-13)
    per = E // 2
    for a_exp, b_exp in zip(
        stage.moe.experts, list(ref_moe.experts)[shard * per : (shard + 1) * per], strict=True
    ):
        for a, b in zip(a_exp.parameters(), b_exp.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-11, atol=1e-13)
    if stage_id == 0 and schedule == "overlap":
        torch.testing.assert_close(runner.input_grad, xs_ref[shard].grad, rtol=1e-11, atol=1e-13)
    assert wire.SENDS.pending() == 0
    overlapped = [(e.kind, e.micro) for e in runner.timeline if e.overlap]
    # the fused B ran as I (under the dispatch; its input gradient left: sent) then W
    # (under the combine): every overlapped B's entry has its sent mark
    split = all(e.sent is not None for e in runner.timeline if e.overlap and e.kind == "B")
    return {
        "phased": seen[0],
        "overlapped": overlapped,
        "busy_ok": all(e.busy >= 0 for e in runner.timeline),
        "async_combines": combines,
        "split": split,
    }


@pytest.mark.parametrize("schedule", ["overlap", "plain"])
def test_moe_dispatch_overlaps_another_micro_batchs_backward(
    local_worlds: Callable[[int], dc.LocalWorld], schedule: str
) -> None:
    n_micro = 4
    out = local_worlds(4).run(_moe_pipeline, n_micro, schedule)
    sched = one_f_one_b_overlap_schedule(2, n_micro)
    check_schedule(sched, 2, n_micro)
    for r, o in enumerate(out):
        n_overlaps = sum(isinstance(st, Overlap) for st in sched[r // 2])
        # the hook ran for every fused forward (and only there), gradients equal serial
        assert o["phased"] == (n_overlaps if schedule == "overlap" else 0)
        assert len(o["overlapped"]) == (2 * n_overlaps if schedule == "overlap" else 0)
        assert o["busy_ok"]
        # the combine all_to_all was posted asynchronously in every phased forward (the
        # other micro-batch's W ran while it travelled), and the fused B was split
        assert o["async_combines"] == [True] * (n_overlaps if schedule == "overlap" else 0)
        assert o["split"]


def _combine_async_equals_blocking() -> None:
    torch.manual_seed(dist.get_rank())
    x = torch.randn(6, H, dtype=F64, requires_grad=True)
    logits = torch.randn(6, E, dtype=F64, requires_grad=True)
    expert = nn.Linear(H, 3, dtype=F64)
    results = []
    for async_op in (False, True):
        gate, index, _ = route(logits, K)
        h, plan = dispatch(x, index, E, None)
        y = combine(expert(h), gate, plan, async_op=async_op)
        assert isinstance(y, dc.AsyncTensor) == async_op
        y = y.wait() if async_op else y  # type: ignore[attr-defined]
        g = torch.randn(y.shape, dtype=F64, generator=torch.Generator().manual_seed(5))
        # first and second order: the gradient's norm differentiated again
        gx, gl = torch.autograd.grad(y, [x, logits], g, create_graph=True)
        gg = torch.autograd.grad((gx.square().sum() + gl.square().sum()), [x, logits, expert.weight])
        results.append([y.detach(), gx.detach(), gl.detach(), *gg])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-14)


def test_combine_async_equals_the_blocking_combine(world2: dc.LocalWorld) -> None:
    world2.run(_combine_async_equals_blocking)


def test_overlap_schedule_is_1f1b_with_fused_pairs() -> None:
    for p, m in [(2, 3), (2, 4), (4, 8), (3, 5)]:
        fused, base = one_f_one_b_overlap_schedule(p, m), one_f_one_b_schedule(p, m)
        check_schedule(fused, p, m)
        assert [expand_steps(s) for s in fused] == base  # 1F1B's order and bound
        assert not any(isinstance(st, Overlap) for st in fused[-1])  # the last rank plain
        for s in fused[:-1]:
            assert any(isinstance(st, Overlap) for st in s)
            assert all(st.forward.micro != st.backward.micro for st in s if isinstance(st, Overlap))
    assert str(one_f_one_b_overlap_schedule(2, 3)) == "[[F0, (F1;B0), (F2;B1), B2], [F0, B0, F1, B1, F2, B2]]"
    # fusing the last rank's F{i+1} with B{i} too: each overlapped step waits for what the
    # other sends only at its end (an Overlap's outputs leave together): refused
    last = [
        Step("F", 0),
        Overlap(Step("F", 1), Step("B", 0)),
        Overlap(Step("F", 2), Step("B", 1)),
        Step("B", 2),
    ]
    with pytest.raises(ScheduleError, match=r"deadlock: stage 0 step 1 \(\(F1;B0\)\) waits for the gradient"):
        check_schedule([one_f_one_b_overlap_schedule(2, 3)[0], last], 2, 3)
    with pytest.raises(TypeError, match="`moe` must be an ExpertParallelMoE"):
        MoEStage(nn.Identity(), nn.Linear(2, 2), nn.Identity())  # type: ignore[arg-type]
