"""Cost of the flight recorder per communication (target: <= 2 us, so it is on by default).

Two measurements, each as **paired rounds**: within a round the same work runs with the
recorder off and on (the order alternates between rounds), and the cost is the per-op
difference of that round; the table shows the median over rounds and the spread
(25th-75th percentile, min-max).

* ``hook``: the recorder's own hot path (:func:`diffcomm.diagnostics.recorder.begin` + ``end``)
  called seven Python frames below a "user" frame, as from ``dc.all_reduce`` -> dynamo's
  wrapper -> autograd ``apply`` -> ``forward`` -> backend op -> ``_dispatch`` -> ``_run``
  (the call-site walk steps over them), recording on and off, each minus the same calls
  without the hook (off still looks up the group and applies ``DIFFCOMM_TIMEOUT``).
  Timed twice: by the wall clock, and by the thread's CPU time (which leaves out the
  time the thread was preempted; on a shared machine that is the hook's own cost).
* ``all_reduce``: a whole ``dc.all_reduce`` of 16 floats on ``world`` real gloo ranks
  (:class:`~diffcomm.LocalWorld`), recorder off vs on, measured inside every rank; the
  largest rank's difference counts. Communication noise is much larger than the cost, so
  this number is noisy; it shows that nothing else gets slower.

Usage::

    python benchmarks/bench_flight.py                    # hook + all_reduce on worlds 1 2
    python benchmarks/bench_flight.py --rounds 101 --op-calls 200 --worlds 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from diffcomm import LocalWorld, _config
from diffcomm.diagnostics import recorder as _flight


def _stats(diffs: list[float]) -> dict[str, float]:
    d = sorted(diffs)
    q = statistics.quantiles(d, n=4) if len(d) >= 2 else [d[0], d[0], d[0]]
    return {"median": statistics.median(d), "q1": q[0], "q3": q[2], "min": d[0], "max": d[-1]}


# ------------------------------------------------------------------------------ hook


# The frames between the user's call and the hook, compiled under a file name inside the
# diffcomm package so that the call-site walk steps over them as it does in a real op.
_FRAMES = ("public", "compile_wrapper", "apply", "forward", "backend", "dispatch", "run")
_CHAIN = """
def run(hook, sample):
    if hook:
        e = _flight.begin("all_reduce", None, 64, sample, "all_reduce(sum)")
        _flight.end(e)
""" + "".join(
    f"\ndef {caller}(hook, sample):\n    {callee}(hook, sample)\n"
    for caller, callee in zip(_FRAMES, _FRAMES[1:])
)
_chain: dict[str, Any] = {"_flight": _flight}
exec(compile(_CHAIN, _flight._PKG + "_bench_chain.py", "exec"), _chain)


#: ``wall``: time.perf_counter; ``cpu``: this thread's CPU time (time.thread_time), which
#: does not count the time the thread was preempted: on a machine shared with other jobs
#: it is the cost the hook itself adds to every op
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def _hook_calls(n: int, hook: bool, clock: str = "wall") -> float:
    public = _chain["public"]
    sample = torch.ones(16)
    now = CLOCKS[clock]
    start = now()
    for _ in range(n):
        public(hook, sample)  # the "user" frame: this line is the recorded call site
    return (now() - start) / n


def measure_hook(rounds: int, calls: int, clock: str = "wall") -> tuple[dict[str, float], dict[str, float]]:
    """Seconds per op of the hook, recording on and off, each against no hook at all
    (paired rounds; the order of the three variants rotates between rounds)."""
    on_diffs, off_diffs = [], []
    variants = ["none", "off", "on"]
    for r in range(rounds):
        timings = {}
        for v in variants[r % 3 :] + variants[: r % 3]:
            with _config.FLIGHT.set(v == "on"):
                timings[v] = _hook_calls(calls, v != "none", clock)
        on_diffs.append(timings["on"] - timings["none"])
        off_diffs.append(timings["off"] - timings["none"])
    return _stats(on_diffs), _stats(off_diffs)


# ------------------------------------------------------------------------ all_reduce


def _all_reduce_rounds(rounds: int, calls: int) -> list[float]:
    import diffcomm as dc

    x = torch.ones(16)
    for _ in range(50):
        dc.all_reduce(x)
    diffs = []
    for r in range(rounds):
        timings: dict[bool, float] = {}
        for on in (False, True) if r % 2 == 0 else (True, False):
            with _config.FLIGHT.set(on):
                start = time.perf_counter()
                for _ in range(calls):
                    dc.all_reduce(x)
                timings[on] = (time.perf_counter() - start) / calls
        diffs.append(timings[True] - timings[False])
    return diffs


def measure_all_reduce(world: int, rounds: int, calls: int) -> dict[str, Any]:
    with LocalWorld(world, timeout=3600) as w:
        per_rank = w.run(_all_reduce_rounds, rounds, calls)
    worst = max(per_rank, key=statistics.median)
    return _stats(worst)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=51, help="paired rounds (off/on) per measurement")
    parser.add_argument("--calls", type=int, default=1000, help="ops per half-round (hook)")
    parser.add_argument("--op-calls", type=int, default=300, help="ops per half-round (all_reduce)")
    parser.add_argument("--worlds", type=int, nargs="*", default=[1, 2], help="world sizes for all_reduce")
    args = parser.parse_args(argv)

    load = os.getloadavg()[0]
    table = Table(
        title=f"flight recorder cost per op, on - off ({args.rounds} paired rounds; load avg {load:.1f})"
    )
    for col in ("what", "median us", "q1 us", "q3 us", "min us", "max us"):
        table.add_column(col, justify="right" if col != "what" else "left")
    rows = []
    for clock in ("wall", "cpu"):
        on, off = measure_hook(args.rounds, args.calls, clock)
        rows += [(f"hook, recording on ({clock} clock)", on), (f"hook, recording off ({clock} clock)", off)]
    for n in args.worlds:
        cost = measure_all_reduce(n, args.rounds, args.op_calls)
        rows.append((f"dc.all_reduce 16 floats, world {n}, on - off", cost))
    for what, s in rows:
        table.add_row(what, *(f"{s[k] * 1e6:.2f}" for k in ("median", "q1", "q3", "min", "max")))
    Console(width=130).print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
