"""Replication types: the three types, an op's typing rule, a layer's rule, the error.

Kept free of every other diffcomm module (only ``torch``-free Python), so each op class,
mapping and layer can state its rule beside its other facts (``spmd = Rule(...)``) without
an import cycle; the checker that reads the rules is :mod:`diffcomm.spmd.check`.

The types, per process group (see ``docs/spmd_types.md`` for the reasoning):

``R`` replicated
    equal on every rank. Its gradient is either *partial* (each rank holds its own
    contribution; the sum over ranks is the gradient) or *replicated* (every rank holds the
    whole gradient): which one is fixed by the ops that made and that use the value (its
    *gradient kind*, tracked by the checker, see :class:`Rule` ``out_grad`` / ``in_grad``).
``V`` varying
    differs by rank (per-rank data, a shard); its gradient is varying.
``P`` partial
    its true value is the sum over ranks (a row-parallel matmul's output before its
    reduction); its gradient is replicated.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: the names :mod:`diffcomm.spmd` re-exports (the rest serve the op modules)
PUBLIC = (
    "T",
    "R",
    "V",
    "P",
    "PARTIAL",
    "REPLICATED",
    "Rule",
    "LayerRule",
    "SPMDTypeError",
    "varying_by_construction",
    "varying_parameters",
)
__all__ = [*PUBLIC, "TWICE", "SHARES", "HOOK"]


class T(enum.Enum):
    """A replication type over one process group."""

    R = "replicated"
    V = "varying"
    P = "partial"

    def __repr__(self) -> str:
        return self.name

    __str__ = __repr__


R, V, P = T.R, T.V, T.P

#: gradient kinds of a replicated value: what its backward rule needs (``out_grad``) or
#: gives (``in_grad``)
PARTIAL = "partial"
REPLICATED = "replicated"


#: the usual reasons an op refuses a type (shared by the rules of many ops)
TWICE = "already replicated: the reduction would run twice (use the value as it is)"
SHARES = "a partial value's per-rank shares are not its value: reduce it first"


#: set by an active ``dc.spmd_check`` (``None`` otherwise): the check's hooks for facts that
#: only the code that makes a value knows (``.varying(x)``, ``.varying_params(m, group)``)
HOOK: list[Any] = [None]


def varying_by_construction(x: Any) -> Any:
    """``x``, typed varying in an active check (a value that differs by rank because it is
    this rank's part of something, e.g. ``parallel.shard``'s output). Returns ``x``; costs
    one list lookup when no check is active."""
    hook = HOOK[0]
    return x if hook is None else hook.varying(x)


def varying_parameters(module: Any, group: Any) -> None:
    """In an active check over ``group``: ``module``'s parameters are this rank's own
    (varying; e.g. a pipeline stage's). A no-op (one list lookup) when no check is active."""
    hook = HOOK[0]
    if hook is not None:
        hook.varying_params(module, group)


class SPMDTypeError(TypeError):
    """An op's inputs break its replication-typing rule (raised by ``dc.spmd_check``).

    The message names the op (and the user's line), the argument, the type found and the
    types expected, and the fix.
    """


@dataclass(frozen=True)
class Rule:
    """The replication-typing rule of one op (a communication op, a mapping, or an
    autograd Function fused with its communication), stated on its class as ``spmd``.

    Args:
        maps: accepted input type -> output type (for every typed tensor argument; a type
            missing here is refused).
        out_grad: for an ``R`` output, what the op's backward needs of that output's
            gradient: ``PARTIAL`` (it sums the gradient over ranks: the sum convention) or
            ``REPLICATED`` (it passes it on as it is: the replicated objective).
        in_grad: for an ``R`` input, what the backward gives it: ``REPLICATED`` (the
            gradient is summed / gathered over ranks: every rank gets the whole of it) or
            ``PARTIAL`` (each rank gets its share).
        refuse: why a refused input type is wrong, and the fix (one line each).
        instead: under a *replicated* objective (a replicated loss), the mapping to use
            instead of this op (its ``R`` output counts the loss ``world`` times there).
        backward: the backward in words (the docs' table). A registered op's is its
            ``backward_text`` (set by the registry: the op states it once, there); state
            it only for a Function that is no registered op.
        nonlinear: the rule for the op's nonlinear reduce ops (``op`` in max/min/product).
        tensors: positions of the typed tensor arguments of ``forward`` (after a ``ctx``);
            ``None``: the first (a CommOp's ``x``) or every list element (a ListOp).
        group: name of the ``forward`` parameter holding the process group (or a function
            of the bound arguments returning it).
        outputs: the output types for a Function with several outputs (``None`` entries
            untyped); ``maps`` then only checks the inputs.
    """

    maps: Mapping[T, T]
    out_grad: str | None = None
    in_grad: str | None = None
    refuse: Mapping[T, str] = field(default_factory=dict)
    instead: str | None = None
    backward: str = ""
    nonlinear: Rule | None = None
    tensors: tuple[int, ...] | None = None
    group: str | Callable[[Mapping[str, Any]], Any] = "pg"
    outputs: tuple[T | None, ...] | None = None

    def out_type(self, t: T) -> T | None:
        """The output type for input type ``t`` (``None``: refused)."""
        return self.maps.get(t)

    def describe(self) -> tuple[str, str, str]:
        """``(forward types, gradient note, refused types)`` for the docs' table."""
        fwd = ", ".join(f"{a} -> {b}" for a, b in self.maps.items())
        grad = []
        if self.out_grad is not None:
            grad.append(f"R output's gradient must be {self.out_grad}")
        if self.in_grad is not None:
            grad.append(f"R input's gradient comes back {self.in_grad}")
        if self.nonlinear is not None:
            fwd += f" (max/min/product: {', '.join(f'{a} -> {b}' for a, b in self.nonlinear.maps.items())})"
        refused = "; ".join(f"{t}: {why}" for t, why in self.refuse.items())
        return fwd, "; ".join(grad) or "-", refused or "-"


@dataclass(frozen=True)
class LayerRule:
    """The replication-typing rule of a layer (an ``nn.Module`` class), stated as ``spmd``.

    Args:
        inputs: the layer -> the type its (first) tensor input must have (or a tuple of the
            types it accepts), e.g. ``lambda m: V if m.sequence_parallel else R``.
        why: the layer -> what the expected type means, for the message.
        params: the layer -> ``{parameter name: type}`` over the layer's group; parameters
            not named are replicated (a :class:`~diffcomm.parallel.ParallelModule` is
            typed from its ``_shard_dims`` without stating this).
        group: the layer -> its process group (default: its ``_pg``).
        doc: the rule in words (the docs' table).
    """

    inputs: Callable[[Any], T | tuple[T, ...]]
    doc: str = ""
    why: Callable[[Any], str] = lambda m: ""
    params: Callable[[Any], Mapping[str, T]] | None = None
    group: Callable[[Any], Any] = lambda m: getattr(m, "_pg", None)
