"""Pipeline benchmark: GPipe, 1F1B, interleaved, ZB-H1, ZB-V, DualPipeV vs torch.distributed.pipelining.

Model: ``depth`` x (Linear(width, width) + GELU), float32, MSE loss, batch ``batch``, on
``p`` local gloo ranks (CPU, one thread each). **Balanced stages** (``--balance measure``,
the default): every stage's last block is a sizing block Linear(width, h) + GELU +
Linear(h, width) + GELU whose width ``h`` is chosen per stage so that every *rank*
(``plain``, ``loop``) or every *stage* (``v``) does the same ``F + I + W`` per
micro-batch — stage 0 computes no input gradient and the last stage the loss, so equal
layers are unequal work — for the layout the schedule runs on (``plain``: rank ``r``
holds stage ``r``, so ranks and stages are one; ``loop``: ``r`` and ``r + p``, sized per
rank; ``v``: ``r`` and ``2p-1-r``, sized per **stage**, since a V schedule's theory
assumes a rank's two stages equal, and equal rank totals leave stage 0 (no input
gradient) and the loss stage, both on rank 0, unequal). The widths start from a
multiply-add cost model (``--balance model`` stops there) and are calibrated from
profiled split steps (ZB-H1, or ZB-V for the V layout) until the ranks (stages) are
within ``--balance-tol``; the widths and each rank's ``F / I / W`` per micro-batch are
printed, and ``--widths`` replays given widths. ``--balance none``
is the plain model with equal layers per stage. ``--emulate F,I,W`` replaces the compute by
sleeps: every block is a Linear(16) whose forward, input-gradient and weight-gradient steps
sleep ``F``, ``I`` and ``W`` milliseconds (:class:`EmulatedBlock`; equal blocks per stage),
so that a sleeping rank uses no core and ``p`` ranks larger than the machine's cores
measure the schedule and the runtime (messages, Python, step-time jitter) rather than
cores shared by ranks that compute at once. For every ``p``, ``m`` and schedule it
reports, for diffcomm's :class:`~diffcomm.pipeline.PipelineRunner`:

* the **bubble fraction** measured from the per-step timelines (time blocked in receives
  counts as idle; median and best over rounds — the best round is the one least disturbed
  by other load on the machine) next to its theory: ``(p-1)/(m+p-1)`` for GPipe and
  1F1B, ``(p-1)/(v*m+p-1)`` for interleaved (``v = 2``), and for ZB-H1
  ``(p-1)(F+I-W) / (m(F+I+W) + (p-1)(F+I-W))`` with this run's measured mean ``F``,
  ``I``, ``W`` step times (``I``, ``W`` from ranks 1.., whose backward splits); and the
  **replay** (:func:`~diffcomm.pipeline.replayed_bubble`, median over rounds): the same
  steps with their measured busy times replayed on the schedule's dependencies with free
  communication, the bubble the schedule implies for these stage times (equal to the
  theory when stages are uniform); and the **bound**
  (:func:`~diffcomm.pipeline.bubble_bound`, median over rounds): the least bubble any order
  of the same steps on the same ranks could have with these busy times (a schedule whose
  replay equals it is optimal for them); ``th-meas``, the theory for these measured
  stage times: the schedule's order replayed with every step at the median busy time of
  its rank, chunk and kind over all rounds (steady stage times, free messages); and
  ``imbal``, the spread (max / min - 1) of the ranks' busy time per step.
  ``bubble - replay`` is what messages and the runtime cost; ``replay - bound`` what the
  schedule's order costs; ``bound - theory`` what unequal stage times cost (stage 0's
  backward has no input
  gradient to compute, the last stage computes the loss, and two ranks computing at once
  on a small machine each run slower than one alone);
* the **peak activation memory** per stage (bytes of saved-for-backward tensors alive at
  once, as the runner counts them; for ZB-H1 including the gradients kept from I for W);

and, side by side in the same processes, ``torch.distributed.pipelining`` on the same
model and schedule (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B`` with
2 stages per rank, and for ZB-H1 ``ScheduleInterleavedZeroBubble`` with one stage per
rank — torch's ZB1P): the largest gradient difference after one step from zero
gradients (relative to the largest gradient), and the paired per-round time ratio
``diffcomm / torch`` (rounds interleave the two, alternating which goes first; median and
min..max). A 1F1B row without pre-posted receives (``prepost=False``) shows what
posting the next receive early buys, and one with plain backward steps
(``grad_first=False``, the runner before input-gradient-first ``B``) what sending the
input gradient before the weight gradients buys. ``1f1b`` and ``interleaved`` run the
runner's default (``grad_first="cooldown"``: only the ``B`` steps after a rank's last
``F`` split); ``1f1b-split`` and ``interleaved-split`` split every ``B`` (``True``, the
default with one chunk per rank before 2026-11-27), ``interleaved-plainB`` none
(``False``, as torch's schedule runs).

The frontier rows: ``zb-h1-placed`` is ZB-H1 with its ``W`` steps placed from the step
times measured in the previous step (``PipelineRunner(costs="measure")``; the warm-up
step runs with unit times), against the same torch class as ``zb-h1``; ``zbv-placed``
is ZB-V with its ``W`` steps placed the same way (torch's order kept where placing
gains less than the runner's threshold), against ``ScheduleZBVZeroBubble``; ``zbv`` and
``dualpipev`` run in the V placement (rank ``r`` holds stages ``r`` and ``2p-1-r``)
against ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV``. For these three the theory
column is the schedule's own bubble with uniform stages — the same steps replayed with
every step of a kind taking the round's mean time of that kind (``F``, ``I``, ``W``;
``B = I + W``), free messages — since they have no closed form at small ``m``. The
``calls`` column is the Python function calls of one ``runner.step`` on rank 0
(``sys.setprofile``, one extra step after the timed rounds).

    python benchmarks/bench_pipeline.py                         # p=2, m=4 and 8
    python benchmarks/bench_pipeline.py --stages 2 4 --micro 8 --rounds 7 \
        --schedules 1f1b interleaved zb-h1 zb-h1-placed zbv dualpipev   # the bubble table
    python benchmarks/bench_pipeline.py --stages 2 4 --plot docs/_static/pipeline_timeline.png
    python benchmarks/bench_pipeline.py --schedules gpipe 1f1b interleaved zb-h1 --rounds 21 --pin

Each rank uses one thread, so ``p`` stages want ``p`` free cores; the script prints the
core count. On fewer cores the ranks share them and the bubble says more about the
machine than about the schedule. ``--pin`` pins rank ``r`` (every thread of it, gloo's
too) to core ``r``; ``torch.distributed.pipelining`` runs in the same pinned processes.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

import diffcomm as dc
from diffcomm import backend as B
from diffcomm.pipeline import (
    PipelineRunner,
    TimelineEntry,
    bubble_bound,
    bubble_fraction,
    partition,
    replayed_bubble,
    theoretical_bubble,
)

#: diffcomm schedule name -> (virtual stages per rank, torch schedule class name)
SCHEDULES = {
    "gpipe": (1, "ScheduleGPipe"),
    "1f1b": (1, "Schedule1F1B"),
    "1f1b-noprepost": (1, None),
    "1f1b-plainB": (1, None),
    "1f1b-split": (1, "Schedule1F1B"),
    "interleaved": (2, "ScheduleInterleaved1F1B"),
    "interleaved-split": (2, "ScheduleInterleaved1F1B"),
    "interleaved-plainB": (2, "ScheduleInterleaved1F1B"),
    "zb-h1": (1, "ScheduleInterleavedZeroBubble"),
    "zb-h1-placed": (1, "ScheduleInterleavedZeroBubble"),
    "zbv": (2, "ScheduleZBVZeroBubble"),
    "zbv-placed": (2, "ScheduleZBVZeroBubble"),
    "dualpipev": (2, "ScheduleDualPipeV"),
}
V_SCHEDULES = ("zbv", "zbv-placed", "dualpipev")


class _Sleep(torch.autograd.Function):
    """Identity whose forward sleeps ``fwd`` seconds and whose backward sleeps ``bwd``:
    emulated compute (the GIL is released, no core is used, so ``p`` ranks on fewer cores
    do not slow each other)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fwd: float, bwd: float) -> torch.Tensor:
        ctx.bwd = bwd
        if fwd:
            time.sleep(fwd)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.bwd:
            time.sleep(ctx.bwd)
        return grad, None, None


class EmulatedBlock(nn.Module):
    """A Linear(width, width) whose ``F``, ``I`` and ``W`` steps take ``f``, ``i``, ``w``
    seconds more (sleeps): the forward's sleep after the product; the input-gradient sleep
    on the output's path (shared by the input and weight gradients, so a split backward
    runs it in ``I``); the weight-gradient sleep on the weight's own path (run in ``W``)."""

    def __init__(self, width: int, f: float, i: float, w: float) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.f, self.i, self.w = f, i, w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = _Sleep.apply(self.lin.weight, 0.0, self.w)
        return _Sleep.apply(nn.functional.linear(x, weight, self.lin.bias), self.f, self.i)


def make_model(
    width: int, depth: int, widths: list[int] | None = None, emulate: list[float] | None = None
) -> nn.Sequential:
    """``depth`` x (Linear(width, width) + GELU); with ``widths`` (one per virtual stage,
    ``depth`` divisible by their number) a **sized** model of ``len(widths)`` stages, one
    child each (so ``partition(model, len(widths))`` cuts between them): stage ``s`` is
    ``depth / len(widths) - 1`` blocks Linear(width, width) + GELU, then one sizing block
    Linear(width, h) + GELU + Linear(h, width) + GELU with ``h = widths[s]`` — at ``h =
    width / 2`` the sizing block has one plain block's multiply-adds, and a stage's
    F + I + W grows linearly in ``h``. With ``emulate`` (``[f, i, w]`` milliseconds):
    ``depth`` :class:`EmulatedBlock` (every stage of equal blocks does equal work)."""
    if emulate is not None:
        f, i, w = (t / 1e3 for t in emulate)
        return nn.Sequential(*[EmulatedBlock(width, f, i, w) for _ in range(depth)])
    if widths is None:
        return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)])
    per = depth // len(widths)
    stages = []
    for h in widths:
        plain = [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(per - 1)]
        sizer = nn.Sequential(nn.Linear(width, h), nn.GELU(), nn.Linear(h, width), nn.GELU())
        stages.append(nn.Sequential(*plain, sizer))
    return nn.Sequential(*stages)


def _placement(schedule: str) -> str:
    """The stage layout a schedule runs on: ``"plain"`` (stage ``r`` on rank ``r``),
    ``"loop"`` (2 chunks, stages ``r`` and ``r + p``) or ``"v"`` (``r`` and ``2p-1-r``)."""
    if schedule in V_SCHEDULES:
        return "v"
    return "loop" if SCHEDULES[schedule][0] > 1 else "plain"


def _rank_stages(rank: int, p: int, layout: str) -> list[int]:
    """The virtual stages rank ``rank`` holds in ``layout`` (see :func:`_placement`)."""
    return {"plain": [rank], "loop": [rank, rank + p], "v": [rank, 2 * p - 1 - rank]}[layout]


def _torch_schedule(name: str, model: nn.Sequential, v: int, m: int, loss_fn: Any, vshape: bool) -> Any:
    from torch.distributed import pipelining as tp

    rank, p = dc.get_rank(), dc.get_world_size()
    parts = partition(model, p * v)
    ids = [rank, 2 * p - 1 - rank] if vshape else list(range(rank, p * v, p))
    stages = [tp.PipelineStage(parts[r], r, p * v, torch.device("cpu")) for r in ids]
    cls = getattr(tp, name)
    if name in ("ScheduleGPipe", "Schedule1F1B"):
        return cls(stages[0], m, loss_fn=loss_fn), stages
    return cls(stages, m, loss_fn=loss_fn), stages


def _grads(modules: list[nn.Module]) -> list[torch.Tensor]:
    return [p.grad.clone() for mod in modules for p in mod.parameters()]


def _pin() -> None:
    """Pin every thread of this rank (its gloo threads too) to core ``rank % cores``."""
    cpu = {dc.get_rank() % (os.cpu_count() or 1)}
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), cpu)


#: the split schedule that profiles each layout's F, I, W (the calibration's warm-up)
PROFILE = {"plain": "zb-h1", "loop": "zb-h1", "v": "zbv"}


def _rank_profile(
    width: int, depth: int, batch: int, m: int, layout: str, widths: list[int], steps: int, pin: bool = False
) -> dict[str, list[float]]:
    """This rank's busy seconds per micro-batch of ``F``, ``I``, ``W`` (``B`` counted as
    ``I``), summed over its chunks: the lower quartile of each chunk's steps of a kind in
    ``steps`` pipeline steps (after one warm-up) of ``PROFILE[layout]`` on the model sized
    by ``widths`` (the quartile, not the median: a step slowed by other jobs on the cores
    says nothing about the stage's work); and per chunk."""
    torch.set_num_threads(1)
    if pin:
        _pin()
    rank, p = dc.get_rank(), dc.get_world_size()
    torch.manual_seed(0)
    parts = partition(make_model(width, depth, widths), len(widths))
    mine = [parts[g] for g in _rank_stages(rank, p, layout)]
    runner = PipelineRunner(
        mine if len(mine) > 1 else mine[0], PROFILE[layout], loss_fn=nn.functional.mse_loss
    )
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    busy: dict[tuple[int, str], list[float]] = {}
    for i in range(steps + 1):
        for mod in mine:
            mod.zero_grad(set_to_none=True)
        runner.step(x, y, m)
        if i == 0:
            continue  # warm-up: one-time costs
        for e in runner.timeline:
            busy.setdefault((e.chunk, "I" if e.kind == "B" else e.kind), []).append(e.busy)
    per_chunk = {
        f"{k}{c}": statistics.quantiles(t, n=4)[0] if len(t) > 1 else t[0] for (c, k), t in busy.items()
    }
    total = {k: sum(v for n, v in per_chunk.items() if n[0] == k) for k in "FIW"}
    return {
        "total": [total["F"], total["I"], total["W"]],
        "chunks": [per_chunk.get(n, 0.0) for n in sorted(per_chunk)],
        # virtual stage -> its F + I + W per micro-batch (what per-stage sizing equalises)
        "stages": {
            g: sum(per_chunk.get(f"{k}{c}", 0.0) for k in "FIW")
            for c, g in enumerate(_rank_stages(rank, p, layout))
        },
    }


#: what ``--balance`` equalises per layout: every rank's ``F + I + W`` (``plain``: one stage
#: per rank, so also every stage's; ``loop``) or every *stage*'s (``v``: a V schedule's theory
#: assumes its two stages on a rank equal, and equal rank totals leave them unequal — stage 0
#: computes no input gradient, the last stage, on the same rank, the loss)
SIZED_BY = {"plain": "rank", "loop": "rank", "v": "stage"}


def _units(p: int, layout: str) -> list[list[int]]:
    """The groups of virtual stages whose ``F + I + W`` the sizing makes equal: one per rank
    (its stages) or one per stage, by :data:`SIZED_BY`."""
    if SIZED_BY[layout] == "stage":
        return [[g] for g in range(p * (1 if layout == "plain" else 2))]
    return [_rank_stages(r, p, layout) for r in range(p)]


def _model_widths(width: int, depth: int, p: int, layout: str) -> list[int]:
    """Stage widths from an explicit cost model: a stage's ``F + I + W`` per micro-batch is
    its multiply-adds (``F``, ``I`` and ``W`` each one product per Linear), less the first
    Linear's input gradient on stage 0 (its input needs none); the loss and the
    element-wise work are left out. Every rank (``v`` layout: every stage, see
    :data:`SIZED_BY`) gets the same total, the widths keep their sum (``width / 2`` per
    stage on average)."""
    n = p * (1 if layout == "plain" else 2)
    per = depth // n
    # in units of rows x width: a plain block costs 3 width, the sizing block 6 h
    fixed = [3 * width * (per - 1) - (width if g == 0 and per > 1 else 0) for g in range(n)]
    units = _units(p, layout)
    c = [sum(fixed[g] for g in gs) for gs in units]
    total_h = n * width // 2
    widths = [width // 2] * n
    u = len(units)
    for i, gs in enumerate(units):
        h_unit = (6 * total_h + sum(c) - u * c[i]) / (6 * u)  # equal c_i + 6 h_unit in every unit
        for g in gs:
            widths[g] = max(8, int(round(h_unit / len(gs) / 8)) * 8)
    if per == 1:  # stage 0's only Linear with an input is Linear(width, h): its missing I is width x h
        widths[0] = max(8, int(round(widths[0] * 6 / 5 / 8)) * 8)
    return widths


def _unit_times(prof: list[dict[str, Any]], p: int, layout: str) -> list[float]:
    """Each sizing unit's (:func:`_units`) ``F + I + W`` seconds per micro-batch in a
    profile (:func:`_rank_profile`'s per-rank results)."""
    if SIZED_BY[layout] == "rank":
        return [sum(r["total"]) for r in prof]
    stage = {int(g): t for r in prof for g, t in r["stages"].items()}
    return [sum(stage[g] for g in gs) for gs in _units(p, layout)]


def _calibrate(
    world: Any, args: argparse.Namespace, p: int, m: int, layout: str
) -> tuple[list[int], list[list[float]]]:
    """Stage widths that give every rank (``v`` layout: every stage; :data:`SIZED_BY`) the
    same ``F + I + W`` per micro-batch.

    Start at :func:`_model_widths` (the multiply-add count); profile
    (:func:`_rank_profile`); model each unit's (rank's, or stage's) time per micro-batch as
    linear in the widths of its stages, with the slope from its own measured time per
    multiply-add (``3 (F, I, W) x 2 (the sizing block's two Linear) x rows x width`` per
    unit of ``h``); move every unit's widths so that its time meets the units' mean; repeat
    until the spread (max / min - 1) is under ``--balance-tol`` or ``--balance-iters``
    profiles ran. Returns the widths of the profile with the least spread and its per-rank
    ``[F, I, W]`` seconds per micro-batch."""
    v = 1 if layout == "plain" else 2
    n = p * v
    w, rows = args.width, args.batch // m
    per = args.depth // n
    widths = _model_widths(w, args.depth, p, layout)
    units = _units(p, layout)
    best: tuple[float, list[int], list[list[float]]] | None = None
    for it in range(args.balance_iters):
        prof = world.run(
            _rank_profile, w, args.depth, args.batch, m, layout, widths, args.balance_steps, args.pin
        )
        t = _unit_times(prof, p, layout)
        spread = max(t) / min(t) - 1
        print(
            f"   balance {layout:<5} p={p} iter {it}: widths {widths}; F+I+W ms per micro-batch by "
            + SIZED_BY[layout]
            + " "
            + " ".join(f"{x * 1e3:.2f}" for x in t)
            + f"; spread {spread * 100:.1f} %",
            flush=True,
        )
        if best is None or spread < best[0]:
            best = (spread, list(widths), [r["total"] for r in prof])
        if spread < args.balance_tol or it == args.balance_iters - 1:
            break
        target = statistics.mean(t)
        new = list(widths)
        for i, gs in enumerate(units):
            macs = sum(3 * rows * w * (w * (per - 1) + 2 * widths[g]) for g in gs)
            slope = t[i] / macs * 6 * rows * w  # seconds per unit of h on one of its stages
            dh = (target - t[i]) / slope / len(gs)
            for g in gs:
                new[g] = max(8, round(widths[g] + dh))
        if new == widths:
            break  # within one unit of width: nothing left to move
        widths = new
    assert best is not None
    return best[1], best[2]


def _rank_bench(
    width: int,
    depth: int,
    batch: int,
    m: int,
    schedule: str,
    rounds: int,
    pin: bool = False,
    widths: list[int] | None = None,
    emulate: list[float] | None = None,
) -> dict[str, Any]:
    torch.set_num_threads(1)
    if pin:
        _pin()
    rank, p = dc.get_rank(), dc.get_world_size()
    v, torch_name = SCHEDULES[schedule]
    torch.manual_seed(0)
    model = make_model(width, depth, widths, emulate)
    twin = copy.deepcopy(model)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    vshape = schedule in V_SCHEDULES
    parts = partition(model, p * v)
    mine = [parts[g] for g in _rank_stages(rank, p, _placement(schedule))]
    grad_first: bool | str | None = {
        "1f1b-plainB": False,
        "1f1b-split": True,
        "interleaved-split": True,
        "interleaved-plainB": False,
    }.get(schedule)  # None: the runner's default
    runner = PipelineRunner(
        mine if v > 1 else mine[0],
        schedule.split("-")[0]
        if schedule.startswith(("1f1b", "interleaved"))
        else schedule.removesuffix("-placed"),
        loss_fn=nn.functional.mse_loss,
        prepost=not schedule.endswith("noprepost"),
        grad_first=grad_first,
        costs="measure" if schedule.endswith("-placed") else None,
    )
    out: dict[str, Any] = {"dc": [], "torch": [], "bubble": [], "kinds": {}}

    def run_dc() -> float:
        for mod in mine:
            mod.zero_grad(set_to_none=True)
        B.get_backend().barrier(None)
        t = time.perf_counter()
        runner.step(x, y, m)
        B.get_backend().barrier(None)
        return time.perf_counter() - t

    sched = stages = None
    if torch_name is not None:
        try:
            sched, stages = _torch_schedule(torch_name, twin, v, m, nn.functional.mse_loss, vshape)
        except Exception as err:  # reported, not hidden
            out["torch_error"] = f"{type(err).__name__}: {err}"

    def run_torch() -> float:
        assert sched is not None and stages is not None
        for st in stages:
            st.submod.zero_grad(set_to_none=True)
        first = any(s.is_first for s in stages)
        last = any(s.is_last for s in stages)
        B.get_backend().barrier(None)
        t = time.perf_counter()
        if first and last:
            sched.step(x, target=y)
        elif first:
            sched.step(x)
        elif last:
            sched.step(target=y)
        else:
            sched.step()
        B.get_backend().barrier(None)
        return time.perf_counter() - t

    # warm-up, and the gradient comparison (both from zero gradients, same weights)
    run_dc()
    if sched is not None:
        try:
            run_torch()
            g_dc, g_t = _grads(mine), _grads([s.submod for s in stages])  # type: ignore[union-attr]
            scale = max(float(g.abs().max()) for g in g_dc)
            out["grad_diff"] = max(float((a - b).abs().max()) for a, b in zip(g_dc, g_t, strict=True)) / scale
        except Exception as err:  # reported, not hidden
            out["torch_error"] = f"{type(err).__name__}: {err}"
            sched = None
    for i in range(rounds):
        order = ("dc", "torch") if i % 2 == 0 else ("torch", "dc")
        for who in order:
            if who == "dc":
                out["dc"].append(run_dc())
                out["bubble"].append(
                    [
                        (e.kind, e.micro, e.start, e.end, e.wait, e.chunk, e.sent, e.overlap)
                        for e in runner.timeline
                    ]
                )
            elif sched is not None:
                out["torch"].append(run_torch())
    out["peak"] = runner.peak_activation_bytes
    out["calls"] = _count_calls(run_dc)
    return out


def _count_calls(fn: Any) -> int:
    """Python function calls (``sys.setprofile`` "call" events) of one ``fn()``."""
    n = [0]

    def prof(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            n[0] += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n[0]


def _uniform_theory(timelines: list[list[TimelineEntry]], placement: str) -> float:
    """The schedule's bubble with uniform stages: every step of a kind takes the mean
    busy time of that kind in these timelines (``B`` = mean ``I`` + mean ``W`` when the
    schedule splits some backwards), free messages."""
    busy: dict[str, list[float]] = {"F": [], "B": [], "I": [], "W": []}
    for tl in timelines:
        for e in tl:
            busy[e.kind].append(e.busy)
    mean = {k: statistics.mean(v) for k, v in busy.items() if v}
    if "I" in mean and "W" in mean:
        mean["B"] = mean["I"] + mean["W"]
    uni = [
        [TimelineEntry(e.kind, e.micro, 0.0, mean[e.kind], 0.0, e.chunk, None, e.overlap) for e in tl]
        for tl in timelines
    ]
    return replayed_bubble(uni, placement)


def _steady_theory(rounds: list[list[list[TimelineEntry]]], placement: str) -> float:
    """The schedule's bubble for **these measured stage times**, without step-to-step
    noise: every step replaced by the median busy time, over all rounds, of the steps of
    its rank, chunk and kind (a split ``B``, which sends early, apart from a plain one;
    ``sent`` likewise), then replayed with free messages
    (:func:`~diffcomm.pipeline.replayed_bubble`); the median over the rounds' orders."""
    Key = tuple[int, int, str, bool, bool]  # rank, chunk, kind, overlapped, split (sent early)
    busy: dict[Key, list[float]] = {}
    sent: dict[Key, list[float]] = {}
    for tls in rounds:
        for r, tl in enumerate(tls):
            for e in tl:
                key = (r, e.chunk, e.kind, e.overlap, e.sent is not None)
                busy.setdefault(key, []).append(e.busy)
                if e.sent is not None:
                    sent.setdefault(key, []).append(e.sent)
    med = {k: statistics.median(v) for k, v in busy.items()}
    med_sent = {k: statistics.median(v) for k, v in sent.items()}
    out = []
    for tls in rounds:
        steady = [
            [
                TimelineEntry(
                    e.kind, e.micro, 0.0, med[(r, e.chunk, e.kind, e.overlap, e.sent is not None)], 0.0,
                    e.chunk, None if e.sent is None else med_sent[(r, e.chunk, e.kind, e.overlap, True)],
                    e.overlap,
                )
                for e in tl
            ]
            for r, tl in enumerate(tls)
        ]  # fmt: skip
        out.append(replayed_bubble(steady, placement))
    return statistics.median(out)


def _entries(raw: list[tuple]) -> list[TimelineEntry]:
    return [TimelineEntry(*e) for e in raw]


def _zb_theory(p: int, m: int, timelines: list[list[TimelineEntry]]) -> float:
    # I and W from ranks 1.. only: rank 0's input needs no gradient, so its I only takes
    # the output gradient and its W is the whole backward (see docs/pipeline.md)
    busy: dict[str, list[float]] = {"F": [], "I": [], "W": []}
    for rank, tl in enumerate(timelines):
        for e in tl:
            if e.kind == "F" or rank > 0:
                busy[e.kind].append(e.busy)
    f, i, w = (statistics.mean(busy[k]) for k in "FIW")
    idle = max(0.0, (p - 1) * (f + i - w))  # W >= F + I: the drain is all W, no idle
    return idle / (m * (f + i + w) + idle)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=None, help="default 1024 (16 with --emulate)")
    ap.add_argument("--depth", type=int, default=8, help="Linear+GELU blocks (divisible by 2 * stages)")
    ap.add_argument("--batch", type=int, default=None, help="default 512 (64 with --emulate)")
    ap.add_argument(
        "--emulate",
        default=None,
        metavar="F,I,W",
        help="emulated compute: every block is a small Linear whose forward, input-gradient and "
        "weight-gradient steps sleep F, I, W milliseconds (e.g. 5,5,5; implies --balance none, "
        "equal blocks per stage): the schedules' bubbles at any p on few cores, since a sleeping "
        "rank uses no core",
    )
    ap.add_argument("--stages", type=int, nargs="+", default=[2])
    ap.add_argument("--micro", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per configuration (after 1 warm-up)")
    ap.add_argument(
        "--balance",
        choices=["measure", "model", "none"],
        default="measure",
        help="measure (default): size each stage so that every rank's F+I+W per micro-batch is equal "
        "(layouts plain and loop; plain has one stage per rank) or every stage's "
        "(layout v: ZB-V, DualPipeV), "
        "calibrated per layout and m from profiled steps, starting from the cost model (see _calibrate); "
        "model: the multiply-add cost model only (_model_widths; no calibration); none: the plain model, "
        "equal layers per stage (stage 0 has no input gradient, the last stage the loss)",
    )
    ap.add_argument(
        "--widths",
        nargs="+",
        default=[],
        metavar="LAYOUT:P:M=H,H,..",
        help="explicit stage widths instead of calibrating, e.g. plain:2:8=680,368 v:2:8=592,464,464,592 "
        "(layouts: plain, loop, v; one width per virtual stage) — the widths a calibration printed",
    )
    ap.add_argument("--balance-iters", type=int, default=5, help="most profiles per layout (default 5)")
    ap.add_argument("--balance-steps", type=int, default=5, help="timed steps per profile (default 5)")
    ap.add_argument(
        "--balance-tol",
        type=float,
        default=0.02,
        help="stop when max/min - 1 of the ranks' (layout v: stages') F+I+W is below",
    )
    ap.add_argument("--json", action="store_true", help="also print the rows as JSON (last line)")
    ap.add_argument(
        "--dump", default=None, help="write every round's timelines of every row as JSON (offline analysis)"
    )
    ap.add_argument(
        "--pin", action="store_true", help="pin rank r (all its threads) to core r %% cores (Linux)"
    )
    ap.add_argument(
        "--plot", default=None, help="write a timeline PNG (one panel per schedule, largest m, median round)"
    )
    args = ap.parse_args(argv)
    emulate: list[float] | None = None
    if args.emulate is not None:
        try:
            emulate = [float(t) for t in args.emulate.split(",")]
        except ValueError:
            emulate = []
        if len(emulate) != 3 or min(emulate) < 0:
            ap.error(f"--emulate: expected three milliseconds F,I,W (>= 0), got {args.emulate!r}")
        args.balance = "none"
        for p in args.stages:
            n = max(p * SCHEDULES[s][0] for s in args.schedules)
            if args.depth % n:
                ap.error(f"--depth {args.depth}: emulated stages need a multiple of {n} (stages x chunks)")
    args.width = args.width or (16 if emulate else 1024)
    args.batch = args.batch or (64 if emulate else 512)
    if args.plot:
        import matplotlib  # noqa: F401 - fail before measuring, not after
    for p in args.stages:
        n = max(p * SCHEDULES[s][0] for s in args.schedules)
        if args.balance != "none" and args.depth % n:
            ap.error(f"--depth {args.depth}: balanced stages need a multiple of {n} (stages x chunks)")

    balanced = args.balance != "none"
    fixed: dict[tuple[str, int, int], list[int]] = {}
    for spec in args.widths:
        try:
            key, hs = spec.split("=")
            layout, p_s, m_s = key.split(":")
            ws = [int(h) for h in hs.split(",")]
            n = int(p_s) * (1 if layout == "plain" else 2)
            int(m_s)
        except ValueError:
            ap.error(f"--widths: expected LAYOUT:P:M=H,H,.., got {spec!r}")
        if layout not in ("plain", "loop", "v") or len(ws) != n or min(ws) < 1:
            ap.error(f"--widths: {spec!r} needs a layout plain/loop/v and {n} positive widths")
        fixed[(layout, int(p_s), int(m_s))] = ws
    if emulate:
        print(
            f"model: {args.depth} x emulated block (Linear({args.width}); F / I / W sleep "
            f"{emulate[0]:g} / {emulate[1]:g} / {emulate[2]:g} ms per block), batch {args.batch}, "
            "float32, MSE; gloo, CPU, one thread per rank; equal blocks per stage"
        )
    else:
        print(
            f"model: {args.depth} x (Linear({args.width}) + GELU), batch {args.batch}, float32, MSE; "
            f"gloo, CPU, one thread per rank"
            + ("; stages balanced (each stage's last block sized: Linear(w, h) + GELU + Linear(h, w) + GELU)"
               if balanced else "; equal layers per stage (unbalanced)")
        )  # fmt: skip
    pinned = "; ranks pinned to cores" if args.pin else ""
    print(f"cores: {os.cpu_count()}; torch {torch.__version__}; {args.rounds} rounds per row{pinned}\n")
    head = (
        f"{'p':>2} {'m':>2} {'schedule':<17} {'bubble':>6} {'best':>6} {'theory':>6} {'th-meas':>7} "
        f"{'replay':>6} {'bound':>6} {'imbal':>6} "
        f"{'ms/step':>8} {'vs torch':>17} {'grad diff':>9} {'calls':>6}  peak activation MiB per stage"
    )
    print(head)
    print("-" * len(head))
    plots: dict[str, tuple[list[list[TimelineEntry]], str]] = {}
    rows: list[dict[str, Any]] = []
    dumped: list[dict[str, Any]] = []
    for p in args.stages:
        with dc.LocalWorld(p) as world:
            for m in args.micro:
                sizes: dict[str, tuple[list[int], list[list[float]]]] = {}
                if args.balance == "measure" and p > (os.cpu_count() or 1) and m == args.micro[0]:
                    print(
                        f"   note: {p} ranks on {os.cpu_count()} cores time-share them; the calibration "
                        "measures that sharing too (--balance model: the cost model's widths alone)"
                    )
                if balanced:
                    for layout in dict.fromkeys(_placement(s) for s in args.schedules):
                        given = fixed.get((layout, p, m))
                        if given is None and args.balance == "model":
                            given = _model_widths(args.width, args.depth, p, layout)
                        if given is not None:
                            prof = world.run(
                                _rank_profile, args.width, args.depth, args.batch, m, layout, given,
                                args.balance_steps, args.pin,
                            )  # fmt: skip
                            sizes[layout] = (given, [r["total"] for r in prof])
                        else:
                            sizes[layout] = _calibrate(world, args, p, m, layout)
                        ws, fiw = sizes[layout]
                        print(
                            f"   {layout} layout, p={p} m={m}: stage widths {ws}; per rank F / I / W ms per "
                            "micro-batch: "
                            + ", ".join(
                                f"{f * 1e3:.1f} / {i * 1e3:.1f} / {w * 1e3:.1f} (= {(f + i + w) * 1e3:.1f})"
                                for f, i, w in fiw
                            ),
                            flush=True,
                        )
                for schedule in args.schedules:
                    v = SCHEDULES[schedule][0]
                    widths = sizes[_placement(schedule)][0] if balanced else None
                    res = world.run(
                        _rank_bench, args.width, args.depth, args.batch, m, schedule, args.rounds, args.pin,
                        widths, emulate,
                    )  # fmt: skip
                    t_dc = [max(r["dc"][i] for r in res) for i in range(args.rounds)]
                    bubbles = [
                        bubble_fraction([_entries(r["bubble"][i]) for r in res]) for i in range(args.rounds)
                    ]
                    placement = "v" if schedule in V_SCHEDULES else "loop"
                    replays = [
                        replayed_bubble([_entries(r["bubble"][i]) for r in res], placement)
                        for i in range(args.rounds)
                    ]
                    bounds = [
                        bubble_bound([_entries(r["bubble"][i]) for r in res], placement)
                        for i in range(args.rounds)
                    ]
                    mid = sorted(range(args.rounds), key=lambda i: bubbles[i])[args.rounds // 2]
                    timelines = [_entries(r["bubble"][mid]) for r in res]  # the median round
                    if schedule in V_SCHEDULES or schedule.endswith("-placed"):
                        theory = statistics.median(
                            _uniform_theory([_entries(r["bubble"][i]) for r in res], placement)
                            for i in range(args.rounds)
                        )
                    elif schedule == "zb-h1":
                        theory = statistics.median(
                            _zb_theory(p, m, [_entries(r["bubble"][i]) for r in res])
                            for i in range(args.rounds)
                        )
                    else:
                        theory = theoretical_bubble(p, m, v)
                    rounds_tl = [[_entries(r["bubble"][i]) for r in res] for i in range(args.rounds)]
                    steady = _steady_theory(rounds_tl, placement)
                    # each rank's busy time per micro-batch (median over rounds), and their spread
                    rank_ms = [
                        statistics.median(sum(e.busy for e in tls[r]) for tls in rounds_tl) / m * 1e3
                        for r in range(p)
                    ]
                    imbal = max(rank_ms) / min(rank_ms) - 1
                    dumped.append(
                        {"p": p, "m": m, "schedule": schedule, "placement": placement, "widths": widths,
                         "rounds": [[r["bubble"][i] for r in res] for i in range(args.rounds)]}
                    )  # fmt: skip
                    if args.dump:  # after every row: a run cut short keeps what it measured
                        with open(args.dump, "w") as f:
                            json.dump(dumped, f)
                    errs = {r.get("torch_error") for r in res} - {None}
                    ratios: list[float] = []
                    if errs:
                        vs = "torch FAILS"
                    elif res[0]["torch"]:
                        t_t = [max(r["torch"][i] for r in res) for i in range(args.rounds)]
                        ratios = sorted(a / b for a, b in zip(t_dc, t_t, strict=True))
                        vs = f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})"
                    else:
                        vs = "-"
                    diff = max((r.get("grad_diff", 0.0) for r in res), default=0.0)
                    rows.append(
                        {
                            "p": p,
                            "m": m,
                            "schedule": schedule,
                            "bubble": statistics.median(bubbles),
                            "best": min(bubbles),
                            "theory": theory,
                            "theory_measured": steady,
                            "rank_ms_per_micro": rank_ms,
                            "imbalance": imbal,
                            "widths": widths,
                            "replay": statistics.median(replays),
                            "bound": statistics.median(bounds),
                            "ms_per_step": statistics.median(t_dc) * 1e3,
                            "vs_torch": statistics.median(ratios) if ratios else None,
                            "torch_error": sorted(errs) or None,
                            "grad_diff": diff if SCHEDULES[schedule][1] and not errs else None,
                            "peak_bytes": [r["peak"] for r in res],
                            "calls": res[0]["calls"],
                        }
                    )
                    diff_s = f"{diff:9.1e}" if SCHEDULES[schedule][1] and not errs else f"{'-':>9}"
                    peaks = " ".join(f"{r['peak'] / 2**20:6.1f}" for r in res)
                    print(
                        f"{p:>2} {m:>2} {schedule:<17} {statistics.median(bubbles):6.3f} {min(bubbles):6.3f} "
                        f"{theory:6.3f} {steady:7.3f} {statistics.median(replays):6.3f} "
                        f"{statistics.median(bounds):6.3f} {imbal * 100:5.1f}% "
                        f"{statistics.median(t_dc) * 1e3:8.1f} {vs:>17} {diff_s} "
                        f"{res[0]['calls']:6d}  {peaks}",
                        flush=True,
                    )
                    for e in sorted(errs):
                        print(f"      torch.distributed.pipelining failed: {e}")
                    if m == max(args.micro) and not schedule.startswith("1f1b-"):
                        title = f"{schedule}, p={p}, m={m}" + (f", v={v}" if v > 1 else "")
                        plots[title] = (timelines, placement)
    if args.plot:
        _plot(plots, args.plot)
        print(f"\ntimeline written to {args.plot}")
    if args.json:
        print(json.dumps(rows))
    return 0


COLORS = {"F": "tab:blue", "B": "tab:orange", "I": "tab:red", "W": "tab:green"}


def _plot(plots: dict[str, tuple[list[list[TimelineEntry]], str]], path: str) -> None:
    """One panel per schedule: a bar per executed step (colour: kind; label: kind,
    micro-batch and virtual stage ``s``), grey where blocked in a receive; the two halves
    of an overlapped step (DualPipeV's fused F+B) hatched and joined by a black frame;
    the y ticks name the virtual stages each rank holds (``r, r+p, ..`` or the V's
    ``r, 2p-1-r``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    from diffcomm.pipeline import virtual_stage

    n_rows = sum(len(t) for t, _ in plots.values())
    fig, axes = plt.subplots(len(plots), 1, figsize=(12, 0.9 + 0.42 * n_rows))
    axes = [axes] if len(plots) == 1 else list(axes)
    for ax, (title, (timelines, placement)) in zip(axes, plots.items()):
        p = len(timelines)
        t0 = min(e.start for tl in timelines for e in tl)
        v = 1 + max(e.chunk for tl in timelines for e in tl)
        for rank, tl in enumerate(timelines):
            for k, e in enumerate(tl):
                ax.barh(rank, e.wait * 1e3, left=(e.start - t0) * 1e3, color="lightgrey", height=0.8)
                left = (e.start - t0 + e.wait) * 1e3
                ax.barh(
                    rank, e.busy * 1e3, left=left, color=COLORS[e.kind], height=0.8, edgecolor="k", lw=0.3,
                    hatch="///" if e.overlap else None,
                )  # fmt: skip
                g = virtual_stage(rank, e.chunk, p, placement)
                label = f"{e.kind}{e.micro}" + (f" s{g}" if v > 1 else "")
                ax.text(left + e.busy * 5e2, rank, label, ha="center", va="center", fontsize=5, color="white")
                if e.overlap and e.kind == "F" and k + 1 < len(tl):  # frame the fused F+B pair
                    nxt = tl[k + 1]
                    x0, x1 = (e.start - t0) * 1e3, (nxt.end - t0) * 1e3
                    ax.add_patch(Rectangle((x0, rank - 0.45), x1 - x0, 0.9, fill=False, ec="k", lw=1.2))
        bubble = bubble_fraction(timelines)
        names = [
            f"rank {r}"
            + (f" (s{', s'.join(str(virtual_stage(r, c, p, placement)) for c in range(v))})" if v > 1 else "")
            for r in range(p)
        ]
        ax.set_yticks(range(p), names, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{title} ({placement} placement): measured bubble {bubble:.3f}", fontsize=9)
    axes[-1].set_xlabel(
        "ms — blue F, orange B, red I (input grad), green W (weight grad), grey: blocked in a receive; "
        "sN = virtual stage N; hatched in a black frame: one overlapped F+B step",
        fontsize=8,
    )
    fig.suptitle("diffcomm.pipeline timelines (gloo, CPU, one thread per rank)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
