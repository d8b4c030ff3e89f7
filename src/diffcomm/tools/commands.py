"""``python -m diffcomm check`` and ``python -m diffcomm bench`` (registered in ``cli``).

A usage error raises :class:`UsageError`; ``cli.main`` prints it as one ``error:`` line on
stderr and exits 2. Everything is checked before the first rank starts.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import time
from collections.abc import Sequence
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from diffcomm.tools.bench import MIN_ROUNDS  # torch-free at import

# Size: ~610 lines: the two commands' argument parsers, runs and tables (check: local
# ranks, the registry's cases, user modules; bench: its table and plot), each a screen.

C10D_BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl")
#: ``--ops`` names that select another's cases (send and recv are checked together)
_CHECK_ALIASES = {"send": "send/recv", "recv": "send/recv"}


def check_ops() -> list[str]:
    """The built-in ops ``check`` covers, in its cases' order (family by family:
    collective, p2p, coalesced, mapping), from the families' homes' literal ``__all__``
    lists, read as data by :mod:`diffcomm.tools.op_names` (no torch import), so ``--help``
    lists them and a bad ``--ops`` is refused at once. With ``--module``, the names are read
    off the registry."""
    from diffcomm.tools.op_names import builtin_ops

    names = [_CHECK_ALIASES.get(n, n) for ops in builtin_ops().values() for n in ops]
    return list(dict.fromkeys(names))


#: backends that communicate on a device, with the device kind (one device per rank)
_DEVICE_BACKENDS = {"nccl": "CUDA", "xccl": "XPU"}


class UsageError(Exception):
    """A bad command line (argument, op name, backend): one ``error:`` line, exit code 2."""


def check_worlds(worlds: Sequence[int]) -> None:
    """Raise :class:`UsageError` unless every world size is >= 1."""
    bad = [w for w in worlds if w < 1]
    if bad:
        raise UsageError(f"world size must be >= 1, got {bad[0]}")


def check_backend(backend: str, worlds: Sequence[int]) -> None:
    """Raise :class:`UsageError` unless local ranks of every world can use ``backend`` here.

    An unknown name or one this torch build lacks lists the backends it has; ``nccl`` /
    ``xccl`` also need one GPU per rank.
    """
    import torch.distributed as dist

    if not dist.is_available():
        raise UsageError("torch.distributed is not available in this torch build")
    device = _DEVICE_BACKENDS.get(backend.lower())
    needs = f"; {backend} needs a {device} build of torch and one {device} GPU per rank" if device else ""
    if not dist.is_backend_available(backend):
        have = ", ".join(b for b in C10D_BACKENDS if dist.is_backend_available(b))
        raise UsageError(f"--backend {backend}: not available in this torch build (it has: {have}){needs}")
    if device:
        from diffcomm.accelerator import comm_accelerator

        acc = comm_accelerator(backend)
        count = acc.device_count() if acc.name != "cpu" else 0
        if count < max(worlds):
            raise UsageError(
                f"--backend {backend}: {count} {device} GPU(s) visible, world {max(worlds)} needs one "
                "per rank; use --backend gloo on CPU"
            )


def unknown_name_error(flag: str, given: Sequence[str], valid: Sequence[str]) -> UsageError | None:
    """The :class:`UsageError` for the first name of ``given`` not in ``valid`` (listing them)."""
    for name in given:
        if name not in valid:
            close = difflib.get_close_matches(name, valid, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            return UsageError(f"{flag}: unknown op {name!r}{hint}; valid: {', '.join(valid)}")
    return None


# ---------------------------------------------------------------------------------- check


def load_module(spec: str) -> Any:
    """Import ``spec``, a file path (``ops/my_ops.py``, imported under its file name's
    stem) or a dotted module name: defining its op classes registers them. Importing the
    same file again returns the module already imported."""
    import importlib
    import importlib.util
    import sys
    from pathlib import Path

    if not (spec.endswith(".py") or "/" in spec or "\\" in spec):
        return importlib.import_module(spec)
    path = Path(spec).resolve()
    if not path.is_file():
        raise UsageError(f"--module: no file {spec!r}")
    name = path.stem
    have = sys.modules.get(name)
    if have is not None and Path(getattr(have, "__file__", "") or "").resolve() == path:
        return have
    loader = importlib.util.spec_from_file_location(name, path)
    assert loader is not None and loader.loader is not None
    module = importlib.util.module_from_spec(loader)
    sys.modules[name] = module  # the registry finds an op's public function by module
    loader.loader.exec_module(module)
    return module


def standard_suite(world: int, modules: Sequence[str] = ()) -> list[Any]:
    """Every op's standard cases for ``world`` ranks, family by family (collective, p2p,
    coalesced, mapping), each op in the registry's order: diffcomm's own and those the
    modules named ``modules`` define."""
    from diffcomm.testing.cases import standard_cases, standard_p2p_cases
    from diffcomm.testing.coalesced import standard_coalesced_cases
    from diffcomm.testing.mappings import standard_mapping_cases

    kinds = (standard_cases, standard_p2p_cases, standard_coalesced_cases, standard_mapping_cases)
    return [c for kind in kinds for c in kind(world, modules)]


def _run_one(case: Any, modules: Sequence[str] = ()) -> dict[str, Any]:
    from diffcomm.testing.cases import run_case
    from diffcomm.testing.coalesced import CoalescedCase, run_coalesced_case
    from diffcomm.testing.mappings import is_mapping, run_mapping_case

    for m in modules:  # this rank registers the user's ops too
        load_module(m)
    if isinstance(case, CoalescedCase):
        return run_coalesced_case(case).as_dict()
    if is_mapping(case.op):
        return run_mapping_case(case).as_dict()
    return run_case(case).as_dict()


def check_backend_name(backend: str) -> None:
    """Raise :class:`UsageError` for a name that is no c10d backend (without torch)."""
    if backend.lower() not in C10D_BACKENDS:
        close = difflib.get_close_matches(backend.lower(), C10D_BACKENDS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        names = ", ".join(C10D_BACKENDS)
        raise UsageError(f"--backend: unknown backend {backend!r}{hint}; c10d backends: {names}")


def local_world_arguments(parser: argparse.ArgumentParser, default: list[int], world_help: str) -> None:
    """The arguments of the local ranks a command starts (``check``, ``bench``): ``-n`` /
    ``--world``, ``--backend``, ``--allow-oversubscribe``."""
    parser.add_argument(
        "-n", "--world", type=int, nargs="+", default=default, metavar="WORLD", help=world_help
    )
    parser.add_argument("--backend", default="gloo", help="c10d backend of the local ranks (default gloo)")
    parser.add_argument(
        "--allow-oversubscribe",
        action="store_true",
        help="start a world larger than this machine can hold (more than 8 ranks per core or "
        "more estimated memory than available) instead of refusing it",
    )


def local_world(args: argparse.Namespace, world: int, timeout: float) -> Any:
    """The :class:`~diffcomm.LocalWorld` of ``world`` ranks a command runs on (its
    ``--backend`` and ``--allow-oversubscribe``; no progress line of its own: the command
    prints what happens)."""
    from diffcomm.runtime.world import LocalWorld

    over = args.allow_oversubscribe or None
    return LocalWorld(world, backend=args.backend, timeout=timeout, allow_oversubscribe=over, progress=False)


def world_progress(world: int, console: Console, quiet: bool, *columns: Any) -> Progress:
    """The transient progress bar of a command's run on one world (hidden when ``quiet``)."""
    return Progress(
        TextColumn(f"world {world}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        *columns,
        console=console,
        transient=True,
        disable=quiet,
    )


def check_configure(parser: argparse.ArgumentParser) -> None:
    local_world_arguments(
        parser, [2, 3], "world size(s) to check on (default: 2 3; 3 catches even-split assumptions)"
    )
    parser.add_argument(
        "--ops",
        nargs="+",
        default=None,
        metavar="OP",
        help="only these ops (default: all of them; e.g. all_gather send shift copy_to_region): "
        + ", ".join(check_ops()),
    )
    parser.add_argument(
        "--module",
        action="append",
        default=[],
        metavar="PATH_OR_MODULE",
        help="also check the ops a module defines (a .py file or a dotted module name, "
        "imported on every rank first; repeatable): every op class it defines is registered, "
        "and its standard cases run with the built-in ones",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument(
        "--flight",
        action="store_true",
        help="with --json: include every rank's flight recorder (its last communications) per world",
    )


def _flight_snapshot() -> dict[str, Any]:
    import diffcomm

    return diffcomm.flight_recorder().as_dict()


def check_run(args: argparse.Namespace, console: Console) -> int:
    """Adjoint + reference-gradient check of every op on local ranks; non-zero on failure."""
    # the command line first, before torch is imported (seconds): a typo is refused at once
    check_worlds(args.world)
    modules = list(args.module or [])
    if args.ops is not None and not modules:
        if err := unknown_name_error("--ops", args.ops, [*check_ops(), *_CHECK_ALIASES]):
            raise err
    check_backend_name(args.backend)

    from diffcomm.runtime.world import check_world_fits

    names = []
    for m in modules:
        try:
            names.append(load_module(m).__name__)
        except ImportError as exc:
            raise UsageError(f"--module {m}: {exc}") from None
    if modules:
        from diffcomm.ops import registry

        if problems := registry.verify():
            raise UsageError("the op registry: " + "; ".join(problems))
    if not args.allow_oversubscribe:
        check_world_fits(max(args.world), override="--allow-oversubscribe")
    every = {w: standard_suite(w, names) for w in args.world}
    if args.ops is not None and modules:
        names = list(dict.fromkeys(c.op for w in args.world for c in every[w]))
        if err := unknown_name_error("--ops", args.ops, [*names, *_CHECK_ALIASES]):
            raise err
    if args.ops is not None:
        args.ops = [_CHECK_ALIASES.get(op, op) for op in args.ops]
    check_backend(args.backend, args.world)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    flights: dict[str, Any] = {}
    failures = 0
    for w in args.world:
        cases = [c for c in every[w] if args.ops is None or c.op in args.ops]
        if not cases:
            raise UsageError(f"--ops: no cases for {' '.join(args.ops or [])} on world {w}")
        if not args.json:
            console.print(f"starting {w} local ranks (each imports torch: seconds) ...")
        with local_world(args, w, 300) as world:
            with world_progress(w, console, args.json, TimeElapsedColumn()) as bar:
                task = bar.add_task("", total=len(cases))
                for case in cases:
                    bar.update(task, description=f"{case.op} {case.label()}")
                    t0 = time.perf_counter()
                    try:
                        per_rank = world.run(_run_one, case, modules)
                        failure = None
                    except Exception as exc:  # a failing case is a row, not a crash
                        per_rank, failure = [], f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
                    row = _merge(case, w, per_rank, failure, time.perf_counter() - t0)
                    failures += not row["ok"]
                    rows.append(row)
                    bar.advance(task)
            if args.flight:
                try:
                    flights[str(w)] = world.run(_flight_snapshot)
                except Exception as exc:  # the world may be torn down by a failure
                    flights[str(w)] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    if args.json:
        out: dict[str, Any] = {"ok": failures == 0, "failures": failures, "cases": rows}
        if args.flight:
            out["flight"] = flights
        console.print_json(json.dumps(out))
    else:
        for w in args.world:
            console.print()
            console.print(_table([r for r in rows if r["world"] == w], w, args.backend))
        for r in rows:
            if not r["ok"]:
                why = r["error"] or ", ".join(
                    f"{k} {_fmt(r[k])}" for k in ("forward_err", "adjoint_err", "grad_err", "double_err")
                )
                what = escape(f"world {r['world']} {r['op']} {r['case']}: {why}")
                console.print(f"[red]✗[/red] {what}", highlight=False)
        verdict = (
            "[green]all checks passed[/green]" if failures == 0 else f"[red]{failures} case(s) failed[/red]"
        )
        seconds = time.perf_counter() - started
        console.print(f"{len(rows)} cases on world(s) {args.world} in {seconds:.0f} s: {verdict}")
        console.print("[dim]every case, with its errors and time: --json[/dim]")
    return 0 if failures == 0 else 1


def _merge(
    case: Any, world: int, per_rank: list[dict[str, Any]], err: str | None, seconds: float
) -> dict[str, Any]:
    def worst(key: str) -> float | None:
        vals = [r[key] for r in per_rank if r.get(key) is not None]
        return max(vals) if vals else None

    ok = err is None and bool(per_rank) and all(r["ok"] for r in per_rank)
    return {
        "world": world,
        "op": case.op,
        "case": case.label(),
        "forward_ok": err is None
        and all(r["forward_err"] <= r["tol"] and r["input_unchanged"] and r["no_alias"] for r in per_rank),
        "forward_err": worst("forward_err"),
        "adjoint_err": worst("adjoint_err"),
        "grad_err": worst("grad_err"),
        "double_err": worst("double_err"),
        "seconds": round(seconds, 4),
        "ok": ok,
        "error": err,
    }


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1e}"


def _table(rows: list[dict[str, Any]], world: int, backend: str) -> Table:
    """One row per op (its cases' worst errors), so the table fits 80 columns."""
    t = Table(
        title=f"diffcomm check, world {world} ({backend}): max error per op vs a reference",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
    )
    t.add_column("op", no_wrap=True, min_width=min(24, max(len(r["op"]) for r in rows)))
    for col in ("cases", "forward", "adjoint", "grad", "2nd-order"):
        t.add_column(col, justify="right", no_wrap=True)
    t.add_column("ok", justify="center", no_wrap=True)
    by_op: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_op.setdefault(r["op"], []).append(r)
    for op, cell in by_op.items():

        def worst(key: str, cell: list[dict[str, Any]] = cell) -> str:
            vals = [r[key] for r in cell if r[key] is not None]
            return _fmt(max(vals) if vals else None)

        failed = sum(not r["ok"] for r in cell)
        t.add_row(
            op,
            str(len(cell)),
            worst("forward_err"),
            worst("adjoint_err"),
            worst("grad_err"),
            worst("double_err"),
            "[green]✓[/green]" if not failed else f"[red]✗ {failed}[/red]",
        )
    return t


# ---------------------------------------------------------------------------------- bench


def bench_configure(parser: argparse.ArgumentParser) -> None:
    from diffcomm.tools.bench import BENCH_OPS, DEFAULT_SIZES, size_label

    local_world_arguments(parser, [2], "world size(s) (default 2)")
    parser.add_argument(
        "--ops",
        nargs="+",
        default=["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"],
        choices=BENCH_OPS,
        metavar="OP",
        help=f"ops to time (from {', '.join(BENCH_OPS)}). Default: all_reduce, all_gather, "
        "reduce_scatter, all_to_all and broadcast (the four with no root, and broadcast); "
        "reduce, gather and scatter (rooted, like broadcast) move the same bytes as all_reduce, "
        "all_gather and reduce_scatter through the same code and are left out to keep the "
        "default run short: add them by name",
    )
    default_sizes = [size_label(n) for n in DEFAULT_SIZES]
    parser.add_argument(
        "--sizes",
        nargs="+",
        default=default_sizes,
        metavar="SIZE",
        help=f"bytes per rank, e.g. 16KiB 1MiB 4194304 (default {' '.join(default_sizes)})",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=20,
        help=f"timed rounds per (op, size), at least {MIN_ROUNDS}: the quartiles need them (default 20)",
    )
    parser.add_argument(
        "--plot",
        default=None,
        metavar="OUT.png",
        help='write a bandwidth-vs-size plot (needs matplotlib: pip install "diffcomm[plot]")',
    )
    parser.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    parser.add_argument(
        "--control",
        action="store_true",
        help="also time torch.distributed.nn a second time: how often an equal pair reads 'slower' here",
    )
    parser.add_argument(
        "--coalesced",
        nargs="*",
        default=None,
        metavar="OP",
        help="instead: the coalesced ops (default all_reduce) on --tensors tensors of --tensor-bytes "
        "each vs a loop of single calls vs one flat call (see diffcomm.tools.bench_coalesced)",
    )
    parser.add_argument("--tensors", type=int, default=256, help="with --coalesced: tensors (default 256)")
    parser.add_argument(
        "--tensor-bytes", type=int, default=4096, help="with --coalesced: bytes per tensor (default 4096)"
    )


def _bench_coalesced(args: argparse.Namespace, console: Console) -> int:
    from diffcomm.tools.bench_coalesced import OPS, run_suite, table

    ops = args.coalesced or ["all_reduce"]
    err = unknown_name_error("--coalesced", ops, OPS)
    if err:
        raise err
    if args.tensors < 1 or args.tensor_bytes < 4:
        raise UsageError("--tensors must be >= 1 and --tensor-bytes >= 4")
    check_backend(args.backend, args.world)
    result = run_suite(
        args.world,
        ops,
        args.tensors,
        args.tensor_bytes,
        args.rounds,
        open_world=lambda w: local_world(args, w, 1200),  # its --backend, --allow-oversubscribe
    )
    if args.json:
        console.print_json(json.dumps(result))
    else:
        console.print(table(result, args.tensors, args.tensor_bytes, args.rounds))
    return 0


def parse_size(text: str) -> int:
    """``"16KiB"`` -> 16384; plain integers are bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 1000, "mb": 10**6, "b": 1}
    s = text.strip().lower()
    for u, f in units.items():
        if s.endswith(u) and s[: -len(u)].strip().isdigit():
            return int(s[: -len(u)]) * f
    if s.isdigit():
        return int(s)
    raise ValueError(f"bad size {text!r}; use e.g. 16KiB, 1MiB or a number of bytes")


#: what each implementation row of the bench table is, by its printed name
_IMPL_WORDS = {
    "raw": "torch.distributed, no autograd",
    "floor": "a bare autograd.Function around raw",
    "nn": "torch.distributed.nn",
    "nn (again)": "torch.distributed.nn timed a second time (--control): how often an equal pair "
    "reads slower",
    "funcol": "functional collectives",
    "diffcomm": "the public op",
    "diffcomm(sizes=)": "all_gather with split_sizes= given",
}


def _short(impl: str) -> str:
    from diffcomm.tools.bench import SHORT_NAMES

    return SHORT_NAMES.get(impl, impl)


def bench_legend(rows: Sequence[Any]) -> str:
    """How to read :func:`bench_table` of ``rows``: its columns, and what each
    implementation shown is (only those shown)."""
    from diffcomm.tools.bench import disagrees_with_nn

    shown = {_short(r.impl) for r in rows}
    has_nn = "nn" in shown
    text = (
        "ms: median over the rounds of forward+backward, the slowest rank each round. "
        + ("x raw / x nn" if has_nn else "x raw")
        + ": the median over the rounds of the row's time divided by raw's"
        + (" / nn's" if has_nn else "")
        + " in the same round (below 1: faster"
        + ("; in brackets, the range of the middle half of the rounds). " if has_nn else "). ")
        + "GB/s: bus bandwidth. "
        + "; ".join(f"{name}: {words}" for name, words in _IMPL_WORDS.items() if name in shown)
        + "."
    )
    if any(disagrees_with_nn(r, rows) for r in rows):
        text += (
            " *: the paired ratio and the two rows' median ms disagree on which is faster "
            "(each a median of its own): read that cell as level."
        )
    return text


def bench_table(rows: Sequence[Any], world: int) -> Table:
    """One world's rows as a table that fits 100 columns (:func:`bench_legend` explains it)."""
    from diffcomm.tools.bench import CONTROL, disagrees_with_nn, size_label

    t = Table(
        title=f"diffcomm bench, world {world}: forward+backward",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
    )
    has_nn = any(not math.isnan(r.ratio_vs_nn) for r in rows)
    for col in ("op", "size", "impl", "ms", "x raw", *(["x nn"] if has_nn else []), "GB/s"):
        t.add_column(col, justify="left" if col in ("op", "impl") else "right", no_wrap=True)
    for r in rows:
        mine = r.impl.startswith("diffcomm")
        vs_raw = f"{r.ratio_vs_raw:.2f}"
        vs_nn = "-"
        if (mine or r.impl == CONTROL) and not math.isnan(r.ratio_vs_nn):
            vs_nn = f"{r.ratio_vs_nn:.2f} ({r.ratio_vs_nn_q1:.2f}-{r.ratio_vs_nn_q3:.2f})"
            vs_nn += "*" if disagrees_with_nn(r, rows) else " "
        if mine:
            vs_raw, vs_nn = f"[bold]{vs_raw}[/bold]", f"[bold]{vs_nn}[/bold]"
        t.add_row(
            r.op,
            size_label(r.nbytes),
            _short(r.impl),
            f"{r.median_ms:.3f}",
            vs_raw,
            *([vs_nn] if has_nn else []),
            f"{r.busbw_GBps:.3f}",
        )
    return t


def bench_run(args: argparse.Namespace, console: Console) -> int:
    """diffcomm vs raw torch.distributed, a bare autograd floor, torch.distributed.nn, funcol."""
    from diffcomm.tools.bench import (
        PLOT_INSTALL_HINT,
        plot_missing,
        plot_rows,
        run_benchmark,
        slower_than_nn_lines,
        summarize,
    )

    try:
        sizes = [parse_size(s) for s in args.sizes]
    except ValueError as exc:
        raise UsageError(f"--sizes: {exc}") from None
    if args.rounds < MIN_ROUNDS:
        raise UsageError(f"--rounds must be >= {MIN_ROUNDS}, got {args.rounds}")
    check_worlds(args.world)
    if args.coalesced is not None:
        return _bench_coalesced(args, console)
    if args.plot:
        missing = plot_missing()  # before measuring: minutes of timing must not end in an ImportError
        if missing:  # short enough that the install command fits on the error's one line
            raise UsageError(f"--plot needs matplotlib: {PLOT_INSTALL_HINT}")
    check_backend(args.backend, args.world)
    from diffcomm.runtime.world import check_world_fits

    if not args.allow_oversubscribe:
        check_world_fits(max(args.world), override="--allow-oversubscribe")
    rows = []
    for w in args.world:
        with local_world(args, w, 600) as world:
            with world_progress(w, console, args.json) as bar:
                task = bar.add_task("", total=len(args.ops) * len(sizes))

                def progress(what: str, bar: Progress = bar, task: Any = task) -> None:
                    bar.update(task, description=what)
                    bar.advance(task)

                rows += run_benchmark(
                    world, args.ops, sizes, args.rounds, progress=progress, control=args.control
                )
    if args.json:
        console.print_json(json.dumps([r.as_dict() for r in rows]))  # geomeans: bench.summarize(rows)
    else:
        for w in dict.fromkeys(r.world for r in rows):
            console.print(bench_table([r for r in rows if r.world == w], w))
        console.print(f"[dim]{escape(bench_legend(rows))}[/dim]", highlight=False)
        summary = summarize(rows)
        console.print()
        console.print("geometric mean over every cell of the median ratios, per world:")
        g = Table(
            box=box.SIMPLE_HEAD,
            show_edge=False,
            pad_edge=False,
        )
        keys = list(dict.fromkeys(k for s in summary.values() for k in s if not k.endswith("cells")))
        g.add_column("impl", no_wrap=True)
        for w in summary:
            g.add_column(f"world {w}", justify="right", no_wrap=True)
        for k in keys:
            impl, _, base = k.rpartition("/")
            label = f"{_short(impl)} x {base}"
            g.add_row(label, *[f"{s[k]:.3f}" if k in s else "-" for s in summary.values()])
        console.print(g)
        for paragraph in slower_than_nn_lines(rows, min(console.width, 100)):
            console.print(paragraph, highlight=False, soft_wrap=True)
    if args.plot:
        plot_rows(rows, args.plot, backend=args.backend)
        if not args.json:
            console.print(f"plot written to {args.plot}")
    return 0
