"""Python work per forward+backward, counted instead of timed.

``python -m diffcomm bench`` times each implementation, and at world 1 (no
communication) a round takes 0.2-0.6 ms of which the wrapper is tens of microseconds:
on a shared 2-core machine that is inside the noise (the raw op alone moved from 0.10 to
0.37 ms between runs here, with the machine's load). This script measures the same
implementations (:func:`diffcomm.tools.bench._impls`: raw, floor, torch.distributed.nn,
funcol, diffcomm) by the Python bytecode instructions one forward+backward executes on
a world-1 gloo group, after a warm-up: a count, the same on every run and machine (for
one torch and Python version), so a change to the hot path shows as a number.

The count covers Python only (torch's own Python wrappers included: the floor calls
``torch.distributed``'s public functions), not C++: ``--callgrind`` adds the machine
instructions of 300 calls under valgrind's callgrind (if valgrind is installed), which
do include C++ (autograd, tensor allocation, and gloo's threads, which run the op and
wait for it: the instruction counts vary by a few percent between runs).

Run: ``python benchmarks/bench_overhead.py [--ops all_reduce ...] [--size 16384]
[--callgrind]``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
IMPLS = ("raw", "floor", "torch.distributed.nn", "diffcomm")


def _init_world1() -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def bytecodes(fn: Callable[[], None], warmup: int = 50) -> tuple[int, collections.Counter[str]]:
    """Bytecode instructions of one call of ``fn`` (after ``warmup`` calls), in total and
    per function (``file:function``)."""
    for _ in range(warmup):
        fn()
    per_fn: collections.Counter[str] = collections.Counter()

    def trace(frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        code = frame.f_code
        key = f"{os.path.basename(code.co_filename)}:{code.co_name}"

        def local(f: Any, ev: str, a: Any) -> Any:
            if ev == "opcode":
                per_fn[key] += 1
            return local

        return local

    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(None)
    return sum(per_fn.values()), per_fn


def _callgrind(op: str, impl: str, size: int, calls: int) -> int | None:
    """Machine instructions per call of ``impl`` under callgrind (``None`` without valgrind)."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cg.out")
        cmd = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            f"--callgrind-out-file={out}",
            sys.executable,
            __file__,
            "--_child",
            op,
            impl,
            str(size),
            str(calls),
        ]
        subprocess.run(cmd, capture_output=True, check=True)
        with open(out) as f:
            for line in f:
                if line.startswith("totals:"):
                    return round(int(line.split()[1]) / calls)
    return None


def _child(op: str, impl: str, size: int, calls: int) -> None:
    """Inside callgrind: warm up, switch instrumentation on for ``calls`` calls, exit."""
    from diffcomm.tools.bench import _impls

    _init_world1()
    fn = _impls(op, size)[impl]
    for _ in range(100):
        fn()
    pid = str(os.getpid())
    subprocess.run(["callgrind_control", "-i", "on", pid], capture_output=True)
    for _ in range(calls):
        fn()
    subprocess.run(["callgrind_control", "-i", "off", pid], capture_output=True)
    os._exit(0)  # no teardown inside the count's file


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_child"]:
        _child(argv[1], argv[2], int(argv[3]), int(argv[4]))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", nargs="+", default=list(OPS))
    p.add_argument("--size", type=int, default=16 * 1024, help="bytes per rank (default 16 KiB)")
    p.add_argument("--callgrind", action="store_true", help="also count machine instructions (valgrind)")
    p.add_argument("--top", type=int, default=0, help="list diffcomm's N costliest functions per op")
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    args = p.parse_args(argv)

    from diffcomm.tools.bench import _impls

    _init_world1()
    head = f"{'op':15s} {'impl':22s} {'bytecodes':>9s} {'/ floor':>8s}"
    if not args.json:
        print(head + (f" {'instructions':>12s} {'/ floor':>8s}" if args.callgrind else ""))
    rows = []
    for op in args.ops:
        impls = _impls(op, args.size)
        counts = {k: bytecodes(impls[k]) for k in IMPLS if k in impls}
        insns = {k: _callgrind(op, k, args.size, 300) for k in counts} if args.callgrind else {}
        rows += [
            {"op": op, "impl": k, "bytecodes": n, "instructions": insns.get(k)}
            for k, (n, _) in counts.items()
        ]
        if args.json:
            continue
        for k, (n, _) in counts.items():
            line = f"{op:15s} {k:22s} {n:9d} {n / counts['floor'][0]:8.2f}"
            if args.callgrind and insns.get(k) and insns.get("floor"):
                line += f" {insns[k]:12d} {insns[k] / insns['floor']:8.2f}"
            print(line)
        if args.top:
            for name, n in counts["diffcomm"][1].most_common(args.top):
                print(f"{'':15s}   {n:5d} {name}")
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
