"""Tools for users' own gradient tests of SPMD code (nothing in the package imports this).

* :func:`check_adjoint` — the dot-product test ``sum_r <A x_r, y_r> == sum_r <x_r, A^T y_r>``;
* :func:`gradcheck` — finite differences across ranks in lockstep (float64);
* :func:`assert_matches_serial` (with :class:`Shard` and :func:`build`) — outputs and all
  gradients of a parallel layer equal those of its single-device reference;
* :mod:`~diffcomm.testing.strategies` — hypothesis strategies (imported on first use;
  needs ``hypothesis``).

The pytest fixtures (one shared ``LocalWorld`` per world size) are in
:mod:`diffcomm.testing.plugin`, loaded automatically. See ``docs/testing.md``.
"""

from __future__ import annotations

import importlib
from typing import Any

from .checks import check_adjoint, gradcheck
from .serial import Shard, assert_matches_serial, build

__all__ = ["check_adjoint", "gradcheck", "assert_matches_serial", "Shard", "build", "strategies"]


def __getattr__(name: str) -> Any:
    if name == "strategies":
        return importlib.import_module(".strategies", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
