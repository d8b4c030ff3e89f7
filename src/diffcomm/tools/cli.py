"""The ``diffcomm`` command line: ``python -m diffcomm <subcommand>`` (or ``diffcomm ...``).

Subcommands are entries of :data:`_SUBCOMMANDS`: a name mapped to a :class:`Subcommand`
(help text, a function adding its arguments, a function running it and returning the
exit code). To add one (``check``, ``bench`` ...), write those two functions and add an
entry; :func:`main` builds the parser from the registry.

``info`` prints the versions, the accelerator, the c10d backends this torch build has,
the settings, and the capabilities of the default backend probed on two local ranks.

Errors of usage (a bad argument, an unknown op, a backend this machine cannot run) are one
message on stderr, ``<prog> <command>: error: ...``, wrapped at :data:`WIDTH` columns (the
lines after the first indented), and exit code 2. Everything printed fits :data:`WIDTH`
columns, or the terminal's width where it is narrower. torch is imported only when a
subcommand runs, so ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from rich.console import Console
from rich.table import Table

from .. import __version__, _config
from .._errors import WorldTooLargeError
from . import commands as _cli_tools
from .commands import UsageError

C10D_BACKENDS = _cli_tools.C10D_BACKENDS
#: the widest line the command line prints (tables, prose, errors)
WIDTH = 100


@dataclass(frozen=True)
class Subcommand:
    """One ``python -m diffcomm`` subcommand.

    Attributes:
        help: one line for ``--help``.
        configure: adds the subcommand's arguments to its parser.
        run: runs it with the parsed arguments and a rich console; returns the exit code.
    """

    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, Console], int]


# ------------------------------------------------------------------------------ info


def _probe_rank() -> dict[str, Any]:
    """Runs on each probe rank: what the backend adapter reports for the default group."""
    from ..backend import get_backend

    be = get_backend()
    return {
        "backend": be.backend_name(None),
        "world_size": be.world_size(None),
        "capabilities": be.capabilities(None).as_dict(),
    }


def probe_capabilities(world_size: int = 2, backend: str = "gloo") -> dict[str, Any]:
    """Start a :class:`~diffcomm.LocalWorld`, ask rank 0's backend adapter what it can do.

    Returns a dict with ``backend``, ``world_size``, ``capabilities`` and ``seconds``
    (start-up plus probe), or ``error`` when the world could not run.
    """
    from ..runtime.world import LocalWorld

    start = time.perf_counter()
    try:
        with LocalWorld(world_size, backend=backend, timeout=120) as world:
            result: dict[str, Any] = world.run(_probe_rank)[0]
    except Exception as exc:  # reported, `info` still prints the rest
        return {"backend": backend, "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    result["seconds"] = round(time.perf_counter() - start, 2)
    return result


def _accelerator_info() -> dict[str, Any]:
    try:
        from ..accelerator import get_accelerator
    except ImportError as exc:
        return {"error": f"diffcomm.accelerator is not importable: {exc}"}
    try:
        acc = get_accelerator()
        return {
            "name": acc.name,
            "device_count": acc.device_count(),
            "communication_backend": acc.communication_backend_name(),
        }
    except Exception as exc:  # e.g. a bad DIFFCOMM_ACCELERATOR, shown to the user
        return {"error": f"{type(exc).__name__}: {exc}"}


def _settings_info() -> dict[str, Any]:
    try:
        return dict(_config.settings())
    except ValueError as exc:
        return {"error": str(exc)}


def collect_info(probe: bool = True) -> dict[str, Any]:
    """Everything ``python -m diffcomm info`` shows, as a JSON-friendly dict."""
    import torch
    import torch.distributed as dist

    info: dict[str, Any] = {
        "diffcomm": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "accelerator": _accelerator_info(),
        "distributed_available": dist.is_available(),
        "c10d_backends": {name: bool(dist.is_backend_available(name)) for name in C10D_BACKENDS},
        "settings": _settings_info(),
    }
    if probe:
        info["probe"] = probe_capabilities()
    return info


def _info_configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-probe", action="store_true", help="skip starting two local ranks to probe the backend"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def _yes(flag: bool) -> str:
    return "[green]yes[/green]" if flag else "[dim]no[/dim]"


def _info_run(args: argparse.Namespace, console: Console) -> int:
    info = collect_info(probe=not args.no_probe)
    failed = "error" in info.get("probe", {})
    if args.json:
        console.print_json(json.dumps(info, default=str))
        return 1 if failed else 0

    env = Table(title="diffcomm info", show_header=False)
    env.add_column("key", style="bold")
    env.add_column("value")
    for key in ("diffcomm", "torch", "python", "platform", "cpus"):
        env.add_row(key, str(info[key]))
    acc = info["accelerator"]
    if "error" in acc:
        env.add_row("accelerator", f"[red]{acc['error']}[/red]")
    else:
        devices = f"{acc['device_count']} device(s), default backend {acc['communication_backend']}"
        env.add_row("accelerator", f"{acc['name']} ({devices})")
    settings = info["settings"]
    env.add_row(
        "settings",
        f"[red]{settings['error']}[/red]"
        if "error" in settings
        else ", ".join(f"{k}={v!r}" for k, v in settings.items()),
    )
    console.print(env)

    backends = Table(title="c10d backends")
    backends.add_column("backend")
    backends.add_column("available")
    for name, ok in info["c10d_backends"].items():
        backends.add_row(name, _yes(ok))
    console.print(backends)

    if "probe" in info:
        probe = info["probe"]
        if failed:
            console.print(f"[red]capability probe ({probe['backend']}) failed:[/red] {probe['error']}")
        else:
            caps = Table(title=f"{probe['backend']} capabilities ({probe['world_size']} ranks)")
            caps.add_column("capability")
            caps.add_column("native")
            for name, value in probe["capabilities"].items():
                if name != "backend":
                    caps.add_row(name, _yes(bool(value)))
            console.print(caps)
            console.print(f"probe took {probe['seconds']:.2f} s")
    return 1 if failed else 0


# ------------------------------------------------------------------------------ registry

#: Every subcommand, by name.
_SUBCOMMANDS: dict[str, Subcommand] = {
    "check": Subcommand(
        help="check every op's forward, adjoint and gradients against a reference on local ranks",
        configure=_cli_tools.check_configure,
        run=_cli_tools.check_run,
    ),
    "bench": Subcommand(
        help="time forward+backward of diffcomm vs raw torch.distributed (and torch.distributed.nn)",
        configure=_cli_tools.bench_configure,
        run=_cli_tools.bench_run,
    ),
    "info": Subcommand(
        help="versions, accelerator, c10d backends and probed backend capabilities",
        configure=_info_configure,
        run=_info_run,
    ),
}


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``<prog>: error: <message>`` on stderr, exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, error_text(f"{self.prog}: error: {message} (see {self.prog} --help)") + "\n")


def error_text(text: str) -> str:
    """``text`` as one message of lines of at most :data:`WIDTH` columns: its whitespace
    (argparse's line breaks included) collapsed, then wrapped at spaces, the lines after
    the first indented by two (a long list of valid names reads as one paragraph)."""
    return textwrap.fill(
        " ".join(text.split()),
        WIDTH,
        subsequent_indent="  ",
        break_long_words=False,
        break_on_hyphens=False,
    )


def prog_name(argv0: str | None = None) -> str:
    """How the user started us (from ``argv[0]``): ``diffcomm`` for the console script,
    else ``python -m diffcomm`` (``argv[0]`` is then ``.../diffcomm/__main__.py``)."""
    name = os.path.basename(sys.argv[0] if argv0 is None else argv0)
    return "diffcomm" if name.lower().startswith("diffcomm") else "python -m diffcomm"


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The argparse parser, one sub-parser per entry of :data:`_SUBCOMMANDS`."""
    parser = _Parser(
        prog=prog or prog_name(), description="diffcomm: differentiable collectives for PyTorch."
    )
    parser.add_argument("--version", action="version", version=f"diffcomm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in _SUBCOMMANDS.items():
        command.configure(sub.add_parser(name, help=command.help, description=command.help))
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parse_args``, with an unknown argument of a command reported by that command."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        owner = sub.choices.get(args.command, parser) if args.command else parser
        owner.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 failure, 2 usage error)."""
    parser = build_parser()
    try:
        args = _parse(parser, argv)
    except SystemExit as exc:  # argparse exits on --help/--version (0) and bad usage (2)
        return exc.code if isinstance(exc.code, int) else 2
    if args.command is None:
        commands = ", ".join(_SUBCOMMANDS)
        print(
            error_text(f"{parser.prog}: error: name a command: {commands} (see {parser.prog} --help)"),
            file=sys.stderr,
        )
        return 2
    # a terminal (or COLUMNS) narrower than WIDTH sets the width; other output (a wide
    # terminal, CI logs, files) gets WIDTH columns instead of rich's 80-column default
    sized = sys.stdout.isatty() or os.environ.get("COLUMNS")
    console = Console(file=sys.stdout, width=min(WIDTH, Console(file=sys.stdout).width) if sized else WIDTH)
    try:
        return _SUBCOMMANDS[args.command].run(args, console)
    except KeyboardInterrupt:
        # the ranks ignore SIGINT and LocalWorld tore them down on the way out: one line
        print("diffcomm: interrupted (Ctrl-C); every rank was stopped.", file=sys.stderr)
        return 130
    except (UsageError, WorldTooLargeError) as exc:
        print(error_text(f"{parser.prog} {args.command}: error: {exc}"), file=sys.stderr)
        return 2
