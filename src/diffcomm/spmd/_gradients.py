"""``dc.spmd_check`` at backward: the objective (the loss's type) and the replicated
inputs' gradient kinds checked before backward starts, the parameters' gradients typed
after it (accumulation onto a reduced gradient remembered), and the gradient check run
before every optimizer step and on leaving the block. A part of
:class:`diffcomm.spmd.check.SPMDCheck`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from .._replication import PARTIAL, REPLICATED, P, R, SPMDTypeError, V
from ._ops import _replicated_values_differ
from ._records import _EPOCH, _Cell, _Rec, _site
from ._state import _CheckState

#: the hint of a replicated-objective gradient summed again (the loss was replicated only
#: because per-rank data was not seen as such)
_PER_RANK_LOSS = (
    "; if the loss differs by rank (per-rank data, rows sliced with a rank taken before the "
    "check), declare the data with dc.spmd.varying(x), or take the rank with dc.get_rank() "
    "inside the check"
)


class _Gradients(_CheckState):
    """Backward and the gradient check (a part of the check)."""

    def _backward(self, func: Any, args: Any, kwargs: Any) -> Any:
        roots = args[0] if args else kwargs.get("tensors", kwargs.get("outputs"))
        roots = [roots] if isinstance(roots, Tensor) else list(roots or ())
        objective: str | None = None
        cotangents = self._cotangents(func, args, kwargs, len(roots))
        for root, cot in zip(roots, cotangents, strict=True):
            if isinstance(root, Tensor) and objective is None:
                cot_rec = cot.__dict__.get(self.key) if isinstance(cot, Tensor) else None
                if cot_rec is not None and cot_rec.t is V:
                    # the objective is <root, cot>: a per-rank cotangent makes it per rank
                    objective = f"a varying loss (a varying gradient argument at {_site()})"
                else:
                    objective = self._check_objective(root)
        if objective is not None:
            self._check_aux_terms(objective)
        self._aux_terms.clear()
        if objective is not None and objective.startswith("a replicated"):
            self._check_inputs()
        key = self.key
        before = {}  # each parameter's gradient before this backward (accumulated onto)
        #: the gradients zeroed (``zero_grad(set_to_none=False)``): nothing is accumulated
        #: onto them, and one this backward leaves alone (the same tensor, not written since)
        #: stays zero. Decided by the ops that made them zero, never by their values: a
        #: per-rank gradient zero on one rank only made that rank alone skip the rule
        zeroed = {}
        for entry in self._params.values():
            p = entry.param
            g = p.grad
            old = g.__dict__.get(key) if g is not None else None
            if g is not None and old is not None and old.zero:
                zeroed[id(p)] = (g, g._version)
            elif old is not None:
                before[id(p)] = old
        self.in_backward += 1
        try:
            out = func(*args, **kwargs)
        finally:
            self.in_backward -= 1
        if not (kwargs.get("retain_graph") or kwargs.get("create_graph")):
            _EPOCH.n += 1
        strict = objective if objective is not None and not objective.startswith("a varying") else None
        self._type_grads(before, strict, zeroed)
        if func is torch.autograd.grad and isinstance(out, tuple):
            inputs = args[1] if len(args) > 1 else kwargs.get("inputs")
            inputs = [inputs] if isinstance(inputs, Tensor) else list(inputs or ())
            for x, g in zip(inputs, out):
                if isinstance(g, Tensor) and isinstance(x, Tensor):
                    g.__dict__[self.key] = self._grad_rec(self.rec(x), strict)
        for entry in self._params.values():  # the next forward is a new graph
            r = entry.rec
            if r.cell is not None:
                r.cell = _Cell()
        self._inputs.clear()
        return out

    @staticmethod
    def _cotangents(func: Any, args: Any, kwargs: Any, n: int) -> list[Any]:
        """The gradient arguments of a backward (``Tensor.backward(gradient)``,
        ``torch.autograd.backward(tensors, grad_tensors)``, ``torch.autograd.grad(outputs,
        inputs, grad_outputs)``), one per root (``None`` where none is given)."""
        if func is torch.autograd.grad:
            cot = args[2] if len(args) > 2 else kwargs.get("grad_outputs")
        elif func is torch.autograd.backward:
            cot = args[1] if len(args) > 1 else kwargs.get("grad_tensors")
        else:
            cot = args[1] if len(args) > 1 else kwargs.get("gradient")
        cots = [cot] if cot is None or isinstance(cot, Tensor) else list(cot)
        return (cots + [None] * n)[:n]

    def _check_objective(self, loss: Tensor) -> str:
        """Check the loss; return the objective in words: replicated (counted once), partial
        (the sum of the per-rank shares), varying (the sum, or by convention the mean, of
        the per-rank losses)."""
        r = self.rec(loss)
        if r.t is P:  # a linear function of partial values: the sum of the shares is the loss
            return f"a partial loss (the objective is the sum of the ranks' shares; {r.why})"
        if r.t is V:
            return "a varying loss (each rank's own objective)"
        if self.objective == "sum":
            return self._sum_objective(r)
        if r.cell is not None:
            root = r.cell.root()
            if root.epoch != _EPOCH.n:
                root.kind, root.epoch = None, _EPOCH.n
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
        site = _site()
        if type(loss) is Tensor:  # its value, compared between the ranks when the block ends
            self._replicated_losses.append((site, float(loss.detach().double().sum())))
        return f"a replicated loss (a replicated objective, the loss at {site})"

    def _sum_objective(self, r: _Rec) -> str:
        """A replicated loss under ``spmd_check(objective="sum")``: the objective is the sum
        of the ranks' copies (the contract's sum convention), so the loss's gradient is each
        rank's own contribution (partial); a value whose backward passes its gradient on
        unchanged (a replicated-objective mapping) is an error."""
        if r.cell is not None:
            root = r.cell.root()
            if root.epoch != _EPOCH.n:
                root.kind, root.epoch = None, _EPOCH.n
            if root.kind == REPLICATED:
                raise SPMDTypeError(
                    f"diffcomm.spmd_check: backward at {_site()}: under objective='sum' the loss is "
                    f"the sum of the ranks' copies, so its gradient must be summed over the ranks, "
                    f"but it would not be: {root.why}. The gradients would be world-size times too "
                    "small: use the sum-convention op (dc.all_reduce / dc.all_gather), or leave "
                    "objective='sum' out for a replicated objective."
                )
            if root.kind is None:
                root.kind = PARTIAL
                root.why = f"the loss at {_site()} under objective='sum' (the sum of the per-rank losses)"
        return f"a varying loss (objective='sum': the sum of the per-rank losses, the loss at {_site()})"

    def _check_aux_terms(self, objective: str) -> None:
        """Each auxiliary loss attached with ``pipeline.add_aux_loss`` is a term of this
        backward's objective, typed as a loss added to it: a replicated (or partial)
        objective needs a replicated term's gradient passed on unchanged, a varying one (the
        sum of the per-rank objectives) needs it partial. A varying or partial term is a sum of the
        ranks' terms, whatever the objective (an ``ExpertParallelMoE``'s aux loss is this
        rank's share). Before, the term was typed as no objective at all: an aux made
        through ``dc.all_reduce`` in a replicated objective passed, with gradients
        world-size times too large."""
        varying = objective.startswith("a varying")
        for r, site in self._aux_terms:
            what = f"the auxiliary loss attached at {site} (pipeline.add_aux_loss) is a term of {objective}"
            if r.t is not R or r.cell is None:
                continue
            root = r.cell.root()
            if root.epoch != _EPOCH.n:
                root.kind, root.epoch = None, _EPOCH.n
            want = PARTIAL if varying else REPLICATED
            if root.kind is not None and root.kind != want and not root.mean:
                raise SPMDTypeError(
                    f"diffcomm.spmd_check: backward at {_site()}: {what}, so its gradient must be "
                    + (
                        "summed over the ranks"
                        if varying
                        else "passed on unchanged, not summed over the ranks"
                    )
                    + f", but {root.why}. The gradients would be world-size times too "
                    + ("small." if varying else "large.")
                )
            if root.kind is None:
                root.kind = want
                root.why = f"{what} (its gradient {'partial' if varying else 'replicated'})"

    def _check_inputs(self) -> None:
        """Before the backward of a replicated objective: no replicated input that requires
        grad may get a partial gradient (each rank would hold only its share, and nothing
        sums it: a copy_to_region is missing where it met a varying weight)."""
        for x, _ in self._inputs.values():
            r = x.__dict__.get(self.key)
            if r is None or r.t is not R or r.cell is None or not x.requires_grad:
                continue
            root = r.cell.root()
            if root.epoch != _EPOCH.n or root.kind != PARTIAL or root.copy_at is None:
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
        root = r.cell.root() if r.cell is not None else None
        if r.t is R and root is not None and root.kind == PARTIAL:
            g = _Rec(P, why=f"the gradient of a replicated value; {root.why}")
            g.strict = strict
            g.copy_at = root.copy_at
            return g
        g = _Rec(R)  # whole on every rank: summing it again would count it world-size times
        if r.t is P:
            g.reduced = "the gradient of a partial value, whole on every rank"
        elif root is not None and root.kind == REPLICATED:
            g.reduced = (
                f"a gradient of a replicated objective, whole on every rank ({root.why}){_PER_RANK_LOSS}"
            )
        else:
            g.reduced = f"a replicated gradient, whole on every rank{_PER_RANK_LOSS}"
        return g

    def _type_grads(
        self, before: Mapping[int, _Rec], strict: str | None, zeroed: Mapping[int, tuple[Tensor, int]]
    ) -> None:
        key = self.key
        for entry in list(self._params.values()):
            p, r = entry.param, entry.rec
            if p.grad is None:
                continue
            g = p.grad
            z = zeroed.get(id(p))
            if z is not None and z[0] is g and g._version == z[1]:
                continue  # a zeroed gradient this backward did not reach: still zero
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

    def _check_replicated_losses(self) -> None:
        """Every loss typed replicated must be equal on every rank: one that differs was
        computed from per-rank data the check could not see (rows sliced with a rank taken
        before the check), so the gradient rules checked under it assumed a replicated
        objective that was not one (a gradient reduction left out passed in silence)."""
        found = _replicated_values_differ(self.pg, self._replicated_losses)
        if found is None:
            return
        i, values = found
        shown = ", ".join(f"rank {r}: {v:.6g}" for r, v in enumerate(values))
        raise SPMDTypeError(
            f"diffcomm.spmd_check: the loss at {self._replicated_losses[i][0]} was typed "
            f"replicated (no per-rank data was seen in it), so its objective was counted once "
            f"and the gradients checked against that; but its value differs between the ranks "
            f"({shown}): it was computed from per-rank data the check could not see, and its "
            "gradient checks do not hold. Declare such data with dc.spmd.varying(x), or take the "
            "rank with dc.get_rank() inside the check (a rank taken before it is a plain int)"
        )

    def check_grads(self, params: Iterable[Tensor] | None = None) -> None:
        """Raise :class:`SPMDTypeError` for the first replicated parameter (of ``params``;
        default: every parameter the check typed) whose gradient is partial (each rank
        holds its share: a reduction over the group is missing) or varying (changed by a
        per-rank value after backward), or a varying parameter whose gradient was reduced over
        the checked group (a sharded weight's gradient mixed with the other shards'). Runs
        on leaving the block and before every optimizer step inside it."""
        key = self.key
        only = None if params is None else {id(p) for p in params}
        for entry in self._params.values():
            p, name, r = entry.param, entry.name, entry.rec
            if only is not None and id(p) not in only:
                continue
            if p.grad is None:
                continue
            g = p.grad.__dict__.get(key)
            if g is not None and g.zero:  # zeroed (zero_grad(set_to_none=False)): nothing to sum
                continue
            if p.__dict__.get(key, r).t is V:
                if g is not None and g.t is R and g.why:
                    raise SPMDTypeError(
                        f"diffcomm.spmd_check: parameter {name} is varying (each rank holds its own "
                        f"shard or copy), but its gradient is replicated ({g.why}): reduced over the "
                        "group it varies on, it mixes the ranks' different gradients. Reduce it only "
                        "over another group (the data-parallel one), or not at all."
                    )
                continue
            if p.__dict__.get(key, r).t is not R:
                continue
            if g is not None and g.t is V:
                raise SPMDTypeError(
                    f"diffcomm.spmd_check: parameter {name} is replicated, but its gradient varies by "
                    f"rank ({g.why or 'changed by a per-rank value after backward'}): the replicas "
                    "would drift apart. A per-rank factor (e.g. a gradient-clipping norm of sharded "
                    "gradients computed without an all_reduce) must be made replicated first: "
                    "for clipping, diffcomm.parallel.clip_grad_norm_(model, max_norm)."
                )
            if g is not None and g.t is P:
                owner = self._owners.get(id(p))
                sync = owner.sync if owner is not None else None
                if sync is not None:
                    fix = sync
                elif g.copy_at is not None:
                    fix = (
                        f"insert parallel.copy_to_region before the {g.copy_at} (its backward sums "
                        "the gradient of everything upstream, inputs included)"
                    )
                else:
                    fix = (
                        "sum its gradient over the group: a sequence-parallel LayerNorm (RMSNorm) "
                        "is parallel.SequenceParallelLayerNorm (SequenceParallelRMSNorm); otherwise "
                        "p.grad = dc.all_reduce(p.grad) after backward"
                    )
                raise SPMDTypeError(
                    f"diffcomm.spmd_check: parameter {name} is replicated, but its gradient is "
                    f"partial ({g.why}): every rank holds only its share (missing reduction). Fix: {fix}."
                )
