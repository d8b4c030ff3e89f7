"""Per-call cost of every op grows no faster than O(world) (O(1) for all_reduce / broadcast / reduce).

Runs ``benchmarks/bench_scaling.py`` at worlds 16, 64, 256 under torch's fake process group
(one process, no data moved) and checks deterministic counts, never wall time: Python lines
executed and function calls per forward + backward, and peak Python memory (tracemalloc).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _shared import benchmark_json

ROOT = Path(__file__).resolve().parents[2]
WORLDS = (16, 64, 256)
# Ops known to grow faster than their stated bound (none since all_reduce(product)'s
# backward uses two all_reduces, the count of zeros and the product of the non-zero
# values, instead of an all_gather of every rank's input).
KNOWN_VIOLATIONS: dict[str, str] = {}


@pytest.fixture(scope="module")
def rows() -> dict[str, dict[int, dict]]:
    # without debug mode: its cross-rank checks gather a row per rank (O(world) by design)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DIFFCOMM_DEBUG", "0")
        runs = benchmark_json("bench_scaling.py", "--worlds", *map(str, WORLDS))
    out: dict[str, dict[int, dict]] = {}
    for r in runs:
        out.setdefault(r["op"], {})[r["world"]] = r
    return out


def _ops() -> list:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from bench_scaling import CASES
    finally:
        sys.path.pop(0)
    params = []
    for op, (growth, _) in CASES.items():
        marks = (
            [pytest.mark.xfail(strict=True, reason=KNOWN_VIOLATIONS[op])] if op in KNOWN_VIOLATIONS else []
        )
        params.append(pytest.param(op, growth, id=op, marks=marks))
    return params


def _slopes(m: dict[int, dict], key: str) -> tuple[float, float]:
    a, b, c = (m[w][key] for w in WORLDS)
    return (b - a) / (WORLDS[1] - WORLDS[0]), (c - b) / (WORLDS[2] - WORLDS[1])


@pytest.mark.parametrize(("op", "growth"), _ops())
def test_cost_grows_at_most_linearly(rows: dict[str, dict[int, dict]], op: str, growth: str) -> None:
    m = rows[op]
    assert set(m) == set(WORLDS)
    small, large = m[WORLDS[0]], m[WORLDS[-1]]
    assert small["lines"] > 100 and small["calls"] > 10  # the op really ran under the tracer
    if growth == "1":
        # the same Python work at every world size, and no per-rank memory
        assert large["lines"] <= small["lines"] + 8, (op, small["lines"], large["lines"])
        assert large["calls"] <= small["calls"] + 2, (op, small["calls"], large["calls"])
        assert large["py_bytes"] <= 1.25 * small["py_bytes"] + 2048, (
            op,
            small["py_bytes"],
            large["py_bytes"],
        )
    else:
        # linear: the per-rank increment does not grow with the world (quadratic would x4 it)
        for key, factor, slack in (("lines", 1.25, 1.0), ("calls", 1.25, 1.0), ("py_bytes", 2.0, 64.0)):
            s1, s2 = _slopes(m, key)
            assert s2 <= factor * max(s1, 0.0) + slack, (op, key, s1, s2)
