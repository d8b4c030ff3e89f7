"""Dispatch overhead of :meth:`diffcomm.LocalWorld.run` with a trivial function.

What one ``run()`` costs on top of the work itself: pickling the function, sending it to
every rank over its socket, the ranks unpickling and calling it, and collecting the
replies. Property tests call ``run()`` thousands of times, so this must stay small.

Usage::

    python benchmarks/bench_dispatch.py                 # world sizes 1 2 4, 500 calls each
    python benchmarks/bench_dispatch.py --sizes 2 --calls 2000
"""

from __future__ import annotations

import argparse
import statistics

from _common import timed
from rich.console import Console
from rich.table import Table

from diffcomm import LocalWorld


def _trivial() -> None:
    return None


def measure(world_size: int, calls: int, warmup: int) -> dict[str, float]:
    """Seconds per ``run(_trivial)`` on a started world: median, p90, mean, min, max."""
    with LocalWorld(world_size) as world:
        samples = timed(world.run, _trivial, calls=calls, warmup=warmup)
    samples.sort()
    return {
        "median": statistics.median(samples),
        "p90": samples[min(len(samples) - 1, int(0.9 * len(samples)))],
        "mean": statistics.fmean(samples),
        "min": samples[0],
        "max": samples[-1],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4], help="world sizes")
    parser.add_argument("--calls", type=int, default=500, help="timed calls per world size")
    parser.add_argument("--warmup", type=int, default=50, help="untimed calls first")
    args = parser.parse_args(argv)

    table = Table(title=f"LocalWorld.run() dispatch overhead ({args.calls} calls, {args.warmup} warm-up)")
    for col in ("world", "median ms", "p90 ms", "mean ms", "min ms", "max ms"):
        table.add_column(col, justify="right")
    for n in args.sizes:
        s = measure(n, args.calls, args.warmup)
        table.add_row(str(n), *(f"{s[k] * 1e3:.3f}" for k in ("median", "p90", "mean", "min", "max")))
    Console().print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
