"""Per-call overhead at world 1, timed steadily in one process (CPU/gloo or one GPU/nccl).

``python -m diffcomm bench`` times one forward + backward per round across real ranks,
which at world 1 is a fraction of a millisecond and moves with the machine's load. Here
one process joins a world-1 group (nccl on its GPU when torch sees one, else gloo) and
times the implementations of :func:`diffcomm.tools.bench._impls` (raw, floor,
torch.distributed.nn, diffcomm) on ``--size`` bytes: ``--calls`` forward + backward per
implementation, split into 7 blocks that interleave the implementations; a block ends
when the device's queued work has finished. Reported: the median block's time per call
and the ratios to the floor. ``--profile`` adds a cProfile of 1000 calls of the floor and
of diffcomm (top functions by own time).

Run: ``python benchmarks/bench_world1.py [--ops all_gather ...] [--size 16384]
[--calls 3000] [--cpu] [--profile] [--json]``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import socket
import statistics
import time
from typing import Any

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
IMPLS = ("raw", "floor", "torch.distributed.nn", "diffcomm")
BLOCKS = 7


def _init(cpu: bool) -> tuple[Any, Any]:
    """Join a world-1 group; returns (device, synchronize)."""
    import torch
    import torch.distributed as dist

    gpu = torch.cuda.is_available() and dist.is_nccl_available() and not cpu
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if gpu:
        torch.cuda.set_device(0)
    else:
        torch.set_num_threads(1)
    backend = "nccl" if gpu else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    if gpu:
        return torch.device("cuda", 0), torch.cuda.synchronize
    return torch.device("cpu"), lambda: None


def time_op(op: str, size: int, calls: int, device: Any, sync: Any) -> dict[str, float]:
    """Median seconds per forward + backward of each implementation."""
    from diffcomm.tools.bench import _impls

    impls = _impls(op, size, device)
    names = [k for k in IMPLS if k in impls]
    per_block = max(1, calls // BLOCKS)
    for k in names:  # warm-up
        for _ in range(min(200, per_block)):
            impls[k]()
    sync()
    blocks: dict[str, list[float]] = {k: [] for k in names}
    for b in range(BLOCKS):
        for k in names[b % len(names) :] + names[: b % len(names)]:
            fn = impls[k]
            t0 = time.perf_counter()
            for _ in range(per_block):
                fn()
            sync()
            blocks[k].append((time.perf_counter() - t0) / per_block)
    return {k: statistics.median(v) for k, v in blocks.items()}


def profile(op: str, size: int, impl: str, device: Any, sync: Any, top: int = 20) -> str:
    """cProfile of 1000 calls of ``impl``: the ``top`` functions by own time."""
    from diffcomm.tools.bench import _impls

    fn = _impls(op, size, device)[impl]
    for _ in range(100):
        fn()
    sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(1000):
        fn()
    sync()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    parser.add_argument("--size", type=int, default=16384, help="bytes per call (default 16384)")
    parser.add_argument("--calls", type=int, default=3000, help="forward + backward per implementation")
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU even where a GPU is visible")
    parser.add_argument("--profile", action="store_true", help="add a cProfile of the floor and diffcomm")
    parser.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    args = parser.parse_args(argv)
    import torch
    import torch.distributed as dist

    device, sync = _init(args.cpu)
    rows = []
    try:
        if not args.json:
            name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
            what = f"{args.size} B, {args.calls} calls per implementation"
            print(f"world 1, {dist.get_backend()} on {name}, {what}")
            print(f"{'op':<15} " + " ".join(f"{k:>21}" for k in IMPLS) + "  d/floor  nn/floor")
        for op in args.ops:
            t = time_op(op, args.size, args.calls, device, sync)
            row = {"op": op, "nbytes": args.size, "device": device.type}
            row.update({f"{k}_us": v * 1e6 for k, v in t.items()})
            row["diffcomm_vs_floor"] = t["diffcomm"] / t["floor"]
            row["nn_vs_floor"] = t["torch.distributed.nn"] / t["floor"]
            rows.append(row)
            if not args.json:
                cells = " ".join(f"{t[k] * 1e6:>19.1f}us" for k in IMPLS)
                print(f"{op:<15} {cells}  {row['diffcomm_vs_floor']:7.3f}  {row['nn_vs_floor']:8.3f}")
            if args.profile and not args.json:
                for impl in ("floor", "diffcomm"):
                    print(f"--- {op} {impl}")
                    print(profile(op, args.size, impl, device, sync))
        if args.json:
            print(json.dumps(rows))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
