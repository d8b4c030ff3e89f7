"""The one registry of differentiable communication ops.

Every op family (the eight collectives, point-to-point, coalesced lists, the
``diffcomm.parallel`` mappings) registers its :class:`OpSpec` entries here, under the
family's name, in the module that defines the ops. Everything that lists ops is derived
from this one table:

* the per-family views (``dc.OPS`` / ``dc.DUALS``, ``p2p.OPS``, ``coalesced.COALESCED_OPS``,
  ``parallel.MAPPINGS``) are :func:`family` of it;
* :func:`dual` answers for any registered op;
* the docs' op tables are :func:`markdown` of a family;
* :func:`with_reference` is what :mod:`diffcomm.testing` (and so ``python -m diffcomm
  check``) walks: every op with an argument map to its dual and a serial reference.

Adding an op = one entry here (through its module's ``register`` call) + one block (its
public function and its :class:`~diffcomm.ops.base.CommOp`). This module imports nothing from
the package: it sits below every op module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

__all__ = ["Kwargs", "OpSpec", "REGISTRY", "register", "family", "dual", "markdown", "with_reference"]

Kwargs = dict[str, Any]


@dataclass(frozen=True)
class OpSpec:
    """One op of the registry: everything the rest of the package derives from it.

    Attributes:
        name: the public name (``dc.<name>``, ``dc.parallel.<name>``).
        fn: the public function.
        dual: the name of its adjoint op (``dual(dual(op)) == op``), in the same family.
        forward / backward: the rules in words (the docs' tables).
        dual_args: ``(kwargs, world) -> (dual_kwargs, scale)``: the adjoint of the call
            ``fn(x, **kwargs)`` (linear reduce ops) is ``scale * dual_fn(y, **dual_kwargs)``.
            ``kwargs`` are the call's keyword arguments on this rank, split sizes given
            explicitly. Read by :mod:`diffcomm.testing` (the dot-product test) and so by
            ``python -m diffcomm check``.
        reference: ``(xs, kwargs_per_rank) -> outputs``: every rank's output computed in
            one process with plain torch ops (the serial reference of the testing kit).
        family: the op family (``"collective"``, ``"p2p"``, ``"coalesced"``,
            ``"mapping"``), set by :func:`register`.
    """

    name: str
    fn: Any
    dual: str
    forward: str
    backward: str
    dual_args: Callable[[Kwargs, int], tuple[Kwargs, float]] | None = None
    reference: Callable[[list[Tensor], list[Kwargs]], list[Tensor]] | None = None
    family: str = ""


#: op name -> spec, every family (registration order).
REGISTRY: dict[str, OpSpec] = {}

#: family -> the header of its docs table (op, forward, adjoint, backward columns).
_HEADERS: dict[str, tuple[str, str, str, str]] = {
    "collective": ("op", "forward (rank r)", "adjoint", "backward rule"),
    "p2p": ("op", "rank r gets", "adjoint", "backward rule"),
    "coalesced": ("op", "forward (rank r, each tensor)", "adjoint", "backward rule (one call per dtype)"),
    "mapping": ("mapping", "forward", "adjoint", "backward"),
}


def register(family_name: str, *specs: OpSpec) -> dict[str, OpSpec]:
    """Add ``specs`` to the registry under ``family_name``; returns the family's table.

    Raises ``ValueError`` on an unknown family, a name registered twice, or a family
    whose duals do not close (``dual(dual(op)) == op`` within the family).
    """
    if family_name not in _HEADERS:
        raise ValueError(f"diffcomm registry: unknown family {family_name!r}; known: {sorted(_HEADERS)}")
    added = {}
    for s in specs:
        if s.name in REGISTRY:
            raise ValueError(f"diffcomm registry: op {s.name!r} is registered twice")
        added[s.name] = s if s.family == family_name else _with_family(s, family_name)
    REGISTRY.update(added)
    table = family(family_name)
    for name, s in added.items():
        back = table.get(s.dual)
        if back is not None and back.dual != name:
            raise ValueError(
                f"diffcomm registry: dual({name!r}) = {s.dual!r} but dual({s.dual!r}) = {back.dual!r}"
            )
    return table


def _with_family(s: OpSpec, family_name: str) -> OpSpec:
    from dataclasses import replace

    return replace(s, family=family_name)


def family(family_name: str) -> dict[str, OpSpec]:
    """The registered ops of one family, name -> spec, in registration order (a copy)."""
    return {n: s for n, s in REGISTRY.items() if s.family == family_name}


def dual(op: str) -> str:
    """Name of the adjoint of any registered op (``dual(dual(op)) == op``)."""
    spec = REGISTRY.get(op)
    if spec is None:
        raise ValueError(f"diffcomm.dual(): unknown op {op!r}; known: {sorted(REGISTRY)}")
    return spec.dual


def markdown(family_name: str) -> str:
    """A family's op -> adjoint table as Markdown (the docs include these)."""
    head = _HEADERS[family_name]
    lines = ["| " + " | ".join(head) + " |", "|---|---|---|---|"]
    for s in family(family_name).values():
        lines.append(f"| `{s.name}` | {s.forward} | `{s.dual}` | {s.backward} |")
    return "\n".join(lines)


def with_reference() -> dict[str, OpSpec]:
    """Every op the testing kit can check on its own: a dual argument map and a serial
    reference (the collectives and the symmetric p2p ops)."""
    return {n: s for n, s in REGISTRY.items() if s.dual_args is not None and s.reference is not None}
