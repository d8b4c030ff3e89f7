"""``benchmarks/bench_overhead.py`` stays runnable and counts what it claims.

The script counts (never times) the Python bytecode one forward + backward executes per
implementation on a world-1 gloo group. Run in a subprocess (it makes its own process
group); the checks are on its deterministic counts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_overhead_counts_every_implementation_and_the_floor_wraps_the_raw_calls() -> None:
    p = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_overhead.py"),
            "--json",
            "--ops",
            "all_reduce",
            "all_gather",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert p.returncode == 0, p.stderr
    rows = {(r["op"], r["impl"]): r["bytecodes"] for r in json.loads(p.stdout.strip().splitlines()[-1])}
    for op in ("all_reduce", "all_gather"):
        assert {impl for o, impl in rows if o == op} == {"raw", "floor", "torch.distributed.nn", "diffcomm"}
        # the floor runs the raw calls inside an autograd.Function: strictly more Python;
        # every autograd implementation runs at least the floor's backward machinery
        assert 0 < rows[(op, "raw")] < rows[(op, "floor")]
        assert rows[(op, "floor")] <= rows[(op, "diffcomm")]
        assert rows[(op, "floor")] <= rows[(op, "torch.distributed.nn")]
