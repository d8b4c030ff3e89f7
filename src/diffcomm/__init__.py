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

# The public names, each listed once (as JAX's ``lax/__init__.py``): a name of the package
# is one ``from .module import name as name`` line below and one entry of ``__all__``; an op
# family's names (its ops and tables) are listed in its home's ``__all__``
# (``ops/collectives.py``, ``ops/p2p.py``, ``ops/coalesced.py``) and re-exported here by
# ``from .ops.<home> import *`` and ``__all__ += <home>.__all__``, forms mypy and IDEs read
# statically (``dc.all_gather`` goes to its function). So a built-in op is its module, its
# import line and ``__all__`` entry in its family's home, and its test; tests/test_packaging.py
# checks that the face, ``__all__``, the homes and the registry agree.
#
# A plain ``import diffcomm`` imports every submodule at once (the imports below), so the
# import cost (torch: seconds) is paid there, never inside a user's first collective, where
# one rank still importing would look like a desync to the others. Only the command line
# is lazy: while ``python -m diffcomm`` or the ``diffcomm`` console script starts, nothing
# here imports torch, so ``--help`` answers at once and each subcommand imports what it
# needs; a first use of a public name (``dc.LocalWorld``, or ``__all__``) then runs this
# file again with the imports (``__getattr__`` below).


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
        half-initialized); any other public name (``__all__`` too: the families' names are
        their homes') runs this file again, with its imports."""
        if name.startswith("__") and name != "__all__":
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        if importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f"{__name__}.{name}")
        del globals()["__getattr__"]
        importlib.reload(sys.modules[__name__])
        return getattr(sys.modules[__name__], name)

else:
    # one line per public name, by module: the layers and tools (``dc.parallel``), the op
    # families' homes by their old top-level names (``dc.p2p.irecv``,
    # ``dc.collectives.duals_markdown``, ``dc.world``), each family's ops and tables (a
    # star import of its home's ``__all__``; docs: the homes), the settings, errors,
    # asynchronous results, flight recorder and the SPMD type check
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
    from .ops.coalesced import *  # noqa: F403 - the family's names: its home's __all__
    from .ops.collectives import *  # noqa: F403 - the family's names: its home's __all__
    from .ops.engine import AsyncTensor as AsyncTensor
    from .ops.p2p import *  # noqa: F403 - the family's names: its home's __all__
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
        "AsyncTensor",
        "backend",
        "CollectiveTimeoutError",
        "compat",
        "CrossRankMismatchError",
        "debug",
        "DesyncError",
        "DiffcommError",
        "flight_recorder",
        "FlightRecorder",
        "get_rank",
        "get_world_size",
        "init",
        "is_initialized",
        "launch",
        "LocalWorld",
        "parallel",
        "pipeline",
        "Precision",
        "RankDesyncError",
        "RankDiedError",
        "RankError",
        "rng",
        "settings",
        "spmd",
        "spmd_check",
        "SPMDTypeError",
        "timeout",
        "WorldTimeoutError",
        "WorldTooLargeError",
    ]
    __all__ += collectives.__all__
    __all__ += p2p.__all__
    __all__ += coalesced.__all__
