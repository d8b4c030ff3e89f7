"""diffcomm: differentiable collectives for PyTorch.

Every communication op is an autograd op whose backward is its exact adjoint under the
convention that the objective is the **sum of the per-rank objectives**.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# A plain ``import diffcomm`` imports every submodule at once (the end of this file), so
# the import cost (torch, dynamo: seconds) is paid there, never inside a user's first
# collective, where one rank still importing would look like a desync to the others.
# Only the command line is lazy (PEP 562 ``__getattr__``): while ``python -m diffcomm``
# or the ``diffcomm`` console script starts, nothing here imports torch, so ``--help``
# answers at once and each subcommand imports what it needs. Keep ``__all__``,
# ``_SUBMODULES``, ``_EXPORTS`` and the ``TYPE_CHECKING`` imports in sync
# (tests/test_packaging.py checks it).
#
# The ops themselves (``dc.all_reduce``, ``dc.send``, ``dc.all_reduce_coalesced`` ...) are
# read off the registry at run time (``ops.families.exported``: every op of a family with
# a public home), bound by ``_load`` and appended to ``__all__``, so a new built-in op is
# exported by defining it in its module. Static analysis (an IDE, mypy) cannot run the
# registry: the ``TYPE_CHECKING`` block names each op once more, from its module, so
# ``dc.all_reduce`` shows its signature and docstring; tests/test_packaging.py names an op
# missing there.

#: public submodules re-exported as attributes
_SUBMODULES = ("accelerator", "backend", "compat", "parallel", "pipeline", "rng", "spmd")

#: the op families' modules, by their old top-level names (``dc.p2p.irecv``,
#: ``dc.collectives.duals_markdown``): attributes of the package, kept where the docs use them
_FAMILIES: dict[str, str] = {
    "collectives": "ops.collectives",
    "coalesced": "ops.coalesced",
    "p2p": "ops.p2p",
    "world": "runtime.world",
}

#: public name -> the submodule defining it
_EXPORTS: dict[str, str] = {
    "AsyncTensor": "ops.engine",
    "Precision": "ops.precision",
    "debug": "_config",
    "settings": "_config",
    "timeout": "_config",
    "CollectiveTimeoutError": "_errors",
    "CrossRankMismatchError": "_errors",
    "DesyncError": "_errors",
    "DiffcommError": "_errors",
    "RankDesyncError": "_errors",
    "RankDiedError": "_errors",
    "RankError": "_errors",
    "WorldTimeoutError": "_errors",
    "WorldTooLargeError": "_errors",
    "FlightRecorder": "debug.recorder",
    "flight_recorder": "debug.recorder",
    "DUALS": "ops.collectives",
    "OPS": "ops.collectives",
    "dual": "ops.collectives",
    "wait_sends": "ops.p2p",
    "LocalWorld": "runtime.world",
    "get_rank": "runtime.world",
    "get_world_size": "runtime.world",
    "init": "runtime.world",
    "is_initialized": "runtime.world",
    "launch": "runtime.world",
    "SPMDTypeError": "_replication",
    "spmd_check": "spmd.check",
}

if TYPE_CHECKING:
    from . import accelerator, backend, compat, parallel, pipeline, rng, spmd
    from ._config import debug, settings, timeout
    from ._errors import (
        CollectiveTimeoutError,
        CrossRankMismatchError,
        DesyncError,
        DiffcommError,
        RankDesyncError,
        RankDiedError,
        RankError,
        WorldTimeoutError,
        WorldTooLargeError,
    )
    from ._replication import SPMDTypeError
    from .debug.recorder import FlightRecorder, flight_recorder

    # the ops (the `name as name` imports): for static analysis only; at run time the registry
    from .ops.all_gather import all_gather as all_gather
    from .ops.all_gather import reduce_scatter as reduce_scatter
    from .ops.all_reduce import all_reduce as all_reduce
    from .ops.all_to_all import all_to_all as all_to_all
    from .ops.broadcast_reduce import broadcast as broadcast
    from .ops.broadcast_reduce import reduce as reduce
    from .ops.coalesced_gather import all_gather_coalesced as all_gather_coalesced
    from .ops.coalesced_gather import reduce_scatter_coalesced as reduce_scatter_coalesced
    from .ops.coalesced_reduce import all_reduce_coalesced as all_reduce_coalesced
    from .ops.coalesced_reduce import broadcast_coalesced as broadcast_coalesced
    from .ops.coalesced_reduce import reduce_coalesced as reduce_coalesced
    from .ops.collectives import DUALS, OPS, dual
    from .ops.engine import AsyncTensor
    from .ops.exchanges import ppermute as ppermute
    from .ops.exchanges import sendrecv as sendrecv
    from .ops.exchanges import shift as shift
    from .ops.gather_scatter import gather as gather
    from .ops.gather_scatter import scatter as scatter
    from .ops.p2p import wait_sends
    from .ops.precision import Precision
    from .ops.send_recv import recv as recv
    from .ops.send_recv import send as send
    from .runtime.world import LocalWorld, get_rank, get_world_size, init, is_initialized, launch
    from .spmd.check import spmd_check

__all__ = [
    "accelerator",
    "backend",
    "compat",
    "parallel",
    "pipeline",
    "rng",
    "spmd",
    "AsyncTensor",
    "Precision",
    "DUALS",
    "OPS",
    "wait_sends",
    "dual",
    "CollectiveTimeoutError",
    "CrossRankMismatchError",
    "DesyncError",
    "FlightRecorder",
    "RankDesyncError",
    "WorldTooLargeError",
    "flight_recorder",
    "DiffcommError",
    "LocalWorld",
    "RankDiedError",
    "RankError",
    "WorldTimeoutError",
    "debug",
    "get_rank",
    "get_world_size",
    "init",
    "is_initialized",
    "launch",
    "settings",
    "timeout",
    "SPMDTypeError",
    "spmd_check",
]


def _load() -> None:
    """Import every public submodule, bind every exported name and append the ops to
    ``__all__`` (idempotent)."""
    for name in __all__:
        __getattr__(name)
    for name in _ops():
        __getattr__(name)
        if name not in __all__:
            __all__.append(name)


def _ops() -> dict[str, str]:
    """Every op exported as ``dc.<name>``: name -> its family's home (read off the registry)."""
    from .ops.families import exported

    return exported()


def __getattr__(name: str) -> Any:
    # one submodule per first use (not all of them: a submodule being imported may ask
    # for a sibling, e.g. `from .. import rng`, while others are half-initialized)
    mod = _EXPORTS.get(name)
    if mod is None and not name.startswith("__") and name not in _FAMILIES:
        if importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f"{__name__}.{name}")  # accelerator, ..., testing, world
        mod = _ops().get(name)  # an op (imports torch)
    if mod is not None:
        value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
        globals()[name] = value
        return value
    if name in _FAMILIES:
        return importlib.import_module(f"{__name__}.{_FAMILIES[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def _cli_starting() -> bool:
    """Whether this import is the start of the command line (then the package stays lazy).

    ``python -m diffcomm``: ``sys.argv[0]`` is ``"-m"`` while the package is located and
    imported. The console script: pip's wrapper (``from diffcomm.tools.cli import main``) runs
    as ``.../bin/diffcomm`` (``diffcomm.exe`` or ``diffcomm-script.py`` on Windows).
    """
    import os
    import re
    import sys

    argv0 = sys.argv[0] if sys.argv else ""
    name = os.path.basename(argv0.replace("\\", "/"))
    return argv0 == "-m" or re.fullmatch(r"diffcomm(\.exe|-script\.pyw?)?", name, re.I) is not None


if not _cli_starting():
    _load()
