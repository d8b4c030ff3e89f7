"""The type lattice of ``dc.spmd_check``: how a plain torch op's output is typed from its
inputs' types (replicated / varying / partial, the special products, masking, the
replicated terms), the gradient-kind cells' constraints (``_demand`` / ``_union``) and the
reductions' extra rules. A part of :class:`diffcomm.spmd.check.SPMDCheck`."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .. import rng
from .._replication import PARTIAL, REPLICATED, P, R, SPMDTypeError, T, V
from ._ops import (
    _ACCUMULATING,
    _ADDITIVE,
    _CASTS,
    _DROPOUT,
    _ELEMENTWISE,
    _LINEAR_CHAIN,
    _MASKING,
    _RANDOM,
    _SCALING,
    _STACKING,
    _STRUCTURAL,
    _TEMPLATE_2ND,
    _WEIGHT_KEEPING,
    _WEIGHTED,
    SEEDED_BY_RANK,
    _contracts_shard,
    _differentiable,
    _flat_tensors,
    _is_number,
    _is_weight,
    _is_zero,
    _keeps_weight,
    _makes_zero,
    _random_type,
    _rank_dependent,
    _weight_shard,
)
from ._records import _EPOCH, _Cell, _conflict, _Rec, _site
from ._state import _CheckState

#: in-place ops whose result does not read the old value: they make a drifted parameter
#: replicated again when what they write is replicated
_OVERWRITES = _RANDOM | {"copy_", "fill_", "zero_"}


def _truncates(ins: list[Tensor], outs: list[Tensor]) -> bool:
    """A cast of floating values to an integer or boolean dtype (not linear)."""
    src = ins[0].dtype if ins else None
    dst = outs[0].dtype if outs else None
    return bool(
        src is not None
        and dst is not None
        and src.is_floating_point
        and not dst.is_floating_point
        and not dst.is_complex
    )


class _Lattice(_CheckState):
    """The plain-op rules and the gradient-kind cells (a part of the check)."""

    def _type_plain(self, func: Any, name: str, args: Any, kwargs: Any, outs: list[Tensor]) -> None:
        key = self.key
        ins = _flat_tensors(args, [])
        if kwargs:
            _flat_tensors(kwargs.values(), ins)
        inplace = name.endswith("_") or name == "setitem"
        if inplace and isinstance(outs[0], torch.nn.Parameter):
            self.rec(outs[0])  # registered: its updates are tracked (``_param_update``)
        target = outs[0].__dict__.get(key) if inplace else None
        param_update = target is not None and target.param is not None
        if name == "copy_" and len(ins) >= 2:  # the target takes the source's type
            ins = ins[1:]
        elif name in _TEMPLATE_2ND and len(ins) >= 2:  # `other` gives a shape, not values
            ins = ins[:1]
        elif name in ("zero_", "fill_", "_foreach_zero_"):
            ins = ins[1:] if name != "_foreach_zero_" else []
        zero = _makes_zero(name, args, kwargs, ins, self.rec)  # by the op, not by the values
        for o in outs if inplace else ():
            base = o.__dict__.get(f"{key}.data")
            if base is not None and base.param is None:  # `t.data.zero_()` zeroes t (one record)
                base.zero = zero
        extra: T | None = None
        extra_why = ""
        if name in _RANDOM:
            gen = (kwargs or {}).get("generator")
            extra = _random_type(gen, *self._rng_entry)
            extra_why = f"a random draw on a per-rank RNG stream at {_site()}"
            if gen is not None:
                extra_why = f"a random draw on a torch.Generator seeded from the rank at {_site()}"
            elif extra is V and not rng.get_tracker()._active and SEEDED_BY_RANK[0] is None:
                extra_why = (
                    f"a random draw on the default generator, whose state differed between the "
                    f"ranks when the check began (not seeded alike) at {_site()}"
                )
            if not ins or name.endswith("like") or inplace:
                ins = []  # a draw: its type is the stream's, not its template's
        elif name in _DROPOUT:
            training = kwargs.get("training", args[2] if len(args) > 2 else True)
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            if training and p:
                extra = _random_type(None, *self._rng_entry)
                extra_why = f"a dropout mask drawn on a per-rank RNG stream at {_site()}"
        if extra is None and _rank_dependent(args):
            extra = V  # an index, slice or scalar computed from the rank
            extra_why = (
                f"{name} with an index, slice or scalar computed from the rank (dc.get_rank()) at {_site()}"
            )
        if param_update and target is not None:  # a parameter's update (init, optimizer step)
            # keeps its type (an init drawn in place is not per-rank evidence: the default generator's state
            # at the entry is indirect, and a replica sync may follow; docs: Limits)
            drawn = name in _RANDOM
            others = [self.rec(t) for t in ins if t is not outs[0]]
            self._param_update(name, target, others, None if drawn else extra, extra_why)
            return
        if name in _MASKING:
            masked = self._masked(name, args, kwargs)
            if masked is not None:  # linear in its partial operand: the rest is zero
                for o in outs:
                    o.__dict__[key] = masked
                return
        recs = [self.rec(t) for t in ins]
        drift = next((r.drift for r in recs if r.drift), None)
        if drift is not None and name not in _WEIGHT_KEEPING:
            raise SPMDTypeError(
                f"diffcomm.spmd_check: {name} at {_site()}: a replicated parameter was updated in "
                f"place with per-rank data ({drift}), so its replicas differ between the ranks: "
                "the program computes with a different model on every rank. Update it with "
                "replicated data (reduce or broadcast the update first), or make it equal again "
                "before using it (p.data.copy_(dc.broadcast(p.detach(), src=0)))."
            )
        if name in _CASTS and _truncates(ins, outs) and any(r.t is P for r in recs):
            raise SPMDTypeError(
                f"diffcomm.spmd_check: {name} at {_site()}: a partial value cast to "
                f"{outs[0].dtype}: each rank's share is rounded on its own, and the sum of the "
                "rounded shares is not the rounded sum. Reduce it first "
                "(parallel.reduce_from_region), or cast after the reduction."
            )
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
        elif name in ("einsum", "tensordot") and _contracts_shard(name, args, kwargs, recs, ins):
            special_p = True  # a row-parallel product written as an einsum or a tensordot
        differentiable = any(_differentiable(o) for o in outs)
        if special_p:
            res = _Rec(P, why=f"{name} with a weight sharded along its contracted dim at {_site()}")
        else:
            if name == "pad":  # its constant fill goes last, for the partial rule (zero or not)
                args = (*args, (kwargs or {}).get("value", args[3] if len(args) > 3 else None))
            elif name in ("baddbmm", "baddbmm_"):  # its term's weight (keyword-only) goes last
                args = (*args, (kwargs or {}).get("beta", 1))
            res = self._join(name, recs, ins, extra, differentiable, extra_why, args)
            if res.weight and len(outs) == 1:  # a weight's sharded dim, through a cast or a transpose
                res.shard = _weight_shard(name, args, recs, ins, outs[0])
        res.drift = drift  # a cast, copy or view of a drifted parameter: still drifted
        res.zero = zero
        for o in outs:
            if o.__dict__.get(key) is not None and o.__dict__[key].param is not None:
                continue
            if res.t is R and res.cell is not None and not o.requires_grad:
                o.__dict__[key] = _Rec(R)
                o.__dict__[key].reduced, o.__dict__[key].zero = res.reduced, zero
            else:
                o.__dict__[key] = res
                if res.cell is not None and o.grad_fn is None and not isinstance(o, torch.nn.Parameter):
                    self._inputs[id(o)] = (o, res)  # a leaf made to require grad (an input)

    def _param_update(self, name: str, target: _Rec, others: list[_Rec], extra: T | None, why: str) -> None:
        """An in-place update of a parameter keeps its type. A replicated one updated with
        per-rank data (a pruning mask, noise, an init drawn on a per-rank stream, a value
        set at a row computed from the rank) drifts: its replicas differ, and its next use
        is an error (``_type_plain``); an overwrite with replicated data (``copy_`` of a
        broadcast, a draw alike on every rank) makes it replicated again."""
        if target.t is not R:
            return
        bad = next((r for r in others if r.t is not R), None)
        if bad is not None or extra is V:
            found = f"{bad.t.value} data: {bad.why}" if bad is not None else why
            target.drift = f"{name} at {_site()}, with {found}"
        elif name in _OVERWRITES:
            target.drift = None

    def _zeroed(self, tensors: Any) -> None:
        """``_foreach_zero_(tensors)`` (``optimizer.zero_grad(set_to_none=False)``
        with ``foreach``): each tensor typed as ``t.zero_()`` types it."""
        for t in tensors if isinstance(tensors, list | tuple) else ():
            r = t.__dict__.get(self.key) if isinstance(t, Tensor) else None
            if isinstance(t, Tensor) and (r is None or r.param is None):
                t.__dict__[self.key] = _Rec(R)
                t.__dict__[self.key].zero = True
                base = t.__dict__.get(f"{self.key}.data")
                if base is not None and base.param is None:
                    base.zero = True

    def _data_access(self, op: str, args: Any, out: Any) -> None:
        """``t.data`` is ``t``'s data: the same record (a parameter's updates through it are
        the parameter's; ``p.data.norm()`` of a partial value is partial). ``t.data = other``:
        ``t`` takes ``other``'s type; a parameter keeps its own (drifted by per-rank data)."""
        key = self.key
        if args and isinstance(args[0], torch.nn.Parameter):
            self.rec(args[0])  # registered: its updates through .data are tracked
        if op == "__get__" and args and isinstance(args[0], Tensor) and isinstance(out, Tensor):
            r = args[0].__dict__.get(key)
            if r is not None:
                out.__dict__[key] = r
                out.__dict__[f"{key}.data"] = r  # t's record: in-place zeroing through it zeroes t
            return
        if op != "__set__" or len(args) < 2 or not all(isinstance(a, Tensor) for a in args[:2]):
            return
        old = args[0].__dict__.get(key)
        if old is not None and old.param is not None:
            self._param_update("copy_", old, [self.rec(args[1])], None, "")
            return
        new = args[1].__dict__.get(key)
        if new is not None:
            args[0].__dict__[key] = new
        elif old is not None:
            del args[0].__dict__[key]

    def _join(
        self,
        name: str,
        recs: list[_Rec],
        ins: list[Tensor],
        extra: T | None,
        diff: bool,
        extra_why: str = "",
        args: Any = (),
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
            return self._partial(name, recs, ins, has_v, extra, args)
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
            out.weight = _keeps_weight(name, args, recs, ins)
            if name in _LINEAR_CHAIN or name in _ELEMENTWISE:  # a replicated term: remembered
                src = next((r for r in recs if r.t is V and r.rep), None)
                if src is not None and (name in _LINEAR_CHAIN or src.rep_elem):
                    out.rep, out.rep_elem = src.rep, src.rep_elem
                # (only beside a varying tensor: a replicated tensor plus a number computed
                # from the rank, ``arange(4) + 10 * r``, is per-rank data, not a sum of parts)
                elif src is None and name in _ADDITIVE and any(r.t is V for r in recs):
                    if any(r.t is R and _differentiable(t) for r, t in zip(recs, ins)):
                        out.rep, out.rep_elem = f"{name} at {_site()}", name in _STACKING
            return out
        # all replicated: one gradient kind for all that require grad
        cell = None
        if diff:
            for r, t in zip(recs, ins):
                if r.cell is not None and t.requires_grad:
                    cell = r.cell if cell is None else self._union(cell, r.cell, name)
        out = _Rec(R, cell if cell is not None or not diff else _Cell())
        out.reduced = next((r.reduced for r in recs if r.reduced), None)  # made from a reduction
        return out

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
            if (r is not None and r.t is P) or _is_zero(d, r):
                continue
            found = r.t.value if r is not None else repr(d)
            raise SPMDTypeError(
                f"diffcomm.spmd_check: {name} at {_site()}: a partial value ({part.why}) is combined with "
                f"{found}, expected zero or partial: the other value would be counted once per rank. "
                "Reduce the partial value first (parallel.reduce_from_region), or mask with zero."
            )
        return _Rec(P, why=part.why)

    def _partial(
        self, name: str, recs: list[_Rec], ins: list[Tensor], has_v: bool, extra: T | None, args: Any = ()
    ) -> _Rec:
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
        if name == "pad" and args and args[-1] is not None and not _is_zero(args[-1]):
            raise SPMDTypeError(
                f"diffcomm.spmd_check: pad at {_site()}: a partial value ({origin}) padded with "
                f"value={args[-1]!r}: the padding would be added once per rank (zero pads nothing). "
                f"Fix: {fix}, or pad after the reduction."
            )
        if name in _STRUCTURAL:
            ok = True
        elif name in _ADDITIVE:
            # every term partial; a constant (a Python number, an integer tensor) is replicated
            # too: ``p + 1`` adds it once per rank (zero adds nothing)
            term = next((repr(a) for a in args if _is_number(a) and not _is_zero(a)), None)
            if term is None:
                term = next(
                    (r.t.value for r, t in zip(recs, ins) if r.t is not P and not _is_zero(t, r)), None
                )
            if term is not None:
                raise SPMDTypeError(
                    f"diffcomm.spmd_check: {name} at {_site()}: argument is {term}, added to a "
                    f"partial value ({origin}): it would be added once per rank (found partial + "
                    f"replicated, expected partial + partial). Fix: {fix}, or add it after the reduction."
                )
            ok = True
        elif name in _ACCUMULATING:
            # input + t1 * t2 (addcmul, baddbmm): the product is partial (one partial
            # factor) and so is the term it is added to, or that term is zero
            ok = len(recs) >= 3 and sum(r.t is P for r in recs[1:3]) == 1
            # (baddbmm's beta=0 drops the term: its values are never read)
            dropped = name in ("baddbmm", "baddbmm_") and _is_zero(args[-1])
            ok = ok and (recs[0].t is P or _is_zero(ins[0], recs[0]) or dropped)
            if not ok:
                raise SPMDTypeError(
                    f"diffcomm.spmd_check: {name} at {_site()}: it adds its first argument to a "
                    f"product; with a partial operand ({origin}) the product must be partial (one "
                    f"partial factor, the other replicated) and so must the term it is added to, or "
                    f"that term zero (found {', '.join(r.t.value for r in recs[:3])}): a replicated "
                    f"term would be added once per rank. Fix: {fix}, or add it after the reduction."
                )
            for r, t in floats:
                if r.t is R and r.cell is not None and t.requires_grad:
                    self._demand(r.cell, PARTIAL, name, "it scales a partial value")
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
        if root.epoch != _EPOCH.n:  # its graph was backpropagated already: a fresh start
            root.kind, root.epoch = None, _EPOCH.n
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
            if r.epoch != _EPOCH.n:  # its graph was backpropagated already: a fresh start
                r.kind, r.epoch = None, _EPOCH.n
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
                "sharded gradients only, as diffcomm.parallel.grad_norm does)."
            )

    def _check_sent(self, name: str, recs: list[tuple[str, Any, _Rec]]) -> None:
        """A ``send`` over another group than the checked one: the peer's ``recv`` types
        what it gets by its own (replicated) anchor, so a partial value would arrive
        replicated, its shares never summed (docs/spmd_types.md, Limits)."""
        for arg, _, r in recs if name == "send" else ():
            if r.t is P:
                raise SPMDTypeError(
                    f"diffcomm.spmd_check: send at {_site()}: argument `{arg}` is partial over the "
                    f"checked group ({r.why}), sent over another group (a pipeline stage's "
                    "output): the receiving rank cannot know it holds a share, so nothing sums "
                    "the shares. Reduce it over the checked group first "
                    "(parallel.reduce_from_region or reduce_scatter_to_sequence)."
                )
