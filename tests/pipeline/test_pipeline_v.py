"""Tests for the V-placed schedules (ZB-V, DualPipeV), W placed from step times, and the
validator's V checks: schedules as data, and pipelined == serial in float64.

The parity body builds the model with the same seed on every rank, cuts it into ``2p``
virtual stages, gives rank ``r`` stages ``r`` and ``2p - 1 - r`` (the V placement), and
compares the loss and every parameter gradient with a serial copy inside the rank.
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
from diffcomm.pipeline import (
    SCHEDULES,
    Overlap,
    PipelineRunner,
    ScheduleError,
    Step,
    TimelineEntry,
    check_schedule,
    dualpipev_schedule,
    expand_steps,
    max_in_flight,
    one_f_one_b_schedule,
    partition,
    replayed_bubble,
    schedule_placement,
    stage_owner,
    virtual_stage,
    zb_h1_schedule,
    zbv_schedule,
)

# The V schedules' values and gradients need no real transport: this module's shared worlds are in-
# process (the same values as gloo processes: tests/runtime/test_in_process.py). A test that needs a
# process per rank says why and stays on processes.
pytestmark = pytest.mark.diffcomm_in_process


def _mlp(width: int = 5, depth: int = 4) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(depth):
        layers.append(nn.Linear(width if i else 3, width if i < depth - 1 else 2, dtype=torch.float64))
        if i < depth - 1:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


def _uniform(schedule: list, p: int, f: float = 1.0, i: float = 1.0, w: float = 1.0) -> list:
    """Timelines of ``schedule`` with every step taking its unit time (B = I + W)."""
    dur = {"F": f, "B": i + w, "I": i, "W": w}
    return [
        [TimelineEntry(st.kind, st.micro, 0.0, dur[st.kind], 0.0, st.chunk) for st in expand_steps(steps)]
        for steps in schedule
    ]


# ======================================================================================
# schedules as data
# ======================================================================================


def test_v_placement_maps_ranks_to_stages_and_back() -> None:
    assert [virtual_stage(r, c, 4, "v") for c in (0, 1) for r in range(4)] == [0, 1, 2, 3, 7, 6, 5, 4]
    assert [virtual_stage(r, c, 4) for c in (0, 1) for r in range(4)] == list(range(8))
    for placement in ("loop", "v"):
        for g in range(8):
            r, c = stage_owner(g, 4, placement)
            assert virtual_stage(r, c, 4, placement) == g
    assert schedule_placement(zbv_schedule) == schedule_placement(dualpipev_schedule) == "v"
    assert schedule_placement(zb_h1_schedule) == "loop"
    assert {"zbv", "dualpipev"} <= set(SCHEDULES)


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 10, 12])
def test_zbv_is_valid_and_holds_2p_chunk_activations(p: int, m: int) -> None:
    sched = zbv_schedule(p, m)
    check_schedule(sched, p, m, 2, "v")
    for steps in sched:
        assert sorted(map(str, steps)) == sorted(
            str(Step(k, i, c)) for k in "FIW" for i in range(m) for c in (0, 1)
        )
        assert max_in_flight(steps) <= 2 * p  # p micro-batches of a full stage (1F1B's rank 0)
    # not valid in the loop placement (rank 0's chunk 1 is the last stage there too, but
    # rank p-1's chunk 1 would wait for rank p-2's chunk 0 output...): the placement matters
    if p > 2 and m > 1:
        with pytest.raises(ScheduleError, match="deadlock"):
            check_schedule(sched, p, m, 2, "loop")


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m_per", [2, 3])
@pytest.mark.parametrize("extra", [0, 1])
def test_dualpipev_is_valid_and_overlaps_its_steady_state(p: int, m_per: int, extra: int) -> None:
    m = m_per * p + extra
    sched = dualpipev_schedule(p, m)
    check_schedule(sched, p, m, 2, "v")
    for steps in sched:
        flat = expand_steps(steps)
        assert sorted((st.micro, st.chunk) for st in flat if st.kind == "F") == sorted(
            (i, c) for i in range(m) for c in (0, 1)
        )
        overlaps = [st for st in steps if isinstance(st, Overlap)]
        # every steady-state step is fused: F on one chunk with B on the other
        assert len(overlaps) >= 2 * (m - 2 * p) + 1
        assert all(o.forward.chunk != o.backward.chunk for o in overlaps)
    with pytest.raises(ValueError, match=r"`n_micro` must be an int >= 2 \* n_stages"):
        dualpipev_schedule(p, 2 * p - 1)


@pytest.mark.parametrize(("p", "m"), [(2, 8), (4, 8), (4, 12)])
def test_zbv_and_dualpipev_beat_1f1b_with_uniform_stages(p: int, m: int) -> None:
    # unit-cost replays (F = I = W per chunk; 1F1B's stage is two chunks: F = I = W = 2)
    zbv = replayed_bubble(_uniform(zbv_schedule(p, m), p), "v")
    dpv = replayed_bubble(_uniform(dualpipev_schedule(p, m), p), "v")
    base = replayed_bubble(_uniform(one_f_one_b_schedule(p, m), p, 2, 2, 2))
    assert zbv < base and dpv < base
    assert zbv == pytest.approx(0.0, abs=0.12)  # zero bubble but for the ramp of small m


def _replay(sched: list, costs: list, placement: str = "loop") -> float:
    tl = [
        [TimelineEntry(st.kind, st.micro, 0.0, costs[r][st.kind], 0.0, st.chunk) for st in steps]
        for r, steps in enumerate(sched)
    ]
    return replayed_bubble(tl, placement)


def test_w_placed_from_unequal_step_times_fills_the_holes() -> None:
    # stage 0 has no input gradient (cheap I), the last stage computes the loss (slow F)
    p, m = 4, 8
    costs = [{"F": 1.0, "I": 0.5, "W": 0.8}, {"F": 1.0, "I": 1.1, "W": 0.8},
             {"F": 1.0, "I": 1.1, "W": 0.8}, {"F": 1.3, "I": 1.1, "W": 0.8}]  # fmt: skip
    placed, unit = zb_h1_schedule(p, m, costs=costs), zb_h1_schedule(p, m)
    check_schedule(placed, p, m)
    assert _replay(placed, costs) < _replay(unit, costs) - 0.005  # 0.218 < 0.226
    assert max(map(max_in_flight, placed)) <= min(p, m)  # same memory rule
    # ZB-V with weight gradients twice the forward: torch's fixed order leaves holes
    big_w = [{"F": 1.0, "I": 1.0, "W": 2.0}] * p
    zbv_placed = zbv_schedule(p, m, costs=big_w)
    check_schedule(zbv_placed, p, m, 2, "v")
    assert _replay(zbv_placed, big_w, "v") < _replay(zbv_schedule(p, m), big_w, "v") - 0.02  # 0.045 < 0.073
    assert max(map(max_in_flight, zbv_placed)) <= 2 * p
    # never worse than the unit-time order, whatever the times
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        rnd = [dict(zip("FIW", (0.3 + 1.7 * torch.rand(3, generator=g)).tolist())) for _ in range(p)]
        assert _replay(zb_h1_schedule(p, m, costs=rnd), rnd) <= _replay(unit, rnd) + 1e-12
    with pytest.raises(ValueError, match="`costs` must be mappings with keys 'F', 'I', 'W'"):
        zb_h1_schedule(2, 2, costs=[{"F": 1}, {"F": 1}])
    with pytest.raises(ValueError, match="`costs` must be finite step times > 0"):
        zb_h1_schedule(2, 2, costs={"F": 1, "I": 0, "W": 1})


F, B_, I_, W_ = (lambda m, c=0, k=k: Step(k, m, c) for k in "FBIW")


@pytest.mark.parametrize(
    ("schedule", "n_stages", "n_chunks", "match"),
    [
        # a backward before its forward
        ([[F(0), F(0, 1), I_(0, 1), W_(0, 1), I_(0), W_(0)],
          [I_(0, 1), F(0), F(0, 1), W_(0, 1), I_(0), W_(0)]], 2, 2,
         r"each F before its I, got stage 1 chunk 1: I0 first \(step 0; F0 at step 2\)"),
        # a missing W
        ([[F(0), F(0, 1), I_(0, 1), W_(0, 1), I_(0), W_(0)], [F(0), F(0, 1), I_(0, 1), W_(0, 1), I_(0)]],
         2, 2, r"one backward per micro-batch \(B, or I and W\); micro-batch 0, got stage 1: \['I0'\] "
         r"\(its last step at step 4\)"),
        # V placement on an odd number of virtual stages (one chunk per rank)
        ([[F(0), B_(0)], [F(0), B_(0)], [F(0), B_(0)]], 3, 1,
         r"V placement with exactly 2 chunks per rank .* got stage 0 step 0 \(F0\): 3 ranks x 1 chunks = 3"),
        # the V turn: rank 1's chunk 1 (stage 2) before its chunk 0 (stage 1) made the activation
        ([[F(0), F(0, 1), B_(0, 1), B_(0)], [F(0, 1), F(0), B_(0, 1), B_(0)]], 2, 2,
         r"deadlock: .*stage 1 step 0 \(F0c1\) waits for the activation F0 of virtual stage 1 \(rank 1\)"),
        # an overlap must pair a forward with a backward
        ([[Overlap(F(0), F(0, 1))], [F(0), F(0, 1)]], 2, 2,
         r"an Overlap of an F and a B or I, got stage 0 step 0"),
    ],
)  # fmt: skip
def test_validator_refuses_bad_v_schedules_with_rank_step_and_reason(
    schedule: list, n_stages: int, n_chunks: int, match: str
) -> None:
    with pytest.raises(ScheduleError, match=match):
        check_schedule(schedule, n_stages, 1, n_chunks, "v")


# ======================================================================================
# pipelined == serial (float64): p in {2, 4}, m in {2p, 3p, odd}
# ======================================================================================


def _parity_v(schedule: str, ms: list[int], costs: object = None) -> list[int]:
    rank, p = dist.get_rank(), dist.get_world_size()
    peaks = []
    for k, n_micro in enumerate(ms):
        torch.manual_seed(n_micro)
        model = _mlp(depth=2 * p)
        serial = copy.deepcopy(model)
        x = torch.randn(2 * n_micro, 3, dtype=torch.float64)
        y = torch.randn(2 * n_micro, 2, dtype=torch.float64)
        parts = partition(model, 2 * p)
        mine = [parts[rank], parts[2 * p - 1 - rank]]
        runner = PipelineRunner(mine, schedule, loss_fn=nn.functional.mse_loss, costs=costs, prepost=k != 1)
        for _ in range(2 if costs == "measure" else 1):  # "measure": the 2nd step uses step 1's times
            for q in model.parameters():
                q.grad = None
            ran = runner.steps(n_micro)  # the schedule this step runs (validated)
            loss = runner.step(x, y, n_micro=n_micro, input_grad=True)
        xs = x.clone().requires_grad_()
        ref = nn.functional.mse_loss(serial(xs), y)
        ref.backward()
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-13, atol=1e-15)
        theirs = partition(serial, 2 * p)
        for chunk, ref_chunk in zip(mine, [theirs[rank], theirs[2 * p - 1 - rank]], strict=True):
            pairs = list(zip(chunk.parameters(), ref_chunk.parameters(), strict=True))
            assert pairs
            for a, b in pairs:
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-14)
        if rank == 0:
            torch.testing.assert_close(runner.input_grad, xs.grad, rtol=1e-12, atol=1e-14)
        flat = expand_steps(ran)
        assert [(e.kind, e.micro, e.chunk) for e in runner.timeline] == [
            (s.kind, s.micro, s.chunk) for s in flat
        ]
        fused = {(s.kind, s.micro, s.chunk) for o in ran if isinstance(o, Overlap)
                 for s in (o.forward, o.backward)}  # fmt: skip
        assert {(e.kind, e.micro, e.chunk) for e in runner.timeline if e.overlap} == fused
        assert wire.SENDS.pending() == 0
        if costs == "measure":
            assert runner._measured is not None and len(runner._measured) == p
        peaks.append(runner.peak_activation_bytes)
    return peaks


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
@pytest.mark.parametrize("p", [2, 4])
def test_v_schedules_match_the_serial_model(
    local_worlds: Callable[[int], dc.LocalWorld], schedule: str, p: int
) -> None:
    ms = [2 * p, 3 * p, 2 * p + 1]  # m = 2p, 3p and an odd m
    peaks = local_worlds(p).run(_parity_v, schedule, ms)
    assert all(all(b > 0 for b in per_rank) for per_rank in peaks)


def test_w_placed_from_measured_times_matches_the_serial_model(world2: dc.LocalWorld) -> None:
    world2.run(_parity_v, "zbv", [5], "measure")


def _parity_zb_measured() -> None:
    rank, p = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = _mlp(depth=p)
    serial = copy.deepcopy(model)
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    runner = PipelineRunner(
        partition(model, p)[rank], "zb-h1", loss_fn=nn.functional.mse_loss, costs="measure"
    )
    for _ in range(2):
        for q in model.parameters():
            q.grad = None
        runner.step(x, y, n_micro=4)
    measured = runner._measured  # profiled in the first (warm-up) step, then kept
    assert measured is not None and all(t["F"] > 0 and t["W"] > 0 for t in measured)
    assert runner.schedule(4) == zb_h1_schedule(p, 4, costs=measured)  # W placed by them
    runner.remeasure()
    assert runner.schedule(4) == zb_h1_schedule(p, 4)  # the next step profiles again
    nn.functional.mse_loss(serial(x), y).backward()
    for a, b in zip(
        partition(model, p)[rank].parameters(), partition(serial, p)[rank].parameters(), strict=True
    ):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-14)


def test_zb_h1_with_measured_times_matches_the_serial_model(world2: dc.LocalWorld) -> None:
    world2.run(_parity_zb_measured)


class _IgnoresItsInput(nn.Module):
    """A stage whose output does not depend on its input (a learned constant)."""

    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Parameter(torch.randn(4, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach() * 0 + self.b


def _turn_stage_ignores_its_input(schedule: str) -> None:
    rank, p = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    layers = [nn.Linear(3, 4)] + [nn.Tanh()] * (p - 2) + [_IgnoresItsInput()]
    layers += [nn.Tanh()] * (p - 1) + [nn.Linear(4, 2)]
    model = nn.Sequential(*layers).double()  # 2p layers: the constant is stage p - 1 (the turn)
    serial = copy.deepcopy(model)
    x, y = torch.randn(4 * p, 3, dtype=torch.float64), torch.randn(4 * p, 2, dtype=torch.float64)
    parts = partition(model, 2 * p, balance=[1] * (2 * p))
    mine = [parts[rank], parts[2 * p - 1 - rank]]
    loss = PipelineRunner(mine, schedule, loss_fn=nn.functional.mse_loss).step(x, y, n_micro=2 * p)
    ref = nn.functional.mse_loss(serial(x), y)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-13, atol=1e-15)
    theirs = partition(serial, 2 * p, balance=[1] * (2 * p))
    for chunk, ref_chunk in zip(mine, [theirs[rank], theirs[2 * p - 1 - rank]], strict=True):
        for a, b in zip(chunk.parameters(), ref_chunk.parameters(), strict=True):
            # the stages before the constant: None, as serially (tests/pipeline/test_pipeline_none_grads.py)
            assert (a.grad is None) == (b.grad is None)
            if b.grad is not None:
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_a_turn_stage_whose_output_ignores_its_input(world3: dc.LocalWorld, schedule: str) -> None:
    """The V turn's first chunk (rank p-1, stage p-1) ignores its received input: its I sent
    the input's zero gradient only in its W, after steps that wait for the upstream rank's
    I, which waits for that gradient: every rank timed out (ZB-V and DualPipeV at p = 3)."""
    world3.run(_turn_stage_ignores_its_input, schedule)


def _turn_chunk_starts_in_place(schedule: str) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(3, 4), nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4), nn.Linear(4, 2)
    ).double()
    serial = copy.deepcopy(model)
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    parts = partition(model, 4, balance=[1, 1, 2, 1])  # stage 2 (rank 1's chunk 1) starts with ReLU_
    mine = [parts[rank], parts[3 - rank]]
    loss = PipelineRunner(mine, schedule, loss_fn=nn.functional.mse_loss).step(x, y, n_micro=4)
    ref = nn.functional.mse_loss(serial(x), y)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-13, atol=1e-15)
    theirs = partition(serial, 4, balance=[1, 1, 2, 1])
    for chunk, ref_chunk in zip(mine, [theirs[rank], theirs[3 - rank]], strict=True):
        for a, b in zip(chunk.parameters(), ref_chunk.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_the_turn_chunk_may_modify_its_input_in_place(world2: dc.LocalWorld, schedule: str) -> None:
    """``nn.ReLU(inplace=True)`` first in the V turn's second chunk (rank p-1): its input
    was a leaf that requires grad, which refuses an in-place op ("a leaf Variable that
    requires grad is being used in an in-place operation") where the serial model ran.
    And a chunk's input modified in place moved its ``grad_fn``, so ``I`` no longer found
    the input's edge and left the whole backward to ``W``: at the turn the previous
    chunk's ``I`` read no gradient yet and sent zeros (gradients 5 % off, silently)."""
    world2.run(_turn_chunk_starts_in_place, schedule)


def _v_runner_refuses_one_chunk() -> None:
    with pytest.raises(ValueError, match=r"`stage` must be 2 chunks per rank .* got 1 chunk\(s\) on 2 rank"):
        PipelineRunner(nn.Linear(2, 2), "zbv", loss_fn=nn.functional.mse_loss)
    with pytest.raises(TypeError, match="`costs` must be None"):
        PipelineRunner(nn.Linear(2, 2), "zb-h1", loss_fn=nn.functional.mse_loss, costs="fast")


def test_runner_refuses_a_v_schedule_without_two_chunks(world2: dc.LocalWorld) -> None:
    world2.run(_v_runner_refuses_one_chunk)


def backward_first_v(n_stages: int, n_micro: int, n_chunks: int) -> list[list[Step]]:
    """ZB-V with rank 1's first chunk-1 I moved before everything (a backward first)."""
    sched = zbv_schedule(n_stages, n_micro)
    i = sched[1].index(Step("I", 0, 1))
    sched[1].insert(0, sched[1].pop(i))
    return sched


backward_first_v.placement = "v"  # type: ignore[attr-defined]


def _runner_refuses_a_bad_v_schedule() -> float:
    rank, p = dist.get_rank(), dist.get_world_size()
    parts = partition(_mlp(depth=2 * p), 2 * p)
    mine = [parts[rank], parts[2 * p - 1 - rank]]
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    runner = PipelineRunner(mine, backward_first_v, loss_fn=nn.functional.mse_loss)
    with pytest.raises(ScheduleError, match=r"each F before its I, got stage 1 chunk 1: I0 first \(step 0;"):
        runner.step(x, y, n_micro=4)
    # nothing was sent: the same ranks still run a real step
    return float(PipelineRunner(mine, "zbv", loss_fn=nn.functional.mse_loss).step(x, y, n_micro=4))


def test_runner_refuses_a_bad_v_schedule_before_communicating(world2: dc.LocalWorld) -> None:
    losses = world2.run(_runner_refuses_a_bad_v_schedule)
    assert losses[0] == losses[1]


def _peaks_v_and_1f1b(m: int) -> dict[str, int]:
    rank, p = dist.get_rank(), dist.get_world_size()
    out = {}
    for schedule in ("1f1b", "zbv"):
        torch.manual_seed(0)  # 2p equal blocks; a block saves 2 tensors (Linear's input, GELU's)
        blocks = [nn.Sequential(nn.Linear(8, 8, dtype=torch.float64), nn.GELU()) for _ in range(2 * p)]
        model = nn.Sequential(*blocks)
        x, y = torch.randn(4 * m, 8, dtype=torch.float64), torch.randn(4 * m, 8, dtype=torch.float64)
        parts = partition(model, 2 * p)
        stage = [parts[rank], parts[2 * p - 1 - rank]] if schedule == "zbv" else partition(model, p)[rank]
        runner = PipelineRunner(stage, schedule, loss_fn=nn.functional.mse_loss)
        runner.step(x, y, m)
        out[schedule] = runner.peak_activation_bytes
    return out


def _zbv_units(p: int, m: int, rank: int) -> int:
    """The peak, in saved tensors of one micro-batch (4 x 8 float64), that ZB-V's steps
    imply on ``rank``: 2 per chunk activation until its W (4 for the loss stage: MSE saves
    its input and target too), plus 1 per I whose W is not the next step (the gradient
    at the Linear's output that W needs; stage 0's I keeps nothing)."""
    steps = zbv_schedule(p, m)[rank]
    live = peak = 0
    held: set[tuple[int, int]] = set()
    for k, st in enumerate(steps):
        g = virtual_stage(rank, st.chunk, p, "v")
        act = 4 if g == 2 * p - 1 else 2
        if st.kind == "F":
            live += act
        elif st.kind == "I" and g != 0 and steps[k + 1] != Step("W", st.micro, st.chunk):
            live += 1
            held.add((st.micro, st.chunk))
        elif st.kind == "W":
            live -= act + ((st.micro, st.chunk) in held)
            held.discard((st.micro, st.chunk))
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("p", [2, 4])
def test_zbv_peak_is_1f1b_rank0_plus_the_loss_and_the_cooldown_gradients(
    local_worlds: Callable[[int], dc.LocalWorld], p: int
) -> None:
    # ZB-V holds 2p chunk activations (p full-stage micro-batches), 1F1B's rank 0 bound, on
    # every rank; above it only (a) rank 0's loss stage (MSE's saved input and target:
    # 1F1B keeps them on the last rank, which holds one micro-batch) and (b) the I-only
    # cool-down of torch's ZB-V order (ranks r >= 1 run up to 2r I steps before their W
    # steps: each keeps a gradient for its W). An I right before its own W counts as a
    # split B (a backward's transient buffers), as in 1F1B.
    m, unit = 8, 4 * 8 * 8
    peaks = local_worlds(p).run(_peaks_v_and_1f1b, m)
    rank0_1f1b = peaks[0]["1f1b"]
    assert rank0_1f1b == 2 * p * 2 * unit  # p micro-batches x 2 blocks x 2 tensors
    for rank, got in enumerate(peaks):
        assert got["zbv"] == _zbv_units(p, m, rank) * unit, (rank, got)
        extra = got["zbv"] - rank0_1f1b
        if rank == 0:
            assert extra == 2 * unit  # the loss's input and target, one micro-batch
        else:
            assert 0 <= extra <= (2 * rank - 1) * unit  # the cool-down's kept gradients


def test_placement_from_times_keeps_the_standard_order_unless_it_gains() -> None:
    # equal times (any scale), or a 0.1 % wobble on them: the simulated gain of another
    # placement is below MIN_GAIN, so the standard order stays (a placement chosen on
    # one step's noise lost in the next steps: docs/pipeline.md)
    from diffcomm.pipeline.schedules import MIN_GAIN

    assert MIN_GAIN == 0.005
    for p, m in [(2, 8), (4, 8)]:
        for scale in (1.0, 7.5):
            same = {"F": scale, "I": scale, "W": scale}
            wobble = [
                {"F": scale * (1 + 1e-3 * r), "I": scale, "W": scale * (1 - 1e-3 * r)} for r in range(p)
            ]
            for costs in (same, wobble):
                assert zb_h1_schedule(p, m, costs=costs) == zb_h1_schedule(p, m)
                assert zbv_schedule(p, m, costs=costs) == zbv_schedule(p, m)
