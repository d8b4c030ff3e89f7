"""Benchmark: diffcomm forward+backward vs raw ``torch.distributed`` by hand (and
``torch.distributed.nn.functional`` where it has the op), interleaved in one run.

For each op and size, every round runs each implementation once (the order rotates
between rounds so none always goes first), each preceded by a barrier; a round's time
for an implementation is the slowest rank's. Reported: median and interquartile spread
over rounds, the ratio of medians against raw, and algorithmic / bus bandwidth.

"raw" is what a careful user writes by hand for the same forward+backward: the forward
collective into a fresh output, then the adjoint collective on the output gradient
(e.g. all_gather_into_tensor then reduce_scatter_tensor). It allocates exactly what the
out-of-place semantics need, so ``ratio`` measures diffcomm's autograd + validation
overhead.

Run ``python -m diffcomm bench`` (CLI) or :func:`run_benchmark` from Python.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from .backend import _BUS_FACTOR

BENCH_OPS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
)
DEFAULT_SIZES = (16 * 1024, 1024 * 1024, 8 * 1024 * 1024)
_BUS = _BUS_FACTOR  # bus-bandwidth factor per op (nccl-tests convention)


@dataclass
class BenchRow:
    """One (op, size, implementation) measurement."""

    op: str
    nbytes: int
    impl: str
    world: int
    median_ms: float
    q1_ms: float
    q3_ms: float
    ratio_vs_raw: float
    algbw_GBps: float
    busbw_GBps: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _impls(op: str, nbytes: int) -> dict[str, Callable[[], None]]:
    """Closures doing forward+backward of ``op`` on an input of ``nbytes`` bytes."""
    import torch.distributed.nn.functional as tdnn

    import diffcomm as dc
    from diffcomm.backend import _all_gather_single, _reduce_scatter_single

    w, r = dist.get_world_size(), dist.get_rank()
    n = max(w, nbytes // 4 // w * w)  # float32 elements, divisible by the world size
    x0 = torch.randn(n)
    chunk = n // w
    impls: dict[str, Callable[[], None]] = {}

    def dc_step(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        def step() -> None:
            x = x0.detach().requires_grad_(True)
            y = fn(x)
            y.backward(torch.ones_like(y))

        return step

    if op == "all_reduce":
        impls["diffcomm"] = dc_step(lambda x: dc.all_reduce(x))

        def raw() -> None:
            y = x0.clone()
            dist.all_reduce(y)
            g = torch.ones_like(y)
            dist.all_reduce(g)

        impls["raw"] = raw
        impls["torch.distributed.nn"] = dc_step(lambda x: _quiet(tdnn.all_reduce, x))
    elif op == "all_gather":
        impls["diffcomm"] = dc_step(lambda x: dc.all_gather(x))
        impls["diffcomm(sizes=)"] = dc_step(lambda x: dc.all_gather(x, sizes=[n] * w))

        def raw() -> None:
            y = torch.empty(n * w)
            _all_gather_single(y, x0)
            g = torch.ones_like(y)
            gx = torch.empty(n)
            _reduce_scatter_single(gx, g)

        impls["raw"] = raw
        impls["torch.distributed.nn"] = dc_step(lambda x: torch.cat(_quiet(tdnn.all_gather, x)))
    elif op == "reduce_scatter":
        impls["diffcomm"] = dc_step(lambda x: dc.reduce_scatter(x))

        def raw() -> None:
            y = torch.empty(chunk)
            _reduce_scatter_single(y, x0)
            g = torch.ones_like(y)
            gx = torch.empty(n)
            _all_gather_single(gx, g)

        impls["raw"] = raw
        impls["torch.distributed.nn"] = dc_step(
            lambda x: _quiet(tdnn.reduce_scatter, torch.empty(chunk), list(x.split(chunk)))
        )
    elif op == "broadcast":
        impls["diffcomm"] = dc_step(lambda x: dc.broadcast(x, src=0))

        def raw() -> None:
            y = x0.clone()
            dist.broadcast(y, src=0)
            g = torch.ones_like(y)
            dist.reduce(g, dst=0)
            if r != 0:
                g.zero_()

        impls["raw"] = raw
        impls["torch.distributed.nn"] = dc_step(lambda x: _quiet(tdnn.broadcast, x, 0))
    elif op == "reduce":
        impls["diffcomm"] = dc_step(lambda x: dc.reduce(x, dst=0))

        def raw() -> None:
            y = x0.clone()
            dist.reduce(y, dst=0)
            if r != 0:
                y.zero_()
            g = torch.ones_like(y)
            dist.broadcast(g, src=0)

        impls["raw"] = raw
        impls["torch.distributed.nn"] = dc_step(lambda x: _quiet(tdnn.reduce, x, 0))
    elif op == "gather":
        impls["diffcomm"] = dc_step(lambda x: dc.gather(x, dst=0, sizes=[n] * w))

        def raw() -> None:
            y = torch.zeros(n * w)
            dist.gather(x0, list(y.split(n)) if r == 0 else None, dst=0)
            g = torch.ones_like(y)
            gx = torch.empty(n)
            dist.scatter(gx, list(g.split(n)) if r == 0 else None, src=0)

        impls["raw"] = raw
        impls["torch.distributed.nn"] = dc_step(lambda x: torch.cat(_quiet(tdnn.gather, x, 0)))
    elif op == "scatter":
        impls["diffcomm"] = dc_step(lambda x: dc.scatter(x, src=0))

        def raw() -> None:
            y = torch.empty(chunk)
            dist.scatter(y, list(x0.split(chunk)) if r == 0 else None, src=0)
            g = torch.ones_like(y)
            gx = torch.zeros(n)
            dist.gather(g, list(gx.split(chunk)) if r == 0 else None, dst=0)

        impls["raw"] = raw
        impls["torch.distributed.nn"] = dc_step(lambda x: _quiet(tdnn.scatter, list(x.split(chunk)), 0))
    elif op == "all_to_all":
        impls["diffcomm"] = dc_step(lambda x: dc.all_to_all(x))

        def raw() -> None:
            y = torch.empty(n)
            dist.all_to_all_single(y, x0)
            g = torch.ones_like(y)
            gx = torch.empty(n)
            dist.all_to_all_single(gx, g)

        impls["raw"] = raw
        impls["torch.distributed.nn"] = dc_step(lambda x: _quiet(tdnn.all_to_all_single, torch.empty(n), x))
    else:
        raise ValueError(f"diffcomm bench: unknown op {op!r}; known: {BENCH_OPS}")
    return impls


def _quiet(fn: Callable[..., Any], *args: Any) -> Any:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args)


def _rank_times(op: str, nbytes: int, rounds: int, warmup: int) -> dict[str, list[float]]:
    """Runs on every rank: per implementation, the seconds of each round."""
    impls = _impls(op, nbytes)
    names = list(impls)
    times: dict[str, list[float]] = {k: [] for k in names}
    for _ in range(warmup):
        for k in names:
            try:
                impls[k]()
            except RuntimeError:
                times.pop(k, None)  # e.g. torch.distributed.nn op without a gloo backward
    names = [k for k in names if k in times]
    for i in range(rounds):
        order = names[i % len(names) :] + names[: i % len(names)]
        for k in order:
            dist.barrier()
            t0 = time.perf_counter()
            impls[k]()
            times[k].append(time.perf_counter() - t0)
    return times


def run_benchmark(
    world: Any,
    ops: Sequence[str] = BENCH_OPS,
    sizes: Sequence[int] = DEFAULT_SIZES,
    rounds: int = 30,
    warmup: int = 3,
    progress: Callable[[str], None] | None = None,
) -> list[BenchRow]:
    """Benchmark ``ops`` x ``sizes`` on a :class:`~diffcomm.LocalWorld` ``world``."""
    rows: list[BenchRow] = []
    w = world.world_size
    for op in ops:
        if op not in BENCH_OPS:
            raise ValueError(f"diffcomm bench: unknown op {op!r}; known: {BENCH_OPS}")
        for nbytes in sizes:
            if progress:
                progress(f"{op} {nbytes} B")
            per_rank = world.run(_rank_times, op, nbytes, rounds, warmup)
            impls = list(per_rank[0])
            med: dict[str, list[float]] = {}
            for k in impls:
                slowest = [max(rt[k][i] for rt in per_rank) for i in range(rounds)]
                med[k] = slowest
            raw_med = statistics.median(med["raw"])
            for k in impls:
                ts = sorted(med[k])
                m = statistics.median(ts)
                q1, q3 = ts[len(ts) // 4], ts[(3 * len(ts)) // 4]
                # bandwidth of the forward+backward pair: two collectives of nbytes each
                alg = 2 * nbytes / m / 1e9 if m > 0 else 0.0
                bus = alg * _BUS.get(op, lambda n: 1.0)(w)
                rows.append(BenchRow(op, nbytes, k, w, m * 1e3, q1 * 1e3, q3 * 1e3, m / raw_med, alg, bus))
    return rows


def format_rows(rows: Sequence[BenchRow]) -> str:
    """Plain-text table of benchmark rows."""
    head = (
        f"{'op':<15}{'size':>10}{'impl':>22}{'world':>6}{'median ms':>11}{'IQR ms':>16}"
        f"{'ratio':>8}{'busbw GB/s':>12}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.op:<15}{_size(r.nbytes):>10}{r.impl:>22}{r.world:>6}{r.median_ms:>11.3f}"
            f"{f'{r.q1_ms:.3f}-{r.q3_ms:.3f}':>16}{r.ratio_vs_raw:>8.3f}{r.busbw_GBps:>12.3f}"
        )
    return "\n".join(lines)


def _size(n: int) -> str:
    for unit, f in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= f and n % f == 0:
            return f"{n // f}{unit}"
    return f"{n}B"


def plot_rows(rows: Sequence[BenchRow], path: str) -> None:
    """Bus bandwidth vs size, one line per (implementation, op), saved to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = sorted({r.op for r in rows})
    fig, axes = plt.subplots(1, len(ops), figsize=(4 * len(ops), 3.5), squeeze=False)
    for ax, op in zip(axes[0], ops):
        for impl in sorted({r.impl for r in rows if r.op == op}):
            pts = sorted((r.nbytes, r.busbw_GBps) for r in rows if r.op == op and r.impl == impl)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(op)
        ax.set_xlabel("bytes per rank")
        ax.set_ylabel("bus bandwidth GB/s (fwd+bwd)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
