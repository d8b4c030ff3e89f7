"""Replication types: the three types, an op's typing rule, a layer's rule, the error.

Kept free of every other diffcomm module (only ``torch``-free Python), so each op class,
mapping and layer can state its rule beside its other facts (``spmd = Rule(...)``) without
an import cycle; the checker that reads the rules is :mod:`diffcomm.spmd.check`.

The same rules, translated, are spmd_types' (``spmd_types.checker.typecheck()``): stating
``spmd = Rule(...)`` also gives the class ``spmd_typecheck`` (:class:`SpmdTypesRule`); the
helpers at the end let the layers type their parameters for it. ``torch`` and
``spmd_types`` are imported only inside those, which run only while spmd_types checks
(see ``docs/with_spmd_types.md``).

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

# Size: ~610 lines, over the ~600 guideline: the rules and their translation into
# spmd_types' types are one source for both checkers, read side by side.

from __future__ import annotations

import contextlib
import enum
import importlib
import sys
import threading
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
__all__ = [*PUBLIC, "TWICE", "SHARES", "HOOK", "objective_term"]


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


def objective_term(aux: Any) -> None:
    """In an active check: ``aux`` is one more term of the objective of the backward that
    runs through it (``pipeline.add_aux_loss``), checked against that objective as the loss
    is when backward starts. A no-op (one list lookup) when no check is active."""
    hook = HOOK[0]
    if hook is not None:
        hook.objective_term(aux)


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
        no_grad: the output type for an ``R`` input that ``maps`` refuses but that does
            not require grad and that no communication over the group made: the op's
            arithmetic on equal values (``all_reduce`` sums them: ``W * x``, replicated)
            is legal when no gradient flows back through it (the world-size error of a sum
            of a replicated value is in its backward, or in summing what already holds the
            ranks' values); any other ``R`` input is refused as ``refuse`` says. ``None``:
            every ``R`` input is refused.
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
    no_grad: T | None = None

    def __set_name__(self, owner: type, name: str) -> None:
        # the class states its rule as ``spmd``: it also carries spmd_types' rule, made from
        # this one (``owner.spmd_typecheck``, read only by spmd_types' checker)
        # (a class's own ``spmd_typecheck``, written by hand, is kept; one made from an
        # earlier rule of the class is remade from this one)
        mine = owner.__dict__.get("spmd_typecheck")
        if name == "spmd" and (mine is None or isinstance(mine, SpmdTypesRule)):
            owner.spmd_typecheck = SpmdTypesRule(self)  # type: ignore[attr-defined]

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
        free = f" (no gradient, made by no communication: R -> {self.no_grad})" if self.no_grad else ""
        refused = "; ".join(f"{t}: {why}" + (free if t is R else "") for t, why in self.refuse.items())
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
    #: the gradient of its replicated parameters: ``REPLICATED`` (a replicated objective,
    #: tensor parallelism) or ``PARTIAL`` (the sum convention: summed over the group after
    #: backward, e.g. an expert-parallel router); spmd_types' ``I`` or ``R`` for them
    replicated_grad: str = REPLICATED


# ======================================================================================
# the same rules, for spmd_types' checker
# ======================================================================================


class SpmdTypesRule:
    """``cls.spmd_typecheck`` of a class stating ``spmd = Rule(...)``: the class's rule in
    the words of ``spmd_types`` (PyTorch's typed SPMD; ``spmd_types.checker.typecheck()``
    reads this attribute of every ``torch.autograd.Function`` it sees applied).

    Made from the :class:`Rule` itself (no second table), by the type mapping of
    ``docs/with_spmd_types.md``: spmd_types' ``I`` (invariant) is our replicated value whose
    gradient is replicated, its ``R`` a replicated value whose gradient is partial, ``V`` /
    ``S(i)`` varying, ``P`` partial. A descriptor: the hook (a function whose keyword-only
    parameters are ``forward``'s, as spmd_types requires) is made on first use per class,
    and nothing here imports torch or spmd_types until spmd_types calls it.
    """

    def __init__(self, rule: Rule) -> None:
        self.rule = rule
        self._hooks: dict[type, Callable[..., None]] = {}

    def __get__(self, obj: Any, cls: type | None = None) -> Callable[..., None]:
        owner = cls if cls is not None else type(obj)
        hook = self._hooks.get(owner)
        if hook is None:
            hook = self._hooks[owner] = _spmd_types_hook(owner, self.rule)
        return hook


def _st(sub: str = "") -> Any:
    """``spmd_types`` (or its submodule ``sub``): only called while spmd_types checks, so
    it is imported already (typed ``Any``: diffcomm type-checks without it installed)."""
    import importlib

    return importlib.import_module("spmd_types" + (f".{sub}" if sub else ""))


def _forward_names(cls: type) -> tuple[str, ...]:
    """``cls.forward``'s parameter names, without a ``ctx`` (as spmd_types binds them)."""
    import inspect

    import torch

    params = list(inspect.signature(cls.forward).parameters)  # type: ignore[attr-defined]
    if cls.setup_context is torch.autograd.Function.setup_context:  # type: ignore[attr-defined]
        params = params[1:]  # forward(ctx, ...)
    return tuple(params)


def _spmd_types_hook(cls: type, rule: Rule) -> Callable[..., None]:
    import inspect

    names = _forward_names(cls)

    def spmd_typecheck(outputs: Any, **args: Any) -> None:
        _type_for_spmd_types(cls, rule, outputs, args)

    kw = inspect.Parameter.KEYWORD_ONLY
    spmd_typecheck.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter("outputs", inspect.Parameter.POSITIONAL_ONLY)]
        + [inspect.Parameter(n, kw) for n in names]
    )
    spmd_typecheck.__qualname__ = f"{cls.__qualname__}.spmd_typecheck"
    return spmd_typecheck


def _logical_args(
    cls: type, rule: Rule, args: Mapping[str, Any]
) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """``(bound arguments by name, [(name, typed tensor)])`` of one call: a list op's
    ``forward(x0, *args)`` is ``(xs[0], *meta, *xs[1:])`` (its ``run(xs, *meta)`` names)."""
    import torch

    nmeta = getattr(cls, "nmeta", None)
    if nmeta is not None and tuple(args) == ("x0", "args"):
        run = cls.__dict__["run"].__func__
        run_names = run.__code__.co_varnames[: run.__code__.co_argcount]
        rest = tuple(args["args"])
        xs = (args["x0"], *rest[nmeta:])
        bound = dict(zip(run_names[1:], rest[:nmeta]))
        return bound, [(f"{run_names[0]}[{i}]", x) for i, x in enumerate(xs) if isinstance(x, torch.Tensor)]
    bound = dict(args)
    names = list(args)
    pos = rule.tensors if rule.tensors is not None else (0,)
    typed = [(names[i], args[names[i]]) for i in pos if i < len(names)]
    return bound, [(n, x) for n, x in typed if isinstance(x, torch.Tensor)]


def _type_for_spmd_types(cls: type, rule: Rule, outputs: Any, args: Mapping[str, Any]) -> None:
    """Check ``rule`` on one call's arguments in spmd_types' types and type its outputs
    (the body of every ``spmd_typecheck`` made by :class:`SpmdTypesRule`)."""
    import torch
    import torch.distributed as dist

    st, st_rules, normalize_axis = _st(), _st("rules"), _st("types").normalize_axis

    name = getattr(cls, "name", "")  # a CommOp's public name, else module.Class
    if not isinstance(name, str) or not name:
        name = f"{cls.__module__.removeprefix('diffcomm.')}.{cls.__name__.lstrip('_')}"
    who = (
        f"diffcomm.{name}"
        if cls.__module__.startswith("diffcomm")
        else f"{cls.__module__}.{cls.__qualname__}"
    )
    bound, typed = _logical_args(cls, rule, args)
    group = rule.group(bound) if callable(rule.group) else bound.get(rule.group)
    axis = normalize_axis(group if group is not None else dist.group.WORLD)
    if rule.nonlinear is not None and bound.get("op") in ("max", "min", "product"):
        rule = rule.nonlinear
    others = [
        (n, t)
        for n, v in args.items()
        for t in (v if isinstance(v, (tuple, list)) else (v,))
        if isinstance(t, torch.Tensor) and all(t is not x for _, x in typed)
    ]
    st_rules.ignore(*[t for _, t in typed], *[t for _, t in others])
    for n, t in others:  # weights, masks, targets: any type but a partial one
        if axis.size() > 1 and st.get_local_type(t).get(axis) is st.P:
            raise st.SpmdTypeError(f"{who}: argument {n!r} is P (partial) on axis {axis}: {SHARES}.")
    to_st = {R: None, V: st.V, P: st.P}
    results: list[Any] = []
    for n, x in typed:
        local = dict(st.get_local_type(x))
        if axis.size() == 1:
            results.append((x, local))
            continue
        have = local.get(axis)
        if have is None:  # untyped on this axis: the rule's first input type establishes it
            first = next(iter(rule.maps))
            have = (st.I if rule.in_grad == REPLICATED else st.R) if first is R else to_st[first]
        ours = {st.I: R, st.R: R, st.V: V, st.P: P}[have]
        same = name in ("all_reduce", "all_reduce_coalesced") and bound.get("op") in ("avg", "max", "min")
        if ours is R and same:
            # the mean, max or min of equal values: an identity whose backward averages the
            # gradient (every rank ties), right for a whole (I) gradient; as dc.spmd_check
            # types it (docs/spmd_types.md)
            if have is st.R and torch.is_grad_enabled() and x.requires_grad:
                raise st.SpmdTypeError(
                    f"{who}(op={bound.get('op')!r}): argument {n!r} is R on axis {axis}, expected I: its "
                    "backward averages the gradient, which must be whole on every rank."
                )
            local[axis] = have
            results.append((x, local))
            continue
        out = rule.maps.get(ours)
        if out is None:
            expected = " or ".join(_st_names(t, rule.in_grad) for t in rule.maps)
            why = rule.refuse.get(ours, "")
            raise st.SpmdTypeError(
                f"{who}: argument {n!r} is {have!r} on axis {axis}, expected {expected}"
                + (f": {why}" if why else "")
                + "."
            )
        needs_grad = torch.is_grad_enabled() and x.requires_grad
        if ours is R and rule.in_grad is not None and needs_grad:
            want = st.I if rule.in_grad == REPLICATED else st.R
            if have is not want:
                raise st.SpmdTypeError(
                    f"{who}: argument {n!r} is {have!r} on axis {axis}, expected {want!r}: "
                    f"the backward of {name} gives it a {rule.in_grad} gradient, but a "
                    f"{have!r} value's gradient is "
                    + (
                        "partial (summed later over the ranks: it would be summed twice)"
                        if have is st.R
                        else "replicated (never summed: each rank's share would be lost)"
                    )
                    + "."
                )
        if out is R:
            kind = rule.out_grad
            if kind is None:  # the rule needs no gradient kind: an R or I input keeps its own
                local[axis] = have if have is st.I or have is st.R else st.R
            else:
                local[axis] = st.R if kind == PARTIAL else st.I
        else:
            local[axis] = to_st[out]
        results.append((x, local))
    _stamp(rule, outputs, results, axis)


def _st_names(t: T, grad: str | None) -> str:
    """spmd_types' name of our type ``t`` as an input whose gradient the rule gives as
    ``grad`` (``in_grad``), or as an output whose gradient it needs as ``grad``
    (``out_grad``)."""
    if t is not R:
        return t.name
    return {REPLICATED: "I", PARTIAL: "R"}.get(grad or "", "R or I")


def describe_for_spmd_types(rule: Rule) -> str:
    """``rule`` in spmd_types' types, e.g. ``"V -> I, P -> I"`` (the docs' table; the same
    translation the hooks apply: :func:`_type_for_spmd_types`)."""

    def one(r: Rule) -> str:
        parts = []
        for t, u in r.maps.items():
            src = _st_names(t, r.in_grad)
            dst = _st_names(u, r.out_grad)
            if u is R and r.out_grad is None:  # the gradient kind of an R / I input is kept
                dst = "R" if t is not R else "R or I (as the input)"
            parts.append(f"{src} -> {dst}")
        return ", ".join(parts)

    text = one(rule)
    if rule.nonlinear is not None:
        text += f" (max/min/product: {one(rule.nonlinear)})"
    if rule.outputs is not None:
        outs = ", ".join("-" if t is None else _st_names(t, rule.out_grad) for t in rule.outputs)
        text += f"; outputs ({outs})"
    return text


def _stamp(rule: Rule, outputs: Any, results: list[tuple[Any, dict[Any, Any]]], axis: Any) -> None:
    """Stamp ``outputs`` with the types in ``results`` (one per typed input; a single
    output takes the first), or with ``rule.outputs`` where the Function states them."""
    import torch

    st, st_rules = _st(), _st("rules")

    outs = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
    base = dict(results[0][1]) if results else {}
    for i, o in enumerate(outs):
        if not isinstance(o, torch.Tensor):
            continue
        if rule.outputs is not None:
            t = rule.outputs[min(i, len(rule.outputs) - 1)]
            local = dict(base)
            if axis.size() > 1:
                if t is R:
                    local[axis] = st.I if rule.out_grad == REPLICATED else st.R
                elif t is not None:
                    local[axis] = st.V if t is V else st.P
        else:
            local = results[min(i, len(results) - 1)][1] if results else {}
        typed = st_rules.NdimWithSpmdType(o.ndim)
        st.assert_type(typed, local)
        st_rules.output(o, typed)


def spmd_types_checking(attrs: Mapping[str, Any]) -> bool:
    """Whether spmd_types' checker is active: ``attrs`` is ``torch.autograd.Function``'s
    ``__dict__``, whose ``apply`` spmd_types replaces while it checks (see
    ``diffcomm.ops.base``). ``dc.spmd_check`` replaces it too, with a wrapper that names
    what it wraps (``_diffcomm_wraps``): that one is looked through. Costs a lookup when
    nothing is replaced; imports nothing."""
    apply = attrs["apply"]
    if type(apply) is classmethod:
        return False
    return type(getattr(apply, "_diffcomm_wraps", apply)) is not classmethod


#: spmd_types' process-wide patches, each an (install, remove) pair of functions of a module
_ST_PATCHES = (
    ("spmd_types._checker", "_install_autograd_apply_patch", "_remove_autograd_apply_patch"),
    ("spmd_types._vmap", "install", "uninstall"),
    ("spmd_types._backward_hooks", "install", "uninstall"),
)
_COUNTED = "_diffcomm_counted"


def count_spmd_types_patches() -> None:
    """Make spmd_types' checker safe for the ranks of an in-process world (threads of one
    process, which hand over inside a collective). ``typecheck()`` installs process-wide
    patches (``Function.apply``, vmap, module backward hooks) when a thread enters it and
    removes them when that thread leaves; its own FIXME says two threads inside at once
    need a lock and a count. Without them the second rank to enter saved the first's
    ``Function.apply`` patch as "the original" and wrapped it again (each Function typed
    twice on that rank: a correct program passed on rank 0 and was refused on rank 1), and
    the first to leave removed the vmap and hook patches under the other. Here each pair
    is counted: installed by the first thread to enter, removed by the last to leave (each
    patch already reads its own thread's checking state). Applied once, when spmd_types'
    checker is imported in a process that runs an in-process world (the pairs of the other
    modules when a check first starts: spmd_types is fully imported by then). Patches
    nothing of an spmd_types without these functions."""
    checker = sys.modules.get(_ST_PATCHES[0][0])
    if checker is None or getattr(checker, _COUNTED, False):
        return
    setattr(checker, _COUNTED, True)
    lock = threading.RLock()
    later = list(_ST_PATCHES[1:])

    def count(module: Any, install: str, remove: str) -> None:
        on, off = getattr(module, install, None), getattr(module, remove, None)
        if not (callable(on) and callable(off)):
            return
        inside = [0]

        def counted_install() -> None:
            with lock:
                while later:  # (the other modules: imported once a check starts)
                    name, i, r = later.pop(0)
                    count(importlib.import_module(name), i, r)
                inside[0] += 1
                if inside[0] == 1:
                    on()

        def counted_remove() -> None:
            with lock:
                inside[0] = max(inside[0] - 1, 0)
                if inside[0] == 0:
                    off()

        setattr(module, install, counted_install)
        setattr(module, remove, counted_remove)

    count(checker, _ST_PATCHES[0][1], _ST_PATCHES[0][2])


def spmd_types_paused() -> Any:
    """spmd_types' ``no_typecheck()`` block, for diffcomm's own metadata exchanges outside
    any Function (a receive's shape header): not typed data. Call it under
    :func:`spmd_types_checking` only."""
    return _st().no_typecheck()


_NULL = contextlib.nullcontext()


def spmd_types_untyped(attrs: Mapping[str, Any]) -> Any:
    """:func:`spmd_types_paused` while spmd_types' checker is active (``attrs``: see
    :func:`spmd_types_checking`), else a null block: around diffcomm's exchanges of host
    integers (sizes, debug mode's codes and fingerprints), no program data. Typed, the
    checker refused their raw collectives on in-process ranks ("tensor has no type for
    axis") where real processes ran."""
    return spmd_types_paused() if spmd_types_checking(attrs) else _NULL


def spmd_types_like(out: Any, src: Any) -> Any:
    """``out`` (a fresh tensor: zeros a result is accumulated into) with ``src``'s
    spmd_types type while spmd_types checks (its factories make untyped tensors); ``out``
    as it is otherwise. Call it under :func:`spmd_types_checking` only."""
    st = _st()
    if st.has_local_type(src) and not st.get_local_type(out):
        st.assert_type(out, dict(st.get_local_type(src)))
    return out


def spmd_types_varying(x: Any, group: Any) -> Any:
    """``x`` typed ``V`` over ``group`` for spmd_types (a value made from this rank's
    number, e.g. the indices of its own heads). Call it under :func:`spmd_types_checking`
    only."""
    import torch.distributed as dist

    st = _st()
    st.assert_type(x, {group if group is not None else dist.group.WORLD: st.V})
    return x


def spmd_types_invariant(x: Any, group: Any) -> Any:
    """``x`` typed ``I`` over ``group`` for spmd_types (a value made from data every rank
    holds alike, e.g. exchanged counts, with no gradient). Call it under
    :func:`spmd_types_checking` only."""
    import torch.distributed as dist

    st = _st()
    st.assert_type(x, {group if group is not None else dist.group.WORLD: st.I})
    return x


def annotate_params_for_spmd_types(root: Any) -> None:
    """Give every parameter of the module tree ``root`` its spmd_types type, over its
    layer's group, from the layer's own facts (``_shard_dims`` / its :class:`LayerRule`):
    sharded parameters (and those the rule names) ``V``; the rest replicated: ``I``, or
    ``R`` where the rule says their gradient is partial (``replicated_grad``). A parameter
    already typed on that axis (by the user, or earlier) keeps its type. Called by the
    layers' forward pre-hooks while spmd_types checks (never imports it otherwise)."""
    import torch.distributed as dist

    st, normalize_axis = _st(), _st("types").normalize_axis

    for _, m in reversed(list(root.named_modules())):  # the innermost layer decides
        rule = getattr(type(m), "spmd", None)
        if not isinstance(rule, LayerRule) and not hasattr(m, "_shard_dims"):
            continue
        group = rule.group(m) if isinstance(rule, LayerRule) else getattr(m, "_pg", None)
        axis = normalize_axis(group if group is not None else dist.group.WORLD)
        if axis.size() == 1:
            continue
        declared = rule.params(m) if isinstance(rule, LayerRule) and rule.params is not None else {}
        dims = getattr(m, "_shard_dims", None) or {}
        kind = rule.replicated_grad if isinstance(rule, LayerRule) else REPLICATED
        for pname, p in m.named_parameters():
            if axis in st.get_local_type(p):
                continue
            if declared.get(pname) is V or dims.get(pname) is not None:
                t = st.V
            else:
                t = st.I if kind == REPLICATED else st.R
            st.assert_type(p, {axis: t})
