"""diffcomm under torch's ``LocalTensorMode`` (torch's local-tensor package).

``LocalTensorMode(n)`` runs one program for ``n`` simulated ranks at once: every tensor is
a ``LocalTensor`` holding each rank's values, and torch's fake process group reports
**rank 0 on every simulated rank**. A diffcomm op whose raw ops do not depend on the rank
gives each simulated rank exactly what a real rank gets; one whose result depends on the
rank (its own chunk of a reduce_scatter, the root of a reduce, a peer of a send) would
give every rank rank 0's answer, silently. :class:`LocalTensorGuard` is the backend
adapter :func:`~diffcomm.backend.get_backend` returns while such a mode is on: it passes
the rank-free raw ops through (``all_reduce`` with every reduce op, its coalesced form,
the even ``all_to_all``; each checked against real processes in
tests/runtime/test_in_process.py) and refuses every other one with an error naming the
op and why, before any communication. For every op, run the ranks with
``dc.LocalWorld(n, in_process=True)`` instead (docs/in_process.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .._errors import DiffcommError

#: The raw ops that are rank-free (the same on every rank given each rank's values).
PASSED = frozenset({"all_reduce", "all_reduce_coalesced", "all_to_all"})
_HELPERS = frozenset(
    {
        "world_size",
        "backend_name",
        "capabilities",
        "comm_device",
        "global_rank",
        "overrides",
        "check_consistent",
    }
)


class LocalTensorModeError(DiffcommError, NotImplementedError):
    """A diffcomm op that cannot give each simulated rank its own answer under torch's
    ``LocalTensorMode`` (see :mod:`diffcomm.backend.local_tensor`)."""


def _refuse(op: str) -> LocalTensorModeError:
    return LocalTensorModeError(
        f"diffcomm: raw op `{op}` under torch's LocalTensorMode is not supported: its result "
        "depends on the rank, and torch's fake process group reports rank 0 on every "
        "simulated rank (every rank would get rank 0's answer). Run the ranks with "
        "dc.LocalWorld(n, in_process=True) instead: the same values as real processes, in "
        "this process (docs/in_process.md)."
    )


class LocalTensorGuard:
    """The backend adapter while a ``LocalTensorMode`` is on: rank-free ops through,
    every other raw op refused (see the module)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def all_to_all(
        self,
        x: torch.Tensor,
        group: Any,
        input_split_sizes: Sequence[int] | None = None,
        output_split_sizes: Sequence[int] | None = None,
    ) -> torch.Tensor:
        if input_split_sizes is not None or output_split_sizes is not None:
            raise _refuse("all_to_all with split sizes")
        return self._inner.all_to_all(x, group)

    def __getattr__(self, name: str) -> Any:
        if name in PASSED or name in _HELPERS:
            return getattr(self._inner, name)
        if name == "rank":
            raise _refuse("rank (the group rank)")
        raise _refuse(name)
