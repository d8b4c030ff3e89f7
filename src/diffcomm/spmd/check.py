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
"""

from __future__ import annotations

# Size: ~1050 lines, over the ~600 guideline: the torch-op name tables are in ``_ops``, the
# records and cells in ``_records``, what a check installs (and the user Functions' rules)
# in ``_install``; what is left is the check itself (the plain-op rules, the typed ops, the
# objective and the gradients), whose parts share its state, plus the public helpers and
# the generated docs table. Issue 48's <= 700 lines is not reached yet.
import importlib
import itertools
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from .. import _replication as T_
from .. import _torch
from .._replication import PARTIAL, REPLICATED, LayerRule, P, R, Rule, SPMDTypeError, T, V
from ..backend import args as A
from ._install import (  # what a check installs; the active checks
    _ACTIVE,
    _CHECKED_GROUP,
    _LOCK,
    _PATCHED,  # noqa: F401  (read by the tests)
    _install,
    _op_name,
    _outer_typedness_for_tests,  # noqa: F401  (read by the tests)
    _uninstall,
    register_function,
    typed_functions,
    typed_layers,
)
from ._ops import (  # the torch-op name tables and argument classifiers
    _ADDITIVE,
    _DROPOUT,
    _LINEAR_CHAIN,
    _MASKING,
    _NO_TYPING,
    _RANDOM,
    _SCALING,
    _STRUCTURAL,
    _SUMMING,
    _WEIGHTED,
    _differentiable,
    _flat_tensors,
    _is_weight,
    _is_zero,
    _random_type,
    _rank_dependent,
)
from ._records import _EPOCH, _TENSOR_BASE, _Cell, _conflict, _Escape, _fname, _Rec, _site

__all__ = [
    "SPMDCheck",
    "spmd_check",
    "varying",
    "replicated",
    "partial",
    "module",
    "type_of",
    "typing_table",
    "register_function",
]


_COUNTER = itertools.count()


# ======================================================================================
# the check
# ======================================================================================


class SPMDCheck(TorchFunctionMode):
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
    ) -> None:
        super().__init__()
        self.group = group
        self.pg: Any = None
        self.key = f"_dc_spmd{next(_COUNTER)}"
        self._declared = (list(varying), list(partial))
        self._modules = [modules] if isinstance(modules, torch.nn.Module) else list(modules)
        self._check_grads = check_grads
        self._params: dict[int, tuple[Any, str, _Rec]] = {}  # id(param) -> (param, name, rec)
        #: leaf inputs (not parameters) that require grad: their gradient is checked when
        #: a backward of a replicated objective finishes
        self._inputs: dict[int, tuple[Tensor, _Rec]] = {}
        self._typed_modules: set[int] = set()
        #: id(param) -> (dotted name from the layer that holds it, the fix of a partial
        #: gradient that layer offers: its sync_replicated_grads())
        self._owners: dict[int, tuple[str, str | None]] = {}
        self._groups: dict[int, bool] = {}  # id(pg) -> is the checked group
        self.inside = 0  # >0 while a typed op's forward runs (its inner ops are not typed)
        self.in_backward = 0
        self.thread = threading.get_ident()

    # ---------------------------------------------------------------- enter / exit

    def __enter__(self) -> SPMDCheck:
        self.pg = A.resolve_group(self.group, "spmd_check")
        self.thread = threading.get_ident()
        importlib.import_module("diffcomm.parallel")  # every rule-bearing class is defined
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
        if isinstance(exc, _Escape):
            self._params.clear()
            raise exc.error from None
        try:
            if exc_type is None and self._check_grads:
                self.check_grads()
        finally:
            self._params.clear()
            self._inputs.clear()

    # ---------------------------------------------------------------- records

    def rec(self, x: Tensor) -> _Rec:
        """``x``'s record; an untyped tensor is replicated (a parameter is registered)."""
        r = x.__dict__.get(self.key)
        if r is None and _torch.transforms_active():  # a torch.func wrapper: its base's type
            base = _torch.functorch_unwrapped(x)
            if base is not x:
                r = base.__dict__.get(self.key)
        if r is None and x._base is not None:  # a view made outside the mode (a forward-AD dual)
            r = x._base.__dict__.get(self.key)
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

    def _from_spmd_types(self, x: Tensor) -> _Rec | None:
        """``x``'s record from its spmd_types annotation over the checked group, if any."""
        from . import spmd_types_interop as SI

        t = SI.annotated(x, self._world_pg())
        if t is None:
            return None
        ours, kind, shard = SI.to_dc(t)
        why = f"annotated {SI.name_of(t)} with spmd_types.assert_type"
        grad = x.requires_grad
        r = _Rec(ours, _Cell(kind, f"it is {why}") if ours is R and grad else None, shard=shard, why=why)
        x.__dict__[self.key] = r
        if isinstance(x, torch.nn.Parameter):
            self._register_param(x, f"a parameter of shape {tuple(x.shape)}", r)
        elif r.cell is not None and x.grad_fn is None:
            self._inputs[id(x)] = (x, r)
        return r

    def annotated(self, x: Tensor) -> None:
        """``spmd_types.assert_type(x, ...)`` ran: a leaf takes the annotated type (a
        declaration); a computed value is checked against it (I / R fix its gradient kind)."""
        from . import spmd_types_interop as SI

        r = x.__dict__.get(self.key)
        if r is None or x.grad_fn is None:
            x.__dict__.pop(self.key, None)
            self._from_spmd_types(x)
            return
        theirs = SI.annotated(x, self._world_pg())
        if theirs is None:
            return
        t, kind, _ = SI.to_dc(theirs)
        if t is R and r.t is R:
            if r.cell is not None and kind is not None:
                self._demand(r.cell, kind, "spmd_types.assert_type", f"it is annotated {SI.name_of(theirs)}")
        elif t is not r.t and not (t is V and r.t is P):  # V: spmd_types' local view of a partial
            origin = f" ({r.why})" if r.why else ""
            raise SPMDTypeError(
                f"diffcomm.spmd_check: spmd_types.assert_type at {_site()}: the value is "
                f"{r.t.value}{origin}, annotated {SI.name_of(theirs)} ({t.value})."
            )

    def spmd_types_function(self, cls: type, bound: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        """A user Function typed from its spmd_types rule (``spmd_typecheck``): the rule runs
        on stand-ins of the inputs' types over the checked group; its forward untyped."""
        from . import spmd_types_interop as SI

        site = _site()
        tensors = [a for a in args if isinstance(a, Tensor)]
        recs = [self.rec(t) for t in tensors]
        kinds = [r.cell.root().kind if r.cell is not None else None for r in recs]
        options = [SI.candidates(r.t, k, r.shard) for r, k in zip(recs, kinds)]
        try:
            chosen, out_types = SI.hook_types(cls, tuple(args), self._world_pg(), options)
        except Exception as e:  # spmd_types' SpmdTypeError: the rule refuses these types
            found = ", ".join(f"{r.t.value}" for r in recs)
            raise SPMDTypeError(
                f"diffcomm.spmd_check: {cls.__qualname__} at {site}: its spmd_types rule "
                f"(spmd_typecheck) refuses its inputs ({found}): {e}"
            ) from None
        for t, r, c in zip(tensors, recs, chosen):
            ours, kind, _ = SI.to_dc(c)
            if r.t is R and r.cell is not None and t.requires_grad and kind is not None:
                self._demand(r.cell, kind, cls.__name__, f"its spmd_types rule takes it as {SI.name_of(c)}")
        self.inside += 1
        try:
            out = bound(*args, **kwargs)
        finally:
            self.inside -= 1
        grad = any(t.requires_grad for t in tensors)
        outs = [out] if isinstance(out, Tensor) else [o for o in out if isinstance(o, Tensor)]
        outs = [o.view_as(o) if any(o is t for t in tensors) else o for o in outs]
        for o, st in zip(outs, out_types):
            if st is None:
                continue
            typ, kind, shard = SI.to_dc(st)
            why = f"the output of {cls.__name__} at {site} (its spmd_types rule: {SI.name_of(st)})"
            cell = _Cell(kind, why) if typ is R and grad else None
            o.__dict__[self.key] = _Rec(typ, cell, shard=shard, why=why)
        if isinstance(out, Tensor):
            return outs[0]
        it = iter(outs)
        return type(out)(next(it) if isinstance(o, Tensor) else o for o in out)

    def _spmd_types_op(self, SI: Any, func: Any, args: Any, kwargs: Any) -> Any:
        """An spmd_types collective or conversion, typed by its ``src`` / ``dst``."""
        x, axis, src, dst = SI.bind(func, args, kwargs)
        name = f"spmd_types.{func.__name__}(src={SI.name_of(src)}, dst={SI.name_of(dst)})"
        if not isinstance(x, Tensor) or src is None or dst is None:
            return func(*args, **kwargs)
        r = self.rec(x)
        ours = self._is_group(SI.group_of(axis))
        site = _site()
        if ours:
            want, kind, _ = SI.to_dc(src)
            if not (r.t is want or (want is P and r.t is V)):
                origin = f" ({r.why})" if r.why else ""
                hint = f": {T_.TWICE}" if want is not R and r.t is R else ""
                raise SPMDTypeError(
                    f"diffcomm.spmd_check: {name} at {site}: argument `x` is {r.t.value}{origin}, "
                    f"expected {want.value} (src={SI.name_of(src)}){hint}."
                )
            summing = func.__name__ in ("all_reduce", "reduce_scatter")
            self._check_summed(name, "x", r, summing, False, site)
            if r.t is R and r.cell is not None and x.requires_grad and kind is not None:
                self._demand(r.cell, kind, name, f"src={SI.name_of(src)} gives `x` a {kind} gradient")
        out = func(*args, **kwargs)
        outs = _flat_tensors([out] if isinstance(out, Tensor) else out, [])
        if not ours:  # another group: the type passes through
            for o in outs:
                o.__dict__[self.key] = _Rec(r.t, r.cell if x.requires_grad else None, r.shard, r.why)
            return out
        t, kind, shard = SI.to_dc(dst)
        for o in outs:
            if t is R:
                why = f"it is the output of {name} at {site}, whose backward " + (
                    "sums its gradient over the ranks (spmd_types R: use dst=I under a replicated objective)"
                    if kind == PARTIAL
                    else "passes its gradient on unchanged (spmd_types I)"
                )
                o.__dict__[self.key] = _Rec(R, _Cell(kind, why) if x.requires_grad else None, why=why)
            else:
                o.__dict__[self.key] = _Rec(t, shard=shard, why=f"the {t.value} output of {name} at {site}")
        return out

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
        self._params[id(p)] = (p, name, r)  # held until the block ends (the grad check)

    def _type_module_params(self, module: torch.nn.Module, names: Mapping[int, str] | None = None) -> None:
        if id(module) in self._typed_modules:
            return
        self._typed_modules.add(id(module))
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
                self._owners.setdefault(id(q), (f"{owner}.{n}", sync))
        named = list(module.named_parameters(recurse=False))
        if declared:  # a rule may name parameters of submodules (dotted names)
            named += [(n, p) for n, p in module.named_parameters() if n in declared and "." in n]
        for pname, p in named:
            old = p.__dict__.get(self.key)
            if old is not None and old.param is not None and not old.auto:
                continue  # typed already by its layer (or declared)
            name = (
                (names or {}).get(id(p))
                or self._owners.get(id(p), (None, None))[0]
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
            self._register_param(p, name, r)
            p.__dict__[self.key] = r

    def _is_group(self, pg: Any) -> bool:
        if pg is self.pg:
            return True
        k = id(pg)
        hit = self._groups.get(k)
        if hit is None:
            import torch.distributed as dist

            try:
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
        return self.inside > 0 or self.in_backward > 0 or threading.get_ident() != self.thread

    # ---------------------------------------------------------------- plain torch ops

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.inside or self.in_backward:
            return func(*args, **kwargs)
        raw = getattr(func, "__name__", "")
        if raw in _NO_TYPING:
            return func(*args, **kwargs)
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
        if not outs:
            return out
        try:
            self._type_plain(func, name, args, kwargs, outs)
        except SPMDTypeError as e:
            if getattr(func, "__objclass__", None) is _TENSOR_BASE:  # maybe an operator
                raise _Escape(e) from None
            raise
        return out

    def _type_plain(self, func: Any, name: str, args: Any, kwargs: Any, outs: list[Tensor]) -> None:
        key = self.key
        ins = _flat_tensors(args, [])
        if kwargs:
            _flat_tensors(kwargs.values(), ins)
        inplace = name.endswith("_") or name == "setitem"
        if inplace and outs[0].__dict__.get(key) is not None and outs[0].__dict__[key].param is not None:
            return  # an update of a parameter (init, optimizer step) keeps its type
        if name == "copy_" and len(ins) >= 2:  # the target takes the source's type
            ins = ins[1:]
        elif name in ("zero_", "fill_"):
            ins = ins[1:]
        extra: T | None = None
        extra_why = ""
        if name in _RANDOM:
            extra = _random_type((kwargs or {}).get("generator") is None)
            extra_why = f"a random draw on a per-rank RNG stream at {_site()}"
            if not ins or name.endswith("like") or inplace:
                ins = []  # a draw: its type is the stream's, not its template's
        elif name in _DROPOUT:
            training = kwargs.get("training", args[2] if len(args) > 2 else True)
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            if training and p:
                extra = _random_type()
                extra_why = f"a dropout mask drawn on a per-rank RNG stream at {_site()}"
        if extra is None and _rank_dependent(args):
            extra = V  # an index, slice or scalar computed from the rank
            extra_why = (
                f"{name} with an index, slice or scalar computed from the rank (dc.get_rank()) at {_site()}"
            )
        if name in _MASKING:
            masked = self._masked(name, args, kwargs)
            if masked is not None:  # linear in its partial operand: the rest is zero
                for o in outs:
                    o.__dict__[key] = masked
                return
        recs = [self.rec(t) for t in ins]
        # the special products: a varying weight sharded along the contracted dim
        special_p = False
        if name in ("linear", "matmul", "mm", "bmm", "rmatmul") and len(recs) >= 2:
            a, w = (recs[1], recs[0]) if name == "rmatmul" else (recs[0], recs[1])
            wt = ins[0] if name == "rmatmul" else ins[1]
            contracted = 1 if name == "linear" else wt.dim() - 2
            if a.t is V and w.t is V and w.shard is not None and w.shard == contracted % max(wt.dim(), 1):
                special_p = True
                if name == "linear" and len(recs) > 2:
                    raise SPMDTypeError(
                        f"diffcomm.spmd_check: linear at {_site()}: argument `bias` is {recs[2].t.value}, "
                        "added to a partial sum (the weight is sharded along in_features): the bias would "
                        "be added once per rank. Add it after the reduction (reduce_from_region)."
                    )
        elif name == "embedding" and len(recs) >= 2 and recs[1].t is V and recs[1].shard == 0:
            special_p = True
        differentiable = any(_differentiable(o) for o in outs)
        if special_p:
            res = _Rec(P, why=f"{name} with a weight sharded along its contracted dim at {_site()}")
        else:
            res = self._join(name, recs, ins, extra, differentiable, extra_why)
        for o in outs:
            if o.__dict__.get(key) is not None and o.__dict__[key].param is not None:
                continue
            if res.t is R and res.cell is not None and not o.requires_grad:
                o.__dict__[key] = _Rec(R)
            else:
                o.__dict__[key] = res
                if res.cell is not None and o.grad_fn is None and not isinstance(o, torch.nn.Parameter):
                    self._inputs[id(o)] = (o, res)  # a leaf made to require grad (an input)

    def _join(
        self, name: str, recs: list[_Rec], ins: list[Tensor], extra: T | None, diff: bool, extra_why: str = ""
    ) -> _Rec:
        has_p = has_v = False
        for r in recs:
            if r.t is P:
                has_p = True
            elif r.t is V:
                has_v = True
        if extra is V:
            has_v = True
        if has_p:
            return self._partial(name, recs, ins, has_v, extra)
        if has_v:
            vwhy = next((r.why for r in recs if r.t is V), "") or extra_why
            if diff:
                for r, t in zip(recs, ins):
                    if r.t is R and r.cell is not None and t.requires_grad:
                        self._demand(r.cell, PARTIAL, name, f"it meets a varying value ({vwhy})")
                        if (
                            r.param is None
                            and name in _WEIGHTED
                            and any(_is_weight(q, w) for q, w in zip(recs, ins))
                        ):
                            r.cell.root().copy_at = f"{name} at {_site()}"
            out = _Rec(V, why=vwhy)
            if name in _LINEAR_CHAIN:  # a replicated term added to per-rank values: remembered
                out.rep = next((r.rep for r in recs if r.t is V and r.rep), None)
                # (only beside a varying tensor: a replicated tensor plus a number computed
                # from the rank, ``arange(4) + 10 * r``, is per-rank data, not a sum of parts)
                if out.rep is None and name in _ADDITIVE and any(r.t is V for r in recs):
                    if any(r.t is R and _differentiable(t) for r, t in zip(recs, ins)):
                        out.rep = f"{name} at {_site()}"
            return out
        # all replicated: one gradient kind for all that require grad
        if not diff:
            return _Rec(R)
        cell = None
        for r, t in zip(recs, ins):
            if r.cell is not None and t.requires_grad:
                cell = r.cell if cell is None else self._union(cell, r.cell, name)
        return _Rec(R, cell if cell is not None else _Cell())

    def _masked(self, name: str, args: Any, kwargs: Any) -> _Rec | None:
        """``x[mask] = 0``, ``where(mask, x, 0)``, ``masked_fill(mask, 0)`` of a partial
        ``x``: linear in ``x`` whatever the mask (a per-rank mask zeroes each rank's share
        where that rank holds nothing, as Megatron's vocab-parallel embedding does); any
        other operand must be partial too or zero. ``None``: no partial operand."""
        if name == "setitem":
            data = [args[0], args[2] if len(args) > 2 else None]
        elif name == "where":
            if len(args) + len(kwargs) < 3:
                return None
            data = [
                args[1] if len(args) > 1 else kwargs.get("input"),
                args[2] if len(args) > 2 else kwargs.get("other"),
            ]
        else:
            data = [args[0], args[2] if len(args) > 2 else kwargs.get("value")]
        recs = [self.rec(d) if isinstance(d, Tensor) else None for d in data]
        part = next((r for r in recs if r is not None and r.t is P), None)
        if part is None:
            return None
        for d, r in zip(data, recs):
            if (r is not None and r.t is P) or _is_zero(d):
                continue
            found = r.t.value if r is not None else repr(d)
            raise SPMDTypeError(
                f"diffcomm.spmd_check: {name} at {_site()}: a partial value ({part.why}) is combined with "
                f"{found}, expected zero or partial: the other value would be counted once per rank. "
                "Reduce the partial value first (parallel.reduce_from_region), or mask with zero."
            )
        return _Rec(P, why=part.why)

    def _partial(self, name: str, recs: list[_Rec], ins: list[Tensor], has_v: bool, extra: T | None) -> _Rec:
        p_rec = next(r for r in recs if r.t is P)
        origin = p_rec.why
        fix = "reduce it first (parallel.reduce_from_region, or dc.all_reduce under the sum convention)"
        if has_v:
            bad = next((i for i, r in enumerate(recs) if r.t is V), None)
            what = "a varying value" if bad is not None else "a per-rank random mask"
            raise SPMDTypeError(
                f"diffcomm.spmd_check: {name} at {_site()}: a partial value (its true value is the "
                f"sum over ranks; {origin}) meets {what}: the result is not a partial sum of "
                f"anything (found partial and varying, expected partial with replicated). Fix: {fix}."
            )
        n_p = sum(r.t is P for r in recs)
        floats = [(r, t) for r, t in zip(recs, ins) if _differentiable(t)]
        if name in _STRUCTURAL:
            ok = True
        elif name in _ADDITIVE:
            ok = all(r.t is P for r, _ in floats)
            if not ok:
                raise SPMDTypeError(
                    f"diffcomm.spmd_check: {name} at {_site()}: argument is replicated, added to a "
                    f"partial value ({origin}): it would be added once per rank (found partial + "
                    f"replicated, expected partial + partial). Fix: {fix}, or add it after the reduction."
                )
        elif name in _SCALING:
            ok = n_p == 1 and not (name in ("div", "div_", "truediv", "true_divide") and recs[0].t is not P)
            if ok:
                for r, t in floats:
                    if r.t is R and r.cell is not None and t.requires_grad:
                        self._demand(r.cell, PARTIAL, name, "it scales a partial value")
        else:
            ok = False
        if not ok:
            raise SPMDTypeError(
                f"diffcomm.spmd_check: {name} at {_site()}: argument is partial ({origin}), "
                f"expected replicated or varying: {name} is not linear in it, so applying it to "
                f"each rank's share is not applying it to the sum. Fix: {fix}."
            )
        return _Rec(P, why=origin)

    def _demand(self, cell: _Cell, kind: str, op: str, why: str) -> None:
        root = cell.root()
        if root.epoch != _EPOCH[0]:  # its graph was backpropagated already: a fresh start
            root.kind, root.epoch = None, _EPOCH[0]
        if root.kind is None:
            root.kind = kind
            root.why = f"{why} in {op} at {_site()}"
        elif root.kind != kind:
            raise _conflict(op, _site(), kind, root, why)

    def _union(self, a: _Cell, b: _Cell, op: str) -> _Cell:
        ra, rb = a.root(), b.root()
        if ra is rb:
            return ra
        for r in (ra, rb):
            if r.epoch != _EPOCH[0]:  # its graph was backpropagated already: a fresh start
                r.kind, r.epoch = None, _EPOCH[0]
        if ra.kind is not None and rb.kind is not None and ra.kind != rb.kind:
            rep, par = (ra, rb) if ra.kind == REPLICATED else (rb, ra)
            raise SPMDTypeError(
                f"diffcomm.spmd_check: {op} at {_site()}: combines two replicated values whose "
                f"gradients must be of different kinds: one partial ({par.why}), one replicated "
                f"({rep.why}). A sum-convention op and a replicated-objective mapping meet here: "
                "use the diffcomm.parallel mapping in place of the sum-convention op (or the reverse)."
            )
        if rb.kind is None:
            rb.parent = ra
            return ra
        ra.parent = rb
        return rb

    # ---------------------------------------------------------------- typed ops

    def op_before(
        self, cls: type, rule: Rule, bound: Mapping[str, Any], tensors: list[tuple[str, Tensor]]
    ) -> Any:
        """Check ``rule`` on the inputs; return the plan for typing the outputs."""
        name = _op_name(cls)
        group = rule.group(bound) if callable(rule.group) else bound.get(rule.group)
        recs = [(arg, t, self.rec(t)) for arg, t in tensors]
        if group is not _CHECKED_GROUP and not self._is_group(group):
            return ("other", recs, any(t.requires_grad for _, t in tensors))
        if rule.nonlinear is not None and bound.get("op") in ("max", "min", "product"):
            rule = rule.nonlinear
        site = _site()
        outs: list[T] = []
        rop = bound.get("op", "sum")
        summing = name in _SUMMING and rop == "sum"
        avg = name in _SUMMING and rop == "avg"
        shares: list[_Cell | None] = []
        for arg, t, r in recs:
            shares.append(None)
            if avg and r.t is R:  # the mean of equal values: an identity (gradient averaged)
                if r.cell is not None and t.requires_grad:
                    self._demand(r.cell, REPLICATED, name, f"the backward of {name}(op='avg') averages it")
                    shares[-1] = r.cell
                outs.append(R)
                continue
            self._check_summed(name, arg, r, summing, avg, site)
            out = rule.maps.get(r.t)
            if out is None:
                expected = " or ".join(x.value for x in rule.maps)
                why = rule.refuse.get(r.t, "")
                origin = f" (it is {r.why})" if r.why else ""
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
        return ("ours", name, rule, outs, site, grad, shares, avg)

    def _check_summed(self, name: str, arg: str, r: _Rec, summing: bool, avg: bool, site: str) -> None:
        """The reductions' extra rules: a gradient that holds an already reduced part
        (accumulated onto), a replicated-objective gradient averaged, a replicated term
        inside a per-rank value summed."""
        if summing and r.t is P and r.acc:
            raise SPMDTypeError(
                f"diffcomm.spmd_check: {name} at {site}: argument `{arg}` is a partial gradient that "
                f"already holds a reduced gradient ({r.acc}; this backward accumulated onto it): "
                "summing it over the ranks again multiplies the reduced part by the world size "
                "(W*G1 + G2 instead of G1 + G2). Reduce the gradients once, after the last "
                "micro-batch's backward (or use op='avg' on every micro-batch)."
            )
        if avg and r.t is P and r.strict:
            raise SPMDTypeError(
                f"diffcomm.spmd_check: {name}(op='avg') at {site}: argument `{arg}` is partial "
                f"({r.why}) under {r.strict}: its sum over the ranks is the gradient, the average "
                "is world-size times too small. Use op='sum' (each rank holds its share of one "
                "objective, not its own objective)."
            )
        if summing and r.t is V and r.rep:
            raise SPMDTypeError(
                f"diffcomm.spmd_check: {name} at {site}: argument `{arg}` is varying but holds a "
                f"replicated term (added at {r.rep}): summing over the ranks counts that term "
                "world-size times. Sum only the per-rank terms over the group and add the "
                "replicated ones after (e.g. a clipping norm: all-reduce the squares of the "
                "sharded gradients only)."
            )

    def op_after(self, plan: Any, outputs: list[Tensor]) -> None:
        key = self.key
        if plan[0] == "other":  # an op on another group: types pass through (per element)
            recs, grad = plan[1], plan[2]
            for i, o in enumerate(outputs):
                src = recs[min(i, len(recs) - 1)][2] if recs else _Rec(R)
                o.__dict__[key] = _Rec(src.t, src.cell if grad else None, why=src.why)
            return
        _, name, rule, outs, site, grad, shares, avg = plan
        types = list(rule.outputs) if rule.outputs is not None else outs
        for i, o in enumerate(outputs):
            t = types[min(i, len(types) - 1)] if types else R
            if t is None:
                continue
            share = shares[min(i, len(shares) - 1)] if shares and rule.outputs is None else None
            if t is R and share is not None:
                o.__dict__[key] = _Rec(R, share, why=f"the output of {name} at {site}")
            elif t is R:
                kind = rule.out_grad
                why = f"it is the output of {name} at {site}, whose backward " + (
                    "sums its gradient over the ranks (the sum convention)"
                    if kind == PARTIAL
                    else "passes its gradient on unchanged (the replicated objective)"
                )
                if kind == PARTIAL and rule.instead:
                    why += f"; under a replicated objective use {rule.instead}"
                cell = _Cell(kind, why, mean=avg and kind == PARTIAL) if grad else None
                o.__dict__[key] = _Rec(R, cell, why=f"the output of {name} at {site}")
            else:
                o.__dict__[key] = _Rec(t, why=f"the {t.value} output of {name} at {site}")

    # ---------------------------------------------------------------- layers

    def module_pre(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        self._type_module_params(module)
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

    # ---------------------------------------------------------------- backward and gradients

    def _backward(self, func: Any, args: Any, kwargs: Any) -> Any:
        roots = args[0] if args else kwargs.get("tensors", kwargs.get("outputs"))
        roots = [roots] if isinstance(roots, Tensor) else list(roots or ())
        objective: str | None = None
        for root in roots:
            if isinstance(root, Tensor):
                objective = self._check_objective(root) if objective is None else objective
        if objective is not None and objective.startswith("a replicated"):
            self._check_inputs()
        key = self.key
        before = {}  # each parameter's gradient before this backward (accumulated onto)
        for p, _, _r in self._params.values():
            g = p.grad
            if g is not None and key in g.__dict__ and bool(g.detach().any()):
                before[id(p)] = g.__dict__[key]
        self.in_backward += 1
        try:
            out = func(*args, **kwargs)
        finally:
            self.in_backward -= 1
        if not (kwargs.get("retain_graph") or kwargs.get("create_graph")):
            _EPOCH[0] += 1
        strict = objective if objective is not None and not objective.startswith("a varying") else None
        self._type_grads(before, strict)
        if func is torch.autograd.grad and isinstance(out, tuple):
            inputs = args[1] if len(args) > 1 else kwargs.get("inputs")
            inputs = [inputs] if isinstance(inputs, Tensor) else list(inputs or ())
            for x, g in zip(inputs, out):
                if isinstance(g, Tensor) and isinstance(x, Tensor):
                    g.__dict__[self.key] = self._grad_rec(self.rec(x), strict)
        for _p, _, r in self._params.values():  # the next forward is a new graph
            if r.cell is not None:
                r.cell = _Cell()
        self._inputs.clear()
        return out

    def _check_objective(self, loss: Tensor) -> str:
        """Check the loss; return the objective in words: replicated (counted once), partial
        (the sum of the per-rank shares), varying (the sum, or by convention the mean, of
        the per-rank losses)."""
        r = self.rec(loss)
        if r.t is P:  # a linear function of partial values: the sum of the shares is the loss
            return f"a partial loss (the objective is the sum of the ranks' shares; {r.why})"
        if r.t is V:
            return "a varying loss (each rank's own objective)"
        if r.cell is not None:
            root = r.cell.root()
            if root.epoch != _EPOCH[0]:
                root.kind, root.epoch = None, _EPOCH[0]
            if root.kind == PARTIAL and root.mean:
                return "a varying loss (the mean of the per-rank losses, all_reduce(op='avg'))"
            if root.kind == PARTIAL:
                raise SPMDTypeError(
                    f"diffcomm.spmd_check: backward at {_site()}: the loss is replicated, so this "
                    f"objective is replicated (counted once), but its gradient would be summed over "
                    f"the ranks: {root.why}. The gradients would be world-size times too large."
                )
            if root.kind is None:
                root.kind = REPLICATED
                root.why = f"the replicated loss at {_site()} (a replicated objective)"
        return f"a replicated loss (a replicated objective, the loss at {_site()})"

    def _check_inputs(self) -> None:
        """Before the backward of a replicated objective: no replicated input that requires
        grad may get a partial gradient (each rank would hold only its share, and nothing
        sums it: a copy_to_region is missing where it met a varying weight)."""
        for x, _ in self._inputs.values():
            r = x.__dict__.get(self.key)
            if r is None or r.t is not R or r.cell is None or not x.requires_grad:
                continue
            root = r.cell.root()
            if root.epoch != _EPOCH[0] or root.kind != PARTIAL or root.copy_at is None:
                continue
            raise SPMDTypeError(
                f"diffcomm.spmd_check: backward at {_site()}: a replicated input of shape "
                f"{tuple(x.shape)} that requires grad would get a partial gradient ({root.why}): under "
                "this replicated objective each rank would hold only its share of its gradient, "
                f"different on every rank. Fix: insert parallel.copy_to_region before the "
                f"{root.copy_at} (its backward sums the input's gradient over the ranks)."
            )

    def _grad_rec(self, r: _Rec, strict: str | None = None) -> _Rec:
        if r.t is V:
            return _Rec(V, why="a gradient of a varying value")
        if r.t is P:
            return _Rec(R)
        root = r.cell.root() if r.cell is not None else None
        if root is not None and root.kind == PARTIAL:
            g = _Rec(P, why=f"the gradient of a replicated value; {root.why}")
            g.strict = strict
            g.copy_at = root.copy_at
            return g
        return _Rec(R)

    def _type_grads(self, before: Mapping[int, _Rec], strict: str | None) -> None:
        key = self.key
        for p, _, r in list(self._params.values()):
            if p.grad is None:
                continue
            g = p.grad
            old = before.get(id(p))
            new = self._grad_rec(r, strict)
            if old is not None and old.t is P and new.t is R:
                g.__dict__[key] = old
                continue  # accumulated onto a partial gradient: still partial
            if old is not None and new.t is P:
                if old.t is R:
                    new.acc = old.why or "a replicated gradient of an earlier backward"
                elif old.t is P:
                    new.acc = new.acc or old.acc
                    new.strict = new.strict or old.strict
            g.__dict__[key] = new

    def check_grads(self, params: Iterable[Tensor] | None = None) -> None:
        """Raise :class:`SPMDTypeError` for the first replicated parameter (of ``params``;
        default: every parameter the check typed) whose gradient is partial (each rank
        holds its share: a reduction over the group is missing) or varying (changed by a
        per-rank value after backward). Runs on leaving the block and before every
        optimizer step inside it."""
        key = self.key
        only = None if params is None else {id(p) for p in params}
        for p, name, r in self._params.values():
            if only is not None and id(p) not in only:
                continue
            if p.grad is None or p.__dict__.get(key, r).t is not R:
                continue
            g = p.grad.__dict__.get(key)
            if g is not None and g.t is V:
                raise SPMDTypeError(
                    f"diffcomm.spmd_check: parameter {name} is replicated, but its gradient varies by "
                    f"rank ({g.why or 'changed by a per-rank value after backward'}): the replicas "
                    "would drift apart. A per-rank factor (e.g. a gradient-clipping norm of sharded "
                    "gradients computed without an all_reduce) must be made replicated first."
                )
            if g is not None and g.t is P:
                sync = self._owners.get(id(p), (None, None))[1]
                if sync is not None:
                    fix = sync
                elif g.copy_at is not None:
                    fix = (
                        f"insert parallel.copy_to_region before the {g.copy_at} (its backward sums "
                        "the gradient of everything upstream, inputs included)"
                    )
                else:
                    fix = (
                        "sum its gradient over the group: a sequence-parallel LayerNorm is "
                        "parallel.SequenceParallelLayerNorm; otherwise p.grad = dc.all_reduce(p.grad) "
                        "after backward"
                    )
                raise SPMDTypeError(
                    f"diffcomm.spmd_check: parameter {name} is replicated, but its gradient is "
                    f"partial ({g.why}): every rank holds only its share (missing reduction). Fix: {fix}."
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
        modules: models whose parameters are typed (and named) at the entry; layers met in
            the block are typed when they run.
        check_grads: on leaving the block, check that every replicated parameter's
            gradient is replicated (:meth:`SPMDCheck.check_grads`).

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
    return SPMDCheck(group, varying=varying, partial=partial, modules=modules, check_grads=check_grads)


def _current() -> SPMDCheck:
    if not _ACTIVE:
        raise RuntimeError("diffcomm.spmd: no active spmd_check block (use `with dc.spmd_check(group): ...`)")
    return _ACTIVE[-1]


def varying(x: Tensor) -> Tensor:
    """Declare ``x`` per-rank (varying) in the innermost active check; returns ``x``.
    Outside a check a no-op (annotated code runs unchanged with the check off)."""
    return _ACTIVE[-1].declare(x, V) if _ACTIVE else x


def replicated(x: Tensor) -> Tensor:
    """Declare ``x`` equal on every rank (replicated); returns ``x`` (a no-op outside a check)."""
    return _ACTIVE[-1].declare(x, R) if _ACTIVE else x


def partial(x: Tensor) -> Tensor:
    """Declare ``x`` partial (its true value is the sum over ranks); returns ``x`` (a no-op
    outside a check)."""
    return _ACTIVE[-1].declare(x, P) if _ACTIVE else x


def module(m: torch.nn.Module) -> torch.nn.Module:
    """Type the parameters of ``m`` (and its submodules, named from ``m``) in the innermost
    active check now, as if it had run (for code that uses a layer's parameters
    functionally); returns ``m`` (a no-op outside a check)."""
    if not _ACTIVE:
        return m
    check = _ACTIVE[-1]
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
