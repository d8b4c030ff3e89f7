"""Collectives forward+backward: diffcomm vs raw torch.distributed vs torch.distributed.nn.

Usage: python benchmarks/bench_collectives.py [--world 2 4] [--ops all_gather ...]
       [--sizes 16384 1048576] [--rounds 30] [--plot out.png]
(The same as ``python -m diffcomm bench``.)
"""

from __future__ import annotations

import argparse

import diffcomm as dc
from diffcomm.tools.bench import BENCH_OPS, DEFAULT_SIZES, format_rows, plot_rows, run_benchmark


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--world", type=int, nargs="+", default=[2, 4])
    p.add_argument("--ops", nargs="+", default=list(BENCH_OPS))
    p.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES))
    p.add_argument("--rounds", type=int, default=30, help="timed rounds per (op, size), >= 3 (default 30)")
    p.add_argument("--plot", default=None)
    a = p.parse_args()
    rows = []
    for w in a.world:
        with dc.LocalWorld(w) as world:
            rows += run_benchmark(world, a.ops, a.sizes, a.rounds)
    print(format_rows(rows))
    if a.plot:
        plot_rows(rows, a.plot)
        print(f"plot written to {a.plot}")


if __name__ == "__main__":
    main()
