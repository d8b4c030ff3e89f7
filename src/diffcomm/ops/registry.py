"""The one registry of differentiable communication ops: an op registers itself by being
defined.

An op class (a :class:`~diffcomm.ops.base.CommOp` or :class:`~diffcomm.ops.base.ListOp`)
that states a ``family`` is added here when Python creates the class (the base's
``__init_subclass__`` calls :func:`add`). Its block states every fact about the op once
(:class:`OpFacts` lists them): the dual (its class), how the call's arguments map to the
dual's, the serial reference, the output shape, the standard test cases, the docs' words.
Everything that lists ops reads this table:

* the per-family views (``dc.OPS`` / ``dc.DUALS``, ``p2p.OPS``, ``coalesced.COALESCED_OPS``,
  ``parallel.MAPPINGS``) are live :class:`FamilyView` / :class:`DualsView` of it, so an op
  defined later (a user's module) shows up in them;
* :func:`dual` answers for any registered op;
* the docs' op tables are :func:`markdown` of a family;
* :mod:`diffcomm.testing` (and so ``python -m diffcomm check``) walks the ops' ``cases``,
  ``reference`` and ``dual_args``;
* the async engine asks the class for ``out_shape``.

A pair of dual ops names the partner once: the class defined second states
``dual = First`` and :func:`add` sets ``First.dual``; a self-dual op states
``dual = SELF``. :func:`verify` checks what can only be checked once both are defined
(every dual present and paired within its family, every ``transpose`` calling its dual's
class, ``out_shape`` present where the family runs asynchronously).

This module imports nothing from the package: it sits below every op module.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, ClassVar, NamedTuple

__all__ = [
    "SELF",
    "OpFacts",
    "REGISTRY",
    "FAMILIES",
    "add",
    "public_name",
    "public_fn",
    "family",
    "builtin",
    "Entry",
    "entry",
    "FamilyView",
    "DualsView",
    "dual",
    "markdown",
    "with_reference",
    "verify",
    "MEMBER_ORDER",
    "member_rank",
]

Kwargs = dict[str, Any]

#: ``dual = SELF``: the op is its own adjoint (all_reduce, all_to_all, shift ...).
SELF = "self"

#: family -> the header of its docs table (op, forward, adjoint, backward columns).
FAMILIES: dict[str, tuple[str, str, str, str]] = {
    "collective": ("op", "forward (rank r)", "adjoint", "backward rule"),
    "p2p": ("op", "rank r gets", "adjoint", "backward rule"),
    "coalesced": ("op", "forward (rank r, each tensor)", "adjoint", "backward rule (one call per dtype)"),
    "mapping": ("mapping", "forward", "adjoint", "backward"),
}

#: families whose ops take ``async_op=True``: each op must state ``out_shape``.
ASYNC_FAMILIES = ("collective", "coalesced")


class OpFacts:
    """The facts an op class states about itself (class attributes; defaults here).

    Attributes:
        family: ``"collective"``, ``"p2p"``, ``"coalesced"`` or ``"mapping"``; stating it
            registers the class under :func:`public_name` (its ``name`` without a
            ``"parallel."`` style prefix).
        dual: the dual op's class; ``SELF`` for a self-dual op; set on the partner by
            :func:`add` (name it in the class defined second).
        forward_text / backward_text: the forward and the backward rule in words (the
            docs' tables; ``backward_text`` is also the backward of the op's typing rule,
            ``spmd``, which states none of its own).
        dual_args: optional (a mapping needs it): ``(kwargs, world) -> (dual_kwargs,
            scale)``: the adjoint of the public call ``fn(x, **kwargs)`` (a linear reduce
            op) is ``scale * dual_fn(y, **dual_kwargs)``; ``kwargs`` are the call's keyword
            arguments on this rank, split sizes spelled out. The testing kit's dot-product
            test with the dual's public function reads it; without it the kit still
            compares the backward with the gradient of the serial ``reference``.
        reference: ``(xs, kwargs_per_rank) -> outputs``: every rank's output computed in
            one process with plain torch ops (the testing kit's serial reference).
        out_shape: ``(x, *args) -> shape`` (a list of shapes for a list op, called as
            ``(xs, *meta)``): the output's shape from ``run``'s arguments, before any
            communication (the async engine allocates the result with it).
        cases: ``(world) -> iterable of dicts``: the standard test cases (the fields of
            :class:`diffcomm.testing.cases.Case`, or ``CoalescedCase`` for a list op,
            without ``op`` and ``world``) that ``python -m diffcomm check`` runs.
        replicated: mappings only: ``(input replicated, output replicated)`` under the
            replicated objective (how the testing kit forms its inner products).
        wire_transpose: the transpose moves the gradient over the wire protocol itself
            (``send`` / ``recv``: each side's transpose is the other's half) instead of
            calling the dual's class.
        order: the op's place in its family (``dc.OPS``, the docs' table, ``check``): a
            family lists its ops by ``order``, then in definition order; an op that states
            none comes after diffcomm's own.
    """

    family: ClassVar[str] = ""
    dual: ClassVar[Any] = None
    forward_text: ClassVar[str] = ""
    backward_text: ClassVar[str] = ""
    dual_args: ClassVar[Any] = None  # a staticmethod on the op class (signature above)
    reference: ClassVar[Any] = None  # a staticmethod on the op class (signature above)
    out_shape: ClassVar[Any] = None  # a staticmethod on the op class (signature above)
    cases: ClassVar[Any] = None  # a staticmethod on the op class (signature above)
    replicated: ClassVar[tuple[bool, bool] | None] = None
    wire_transpose: ClassVar[bool] = False
    order: ClassVar[float] = math.inf


#: The one order of the members of an op block (docs/architecture.md, "The op block";
#: tests/ops/test_op_blocks.py checks every built-in op): what the op is, how it is called
#: (``"<attributes>"``: any other data member: ``dims``, ``elementwise``, ...), its words
#: and typing rule, its math (``"<methods>"``: any other method: ``linearize``, ``jvp``,
#: ...), then the facts the async engine and the testing kit read.
MEMBER_ORDER: tuple[str, ...] = (
    "name",
    "family",
    "order",
    "dual",
    "<attributes>",
    "forward_text",
    "backward_text",
    "spmd",
    "run",
    "label",
    "transpose",
    "<methods>",
    "out_shape",
    "reference",
    "dual_args",
    "cases",
)


def member_rank(name: str, method: bool) -> int:
    """The place of member ``name`` (a method when ``method``) in :data:`MEMBER_ORDER`."""
    if name in MEMBER_ORDER:
        return MEMBER_ORDER.index(name)
    return MEMBER_ORDER.index("<methods>" if method else "<attributes>")


#: public op name -> its class, every family (definition order).
REGISTRY: dict[str, Any] = {}


def public_name(cls: Any) -> str:
    """The name an op is registered and called under: ``name`` without its namespace
    (``"parallel.copy_to_region"`` -> ``"copy_to_region"``)."""
    return cls.name.rpartition(".")[2]


def add(cls: Any) -> None:
    """Register ``cls`` (called when a class stating ``family`` is created).

    Raises ``ValueError`` on an unknown family, a name registered twice (by another
    class: redefining the same class, as a reload does, replaces it), a missing
    ``forward_text`` / ``backward_text``, or a dual that is no registered op of the same
    family or already paired with another op.
    """
    name = public_name(cls)
    if cls.family not in FAMILIES:
        raise ValueError(
            f"diffcomm registry: {name}: unknown family {cls.family!r}; known: {sorted(FAMILIES)}"
        )
    old = REGISTRY.get(name)
    if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(
            f"diffcomm registry: op {name!r} is registered twice ({old.__qualname__}, {cls.__qualname__})"
        )
    if not (cls.forward_text and cls.backward_text):
        raise ValueError(f"diffcomm registry: {name}: state forward_text and backward_text (the docs' table)")
    d: Any = cls.__dict__.get("dual")
    if d == SELF:
        cls.dual = cls
    elif d is not None:
        partner: Any = REGISTRY.get(public_name(d)) if isinstance(d, type) and hasattr(d, "name") else None
        if partner is not d:
            raise ValueError(f"diffcomm registry: {name}: dual {d!r} is not a registered op class")
        if d.family != cls.family:
            raise ValueError(
                f"diffcomm registry: {name} ({cls.family}) and its dual {public_name(d)} ({d.family}) "
                "differ in family"
            )
        back = d.__dict__.get("dual")
        if back is not None and back is not SELF and public_name(back) != name:
            other = public_name(d)
            raise ValueError(
                f"diffcomm registry: dual({name!r}) = {other!r} but dual({other!r}) = {public_name(back)!r}"
            )
        d.dual = cls
    rule = cls.__dict__.get("spmd")
    if dataclasses.is_dataclass(rule) and not isinstance(rule, type) and hasattr(rule, "backward"):
        cls.spmd = dataclasses.replace(rule, backward=cls.backward_text)  # the typing table's
        cls.spmd.__set_name__(cls, "spmd")  # its spmd_types rule, made from this one
    REGISTRY[name] = cls


def public_fn(cls: Any) -> Any:
    """The public function of op ``cls``: the function named :func:`public_name` in the
    module that defines the class (``parallel.copy_to_region`` for ``_CopyToRegion``)."""
    name = public_name(cls)
    fn = getattr(sys.modules[cls.__module__], name, None)
    if fn is None:
        raise ValueError(f"diffcomm registry: {name}: no public function {name!r} in {cls.__module__}")
    return fn


def family(family_name: str, modules: Iterable[str] | None = None) -> dict[str, Any]:
    """The registered ops of one family, name -> class, in their ``order`` (then in
    definition order; a copy).

    ``modules``: only diffcomm's own ops and those the named modules define (the testing
    kit's standard cases: a test session that imported a user's op module elsewhere
    still checks exactly what it names); ``None``: every op.
    """
    keep = None if modules is None else set(modules)
    ops = [
        (n, c)
        for n, c in REGISTRY.items()
        if c.family == family_name and (keep is None or builtin(c) or c.__module__ in keep)
    ]
    return dict(sorted(ops, key=lambda item: item[1].order))


def builtin(cls: Any) -> bool:
    """Whether op ``cls`` is one of diffcomm's own (defined in the package)."""
    return cls.__module__.startswith("diffcomm.")


class Entry(NamedTuple):
    """What a family view shows of one op: read off its class when asked (nothing here
    is stated anywhere else)."""

    name: str
    fn: Any  # the public function
    dual: str  # the dual's name
    family: str
    forward: str  # forward_text
    backward: str  # backward_text
    op: Any  # the op class (dual_args, reference, cases, out_shape ...)


def entry(cls: Any) -> Entry:
    """The :class:`Entry` of op class ``cls``."""
    return Entry(
        public_name(cls),
        public_fn(cls),
        public_name(cls.dual),
        cls.family,
        cls.forward_text,
        cls.backward_text,
        cls,
    )


class FamilyView(Mapping[str, Entry]):
    """A live, read-only view of one family: name -> :class:`Entry` (``dc.OPS``, ``p2p.OPS``)."""

    def __init__(self, family_name: str) -> None:
        self.family = family_name

    def __getitem__(self, name: str) -> Any:
        cls = REGISTRY[name]
        if cls.family != self.family:
            raise KeyError(name)
        return entry(cls)

    def __iter__(self) -> Iterator[str]:
        return iter(family(self.family))

    def __len__(self) -> int:
        return len(family(self.family))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.family!r}: {list(self)})"


class DualsView(FamilyView):
    """A live, read-only view of one family: op name -> its dual's name (``dc.DUALS``)."""

    def __getitem__(self, name: str) -> str:  # type: ignore[override]
        return super().__getitem__(name).dual


def dual(op: str) -> str:
    """Name of the adjoint of any registered op (``dual(dual(op)) == op``)."""
    cls = REGISTRY.get(op)
    if cls is None:
        raise ValueError(f"diffcomm.dual(): unknown op {op!r}; known: {sorted(REGISTRY)}")
    return public_name(cls.dual)


def markdown(family_name: str) -> str:
    """A family's op -> adjoint table as Markdown (the docs include these)."""
    head = FAMILIES[family_name]
    lines = ["| " + " | ".join(head) + " |", "|---|---|---|---|"]
    for name, c in family(family_name).items():
        lines.append(f"| `{name}` | {c.forward_text} | `{public_name(c.dual)}` | {c.backward_text} |")
    return "\n".join(lines)


def with_reference() -> dict[str, Any]:
    """Every op the testing kit checks under the sum-of-objectives convention: a serial
    reference (the collectives and the symmetric p2p ops; ``dual_args``, when stated, adds
    the dot-product test with the dual's function)."""
    return {n: c for n, c in REGISTRY.items() if c.reference is not None and c.replicated is None}


def verify() -> list[str]:
    """What is wrong with the registry (empty when nothing): every op's dual is set,
    paired back (``dual(dual(op)) == op``) and of its family; its ``transpose`` calls the
    dual's class (named in its code, unless ``wire_transpose``); an op of an async family
    states ``out_shape``; an op with a reference states ``cases``, an op with ``cases`` the
    facts the testing kit checks them with (a collective its ``reference``, a mapping its
    ``dual_args``); the ``Gradient:`` of its public function's docstring names its dual
    (or its ``backward_text``'s leading word)."""
    problems = []
    for name, c in REGISTRY.items():
        d = c.dual
        if d is None or d == SELF:
            problems.append(f"{name}: no dual (state `dual = SELF` or name it in its partner's class)")
            continue
        if d.dual is not c:
            back = "nothing" if d.dual is None else public_name(d.dual)
            problems.append(f"{name}: dual({name}) = {public_name(d)} but dual({public_name(d)}) = {back}")
        if d.family != c.family:
            problems.append(f"{name}: its dual {public_name(d)} is of family {d.family}, not {c.family}")
        rule = c.__dict__.get("transpose")
        if rule is None:
            problems.append(f"{name}: no transpose of its own")
        elif not c.wire_transpose and d not in _classes_named(rule):
            problems.append(f"{name}: transpose does not call its dual's class {d.__qualname__}")
        if c.family in ASYNC_FAMILIES and c.out_shape is None:
            problems.append(f"{name}: no out_shape (async_op=True would have no output to hand out)")
        if c.reference is not None and c.cases is None:
            problems.append(f"{name}: a reference but no cases")
        if c.cases is not None and c.family == "collective" and c.reference is None:
            problems.append(f"{name}: cases but no reference (the testing kit checks them against it)")
        if c.cases is not None and c.family == "mapping" and c.dual_args is None:
            problems.append(f"{name}: cases but no dual_args (the testing kit checks a mapping with it)")
        try:
            fn = public_fn(c)
        except ValueError as exc:
            problems.append(str(exc).removeprefix("diffcomm registry: "))
            continue
        if (wrong := _gradient_line(fn, public_name(d), c.backward_text)) is not None:
            problems.append(f"{name}: {wrong}")
    return problems


def _gradient_line(fn: Any, dual_name: str, backward_text: str) -> str | None:
    """What is wrong with the ``Gradient:`` part of ``fn``'s docstring (``None``: nothing, or
    no such part): it must name the dual op or the backward's leading word (``all_gather``,
    ``identity``), the facts the class states."""
    doc = fn.__doc__ or ""
    if "Gradient:" not in doc:
        return None
    text = doc.split("Gradient:", 1)[1].strip().split("\n\n", 1)[0]
    lead = backward_text.split("(", 1)[0].split()[0].strip(",:;")
    if dual_name in text or lead in text:
        return None
    return f"its docstring's Gradient: names neither its dual {dual_name} nor its backward {lead!r}"


def _classes_named(rule: Any) -> list[Any]:
    """The objects a rule's code names as globals (the classes its body calls)."""
    f = rule.__func__ if isinstance(rule, staticmethod) else rule
    g = f.__globals__
    return [g[n] for n in f.__code__.co_names if n in g]
