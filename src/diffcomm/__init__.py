"""diffcomm: differentiable collectives for PyTorch.

Every communication op is an autograd op whose backward is its exact adjoint under the
convention that the objective is the **sum of the per-rank objectives**.
"""

from __future__ import annotations

from . import accelerator, backend, compat, parallel, pipeline, rng
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
from ._flight import FlightRecorder, flight_recorder
from .coalesced import (
    all_gather_coalesced,
    all_reduce_coalesced,
    broadcast_coalesced,
    reduce_coalesced,
    reduce_scatter_coalesced,
)
from .collectives import (
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
from .p2p import ppermute, recv, send, sendrecv, shift, wait_sends
from .world import LocalWorld, get_rank, get_world_size, init, is_initialized, launch

__version__ = "0.1.0"

__all__ = [
    "accelerator",
    "backend",
    "compat",
    "parallel",
    "pipeline",
    "rng",
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
]
