"""Megatron-style region mappings: the conjugate pairs of the replicated objective.

The core collectives (:mod:`diffcomm.ops.collectives`) differentiate the **sum of the
per-rank objectives**. Tensor-parallel code is written under another convention, the
**replicated objective**: one loss ``L``, computed identically on every rank, and every
tensor that is *replicated* (the same on every rank) stands for **one** variable, not
``world`` copies. Under the sum convention that loss is counted ``world`` times — the
classic "gradient 2x too large at TP=2". The mappings below state, in their names, which
region transition the model makes, and carry the backward that is right for ``L``. Each
mapping's class states its conjugate and its rules (the table in ``docs/parallel.md`` and
``docs/convention.md`` is generated from them: :func:`diffcomm.ops.registry.markdown` of
the ``"mapping"`` family); which of its sides is replicated (``replicated``) is read off
its typing rule, and the second class of a pair takes its rules in words from the first.

Why these backwards. A replicated input ``X`` consumed *differently* on each rank (each
rank multiplies it by its own weight shard) contributes ``sum_r dL/dy_r``: the all_reduce
of ``copy_to_region``. A sum ``y = sum_r x_r`` that every rank then consumes *identically*
arrives with the same gradient ``dL/dy`` on every rank, and ``dL/dx_r = dL/dy``: the
identity of ``reduce_from_region``. The sequence-parallel pair and the all_to_all have no
replicated side at all, so they coincide with the core ops' adjoints; they are named here
so that model code reads as the region transitions it makes.

Debug mode (``diffcomm.debug(True)`` or ``DIFFCOMM_DEBUG=1``, set the same on every rank)
checks the assumption each mapping rests on, with one small all_gather of a fingerprint:

* a **copy forward** (``copy_to_region``, ``scatter_to_region``, ``scatter_to_sequence``)
  checks that its input is equal on every rank;
* an **identity backward** (``reduce_from_region``, ``gather_from_region``,
  ``gather_from_sequence``) checks that the incoming gradient is equal on every rank;
* every mapping checks that the shapes, and whether its input records the op for backward
  (``torch.is_grad_enabled() and x.requires_grad``), agree across ranks.

A mismatch raises :class:`~diffcomm.CrossRankMismatchError` naming the ranks that differ,
so a wrong choice of mapping is an error, not a silent 2x. (The opposite assumptions —
"the gradient of a copy is a *partial* one on each rank" — cannot be checked: partial
gradients may legitimately be equal.)

Every mapping is a :class:`~diffcomm.ops.base.CommOp` (the base of every communication op):
it states its forward (a core collective's raw ``run``, or a local view), its transpose
and its dims, and the base writes ``forward`` / ``setup_context`` / ``backward`` / ``jvp``
/ ``vmap``, the cheap eager ``apply`` and the ``torch.compile`` twin. Its transpose **is
its conjugate mapping** (copy <-> reduce, scatter <-> gather, the sequence pair,
all_to_all with dims swapped), applied as a differentiable mapping again — so double
backward is right under the replicated objective too (a gradient penalty through
``copy_to_region`` is not ``world`` times too large, as it would be with the core
all_reduce as backward), and ``torch.func.grad``/``vjp``/``jvp``/``vmap`` and ``jacrev``
work. The public function validates its arguments (and runs its debug check) once; the
Function then calls the raw backend directly. Defining the classes registers them as the
``"mapping"`` family of :mod:`diffcomm.ops.registry` (:data:`MAPPINGS` is its view).
Shards are even: the split dimension must divide by the group size (a ``ValueError``
naming the argument otherwise, before any communication).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch import Tensor

from .. import _config
from .. import backend as B
from .._replication import PARTIAL, REPLICATED, TWICE, P, R, Rule, V
from ..backend import args as A
from ..backend.args import PG
from ..ops import collectives
from ..ops.all_to_all import raw_all_to_all
from ..ops.base import CommOp, apply, call
from ..ops.precision_format import Precision, quantized
from ..ops.registry import SELF, FamilyView, Kwargs
from ..ops.validation import rank_index, records_grad
from ._check import COPY_HINT, IDENTITY_HINT, check_replicated
from ._coalesced import copy_to_region_coalesced, reduce_from_region_coalesced

#: The ``"mapping"`` family's ops, in the registry's order (the command line reads this
#: first list as data, without importing torch: :mod:`diffcomm.tools.op_names`)
__all__: list[str] = [
    "copy_to_region",
    "reduce_from_region",
    "scatter_to_region",
    "gather_from_region",
    "scatter_to_sequence",
    "gather_from_sequence",
    "reduce_scatter_to_sequence",
    "all_gather_from_sequence",
    "all_to_all_region",
]
#: the coalesced forms (ops of no registry family) and the table
__all__ += ["copy_to_region_coalesced", "reduce_from_region_coalesced", "MAPPINGS"]

# Size: ~850 lines, over the ~600 guideline on purpose: nine mappings, each one block (its
# CommOp class with the facts the registry reads that are its own: conjugate, reference,
# rule, dims; the shared ones in ``_Mapping``) and one public function whose docstring
# (Args / Returns / Gradient / Example, half the file) documents the convention it rests
# on. Split by pair, the blocks would scatter a table whose point is to be read side by
# side.


def _b() -> B.Backend:
    return B.get_backend()


def _debug() -> bool:
    return bool(_config.DEBUG.get())


def _check_shape(name: str, x: Tensor, pg: PG, **fields: Any) -> None:
    """Debug mode: the shapes and dtypes agree across ranks, whether ``x`` records the op
    for backward (``records_grad``: a rank whose ``x`` requires grad on some ranks only
    runs a backward, a communication in debug mode, the others skip: a desync at the
    timeout before), and ``fields``: the mapping's dims (ranks splitting or gathering a
    square tensor along different dims move the same bytes: a silently wrong value) and
    the quantized mapping's ``precision`` (a rank without it passes none, and the check
    names it)."""
    _b().check_consistent(
        f"parallel.{name}", {"shape": tuple(x.shape), "dtype": x.dtype, "grad": records_grad(x), **fields}, pg
    )


def _check_copied(name: str, x: Tensor, pg: PG, **fields: Any) -> None:
    """Debug mode, a copy forward's input (copy_to_region, scatter_to_region /
    _sequence): ``fields`` agree across ranks (the mapping's ``dim``; the quantized
    mapping's ``precision``, none on the plain path, so a rank passing ``precision=`` where
    another does not meets this check and it names ``precision``, not the transport's
    "aborted" on a fingerprint of another size), and whether ``x`` records the op for
    backward (see :func:`_check_shape`), then ``x`` is replicated."""
    _check_replica(name, x, pg, {"grad": records_grad(x), **fields})


def _check_replica(name: str, x: Tensor, pg: PG, fields: dict[str, Any]) -> None:
    """:func:`_check_copied` with the ``fields`` to compare as given."""
    _b().check_consistent(f"parallel.{name}", fields, pg)
    check_replicated(x, f"parallel.{name}", "the input", COPY_HINT, pg)


def _check_identity_backward(name: str, instead: str, g: Tensor, pg: PG, debug: bool) -> None:
    """Debug mode (at the call or now): the gradient reaching an identity backward is
    replicated."""
    if debug or _debug():
        hint = IDENTITY_HINT.format(name=name, instead=instead)
        check_replicated(g, f"parallel.{name} backward", "the incoming gradient", hint, pg)


def _prepare(name: str, x: Any, group: A.GroupLike) -> tuple[Tensor, PG]:
    """The one validation of a mapping's call: a differentiable tensor and the group."""
    x = A.check_tensor(x, f"parallel.{name}", "x")
    A.check_grad_dtype(x, f"parallel.{name}", "x")
    return x, A.resolve_group(group, f"parallel.{name}")


def _even_dim(name: str, x: Tensor, dim: Any, world: int, arg: str = "dim") -> int:
    """Normalised ``dim``; ValueError when the group size does not divide it."""
    dim = A.check_dim(x, dim, f"parallel.{name}", arg)
    if x.shape[dim] % world != 0:
        raise A.arg_error(
            f"parallel.{name}",
            "x",
            f"of a size along {arg}={dim} divisible by the group size {world} (shards are even; "
            "pad the dimension to a multiple of the group size)",
            f"shape {tuple(x.shape)}",
        )
    return dim


# ======================================================================================
# The mappings' Functions, on the CommOp base (diffcomm.ops.base): each states its forward
# (``run``: a core op's raw ``run``, or a local view), its transpose (the conjugate
# mapping, applied through ``call`` so it is differentiable again) and its dims; the base
# writes forward / setup_context / backward / jvp / vmap and the compile twin. Every
# argument after ``x`` is a plain value resolved once by the public function.
# ======================================================================================


class _Mapping(CommOp):
    """What the mappings share (not an op itself: it defines no ``transpose``).

    A subclass that defines ``transpose`` is a mapping: it is registered in the
    ``"mapping"`` family. Its ``replicated`` sides are read off its rule: a side is
    replicated when the rule gives that side's gradient whole on every rank
    (``in_grad`` / ``out_grad`` ``REPLICATED``). The class of a conjugate pair defined
    second names the first (``dual``) and gets the rules in words from it, swapped (the
    adjoint's forward is the backward). A mapping's dual takes the same ``dim``
    (all_to_all_region, which swaps its two dims, says so itself), with scale 1; its
    standard test case is a ``(3, 3)`` input whose ``dim`` holds two rows per rank when
    the mapping splits that dim (``splits``), two rows when it concatenates along it, and
    a ``(3, 4)`` input when the mapping takes no dim.
    """

    #: the ``dim`` of a call that names none (the public function's default); ``None``:
    #: the mapping takes no dim
    default_dim: ClassVar[int | None] = None
    #: the mapping splits ``dim`` into ``world`` even chunks (its size must divide)
    splits: ClassVar[bool] = False
    spmd: ClassVar[Rule]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        if "transpose" in cls.__dict__:  # a mapping (set before the base registers it)
            cls.family = "mapping"
            cls.replicated = (cls.spmd.in_grad == REPLICATED, cls.spmd.out_grad == REPLICATED)
            partner = cls.__dict__.get("dual")
            if isinstance(partner, type) and issubclass(partner, CommOp):
                cls.forward_text, cls.backward_text = partner.backward_text, partner.forward_text
        super().__init_subclass__(**kwargs)

    @classmethod
    def dual_args(cls, kw: Kwargs, world: int) -> tuple[Kwargs, float]:
        return ({} if cls.default_dim is None else {"dim": kw.get("dim", cls.default_dim)}), 1.0

    @classmethod
    def cases(cls, world: int) -> Iterator[Kwargs]:
        if cls.default_dim is None:
            yield {"shape": (3, 4)}
            return
        shape = [3, 3]
        shape[cls.default_dim] = 2 * world if cls.splits else 2
        yield {"shape": tuple(shape), "kwargs": {"dim": cls.default_dim}}


class _CopyToRegion(_Mapping):
    """Identity forward; transpose: reduce_from_region (all_reduce of the gradient)."""

    name = "parallel.copy_to_region"
    elementwise = True
    forward_text = "identity"
    backward_text = "all_reduce(sum)"
    spmd = Rule(
        {R: R},
        out_grad=PARTIAL,
        in_grad=REPLICATED,
        refuse={
            V: "a varying value needs no copy into the region (its backward would sum the "
            "gradients of different values)",
            P: "reduce it first (reduce_from_region)",
        },
    )

    @staticmethod
    def run(x: Tensor, pg: PG, debug: bool) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def transpose(g: Tensor, pg: PG, debug: bool) -> Tensor:
        # the conjugate mapping (not the core all_reduce): double backward stays right
        # under the replicated objective, and checks the replicated grad-of-grad
        return call(_ReduceFromRegion, g, pg, debug)

    @staticmethod
    def reference(xs: list[Tensor], kws: list[Kwargs]) -> list[Tensor]:
        return [xs[0].clone() for _ in xs]


class _ReduceFromRegion(_Mapping):
    """all_reduce(sum) forward; transpose: copy_to_region (identity, checked replicated)."""

    name = "parallel.reduce_from_region"
    dual = _CopyToRegion
    elementwise = True
    spmd = Rule(
        {V: R, P: R},
        out_grad=REPLICATED,
        refuse={R: TWICE},
    )

    @staticmethod
    def run(x: Tensor, pg: PG, debug: bool) -> Tensor:
        return collectives.raw_all_reduce(x, "sum", pg)

    @staticmethod
    def transpose(g: Tensor, pg: PG, debug: bool) -> Tensor:
        _check_identity_backward("reduce_from_region", "diffcomm.all_reduce", g, pg, debug)
        return call(_CopyToRegion, g, pg, False)

    @staticmethod
    def reference(xs: list[Tensor], kws: list[Kwargs]) -> list[Tensor]:
        return [torch.stack(xs).sum(0) for _ in xs]


class _ScatterToRegion(_Mapping):
    """Keep chunk ``rank`` along ``dim``; transpose: gather_from_region."""

    name = "parallel.scatter_to_region"
    default_dim = -1
    splits = True
    dims = (0,)
    forward_text = "keep own chunk"
    backward_text = "all_gather"
    spmd = Rule({R: V}, in_grad=REPLICATED, refuse={V: "already a shard", P: "reduce it first"})

    @staticmethod
    def run(x: Tensor, dim: int, pg: PG, rank: int, world: int, debug: bool) -> Tensor:
        n = x.shape[dim] // world  # a copy: rank 0's chunk along dim 0 would be a view of x
        return x.narrow(dim, rank * n, n).clone(memory_format=torch.contiguous_format)

    @staticmethod
    def transpose(g: Tensor, dim: int, pg: PG, rank: int, world: int, debug: bool) -> Tensor:
        return call(_GatherFromRegion, g, dim, pg, rank, world, debug)

    @classmethod
    def reference(cls, xs: list[Tensor], kws: list[Kwargs]) -> list[Tensor]:
        return [xs[0].chunk(len(xs), kws[0].get("dim", cls.default_dim))[r].clone() for r in range(len(xs))]


class _GatherFromRegion(_Mapping):
    """all_gather (even chunks) forward; transpose: scatter_to_region (checked replicated)."""

    name = "parallel.gather_from_region"
    dual = _ScatterToRegion
    default_dim = -1
    dims = (0,)
    spmd = Rule(
        {V: R},
        out_grad=REPLICATED,
        refuse={R: "already whole on every rank", P: "reduce it first"},
    )

    @staticmethod
    def run(x: Tensor, dim: int, pg: PG, rank: int, world: int, debug: bool) -> Tensor:
        return collectives.raw_all_gather(x, dim, pg, (x.shape[dim],) * world)

    @staticmethod
    def transpose(g: Tensor, dim: int, pg: PG, rank: int, world: int, debug: bool) -> Tensor:
        _check_identity_backward("gather_from_region", "diffcomm.all_gather", g, pg, debug)
        return call(_ScatterToRegion, g, dim, pg, rank, world, False)

    @classmethod
    def reference(cls, xs: list[Tensor], kws: list[Kwargs]) -> list[Tensor]:
        return [torch.cat(xs, kws[0].get("dim", cls.default_dim)) for _ in xs]


# The sequence pair is the region pair along the sequence dim (Megatron's ``[s, b, h]``:
# dim 0): the same forward and reference, named for the transition the model makes. Each
# class restates ``run`` (the base derives the rules from the class's own ``run``) and
# states its own ``transpose`` (it names its own conjugate).


class _ScatterToSequence(_ScatterToRegion):
    """scatter_to_region along the sequence dim; transpose: gather_from_sequence."""

    name = "parallel.scatter_to_sequence"
    default_dim = 0
    spmd = Rule(
        {R: V},
        in_grad=REPLICATED,
        refuse={V: "already a sequence shard", P: "reduce it first"},
    )
    run = staticmethod(_ScatterToRegion.run)

    @staticmethod
    def transpose(g: Tensor, dim: int, pg: PG, rank: int, world: int, debug: bool) -> Tensor:
        return call(_GatherFromSequence, g, dim, pg, rank, world, debug)


class _GatherFromSequence(_GatherFromRegion):
    """gather_from_region along the sequence dim; transpose: scatter_to_sequence (checked
    replicated)."""

    name = "parallel.gather_from_sequence"
    dual = _ScatterToSequence
    default_dim = 0
    spmd = _GatherFromRegion.spmd
    run = staticmethod(_GatherFromRegion.run)

    @staticmethod
    def transpose(g: Tensor, dim: int, pg: PG, rank: int, world: int, debug: bool) -> Tensor:
        _check_identity_backward("gather_from_sequence", "parallel.all_gather_from_sequence", g, pg, debug)
        return call(_ScatterToSequence, g, dim, pg, rank, world, False)


class _ReduceScatterToSequence(_Mapping):
    """reduce_scatter(sum) (even chunks); transpose: all_gather_from_sequence."""

    name = "parallel.reduce_scatter_to_sequence"
    default_dim = 0
    splits = True
    dims = (0,)
    forward_text = "reduce_scatter(sum)"
    backward_text = "all_gather"
    spmd = Rule({V: V, P: V}, refuse={R: TWICE})

    @staticmethod
    def run(x: Tensor, dim: int, pg: PG, world: int) -> Tensor:
        return collectives.raw_reduce_scatter(x, dim, "sum", pg, (x.shape[dim] // world,) * world)

    @staticmethod
    def transpose(g: Tensor, dim: int, pg: PG, world: int) -> Tensor:
        return call(_AllGatherFromSequence, g, dim, pg, world)

    @staticmethod
    def reference(xs: list[Tensor], kws: list[Kwargs]) -> list[Tensor]:
        return list(torch.stack(xs).sum(0).chunk(len(xs), kws[0].get("dim", 0)))


class _AllGatherFromSequence(_Mapping):
    """all_gather (even chunks) along the sequence dim; transpose: the core adjoint,
    reduce_scatter_to_sequence (no side is replicated)."""

    name = "parallel.all_gather_from_sequence"
    dual = _ReduceScatterToSequence
    default_dim = 0
    dims = (0,)
    spmd = Rule(
        {V: R},
        out_grad=PARTIAL,
        instead="parallel.gather_from_sequence",
        refuse={
            R: "already whole on every rank (a sequence shard is varying)",
            P: "reduce_scatter it instead",
        },
    )

    @staticmethod
    def run(x: Tensor, dim: int, pg: PG, world: int) -> Tensor:
        return collectives.raw_all_gather(x, dim, pg, (x.shape[dim],) * world)

    @staticmethod
    def transpose(g: Tensor, dim: int, pg: PG, world: int) -> Tensor:
        return call(_ReduceScatterToSequence, g, dim, pg, world)

    @staticmethod
    def reference(xs: list[Tensor], kws: list[Kwargs]) -> list[Tensor]:
        return [torch.cat(xs, kws[0].get("dim", 0)) for _ in xs]


def region_a2a_sizes(x: Tensor, split_dim: int, concat_dim: int, world: int) -> tuple[tuple[int, ...], ...]:
    """``all_to_all_region``'s input and output split sizes (even chunks; also its
    quantized form's, :mod:`diffcomm.parallel.precision`)."""
    ins = (x.shape[split_dim] // world,) * world
    return ins, ins if split_dim == concat_dim else (x.shape[concat_dim],) * world


class _AllToAllRegion(_Mapping):
    """all_to_all (even chunks); transpose: itself with the dims swapped."""

    name = "parallel.all_to_all_region"
    dual = SELF
    dims = (0, 1)
    forward_text = "all_to_all"
    backward_text = "all_to_all, dims swapped"
    spmd = Rule(
        {V: V},
        refuse={R: "split a replicated value with scatter_to_region first", P: "reduce it first"},
    )

    @staticmethod
    def run(x: Tensor, split_dim: int, concat_dim: int, pg: PG, world: int) -> Tensor:
        ins, outs = region_a2a_sizes(x, split_dim, concat_dim, world)
        return raw_all_to_all(x, split_dim, concat_dim, pg, ins, outs)

    @staticmethod
    def transpose(g: Tensor, split_dim: int, concat_dim: int, pg: PG, world: int) -> Tensor:
        return call(_AllToAllRegion, g, concat_dim, split_dim, pg, world)

    @staticmethod
    def reference(xs: list[Tensor], kws: list[Kwargs]) -> list[Tensor]:
        n, s, c = len(xs), kws[0]["split_dim"], kws[0]["concat_dim"]
        return [torch.cat([x.chunk(n, s)[r] for x in xs], c) for r in range(n)]

    @staticmethod
    def dual_args(kw: Kwargs, world: int) -> tuple[Kwargs, float]:
        return {"split_dim": kw["concat_dim"], "concat_dim": kw["split_dim"]}, 1.0

    @staticmethod
    def cases(world: int) -> Iterator[Kwargs]:
        yield {"shape": (2 * world, 3 * world), "kwargs": {"split_dim": 1, "concat_dim": 0}}


# ======================================================================================
# the public mappings: validate once, then one Function apply
# ======================================================================================


def _keep_own_chunk(
    op: type[_ScatterToRegion], name: str, x: Any, dim: Any, group: A.GroupLike, precision: Any
) -> Tensor:
    """The call of scatter_to_region / scatter_to_sequence (``op``, public ``name``):
    validate, check in debug mode that ``x`` is replicated, apply (with ``precision``:
    the quantized mapping, :mod:`diffcomm.parallel.precision`)."""
    if precision is not None:
        return quantized("mapping")(name, x, group, precision, dim=dim)
    x, pg = _prepare(name, x, group)
    b = _b()
    world = b.world_size(pg)
    dim = _even_dim(name, x, dim, world)
    debug = _debug()
    if debug:
        _check_copied(name, x, pg, dim=dim)
    return apply(op, x, dim, pg, rank_index(pg), world, debug)


def _gather_replicated(
    op: type[_GatherFromRegion], name: str, x: Any, dim: Any, group: A.GroupLike, precision: Any
) -> Tensor:
    """The call of gather_from_region / gather_from_sequence (``op``, public ``name``):
    validate, check the shapes in debug mode, apply (the transpose checks the gradient;
    with ``precision``: the quantized mapping, :mod:`diffcomm.parallel.precision`)."""
    if precision is not None:
        return quantized("mapping")(name, x, group, precision, dim=dim)
    x, pg = _prepare(name, x, group)
    dim = A.check_dim(x, dim, op.name)
    debug = _debug()
    if debug:
        _check_shape(name, x, pg, dim=dim)
    b = _b()
    return apply(op, x, dim, pg, rank_index(pg), b.world_size(pg), debug)


def copy_to_region(x: Tensor, group: A.GroupLike = None, *, precision: Precision | None = None) -> Tensor:
    """Enter a tensor-parallel region with a replicated tensor: identity forward.

    Convention (replicated objective): ``x`` is the same on every rank and stands for one
    variable; after this point each rank consumes it differently (e.g. with its own
    column shard of a weight), and the loss is the same on every rank.

    Args:
        x: tensor, equal on every rank.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.

    Returns:
        ``x`` itself (a view, no copy), shape ``x.shape``.

    Gradient:
        ``all_reduce(grad, "sum")``: the total derivative of the one variable ``x`` is the
        sum of what every rank's consumer contributed. Debug mode checks that ``x`` is
        equal on every rank.

    Example::

        with dc.LocalWorld(2) as world:
            def f():
                x = torch.ones(2, requires_grad=True)
                w = torch.tensor([1.0, 2.0]) * (dc.get_rank() + 1)   # rank-local shard
                (parallel.copy_to_region(x) * w).sum().backward()
                return x.grad
            world.run(f)   # [tensor([3., 6.]), tensor([3., 6.])]
    """
    if precision is not None:  # quantized: diffcomm.parallel.precision (docs/precision.md)
        return quantized("mapping")("copy_to_region", x, group, precision)
    return _copy(x, group, True)


def copy_replica_to_region(p: Tensor, group: A.GroupLike) -> Tensor:
    """:func:`copy_to_region` of a :class:`~diffcomm.parallel.ParallelModule`'s replicated
    parameter (its forward's copies): debug mode compares its ``requires_grad`` not here
    but after the module's forward, with every parameter's, by name
    (``_module._check_requires_grad``: "requires_grad of `fc2.bias` differs")."""
    return _copy(p, group, False)


def _copy(x: Any, group: A.GroupLike, grad: bool) -> Tensor:
    x, pg = _prepare("copy_to_region", x, group)
    debug = _debug()
    if debug:
        _check_replica("copy_to_region", x, pg, {"grad": records_grad(x)} if grad else {})
    return apply(_CopyToRegion, x, pg, debug)


def reduce_from_region(x: Tensor, group: A.GroupLike = None, *, precision: Precision | None = None) -> Tensor:
    """Leave a tensor-parallel region by summing the partial results: all_reduce forward.

    Convention (replicated objective): each rank holds a partial sum ``x_r`` (e.g. the
    output of its row shard of a weight); the sum is then consumed identically on every
    rank, and the loss is the same on every rank.

    Args:
        x: partial sum, same shape on every rank.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.

    Returns:
        A new tensor of ``x.shape``: ``sum_r x_r``, equal on every rank.

    Gradient:
        identity: ``dL/dx_r = dL/dy``, already the same on every rank. Debug mode checks
        that the incoming gradient is equal on every rank.

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: parallel.reduce_from_region(torch.ones(2)))
            # [tensor([2., 2.]), tensor([2., 2.])]
    """
    if precision is not None:  # quantized: diffcomm.parallel.precision (docs/precision.md)
        return quantized("mapping")("reduce_from_region", x, group, precision)
    x, pg = _prepare("reduce_from_region", x, group)
    debug = _debug()
    if debug:
        _check_shape("reduce_from_region", x, pg)
    return apply(_ReduceFromRegion, x, pg, debug)


def scatter_to_region(
    x: Tensor, dim: int = -1, group: A.GroupLike = None, *, precision: Precision | None = None
) -> Tensor:
    """Enter a tensor-parallel region by keeping this rank's chunk of a replicated tensor.

    Convention (replicated objective): ``x`` is the same on every rank; rank ``r``
    continues with chunk ``r`` along ``dim`` (e.g. the input of a RowParallelLinear that
    is not already parallel), and the loss is the same on every rank.

    Args:
        x: tensor, equal on every rank; ``x.shape[dim]`` divisible by the group size.
        dim: the dimension to split (default: the last).
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.

    Returns:
        A new tensor: ``x.shape`` with ``dim`` of size ``x.shape[dim] // world``.

    Gradient:
        ``all_gather(grad, dim)``: the gradient of the one variable ``x`` is every rank's
        chunk gradient, put together. Debug mode checks that ``x`` is equal on every rank.

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: parallel.scatter_to_region(torch.arange(4.0)))
            # [tensor([0., 1.]), tensor([2., 3.])]
    """
    return _keep_own_chunk(_ScatterToRegion, "scatter_to_region", x, dim, group, precision)


def gather_from_region(
    x: Tensor, dim: int = -1, group: A.GroupLike = None, *, precision: Precision | None = None
) -> Tensor:
    """Leave a tensor-parallel region by concatenating every rank's chunk: all_gather.

    Convention (replicated objective): rank ``r`` holds chunk ``r`` (e.g. its columns of
    a ColumnParallelLinear output); the concatenation is then consumed identically on
    every rank, and the loss is the same on every rank.

    Args:
        x: this rank's chunk; same shape on every rank.
        dim: the dimension to concatenate along (default: the last).
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.

    Returns:
        A new tensor: ``x.shape`` with ``dim`` of size ``world * x.shape[dim]``, equal on
        every rank.

    Gradient:
        keep own chunk: ``dL/dx_r`` is chunk ``r`` of ``dL/dy``, which is the same on every
        rank. Debug mode checks that the incoming gradient is equal on every rank.

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: parallel.gather_from_region(torch.tensor([1.0 * dc.get_rank()])))
            # [tensor([0., 1.]), tensor([0., 1.])]
    """
    return _gather_replicated(_GatherFromRegion, "gather_from_region", x, dim, group, precision)


def scatter_to_sequence(
    x: Tensor, dim: int = 0, group: A.GroupLike = None, *, precision: Precision | None = None
) -> Tensor:
    """Enter a sequence-parallel region by keeping this rank's sequence chunk of a
    replicated tensor (Megatron's ``scatter_to_sequence_parallel_region``).

    Convention (replicated objective): ``x`` is the same on every rank (e.g. the
    embedding output before the first sequence-parallel layer norm); rank ``r`` continues
    with sequence chunk ``r``, and the loss is the same on every rank.

    Args:
        x: tensor, equal on every rank; ``x.shape[dim]`` divisible by the group size.
        dim: the sequence dimension (default 0, Megatron's ``[s, b, h]`` layout).
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.

    Returns:
        A new tensor: ``x.shape`` with ``dim`` of size ``x.shape[dim] // world``.

    Gradient:
        ``all_gather(grad, dim)``: the gradient of the one variable ``x`` is every rank's
        chunk gradient, put together (the conjugate, :func:`gather_from_sequence`). Debug
        mode checks that ``x`` is equal on every rank.

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: parallel.scatter_to_sequence(torch.arange(4.0)))
            # [tensor([0., 1.]), tensor([2., 3.])]
    """
    return _keep_own_chunk(_ScatterToSequence, "scatter_to_sequence", x, dim, group, precision)


def gather_from_sequence(
    x: Tensor, dim: int = 0, group: A.GroupLike = None, *, precision: Precision | None = None
) -> Tensor:
    """Leave a sequence-parallel region into a replicated one: all_gather, backward keeps
    the own chunk (Megatron's ``gather_from_sequence_parallel_region`` with
    ``tensor_parallel_output_grad=False``).

    Convention (replicated objective): rank ``r`` holds sequence chunk ``r``; the full
    sequence is then consumed **identically** on every rank (e.g. the final layer norm's
    output before a replicated head), and the loss is the same on every rank. If instead
    each rank consumes it differently (its column shard of a weight), use
    :func:`all_gather_from_sequence` (reduce_scatter backward).

    Args:
        x: this rank's sequence chunk; same shape on every rank.
        dim: the sequence dimension (default 0).
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.

    Returns:
        A new tensor, the whole sequence: ``x.shape`` with ``dim`` of size
        ``world * x.shape[dim]``, equal on every rank.

    Gradient:
        keep own chunk: ``dL/dx_r`` is sequence chunk ``r`` of ``dL/dy``, which is the same
        on every rank (the conjugate, :func:`scatter_to_sequence`). Debug mode checks that the
        incoming gradient is equal on every rank.

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: parallel.gather_from_sequence(torch.tensor([1.0 * dc.get_rank()])))
            # [tensor([0., 1.]), tensor([0., 1.])]
    """
    return _gather_replicated(_GatherFromSequence, "gather_from_sequence", x, dim, group, precision)


def reduce_scatter_to_sequence(
    x: Tensor, dim: int = 0, group: A.GroupLike = None, *, precision: Precision | None = None
) -> Tensor:
    """Leave a tensor-parallel region into a sequence-parallel one: reduce_scatter.

    Convention (replicated objective): each rank holds a partial sum over the full
    sequence (e.g. a RowParallelLinear output); rank ``r`` continues with the sequence
    chunk ``r`` of the sum (dropout, residual, layer norm run on ``1/world`` of the
    tokens), and the loss is the same on every rank.

    Args:
        x: partial sum, same shape on every rank; ``x.shape[dim]`` divisible by the group
            size.
        dim: the sequence dimension (default 0, Megatron's ``[s, b, h]`` layout).
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.

    Returns:
        A new tensor: ``x.shape`` with ``dim`` of size ``x.shape[dim] // world``.

    Gradient:
        ``all_gather(grad, dim)`` — the core reduce_scatter's adjoint: no side of this
        mapping is replicated, so both conventions agree (debug mode checks shapes only).

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: parallel.reduce_scatter_to_sequence(torch.arange(4.0)))
            # [tensor([0., 2.]), tensor([4., 6.])]
    """
    if precision is not None:  # quantized: diffcomm.parallel.precision (docs/precision.md)
        return quantized("mapping")("reduce_scatter_to_sequence", x, group, precision, dim=dim)
    x, pg = _prepare("reduce_scatter_to_sequence", x, group)
    world = _b().world_size(pg)
    dim = _even_dim("reduce_scatter_to_sequence", x, dim, world)
    if _debug():
        _check_shape("reduce_scatter_to_sequence", x, pg, dim=dim)
    return apply(_ReduceScatterToSequence, x, dim, pg, world)


def all_gather_from_sequence(
    x: Tensor, dim: int = 0, group: A.GroupLike = None, *, precision: Precision | None = None
) -> Tensor:
    """Enter a tensor-parallel region from a sequence-parallel one: all_gather.

    Convention (replicated objective): rank ``r`` holds sequence chunk ``r``; the full
    sequence is then consumed *differently* on each rank (e.g. by its column shard of a
    weight), and the loss is the same on every rank.

    Args:
        x: this rank's sequence chunk; same shape on every rank.
        dim: the sequence dimension (default 0, Megatron's ``[s, b, h]`` layout).
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.

    Returns:
        A new tensor: ``x.shape`` with ``dim`` of size ``world * x.shape[dim]``.

    Gradient:
        ``reduce_scatter(grad, dim, "sum")``: every rank's consumer contributed a partial
        gradient for the whole sequence; rank ``r`` gets the sum for its chunk. This is
        the core all_gather's adjoint (debug mode checks shapes only). If instead the
        gathered sequence is consumed identically on every rank, use
        :func:`gather_from_region` (keep-own-chunk backward).

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: parallel.all_gather_from_sequence(torch.tensor([1.0 * dc.get_rank()])))
            # [tensor([0., 1.]), tensor([0., 1.])]
    """
    if precision is not None:  # quantized: diffcomm.parallel.precision (docs/precision.md)
        return quantized("mapping")("all_gather_from_sequence", x, group, precision, dim=dim)
    x, pg = _prepare("all_gather_from_sequence", x, group)
    dim = A.check_dim(x, dim, "parallel.all_gather_from_sequence")
    if _debug():
        _check_shape("all_gather_from_sequence", x, pg, dim=dim)
    return apply(_AllGatherFromSequence, x, dim, pg, _b().world_size(pg))


def all_to_all_region(
    x: Tensor,
    split_dim: int,
    concat_dim: int,
    group: A.GroupLike = None,
    *,
    precision: Precision | None = None,
) -> Tensor:
    """Re-shard between two dimensions (Ulysses: sequence-sharded <-> head-sharded).

    Rank ``r`` sends chunk ``j`` of ``x`` along ``split_dim`` to rank ``j`` and
    concatenates what it receives along ``concat_dim``. Convention: neither side is
    replicated, so it is the core all_to_all (both conventions agree).

    Args:
        x: tensor, same shape on every rank; ``x.shape[split_dim]`` divisible by the group
            size.
        split_dim: the dimension that becomes sharded (e.g. heads).
        concat_dim: the dimension that stops being sharded (e.g. sequence).
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.

    Returns:
        A new tensor. ``split_dim != concat_dim``: ``x.shape`` with ``split_dim`` divided
        and ``concat_dim`` multiplied by ``world``; equal dims: ``x.shape``.

    Gradient:
        ``all_to_all(grad, split_dim=concat_dim, concat_dim=split_dim)`` (debug mode checks
        shapes).

    Example::

        # sequence-sharded (s/2, heads) -> head-sharded (s, heads/2)
        with dc.LocalWorld(2) as world:
            world.run(lambda: parallel.all_to_all_region(torch.zeros(3, 4), 1, 0).shape)
            # [torch.Size([6, 2]), torch.Size([6, 2])]
    """
    if precision is not None:  # quantized: diffcomm.parallel.precision (docs/precision.md)
        return quantized("mapping")(
            "all_to_all_region", x, group, precision, split_dim=split_dim, concat_dim=concat_dim
        )
    x, pg = _prepare("all_to_all_region", x, group)
    A.check_one_shape(x, "parallel.all_to_all_region")  # (its sizes are read from this rank's x)
    world = _b().world_size(pg)
    split_dim = _even_dim("all_to_all_region", x, split_dim, world, "split_dim")
    concat_dim = A.check_dim(x, concat_dim, "parallel.all_to_all_region", "concat_dim")
    if _debug():
        _check_shape("all_to_all_region", x, pg, split_dim=split_dim, concat_dim=concat_dim)
    return apply(_AllToAllRegion, x, split_dim, concat_dim, pg, world)


#: mapping name -> its registry entry, read off its class: a live view of the ``"mapping"`` family (the
#: docs' table is ``registry.markdown("mapping")``). The dual of a mapping is its conjugate
#: under the replicated objective; each class states whether its input and output are
#: replicated (``replicated``), which is how :mod:`diffcomm.testing.mappings` forms the
#: inner products of its adjoint test (a replicated pair counts once, not ``world`` times).
MAPPINGS = FamilyView("mapping")
