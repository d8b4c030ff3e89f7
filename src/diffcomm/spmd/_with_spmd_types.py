"""``dc.spmd_check``'s side of spmd_types: its ``assert_type`` annotations read as
declarations, a user Function typed by its ``spmd_typecheck`` rule, its collectives and
conversions typed by their ``src`` / ``dst`` (:mod:`diffcomm.spmd.spmd_types_interop`,
imported only then). A part of :class:`diffcomm.spmd.check.SPMDCheck`."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .. import _replication as T_
from .._replication import PARTIAL, P, R, SPMDTypeError, V
from ._ops import (
    _flat_tensors,
)
from ._records import _Cell, _Rec, _site
from ._state import _CheckState


class _WithSpmdTypes(_CheckState):
    """spmd_types' annotations, rules and collectives (a part of the check)."""

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
        # replicated inputs whose gradient kind is not fixed were tried as R first; a rule
        # that reads them as I the same way (R -> R, I -> I: a local op) fixes no kind: its
        # outputs share their gradient kind, as a plain op's do (taking R would make a
        # replicated loss after it an error, and a sum-convention loss after it pass)
        free = [i for i, (r, k) in enumerate(zip(recs, kinds)) if r.t is R and k is None]
        follow = SI.kind_preserving(cls, tuple(args), self._world_pg(), chosen, out_types, free)
        tied: _Cell | None = None
        if follow is not None:
            for i in free:
                if recs[i].cell is not None and tensors[i].requires_grad:
                    cell = recs[i].cell
                    assert cell is not None
                    tied = cell.root() if tied is None else self._union(tied, cell, cls.__name__)
        for i, (t, r, c) in enumerate(zip(tensors, recs, chosen)):
            ours, kind, _ = SI.to_dc(c)
            if follow is not None and i in free:
                continue
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
        for j, (o, st) in enumerate(zip(outs, out_types)):
            if st is None:
                continue
            typ, kind, shard = SI.to_dc(st)
            why = f"the output of {cls.__name__} at {site} (its spmd_types rule: {SI.name_of(st)})"
            cell = _Cell(kind, why) if typ is R and grad else None
            if follow is not None and j in follow and grad:  # R or I, as its inputs
                cell = tied if tied is not None else _Cell(None, why)
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
            self._check_summed(name, "x", r, SI.sums(func, src, dst), False, site)
            if r.t is R and r.cell is not None and x.requires_grad and kind is not None:
                self._demand(r.cell, kind, name, f"src={SI.name_of(src)} gives `x` a {kind} gradient")
        out = func(*args, **kwargs)
        outs = _flat_tensors([out] if isinstance(out, Tensor) else out, [])
        if not ours:  # another group: the type passes through
            for o in outs:
                o.__dict__[self.key] = _Rec(r.t, r.cell if x.requires_grad else None, r.shard, r.why)
                o.__dict__[self.key].reduced = r.reduced
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
                # the ranks' values combined (as diffcomm's own ops' replicated outputs): a
                # later sum of it, with or without a gradient, would run the reduction twice
                combined = f"the result of {name} at {site}" if SI.combines(src) else r.reduced
                o.__dict__[self.key].reduced = combined
            else:
                o.__dict__[self.key] = _Rec(t, shard=shard, why=f"the {t.value} output of {name} at {site}")
        return out
