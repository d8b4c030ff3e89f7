"""``dc.spmd_check`` reading spmd_types programs: its collectives and conversions typed by
their ``src`` / ``dst``, its ``assert_type`` annotations read as declarations.

Imported only by an active check that meets an spmd_types function or an annotated tensor
(so only when ``spmd_types`` is imported already): diffcomm never imports spmd_types
itself. The type mapping (see ``docs/spmd_types.md``):

========== ==========================================================================
spmd_types ``dc.spmd_check``
========== ==========================================================================
``I``      replicated, gradient kind replicated (invariant: the gradient is whole on
           every rank, as under Megatron's replicated objective)
``R``      replicated, gradient kind partial (each rank's gradient is its contribution)
``V``      varying
``S(i)``   varying, sharded along dim ``i`` (a weight sharded along its contracted dim
           makes a matmul partial)
``P``      partial
========== ==========================================================================
"""

from __future__ import annotations

from typing import Any, cast

from .._replication import PARTIAL, REPLICATED, P, R, T, V

#: the spmd_types functions typed by their ``src`` / ``dst`` (each reaches the check's
#: TorchFunctionMode through ``handle_torch_function``)
TYPED = frozenset(
    {
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "all_to_all",
        "redistribute",
        "convert",
        "reinterpret",
        "invariant_to_replicate",
    }
)

#: the typed functions whose ``src`` / ``dst`` are their name, not arguments:
#: ``invariant_to_replicate`` is ``convert(src=I, dst=R)`` (its backward sums the gradient)
IMPLIED = {"invariant_to_replicate": ("I", "R")}


def is_spmd_types_op(func: Any) -> bool:
    """``func`` is one of spmd_types' typed collectives or conversions."""
    return getattr(func, "__name__", "") in TYPED and (getattr(func, "__module__", "") or "").startswith(
        "spmd_types"
    )


def to_dc(t: Any) -> tuple[T, str | None, int | None]:
    """An spmd_types per-axis type -> (our type, the gradient kind of a replicated value,
    the sharded dim of a varying one)."""
    from spmd_types import types as ST

    if isinstance(t, ST.Shard):
        return V, None, t.dim
    if t is ST.I:
        return R, REPLICATED, None
    if t is ST.R:
        return R, PARTIAL, None
    if t is ST.V:
        return V, None, None
    if t is ST.P:
        return P, None, None
    raise TypeError(f"diffcomm.spmd_check: unknown spmd_types type {t!r}")


def name_of(t: Any) -> str:
    from spmd_types import types as ST

    if isinstance(t, ST.Shard):
        return f"S({t.dim})"
    return str(getattr(t, "name", t))


def bind(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    """``(x, the axis / group, src, dst)`` of an spmd_types collective call."""
    import inspect

    sig = inspect.signature(func)
    b = sig.bind_partial(*args, **kwargs)
    b.apply_defaults()
    a = b.arguments
    names = list(sig.parameters)
    implied = IMPLIED.get(func.__name__)
    if implied is not None:
        from spmd_types import types as ST

        return a[names[0]], a[names[1]], getattr(ST, implied[0]), getattr(ST, implied[1])
    return a[names[0]], a[names[1]], a.get("src"), a.get("dst")


def sums(func: Any, src: Any, dst: Any) -> bool:
    """The call sums its input over the ranks: ``all_reduce``, ``reduce_scatter``, and
    ``redistribute`` from ``P`` (which routes to them)."""
    from spmd_types import types as ST

    name = func.__name__
    if name == "redistribute":
        return src is ST.P and dst is not ST.P
    return name in ("all_reduce", "reduce_scatter")


def combines(src: Any) -> bool:
    """An ``R`` / ``I`` output made from per-rank values (``P``, ``V``, ``S(i)``): the
    ranks' values combined (a reduction or a gather), as diffcomm's communication ops'
    replicated outputs are; from ``R`` / ``I`` it is a conversion of a replicated value."""
    from spmd_types import types as ST

    return src is not ST.R and src is not ST.I


def annotated(x: Any, pg: Any) -> Any | None:
    """The spmd_types type annotated on ``x`` (``assert_type``) for the axis of ``pg``
    (``S(i)`` when a partition spec shards a dim of ``x`` over it), else ``None``."""
    if getattr(x, "_local_type", None) is None:
        return None
    from spmd_types import types as ST
    from spmd_types._type_attr import maybe_get_axis_local_type
    from spmd_types.runtime import get_partition_spec

    try:
        t = maybe_get_axis_local_type(x, pg)
    except Exception:
        return None
    if t is ST.V:
        spec = get_partition_spec(x)
        axis = ST.normalize_axis(pg)
        for dim, entry in enumerate(spec or ()):
            entries = entry if isinstance(entry, tuple) else (entry,)
            if any(e is not None and ST.normalize_axis(e) == axis for e in entries):
                return ST.Shard(dim)
    return t


def group_of(axis: Any) -> Any:
    """The process group of an spmd_types mesh axis (or the group itself)."""
    from spmd_types import _collectives as SC

    return SC._pg_for_axis(axis)


def hook_types(
    cls: type, args: tuple[Any, ...], pg: Any, inputs: list[list[Any]]
) -> tuple[list[Any], list[Any]]:
    """Run ``cls.spmd_typecheck`` (the type-level form, ``spmd_typecheck(*, x, ...)``) on
    stand-ins of the tensor arguments typed over ``pg``'s axis, trying for each argument
    the spmd_types types ``inputs[i]`` allows (a replicated value whose gradient kind is
    not fixed yet may be ``R`` or ``I``). Returns the input types it accepted and its
    output types; raises the last ``SpmdTypeError`` when it accepts none."""
    import itertools

    from spmd_types import rules as SR
    from spmd_types import types as ST
    from spmd_types._coverage import _coverage

    returns_types, names = SR.hook_shape(cls)
    if not returns_types:
        raise TypeError("only the type-level form spmd_typecheck(*, ...) is read")
    forward_args = SR.bind_forward_args(cls, args)
    axis = ST.normalize_axis(pg)
    positions = [i for i, a in enumerate(args) if hasattr(a, "ndim") and hasattr(a, "dtype")]
    last: Exception | None = None
    for choice in itertools.product(*inputs):
        stand_ins = dict(forward_args)
        by_id = {id(args[i]): c for i, c in zip(positions, choice)}
        for name, arg in forward_args.items():
            value = cast(Any, arg)
            if id(value) in by_id:
                t = by_id[id(value)]
                spec = None
                if isinstance(t, ST.Shard):
                    entries: list[Any] = [None] * value.ndim
                    entries[t.dim] = axis
                    spec = ST.PartitionSpec(*entries)
                    t = ST.V
                stand_ins[name] = SR._make(value.ndim, {axis: t}, spec)
        kwargs = SR.hook_kwargs(cls, stand_ins, names)
        try:
            with _coverage():
                result = cls.spmd_typecheck(**kwargs)  # type: ignore[attr-defined]
        except ST.SpmdTypeError as e:
            last = e
            continue
        outs = result if isinstance(result, list | tuple) else [result]
        return list(choice), [annotated_of(o, axis) for o in outs]
    assert last is not None
    raise last


def kind_preserving(
    cls: type, args: tuple[Any, ...], pg: Any, chosen: list[Any], outs: list[Any], free: list[int]
) -> list[int] | None:
    """Whether ``cls``'s rule, which accepted the replicated inputs at ``free`` (their
    gradient kind not fixed yet) as ``R``, accepts them as ``I`` too, with ``I`` outputs
    exactly where it gave ``R`` ones and the rest unchanged: a local op, whose outputs'
    gradient kind is its inputs'. Returns those outputs' positions, else ``None``."""
    from spmd_types import types as ST

    if not free or any(chosen[i] is not ST.R for i in free):
        return None
    options = [[ST.I] if i in free else [c] for i, c in enumerate(chosen)]
    try:
        _, mirrored = hook_types(cls, args, pg, options)
    except ST.SpmdTypeError:
        return None
    if len(mirrored) != len(outs):
        return None
    follow = []
    for j, (a, b) in enumerate(zip(outs, mirrored)):
        if a is ST.R and b is ST.I:
            follow.append(j)
        elif a != b:
            return None
    return follow


def annotated_of(value: Any, axis: Any) -> Any:
    """The per-axis spmd_types type of a tensor or stand-in (``S(i)`` from its spec)."""
    from spmd_types import types as ST
    from spmd_types._type_attr import get_local_type
    from spmd_types.runtime import get_partition_spec

    t = get_local_type(value).get(axis)
    if t is ST.V:
        for dim, entry in enumerate(get_partition_spec(value) or ()):
            entries = entry if isinstance(entry, tuple) else (entry,)
            if axis in entries:
                return ST.Shard(dim)
    return t


def candidates(t: T, kind: str | None, shard: int | None) -> list[Any]:
    """The spmd_types types a value of our type may be given (``R``/``I`` both while its
    gradient kind is not fixed; ``V`` also as ``P``, as a reduction reads it)."""
    from spmd_types import types as ST

    if t is V:  # or read as partial (spmd_types' V -> P reinterpret; our sums take V)
        return [ST.Shard(shard), ST.V, ST.P] if shard is not None else [ST.V, ST.P]
    if t is P:
        return [ST.P]
    if kind == REPLICATED:
        return [ST.I]
    if kind == PARTIAL:
        return [ST.R]
    return [ST.R, ST.I]
