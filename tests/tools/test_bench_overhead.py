"""``benchmarks/bench_overhead.py`` stays runnable and counts what it claims.

The script counts (never times) the Python bytecode one forward + backward executes per
implementation on a world-1 gloo group. Run in a subprocess (it makes its own process
group); the checks are on its deterministic counts.
"""

from __future__ import annotations

from _shared import benchmark_json


def test_bench_overhead_counts_every_implementation_and_the_floor_wraps_the_raw_calls() -> None:
    runs = benchmark_json("bench_overhead.py", "--ops", "all_reduce", "all_gather", timeout=300)
    rows = {(r["op"], r["impl"]): r["bytecodes"] for r in runs}
    for op in ("all_reduce", "all_gather"):
        assert {impl for o, impl in rows if o == op} == {"raw", "floor", "torch.distributed.nn", "diffcomm"}
        # the floor runs the raw calls inside an autograd.Function: strictly more Python;
        # every autograd implementation runs at least the floor's backward machinery
        assert 0 < rows[(op, "raw")] < rows[(op, "floor")]
        assert rows[(op, "floor")] <= rows[(op, "diffcomm")]
        assert rows[(op, "floor")] <= rows[(op, "torch.distributed.nn")]
