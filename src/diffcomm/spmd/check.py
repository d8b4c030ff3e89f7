"""``dc.spmd_check``: replication types checked while the program runs, without
communicating (see ``docs/spmd_types.md`` for the rules and the reasoning).

How it is put together — nothing of it exists while no check is active:

* a :class:`torch.overrides.TorchFunctionMode` (:class:`SPMDCheck` itself) types every
  plain torch op from its inputs' types; the types live on the tensors, in one attribute
  per check (``x.__dict__[key]``), so no data is copied or wrapped;
* the ``forward`` of every class that states a :class:`~diffcomm._replication.Rule` (the
  communication ops, the mappings, the Functions fused with their communication) is
  replaced, for the duration of the check, by one that checks the rule and types the
  outputs; the originals are put back on exit;
* one global module forward pre-hook types each layer's parameters (from the layer's
  ``_shard_dims`` / its :class:`~diffcomm._replication.LayerRule`) and checks the layer's
  input against its rule;
* ``Tensor.backward`` / ``torch.autograd.backward`` / ``torch.autograd.grad`` check the
  loss (the objective) and the replicated inputs' gradient kinds before backward starts,
  and type the parameters' gradients after (accumulation onto a reduced gradient is
  remembered); :meth:`SPMDCheck.check_grads` (run before every optimizer step, through a
  global optimizer step pre-hook, and on leaving the block) checks that every replicated
  parameter's gradient is replicated;
* ``torch.autograd.Function.apply`` is replaced by a descriptor that types a user's own
  Function by its rule (:func:`register_function`, ``spmd = Rule`` on the class, or its
  spmd_types ``spmd_typecheck``) or refuses it by name;
* spmd_types' collectives and conversions (which reach the mode through
  ``handle_torch_function``) are typed by their ``src`` / ``dst``, its ``assert_type``
  annotations read (:mod:`diffcomm.spmd.spmd_types_interop`, imported only then).

A replicated value carries a **gradient kind** (partial or replicated), shared by every
value whose gradient must be of the same kind (union-find cells): the ops that made the
value and the ops that use it fix it, and two ops that need different kinds of the same
gradient are an error at the second one (or at the loss, or at the gradient check).
Only values that require grad carry a cell: a constraint on a gradient nobody computes
is no constraint.

The modules: this one holds the public check (:class:`SPMDCheck`: entry and exit, the
records, the typed ops and layers; :func:`spmd_check` and the helpers; the docs' typing
table); :mod:`._lattice` the type lattice (the plain-op rules, the cells' constraints);
:mod:`._ops` the torch-op tables; :mod:`._install` what a check installs;
:mod:`._gradients` backward and the gradient check; :mod:`._with_spmd_types`
spmd_types' side; :mod:`._records` and :mod:`._state` what they share.
"""

from __future__ import annotations

import importlib
import itertools
import sys
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from .. import _torch
from .._replication import PARTIAL, REPLICATED, LayerRule, P, R, Rule, SPMDTypeError, T, V
from ..backend import args as A
from . import _CHECK
from ._gradients import _Gradients
from ._install import (  # what a check installs; the active checks
    _ACTIVE,
    _CHECKED_GROUP,
    _LOCK,
    _PATCHED,  # noqa: F401  (read by the tests)
    _install,
    _op_name,
    _outer_typedness_for_tests,  # noqa: F401  (read by the tests)
    _uninstall,
    register_function,  # noqa: F401  (a public name: __all__)
    typed_functions,
    typed_layers,
    untyped_under_transform,
)
from ._lattice import _Lattice
from ._ops import (  # the torch-op name tables and argument classifiers
    _ALL_REDUCES,
    _NO_TYPING,
    _SUMMING,
    _default_rng_differs,
    _flat_tensors,
    _view_shard,
)
from ._records import (
    _TENSOR_BASE,
    _Cell,
    _Escape,
    _fname,
    _op_by_user,
    _OpPlan,
    _Owner,
    _Param,
    _PassThrough,
    _Rec,
    _reflected,
    _site,
)
from ._with_spmd_types import _WithSpmdTypes

# Size: ~700 lines, over the ~600 guideline (issue 48 bounds it at 700): what is left here
# is the public check itself, one piece: the context manager and its entry/exit, the typing
# of tensors as they meet the check, and the rule of an op applied at its call (the lattice,
# the gradient kinds, the torch-op tables, installation and spmd_types live beside it).

#: this module's public names: the list the package face loads on first use (one list, there)
__all__ = list(_CHECK)


_COUNTER = itertools.count()

#: what a backward differentiates: ``"loss"``, the loss's type decides (a replicated loss
#: is a replicated objective, counted once); ``"sum"``, the contract's sum convention for
#: every loss (the sum of the per-rank losses, a replicated one included)
_OBJECTIVES = ("loss", "sum")

#: why a tensor nothing in the check made is replicated (the fix, if it is per-rank data)
_UNDECLARED = (
    " (no per-rank source: a tensor entering the block is replicated unless declared, and so "
    "is what plain ops make of replicated values; if it differs by rank (per-rank data, rows "
    "sliced with a rank taken before the check), declare it with dc.spmd.varying(x), or take "
    "the rank with dc.get_rank() inside the check)"
)


# ======================================================================================
# the check
# ======================================================================================


def _list_of(items: Any, arg: str, kind: type, what: str) -> list[Any]:
    """``items`` (an iterable of ``kind``) as a list; else a ``TypeError`` naming ``arg``."""
    try:
        out = list(items)
    except TypeError:
        out = None
    if out is None or not all(isinstance(i, kind) for i in out):
        raise TypeError(
            f"diffcomm.spmd_check: argument `{arg}` must be an iterable of {what}, got {type(items).__name__}"
        )
    return out


class SPMDCheck(_WithSpmdTypes, _Lattice, _Gradients):
    """The active replication-type check of one process group (``dc.spmd_check``).

    Use it as a ``with`` block. Inputs are replicated unless declared (``varying=`` /
    ``partial=`` here, or :func:`varying` / :func:`partial` inside the block).
    """

    def __init__(
        self,
        group: A.GroupLike = None,
        *,
        varying: Iterable[Tensor] = (),
        partial: Iterable[Tensor] = (),
        modules: Iterable[torch.nn.Module] | torch.nn.Module = (),
        check_grads: bool = True,
        objective: str = "loss",
    ) -> None:
        super().__init__()
        if objective not in _OBJECTIVES:
            raise ValueError(
                "diffcomm.spmd_check: argument `objective` must be one of "
                f"{', '.join(map(repr, _OBJECTIVES))}, got {objective!r}"
            )
        self.objective = objective
        self.group = group
        self.pg: Any = None
        self.key = f"_dc_spmd{next(_COUNTER)}"
        self._declared = (
            _list_of(varying, "varying", Tensor, "tensors"),
            _list_of(partial, "partial", Tensor, "tensors"),
        )
        modules = [modules] if isinstance(modules, torch.nn.Module) else modules
        self._modules = _list_of(modules, "modules", torch.nn.Module, "torch.nn.Module objects")
        self._check_grads = check_grads
        self._params: dict[int, _Param] = {}  # id(param) -> its entry
        #: leaf inputs (not parameters) that require grad: their gradient is checked when
        #: a backward of a replicated objective finishes
        self._inputs: dict[int, tuple[Tensor, _Rec]] = {}
        #: id(module) -> the module, held until the block ends: an id is one object's only
        #: while it lives (a freed layer's id, reused by a new layer, left that one untyped
        #: on a rank whose allocator reused it: a verdict that differed between the ranks)
        self._typed_modules: dict[int, torch.nn.Module] = {}
        #: id(param) -> (dotted name from the layer that holds it, the fix of a partial
        #: gradient that layer offers: its sync_replicated_grads())
        self._owners: dict[int, _Owner] = {}
        #: pg -> is the checked group (keyed by the object, held: no reuse of a dead one's id)
        self._groups: dict[Any, bool] = {}
        self.inside = 0  # >0 while a typed op's forward runs (its inner ops are not typed)
        self.in_backward = 0
        self.transform_warned = False  # code under torch.func met (and said untyped) in this block
        self.thread = threading.get_ident()
        #: whether the default generator's state differed between the ranks when the check
        #: was entered (unseeded processes: its draws are varying until it is seeded
        #: inside), and its initial seed then
        self._rng_entry: tuple[bool, int | None] = (False, None)
        self._replicated_losses: list[tuple[str, float]] = []
        self._aux_terms: list[tuple[_Rec, str]] = []  # add_aux_loss's, until a backward

    # ---------------------------------------------------------------- enter / exit

    def __enter__(self) -> SPMDCheck:
        self.pg = A.resolve_group(self.group, "spmd_check")
        self.thread = threading.get_ident()
        self.transform_warned = False
        importlib.import_module("diffcomm.parallel")  # every rule-bearing class is defined
        self._rng_entry = (_default_rng_differs(self.pg), torch.initial_seed())
        with _LOCK:
            if not _ACTIVE:
                _install()
            _ACTIVE.append(self)
        super().__enter__()
        for m in self._modules:
            names = {id(p): n for n, p in m.named_parameters()}
            for mod in m.modules():
                self._type_module_params(mod, names)
        vs, ps = self._declared
        for x in vs:
            self.declare(x, V)
        for x in ps:
            self.declare(x, P)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        super().__exit__(exc_type, exc, tb)
        with _LOCK:
            if self in _ACTIVE:
                _ACTIVE.remove(self)
            if not _ACTIVE:
                _uninstall()
        self._typed_modules.clear()
        if isinstance(exc, _Escape):
            self._params.clear()
            raise exc.error from None
        try:
            if exc_type is None and self._check_grads:
                self.check_grads()
            if exc_type is None:
                self._check_replicated_losses()
        finally:
            self._params.clear()
            self._inputs.clear()
            self._owners.clear()
            self._replicated_losses.clear()

    # ---------------------------------------------------------------- records

    def rec(self, x: Tensor) -> _Rec:
        """``x``'s record; an untyped tensor is replicated (a parameter is registered)."""
        r = x.__dict__.get(self.key)
        if r is None and _torch.transforms_active():  # a torch.func wrapper: its base's type
            base = _torch.functorch_unwrapped(x)
            if base is not x:
                r = base.__dict__.get(self.key)
        if r is None and x._base is not None:  # a view made outside the mode (a forward-AD dual)
            b = x._base.__dict__.get(self.key)
            if b is not None:  # its base's type (a view of a parameter is not the parameter)
                r = x.__dict__[self.key] = _Rec(b.t, b.cell, _view_shard(b.shard, x, x._base), b.why)
                r.rep, r.reduced, r.weight = b.rep, b.reduced, b.weight
        if r is None and "_local_type" in x.__dict__:  # an spmd_types annotation (assert_type)
            r = self._from_spmd_types(x)
        if r is None:
            r = _Rec(R, _Cell() if x.requires_grad else None)
            if isinstance(x, torch.nn.Parameter):
                self._register_param(x, f"a parameter of shape {tuple(x.shape)}", r)
                r.auto = True
            elif x.requires_grad and x.grad_fn is None:
                self._inputs[id(x)] = (x, r)
            x.__dict__[self.key] = r
        return r

    def type_of(self, x: Tensor) -> T:
        return self.rec(x).t

    def _world_pg(self) -> Any:
        import torch.distributed as dist

        return self.pg if self.pg is not None else dist.group.WORLD

    def declare(self, x: Tensor, t: T, why: str = "declared") -> Tensor:
        if not isinstance(x, Tensor):
            raise TypeError(f"diffcomm.spmd: expected a tensor to declare {t.value}, got {type(x).__name__}")
        r = _Rec(t, _Cell() if (t is R and x.requires_grad) else None, why=f"{why} at {_site()}")
        x.__dict__[self.key] = r
        if r.cell is not None and x.grad_fn is None and not isinstance(x, torch.nn.Parameter):
            self._inputs[id(x)] = (x, r)
        return x

    def _register_param(self, p: Tensor, name: str, r: _Rec) -> None:
        r.param = name
        self._params[id(p)] = _Param(p, name, r)  # held until the block ends (the grad check)

    def _type_module_params(self, module: torch.nn.Module, names: Mapping[int, str] | None = None) -> None:
        if id(module) in self._typed_modules:
            return
        self._typed_modules[id(module)] = module
        rule = getattr(type(module), "spmd", None)
        ours = self._is_group(getattr(module, "_pg", None)) if hasattr(module, "_pg") else False
        dims = getattr(module, "_shard_dims", None) if ours else None
        declared = (
            rule.params(module) if isinstance(rule, LayerRule) and rule.params is not None and ours else {}
        )
        if isinstance(rule, LayerRule) and ours and callable(getattr(module, "sync_replicated_grads", None)):
            # a layer that sums its replicated parameters' gradients itself (the
            # expert-parallel MoE's router): name its submodules' parameters from it, and
            # a partial gradient's fix is that call
            owner = type(module).__name__
            sync = (
                f"call {owner}.sync_replicated_grads() after backward (it sums the replicated "
                "parameters' gradients over the group)"
            )
            for n, q in module.named_parameters():
                self._owners.setdefault(id(q), _Owner(f"{owner}.{n}", sync, q))
        named = list(module.named_parameters(recurse=False))
        if declared:  # a rule may name parameters of submodules (dotted names)
            named += [(n, p) for n, p in module.named_parameters() if n in declared and "." in n]
        for pname, p in named:
            old = p.__dict__.get(self.key)
            if old is not None and old.param is not None and not old.auto:
                continue  # typed already by its layer (or declared)
            name = (
                (names or {}).get(id(p))
                or getattr(self._owners.get(id(p)), "name", None)
                or f"{type(module).__name__}.{pname}"
            )
            if pname not in declared and "_local_type" in p.__dict__:
                # annotated with spmd_types.assert_type (its type over the checked group)
                spmd_rec = self._from_spmd_types(p)
                if spmd_rec is not None:
                    self._register_param(p, name, spmd_rec)
                    continue
            if pname in declared:
                t, shard = declared[pname], None
            elif dims is not None and dims.get(pname) is not None:
                t, shard = V, dims[pname] % p.dim() if p.dim() else None
            else:
                t, shard = R, None
            r = _Rec(t, _Cell() if t is R else None, shard=shard, why=f"the {t.value} parameter {name}")
            r.drift = old.drift if old is not None and t is R else None  # updated with per-rank data
            self._register_param(p, name, r)
            p.__dict__[self.key] = r

    def _is_group(self, pg: Any) -> bool:
        if pg is self.pg:
            return True
        k = pg
        hit = self._groups.get(k)
        if hit is None:
            import torch.distributed as dist

            try:
                pg = A.resolve_group(pg, "spmd_check") if isinstance(pg, tuple) else pg  # (mesh, axis)
                mine = (
                    dist.get_process_group_ranks(self.pg)
                    if self.pg is not None
                    else list(range(dist.get_world_size()))
                )
                theirs = (
                    dist.get_process_group_ranks(pg) if pg is not None else list(range(dist.get_world_size()))
                )
                hit = mine == theirs
            except Exception:
                hit = False
            self._groups[k] = hit
        return hit

    @property
    def off(self) -> bool:
        return (
            self.inside > 0
            or self.in_backward > 0
            or threading.get_ident() != self.thread
            or _torch.transforms_active()  # torch.func: not typed (docs: Limits)
        )

    # ---------------------------------------------------------------- plain torch ops

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.inside or self.in_backward or torch.compiler.is_compiling():
            return func(*args, **kwargs)  # (traced by torch.compile: not typed, docs: Limits)
        if _torch.transforms_active():
            # under a torch.func transform the values are functorch wrappers (a parameter's
            # type is not theirs) and no Tensor.backward runs: not typed, and said so once
            # (docs: Limits)
            if not self.transform_warned and _op_by_user(sys._getframe(1)):
                untyped_under_transform(_fname(func))
            return func(*args, **kwargs)
        raw = getattr(func, "__name__", "")
        if raw in _NO_TYPING:
            out = func(*args, **kwargs)
            if getattr(getattr(func, "__self__", None), "__name__", "") == "data":
                self._data_access(raw, args, out)  # `t.data`, `t.data = other`: typed as data
            return out
        name = _fname(func)
        if name == "backward" or func is torch.autograd.backward or func is torch.autograd.grad:
            return self._backward(func, args, kwargs)
        if (getattr(func, "__module__", None) or "").startswith("spmd_types"):
            from . import spmd_types_interop as SI

            if SI.is_spmd_types_op(func):
                return self._spmd_types_op(SI, func, args, kwargs)
        out = func(*args, **kwargs)
        outs: list[Tensor] = []
        if isinstance(out, Tensor):
            outs.append(out)
        elif isinstance(out, list | tuple):
            _flat_tensors(out, outs)
        elif name.endswith("_") or name in ("setitem", "iadd", "isub", "imul", "itruediv"):
            if args and isinstance(args[0], Tensor):
                outs.append(args[0])
            elif name == "_foreach_zero_" and args:  # zero_grad(set_to_none=False), foreach
                self._zeroed(args[0])
        if not outs:
            return out
        try:
            self._type_plain(func, name, args, kwargs, outs)
        except SPMDTypeError as e:
            if getattr(func, "__objclass__", None) is _TENSOR_BASE or _reflected(func):  # maybe an operator
                raise _Escape(e) from None
            raise
        return out

    # ---------------------------------------------------------------- typed ops

    def op_before(
        self, cls: type, rule: Rule, bound: Mapping[str, Any], tensors: list[tuple[str, Tensor]]
    ) -> Any:
        """Check ``rule`` on the inputs; return the plan for typing the outputs."""
        name = _op_name(cls)
        group = rule.group(bound) if callable(rule.group) else bound.get(rule.group)
        recs = [(arg, t, self.rec(t)) for arg, t in tensors]
        if group is not _CHECKED_GROUP and not self._is_group(group):
            self._check_sent(name, recs)  # a p2p value over another group
            return _PassThrough(recs, any(t.requires_grad for _, t in tensors))
        if rule.nonlinear is not None and bound.get("op") in ("max", "min", "product"):
            rule = rule.nonlinear
        site = _site()
        outs: list[T] = []
        rop = bound.get("op", "sum")
        summing = name in _SUMMING and rop == "sum"
        avg = name in _SUMMING and rop == "avg"
        # the mean, max or min of equal values over the ranks: an identity whose backward
        # averages the gradient (every rank ties for max / min); not a reduce_scatter's,
        # whose output is this rank's chunk
        same = name in _ALL_REDUCES and rop in ("avg", "max", "min")
        shares: list[_Cell | None] = []
        for arg, t, r in recs:
            shares.append(None)
            if same and r.t is R:
                if r.cell is not None and t.requires_grad:
                    self._demand(r.cell, REPLICATED, name, f"the backward of {name}(op={rop!r}) averages it")
                    shares[-1] = r.cell
                outs.append(R)
                continue
            self._check_summed(name, arg, r, summing, avg, site)
            out = rule.maps.get(r.t)
            free = rule.no_grad if not t.requires_grad and not r.reduced else None
            if out is None and r.t is R and free is not None:
                # a sum of equal values that nothing differentiates through and that no
                # communication over the group made: arithmetic (W * x, `dc.all_reduce(
                # torch.ones(3))`); one that requires grad, or holds a reduction, a gather, a
                # broadcast or a replicated objective's gradient, is refused
                outs.append(free)
                continue
            if out is None:
                expected = " or ".join(x.value for x in rule.maps)
                why = rule.refuse.get(r.t, "")
                origin = f" (it is {r.why})" if r.why else ""
                if r.t is R and r.reduced:
                    origin = f" (it holds {r.reduced})"
                elif r.t is R and not r.why and r.param is None:
                    origin = _UNDECLARED
                raise SPMDTypeError(
                    f"diffcomm.spmd_check: {name} at {site}: argument `{arg}` is {r.t.value}{origin}, "
                    f"expected {expected}" + (f": {why}" if why else "") + "."
                )
            if r.t is R and r.cell is not None and t.requires_grad and rule.in_grad is not None:
                self._demand(
                    r.cell,
                    rule.in_grad,
                    name,
                    f"the backward of {name} gives `{arg}` a {rule.in_grad} gradient",
                )
            outs.append(out)
        grad = any(t.requires_grad for _, t in tensors)
        # the mean of per-rank values (data parallel's mean loss); the mean of partial sums
        # is the sum over W, whose gradient is summed like the sum's, not a mean objective
        mean = avg and all(r.t is not P for _, _, r in recs)
        return _OpPlan(name, rule, outs, site, grad, shares, mean)

    def op_after(self, plan: _OpPlan | _PassThrough, outputs: list[Tensor]) -> None:
        key = self.key
        if isinstance(plan, _PassThrough):  # an op on another group: types pass through
            recs, grad = plan.recs, plan.grad
            for i, o in enumerate(outputs):
                src = recs[min(i, len(recs) - 1)][2] if recs else _Rec(R)
                o.__dict__[key] = _Rec(src.t, src.cell if grad else None, why=src.why)
                o.__dict__[key].reduced = src.reduced
            return
        name, rule, outs, site = plan.name, plan.rule, plan.outs, plan.site
        grad, shares, mean = plan.grad, plan.shares, plan.mean
        types = list(rule.outputs) if rule.outputs is not None else outs
        for i, o in enumerate(outputs):
            t = types[min(i, len(types) - 1)] if types else R
            if t is None:
                continue
            share = shares[min(i, len(shares) - 1)] if shares and rule.outputs is None else None
            if t is R and share is not None:
                o.__dict__[key] = _Rec(R, share, why=f"the output of {name} at {site}")
                o.__dict__[key].reduced = f"the result of {name} at {site}"
            elif t is R:
                kind = rule.out_grad
                why = f"it is the output of {name} at {site}, whose backward " + (
                    "sums its gradient over the ranks (the sum convention)"
                    if kind == PARTIAL
                    else "passes its gradient on unchanged (the replicated objective)"
                )
                if kind == PARTIAL and rule.instead:
                    why += f"; under a replicated objective use {rule.instead}"
                cell = _Cell(kind, why, mean=mean and kind == PARTIAL) if grad else None
                o.__dict__[key] = _Rec(R, cell, why=f"the output of {name} at {site}")
                o.__dict__[key].reduced = f"the result of {name} at {site}"  # combined over the ranks
            else:
                o.__dict__[key] = _Rec(t, why=f"the {t.value} output of {name} at {site}")

    # ---------------------------------------------------------------- layers

    def module_pre(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if id(module) not in self._typed_modules:
            # the whole tree at its root's first call, as modules= does at the entry: a
            # forward may use a sub-layer's weights without calling it (F.linear(x,
            # self.fc1.weight)), which left them untyped (replicated) and the check asking
            # to drop a reduction the program needs
            for mod in module.modules():
                self._type_module_params(mod)
        rule = getattr(type(module), "spmd", None)
        if not isinstance(rule, LayerRule) or not args or not isinstance(args[0], Tensor):
            return
        if not self._is_group(rule.group(module)):
            return
        want = rule.inputs(module)
        wants = want if isinstance(want, tuple) else (want,)
        r = self.rec(args[0])
        if r.t not in wants:
            why = rule.why(module)
            hint = (
                " Declare per-rank data with dc.spmd.varying(x) (or spmd_check(varying=[x]))."
                if want is V
                else ""
            )
            origin = f" ({r.why})" if r.why else ""
            raise SPMDTypeError(
                f"diffcomm.spmd_check: {type(module).__name__} at {_site()}: argument `x` is "
                f"{r.t.value}{origin}, expected {' or '.join(w.value for w in wants)}"
                + (f": {why}" if why else "")
                + "."
                + hint
            )


# ======================================================================================
# the public entry and helpers
# ======================================================================================


def spmd_check(
    group: A.GroupLike = None,
    *,
    varying: Iterable[Tensor] = (),
    partial: Iterable[Tensor] = (),
    modules: Iterable[torch.nn.Module] | torch.nn.Module = (),
    check_grads: bool = True,
    objective: str = "loss",
) -> SPMDCheck:
    """Check replication types over ``group`` in a ``with`` block, without communicating.

    Every tensor crossing a diffcomm op, a mapping, a layer or a plain torch op gets a
    type — replicated, varying or partial — and every op's rule (``spmd`` on its class)
    is checked at the call; :class:`~diffcomm.SPMDTypeError` names the first op that
    breaks its rule, the argument, the types found and expected, and the fix.

    Args:
        group: the process group whose replication is checked (``None``: the world).
        varying: per-rank inputs (everything else entering the block is replicated).
        partial: inputs whose true value is their sum over ranks.
        modules: models whose parameters are typed (and named) at the entry; modules met
            in the block are typed, with their whole tree, when they first run.
        check_grads: on leaving the block, check that every replicated parameter's
            gradient is replicated (:meth:`SPMDCheck.check_grads`).
        objective: what a backward differentiates. ``"loss"`` (default): the loss's type
            decides: a replicated loss is a replicated objective (counted once, Megatron's
            convention), a varying one the sum of the per-rank losses. ``"sum"``: every
            objective is the sum of the per-rank objectives (the contract's sum
            convention), a replicated loss included: its gradient is each rank's own
            contribution, so the sum-convention ops (``dc.all_gather`` into
            ``(y ** 2).sum()``) pass and the replicated-objective mappings
            (``parallel.reduce_from_region``) are errors. The check cannot tell the two
            conventions apart from the program (``dc.all_gather`` into a replicated loss is
            the sum convention's demo and Megatron's 2x bug alike): say which one is meant.

    Returns:
        The check (a context manager; ``check.type_of(x)``, ``check.check_grads()``).

    Example::

        def step():
            mlp = dc.parallel.ParallelMLP(8, 16)
            with dc.spmd_check():
                mlp(torch.randn(4, 8)).pow(2).mean().backward()
        with dc.LocalWorld(2) as world:
            world.run(step)
    """
    return SPMDCheck(
        group, varying=varying, partial=partial, modules=modules, check_grads=check_grads, objective=objective
    )


def _innermost() -> SPMDCheck | None:
    """This thread's innermost active check: the checks of an in-process world's ranks
    (one thread each) are active at once, and each rank declares into its own."""
    me = threading.get_ident()
    return next((c for c in reversed(_ACTIVE) if c.thread == me), None)


def _current() -> SPMDCheck:
    check = _innermost()
    if check is None:
        raise RuntimeError("diffcomm.spmd: no active spmd_check block (use `with dc.spmd_check(group): ...`)")
    return check


def varying(x: Tensor) -> Tensor:
    """Declare ``x`` per-rank (varying) in the innermost active check; returns ``x``.
    Outside a check a no-op (annotated code runs unchanged with the check off)."""
    check = _innermost()
    return check.declare(x, V) if check is not None else x


def replicated(x: Tensor) -> Tensor:
    """Declare ``x`` equal on every rank (replicated); returns ``x`` (a no-op outside a check)."""
    check = _innermost()
    return check.declare(x, R) if check is not None else x


def partial(x: Tensor) -> Tensor:
    """Declare ``x`` partial (its true value is the sum over ranks); returns ``x`` (a no-op
    outside a check)."""
    check = _innermost()
    return check.declare(x, P) if check is not None else x


def module(m: torch.nn.Module) -> torch.nn.Module:
    """Type the parameters of ``m`` (and its submodules, named from ``m``) in the innermost
    active check now, as if it had run (for code that uses a layer's parameters
    functionally); returns ``m`` (a no-op outside a check)."""
    check = _innermost()
    if check is None:
        return m
    names = {id(p): n for n, p in m.named_parameters()}
    for mod in m.modules():
        check._type_module_params(mod, names)
    return m


def type_of(x: Tensor) -> T:
    """``x``'s type in the innermost active check."""
    return _current().type_of(x)


# ======================================================================================
# the docs' typing table (generated from the classes)
# ======================================================================================


def typing_table() -> str:
    """The typing table of every op, mapping, fused Function and layer, as Markdown,
    generated from the ``spmd`` rules on their classes."""
    rows = []
    for cls in typed_functions():
        rule: Rule = cls.__dict__["spmd"]
        if getattr(cls, "spmd_same_as", None) is not None:  # a variant typed as its plain op
            continue
        name = _op_name(cls, qualified=True)
        fwd, grad, refused = rule.describe()
        rows.append((name, fwd, rule.backward or "-", grad, refused, rule.instead or "-"))
    rows.sort(key=lambda r: (r[0].count("."), r[0]))
    lines = [
        "| op | forward (input -> output) | backward | gradient kind of a replicated input/output "
        "| refused | under a replicated objective use |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append("| " + " | ".join(x.replace("|", "\\|") for x in r) + " |")
    lines += ["", "| layer | its input must be |", "|---|---|"]
    for cls in sorted(typed_layers(), key=lambda c: c.__name__):
        layer: LayerRule = cls.__dict__["spmd"]
        lines.append(f"| `{cls.__module__.removeprefix('diffcomm.')}.{cls.__name__}` | {layer.doc} |")
    return "\n".join(lines) + "\n"
