"""A/B of ``dc.all_gather`` without ``split_sizes`` between two source trees.

Issue 33 made the all_gather that learns the row counts with the rows also carry every
rank's shape record (128 bytes in front of its rows instead of a 64-byte count), so that
a shape or dtype mismatch is an error on every rank. This measures what that costs:
each round runs one fresh process per tree, in alternating order, each starting a world
of 2 and timing ``--calls`` gathers of each shape after a warm-up (median per call, the
slower rank); the result is the per-round ratio B / A, median and range over the rounds.

    python benchmarks/bench_gather_record.py --a /path/to/old/src --b src --rounds 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

SHAPES = [(4, 16), (64, 256), (8, 4096)]


def _rank_body(shapes: list[tuple[int, ...]], calls: int) -> dict[str, float]:
    import torch
    from _common import timed

    import diffcomm as dc

    out = {}
    for shape in shapes:
        x = torch.ones(*shape)
        ts = timed(dc.all_gather, x, calls=calls, warmup=20)
        out[str(tuple(shape))] = statistics.median(ts) * 1e6
    return out


def _one_process(calls: int) -> dict[str, float]:
    import diffcomm as dc

    with dc.LocalWorld(2) as world:
        per_rank = world.run(_rank_body, SHAPES, calls)
    return {k: max(r[k] for r in per_rank) for k in per_rank[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", required=True, help="src folder of build A (the baseline)")
    p.add_argument("--b", required=True, help="src folder of build B")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(_one_process(args.calls)))
        return
    ratios: dict[str, list[float]] = {str(s): [] for s in SHAPES}
    for r in range(args.rounds):
        order = [("a", args.a), ("b", args.b)] if r % 2 == 0 else [("b", args.b), ("a", args.a)]
        got = {}
        for name, src in order:
            env = dict(os.environ, PYTHONPATH=os.path.abspath(src), DIFFCOMM_PROGRESS="0")
            cmd = [sys.executable, __file__, "--child", "--a", "-", "--b", "-", "--calls", str(args.calls)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            got[name] = json.loads(out.stdout.strip().splitlines()[-1])
        for k in ratios:
            ratios[k].append(got["b"][k] / got["a"][k])
        cells = [f"{k} A {got['a'][k]:.0f} us B {got['b'][k]:.0f} us" for k in ratios]
        print(f"round {r + 1}: " + ", ".join(cells))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"B / A per round (median, min-max), load average {load:.1f}:")
    for k, v in ratios.items():
        print(f"  {k}: {statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f})")


if __name__ == "__main__":
    main()
