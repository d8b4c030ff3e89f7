"""diffcomm: differentiable collectives for PyTorch.

Every communication op is an autograd op whose backward is its exact adjoint under the
convention that the objective is the **sum of the per-rank objectives**.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# The public names, each listed once below as ``from .module import name as name`` (as
# JAX's ``lax/__init__.py``): an IDE or mypy goes from ``dc.all_gather`` to its function.
# ``__all__`` is these names (tests/test_packaging.py checks that the face, ``__all__``,
# the families' homes and the registry agree; a built-in op is one line in its family's
# home, one here and one in ``tools/op_names.py``).
#
# A plain ``import diffcomm`` imports every submodule at once (the imports below), so the
# import cost (torch: seconds) is paid there, never inside a user's first collective, where
# one rank still importing would look like a desync to the others. Only the command line
# is lazy: while ``python -m diffcomm`` or the ``diffcomm`` console script starts, nothing
# here imports torch, so ``--help`` answers at once and each subcommand imports what it
# needs; a first use of a public name (``dc.LocalWorld``) then runs this file again with
# the imports (``_lazy_face``).


def _cli_starting() -> bool:
    """Whether this import is the start of the command line (then the package stays lazy).

    ``python -m diffcomm``: ``sys.argv[0]`` is ``"-m"`` while the package is located and
    imported. The console script: pip's wrapper (``from diffcomm.tools.cli import main``) runs
    as ``.../bin/diffcomm`` (``diffcomm.exe`` or ``diffcomm-script.py`` on Windows).
    """
    import os
    import re

    argv0 = sys.argv[0] if sys.argv else ""
    name = os.path.basename(argv0.replace("\\", "/"))
    return argv0 == "-m" or re.fullmatch(r"diffcomm(\.exe|-script\.pyw?)?", name, re.I) is not None


#: the package's names wait for a first use (the command line starting; a second run of
#: this file, the first use, finds ``_lazy`` already set and imports them)
_lazy = "_lazy" not in globals() and _cli_starting()

if not TYPE_CHECKING and _lazy:

    def __getattr__(name: str) -> Any:
        """The command line's lazy package: a submodule imports alone (a module being
        imported may ask for a sibling, ``from .. import rng``, while others are
        half-initialized); any other public name runs this file again, with its imports."""
        if name.startswith("__"):
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        if importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f"{__name__}.{name}")
        del globals()["__getattr__"]
        importlib.reload(sys.modules[__name__])
        return getattr(sys.modules[__name__], name)

else:
    # one line per public name, by module: the layers and tools (``dc.parallel``), the op
    # families' homes by their old top-level names (``dc.p2p.irecv``,
    # ``dc.collectives.duals_markdown``, ``dc.world``), the ops (docs: the homes), the
    # settings, errors, asynchronous results, flight recorder and the SPMD type check
    from . import accelerator as accelerator
    from . import backend as backend
    from . import compat as compat
    from . import parallel as parallel
    from . import pipeline as pipeline
    from . import rng as rng
    from . import spmd as spmd
    from ._config import debug as debug
    from ._config import settings as settings
    from ._config import timeout as timeout
    from ._errors import CollectiveTimeoutError as CollectiveTimeoutError
    from ._errors import CrossRankMismatchError as CrossRankMismatchError
    from ._errors import DesyncError as DesyncError
    from ._errors import DiffcommError as DiffcommError
    from ._errors import RankDesyncError as RankDesyncError
    from ._errors import RankDiedError as RankDiedError
    from ._errors import RankError as RankError
    from ._errors import WorldTimeoutError as WorldTimeoutError
    from ._errors import WorldTooLargeError as WorldTooLargeError
    from ._replication import SPMDTypeError as SPMDTypeError
    from .diagnostics.recorder import FlightRecorder as FlightRecorder
    from .diagnostics.recorder import flight_recorder as flight_recorder
    from .ops import coalesced as coalesced
    from .ops import collectives as collectives
    from .ops import p2p as p2p
    from .ops.coalesced import all_gather_coalesced as all_gather_coalesced
    from .ops.coalesced import all_reduce_coalesced as all_reduce_coalesced
    from .ops.coalesced import broadcast_coalesced as broadcast_coalesced
    from .ops.coalesced import reduce_coalesced as reduce_coalesced
    from .ops.coalesced import reduce_scatter_coalesced as reduce_scatter_coalesced
    from .ops.collectives import DUALS as DUALS
    from .ops.collectives import OPS as OPS
    from .ops.collectives import all_gather as all_gather
    from .ops.collectives import all_reduce as all_reduce
    from .ops.collectives import all_to_all as all_to_all
    from .ops.collectives import broadcast as broadcast
    from .ops.collectives import dual as dual
    from .ops.collectives import gather as gather
    from .ops.collectives import reduce as reduce
    from .ops.collectives import reduce_scatter as reduce_scatter
    from .ops.collectives import scatter as scatter
    from .ops.engine import AsyncTensor as AsyncTensor
    from .ops.p2p import ppermute as ppermute
    from .ops.p2p import recv as recv
    from .ops.p2p import send as send
    from .ops.p2p import sendrecv as sendrecv
    from .ops.p2p import shift as shift
    from .ops.p2p import wait_sends as wait_sends
    from .ops.precision import Precision as Precision
    from .runtime import world as world
    from .runtime.world import LocalWorld as LocalWorld
    from .runtime.world import get_rank as get_rank
    from .runtime.world import get_world_size as get_world_size
    from .runtime.world import init as init
    from .runtime.world import is_initialized as is_initialized
    from .runtime.world import launch as launch
    from .spmd.check import spmd_check as spmd_check

__all__ = [
    "accelerator",
    "all_gather",
    "all_gather_coalesced",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "AsyncTensor",
    "backend",
    "broadcast",
    "broadcast_coalesced",
    "CollectiveTimeoutError",
    "compat",
    "CrossRankMismatchError",
    "debug",
    "DesyncError",
    "DiffcommError",
    "dual",
    "DUALS",
    "flight_recorder",
    "FlightRecorder",
    "gather",
    "get_rank",
    "get_world_size",
    "init",
    "is_initialized",
    "launch",
    "LocalWorld",
    "OPS",
    "parallel",
    "pipeline",
    "ppermute",
    "Precision",
    "RankDesyncError",
    "RankDiedError",
    "RankError",
    "recv",
    "reduce",
    "reduce_coalesced",
    "reduce_scatter",
    "reduce_scatter_coalesced",
    "rng",
    "scatter",
    "send",
    "sendrecv",
    "settings",
    "shift",
    "spmd",
    "spmd_check",
    "SPMDTypeError",
    "timeout",
    "wait_sends",
    "WorldTimeoutError",
    "WorldTooLargeError",
]
