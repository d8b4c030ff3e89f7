"""The op families' public homes, filled from the registry: no file lists the ops.

A built-in op lives in its own module of :mod:`diffcomm.ops` (its class, which states its
``family`` and ``order``, and its public function). Nothing imports that module by name
for it to be found: :func:`import_op_modules` imports every module of the package
(``pkgutil``), and defining the classes registers them. Each family's public home —
:mod:`~diffcomm.ops.collectives`, :mod:`~diffcomm.ops.p2p`, :mod:`~diffcomm.ops.coalesced`
(:data:`HOMES`) — then binds the public functions of its family with :func:`export`, in
the registry's order, and :mod:`diffcomm` exports them (:func:`exported`). So a new
built-in op touches its module and its test, nothing else.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from collections.abc import Callable
from typing import Any

from . import registry as R

__all__ = ["HOMES", "import_op_modules", "public", "export", "late_ops", "exported"]

#: family -> the module of :mod:`diffcomm.ops` that is its public home (``dc.collectives``,
#: ``dc.p2p``, ``dc.coalesced``); their functions are also ``dc.<name>``.
HOMES: dict[str, str] = {"collective": "collectives", "p2p": "p2p", "coalesced": "coalesced"}

_PACKAGE = __name__.rpartition(".")[0]


def import_op_modules() -> None:
    """Import every module of :mod:`diffcomm.ops` but the homes and this one: defining
    their op classes registers them (each module once; a no-op after the first call)."""
    skip = {*HOMES.values(), __name__.rpartition(".")[2]}
    for info in pkgutil.iter_modules(sys.modules[_PACKAGE].__path__):
        if info.name not in skip:
            importlib.import_module(f"{_PACKAGE}.{info.name}")


def public(family: str) -> dict[str, Any]:
    """diffcomm's own ops of ``family``: name -> public function, in the registry's order."""
    import_op_modules()
    return {n: R.public_fn(c) for n, c in R.family(family).items() if R.builtin(c)}


def export(family: str, namespace: dict[str, Any]) -> list[str]:
    """Bind the public functions of ``family`` in a home's ``namespace`` (its ``globals()``);
    returns their names (the start of the home's ``__all__``)."""
    fns = public(family)
    namespace.update(fns)
    return list(fns)


def late_ops(family: str, home: str) -> Callable[[str], Any]:
    """A home's module ``__getattr__``: the public function of an op of ``family`` defined
    after the home was imported (a user's module), else ``AttributeError``."""

    def __getattr__(name: str) -> Any:
        cls = R.REGISTRY.get(name)
        if cls is not None and cls.family == family:
            return R.public_fn(cls)
        raise AttributeError(f"module {home!r} has no attribute {name!r}")

    return __getattr__


def exported() -> dict[str, str]:
    """Every op :mod:`diffcomm` exports: name -> its home's module path below the package
    (``"ops.collectives"``), family by family, each in the registry's order."""
    return {name: f"ops.{home}" for family, home in HOMES.items() for name in public(family)}
