"""Cost of one diffcomm op as the world grows, in one process, under torch's fake process group.

Every op is built forward + backward at world 8, 64, 512, 4096 on a single process whose
default group is ``torch.testing._internal.distributed.fake_pg`` (collectives return at
once without moving data), so what is measured is diffcomm's own per-call work as a
function of the world size, not the network. Per op and world:

``lines``
    Python lines executed for one forward + backward (``sys.settrace`` line events): the
    deterministic measure of Python work, used by ``tests/ops/test_scaling.py``.
``calls``
    Python function calls for one forward + backward.
``cpu_us``
    process CPU time per forward + backward (median of repeats, microseconds).
``py_bytes``
    peak Python-side memory of one forward + backward (``tracemalloc``; tensor storage is
    not Python memory and is not counted).

Per-rank tensors are as small as each op allows (8 elements; ``W`` elements where the input
must split into ``W`` chunks), so the growth seen is the op's bookkeeping. Expected growth:
O(1) for all_reduce / broadcast / reduce, at most O(world) for the rest (they take or
return one chunk per rank).

Usage::

    python benchmarks/bench_scaling.py                       # worlds 8 64 512 4096, table
    python benchmarks/bench_scaling.py --worlds 8 32 --json  # what the test runs
    python benchmarks/bench_scaling.py --plot docs/_static/scaling.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import tracemalloc
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import diffcomm as dc

# op label -> (expected growth, builder(world) -> (input, function of the input))
Builder = Callable[[int], tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]]


def _fixed(fn: Callable[[torch.Tensor, int], torch.Tensor]) -> Builder:
    return lambda w: (torch.randn(8), lambda x: fn(x, w))


def _chunked(fn: Callable[[torch.Tensor, int], torch.Tensor]) -> Builder:
    return lambda w: (torch.randn(w), lambda x: fn(x, w))


CASES: dict[str, tuple[str, Builder]] = {
    "all_reduce": ("1", _fixed(lambda x, w: dc.all_reduce(x))),
    "all_reduce(max)": ("1", _fixed(lambda x, w: dc.all_reduce(x, op="max"))),
    "all_reduce(product)": ("1", _fixed(lambda x, w: dc.all_reduce(x, op="product"))),
    "broadcast": ("1", _fixed(lambda x, w: dc.broadcast(x, src=0))),
    "reduce": ("1", _fixed(lambda x, w: dc.reduce(x, dst=0))),
    "all_gather": ("W", _fixed(lambda x, w: dc.all_gather(x))),
    "all_gather(sizes=)": ("W", _fixed(lambda x, w: dc.all_gather(x, split_sizes=[8] * w))),
    "reduce_scatter": ("W", _chunked(lambda x, w: dc.reduce_scatter(x))),
    "reduce_scatter(split_sizes=)": ("W", _chunked(lambda x, w: dc.reduce_scatter(x, split_sizes=[1] * w))),
    "gather": ("W", _fixed(lambda x, w: dc.gather(x, dst=0, split_sizes=[8] * w))),
    "scatter": ("W", _chunked(lambda x, w: dc.scatter(x, src=0))),
    "all_to_all": ("W", _chunked(lambda x, w: dc.all_to_all(x))),
    "all_to_all(split_sizes=)": (
        "W",
        _chunked(lambda x, w: dc.all_to_all(x, input_split_sizes=[1] * w, output_split_sizes=[1] * w)),
    ),
}
DEFAULT_WORLDS = (8, 64, 512, 4096)


def _step(x0: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    x = x0.detach().requires_grad_(True)
    y = fn(x)
    y.backward(torch.ones_like(y))


class _Counter:
    def __init__(self) -> None:
        self.lines = 0
        self.calls = 0

    def trace(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "call":
            self.calls += 1
            return self.local
        return None

    def local(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            self.lines += 1
        return self.local


def measure_op(name: str, world: int, repeats: int = 20) -> dict[str, Any]:
    """One op at one world size (the fake default group must be up with that size)."""
    growth, build = CASES[name]
    x0, fn = build(world)
    for _ in range(3):
        _step(x0, fn)  # warm caches (capabilities, group records)
    counter = _Counter()
    sys.settrace(counter.trace)
    try:
        _step(x0, fn)
    finally:
        sys.settrace(None)
    tracemalloc.start()
    peaks = []
    for _ in range(3):
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        _step(x0, fn)
        peaks.append(tracemalloc.get_traced_memory()[1] - base)
    tracemalloc.stop()
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        _step(x0, fn)
        times.append(time.process_time() - t0)
    return {
        "op": name,
        "world": world,
        "expected": growth,
        "lines": counter.lines,
        "calls": counter.calls,
        "py_bytes": min(peaks),
        "cpu_us": statistics.median(times) * 1e6,
    }


def run(worlds: tuple[int, ...] = DEFAULT_WORLDS, ops: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    """Every op (or ``ops``) at every world size, one fake default group per world."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    rows = []
    for w in worlds:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=w)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for name in ops or tuple(CASES):
                    rows.append(measure_op(name, w, repeats=5 if w >= 1024 else 20))
        finally:
            dist.destroy_process_group()
    return rows


def growth_exponent(rows: list[dict[str, Any]], op: str, key: str) -> float:
    """Slope of log(key) against log(world) between the smallest and largest world."""
    import math

    mine = sorted((r["world"], r[key]) for r in rows if r["op"] == op)
    (w0, v0), (w1, v1) = mine[0], mine[-1]
    return math.log(max(v1, 1e-12) / max(v0, 1e-12)) / math.log(w1 / w0)


def growth_report(rows: list[dict[str, Any]]) -> list[str]:
    """The table's growth-exponent lines; none for a single world size (a slope needs two)."""
    if len({r["world"] for r in rows}) < 2:
        return []
    lines = ["\ngrowth exponent (smallest -> largest world): lines, py_bytes, cpu"]
    for op in dict.fromkeys(r["op"] for r in rows):
        exp = next(r["expected"] for r in rows if r["op"] == op)
        e = [growth_exponent(rows, op, k) for k in ("lines", "py_bytes", "cpu_us")]
        lines.append(f"{op:<30} expected O({exp}): {e[0]:.2f} {e[1]:.2f} {e[2]:.2f}")
    return lines


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r["op"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    cmap = plt.get_cmap("tab20")
    for i, op in enumerate(ops):
        pts = sorted((r["world"], r["cpu_us"], r["lines"], r["py_bytes"]) for r in rows if r["op"] == op)
        ws = [p[0] for p in pts]
        style = "--" if rows[[r["op"] for r in rows].index(op)]["expected"] == "1" else "-"
        for ax, k in zip(axes, (1, 2, 3)):
            ax.plot(ws, [max(p[k], 1) for p in pts], style, marker="o", color=cmap(i % 20), label=op)
    ws = sorted({r["world"] for r in rows})
    for ax, title in zip(axes, ("CPU µs per forward+backward", "Python lines executed", "peak Python bytes")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ws, [str(w) for w in ws])
        ax.set_xlabel("world size (fake process group, one process)")
        ax.set_title(title)
    lo = min(r["lines"] for r in rows)
    axes[1].plot(ws, [lo * w / ws[0] for w in ws], ":", color="black", label="O(world) reference")
    axes[1].legend(fontsize=7, ncol=1)
    fig.suptitle(f"diffcomm per-call cost vs world size (torch {torch.__version__}, dashed: expected O(1))")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="+", default=list(DEFAULT_WORLDS))
    p.add_argument("--ops", nargs="+", default=None, choices=list(CASES))
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--plot", default=None, metavar="OUT.png")
    a = p.parse_args()
    rows = run(tuple(a.worlds), tuple(a.ops) if a.ops else None)
    if a.json:
        print(json.dumps(rows))
    else:
        print(f"{'op':<30}{'world':>6}{'lines':>9}{'calls':>8}{'py KiB':>9}{'cpu us':>10}")
        for r in rows:
            print(
                f"{r['op']:<30}{r['world']:>6}{r['lines']:>9}{r['calls']:>8}"
                f"{r['py_bytes'] / 1024:>9.1f}{r['cpu_us']:>10.0f}"
            )
        for line in growth_report(rows):
            print(line)
    if a.plot:
        plot(rows, a.plot)


if __name__ == "__main__":
    main()
