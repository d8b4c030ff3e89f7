"""Soak: many mixed ops at world 4, resident memory, threads and file descriptors sampled.

Usage::

    python benchmarks/bench_soak.py                 # 10,000 ops at world 4
    python benchmarks/bench_soak.py --ops 2000 --world 2 --json out.json

Each rank runs the same seeded random sequence of blocking collectives (all_reduce with a
random reduce op, all_gather, reduce_scatter), ``async_op=True`` ones, coalesced lists and
point-to-point ring shifts, each with a random size and a backward, and samples every
``--every`` ops: resident memory (RSS), its thread count, its open file descriptors and
the flight recorder's entry count. Reports per rank the first and last sample and the
growth after warm-up (the first 10 % of the ops).
"""

from __future__ import annotations

import argparse
import json
import os
import random
from typing import Any

import psutil
import torch

import diffcomm as dc

OPS = ("all_reduce", "all_gather", "reduce_scatter", "async_all_gather", "coalesced", "shift")
REDUCE = ("sum", "avg", "max", "min", "product")


def soak(n_ops: int, every: int, seed: int = 0) -> list[dict[str, Any]]:
    """The rank body: ``n_ops`` mixed ops, a sample every ``every`` ops."""
    from diffcomm.diagnostics import recorder as _flight

    proc = psutil.Process()
    rng = random.Random(seed)
    world = dc.get_world_size()
    samples = []
    for i in range(n_ops):
        kind = rng.choice(OPS)
        rows = rng.randint(1, 64) * world
        x = torch.randn(rows, rng.choice((1, 8, 64)), dtype=torch.float64, requires_grad=True)
        if kind == "all_reduce":
            y = dc.all_reduce(x, op=rng.choice(REDUCE))
        elif kind == "all_gather":
            y = dc.all_gather(x)
        elif kind == "reduce_scatter":
            y = dc.reduce_scatter(x)
        elif kind == "async_all_gather":
            y = dc.all_gather(x, async_op=True) * 1.0
        elif kind == "coalesced":
            y = sum(t.sum() for t in dc.all_reduce_coalesced([x, x[:1].float()]))
        else:
            y = dc.shift(x, rng.choice((1, -1)))
        y.sum().backward()
        if i % every == 0 or i == n_ops - 1:
            dc.wait_sends()
            samples.append(
                {
                    "op": i,
                    "rss_mb": proc.memory_info().rss / 2**20,
                    "threads": proc.num_threads(),
                    "fds": proc.num_fds(),
                    "recorder": len(_flight._RING),
                    "recorder_cap": _flight._RING.maxlen,
                }
            )
    return samples


def summarize(per_rank: list[list[dict[str, Any]]], n_ops: int) -> list[dict[str, Any]]:
    rows = []
    for r, s in enumerate(per_rank):
        warm = next(x for x in s if x["op"] >= n_ops // 10)
        last = s[-1]
        rows.append(
            {
                "rank": r,
                "rss_first_mb": round(s[0]["rss_mb"], 1),
                "rss_warm_mb": round(warm["rss_mb"], 1),
                "rss_last_mb": round(last["rss_mb"], 1),
                "rss_growth_after_warmup_mb": round(last["rss_mb"] - warm["rss_mb"], 1),
                "threads": sorted({x["threads"] for x in s if x["op"] >= warm["op"]}),
                "fds": sorted({x["fds"] for x in s if x["op"] >= warm["op"]}),
                "recorder_max": max(x["recorder"] for x in s),
                "recorder_cap": last["recorder_cap"],
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=10_000)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--every", type=int, default=250)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    os.environ.setdefault("DIFFCOMM_TIMEOUT", "60")
    with dc.LocalWorld(args.world, timeout=3600, collective_timeout=60) as w:
        per_rank = w.run(soak, args.ops, args.every)
    rows = summarize(per_rank, args.ops)
    for row in rows:
        print(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ops": args.ops, "world": args.world, "rows": rows, "samples": per_rank}, f, indent=1)


if __name__ == "__main__":
    main()
