"""Coalesced collectives: one call for many small tensors vs a loop of single calls.

A thin command line over :mod:`diffcomm.tools.bench_coalesced` (also ``python -m diffcomm bench
--coalesced``): 256 float32 tensors of 4 KiB, forward + backward, worlds 2 and 4 by
default; coalesced vs a loop of single calls vs one flat call, paired per-round ratios,
peak memory in units of the payload, the load average.

Usage::

    python benchmarks/bench_coalesced.py                       # worlds 2 4, all_reduce
    python benchmarks/bench_coalesced.py --world 2 --rounds 50 --ops all_reduce all_gather
    python benchmarks/bench_coalesced.py --json
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console

from diffcomm.tools.bench_coalesced import OPS, run_suite, table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4], help="world sizes (default 2 4)")
    parser.add_argument(
        "--ops", nargs="+", default=["all_reduce"], choices=OPS, help="ops (default all_reduce)"
    )
    parser.add_argument("--tensors", type=int, default=256, help="number of tensors (default 256)")
    parser.add_argument("--bytes", type=int, default=4096, help="bytes per tensor (default 4096)")
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds (default 30)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    result = run_suite(args.world, args.ops, args.tensors, args.bytes, args.rounds, args.warmup)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        Console(width=220).print(table(result, args.tensors, args.bytes, args.rounds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
