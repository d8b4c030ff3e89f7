"""Benchmark of the coalesced collectives: one call for many small tensors vs a loop of
single calls vs one call on a flat tensor of the same total bytes.

The case of the coalesced-ops issue: 256 float32 tensors of 4 KiB, forward + backward.
Implementations, timed **interleaved** in one run (each round runs every implementation
once, in an order drawn afresh each round, each after a barrier; a round's time is the slowest rank's):

* ``coalesced`` — ``dc.<op>_coalesced(tensors)`` and its backward (one call per dtype);
* ``loop``      — ``[dc.<op>(t) for t in tensors]`` and their backward (one call each);
* ``flat``      — ``dc.<op>(flat)`` of one tensor of the same total bytes and its
  backward: the floor a coalesced op can reach (it adds packing and unpacking, and
  autograd handles every tensor instead of one);
* ``coalesced_fwd`` / ``flat_fwd`` — the same forward on detached tensors (no autograd):
  the packing cost alone;
* ``list_floor`` — no communication at all: an identity autograd Function over the same
  256 tensors (outputs are views), forward + backward. What autograd alone charges for a
  list of that many tensors; ``flat + list_floor`` is the floor of any differentiable op
  on such a list, and ``coalesced / (flat + list_floor)`` what the coalesced op adds.

The backward of every step runs the autograd engine from the outputs with their
cotangents (what ``loss.backward()`` hands to the op), not ``torch.autograd.grad``,
whose Python-side check of every (output, cotangent) pair costs about as much again per
tensor as the engine and is paid by no training step.

Reported: median and interquartile range of each implementation's round time, the
**paired** ratios ``loop / coalesced``, ``coalesced / flat`` and ``coalesced / (flat +
list_floor)`` (per round, then median and IQR), and the peak of the live tensor bytes
allocated during one forward+backward (torch profiler memory records) in units of the
payload. Run it twice and compare; the load
average is reported with the results.

Run ``python -m diffcomm bench --coalesced`` or ``python benchmarks/bench_coalesced.py``.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from rich.table import Table

import diffcomm as dc

OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter")


def _round_order(names: list[str], i: int) -> list[str]:
    """Round ``i``'s order: :func:`diffcomm.tools.bench.round_order` (drawn per round, the same
    on every rank; not a rotation, which keeps who runs right after whom). Written here
    again: the two bench modules are independent layers."""
    return random.Random(i).sample(names, len(names))


class _Identity(torch.autograd.Function):
    """``list_floor``: views of the inputs out, the gradients back (no communication)."""

    @staticmethod
    def forward(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *gs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return gs


def _backward(outs: list[torch.Tensor], inputs: list[torch.Tensor], cots: list[torch.Tensor]) -> None:
    """Gradients of ``inputs`` from ``outs`` with cotangents ``cots``, through the autograd
    engine directly (``torch.autograd.grad`` minus its per-pair Python checks)."""
    try:
        from torch.autograd.graph import _engine_run_backward
    except ImportError:  # another torch: the public call
        torch.autograd.grad(outs, inputs, grad_outputs=cots)
        return
    _engine_run_backward(tuple(outs), tuple(cots), False, False, tuple(inputs), False, accumulate_grad=False)


def _steps(op: str, n_tensors: int, nbytes: int) -> dict[str, Callable[[], None]]:
    """Forward+backward closures of each implementation (same data every call)."""
    w = dist.get_world_size()
    numel = max(w, nbytes // 4 // w * w)  # float32, divisible by the world (reduce_scatter)
    gen = torch.Generator().manual_seed(dist.get_rank())
    xs = [torch.randn(numel, generator=gen).requires_grad_(True) for _ in range(n_tensors)]
    flat = torch.randn(numel * n_tensors, generator=gen).requires_grad_(True)
    single = getattr(dc, op)
    coalesced = getattr(dc, f"{op}_coalesced")

    # the cotangents exist before the step (what a loss would hand to backward); shaped
    # like the outputs (one untimed forward, on every rank alike)
    with torch.no_grad():
        cot_xs = [torch.ones_like(o) for o in coalesced([x.detach() for x in xs])]
        cot_flat = [torch.ones_like(single(flat.detach()))]

    run = _backward
    cot_in = [torch.ones_like(x) for x in xs]  # list_floor's outputs are shaped like the inputs
    xs_data = [x.detach() for x in xs]
    flat_data = flat.detach()
    return {
        "coalesced": lambda: run(coalesced(xs), xs, cot_xs),
        "loop": lambda: run([single(x) for x in xs], xs, cot_xs),
        "flat": lambda: run([single(flat)], [flat], cot_flat),
        # forward only, no autograd: the packing cost alone
        "coalesced_fwd": lambda: coalesced(xs_data),
        "flat_fwd": lambda: single(flat_data),
        "list_floor": lambda: run(list(_Identity.apply(*xs)), xs, cot_in),
    }


def _peak_bytes(step: Callable[[], None]) -> int:
    """Peak of the live tensor bytes allocated during ``step``, from the torch profiler's
    memory records: each op's own (self) allocation at its start, and the allocations and
    frees recorded outside any op, summed in time order (a peak inside one op is seen as
    that op's net allocation)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    deltas = []
    for e in prof.events():
        delta = e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        if delta:
            deltas.append((e.time_range.start, delta))
    live = peak = 0
    for _, delta in sorted(deltas):
        live += delta
        peak = max(peak, live)
    return peak


def _rank_run(op: str, n_tensors: int, nbytes: int, rounds: int, warmup: int) -> dict[str, Any]:
    steps = _steps(op, n_tensors, nbytes)
    names = list(steps)
    for _ in range(warmup):
        for name in names:
            steps[name]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(rounds):
        for name in _round_order(names, i):
            dist.barrier()
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
    memory = {name: _peak_bytes(steps[name]) for name in names}
    return {"times": times, "memory": memory}


def _q(values: list[float]) -> tuple[float, float, float]:
    values = sorted(values)
    if len(values) < 4:
        return values[0], statistics.median(values), values[-1]
    q = statistics.quantiles(values, n=4)
    return q[0], q[1], q[2]


def measure(world: dc.LocalWorld, op: str, n_tensors: int, nbytes: int, rounds: int, warmup: int) -> dict:
    per_rank = world.run(_rank_run, op, n_tensors, nbytes, rounds, warmup)
    names = list(per_rank[0]["times"])
    # a round's time: the slowest rank's
    rt = {n: [max(r["times"][n][i] for r in per_rank) for i in range(rounds)] for n in names}
    payload = n_tensors * max(world.world_size, nbytes // 4 // world.world_size * world.world_size) * 4
    out: dict[str, Any] = {"op": op, "world": world.world_size, "tensors": n_tensors, "bytes_each": nbytes}
    out["payload_bytes"] = payload
    for n in names:
        q1, med, q3 = _q(rt[n])
        out[f"{n}_ms"] = (q1 * 1e3, med * 1e3, q3 * 1e3)
    speedup = [lo / co for lo, co in zip(rt["loop"], rt["coalesced"])]
    vs_flat = [co / fl for co, fl in zip(rt["coalesced"], rt["flat"])]
    out["loop_over_coalesced"] = _q(speedup)
    out["coalesced_over_flat"] = _q(vs_flat)
    out["fwd_coalesced_over_flat"] = _q([co / fl for co, fl in zip(rt["coalesced_fwd"], rt["flat_fwd"])])
    floor = [fl + li for fl, li in zip(rt["flat"], rt["list_floor"])]
    out["coalesced_over_floor"] = _q([co / f for co, f in zip(rt["coalesced"], floor)])
    for n in ("coalesced", "loop", "flat"):  # worst rank
        out[f"{n}_peak_x_payload"] = max(r["memory"][n] for r in per_rank) / payload
    return out


def run_suite(
    worlds: list[int],
    ops: list[str],
    n_tensors: int = 256,
    nbytes: int = 4096,
    rounds: int = 30,
    warmup: int = 3,
    backend: str = "gloo",
    open_world: Callable[[int], AbstractContextManager[Any]] | None = None,
) -> dict[str, Any]:
    """Every (world, op) cell, each world size on a fresh local world (or on
    ``open_world(size)``'s: the command line's, with its flags); with the load average
    around it."""
    if open_world is None:
        open_world = lambda w: dc.LocalWorld(w, backend=backend, timeout=1200)
    load = os.getloadavg()
    rows = []
    for w in worlds:
        with open_world(w) as world:
            for op in ops:
                rows.append(measure(world, op, n_tensors, nbytes, rounds, warmup))
    return {"load_before": load, "load_after": os.getloadavg(), "rows": rows}


def table(result: dict[str, Any], n_tensors: int, nbytes: int, rounds: int) -> Table:
    load, load_after = result["load_before"], result["load_after"]
    title = (
        f"{n_tensors} float32 tensors x {nbytes} B, forward+backward, {rounds} interleaved "
        f"rounds (slowest rank); load avg before {load[0]:.2f}, after {load_after[0]:.2f}"
    )
    t = Table(
        title=title,
        caption="ratios: median [IQR] of per-round paired ratios; peak mem: peak "
        "live tensor bytes allocated during one forward+backward (worst rank) / payload",
    )
    cols = ["world", "op", "coalesced ms", "loop ms", "flat ms", "loop/coalesced", "coalesced/flat"]
    cols += ["list floor ms", "coalesced/(flat+floor)", "fwd-only coalesced/flat"]
    cols += ["peak mem coalesced", "peak mem flat", "peak mem loop"]
    for c in cols:
        t.add_column(c, justify="left" if c == "op" else "right")

    def ms(q: tuple[float, float, float]) -> str:
        return f"{q[1]:.2f} [{q[0]:.2f}-{q[2]:.2f}]"

    def ratio(q: tuple[float, float, float]) -> str:
        return f"{q[1]:.2f}x [{q[0]:.2f}-{q[2]:.2f}]"

    for r in result["rows"]:
        t.add_row(
            str(r["world"]),
            f"{r['op']}_coalesced",
            ms(r["coalesced_ms"]),
            ms(r["loop_ms"]),
            ms(r["flat_ms"]),
            ratio(r["loop_over_coalesced"]),
            ratio(r["coalesced_over_flat"]),
            ms(r["list_floor_ms"]),
            ratio(r["coalesced_over_floor"]),
            ratio(r["fwd_coalesced_over_flat"]),
            f"{r['coalesced_peak_x_payload']:.2f}x",
            f"{r['flat_peak_x_payload']:.2f}x",
            f"{r['loop_peak_x_payload']:.2f}x",
        )
    return t
