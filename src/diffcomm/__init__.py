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
    "all_gather_coalesced": "ops.coalesced",
    "all_reduce_coalesced": "ops.coalesced",
    "broadcast_coalesced": "ops.coalesced",
    "reduce_coalesced": "ops.coalesced",
    "reduce_scatter_coalesced": "ops.coalesced",
    "DUALS": "ops.collectives",
    "OPS": "ops.collectives",
    "all_gather": "ops.collectives",
    "all_reduce": "ops.collectives",
    "all_to_all": "ops.collectives",
    "broadcast": "ops.collectives",
    "dual": "ops.collectives",
    "gather": "ops.collectives",
    "reduce": "ops.collectives",
    "reduce_scatter": "ops.collectives",
    "scatter": "ops.collectives",
    "ppermute": "ops.p2p",
    "recv": "ops.p2p",
    "send": "ops.p2p",
    "sendrecv": "ops.p2p",
    "shift": "ops.p2p",
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
    from .ops.coalesced import (
        all_gather_coalesced,
        all_reduce_coalesced,
        broadcast_coalesced,
        reduce_coalesced,
        reduce_scatter_coalesced,
    )
    from .ops.collectives import (
        DUALS,
        OPS,
        all_gather,
        all_reduce,
        all_to_all,
        broadcast,
        dual,
        gather,
        reduce,
        reduce_scatter,
        scatter,
    )
    from .ops.engine import AsyncTensor
    from .ops.p2p import ppermute, recv, send, sendrecv, shift, wait_sends
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
    "DUALS",
    "OPS",
    "all_gather",
    "all_gather_coalesced",
    "all_reduce_coalesced",
    "broadcast_coalesced",
    "reduce_coalesced",
    "reduce_scatter_coalesced",
    "ppermute",
    "recv",
    "send",
    "sendrecv",
    "shift",
    "wait_sends",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "dual",
    "gather",
    "reduce",
    "reduce_scatter",
    "scatter",
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
    """Import every public submodule and bind every exported name (idempotent)."""
    for name in __all__:
        __getattr__(name)


def __getattr__(name: str) -> Any:
    # one submodule per first use (not all of them: a submodule being imported may ask
    # for a sibling, e.g. `from .. import rng`, while others are half-initialized)
    mod = _EXPORTS.get(name)
    if mod is not None:
        value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
        globals()[name] = value
        return value
    if name in _FAMILIES:
        return importlib.import_module(f"{__name__}.{_FAMILIES[name]}")
    if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")  # accelerator, ..., testing, world
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
