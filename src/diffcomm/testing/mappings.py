"""Checks of the tensor-parallel mappings (``diffcomm.parallel``) for ``python -m diffcomm check``.

The mappings are differentiated under the **replicated objective** (docs/convention.md):
a replicated tensor is one variable, held the same on every rank, and counts once; a
per-rank tensor (a shard, a partial sum) counts on every rank. So they cannot go through
:func:`~diffcomm.testing.cases.run_case`, whose sum-of-per-rank-objectives reference gives
every rank's copy its own variable. A :class:`~diffcomm.testing.cases.Case` of a mapping
is checked here, on every rank, for:

* **forward** - the output equals a plain-torch reference computed from every rank's input
  (replicated inputs: rank 0's, on every rank);
* **gradient** - autograd's gradient of ``<M(x), c>`` is the conjugate mapping its class
  names (``dual``, called with ``dual_args``) applied to ``c`` directly (``c`` replicated
  where ``M``'s output is; which sides are replicated: the class's ``replicated``), also
  with ``c``'s values laid out non-contiguously;
* **adjoint** - ``<M x, y> == <x, M* y>`` in the replicated inner product (a replicated
  pair counts once, a per-rank pair is summed over ranks);
* **double backward** - the gradient of ``<grad_x, w>`` with respect to ``c`` is ``M(w)``;
* the input is unchanged and the output does not alias it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

import diffcomm as dc
from diffcomm.ops import registry

from .cases import (
    Case,
    CaseResult,
    _inner,
    _rel,
    _sum_over_ranks,
    case_device,
    make_inputs,
    registry_cases,
    tolerance,
)
from .checks import strided

#: mappings whose forward returns ``x`` itself, as documented (identity forward: a view)
VIEWS = ("copy_to_region",)


def standard_mapping_cases(world: int, modules: Sequence[str] = ()) -> Iterator[Case]:
    """Every mapping's standard cases (the ``cases`` their classes state), for ``world``
    ranks (also those of ``modules``)."""
    import diffcomm.parallel  # noqa: F401 - importing registers the mappings

    return registry_cases(world, "mapping", modules)


def is_mapping(op: str) -> bool:
    """Whether ``op`` is checked here: a registered op stating which sides are replicated."""
    cls = registry.REGISTRY.get(op)
    return cls is not None and cls.replicated is not None


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
    op = registry.REGISTRY[case.op]
    fn, dual = registry.public_fn(op), registry.public_fn(op.dual)
    rep_in, rep_out = op.replicated
    res = CaseResult(tol=tolerance(case.dtype))
    dev = case_device()
    xs = make_inputs(case, "x", torch.float64)
    if rep_in:
        xs = [xs[0]] * w
    x = xs[rank].to(dev, copy=True).requires_grad_(True)
    x_before = x.detach().clone()
    out = fn(x, **case.kwargs)
    res.forward_err = _rel(out, op.reference(xs, [case.kwargs] * w)[rank])
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
    dual_kwargs, scale = op.dual_args(case.kwargs, w)
    with torch.no_grad():
        aty = dual(cot.detach(), **dual_kwargs) * scale
    # again with the same cotangent values laid out non-contiguously (first order only): a
    # backward wrong only for a strided gradient is a classic silent bug, and cot above is
    # contiguous
    (gx_nc,) = torch.autograd.grad(out, x, grad_outputs=strided(cot.detach()), retain_graph=True)
    res.grad_err = max(_rel(gx, aty), _rel(gx_nc, aty))
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
        m_w = fn(wv, **case.kwargs)
    res.double_err = _rel(hc, m_w)
    res.seconds = time.perf_counter() - start
    return res
