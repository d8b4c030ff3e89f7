"""Checks of the coalesced collectives against the single-tensor ops, on every rank.

A :class:`CoalescedCase` is one call of a coalesced op on a list of tensors (shapes,
dtypes, which require grad, which outputs the loss uses). :func:`run_coalesced_case`
runs it on this rank and measures, like :func:`diffcomm.testing.cases.run_case`:

* **forward** — each output against the single-tensor op applied to that tensor alone
  (integer-valued data, so the comparison is exact whatever the reduction order);
* **gradient** and **double backward** — of ``sum_i <out_i, cot_i>`` (used outputs only)
  against the same objective through the single ops (the gradient also with the
  cotangents' values laid out non-contiguously);
* **adjoint** — the dot-product test ``sum_r sum_i <A x_i, y_i> == sum_r sum_i <x_i,
  A^T y_i>`` with ``A^T`` the **dual coalesced op** the op's class names (its ``dual``
  and ``dual_args``), called directly (linear cases);
* the inputs are unchanged and no output aliases an input.

Used by the test-suite and by ``python -m diffcomm check``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

import diffcomm as dc
from diffcomm.ops import registry

from .cases import CaseResult, _inner, _rel, _sum_over_ranks, case_device, tolerance
from .checks import strided

Spec = tuple[tuple[int, ...], str, bool, bool]  # shape, dtype, requires_grad, output used


@dataclass(frozen=True)
class CoalescedCase:
    """One coalesced call to check.

    Attributes:
        op: ``"all_reduce_coalesced"``, ``"broadcast_coalesced"``, ``"reduce_coalesced"``,
            ``"all_gather_coalesced"`` or ``"reduce_scatter_coalesced"``.
        world: world size the case is for.
        specs: per tensor ``(shape, dtype name, requires_grad, output used by the loss)``.
        kwargs: the op's arguments (``op``, ``src``, ``dst``, ``dim``, ``split_sizes``).
        seed: data seed.
        rank_sizes: ``all_gather_coalesced`` with sizes that differ between ranks: per
            tensor, every rank's size along ``dim`` (rank ``r``'s tensor ``i`` has
            ``shape[dim] = rank_sizes[i][r]``; the op learns them unless ``kwargs`` gives
            ``split_sizes``). ``None``: every rank's shapes are ``specs``'.
    """

    op: str
    world: int
    specs: tuple[Spec, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    rank_sizes: tuple[tuple[int, ...], ...] | None = None

    def label(self) -> str:
        kinds = sorted({s[1] for s in self.specs})
        bits = [f"{k}={v}" for k, v in self.kwargs.items()]
        return f"{len(self.specs)} tensors {','.join(kinds)} " + " ".join(bits)


def _values(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, lo: int, hi: int) -> Tensor:
    v = torch.randint(lo, hi + 1, shape, generator=gen).to(torch.float64)
    if dtype.is_complex:
        v = torch.complex(v, torch.randint(lo, hi + 1, shape, generator=gen).to(torch.float64))
    return v.to(dtype)


def _single_op(case: CoalescedCase, i: int) -> Any:
    """The single-tensor op for tensor ``i`` (its own entry of ``split_sizes``)."""
    name = case.op.removesuffix("_coalesced")
    kw = dict(case.kwargs)
    if kw.get("split_sizes") is not None:
        kw["split_sizes"] = kw["split_sizes"][i]
    return lambda x: getattr(dc, name)(x, **kw)


def _sizes(case: CoalescedCase) -> Any:
    """The per-tensor, per-rank sizes along ``dim`` (``None``: even)."""
    given = case.kwargs.get("split_sizes")
    return given if given is not None else case.rank_sizes


def _dual_call(case: CoalescedCase, ys: list[Tensor]) -> list[Tensor] | None:
    """``A^T y`` through the dual coalesced op its class names, called with the arguments
    its ``dual_args`` maps the call's to (linear cases of an op that states it)."""
    op = registry.REGISTRY[case.op]
    if case.kwargs.get("op", "sum") not in ("sum", "avg") or op.dual_args is None:
        return None
    kw = dict(case.kwargs)
    if "dim" in kw or "split_sizes" in kw:
        kw["split_sizes"] = _sizes(case)
    dual_kwargs, scale = op.dual_args(kw, case.world)
    out = registry.public_fn(op.dual)(ys, **dual_kwargs)
    return [o * scale for o in out] if scale != 1.0 else out


def _with_size(shape: tuple[int, ...], dim: int, n: int) -> tuple[int, ...]:
    d = dim % len(shape)
    return (*shape[:d], n, *shape[d + 1 :])


def run_coalesced_case(case: CoalescedCase, double: bool = True) -> CaseResult:
    """Check ``case`` on this rank (call on every rank of a ``case.world``-rank world)."""
    start = time.perf_counter()
    rank = dc.get_rank()
    if dc.get_world_size() != case.world:
        raise ValueError(f"run_coalesced_case: case is for world {case.world}, not {dc.get_world_size()}")
    kw = case.kwargs
    gen = torch.Generator().manual_seed(case.seed * 101 + rank)
    lo, hi = (-2, 2) if kw.get("op") == "product" else (-3, 3)
    dev = case_device()
    shapes = [s for s, _, _, _ in case.specs]
    if case.rank_sizes is not None:  # this rank's size along dim
        shapes = [_with_size(s, kw.get("dim", 0), n[rank]) for s, n in zip(shapes, case.rank_sizes)]
    xs = [
        _values(s, getattr(torch, d), gen, lo, hi).to(dev).requires_grad_(g)
        for s, (_, d, g, _) in zip(shapes, case.specs)
    ]
    res = CaseResult(tol=max(tolerance(d) for _, d, _, _ in case.specs))
    before = [x.detach().clone() for x in xs]
    fn = registry.public_fn(registry.REGISTRY[case.op])
    out = fn(xs, **kw)
    xs1 = [x.detach().clone().requires_grad_(x.requires_grad) for x in xs]
    ref = [_single_op(case, i)(x) for i, x in enumerate(xs1)]
    res.forward_err = max(_rel(a, b) if a.shape == b.shape else float("inf") for a, b in zip(out, ref))
    res.input_unchanged = all(torch.equal(x.detach(), b) for x, b in zip(xs, before))
    ptrs = {x.data_ptr() for x in xs if x.numel()}
    res.no_alias = not any(o.numel() and o.data_ptr() in ptrs for o in out)
    used = [i for i, s in enumerate(case.specs) if s[3]]
    cots: list[Any] = [None] * len(xs)
    for i in used:
        cots[i] = _values(tuple(out[i].shape), out[i].dtype, gen, -3, 3).to(dev)
        cots[i].requires_grad_(out[i].dtype.is_floating_point or out[i].dtype.is_complex)
    # adjoint: dot-product test with the dual coalesced op, called directly
    ys = [c.detach() if c is not None else torch.zeros_like(o.detach()) for c, o in zip(cots, out)]
    with torch.no_grad():
        aty = _dual_call(case, ys)
    if aty is not None:
        lhs = sum(float(_inner(o.detach(), y)) for o, y in zip(out, ys))
        rhs = sum(float(_inner(x.detach(), a)) for x, a in zip(xs, aty))
        # the scale of the terms (not of the sums, which may cancel): sum |o||y|
        mag = sum(float(_inner(o.detach().abs(), y.abs())) for o, y in zip(out, ys))
        lhs, rhs, mag = _sum_over_ranks(lhs), _sum_over_ranks(rhs), _sum_over_ranks(mag)
        scale = max(abs(lhs), abs(rhs), mag, 1.0)
        res.adjoint_err = abs(lhs - rhs) / scale
    wanted = [i for i, x in enumerate(xs) if x.requires_grad]

    def grads(outs: list[Tensor], inputs: list[Tensor]) -> tuple[Any, ...]:
        terms = [(outs[i] * cots[i].conj()).real.sum() for i in used if outs[i].requires_grad]
        if not terms:  # the single ops' outputs are constants here: no backward at all
            return (None,) * len(wanted)
        leaves = [inputs[i] for i in wanted]
        return torch.autograd.grad(sum(terms), leaves, create_graph=double, allow_unused=True)

    if not wanted:
        res.seconds = time.perf_counter() - start
        return res
    # also with the same cotangent values laid out non-contiguously (first order only, the
    # graph kept for the pass below): a backward wrong only for a strided gradient is a
    # classic silent bug, and the cotangents are contiguous
    roots = [i for i in used if out[i].requires_grad]
    g_nc: tuple[Any, ...] = (None,) * len(wanted)
    if roots:
        g_nc = torch.autograd.grad(
            [out[i] for i in roots],
            [xs[i] for i in wanted],
            [strided(cots[i].detach()) for i in roots],
            retain_graph=True,
            allow_unused=True,
        )
    g_co, g_ref = grads(out, xs), grads(ref, xs1)
    res.grad_err = max(_rel(a, b) for a, b in [*zip(g_co, g_ref), *zip(g_nc, g_ref)])
    if double:
        ws = [_values(tuple(xs[i].shape), xs[i].dtype, gen, -2, 2).to(dev) for i in wanted]
        extra = [i for i in used if cots[i].requires_grad]

        def second(gs: tuple[Any, ...], inputs: list[Tensor]) -> tuple[Any, ...]:
            leaves = [inputs[i] for i in wanted] + [cots[i] for i in extra]
            terms = [(g * w.conj()).real.sum() for g, w in zip(gs, ws) if g is not None and g.requires_grad]
            if not terms:
                return (None,) * len(leaves)
            return torch.autograd.grad(sum(terms), leaves, allow_unused=True)

        res.double_err = max(_rel(a, b) for a, b in zip(second(g_co, xs), second(g_ref, xs1)))
    res.seconds = time.perf_counter() - start
    return res


def standard_coalesced_cases(world: int, modules: Sequence[str] = ()) -> Iterator[CoalescedCase]:
    """Every coalesced op's standard cases (the ``cases`` their classes state: every reduce
    op on a mixed list - float64, float32, int64, an empty tensor, a 0-dim one, one not
    requiring grad, one unused output - and sizes that differ between ranks)."""
    for name, cls in registry.family("coalesced", modules).items():
        if cls.cases is not None:
            for fields in cls.cases(world):
                yield CoalescedCase(**{"op": name, "world": world, **fields})
