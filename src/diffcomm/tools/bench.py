"""Benchmark: diffcomm forward+backward against what it replaces, interleaved in one run.

Implementations timed for each op and size (forward + backward of the same op):

``raw``
    what a careful user writes by hand: the forward collective into a fresh output, then
    the adjoint collective on the output gradient (e.g. all_gather_into_tensor then
    reduce_scatter_tensor). No autograd at all.
``floor``
    a bare :class:`torch.autograd.Function` over the same raw calls: fresh outputs, no
    validation, no labels, no logger. The least any autograd collective can cost, so
    ``diffcomm / floor`` is diffcomm's own overhead.
``torch.distributed.nn``
    ``torch.distributed.nn.functional`` where it has the op (and a backward on gloo).
``funcol``
    PyTorch's functional collectives, autograd variants
    (``all_gather_single_autograd``, ``reduce_scatter_single_autograd`` — in older torch
    ``all_gather_tensor_autograd``, ``reduce_scatter_tensor_autograd`` — and
    ``all_to_all_single_autograd``); all_reduce / broadcast / reduce / gather / scatter
    have none, so those cells are absent.
``diffcomm``
    the public op (and ``diffcomm(sizes=)`` for all_gather with ``split_sizes=`` given).
``torch.distributed.nn (again)``
    only with ``control=True`` (``--control``): ``torch.distributed.nn`` a second time,
    the same code timed as a separate implementation — a control that shows how often,
    on this machine, an implementation reads "slower" than one of equal cost.

Every round runs each implementation once, in an order drawn afresh for each round
(:func:`round_order`: none always goes first, and none always runs right after the same
other one), each preceded by a barrier; a round's time for an implementation is
the slowest rank's. Ratios are *paired*: ``impl / raw`` and ``diffcomm / floor`` are
computed within each round and then summarised (median and interquartile spread over
rounds), so a slow stretch of a loaded machine hits numerator and denominator alike.
:func:`summarize` gives the geometric mean of the median ratios per world.
``diffcomm / torch.distributed.nn`` is paired the same way (``ratio_vs_nn``);
:func:`slower_than_nn` counts the cells where diffcomm was the slower of the two in most
rounds (median above 1) and in three rounds of four (first quartile above 1), since on a
loaded machine two implementations of equal cost split the first count by chance (the
control measures it: nn against itself).

Run ``python -m diffcomm bench`` (CLI) or :func:`run_benchmark` from Python. This module
imports torch only inside its functions, so the CLI's ``--help`` stays fast.
"""

# Size: ~620 lines, just over the ~600 guideline: one benchmark, whole — the implementations
# it times (each a closure over the same input), the paired interleaved rounds, the
# statistics and the table and plot of the rows; the plotting (~90 lines) is the one
# separable part and is kept here because the CLI, the tests and benchmarks/ import it
# from this one place together with the rows it draws.

from __future__ import annotations

import math
import statistics
import textwrap
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

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
DEFAULT_SIZES = (16 * 1024, 64 * 1024, 256 * 1024, 1024 * 1024, 4 * 1024 * 1024)
# Fixed order (and so fixed plot colour) of the implementations.
IMPLS = ("raw", "floor", "torch.distributed.nn", "funcol", "diffcomm", "diffcomm(sizes=)")
_NN = "torch.distributed.nn"
#: torch.distributed.nn timed twice (``control=True``): the pair of equal cost
CONTROL = f"{_NN} (again)"
#: one fixed plot colour per implementation, the control's included
_COLOURS = dict(
    zip(
        (*IMPLS, CONTROL),
        ("tab:gray", "tab:brown", "tab:orange", "tab:purple", "tab:blue", "tab:cyan", "tab:olive"),
        strict=True,
    )
)
PLOT_INSTALL_HINT = 'pip install "diffcomm[plot]"'
#: the fewest timed rounds a benchmark takes: the quartiles of the paired ratios need them
MIN_ROUNDS = 3


@dataclass
class BenchRow:
    """One (op, size, implementation) measurement on one world.

    Times are of the slowest rank per round, in milliseconds. ``ratio_vs_raw`` and
    ``ratio_vs_floor`` are medians of per-round paired ratios, with their quartiles;
    ``ratio_vs_nn`` likewise against ``torch.distributed.nn`` (NaN where it did not run).
    """

    op: str
    nbytes: int
    impl: str
    world: int
    median_ms: float
    q1_ms: float
    q3_ms: float
    ratio_vs_raw: float
    ratio_vs_raw_q1: float
    ratio_vs_raw_q3: float
    ratio_vs_floor: float
    ratio_vs_floor_q1: float
    ratio_vs_floor_q3: float
    algbw_GBps: float
    busbw_GBps: float
    ratio_vs_nn: float = math.nan
    ratio_vs_nn_q1: float = math.nan
    ratio_vs_nn_q3: float = math.nan

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------------- statistics


def quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    """``(q1, median, q3)`` of ``values`` (nearest-rank quartiles, exact median)."""
    if not values:
        raise ValueError("quartiles of an empty sequence")
    s = sorted(values)
    return s[len(s) // 4], statistics.median(s), s[(3 * len(s)) // 4]


def paired_ratios(times: Sequence[float], base: Sequence[float]) -> tuple[float, float, float]:
    """Per-round ratios ``times[i] / base[i]`` summarised as ``(q1, median, q3)``.

    Both sequences hold one time per interleaved round (the same rounds, in order).
    """
    if len(times) != len(base):
        raise ValueError(f"paired ratios need one time per round each, got {len(times)} and {len(base)}")
    if any(b <= 0 for b in base):
        raise ValueError("paired ratios need positive base times")
    return quartiles([t / b for t, b in zip(times, base)])


def geomean(values: Sequence[float]) -> float:
    """Geometric mean of positive values."""
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"geomean needs positive values, got {list(values)}")
    return math.exp(sum(math.log(v) for v in values) / len(values))


def summarize(rows: Sequence[BenchRow]) -> dict[int, dict[str, float]]:
    """Geometric means per world of the median paired ratios over every (op, size) cell.

    Returns ``{world: {"<impl>/raw": g, ..., "diffcomm/floor": g}}``; an implementation
    missing for some op (``funcol`` has no all_reduce) is averaged over the cells it has,
    and the key ``"<impl>/raw cells"`` says how many those are.
    """
    out: dict[int, dict[str, float]] = {}
    for w in sorted({r.world for r in rows}):
        mine = [r for r in rows if r.world == w]
        summary: dict[str, float] = {}
        for impl in [i for i in IMPLS[1:] if any(r.impl == i for r in mine)]:
            vals = [r.ratio_vs_raw for r in mine if r.impl == impl]
            summary[f"{impl}/raw"] = geomean(vals)
            summary[f"{impl}/raw cells"] = len(vals)
        dvf = [r.ratio_vs_floor for r in mine if r.impl == "diffcomm" and not math.isnan(r.ratio_vs_floor)]
        if dvf:
            summary["diffcomm/floor"] = geomean(dvf)
            summary["diffcomm/floor cells"] = len(dvf)
        out[w] = summary
    return out


# ---------------------------------------------------------------------- implementations


def _floor_function() -> Any:
    import torch

    class Floor(torch.autograd.Function):
        """The cheapest autograd collective: run ``fwd``, and ``bwd`` on the gradient."""

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, fwd: Callable, bwd: Callable) -> torch.Tensor:
            ctx.bwd = bwd
            return fwd(x)

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, None, None]:
            return ctx.bwd(g), None, None

    return Floor


def _impls(op: str, nbytes: int, device: Any = "cpu", control: bool = False) -> dict[str, Callable[[], None]]:
    """Closures doing forward+backward of ``op`` on an input of ``nbytes`` bytes on
    ``device`` (with ``control``, :data:`CONTROL` too)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.nn.functional as tdnn

    import diffcomm as dc
    from diffcomm._torch import functional_collectives
    from diffcomm.backend import all_gather_single as _all_gather_single
    from diffcomm.backend import reduce_scatter_single as _reduce_scatter_single

    funcol = functional_collectives()

    if op not in BENCH_OPS:
        raise ValueError(f"diffcomm bench: unknown op {op!r}; known: {BENCH_OPS}")
    w, r = dist.get_world_size(), dist.get_rank()
    pg = dist.group.WORLD
    n = max(w, nbytes // 4 // w * w)  # float32 elements, divisible by the world size
    x0 = torch.randn(n, device=device)
    chunk = n // w
    floor = _floor_function()

    def step(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            x = x0.detach().requires_grad_(True)
            y = fn(x)
            y.backward(torch.ones_like(y))

        return run

    # One raw call per op, into a fresh output (allocated as diffcomm does, ``t.new_empty``:
    # on t's device, and as cheap as ``torch.empty``): the floor's body is the op's call forward
    # and its dual's (dc.DUALS) backward; `raw` runs the same pair by hand. The gradients
    # here are contiguous (ones_like of a fresh output), as the raw calls need.
    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        y = t.clone()
        dist.all_reduce(y)
        return y

    def broadcast(t: torch.Tensor) -> torch.Tensor:
        y = t.clone()
        dist.broadcast(y, src=0)
        return y

    def reduce(t: torch.Tensor) -> torch.Tensor:
        y = t.clone()
        dist.reduce(y, dst=0)
        return y if r == 0 else y.zero_()

    def all_gather(t: torch.Tensor) -> torch.Tensor:
        y = t.new_empty(t.numel() * w)
        _all_gather_single(y, t)
        return y

    def reduce_scatter(t: torch.Tensor) -> torch.Tensor:
        y = t.new_empty(t.numel() // w)
        _reduce_scatter_single(y, t)
        return y

    def gather(t: torch.Tensor) -> torch.Tensor:
        y = t.new_zeros(t.numel() * w)
        dist.gather(t, list(y.split(t.numel())) if r == 0 else None, dst=0)
        return y

    def scatter(t: torch.Tensor) -> torch.Tensor:
        y = t.new_empty(t.numel() // w)
        dist.scatter(y, list(t.split(y.numel())) if r == 0 else None, src=0)
        return y

    def all_to_all(t: torch.Tensor) -> torch.Tensor:
        y = t.new_empty(t.numel())
        dist.all_to_all_single(y, t)
        return y

    raw_calls = {f.__name__: f for f in (all_reduce, broadcast, reduce, all_gather, reduce_scatter)}
    raw_calls.update({f.__name__: f for f in (gather, scatter, all_to_all)})
    fwd, bwd = raw_calls[op], raw_calls[dc.DUALS[op]]

    # newer torch renamed the autograd forms (the old names warn); whichever this torch has
    fc_all_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    fc_reduce_scatter = (
        getattr(funcol, "reduce_scatter_single_autograd", None) or funcol.reduce_scatter_tensor_autograd
    )
    # op -> (diffcomm, torch.distributed.nn.functional, functional collectives or None)
    public: dict[str, tuple[Callable, Callable, Callable | None]] = {
        "all_reduce": (lambda x: dc.all_reduce(x), lambda x: _quiet(tdnn.all_reduce, x), None),
        "all_gather": (
            lambda x: dc.all_gather(x),
            lambda x: torch.cat(_quiet(tdnn.all_gather, x)),
            lambda x: fc_all_gather(x, 0, pg),
        ),
        "reduce_scatter": (
            lambda x: dc.reduce_scatter(x),
            lambda x: _quiet(tdnn.reduce_scatter, x.new_empty(chunk), list(x.split(chunk))),
            lambda x: fc_reduce_scatter(x, "sum", 0, pg),
        ),
        "broadcast": (lambda x: dc.broadcast(x, src=0), lambda x: _quiet(tdnn.broadcast, x, 0), None),
        "reduce": (lambda x: dc.reduce(x, dst=0), lambda x: _quiet(tdnn.reduce, x, 0), None),
        "gather": (
            lambda x: dc.gather(x, dst=0, split_sizes=[n] * w),
            lambda x: torch.cat(_quiet(tdnn.gather, x, 0)),
            None,
        ),
        "scatter": (
            lambda x: dc.scatter(x, src=0),
            lambda x: _quiet(tdnn.scatter, list(x.split(chunk)), 0),
            None,
        ),
        "all_to_all": (
            lambda x: dc.all_to_all(x),
            lambda x: _quiet(tdnn.all_to_all_single, x.new_empty(n), x),
            lambda x: funcol.all_to_all_single_autograd(x, None, None, pg),
        ),
    }
    dc_fn, nn_fn, fc_fn = public[op]

    def raw() -> None:
        y = fwd(x0)
        bwd(torch.ones_like(y))

    impls: dict[str, Callable[[], None]] = {
        "raw": raw,
        "floor": step(lambda x: floor.apply(x, fwd, bwd)),
        _NN: step(nn_fn),
    }
    if control:
        impls[CONTROL] = step(nn_fn)
    if fc_fn is not None:
        impls["funcol"] = step(lambda x: funcol.wait_tensor(fc_fn(x)))
    impls["diffcomm"] = step(dc_fn)
    if op == "all_gather":
        impls["diffcomm(sizes=)"] = step(lambda x: dc.all_gather(x, split_sizes=[n] * w))
    return impls


def _quiet(fn: Callable[..., Any], *args: Any) -> Any:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args)


def _rank_times(
    op: str, nbytes: int, rounds: int, warmup: int, control: bool = False
) -> dict[str, list[float]]:
    """Runs on every rank: per implementation, the seconds of each round."""
    import torch.distributed as dist

    from ..accelerator import comm_accelerator

    # the tensors live where the backend communicates (this rank's GPU for nccl), and a
    # round ends when its queued device work has finished
    acc = comm_accelerator(dist.get_backend())
    impls = _impls(op, nbytes, acc.device(), control)
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
        for k in round_order(names, i):
            acc.synchronize()
            dist.barrier()
            times[k].append(_seconds(impls[k], acc.synchronize))
    return times


def round_order(names: Sequence[str], i: int) -> list[str]:
    """The order in which round ``i`` runs ``names``: a permutation drawn from a generator
    seeded with ``i``, so every rank draws the same one (each implementation's
    communication pairs up across ranks).

    Not a rotation: rotating changes who goes first but keeps each implementation's
    predecessor, and one implementation runs faster right after another that ran the
    same code (it finds it in the caches). With the rotation ``floor`` always followed
    ``raw``, its near-twin, and ``diffcomm`` followed ``torch.distributed.nn``: at
    world 1, 16 KiB that made diffcomm / floor read 1.12-1.16 for all_gather,
    reduce_scatter and all_to_all where, drawn at random, it reads 1.09-1.10 (as the
    instruction counts of ``benchmarks/bench_overhead.py`` say; docs/performance.md).
    """
    import random

    return random.Random(i).sample(list(names), len(names))


def _seconds(fn: Callable[[], None], sync: Callable[[], None]) -> float:
    """Wall-clock seconds of ``fn()`` and the device work it queued (``sync()`` waits)."""
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def rows_from_times(
    op: str, nbytes: int, world: int, slowest: Mapping[str, Sequence[float]]
) -> list[BenchRow]:
    """Rows of one (op, size) cell from each implementation's per-round slowest-rank times.

    ``slowest`` must contain ``"raw"``; ratios against ``"floor"`` are NaN without it.
    """
    from ..backend import bus_factor

    rows = []
    for k in [i for i in IMPLS if i in slowest] + [i for i in slowest if i not in IMPLS]:
        ts = slowest[k]
        q1, m, q3 = quartiles(ts)
        rq1, rm, rq3 = paired_ratios(ts, slowest["raw"])
        if "floor" in slowest:
            fq1, fm, fq3 = paired_ratios(ts, slowest["floor"])
        else:
            fq1 = fm = fq3 = math.nan
        nq1, nm, nq3 = paired_ratios(ts, slowest[_NN]) if _NN in slowest else (math.nan, math.nan, math.nan)
        # bandwidth of the forward+backward pair: two collectives of nbytes each
        alg = 2 * nbytes / m / 1e9 if m > 0 else 0.0
        bus = alg * bus_factor(op, world)
        rows.append(
            BenchRow(
                op,
                nbytes,
                k,
                world,
                m * 1e3,
                q1 * 1e3,
                q3 * 1e3,
                rm,
                rq1,
                rq3,
                fm,
                fq1,
                fq3,
                alg,
                bus,
                nm,
                nq1,
                nq3,
            )
        )
    return rows


def above_one(ratio: float) -> bool:
    """Whether ``ratio`` reads above 1 as the tables print it (two decimals: 1.004 reads
    ``1.00``, level), so a count of "slower" cells agrees with the printed column."""
    return round(ratio, 2) > 1.0


def slower_than_nn(rows: Sequence[BenchRow], impl: str = "diffcomm") -> dict[int, tuple[int, int, int]]:
    """Per world, ``(cells, slower, slower_in_3_of_4)``: of the cells with both ``impl``
    and ``torch.distributed.nn``, those where ``impl``'s median paired ratio against it
    reads above 1 (:func:`above_one`), and those where its first quartile does too (slower
    in at least three rounds of four). With ``impl=CONTROL``: how often nn reads slower
    than itself."""
    out: dict[int, tuple[int, int, int]] = {}
    for r in rows:
        if r.impl != impl or math.isnan(r.ratio_vs_nn):
            continue
        n, slow, sure = out.get(r.world, (0, 0, 0))
        out[r.world] = (n + 1, slow + above_one(r.ratio_vs_nn), sure + above_one(r.ratio_vs_nn_q1))
    return out


def disagrees_with_nn(row: BenchRow, rows: Sequence[BenchRow]) -> bool:
    """Whether ``row``'s paired ratio against torch.distributed.nn (``ratio_vs_nn``, as
    printed) and the median times of ``row`` and of nn's row of the same cell in ``rows``
    say different things about which is faster. Each is a median of its own (of per-round
    ratios; of times), so on a noisy machine they can: the tables mark such a cell ``*``."""
    if math.isnan(row.ratio_vs_nn) or round(row.ratio_vs_nn, 2) == 1.0 or row.impl == _NN:
        return False
    nn = [r for r in rows if r.impl == _NN and (r.op, r.nbytes, r.world) == (row.op, row.nbytes, row.world)]
    return bool(nn) and above_one(row.ratio_vs_nn) != (row.median_ms > nn[0].median_ms)


def _cells(n: int) -> str:
    return "1 cell" if n == 1 else f"{n} cells"


def slower_than_nn_lines(rows: Sequence[BenchRow], width: int = 100) -> list[str]:
    """:func:`slower_than_nn` in words, one paragraph per world (then the control's, where
    it ran), each wrapped at ``width`` columns: the counts, and the cells where diffcomm
    read slower by name, as the ``x nn`` column of the table shows them."""
    control = slower_than_nn(rows, CONTROL)
    paragraphs = []
    for w, (n, slow, sure) in slower_than_nn(rows).items():
        if slow == 0:
            text = (
                f"world {w}: diffcomm was not slower than {_NN} in any of the {_cells(n)} "
                "(x nn, the median of the paired rounds, at most 1.00 in every one)."
            )
            mixed = [r for r in rows if r.world == w and r.impl == "diffcomm" and disagrees_with_nn(r, rows)]
            if mixed:
                cells = ", ".join(f"{r.op} {size_label(r.nbytes)}" for r in mixed)
                text += f" In {cells} (*) diffcomm's median ms is the higher of the two: read it as level."
        else:
            slower = [r for r in rows if r.world == w and r.impl == "diffcomm" and above_one(r.ratio_vs_nn)]
            marks = ["*" if disagrees_with_nn(r, rows) else "" for r in slower]
            named = [f"{r.op} {size_label(r.nbytes)} {r.ratio_vs_nn:.2f}{m}" for r, m in zip(slower, marks)]
            text = (
                f"world {w}: diffcomm was slower than {_NN} in {slow} of {_cells(n)} by the median "
                f"of the paired rounds (x nn above 1.00: {', '.join(named)}); of these {_cells(slow)}, "
                f"{sure} read slower in at least 3 of every 4 rounds (the bracket's lower end above 1.00)."
            )
            if any(marks):
                text += " *: diffcomm's median ms is the lower of the two there: read it as level."
        paragraphs.append(text)
        if w in control:
            n, slow, sure = control[w]
            paragraphs.append(
                f"world {w}, for scale: {_NN} timed twice read slower than itself in {slow} of "
                f"{_cells(n)}, and in {sure} of them in at least 3 of every 4 rounds: what noise "
                "alone does here."
            )
    return [textwrap.fill(p, width, subsequent_indent="  ", break_long_words=False) for p in paragraphs]


def run_benchmark(
    world: Any,
    ops: Sequence[str] = BENCH_OPS,
    sizes: Sequence[int] = DEFAULT_SIZES,
    rounds: int = 30,
    warmup: int = 3,
    progress: Callable[[str], None] | None = None,
    control: bool = False,
) -> list[BenchRow]:
    """Benchmark ``ops`` x ``sizes`` on a :class:`~diffcomm.LocalWorld` ``world``
    (``control``: time :data:`CONTROL` too).

    Raises:
        ValueError: an unknown op or fewer than :data:`MIN_ROUNDS` rounds (before any measuring).
    """
    bad = [op for op in ops if op not in BENCH_OPS]
    if bad:
        raise ValueError(f"diffcomm bench: unknown op(s) {bad}; known: {BENCH_OPS}")
    if rounds < MIN_ROUNDS:
        raise ValueError(f"diffcomm bench: rounds must be >= {MIN_ROUNDS}, got {rounds}")
    rows: list[BenchRow] = []
    w = world.world_size
    for op in ops:
        for nbytes in sizes:
            if progress:
                progress(f"{op} {nbytes} B")
            per_rank = world.run(_rank_times, op, nbytes, rounds, warmup, control)
            slowest = {k: [max(rt[k][i] for rt in per_rank) for i in range(rounds)] for k in per_rank[0]}
            rows += rows_from_times(op, nbytes, w, slowest)
    return rows


# ------------------------------------------------------------------------------ output


#: the short names the tables print (their legends spell them out)
SHORT_NAMES = {_NN: "nn", CONTROL: "nn (again)"}


def format_rows(rows: Sequence[BenchRow]) -> str:
    """Plain-text table of benchmark rows (at most 100 columns; ``nn`` is
    torch.distributed.nn), then the geometric means per world and the verdict against nn."""

    def ratio(v: float) -> str:
        return "-" if math.isnan(v) else f"{v:.3f}"

    head = (
        f"{'op':<15}{'size':>7}{'impl':>18}{'world':>6}{'median ms':>10}{'IQR ms':>15}"
        f"{'/raw':>7}{'/floor':>7}{'/nn':>7}{'GB/s':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.op:<15}{size_label(r.nbytes):>7}{SHORT_NAMES.get(r.impl, r.impl):>18}{r.world:>6}"
            f"{r.median_ms:>10.3f}{f'{r.q1_ms:.3f}-{r.q3_ms:.3f}':>15}{ratio(r.ratio_vs_raw):>7}"
            f"{ratio(r.ratio_vs_floor):>7}{ratio(r.ratio_vs_nn):>7}{r.busbw_GBps:>8.3f}"
        )
    for w, s in summarize(rows).items():
        parts = [f"{k} {v:.3f}" for k, v in s.items() if not k.endswith("cells")]
        lines += _pack(f"geomean world {w}: ", parts, 100)
    lines += slower_than_nn_lines(rows)
    return "\n".join(lines)


def _pack(prefix: str, items: Sequence[str], width: int) -> list[str]:
    """``prefix`` and ``items`` joined by ", " in lines of at most ``width`` columns, broken
    only between items (the lines after the first indented by two)."""
    lines, line = [], prefix
    for i, item in enumerate(items):
        piece = item + ("," if i < len(items) - 1 else "")
        if line.strip() and len(line) + 1 + len(piece) > width and line != prefix:
            lines.append(line)
            line = "  " + piece
        else:
            line += ("" if line == prefix else " ") + piece
    return [*lines, line]


def size_label(n: int) -> str:
    """``16384`` -> ``"16KiB"``."""
    for unit, f in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= f and n % f == 0:
            return f"{n // f}{unit}"
    return f"{n}B"


def plot_missing() -> str | None:
    """``None`` when ``--plot`` can work, else the error message (naming the extra)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return f"plotting needs matplotlib, which is not installed: {PLOT_INSTALL_HINT}"
    return None


def machine_label() -> str:
    """A short description of this machine for plot titles (CPU, cores, accelerator)."""
    import os
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    label = f"{platform.system()} {cpu}, {os.cpu_count()} cores"
    if torch.cuda.is_available():
        label += f", {torch.cuda.get_device_name()}"
    return label


def impl_colour(impl: str) -> str:
    """One fixed colour per implementation (the same in every panel and every plot)."""
    return _COLOURS.get(impl, "black")


def plot_figure(rows: Sequence[BenchRow], backend: str = "gloo") -> Any:
    """The bench plot as a matplotlib ``Figure`` (Agg): one panel per (world, op), one
    line per implementation in its fixed colour, titled with the worlds, the backend and
    this machine.

    Time rather than bus bandwidth, so world 1 (no communication: pure overhead) reads too.

    Raises:
        ImportError: matplotlib is missing (the message names ``diffcomm[plot]``).
    """
    missing = plot_missing()
    if missing:
        raise ImportError(missing)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({r.world for r in rows})
    ops = [op for op in BENCH_OPS if any(r.op == op for r in rows)]
    fig, axes = plt.subplots(
        len(worlds), len(ops), figsize=(4 * len(ops), 3.4 * len(worlds) + 0.6), squeeze=False
    )
    for i, w in enumerate(worlds):
        for ax, op in zip(axes[i], ops):
            cell = [r for r in rows if r.op == op and r.world == w]
            for impl in [k for k in IMPLS if any(r.impl == k for r in cell)]:
                pts = sorted((r.nbytes, r.median_ms) for r in cell if r.impl == impl)
                style = "--" if impl == "raw" else "-"
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    style,
                    marker="o",
                    label=impl,
                    color=impl_colour(impl),
                )
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{op}, world {w}")
            ax.set_xlabel("bytes per rank")
            ax.set_ylabel("median ms, slowest rank (fwd+bwd)")
            ax.legend(fontsize=7)
    ws = ", ".join(map(str, worlds))
    fig.suptitle(f"diffcomm bench: forward+backward, world {ws} ({backend}), {machine_label()}")
    fig.tight_layout()
    return fig


def plot_rows(rows: Sequence[BenchRow], path: str, backend: str = "gloo") -> None:
    """Write :func:`plot_figure` to ``path`` (PNG at 110 dpi).

    Raises:
        ImportError: matplotlib is missing (the message names ``diffcomm[plot]``).
    """
    fig = plot_figure(rows, backend)
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
