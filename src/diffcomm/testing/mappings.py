"""Checks of the tensor-parallel mappings (``diffcomm.parallel``) for ``python -m diffcomm check``.

The mappings are differentiated under the **replicated objective** (docs/convention.md):
a replicated tensor is one variable, held the same on every rank, and counts once; a
per-rank tensor (a shard, a partial sum) counts on every rank. So they cannot go through
:func:`~diffcomm.testing.cases.run_case`, whose sum-of-per-rank-objectives reference gives
every rank's copy its own variable. A :class:`~diffcomm.testing.cases.Case` of a mapping
is checked here, on every rank, for:

* **forward** - the output equals a plain-torch reference computed from every rank's input
  (replicated inputs: rank 0's, on every rank);
* **gradient** - autograd's gradient of ``<M(x), c>`` is the conjugate mapping of the
  registry (``dual``) applied to ``c`` directly (``c`` replicated where ``M``'s output is);
* **adjoint** - ``<M x, y> == <x, M* y>`` in the replicated inner product (a replicated
  pair counts once, a per-rank pair is summed over ranks);
* **double backward** - the gradient of ``<grad_x, w>`` with respect to ``c`` is ``M(w)``;
* the input is unchanged and the output does not alias it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

import diffcomm as dc

from .cases import (
    Case,
    CaseResult,
    _inner,
    _rel,
    _sum_over_ranks,
    case_device,
    make_inputs,
    tolerance,
)

#: mapping -> (its input is replicated, its output is replicated)
REPLICATED: dict[str, tuple[bool, bool]] = {
    "copy_to_region": (True, False),
    "reduce_from_region": (False, True),
    "scatter_to_region": (True, False),
    "gather_from_region": (False, True),
    "reduce_scatter_to_sequence": (False, False),
    "all_gather_from_sequence": (False, False),
    "all_to_all_region": (False, False),
}

#: mappings whose forward returns ``x`` itself, as documented (identity forward: a view)
VIEWS = ("copy_to_region",)


def _reference(op: str, xs: list[Tensor], rank: int, kw: dict[str, Any]) -> Tensor:
    """This rank's output of mapping ``op`` from every rank's input, in plain torch."""
    n = len(xs)
    if op == "copy_to_region":
        return xs[0].clone()
    if op == "reduce_from_region":
        return torch.stack(xs).sum(0)
    if op == "scatter_to_region":
        return xs[0].chunk(n, kw.get("dim", -1))[rank].clone()
    if op in ("gather_from_region", "all_gather_from_sequence"):
        return torch.cat(xs, kw.get("dim", -1 if op == "gather_from_region" else 0))
    if op == "reduce_scatter_to_sequence":
        return torch.stack(xs).sum(0).chunk(n, kw.get("dim", 0))[rank].clone()
    if op == "all_to_all_region":
        s, c = kw["split_dim"], kw["concat_dim"]
        return torch.cat([x.chunk(n, s)[rank] for x in xs], c)
    raise ValueError(f"unknown mapping {op!r}")


def standard_mapping_cases(world: int) -> Iterator[Case]:
    """Every mapping once (with ``dim`` where it takes one), for ``world`` ranks."""
    w = world
    yield Case("copy_to_region", w, (3, 4))
    yield Case("reduce_from_region", w, (3, 4))
    yield Case("scatter_to_region", w, (3, 2 * w), kwargs={"dim": -1})
    yield Case("gather_from_region", w, (3, 2), kwargs={"dim": -1})
    yield Case("reduce_scatter_to_sequence", w, (2 * w, 3), kwargs={"dim": 0})
    yield Case("all_gather_from_sequence", w, (2, 3), kwargs={"dim": 0})
    yield Case("all_to_all_region", w, (2 * w, 3 * w), kwargs={"split_dim": 1, "concat_dim": 0})


def _fn(op: str) -> Any:
    import diffcomm.parallel  # noqa: F401 - importing registers the mappings
    from diffcomm.ops import registry as _registry

    return _registry.REGISTRY[op]


def _rep_inner(a: Tensor, b: Tensor, replicated: bool, world: int) -> float:
    """This rank's share of the replicated inner product (summed over ranks by the caller)."""
    v = float(_inner(a, b))
    return v / world if replicated else v


def run_mapping_case(case: Case) -> CaseResult:
    """Check mapping ``case`` on this rank (call on every rank of a ``case.world``-rank world)."""
    start = time.perf_counter()
    rank, w = dc.get_rank(), dc.get_world_size()
    if w != case.world:
        raise ValueError(f"run_mapping_case: case is for world {case.world}, this world has {w} ranks")
    spec = _fn(case.op)
    dual = _fn(spec.dual)
    rep_in, rep_out = REPLICATED[case.op]
    res = CaseResult(tol=tolerance(case.dtype))
    dev = case_device()
    xs = make_inputs(case, "x", torch.float64)
    if rep_in:
        xs = [xs[0]] * w
    x = xs[rank].to(dev, copy=True).requires_grad_(True)
    x_before = x.detach().clone()
    out = spec.fn(x, **case.kwargs)
    res.forward_err = _rel(out, _reference(case.op, xs, rank, case.kwargs))
    res.input_unchanged = bool(torch.equal(x.detach(), x_before))
    res.no_alias = (
        case.op in VIEWS
        or out.numel() == 0
        or out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    )
    # the cotangent: any tensor of the output's shape, the same on every rank where the
    # output is replicated (the replicated objective)
    gen = torch.Generator().manual_seed(case.seed * 1000 + 7 + (0 if rep_out else rank))
    cot = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(dev).requires_grad_(True)
    (gx,) = torch.autograd.grad(_inner(out, cot), x, create_graph=True)
    dual_kwargs = dict(case.kwargs)
    if case.op == "all_to_all_region":
        dual_kwargs = {"split_dim": case.kwargs["concat_dim"], "concat_dim": case.kwargs["split_dim"]}
    with torch.no_grad():
        aty = dual.fn(cot.detach(), **dual_kwargs)
    res.grad_err = _rel(gx, aty)
    o = out.detach()
    lhs, rhs, lhs_abs, rhs_abs = _sum_over_ranks(
        _rep_inner(o, cot.detach(), rep_out, w),
        _rep_inner(x.detach(), aty, rep_in, w),
        _rep_inner(o.abs(), cot.detach().abs(), rep_out, w),
        _rep_inner(x.detach().abs(), aty.abs(), rep_in, w),
    )
    res.adjoint_err = abs(lhs - rhs) / max(1.0, lhs_abs, rhs_abs)
    # second order: d/dcot <grad_x, wv> = M(wv), wv in input space (replicated where x is)
    gen = torch.Generator().manual_seed(case.seed * 1000 + 9 + (0 if rep_in else rank))
    wv = torch.randn(x.shape, generator=gen, dtype=torch.float64).to(dev)
    (hc,) = torch.autograd.grad(_inner(gx, wv), cot)
    with torch.no_grad():
        m_w = spec.fn(wv, **case.kwargs)
    res.double_err = _rel(hc, m_w)
    res.seconds = time.perf_counter() - start
    return res
