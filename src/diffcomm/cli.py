"""The ``diffcomm`` command line: ``python -m diffcomm <subcommand>`` (or ``diffcomm ...``).

Subcommands are entries of :data:`_SUBCOMMANDS`: a name mapped to a :class:`Subcommand`
(help text, a function adding its arguments, a function running it and returning the
exit code). To add one (``check``, ``bench`` ...), write those two functions and add an
entry; :func:`main` builds the parser from the registry.

``info`` prints the versions, the accelerator, the c10d backends this torch build has,
the settings, and the capabilities of the default backend probed on two local ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from . import __version__, _cli_tools, _config
from ._errors import WorldTooLargeError

C10D_BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl")


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
    from .backend import get_backend

    be = get_backend()
    return {
        "backend": be.backend_name(None),  # type: ignore[attr-defined]
        "world_size": be.world_size(None),
        "capabilities": be.capabilities(None).as_dict(),  # type: ignore[attr-defined]
    }


def probe_capabilities(world_size: int = 2, backend: str = "gloo") -> dict[str, Any]:
    """Start a :class:`~diffcomm.LocalWorld`, ask rank 0's backend adapter what it can do.

    Returns a dict with ``backend``, ``world_size``, ``capabilities`` and ``seconds``
    (start-up plus probe), or ``error`` when the world could not run.
    """
    from .world import LocalWorld

    start = time.perf_counter()
    try:
        with LocalWorld(world_size, backend=backend, timeout=120) as world:
            result: dict[str, Any] = world.run(_probe_rank)[0]
    except Exception as exc:  # noqa: BLE001 - reported, `info` still prints the rest
        return {"backend": backend, "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    result["seconds"] = round(time.perf_counter() - start, 2)
    return result


def _accelerator_info() -> dict[str, Any]:
    try:
        from .accelerator import get_accelerator
    except ImportError as exc:
        return {"error": f"diffcomm.accelerator is not importable: {exc}"}
    try:
        acc = get_accelerator()
        return {
            "name": acc.name,
            "device_count": acc.device_count(),
            "communication_backend": acc.communication_backend_name(),
        }
    except Exception as exc:  # noqa: BLE001 - e.g. a bad DIFFCOMM_ACCELERATOR, shown to the user
        return {"error": f"{type(exc).__name__}: {exc}"}


def _settings_info() -> dict[str, Any]:
    try:
        return dict(_config.settings())
    except ValueError as exc:
        return {"error": str(exc)}


def collect_info(probe: bool = True) -> dict[str, Any]:
    """Everything ``python -m diffcomm info`` shows, as a JSON-friendly dict."""
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


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser, one sub-parser per entry of :data:`_SUBCOMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="python -m diffcomm", description="diffcomm: differentiable collectives for PyTorch."
    )
    parser.add_argument("--version", action="version", version=f"diffcomm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in _SUBCOMMANDS.items():
        command.configure(sub.add_parser(name, help=command.help, description=command.help))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 failure, 2 usage error)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help/--version (0) and bad usage (2)
        return exc.code if isinstance(exc.code, int) else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    # piped output (CI logs, files) gets a wide table instead of rich's 80-column default
    console = Console(file=sys.stdout, width=None if sys.stdout.isatty() else 160)
    try:
        return _SUBCOMMANDS[args.command].run(args, console)
    except KeyboardInterrupt:
        # the ranks ignore SIGINT and LocalWorld tore them down on the way out: one line
        print("diffcomm: interrupted (Ctrl-C); every rank was stopped.", file=sys.stderr)
        return 130
    except WorldTooLargeError as exc:
        print(f"diffcomm: {exc}", file=sys.stderr)
        return 2
