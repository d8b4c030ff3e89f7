"""The adapter the collectives call: raw, non-differentiable ops over ``torch.distributed``.

Everything here is out-of-place (returns new tensors, never writes into its inputs) and
works along **dim 0 of a contiguous tensor**; the collectives move dims and make
contiguous before calling in. Ranks are **group-local**. Backend gaps are filled in the
adapter and only there (an uneven all_gather on gloo, a reduce_scatter a backend lacks,
``avg`` on a backend without it...), so the autograd layer never branches on "nccl" or
"gloo".

This package is the public home of the layer; the code lives in one module per concern:

* :mod:`.torch_distributed` — :class:`TorchDistributedBackend`, the raw ops over c10d
  (the default);
* :mod:`.direct_calls` — the direct ``ProcessGroup`` calls under its hottest ops (torch's
  Python wrapper skipped where it would only re-check what the caller knows);
* :mod:`.compiled` — :class:`TraceableBackend`, the same ops as functional collectives,
  returned by :func:`get_backend` while ``torch.compile`` traces;
* :mod:`.groups` — the group record, :func:`group_info` (rank, size, backend name,
  :class:`Capabilities`, communication device; probed once per group);
* :mod:`.dispatch` — :func:`dispatch`, the one entry point every raw op funnels through
  (switches, logger, flight recorder, the translation of a backend timeout into
  :class:`~diffcomm.CollectiveTimeoutError` naming the op and how to fix it);
* :mod:`.sized_gather` — the all_gather whose row counts travel with the rows;
* :mod:`.buffers` — :func:`joined`, the ``torch.cat`` of a collective's buffers (outside
  the caller's autocast);
* :mod:`.args` — argument normalisation shared by every op (groups, reduce ops, ranks);
* from :mod:`diffcomm.diagnostics`: the **comms logger** (:func:`log_comms`: op, count, bytes,
  time, algorithmic/bus bandwidth; the op :func:`label`) and the **comm-off switches**
  (:func:`comm_off` skips named collectives while still returning correctly shaped
  results, for ablation timing, never for correctness) and the **raw-op table**
  (:data:`RAW_OPS`: per op name its bus factor, whether it is point to point or
  shape-free, what it returns switched off).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from .._torch import LOCAL_TENSOR_MODULE as _LT_NAME
from .._torch import compiling, local_tensor_mode_on
from ..diagnostics.logger import LABEL as LABEL
from ..diagnostics.logger import CommRecord, CommsLog, label, log_comms
from ..diagnostics.raw_ops import OP_NAMES, RAW_OPS, RawOp
from ..diagnostics.raw_ops import bus_factor as bus_factor
from ..diagnostics.switches import comm_off, is_off
from .buffers import joined as joined
from .compiled import TraceableBackend
from .direct_calls import all_gather_single as all_gather_single
from .direct_calls import reduce_scatter_single as reduce_scatter_single
from .dispatch import CommState as CommState
from .dispatch import adopt_comm_state as adopt_comm_state
from .dispatch import comm_state as comm_state
from .dispatch import current_spans as current_spans
from .dispatch import dispatch, record_spans
from .dispatch import run_coalesced as run_coalesced
from .dispatch import set_order_hook as set_order_hook
from .dispatch import tensor_nbytes as tensor_nbytes
from .groups import Capabilities, GroupInfo, ProcessGroup, cpu_group, group_info
from .groups import static_capabilities as static_capabilities
from .in_process import per_rank_attr
from .local_tensor import LocalTensorBackend
from .torch_distributed import CoalescedOps as CoalescedOps
from .torch_distributed import TorchDistributedBackend
from .torch_distributed import pad_rows as pad_rows
from .torch_distributed import unpad_rows as unpad_rows
from .torch_distributed import wire as wire

__all__ = [
    # the adapter
    "Backend",
    "TorchDistributedBackend",
    "TraceableBackend",
    "get_backend",
    "set_backend",
    # the group record
    "GroupInfo",
    "Capabilities",
    "group_info",
    "cpu_group",
    # the entry point, labels, the comms logger, the switches
    "dispatch",
    "label",
    "log_comms",
    "CommsLog",
    "CommRecord",
    "record_spans",
    "comm_off",
    "is_off",
    "OP_NAMES",
    "RAW_OPS",
    "RawOp",
]
# (The ``x as x`` imports above are for the layers above, not the documented surface.)


class Backend(Protocol):
    """The raw ops the collectives need. All out-of-place, dim 0, group-local ranks."""

    def rank(self, group: ProcessGroup) -> int: ...
    def world_size(self, group: ProcessGroup) -> int: ...
    def global_rank(self, group: ProcessGroup, rank: int) -> int: ...
    def backend_name(self, group: ProcessGroup) -> str: ...
    def capabilities(self, group: ProcessGroup = None) -> Capabilities: ...
    def comm_device(self, group: ProcessGroup) -> torch.device: ...
    def check_consistent(self, op: str, fields: dict[str, Any], group: ProcessGroup) -> None: ...
    def all_reduce(self, x: torch.Tensor, op: str, group: ProcessGroup) -> torch.Tensor: ...
    def broadcast(self, x: torch.Tensor, src: int, group: ProcessGroup) -> torch.Tensor: ...
    def reduce(self, x: torch.Tensor, dst: int, op: str, group: ProcessGroup) -> torch.Tensor: ...
    def all_gather(
        self, x: torch.Tensor, group: ProcessGroup, sizes: Sequence[int] | None = None
    ) -> torch.Tensor: ...
    def all_gather_unsized(
        self, x: torch.Tensor, group: ProcessGroup, dim: int = 0
    ) -> tuple[torch.Tensor, list[int]]: ...
    def reduce_scatter(
        self, x: torch.Tensor, op: str, group: ProcessGroup, split_sizes: Sequence[int] | None = None
    ) -> torch.Tensor: ...
    def gather(
        self, x: torch.Tensor, dst: int, group: ProcessGroup, sizes: Sequence[int] | None = None
    ) -> torch.Tensor: ...
    def scatter(
        self, x: torch.Tensor, src: int, group: ProcessGroup, split_sizes: Sequence[int] | None = None
    ) -> torch.Tensor: ...
    def all_to_all(
        self,
        x: torch.Tensor,
        group: ProcessGroup,
        input_split_sizes: Sequence[int] | None = None,
        output_split_sizes: Sequence[int] | None = None,
    ) -> torch.Tensor: ...
    def recv(self, out: torch.Tensor, src: int, group: ProcessGroup, tag: int = 0) -> torch.Tensor: ...
    def batch_p2p(self, ops: Sequence[tuple[str, torch.Tensor, int, int]], group: ProcessGroup) -> None: ...
    def barrier(self, group: ProcessGroup) -> None: ...
    def exchange_sizes(self, n: int, group: ProcessGroup) -> list[int]: ...
    def exchange_size_lists(self, ns: Sequence[int], group: ProcessGroup) -> list[list[int]]: ...
    def all_reduce_coalesced(
        self, xs: Sequence[torch.Tensor], op: str, group: ProcessGroup, owned: bool = False
    ) -> list[torch.Tensor]: ...
    def broadcast_coalesced(
        self, xs: Sequence[torch.Tensor], src: int, group: ProcessGroup, owned: bool = False
    ) -> list[torch.Tensor]: ...
    def reduce_coalesced(
        self, xs: Sequence[torch.Tensor], dst: int, op: str, group: ProcessGroup
    ) -> list[torch.Tensor]: ...
    def all_gather_coalesced(
        self, xs: Sequence[torch.Tensor], group: ProcessGroup, sizes: Sequence[Sequence[int]] | None = None
    ) -> list[torch.Tensor]: ...
    def reduce_scatter_coalesced(
        self,
        xs: Sequence[torch.Tensor],
        op: str,
        group: ProcessGroup,
        sizes: Sequence[Sequence[int]] | None = None,
    ) -> list[torch.Tensor]: ...


#: The default adapter, and the one installed now (:func:`set_backend` swaps it; callers
#: ask :func:`get_backend`, except the group-size fast path in
#: :mod:`diffcomm.ops.validation`, which compares the two).
DEFAULT: Backend = TorchDistributedBackend()
INSTALLED: Backend = DEFAULT
# a rank's own in an in-process world, as a rank process's (one rank's ``set_backend`` block
# reached the other ranks' ops, and the ranks' restores interleaved)
per_rank_attr(sys.modules[__name__], "INSTALLED", lambda: DEFAULT)
per_rank_attr(DEFAULT, "overrides", dict)  # (rebound by tests of the fallbacks)
_TRACEABLE = TraceableBackend()
_MODULES = sys.modules


def get_backend() -> Backend:
    """The backend adapter every collective calls (:class:`TraceableBackend` while
    ``torch.compile`` traces, :class:`~diffcomm.backend.local_tensor.LocalTensorBackend`
    under torch's ``LocalTensorMode``, whatever :func:`set_backend` installed)."""
    if compiling():
        return _TRACEABLE  # type: ignore[return-value]
    if _LT_NAME in _MODULES and local_tensor_mode_on():  # (imported: a mode may be on)
        return LocalTensorBackend(INSTALLED)
    return INSTALLED


def set_backend(backend: Backend) -> Any:
    """Swap the adapter (e.g. a wrapper that records calls); a ``with`` block restores."""
    global INSTALLED
    old = INSTALLED
    INSTALLED = backend

    class _Restore:
        def __enter__(self) -> Backend:
            return backend

        def __exit__(self, *exc: object) -> None:
            global INSTALLED
            INSTALLED = old

    return _Restore()
