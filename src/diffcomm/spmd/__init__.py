"""Replication types (``dc.spmd_check``): replicated / varying / partial per process group,
checked op by op without communicating. See ``docs/spmd_types.md``.

:mod:`diffcomm._replication` (the types, :class:`Rule`, :class:`LayerRule`,
:class:`SPMDTypeError`) is imported by the op modules that state their rules;
:mod:`diffcomm.spmd.check` (the check itself) is loaded on first use of a name below.
"""

from __future__ import annotations

import importlib
from typing import Any

# re-exported (the names in PUBLIC; listed by __all__ below)
from .._replication import (  # noqa: F401
    PARTIAL,
    PUBLIC,
    REPLICATED,
    LayerRule,
    P,
    R,
    Rule,
    SPMDTypeError,
    T,
    V,
    varying_by_construction,
    varying_parameters,
)

_CHECK = (
    "SPMDCheck",
    "spmd_check",
    "varying",
    "replicated",
    "partial",
    "module",
    "type_of",
    "typing_table",
    "register_function",
)

__all__ = [*PUBLIC, *_CHECK]


def __getattr__(name: str) -> Any:
    if name in _CHECK:
        value = getattr(importlib.import_module(f"{__name__}.check"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
