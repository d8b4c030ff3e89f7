"""Coalesced collectives on real gloo ranks.

* property tests (hypothesis; list lengths 1-16, random shapes incl. empty and 0-dim,
  mixed dtypes, every reduce op, worlds 1-4): each coalesced op equals the single-tensor
  op applied to the tensors one by one — outputs, gradients and double-backward
  gradients (integer-valued data: outputs are compared bit for bit; gradients, which
  pass through the max/min tie weights, within torch's default tolerances per dtype);
* one communication per dtype, forward and backward, counted twice: by the comms logger
  (one record per coalesced call, ``parts`` = raw calls, total bytes) and independently
  by the profiler's ``gloo:*`` events (the raw c10d calls that really ran);
* ``torch.func`` (grad, vjp, jvp, vmap with one communication for the whole batch) and
  ``torch.compile``;
* bad input raises before any communication; debug mode names the ranks and the first
  differing position of mismatched lists.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _shared import check_in_batches
from hypothesis import strategies as st

import diffcomm as dc
from diffcomm import backend as B
from diffcomm.ops.coalesced import COALESCED_OPS, coalesced_markdown
from diffcomm.testing.coalesced import CoalescedCase, run_coalesced_case, standard_coalesced_cases

# The coalesced ops' values and gradients need no real transport: this module's shared worlds are in-
# process (the same values as gloo processes: tests/runtime/test_in_process.py). A test that needs a
# process per rank says why and stays on processes.
pytestmark = pytest.mark.diffcomm_in_process


WORLDS = [1, 2, 3, 4]
F64 = torch.float64
DTYPES = ["float64", "float32", "float16", "bfloat16", "complex128", "int64"]
OPS = ["sum", "avg", "max", "min", "product"]
COALESCED = {
    "all_reduce": dc.all_reduce_coalesced,
    "reduce": dc.reduce_coalesced,
    "broadcast": dc.broadcast_coalesced,
    "all_gather": dc.all_gather_coalesced,
    "reduce_scatter": dc.reduce_scatter_coalesced,
}


# --------------------------------------------------------------------------------------
# coalesced == the single ops one by one (diffcomm.testing.coalesced.run_coalesced_case)
# --------------------------------------------------------------------------------------


def _assert_cases(world: dc.LocalWorld, cases: list[CoalescedCase]) -> None:
    """Run ``cases`` on every rank of ``world`` (the property tests and the standard cases)."""

    def run_cases(cases: list[CoalescedCase]) -> list[str]:
        out = []
        for c in cases:
            r = run_coalesced_case(c)
            # integer-valued data: outputs must match the single ops bit for bit
            if not r.ok or r.forward_err != 0.0:
                out.append(f"{c.op} {c.kwargs} {c.specs}: {r.as_dict()}")
        return out

    per_rank = world.run(run_cases, cases)
    bad = [(r, f) for r, fs in enumerate(per_rank) for f in fs]
    assert not bad, "\n".join(f"rank {r}: {f}" for r, f in bad[:6])


@st.composite
def coalesced_cases(draw: st.DrawFn, op: str, world: int) -> CoalescedCase:
    kw: dict[str, Any] = {}
    reducing = op in ("all_reduce", "reduce", "reduce_scatter")
    rop = draw(st.sampled_from(OPS)) if reducing else "sum"
    if reducing:
        kw["op"] = rop
    if op == "broadcast":
        kw["src"] = draw(st.integers(0, world - 1))
    if op == "reduce":
        kw["dst"] = draw(st.integers(0, world - 1))
    dtypes = [d for d in DTYPES if not (d == "complex128" and rop in ("max", "min"))]
    dtypes = [d for d in dtypes if not (d == "int64" and rop == "avg")]
    n = draw(st.integers(1, 16))
    min_dims = 1 if op in ("all_gather", "reduce_scatter") else 0
    ndims = draw(st.lists(st.integers(min_dims, 3), min_size=n, max_size=n))
    dim = 0
    if op in ("all_gather", "reduce_scatter"):
        lowest = min(ndims)
        dim = draw(st.integers(-lowest, lowest - 1))
        kw["dim"] = dim
    specs = []
    for nd in ndims:
        shape = draw(st.lists(st.integers(0, 3), min_size=nd, max_size=nd))
        if op == "reduce_scatter":
            shape[dim % nd] = world * draw(st.integers(0, 2))
        dtype = draw(st.sampled_from(dtypes))
        grad = dtype != "int64" and draw(st.booleans())
        specs.append((tuple(shape), dtype, grad, draw(st.booleans())))
    return CoalescedCase(f"{op}_coalesced", world, tuple(specs), kw, seed=draw(st.integers(0, 10_000)))


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("op", ["all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter"])
def test_coalesced_equals_single_ops_one_by_one(local_worlds, op: str, world_size: int) -> None:
    check_in_batches(local_worlds(world_size), coalesced_cases(op, world_size), _assert_cases, max_examples=8)


@st.composite
def varied_cases(draw: st.DrawFn, op: str, world: int) -> CoalescedCase:
    """Sizes along ``dim`` that differ between ranks (all_gather: learned with one exchange
    or given; reduce_scatter: uneven ``split_sizes``), ranks with no rows, mixed dtypes."""
    kw: dict[str, Any] = {}
    rop = draw(st.sampled_from(OPS)) if op == "reduce_scatter" else "sum"
    if op == "reduce_scatter":
        kw["op"] = rop
    dtypes = [d for d in DTYPES if not (d == "complex128" and rop in ("max", "min"))]
    dtypes = [d for d in dtypes if not (d == "int64" and rop == "avg")]
    n = draw(st.integers(1, 8))
    ndims = draw(st.lists(st.integers(1, 3), min_size=n, max_size=n))
    lowest = min(ndims)
    dim = draw(st.integers(-lowest, lowest - 1))
    kw["dim"] = dim
    specs, sizes = [], []
    for nd in ndims:
        shape = draw(st.lists(st.integers(0, 3), min_size=nd, max_size=nd))
        per_rank = tuple(draw(st.lists(st.integers(0, 3), min_size=world, max_size=world)))
        shape[dim % nd] = sum(per_rank) if op == "reduce_scatter" else per_rank[0]
        dtype = draw(st.sampled_from(dtypes))
        grad = dtype != "int64" and draw(st.booleans())
        specs.append((tuple(shape), dtype, grad, draw(st.booleans())))
        sizes.append(per_rank)
    seed = draw(st.integers(0, 10_000))
    if op == "reduce_scatter":
        kw["split_sizes"] = tuple(sizes)
        return CoalescedCase("reduce_scatter_coalesced", world, tuple(specs), kw, seed=seed)
    if draw(st.booleans()):
        kw["split_sizes"] = tuple(sizes)
    return CoalescedCase("all_gather_coalesced", world, tuple(specs), kw, seed=seed, rank_sizes=tuple(sizes))


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
def test_variable_sizes_equal_single_ops_one_by_one(local_worlds, op: str, world_size: int) -> None:
    """Values, gradients, double backward and the dot-product test with the dual coalesced
    op, against the single ops (``dc.all_gather`` learning its sizes or given them,
    ``dc.reduce_scatter(split_sizes=...)``) applied one by one."""
    check_in_batches(local_worlds(world_size), varied_cases(op, world_size), _assert_cases, max_examples=5)


@pytest.mark.parametrize("world_size", WORLDS)
def test_standard_coalesced_cases(local_worlds, world_size: int) -> None:
    """The fixed list `python -m diffcomm check` runs: mixed float64/float32/int64, empty,
    0-dim, no-grad and unused tensors, every op and reduce op."""
    _assert_cases(local_worlds(world_size), list(standard_coalesced_cases(world_size)))


def test_coalesced_dual_table_is_an_involution() -> None:
    assert set(COALESCED_OPS) == {f"{n}_coalesced" for n in ("all_reduce", "broadcast", "reduce")} | {
        "all_gather_coalesced",
        "reduce_scatter_coalesced",
    }
    for name, spec in COALESCED_OPS.items():
        assert spec.fn is getattr(dc, name)
        assert COALESCED_OPS[spec.dual].dual == name
        assert spec.op.dual.dual is spec.op  # the classes name each other
        single = name.removesuffix("_coalesced")
        assert spec.dual.removesuffix("_coalesced") == dc.dual(single), "same duals as the single ops"
    table = coalesced_markdown()
    for name, spec in COALESCED_OPS.items():
        assert f"| `{name}` |" in table and f"`{spec.dual}`" in table


# --------------------------------------------------------------------------------------
# one communication per dtype, forward and backward
# --------------------------------------------------------------------------------------


def _gloo_calls(prof: Any) -> int:
    return sum(1 for e in prof.events() if e.name.startswith("gloo:"))


BWD_NAME = {
    "all_reduce": "all_reduce",
    "broadcast": "reduce",
    "all_gather": "reduce_scatter",
    "reduce_scatter": "all_gather",
}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize(
    "op,kw",
    [
        ("all_reduce", {}),
        ("all_reduce", {"op": "avg"}),
        ("all_reduce", {"op": "max"}),
        ("broadcast", {"src": 1}),
        ("all_gather", {}),
        ("reduce_scatter", {}),
    ],
)
# on processes: counts communications with torch.profiler: one profiler per process
@pytest.mark.diffcomm_in_process(False)
@pytest.mark.usefixtures("debug_off")
def test_one_communication_per_dtype_forward_and_backward(local_worlds, op, kw, world_size) -> None:
    def count_comms(op: str, kw: dict[str, Any]) -> dict[str, Any]:
        from torch.profiler import ProfilerActivity, profile

        w = dc.get_world_size()
        third = torch.float16 if kw.get("op") == "avg" else torch.int64  # avg takes no integers
        xs = [
            torch.randn(w * 2, 3, dtype=torch.float32, requires_grad=True),
            torch.randn(w, dtype=torch.float64, requires_grad=True),
            torch.randn(w * 3, 2, dtype=torch.float32),  # no grad: still part of the backward buffer
            torch.arange(w * 4).to(third),  # integer: forward only; float16 without grad: zeros
            torch.randn(w, 5, dtype=torch.float64, requires_grad=True),
            torch.randn(0, 2, dtype=torch.float32, requires_grad=True),
        ]
        COALESCED[op](xs, **kw)  # all_gather: the group learns this list's sizes (see below)
        with B.log_comms() as fwd_log, profile(activities=[ProfilerActivity.CPU]) as fwd_prof:
            out = COALESCED[op](xs, **kw)
        with B.log_comms() as bwd_log, profile(activities=[ProfilerActivity.CPU]) as bwd_prof:
            sum(o.sum() for o in out if o.requires_grad).backward()
        return {
            "fwd_records": [(r.op, r.parts, r.nbytes) for r in fwd_log.records],
            "bwd_records": [(r.op, r.parts, r.nbytes) for r in bwd_log.records],
            "fwd_gloo": _gloo_calls(fwd_prof),
            "bwd_gloo": _gloo_calls(bwd_prof),
            "payload": sum(x.numel() * x.element_size() for x in xs),
            "grad_payload": sum(x.numel() * x.element_size() for x in xs if x.is_floating_point()),
        }

    for rec in local_worlds(world_size).run(count_comms, op, kw):
        # forward: 3 dtypes present -> 3 raw c10d calls, logged as one op with total bytes
        # (all_gather without split_sizes: once the group has gathered such a list, every
        # rank's sizes travel with the first buffer; the first call's exchange is tested
        # in test_variable_sizes_one_communication_per_dtype)
        assert rec["fwd_gloo"] == 3, rec
        assert [r[:2] for r in rec["fwd_records"]] == [(f"{op}_coalesced", 3)], rec
        # backward: one raw call per differentiable dtype (float32, float64; float16 too
        # when present, with zeros, as it is differentiable); max/min: the tie counts
        # travel in the same buffer. One logged op of the dual.
        n_bwd = 3 if kw.get("op") == "avg" else 2
        assert rec["bwd_gloo"] == n_bwd, rec
        assert [r[:2] for r in rec["bwd_records"]] == [(f"{BWD_NAME[op]}_coalesced", n_bwd)], rec
        if op in ("all_reduce", "broadcast"):
            # max on gloo: each floating buffer travels with its NaN flags (twice its bytes)
            flags = rec["grad_payload"] if kw.get("op") == "max" else 0
            assert rec["fwd_records"][0][2] == rec["payload"] + flags
            factor = 2 if kw.get("op") == "max" else 1  # gradient + tie mask
            assert rec["bwd_records"][0][2] == factor * rec["grad_payload"]


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("op,given", [("all_gather", False), ("all_gather", True), ("reduce_scatter", True)])
# on processes: counts communications with torch.profiler: one profiler per process
@pytest.mark.diffcomm_in_process(False)
@pytest.mark.usefixtures("debug_off")
def test_variable_sizes_one_communication_per_dtype(local_worlds, op, given, world_size) -> None:
    """Sizes that differ between ranks: one data communication per dtype forward (3) and
    backward (2: the float32 and float64 gradients), counted by the comms logger and by
    the profiler's gloo calls, on every call when the sizes are given. Learned sizes: the
    first call on a group exchanges them once for the whole list of five tensors; later
    calls send them with the first buffer (no exchange); sizes past the largest the group
    has seen cost that buffer once more. The backward reuses them (never an exchange)."""

    def count_varied(op: str, given: bool) -> list[dict[str, Any]]:
        """Sizes along dim 0 that differ between ranks: 3 dtypes forward, 2 differentiable.
        Three calls: fresh, the same sizes again, and sizes grown past what the group has
        seen (all_gather learning its sizes: exchange first; with the first buffer; with the
        first buffer, which did not fit, then once more)."""
        from _shared import forget_gathered_sizes
        from torch.profiler import ProfilerActivity, profile

        forget_gathered_sizes()  # as on a new group
        r, w = dc.get_rank(), dc.get_world_size()
        rests = ((3,), (), (2,), (4,), (1, 2))
        dtypes = [torch.float32, torch.float64, torch.float32, torch.int64, torch.float64]
        fn = dc.all_gather_coalesced if op == "all_gather" else dc.reduce_scatter_coalesced
        calls = []
        for grow in (1, 1, 3):
            sizes = [[grow * ((k + q) % 3) for q in range(w)] for k in range(5)]
            if op == "all_gather":  # rank r holds sizes[k][r] rows of tensor k
                shapes = [(sizes[k][r], *rests[k]) for k in range(5)]
            else:  # the same shapes everywhere; sizes[k] splits them
                shapes = [(sum(sizes[k]), *rests[k]) for k in range(5)]
            xs = [torch.ones(s, dtype=d).requires_grad_(d.is_floating_point) for s, d in zip(shapes, dtypes)]
            kw = {"split_sizes": sizes} if given else {}
            with B.log_comms() as fwd_log, profile(activities=[ProfilerActivity.CPU]) as fwd_prof:
                out = fn(xs, **kw)
            with B.log_comms() as bwd_log, profile(activities=[ProfilerActivity.CPU]) as bwd_prof:
                sum(o.sum() for o in out if o.requires_grad).backward()
            calls.append(
                {
                    "fwd_records": [(x.op, x.label, x.parts) for x in fwd_log.records],
                    "bwd_records": [(x.op, x.parts) for x in bwd_log.records],
                    "fwd_gloo": _gloo_calls(fwd_prof),
                    "bwd_gloo": _gloo_calls(bwd_prof),
                    "shapes": [tuple(o.shape) for o in out],
                    "expected": [
                        (sum(sizes[k]) if op == "all_gather" else sizes[k][r], *s[1:])
                        for k, s in enumerate(shapes)
                    ],
                }
            )
        return calls

    label = f"{op}_coalesced" + ("(sum)" if op == "reduce_scatter" else "")
    data = (f"{op}_coalesced", label, 3)
    for calls in local_worlds(world_size).run(count_varied, op, given):
        for i, rec in enumerate(calls):
            assert rec["shapes"] == rec["expected"], rec
            if given:
                expected, gloo = [data], 3
            elif i == 0:
                expected, gloo = [("all_gather", "all_gather_coalesced -> size exchange", 1), data], 4
            elif i == 1:
                expected, gloo = [data], 3
            else:  # the first buffer did not fit the padding: gathered again
                expected, gloo = [(data[0], data[1], 4)], 4
            assert rec["fwd_records"] == expected, (i, rec)
            assert rec["fwd_gloo"] == gloo, (i, rec)
            assert rec["bwd_records"] == [(f"{BWD_NAME[op]}_coalesced", 2)], (i, rec)
            assert rec["bwd_gloo"] == 2, (i, rec)


@pytest.mark.parametrize("world_size", [2, 3])
# on processes: forward-mode AD (one stack of dual levels per process) and async_op=True
@pytest.mark.diffcomm_in_process(False)
@pytest.mark.usefixtures("debug_off")
def test_variable_sizes_torch_func_and_async(local_worlds, world_size) -> None:
    def varied_transforms() -> dict[str, Any]:
        """torch.func and async_op on sizes that differ between ranks, against the single ops."""
        from torch.func import grad, jvp, vjp, vmap

        r, w = dc.get_rank(), dc.get_world_size()
        gen = torch.Generator().manual_seed(r)
        a = torch.randn(r + 1, 3, dtype=F64, generator=gen)
        b = torch.randn(2, w - r, dtype=torch.float32, generator=gen)  # varies along dim 1
        split = [[k + 1 for k in range(w)], [w - k for k in range(w)]]
        c = torch.randn(sum(split[0]), 2, dtype=F64, generator=gen)
        d = torch.randn(sum(split[1]), dtype=F64, generator=gen)

        def prog(a, b, c, d, async_op=False):
            (g1,) = dc.all_gather_coalesced([a], dim=0, async_op=async_op)
            (g2,) = dc.all_gather_coalesced([b.t()], dim=0, async_op=async_op)
            s1, s2 = dc.reduce_scatter_coalesced([c, d], split_sizes=split, async_op=async_op)
            return (g1.sin() * g1).sum() + (g2 * g2).sum().to(F64) + (s1**3).sum() + (s2 * s2).sum()

        def prog_single(a, b, c, d):
            g1, g2 = dc.all_gather(a, 0), dc.all_gather(b.t(), 0)
            s1, s2 = dc.reduce_scatter(c, split_sizes=split[0]), dc.reduce_scatter(d, split_sizes=split[1])
            return (g1.sin() * g1).sum() + (g2 * g2).sum().to(F64) + (s1**3).sum() + (s2 * s2).sum()

        args = (a, b, c, d)
        errs: dict[str, Any] = {}
        got, want = grad(prog, argnums=(0, 1, 2, 3))(*args), grad(prog_single, argnums=(0, 1, 2, 3))(*args)
        errs["grad"] = max(float((x - y).abs().max()) for x, y in zip(got, want))
        _, pull = vjp(prog, *args)
        errs["vjp"] = max(
            float((x - y).abs().max()) for x, y in zip(pull(torch.tensor(1.0, dtype=F64)), want)
        )
        ts = tuple(torch.randn(x.shape, dtype=x.dtype, generator=gen) for x in args)
        errs["jvp"] = float((jvp(prog, args, ts)[1] - jvp(prog_single, args, ts)[1]).abs())
        # async_op=True: values, gradients and double backward equal the blocking op's
        leaves = [x.clone().requires_grad_(True) for x in args]
        y_async = prog(*leaves, async_op=True)
        g_async = torch.autograd.grad(y_async, leaves, create_graph=True)
        gg_async = torch.autograd.grad(sum((g * g).sum() for g in g_async), leaves)
        leaves2 = [x.clone().requires_grad_(True) for x in args]
        y_ref = prog_single(*leaves2)
        g_ref = torch.autograd.grad(y_ref, leaves2, create_graph=True)
        gg_ref = torch.autograd.grad(sum((g * g).sum() for g in g_ref), leaves2)
        errs["async"] = float((y_async - y_ref).abs())
        errs["async_grad"] = max(float((x - y).abs().max()) for x, y in zip(g_async, g_ref))
        errs["async_double"] = max(float((x - y).abs().max()) for x, y in zip(gg_async, gg_ref))

        # vmap: one communication per dtype for the whole batch, the sizes learned once
        def f(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
            return dc.all_gather_coalesced([x, y], dim=0)

        from _shared import forget_gathered_sizes

        forget_gathered_sizes()  # as on a new group: the sizes are exchanged once, first
        xb = torch.randn(4, r + 1, 3, dtype=F64, generator=gen)
        yb = torch.randn(4, w - r, dtype=torch.float32, generator=gen)
        with B.log_comms() as batched:
            outs = vmap(f)(xb, yb)
        loop = [f(xb[i], yb[i]) for i in range(4)]
        errs["vmap"] = max(
            float((o[i] - lp[k]).abs().max()) for k, o in enumerate(outs) for i, lp in enumerate(loop)
        )
        errs["vmap_calls"] = [(x.op, x.parts) for x in batched.records]
        return errs

    for e in local_worlds(world_size).run(varied_transforms):
        for key in ("grad", "vjp", "jvp", "async", "async_grad", "async_double"):
            assert e[key] < 1e-9, (key, e)
        assert e["vmap"] == 0.0, e
        assert e["vmap_calls"] == [("all_gather", 1), ("all_gather_coalesced", 2)], e


# on processes: counts communications with torch.profiler: one profiler per process
@pytest.mark.diffcomm_in_process(False)
def test_product_backward_costs_one_more_collective_per_dtype(world2) -> None:
    """An all_reduce of the gradients (with the zero counts in the same buffers) and a
    product all_reduce of the non-zero inputs (zero-safe product of the others), each one
    call per dtype."""

    def product_comms() -> list[int]:
        from torch.profiler import ProfilerActivity, profile

        xs = [torch.randn(3, requires_grad=True), torch.randn(2, dtype=torch.float64, requires_grad=True)]
        out = dc.all_reduce_coalesced(xs, "product")
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            (out[0].sum() + out[1].sum()).backward()
        return [_gloo_calls(prof)]

    for (n,) in world2.run(product_comms):
        assert n == 4


# --------------------------------------------------------------------------------------
# torch.func and torch.compile
# --------------------------------------------------------------------------------------


def _prog(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Every coalesced op once, mixed dtypes; returns a scalar."""
    w = dc.get_world_size()
    s1, s2 = dc.all_reduce_coalesced([a * 2, b.sin()])
    m1, m2 = dc.all_reduce_coalesced([a, b], "max")
    p1, p2 = dc.broadcast_coalesced([a.exp(), b], src=w - 1)
    g1, g2 = dc.all_gather_coalesced([a, b], dim=0)
    r1, r2 = dc.reduce_scatter_coalesced([g1, g2], dim=0, op="avg")
    total = (s1 * m1).sum() + (s2 * m2).sum().to(a.dtype) + p1.sum() + p2.sum().to(a.dtype)
    return total + (g1.cos().sum() + g2.sum().to(a.dtype)) + (r1 * r1).sum() + (r2 * r2).sum().to(a.dtype)


def _prog_single(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    w = dc.get_world_size()
    s1, s2 = dc.all_reduce(a * 2), dc.all_reduce(b.sin())
    m1, m2 = dc.all_reduce(a, "max"), dc.all_reduce(b, "max")
    p1, p2 = dc.broadcast(a.exp(), src=w - 1), dc.broadcast(b, src=w - 1)
    g1, g2 = dc.all_gather(a, 0), dc.all_gather(b, 0)
    r1, r2 = dc.reduce_scatter(g1, 0, "avg"), dc.reduce_scatter(g2, 0, "avg")
    total = (s1 * m1).sum() + (s2 * m2).sum().to(a.dtype) + p1.sum() + p2.sum().to(a.dtype)
    return total + (g1.cos().sum() + g2.sum().to(a.dtype)) + (r1 * r1).sum() + (r2 * r2).sum().to(a.dtype)


# on processes: forward-mode AD: one stack of dual levels per process (docs/in_process.md, Limits)
@pytest.mark.diffcomm_in_process(False)
@pytest.mark.usefixtures("debug_off")
def test_torch_func_grad_vjp_jvp_vmap(world2) -> None:
    def func_transforms() -> dict[str, Any]:
        from torch.func import grad, jvp, vjp, vmap

        r = dc.get_rank()
        gen = torch.Generator().manual_seed(r)
        a = torch.randn(2, 3, dtype=torch.float64, generator=gen)
        b = torch.randn(3, dtype=torch.float32, generator=gen)
        ta, tb = torch.randn_like(a), torch.randn(3, generator=gen)
        errs: dict[str, Any] = {}
        ga, gb = grad(_prog, argnums=(0, 1))(a, b)
        ra, rb = grad(_prog_single, argnums=(0, 1))(a, b)
        errs["grad"] = [float((ga - ra).abs().max()), float((gb - rb).abs().max())]
        _, pull = vjp(_prog, a, b)
        va, vb = pull(torch.tensor(1.0, dtype=torch.float64))
        errs["vjp"] = [float((va - ra).abs().max()), float((vb - rb).abs().max())]
        _, t = jvp(_prog, (a, b), (ta, tb))
        _, t_ref = jvp(_prog_single, (a, b), (ta, tb))
        errs["jvp"] = float((t - t_ref).abs().max())

        # vmap: one communication per dtype for the whole batch (as many raw calls as unbatched)
        def f(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
            return dc.all_reduce_coalesced([x, y * 2, x.sum(0)], "sum") + dc.all_gather_coalesced(
                [x, y], dim=-1
            )

        xb = torch.randn(4, 2, 3, dtype=torch.float64, generator=gen)
        yb = torch.randn(4, 3, dtype=torch.float32, generator=gen)
        f(xb[0], yb[0]), vmap(f)(xb, yb)  # the group learns the lists' sizes (see the counts test)
        with B.log_comms() as one:
            f(xb[0], yb[0])
        with B.log_comms() as batched:
            outs = vmap(f)(xb, yb)
        loop = [f(xb[i], yb[i]) for i in range(4)]
        errs["vmap"] = max(
            float((o[i] - lp[k]).abs().max()) for k, o in enumerate(outs) for i, lp in enumerate(loop)
        )
        errs["vmap_calls"] = (
            [(x.op, x.parts) for x in one.records],
            [(x.op, x.parts) for x in batched.records],
        )
        with B.log_comms() as partly:  # y unbatched (in_dims None) still shares the calls
            vmap(f, in_dims=(0, None))(xb, yb[0])
        errs["vmap_partly"] = [(x.op, x.parts) for x in partly.records]
        # grad under vmap: per-example gradients, one backward call per dtype
        per = vmap(grad(lambda x, y: sum(o.sum() for o in f(x, y))))(xb, yb)
        ref = torch.stack([grad(lambda x, y: sum(o.sum() for o in f(x, y)))(xb[i], yb[i]) for i in range(4)])
        errs["vmap_grad"] = float((per - ref).abs().max())
        return errs

    for e in world2.run(func_transforms):
        assert max(e["grad"]) < 1e-5 and max(e["vjp"]) < 1e-5 and e["jvp"] < 1e-5, e
        assert e["vmap"] == 0.0 and e["vmap_grad"] < 1e-6, e
        one, batched = e["vmap_calls"]
        assert one == batched == [("all_reduce_coalesced", 2), ("all_gather_coalesced", 2)], e
        assert e["vmap_partly"] == one, e


def test_torch_compile_fullgraph(world2) -> None:
    def compiled() -> dict[str, float]:
        torch._dynamo.reset()
        r = dc.get_rank()
        a = torch.arange(6.0, dtype=torch.float64).reshape(2, 3).add(r).requires_grad_(True)
        b = torch.arange(3.0, dtype=torch.float32).add(2 * r).requires_grad_(True)
        fn = torch.compile(_prog, fullgraph=True, backend="aot_eager")
        y = fn(a, b)
        ga, gb = torch.autograd.grad(y, (a, b))
        y_ref = _prog(a, b)
        ra, rb = torch.autograd.grad(y_ref, (a, b))
        return {
            "value": (y - y_ref).abs().item(),
            "grad_a": float((ga - ra).abs().max()),
            "grad_b": float((gb - rb).abs().max()),
        }

    for e in world2.run(compiled):
        assert e["value"] < 1e-4 and e["grad_a"] < 1e-6 and e["grad_b"] < 1e-4, e


# --------------------------------------------------------------------------------------
# bad input: before any communication; debug mode: cross-rank list mismatches
# --------------------------------------------------------------------------------------

T = torch.ones(4, 3)
BAD = [
    (lambda: dc.all_reduce_coalesced([]), ValueError, r"`tensors` must be a non-empty list"),
    (lambda: dc.all_reduce_coalesced(T), TypeError, r"`tensors` must be a list or tuple of tensors"),
    (
        lambda: dc.broadcast_coalesced([T, 1.0]),
        TypeError,
        r"`tensors\[1\]` must be a torch.Tensor, got float",
    ),
    (
        lambda: dc.all_gather_coalesced([T, torch.ones(2, device="meta")]),
        ValueError,
        r"tensors on one device.*tensors\[1\] on meta",
    ),
    (
        lambda: dc.reduce_scatter_coalesced([T, torch.ones(3, 2)]),
        ValueError,
        r"`tensors\[1\]` must be of a size along dim 0 divisible by the group size 2",
    ),
    (
        lambda: dc.all_gather_coalesced([T, torch.tensor(1.0)]),
        ValueError,
        r"`tensors\[1\]` must be a tensor with",
    ),
    (lambda: dc.all_gather_coalesced([T], dim=2), ValueError, r"`dim` must be a dimension in \[-2, 2\)"),
    (
        lambda: dc.all_reduce_coalesced([T, torch.ones(2, dtype=torch.int64)], "avg"),
        ValueError,
        r"integer or bool tensor.*tensors\[1\]",
    ),
    (
        lambda: dc.all_reduce_coalesced([torch.ones(2, dtype=torch.complex64)], "max"),
        ValueError,
        r"complex",
    ),
    (lambda: dc.broadcast_coalesced([T], src=2), ValueError, r"`src` must be a group-local rank in \[0, 2\)"),
    (lambda: dc.all_reduce_coalesced([T], "xor"), ValueError, r"`op` must be one of"),
    (
        lambda: dc.all_gather_coalesced([T, T], split_sizes=[[4, 4]]),
        ValueError,
        r"`split_sizes` must be one entry per tensor \(2\)",
    ),
    (
        lambda: dc.all_gather_coalesced([T], split_sizes=[[3, 3]]),
        ValueError,
        r"`split_sizes\[0\]` must be to list tensors\[0\].shape\[0\]=4 at this rank's position",
    ),
    (
        lambda: dc.all_gather_coalesced([T], split_sizes=[[4, 4, 4]]),
        ValueError,
        r"`split_sizes\[0\]` must be a list of 2 ints",
    ),
    (
        lambda: dc.reduce_scatter_coalesced([T, T], split_sizes=[[1, 3], [2, 3]]),
        ValueError,
        r"`split_sizes\[1\]` must be sizes summing to 4",
    ),
    (
        lambda: dc.reduce_scatter_coalesced([T], split_sizes=[[-1, 5]]),
        ValueError,
        r"`split_sizes\[0\]` must be non-negative",
    ),
    (
        lambda: dc.reduce_scatter_coalesced([T], split_sizes=[4]),
        TypeError,
        r"`split_sizes\[0\]` must be a list",
    ),
]


class _IntRequiringGrad(torch.Tensor):
    """An integer tensor that claims to require grad (torch itself refuses to make one)."""

    @property
    def requires_grad(self) -> bool:  # type: ignore[override]
        return True


def test_bad_input_raises_before_any_communication(world2) -> None:
    def try_bad() -> list[tuple[str, str, int]]:
        out = []
        cases = [*BAD]
        fake = torch.ones(2, dtype=torch.int64).as_subclass(_IntRequiringGrad)
        cases.append((lambda: dc.all_reduce_coalesced([T, fake]), TypeError, "floating or complex"))
        for fn, _, _ in cases:
            with B.log_comms() as log:
                try:
                    fn()
                    out.append(("no error", "", log.count()))
                except (ValueError, TypeError) as exc:
                    out.append((type(exc).__name__, str(exc), log.count()))
        return out

    expected = [(cls, pat) for _, cls, pat in BAD] + [
        (TypeError, r"`tensors\[1\]` must be a floating or complex")
    ]
    for per_rank in world2.run(try_bad):
        for (cls, pat), (name, msg, comms) in zip(expected, per_rank):
            assert name == cls.__name__, (pat, name, msg)
            assert re.search(pat, msg), (pat, msg)
            assert comms == 0, f"communicated before raising: {msg}"
            assert "diffcomm." in msg and "(rank " in msg


def _in_debug_mode(call: Callable[[], object]) -> str:
    """Shared rank-side helper of the two debug-mode tests below: run ``call`` under
    ``dc.debug(True)``; the ``CrossRankMismatchError`` message, else the string ``call``
    returned, else ``"no error"``."""
    with dc.debug(True):
        try:
            out = call()
        except dc.CrossRankMismatchError as exc:
            return str(exc)
    return out if isinstance(out, str) else "no error"


@pytest.mark.parametrize(
    "kind,pattern",
    [
        ("length", r"length differs \(rank 0: 3, rank 1: 2, rank 2: 3\)"),
        (
            "shape",
            r"first at position 1 \(tensors\[1\]\): ranks \[0, 1\]: shape \[4\].*ranks \[2\]: shape \[5\]",
        ),
        ("dtype", r"first at position 2 .*ranks \[0, 2\]: shape \[1\] dtype float64.*ranks \[1\]: .*float32"),
    ],
)
# on processes: a cross-rank diagnosis (debug mode, the p2p protocol) needs per-rank state
@pytest.mark.diffcomm_in_process(False)
def test_debug_mode_names_ranks_and_first_differing_position(world3, kind, pattern) -> None:
    def mismatch(kind: str) -> str:
        r = dc.get_rank()
        ts = [torch.ones(2, 3), torch.ones(4), torch.ones(1, dtype=torch.float64)]
        if kind == "length" and r == 1:
            ts = ts[:2]
        if kind == "shape" and r == 2:
            ts[1] = torch.ones(5)
        if kind == "dtype" and r == 1:
            ts[2] = ts[2].float()
        return _in_debug_mode(lambda: dc.all_reduce_coalesced(ts))

    for msg in world3.run(mismatch, kind):
        assert re.search(pattern, msg), msg


@pytest.mark.parametrize("learned", [False, True], ids=["size_exchange", "sizes_with_rows"])
@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
@pytest.mark.usefixtures("debug_off")
# on processes: the sizes travel by the real backend's exchange (in-process: no exchange)
@pytest.mark.diffcomm_in_process(False)
def test_a_gathered_dim_that_differs_between_ranks_is_an_error_without_debug_mode(
    world3, learned: bool, async_op: bool
) -> None:
    """Rank 1 gathers a list of square tensors along dim 1, the others along dim 0: every
    size agreed and the same bytes moved, so every rank got a silently wrong value. The
    dims travel after the sizes, in the same exchange, and every rank raises."""

    def gathers_along_other_dims(learned: bool, async_op: bool) -> str:
        from _shared import forget_gathered_sizes

        from diffcomm.ops import engine

        forget_gathered_sizes()
        ts = [torch.arange(4.0).reshape(2, 2), torch.ones(3, 3)]
        if learned:  # the group has gathered such a list: the sizes go with the rows
            dc.all_gather_coalesced(ts)
        try:
            for t in dc.all_gather_coalesced(ts, dim=1 if dc.get_rank() == 1 else 0, async_op=async_op):
                engine.wait(t)
        except dc.CrossRankMismatchError as exc:
            return str(exc)
        return "no error"

    for msg in world3.run(gathers_along_other_dims, learned, async_op):
        assert msg.startswith("diffcomm.all_gather_coalesced(): the ranks must concatenate"), msg
        assert "ranks that agree: [0, 2] | [1]" in msg, msg


def test_dtype_codes_differ_and_every_rank_names_every_dtype() -> None:
    """Debug mode's per-tensor rows carry a dtype code: the same on every rank, one per torch
    dtype, and named by a rank that never used that dtype itself. (The codes were once a sum
    of the name's bytes, alike for float8_e4m3fnuz / float8_e5m2fnuz, and their names a table
    each process filled as it went: a rank that had never sent float64 printed a number.)"""
    from diffcomm.ops import packing

    dtypes = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    codes = {packing._dtype_code(d) for d in dtypes}
    assert len(codes) == len({str(d) for d in dtypes}), "two dtypes share a code"
    names = packing._dtype_names()
    for d in dtypes:
        assert names[packing._dtype_code(d)] == str(d).replace("torch.", "")
    row = [packing._dtype_code(torch.float8_e5m2fnuz), 0, 1, -1, 3]
    assert packing._decode(row, 1)[0][1] == "shape [3] dtype float8_e5m2fnuz requires_grad=False"


@pytest.mark.parametrize(
    "kind,pattern",
    [
        ("correct", r"^ok \[\(6, 3\), \(6, 4\), \(3,\), \(6, 3\), \(6, 4\), \(3,\), \((3|0), 2\)\]$"),
        (
            "other_dim",
            r"first at position 1 \(tensors\[1\]\): ranks \[0, 1\]: shape \[\*, 4\].*ranks \[2\]: "
            r"shape \[\*, 5\].*sizes along dim 0 may differ",
        ),
        ("split_sizes", r"split_sizes differs \(rank 0: \(3, 0, 3\), rank 1: \(2, 1, 3\), rank 2"),
    ],
)
# on processes: a cross-rank diagnosis (debug mode, the p2p protocol) needs per-rank state
@pytest.mark.diffcomm_in_process(False)
def test_debug_mode_accepts_variable_sizes_and_names_wrong_position(world3, kind, pattern) -> None:
    def debug_varied(kind: str) -> str:
        """Debug mode with sizes along dim that differ between ranks: correct calls pass,
        a wrong position is still named."""
        r = dc.get_rank()
        ts = [torch.ones(2, 3), torch.ones(r + 1, 4), torch.ones(r, dtype=torch.float64)]

        def calls() -> str | None:
            if kind == "correct":
                a = dc.all_gather_coalesced(ts)
                b = dc.all_gather_coalesced(ts, split_sizes=[[2, 2, 2], [1, 2, 3], [0, 1, 2]])
                c = dc.reduce_scatter_coalesced([torch.ones(6, 2)], split_sizes=[[3, 0, 3]])
                return f"ok {[tuple(t.shape) for t in a + b + c]}"
            if kind == "other_dim":
                if r == 2:
                    ts[1] = torch.ones(r + 1, 5)
                dc.all_gather_coalesced(ts)
            if kind == "split_sizes":
                split = [[3, 0, 3]] if r != 1 else [[2, 1, 3]]
                dc.reduce_scatter_coalesced([torch.ones(6, 2)], split_sizes=split)
            return None

        return _in_debug_mode(calls)

    for msg in world3.run(debug_varied, kind):
        assert re.search(pattern, msg), msg


# --------------------------------------------------------------------------------------
# finite differences across ranks (diffcomm.testing.gradcheck) for every coalesced op
# --------------------------------------------------------------------------------------


def test_gradcheck_every_coalesced_op(world3) -> None:
    def gradchecks() -> dict[str, bool]:
        from diffcomm.testing import gradcheck

        r, w = dc.get_rank(), dc.get_world_size()
        gen = torch.Generator().manual_seed(r)
        # away from ties and zeros; requiring grad, or gradcheck checks nothing (it now refuses:
        # this test checked nothing before)
        a = (torch.randn(w, 3, dtype=F64, generator=gen) + 3.0).requires_grad_()
        b = (torch.randn(2 * w, dtype=F64, generator=gen) + 3.0).requires_grad_()
        programs = {
            "all_reduce sum": lambda x, y: dc.all_reduce_coalesced([x, y]),
            "all_reduce max": lambda x, y: dc.all_reduce_coalesced([x, y], "max"),
            "all_reduce product": lambda x, y: dc.all_reduce_coalesced([x, y], "product"),
            "broadcast": lambda x, y: dc.broadcast_coalesced([x, y], src=w - 1),
            "reduce avg": lambda x, y: dc.reduce_coalesced([x, y], dst=0, op="avg"),
            "all_gather": lambda x, y: dc.all_gather_coalesced([x, y], dim=0),
            "reduce_scatter": lambda x, y: dc.reduce_scatter_coalesced([x, y], dim=0),
        }
        return {name: gradcheck(fn, [a, b]) for name, fn in programs.items()}

    for res in world3.run(gradchecks):
        assert all(res.values()), res


# --------------------------------------------------------------------------------------
# subgroups, non-contiguous tensors, comm-off switches, in-place on outputs
# --------------------------------------------------------------------------------------


@pytest.mark.usefixtures("debug_off")
def test_subgroups_noncontiguous_comm_off_inplace(world4) -> None:
    def subgroups_and_layouts() -> dict[str, Any]:
        import torch.distributed as dist

        r = dc.get_rank()
        g01, g23 = dist.new_group([0, 1]), dist.new_group([2, 3])  # every rank creates both
        mine = g01 if r < 2 else g23
        base = torch.arange(12.0, dtype=F64).reshape(3, 4) + r
        x = base.t().requires_grad_(True)  # non-contiguous input
        y = torch.tensor([1.0 + r], requires_grad=True)
        sx, sy = dc.all_reduce_coalesced([x, y], group=mine)
        c = torch.arange(12.0, dtype=F64).reshape(3, 4)
        (sx * c.t()).sum().backward(retain_graph=True)  # a transposed (non-contiguous) gradient
        (sy * 0).sum().backward()
        with B.comm_off("all_reduce_coalesced"), B.log_comms() as log:
            off = dc.all_reduce_coalesced([base, torch.ones(2)])
        outs = dc.broadcast_coalesced([torch.zeros(3), torch.zeros(2)], src=0)
        outs[0].add_(1.0)  # outputs are independent tensors: in place is fine
        return {
            "sx": sx.detach(),
            "grad": x.grad,
            "off_equal": torch.equal(off[0], base),
            "off_skipped": [(rec.op, rec.skipped) for rec in log.records],
            "inplace": (outs[0].tolist(), outs[1].tolist()),
        }

    for r, res in enumerate(world4.run(subgroups_and_layouts)):
        pair = [0, 1] if r < 2 else [2, 3]
        expect = sum(torch.arange(12.0, dtype=F64).reshape(3, 4).t() + k for k in pair)
        assert torch.equal(res["sx"], expect)
        assert torch.equal(res["grad"], 2 * torch.arange(12.0, dtype=F64).reshape(3, 4).t())
        assert res["off_equal"] and res["off_skipped"] == [("all_reduce_coalesced", True)]
        assert res["inplace"] == ([1.0, 1.0, 1.0], [0.0, 0.0])


@pytest.mark.usefixtures("debug_off")
def test_vmapped_all_gather_coalesced_costs_the_same_whatever_the_batch(world2) -> None:
    """Issue 45: under ``vmap`` a larger (or new) batch used to add a size exchange or a
    second gather (the learned sizes were remembered by the batched shapes and padded to
    rows that grow with the batch). Now every vmapped call costs what the unbatched call
    costs once the group knows the list: one gather per dtype — counted as communications
    (the logger's records and their raw calls) and as the flight recorder's entries."""

    def body() -> list[tuple[Any, ...]]:
        r = dc.get_rank()
        out = []
        dc.all_gather_coalesced(
            [torch.randn(2 + r, 2), torch.randn(3, dtype=torch.float64)]
        )  # the group learns the list
        for n in (0, 3, 6, 3, 6, 12):  # 0: the unbatched call again
            xs = torch.randn(max(n, 1), 2 + r, 2)  # rows along the gathered dim differ between ranks
            ys = torch.randn(max(n, 1), 3, dtype=torch.float64)
            before = max((e["seq"] for e in dc.flight_recorder()), default=0)
            with B.log_comms() as log:
                if n:
                    a, b = torch.func.vmap(lambda x, y: dc.all_gather_coalesced([x, y]))(xs, ys)
                else:
                    a, b = dc.all_gather_coalesced([xs[0], ys[0]])
            after = max(e["seq"] for e in dc.flight_recorder())
            assert a.shape == ((n, 5, 2) if n else (5, 2)), a.shape
            out.append((n, [(x.op, x.parts) for x in log.records], after - before))
        return out

    for per_rank in world2.run(body):
        costs = {(tuple(recs), fr) for _, recs, fr in per_rank}
        assert len(costs) == 1, per_rank
        # as the unbatched call once the group knows the list: one gather per dtype, no exchange
        assert per_rank[0][1] == [("all_gather_coalesced", 2)], per_rank
