"""Property tests of the eight collectives on real gloo ranks.

Every example runs :func:`diffcomm.testing.cases.run_case` on every rank of a shared
``LocalWorld``: forward equals a single-process reference of the whole SPMD program, the
gradient equals the reference gradient, the dot-product test with the dual op from the
table holds, double backward equals the reference's, the input is unchanged and the
output does not alias it.
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
import torch.distributed as dist
from _shared import check_in_batches
from hypothesis import strategies as st

import diffcomm as dc
from diffcomm import backend as B
from diffcomm.ops import registry as R
from diffcomm.ops.base import CommOp
from diffcomm.testing.cases import Case, run_case, standard_cases

WORLDS = [1, 2, 3, 4]
FLOATS = ["float64", "float32", "float16", "bfloat16"]


def _assert_ok(world: dc.LocalWorld, cases: list[Case]) -> None:
    """Run ``cases`` on every rank of ``world`` (the property tests and the standard cases)."""

    def check_all(cases: list[Case]) -> list[tuple[str, dict]]:
        out = []
        for c in cases:
            r = run_case(c)
            out.append((c.op + " " + c.label(), r.as_dict()))
        return out

    per_rank = world.run(check_all, cases)
    bad = [(rank, name, res) for rank, rr in enumerate(per_rank) for name, res in rr if not res["ok"]]
    assert not bad, "\n".join(f"rank {r}: {n}: {res}" for r, n, res in bad[:8])


# --------------------------------------------------------------------------------------
# strategies: one composite per op, for a given world size
# --------------------------------------------------------------------------------------


def _dtype_and_op(draw: st.DrawFn, ops: tuple[str, ...]) -> tuple[str, str, bool]:
    dtype = draw(st.sampled_from(FLOATS + ["complex128"]))
    allowed = [o for o in ops if not (dtype.startswith("complex") and o in ("max", "min"))]
    rop = draw(st.sampled_from(allowed))
    ints = rop in ("max", "min", "product") or dtype in ("float16", "bfloat16") or draw(st.booleans())
    return dtype, rop, ints


def _shape(draw: st.DrawFn, min_dims: int = 1, max_dims: int = 3) -> list[int]:
    return draw(st.lists(st.integers(1, 4), min_size=min_dims, max_size=max_dims))


def _splits(draw: st.DrawFn, world: int) -> list[int]:
    return draw(st.lists(st.integers(0, 3), min_size=world, max_size=world))


@st.composite
def cases(draw: st.DrawFn, op: str, world: int) -> Case:
    seed = draw(st.integers(0, 10_000))
    all_ops = ("sum", "avg", "max", "min", "product")
    if op in ("all_reduce", "reduce"):
        dtype, rop, ints = _dtype_and_op(draw, all_ops)
        kw: dict = {"op": rop}
        if op == "reduce":
            kw["dst"] = draw(st.integers(0, world - 1))
        return Case(op, world, tuple(_shape(draw)), dtype, kw, seed=seed, ints=ints)
    if op == "broadcast":
        dtype, _, ints = _dtype_and_op(draw, ("sum",))
        src = draw(st.integers(0, world - 1))
        return Case(op, world, tuple(_shape(draw)), dtype, {"src": src}, seed=seed, ints=ints)
    if op in ("all_gather", "gather"):
        dtype, _, ints = _dtype_and_op(draw, ("sum",))
        shape = _shape(draw)
        dim = draw(st.integers(-len(shape), len(shape) - 1))
        uneven = draw(st.booleans())
        sizes = tuple(_splits(draw, world)) if uneven else None
        kw = {"dim": dim}
        if op == "gather":
            kw["dst"] = draw(st.integers(0, world - 1))
        case = Case(op, world, tuple(shape), dtype, kw, sizes=sizes, seed=seed, ints=ints)
        if dim < 0:  # the reference indexes sizes by the normalised dim
            case = Case(
                op, world, tuple(shape), dtype, {**kw, "dim": dim % len(shape)}, sizes, None, seed, ints
            )
        return case
    if op in ("reduce_scatter", "scatter"):
        ops = all_ops if op == "reduce_scatter" else ("sum",)
        dtype, rop, ints = _dtype_and_op(draw, ops)
        shape = _shape(draw)
        dim = draw(st.integers(0, len(shape) - 1))
        kw = {"dim": dim}
        if draw(st.booleans()):
            split = _splits(draw, world)
            shape[dim] = sum(split)
            kw["split_sizes"] = split
        else:
            shape[dim] = world * draw(st.integers(1, 3))
        if op == "reduce_scatter":
            kw["op"] = rop
        else:
            kw["src"] = draw(st.integers(0, world - 1))
        return Case(op, world, tuple(shape), dtype, kw, seed=seed, ints=ints)
    if op == "all_to_all":
        dtype, _, ints = _dtype_and_op(draw, ("sum",))
        shape = _shape(draw, 1, 3)
        sd = draw(st.integers(0, len(shape) - 1))
        cd = draw(st.integers(0, len(shape) - 1))
        kw = {"split_dim": sd, "concat_dim": cd}
        a2a = None
        if sd == cd and draw(st.booleans()):
            a2a = tuple(tuple(_splits(draw, world)) for _ in range(world))
            kw["infer_outputs"] = draw(st.booleans())
        else:
            shape[sd] = world * draw(st.integers(1, 2))
        return Case(op, world, tuple(shape), dtype, kw, a2a=a2a, seed=seed, ints=ints)
    raise ValueError(op)


# --------------------------------------------------------------------------------------
# the property tests: every op x every world size
# --------------------------------------------------------------------------------------


# Where the ranks run: in-process (LocalWorld(n, in_process=True), the full property test:
# the values are the same as on processes, tests/runtime/test_in_process.py) and on real
# gloo processes (fewer examples: the transport, the sizes on the wire).
WHERE = {"in_process": 12, "processes": 3}


@pytest.mark.parametrize("where", list(WHERE))
@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("op", list(R.family("collective", ())))  # diffcomm's own
def test_op_matches_reference(local_worlds, op: str, world_size: int, where: str) -> None:
    world = local_worlds(world_size, in_process=where == "in_process")
    check_in_batches(world, cases(op, world_size), _assert_ok, max_examples=WHERE[where])


@pytest.mark.parametrize("where", list(WHERE))
@pytest.mark.parametrize("world_size", WORLDS)
def test_standard_cases(local_worlds, world_size: int, where: str) -> None:
    """The fixed case list `python -m diffcomm check` runs (every op, op, dtype, uneven)."""
    _assert_ok(local_worlds(world_size, in_process=where == "in_process"), list(standard_cases(world_size)))


# --------------------------------------------------------------------------------------
# the dual table
# --------------------------------------------------------------------------------------


def test_dual_table_is_an_involution() -> None:
    pairs = {
        "all_reduce": "all_reduce",
        "broadcast": "reduce",
        "all_gather": "reduce_scatter",
        "gather": "scatter",
        "all_to_all": "all_to_all",
    }
    own = R.family("collective", ())  # (a user's module may register more: test_adding_an_op)
    assert set(own) == set(pairs) | set(pairs.values())  # the eight collectives, no more
    assert set(own) <= set(dc.DUALS)
    for a, b in pairs.items():
        assert dc.dual(a) == b and dc.dual(b) == a
    for op in own:
        assert dc.dual(dc.dual(op)) == op
        assert callable(dc.OPS[op].fn) and dc.OPS[op].fn is getattr(dc, op)
    with pytest.raises(ValueError, match="unknown op 'psum'"):
        dc.dual("psum")


def test_docs_table_is_generated_from_the_code() -> None:
    from diffcomm.ops.collectives import duals_markdown

    table = duals_markdown()
    for op, d in dc.DUALS.items():
        assert f"| `{op}` |" in table and f"`{d}`" in table


def test_one_registry_holds_every_family() -> None:
    """Every per-family table is a view of the one registry; duals close per family; each
    op's class is the single source (its transpose calls its dual's class)."""
    from diffcomm.ops import coalesced, p2p

    assert dict(dc.OPS) == {n: R.entry(c) for n, c in R.family("collective").items()}
    assert set(p2p.OPS) == set(R.family("p2p"))
    assert set(coalesced.COALESCED_OPS) == set(R.family("coalesced"))
    for name, cls in R.REGISTRY.items():
        assert cls.dual.family == cls.family, name
        assert R.dual(R.dual(name)) == name
        assert cls.dual.dual is cls
    assert R.verify() == []
    # the testing kit walks exactly the ops with an argument map and a serial reference
    own = {n for n, c in R.with_reference().items() if R.builtin(c)}
    assert own == set(R.family("collective", ())) | {"shift", "ppermute"}
    with pytest.raises(ValueError, match="registered twice"):

        class _AllReduceAgain(CommOp):  # another class claiming a registered name
            name = "all_reduce"
            family = "collective"
            dual = R.SELF
            forward_text = backward_text = "-"

    with pytest.raises(ValueError, match="unknown family"):

        class _Nope(CommOp):
            name = "nope"
            family = "nope"

    paired = re.escape("dual('my_reduce') = 'all_gather' but dual('all_gather') = 'reduce_scatter'")
    with pytest.raises(ValueError, match=paired):

        class _MyReduce(CommOp):  # a dual already paired with another op is refused
            name = "my_reduce"
            family = "collective"
            dual = R.REGISTRY["all_gather"]
            forward_text = backward_text = "-"

    assert "my_reduce" not in R.REGISTRY and "nope" not in R.REGISTRY

    # a transpose that does not call its dual's class is reported by verify()
    class _Twice(CommOp):
        name = "twice_test_op"
        family = "collective"
        dual = R.SELF
        forward_text = backward_text = "-"

        @staticmethod
        def run(x: torch.Tensor) -> torch.Tensor:
            return 2 * x

        @staticmethod
        def transpose(g: torch.Tensor) -> torch.Tensor:
            return 2 * g  # right values, but not through the dual op (no double backward)

    try:
        problems = R.verify()
    finally:
        del R.REGISTRY["twice_test_op"]
    assert any(p.startswith("twice_test_op: transpose does not call its dual's class") for p in problems)
    assert any(p.startswith("twice_test_op: no out_shape") for p in problems), problems
    assert R.verify() == []
    assert R.markdown("collective") == dc.ops.collectives.duals_markdown()


def test_every_backward_runs_the_dual_its_class_names(world3: dc.LocalWorld) -> None:
    """At run time too: the backward of every registered op with a reference (the
    collectives, shift, ppermute) communicates under its dual's label, nested under its own
    (``"gather backward -> scatter"``): the transpose calls the dual's class."""
    from diffcomm.backend import log_comms
    from diffcomm.testing.cases import call, make_inputs, standard_cases, standard_p2p_cases

    def rank_body() -> dict[str, list[str]]:
        seen: dict[str, list[str]] = {}
        for case in [*standard_cases(3), *standard_p2p_cases(3)]:
            if case.op in seen or case.op not in R.with_reference() or case.dtype != "float64":
                continue
            x = make_inputs(case, "x")[dc.get_rank()].requires_grad_(True)
            y = call(case, x)
            with log_comms() as log:
                torch.autograd.grad(y, x, torch.ones_like(y))
            seen[case.op] = [r.label or "" for r in log.records]
        return seen

    # diffcomm's own ops: a user's ops registered in this process (tests/ops/test_adding_an_op.py
    # defines some) are not imported on the ranks
    own = {name for name, cls in R.with_reference().items() if cls.__module__.startswith("diffcomm.")}
    for seen in world3.run(rank_body):
        assert set(seen) == own, seen
        for op, labels in seen.items():
            dual = R.dual(op)
            assert labels and any(" backward -> " + dual in lb for lb in labels), (op, labels)


# --------------------------------------------------------------------------------------
# pitfalls pinned down explicitly
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [3, 4])
def test_max_min_ties_product_zeros_avg(local_worlds, world_size: int) -> None:
    def ties_and_zeros() -> dict:
        r, w = dc.get_rank(), dc.get_world_size()
        out = {}
        # every rank holds the same max: the summed gradient is split evenly
        x = torch.full((3,), 5.0, dtype=torch.float64, requires_grad=True)
        dc.all_reduce(x, "max").sum().backward()
        out["max_tie"] = x.grad.clone()
        # min held by ranks 0 and 1 only
        x = torch.tensor([1.0 if r < 2 else 3.0], dtype=torch.float64, requires_grad=True)
        (dc.all_reduce(x, "MIN") * (r + 1)).sum().backward()
        out["min_two"] = x.grad.clone()
        # product with one zero (rank 0) and with two zeros (ranks 0, 1)
        for name, zeros in (("prod_one_zero", 1), ("prod_two_zeros", 2)):
            x = torch.tensor([0.0 if r < zeros else 2.0 + r], dtype=torch.float64, requires_grad=True)
            dc.all_reduce(x, torch.distributed.ReduceOp.PRODUCT).sum().backward()
            out[name] = x.grad.clone()
        # avg scales by 1/world
        x = torch.ones(2, dtype=torch.float64, requires_grad=True)
        dc.all_reduce(x, "avg").sum().backward()
        out["avg"] = x.grad.clone()
        # broadcast: non-source ranks get exact zeros
        x = torch.randn(4, dtype=torch.float64, requires_grad=True)
        dc.broadcast(x, src=w - 1).pow(2).sum().backward()
        out["bcast_zero"] = bool((x.grad == 0).all()) if r != w - 1 else True
        return out

    w = world_size
    res = local_worlds(w).run(ties_and_zeros)
    total_weight = sum(range(1, w + 1))
    for r, o in enumerate(res):
        assert torch.equal(o["max_tie"], torch.full((3,), w / w, dtype=torch.float64))  # W grads / W ties
        expect_min = total_weight / 2 if r < 2 else 0.0
        assert o["min_two"].item() == pytest.approx(expect_min)
        others = [0.0 if k < 1 else 2.0 + k for k in range(w) if k != r]
        expect = w * torch.tensor(others).prod().item()
        assert o["prod_one_zero"].item() == pytest.approx(expect)
        assert o["prod_two_zeros"].item() == 0.0
        assert torch.allclose(o["avg"], torch.ones(2, dtype=torch.float64))
        assert o["bcast_zero"]


_NAN = float("nan")
#: per rank: a NaN on rank 1 only, on rank 0 only, on both, a tie, a NaN beside -inf
_NAN_VALUES = ([1.0, _NAN, 2.0, 5.0, _NAN, -1.0], [_NAN, 3.0, 0.5, 5.0, _NAN, -float("inf")])


def _nan_extrema() -> dict:
    r, out = dc.get_rank(), {}
    w = torch.arange(1.0, 7.0, dtype=torch.float64)
    for op in ("max", "min"):
        x = torch.tensor(_NAN_VALUES[r], dtype=torch.float64, requires_grad=True)
        y = dc.all_reduce(x, op)
        (y * w).nansum().backward()
        out[op] = (y.detach(), x.grad)
        for dtype in (torch.float32, torch.bfloat16):
            v = torch.tensor(_NAN_VALUES[r], dtype=dtype)
            out[op, dtype, "reduce"] = dc.reduce(v, 0, op)
            out[op, dtype, "reduce_scatter"] = dc.reduce_scatter(torch.cat([v, v]), op=op)
            out[op, dtype, "coalesced"] = torch.cat(dc.all_reduce_coalesced([v, v[:2].double()], op))
            out[op, dtype, "reduce_coalesced"] = torch.cat(dc.reduce_coalesced([v, v[:2]], 0, op))
            out[op, dtype, "traced"] = B.TraceableBackend().reduce(v, 1, op, None)  # torch.compile's
    return out


def _plain_ops_under_autocast() -> list[str]:
    r, bad = dc.get_rank(), []
    ops = {
        "all_to_all across dims": lambda x: [dc.all_to_all(x, split_dim=1, concat_dim=0)],
        "uneven all_to_all": lambda x: [
            dc.all_to_all(x, 0, 0, None, [1 + 2 * r, 3 - 2 * r], [1, 3][:: 1 - 2 * r])
        ],
        "uneven scatter": lambda x: [dc.scatter(x, 0, split_sizes=[1, 3])],
        "uneven gather": lambda x: [dc.gather(x[: 1 + r], 0)],
        "uneven all_gather": lambda x: [dc.all_gather(x[: 1 + r])],
        "all_gather_coalesced": lambda x: dc.all_gather_coalesced([x, x[0]]),
        "broadcast_coalesced": lambda x: dc.broadcast_coalesced([x, x[0]], src=1),
        "uneven reduce_scatter": lambda x: [dc.reduce_scatter(x, split_sizes=[1, 3])],
        "all_reduce_coalesced": lambda x: dc.all_reduce_coalesced([x, x[0]]),
        "reduce_coalesced": lambda x: dc.reduce_coalesced([x, x[0]]),
        "reduce_scatter_coalesced": lambda x: dc.reduce_scatter_coalesced([x, x[:2]]),
    }
    for dtype in (torch.float16, torch.float8_e4m3fn):
        for name, op in ops.items():
            if dtype != torch.float16 and "reduce" in name:
                continue  # (fp8 is not reduced without precision=)
            runs = []
            for on in (False, True):
                x = (
                    (torch.arange(24.0).reshape(4, 6) / 4 + r)
                    .to(dtype)
                    .requires_grad_(dtype == torch.float16)
                )
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=on):
                    ys = op(x)
                    if x.requires_grad:
                        sum(
                            (y.float() * (1 + torch.arange(y.numel()).view(y.shape))).sum() for y in ys
                        ).backward()
                runs.append([y.detach() for y in ys] + ([x.grad] if x.requires_grad else []))
            if not all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(*runs)):
                bad.append(f"{dtype} {name}")
    return bad


def test_plain_ops_under_autocast_equal_outside(world2) -> None:
    """A collective's buffers are not autocast's math: under CPU ``torch.autocast`` (bf16),
    float16 and fp8 tensors through an all_to_all across dims, an uneven scatter / gather /
    reduce_scatter, the coalesced ops failed in the backend's ``torch.cat`` ("Unexpected
    floating ScalarType in at::autocast::prioritize"); now the values and gradients equal
    the op outside autocast."""
    for bad in world2.run(_plain_ops_under_autocast):
        assert not bad, bad


@pytest.mark.diffcomm_in_process(False)
def test_max_min_propagate_nan_from_any_rank(local_worlds) -> None:
    """A NaN on any rank makes a floating max/min NaN there, as torch's ``amax`` of the
    stacked values and as in-process: gloo's max/min keep the non-NaN operand, so a NaN on
    rank 1 beside 1.0 on rank 0 gave 1.0 (and its gradient 1 to rank 0, 0 to rank 1)."""
    stacked = torch.tensor(_NAN_VALUES, dtype=torch.float64, requires_grad=True)
    w = torch.arange(1.0, 7.0, dtype=torch.float64)
    procs, inproc = local_worlds(2).run(_nan_extrema), local_worlds(2, in_process=True).run(_nan_extrema)
    for op, amax in (("max", torch.amax), ("min", torch.amin)):
        stacked.grad = None
        y = amax(stacked, 0)
        (y * w).nansum().backward()  # one rank's objective; every rank's: twice the gradient
        for r in range(2):
            got, grad = procs[r][op]
            torch.testing.assert_close(got, y.detach(), equal_nan=True)
            torch.testing.assert_close(grad, 2 * stacked.grad[r], equal_nan=True)
            for key, value in procs[r].items():
                torch.testing.assert_close(value, inproc[r][key], equal_nan=True, msg=str(key))
        for dtype in (torch.float32, torch.bfloat16):
            ref = y.detach().to(dtype)
            torch.testing.assert_close(procs[0][op, dtype, "reduce"], ref, equal_nan=True)
            torch.testing.assert_close(procs[1][op, dtype, "reduce_scatter"], ref, equal_nan=True)
            torch.testing.assert_close(procs[1][op, dtype, "traced"], ref, equal_nan=True)


def _nan_extrema_under_autocast() -> list[str]:
    r, bad = dc.get_rank(), []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for op in ("max", "min"):
            v = torch.tensor(_NAN_VALUES[r], dtype=dtype)
            got = []
            for on in (False, True):
                try:
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=on):
                        got.append((dc.all_reduce(v, op), B.TraceableBackend().all_reduce(v, op, None)))
                except RuntimeError as err:
                    return [f"{dtype} {op} autocast={on}: {err}"]  # (the other rank raises too)
            for plain, under in zip(*got):
                if not torch.equal(plain.isnan(), under.isnan()) or under.dtype != dtype:
                    bad.append(f"{dtype} {op}: {under} for {plain}")
    return bad


@pytest.mark.diffcomm_in_process(False)
def test_max_min_nan_flags_under_autocast(local_worlds) -> None:
    """A floating max/min whose NaNs travel as flags (gloo) under CPU ``torch.autocast``
    equals the op outside it. Before: the values and flags were joined by ``torch.stack``,
    which CPU autocast refuses for float16 (RuntimeError "Unexpected floating ScalarType in
    at::autocast::prioritize", where the op before the flags ran)."""
    for bad in local_worlds(2).run(_nan_extrema_under_autocast):
        assert not bad, bad


def test_noncontiguous_inputs_and_gradients(world3) -> None:
    def noncontiguous() -> list[float]:
        r = dc.get_rank()
        base = torch.arange(12.0, dtype=torch.float64).reshape(3, 4) + r
        x = base.t().requires_grad_(True)  # non-contiguous input
        y = dc.all_gather(x, dim=1)
        c = torch.arange(float(y.numel()), dtype=torch.float64).reshape(y.shape[1], y.shape[0]).t()
        (y * c).sum().backward()  # gradient arriving as a transposed (non-contiguous) view
        # reference: each rank's grad = sum over ranks of its block of c = W * block
        w = dc.get_world_size()
        block = c[:, r * 3 : (r + 1) * 3]
        return [float((x.grad - w * block).abs().max()), float((x.detach() - base.t()).abs().max())]

    for err, changed in world3.run(noncontiguous):
        assert err == 0.0 and changed == 0.0


def test_integer_bool_complex_forward(world3) -> None:
    def integer_forward() -> list:
        r = dc.get_rank()
        x = torch.tensor([r, 2 * r], dtype=torch.int64)
        b = torch.tensor([r % 2 == 0, True])
        return [
            dc.all_reduce(x, "sum").tolist(),
            dc.all_reduce(x, "max").tolist(),
            dc.all_reduce(b, "min").tolist(),
            dc.all_gather(x).tolist(),
            dc.all_to_all(torch.arange(3, dtype=torch.int32) + 3 * r).tolist(),
            dc.all_reduce(torch.tensor([1.0 + r], dtype=torch.complex64), "product").tolist(),
        ]

    res = world3.run(integer_forward)
    for r, (s, m, b, g, a, p) in enumerate(res):
        assert s == [3, 6] and m == [2, 4] and b == [False, True]
        assert g == [0, 0, 1, 2, 2, 4]
        assert a == [r, 3 + r, 6 + r]
        assert p == [complex(6.0)]


_NARROW_BITS = {"int16": (16, True), "uint16": (16, False), "uint32": (32, False), "uint64": (64, False)}


def _narrow_values(name: str, r: int) -> list[int]:
    """Per rank: the dtype's extremes, values that overflow a sum or product, and ``r``."""
    bits, signed = _NARROW_BITS[name]
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    return [lo, hi, hi - 3 * r, lo + 7 * r, 3 + r, 2 ** (bits // 2) + r]


def _wrap(v: int, name: str) -> int:
    bits, signed = _NARROW_BITS[name]
    v %= 2**bits
    return v - 2**bits if signed and v >= 2 ** (bits - 1) else v


def test_integer_dtypes_gloo_cannot_take_move_and_reduce_exactly(world3) -> None:
    """int16 / uint16 / uint32 / uint64: c10d's gloo raised "Invalid scalar type" in every
    op (all_gather of int16 but not of uint16...), and fp8 broadcast too. They move as
    bytes now, and reduce in a wider dtype (uint64: its bits as int64, the sign bit flipped
    for max/min), with the dtype's own wrap-around for sum and product; an fp8 reduction
    is a TypeError naming the op, on every rank, before any communication."""

    def narrow(name: str) -> dict[str, list[int] | str]:
        dtype = getattr(torch, name)
        r = dc.get_rank()
        x = torch.tensor(_narrow_values(name, r), dtype=dtype)
        out: dict[str, list[int] | str] = {
            op: dc.all_reduce(x, op).tolist() for op in ("sum", "max", "min", "product")
        }
        out["reduce"] = dc.reduce(x, dst=1, op="sum").tolist()
        out["reduce_scatter"] = dc.reduce_scatter(x, op="max").tolist()
        out["all_gather"] = dc.all_gather(x).tolist()
        out["broadcast"] = dc.broadcast(x, src=2).tolist()
        out["all_to_all"] = dc.all_to_all(x).tolist()
        out["scatter"] = dc.scatter(x, src=1).tolist()
        out["shift"] = dc.shift(x, 1).tolist()
        out["coalesced"] = dc.all_reduce_coalesced([x, x[:2]], "sum")[1].tolist()
        f8 = torch.ones(3).to(torch.float8_e4m3fn)
        out["fp8 broadcast"] = dc.broadcast(f8, src=0).float().tolist()
        for op in ("all_reduce", "reduce_scatter"):
            try:
                getattr(dc, op)(f8)
                out[f"fp8 {op}"] = "no error"
            except TypeError as err:
                out[f"fp8 {op}"] = str(err)
        return out

    for name in _NARROW_BITS:
        if not hasattr(torch, name):
            continue
        vals = [_narrow_values(name, r) for r in range(3)]
        cols = list(zip(*vals))
        want = {
            "sum": [_wrap(sum(c), name) for c in cols],
            "max": [max(c) for c in cols],
            "min": [min(c) for c in cols],
            "product": [_wrap(c[0] * c[1] * c[2], name) for c in cols],
        }
        for r, got in enumerate(world3.run(narrow, name)):
            for op in ("sum", "max", "min", "product"):
                assert got[op] == want[op], (name, op, got[op], want[op])
            assert got["reduce"] == (want["sum"] if r == 1 else [0] * 6), (name, got["reduce"])
            assert got["reduce_scatter"] == want["max"][2 * r : 2 * r + 2], name
            assert got["all_gather"] == [v for row in vals for v in row], name
            assert got["broadcast"] == vals[2] and got["scatter"] == vals[1][2 * r : 2 * r + 2], name
            assert got["all_to_all"] == [vals[q][2 * r + i] for q in range(3) for i in range(2)], name
            assert got["shift"] == vals[(r - 1) % 3] and got["coalesced"] == want["sum"][:2], name
            assert got["fp8 broadcast"] == [1.0] * 3
            for op in ("all_reduce", "reduce_scatter"):
                lead = f"diffcomm.{op}(): a float8_e4m3fn tensor cannot be reduced"
                assert got[f"fp8 {op}"].startswith(lead), got[f"fp8 {op}"]


def test_narrow_integer_bytes_keep_dim_0_in_all_to_all_and_0_dim_tensors_move(world3) -> None:
    """A narrow integer tensor travels as bytes; viewed directly, a 1-D one had twice (int16)
    or eight times (uint64) as many rows as its split sizes: an uneven all_to_all of it, and
    any all_to_all across dims (its buffer is 1-D), tore the world down with gloo's "Split
    sizes doesn't match total dim 0 size"; a 0-dim one raised torch's "self.dim() cannot be
    0 to view" in broadcast and the ring exchanges. Now they move like any dtype."""

    def narrow_moves(name: str) -> dict[str, list[int] | int]:
        dtype = getattr(torch, name)
        r, w = dc.get_rank(), dc.get_world_size()
        ins = [(r + j) % 3 for j in range(w)]
        flat = (torch.arange(sum(ins)) + 10 * r).to(dtype)
        grid = (torch.arange(2 * w * 2) + 100 * r).reshape(2 * w, 2).to(dtype)
        one = torch.tensor(r + 1, dtype=dtype)
        return {
            "uneven": dc.all_to_all(flat, input_split_sizes=ins).tolist(),
            "across": dc.all_to_all(grid, 0, 1).tolist(),
            "broadcast": dc.broadcast(one, src=w - 1).item(),
            "shift": dc.shift(one).item(),
            "sendrecv": dc.sendrecv(one, (r + 1) % w, (r - 1) % w).item(),
            "ppermute": dc.ppermute(one, [(0, w - 1)]).item(),
        }

    w = 3
    for name in _NARROW_BITS:
        if not hasattr(torch, name):
            continue
        sent = [[(q + j) % 3 for j in range(w)] for q in range(w)]
        flats = [[10 * q + i for i in range(sum(sent[q]))] for q in range(w)]
        grids = [torch.arange(2 * w * 2).reshape(2 * w, 2) + 100 * q for q in range(w)]
        for r, got in enumerate(world3.run(narrow_moves, name)):
            want = [v for q in range(w) for v in flats[q][sum(sent[q][:r]) : sum(sent[q][: r + 1])]]
            assert got["uneven"] == want, (name, r, got["uneven"], want)
            assert got["across"] == torch.cat([g[2 * r : 2 * r + 2] for g in grids], 1).tolist(), name
            assert got["broadcast"] == w and got["sendrecv"] == got["shift"] == (r - 1) % w + 1, name
            assert got["ppermute"] == (1 if r == w - 1 else 0), name


def test_conjugate_and_negative_views_are_read_as_their_values(world3) -> None:
    # A lazy conjugate (``z.conj()``) or negative view keeps its bit through contiguous()
    # while the transport reads the raw memory: scatter sent a negative view's values
    # negated (silently), the complex gathers raised view_as_real's error on some ranks
    # (the others hung); and the gradient of a loss that reads ``y.conj()`` arrives as a
    # conjugate view, which the duals (reduce_scatter, scatter, gather...) refused likewise.
    def lazy_views() -> list[str]:
        r, w = dc.get_rank(), dc.get_world_size()
        ops = {
            "all_reduce": lambda x: dc.all_reduce(x),
            "all_reduce(product)": lambda x: dc.all_reduce(x, "product"),
            "broadcast": lambda x: dc.broadcast(x, src=w - 1),
            "reduce": lambda x: dc.reduce(x, dst=w - 1),
            "all_gather": lambda x: dc.all_gather(x),
            "all_gather(split_sizes)": lambda x: dc.all_gather(x, dim=-1, split_sizes=[3] * w),
            "reduce_scatter": lambda x: dc.reduce_scatter(x),
            "gather": lambda x: dc.gather(x, dst=w - 1),
            "scatter": lambda x: dc.scatter(x, src=w - 1),
            "all_to_all": lambda x: dc.all_to_all(x, 0, 1),
        }
        bad = []
        g = torch.Generator().manual_seed(r)
        for name, f in ops.items():
            z = torch.randn(2 * w, 3, generator=g, dtype=torch.complex128)
            re = torch.randn(2 * w, 3, generator=g, dtype=torch.float64)
            for view, plain in ((z.conj(), z.conj().resolve_conj()), (torch._neg_view(re), -re)):
                if not torch.equal(f(view), f(plain)):
                    bad.append(f"{name} of a {'conjugate' if view.is_conj() else 'negative'} view")
            x1, x2 = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
            y1, y2 = f(x1), f(x2)
            c = torch.randn(y1.shape, generator=g, dtype=torch.complex128)
            (y1.conj() * c).real.sum().backward()  # the gradient reaches the op as y1.grad.conj()
            (y2 * c.conj()).real.sum().backward()  # the same loss, no conjugate view
            if not torch.allclose(x1.grad, x2.grad):
                bad.append(f"{name}: gradient through y.conj()")
        return bad

    assert world3.run(lazy_views) == [[], [], []]


def test_subgroups_and_device_mesh(world4) -> None:
    def subgroups() -> list:
        import torch.distributed as dist

        r = dc.get_rank()
        g01 = dist.new_group([0, 1])
        g23 = dist.new_group([2, 3])
        mine = g01 if r < 2 else g23
        x = torch.tensor([float(r)], dtype=torch.float64, requires_grad=True)
        y = dc.all_gather(x, group=mine)
        b = dc.broadcast(x, src=1, group=mine)  # group-local src: global 1 or 3
        (y.sum() + 10 * b.sum()).backward()
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        z = dc.all_reduce(torch.tensor([float(r)]), group=(mesh, "tp"))
        z2 = dc.all_reduce(torch.tensor([float(r)]), group=(mesh, 0))
        return [y.tolist(), b.tolist(), x.grad.tolist(), z.tolist(), z2.tolist()]

    res = world4.run(subgroups)
    for r, (y, b, g, z, z2) in enumerate(res):
        base = 0 if r < 2 else 2
        assert y == [float(base), float(base + 1)]
        assert b == [float(base + 1)]
        # all_gather grad: 2 ranks each sum -> 2; broadcast grad: 10*2 on the local src only
        assert g == [2.0 + (20.0 if r % 2 == 1 else 0.0)]
        assert z == [float(2 * base + 1)]  # tp pairs: (0,1) and (2,3)
        assert z2 == [float(r % 2 + (r % 2 + 2))]  # dp pairs: (0,2) and (1,3)


# --------------------------------------------------------------------------------------
# bad input: a clear ValueError / TypeError naming the argument, before any communication
# --------------------------------------------------------------------------------------

T = torch.ones(4, 3)
BAD_INPUTS = [
    ("all_reduce", lambda: dc.all_reduce([1.0, 2.0]), TypeError, r"`x` must be a torch.Tensor, got list"),
    ("all_reduce", lambda: dc.all_reduce(T, "mean2"), ValueError, r"`op` must be one of"),
    ("all_reduce", lambda: dc.all_reduce(T, 3), ValueError, r"`op` must be one of .* got 3"),
    ("all_reduce", lambda: dc.all_reduce(T, torch.distributed.ReduceOp.BAND), ValueError, r"`op` must be"),
    (
        "all_reduce",
        lambda: dc.all_reduce(torch.ones(2, dtype=torch.complex64), "max"),
        ValueError,
        r"sum/avg/product for a complex tensor",
    ),
    (
        "all_reduce",
        lambda: dc.all_reduce(torch.ones(2, dtype=torch.int64), "avg"),
        ValueError,
        r"integer or bool tensor",
    ),
    ("all_reduce", lambda: dc.all_reduce(T.to_sparse()), TypeError, r"dense"),
    (
        "all_reduce",
        lambda: dc.all_reduce(T, group="world"),
        TypeError,
        r"`group` must be None, a ProcessGroup",
    ),
    ("all_reduce", lambda: dc.all_reduce(T, group=(object(), 0)), TypeError, r"\(DeviceMesh, axis\)"),
    (
        "broadcast",
        lambda: dc.broadcast(T, src=5),
        ValueError,
        r"`src` must be a group-local rank in \[0, 2\), got 5",
    ),
    ("broadcast", lambda: dc.broadcast(T, src=-1), ValueError, r"`src` must be a group-local rank"),
    ("broadcast", lambda: dc.broadcast(T, src="0"), TypeError, r"`src` must be an int"),
    ("reduce", lambda: dc.reduce(T, dst=2), ValueError, r"`dst` must be a group-local rank in \[0, 2\)"),
    ("reduce", lambda: dc.reduce(T, dst=True), TypeError, r"`dst` must be an int"),
    ("all_gather", lambda: dc.all_gather(T, dim=2), ValueError, r"`dim` must be a dimension in \[-2, 2\)"),
    ("all_gather", lambda: dc.all_gather(T, dim=1.0), TypeError, r"`dim` must be an int"),
    ("all_gather", lambda: dc.all_gather(torch.tensor(1.0)), ValueError, r"at least one dimension"),
    ("all_gather", lambda: dc.all_gather(T, sizes=[4]), ValueError, r"`sizes` must be a list of 2 ints"),
    (
        "all_gather",
        lambda: dc.all_gather(T, split_sizes=[4]),
        ValueError,
        r"`split_sizes` must be a list of 2 ints",
    ),
    ("gather", lambda: dc.gather(T, split_sizes=[1]), ValueError, r"`split_sizes` must be a list of 2 ints"),
    (
        "all_gather",
        lambda: dc.all_gather(T, sizes=[5, 5]),
        ValueError,
        r"`sizes` must be to list x.shape\[0\]=4",
    ),
    (
        "reduce_scatter",
        lambda: dc.reduce_scatter(torch.ones(3, 2)),
        ValueError,
        r"divisible by the group size 2",
    ),
    ("reduce_scatter", lambda: dc.reduce_scatter(T, split_sizes=[1, 2]), ValueError, r"sizes summing to 4"),
    ("reduce_scatter", lambda: dc.reduce_scatter(T, split_sizes=[5, -1]), ValueError, r"non-negative"),
    ("reduce_scatter", lambda: dc.reduce_scatter(T, split_sizes=[1, 1, 2]), ValueError, r"a list of 2 ints"),
    ("reduce_scatter", lambda: dc.reduce_scatter(T, op="xor"), ValueError, r"`op` must be one of"),
    (
        "scatter",
        lambda: dc.scatter(T, split_sizes="22"),
        TypeError,
        r"`split_sizes` must be a list of 2 ints",
    ),
    ("scatter", lambda: dc.scatter(T, src=9), ValueError, r"`src` must be a group-local rank"),
    ("scatter", lambda: dc.scatter(T, dim=-3), ValueError, r"`dim` must be a dimension"),
    ("gather", lambda: dc.gather(T, dst=0.0), TypeError, r"`dst` must be an int"),
    ("gather", lambda: dc.gather(T, sizes=[1, 1, 1]), ValueError, r"`sizes` must be a list of 2 ints"),
    ("all_to_all", lambda: dc.all_to_all(T, split_dim=4), ValueError, r"`split_dim` must be a dimension"),
    ("all_to_all", lambda: dc.all_to_all(T, concat_dim=-5), ValueError, r"`concat_dim` must be a dimension"),
    ("all_to_all", lambda: dc.all_to_all(T, input_split_sizes=[1, 1]), ValueError, r"sizes summing to 4"),
    (
        "all_to_all",
        lambda: dc.all_to_all(T, split_dim=0, concat_dim=1, input_split_sizes=[1, 3]),
        ValueError,
        r"equal sizes when split_dim != concat_dim",
    ),
    (
        "all_to_all",
        lambda: dc.all_to_all(T, output_split_sizes=[4]),
        ValueError,
        r"`output_split_sizes` must be a list of 2 ints",
    ),
    ("all_to_all", lambda: dc.all_to_all(torch.ones(3, 2)), ValueError, r"divisible by the group size 2"),
]


@pytest.mark.parametrize(
    "index", range(len(BAD_INPUTS)), ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD_INPUTS)]
)
def test_bad_input_is_rejected_before_communication(world2, index: int) -> None:
    def try_bad(index: int) -> tuple[str, str, int]:
        fn = BAD_INPUTS[index][1]
        with B.log_comms() as log:
            try:
                fn()
            except (ValueError, TypeError) as exc:
                return type(exc).__name__, str(exc), log.count()
        return "none", "", log.count()

    op, _, exc_type, pattern = BAD_INPUTS[index]
    for rank, (kind, message, comms) in enumerate(world2.run(try_bad, index)):
        assert kind == exc_type.__name__, f"rank {rank}: expected {exc_type.__name__}, got {kind}: {message}"
        assert re.search(pattern, message), message
        assert f"diffcomm.{op}()" in message and f"(rank {rank})" in message
        assert comms == 0, "validation must happen before any communication"


def test_distinct_bad_inputs_count() -> None:
    assert len({pattern for *_, pattern in BAD_INPUTS}) >= 25


def test_not_initialised_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match=r"torch.distributed is not initialised; call diffcomm.init\(\)"):
        dc.all_reduce(torch.ones(2))


# --------------------------------------------------------------------------------------
# debug mode: cross-rank mismatches are named, never a hang or garbage
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, field",
    [
        ("shape", "shape differs"),
        ("dtype", "dtype differs"),
        ("root", "src differs"),
        ("op", "op differs"),
        ("grad", "grad differs"),
        # every rank's own length right, another rank's wrong: the buffers fit each other,
        # so without the check a rank read a padding row as data (debug mode missed it)
        ("gather_sizes", "split_sizes differs"),
    ],
)
def test_debug_mode_names_mismatched_ranks(world3, kind: str, field: str) -> None:
    def mismatch(kind: str) -> tuple[str, str]:
        r = dc.get_rank()
        with dc.debug(True):
            try:
                if kind == "shape":
                    dc.all_reduce(torch.ones(2 + r))
                elif kind == "dtype":
                    dc.all_gather(torch.ones(2, dtype=torch.float32 if r == 0 else torch.float64))
                elif kind == "root":
                    dc.broadcast(torch.ones(2), src=r)
                elif kind == "op":
                    dc.all_reduce(torch.ones(2), "sum" if r else "max")
                elif kind == "grad":
                    dc.all_reduce(torch.ones(2, requires_grad=r == 0))
                elif kind == "gather_sizes":  # rank r holds r + 1 rows; rank 2 thinks rank 0 has 2
                    dc.all_gather(torch.ones(r + 1, 2), split_sizes=[2, 2, 3] if r == 2 else [1, 2, 3])
            except dc.CrossRankMismatchError as exc:
                return type(exc).__name__, str(exc)
        return "none", ""

    for name, msg in world3.run(mismatch, kind):
        assert name == "CrossRankMismatchError"
        assert field in msg and "rank 0:" in msg and "rank 2:" in msg


def _grad_mode_off_on_rank_1(op: str, mode: str) -> str:
    r = dc.get_rank()
    x = torch.ones(3, 2, requires_grad=True)
    off = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]
    calls = {
        "all_reduce": lambda: dc.all_reduce(x),
        "all_gather": lambda: dc.all_gather(x),
        "all_to_all": lambda: dc.all_to_all(x),
        "gather": lambda: dc.gather(x),
        "broadcast": lambda: dc.broadcast(x),
        "all_reduce_coalesced": lambda: dc.all_reduce_coalesced([x, x]),
    }
    with dc.debug(True):
        try:
            with off() if r == 1 else contextlib.nullcontext():
                calls[op]()
        except dc.CrossRankMismatchError as exc:
            return str(exc)
    return "no error"


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize(
    "op", ["all_reduce", "all_gather", "all_to_all", "gather", "broadcast", "all_reduce_coalesced"]
)
def test_debug_mode_names_grad_mode_off_on_one_rank(world3, op: str, mode: str) -> None:
    """``torch.no_grad()`` / ``torch.inference_mode()`` on one rank records no backward
    there while the others' records one: the same desync as a rank-dependent
    ``requires_grad`` (the others' backward collective pairs with that rank's next op: a
    wrong number). Debug mode compared ``x.requires_grad`` alone, True on every rank, and
    let it through; it now compares whether the call records a backward."""
    for msg in world3.run(_grad_mode_off_on_rank_1, op, mode):
        assert "requires_grad" in msg and "differ" in msg, msg
        assert "rank 1: 0" in msg or "ranks [1]: shape [3, 2] dtype float32 requires_grad=False" in msg, msg


def _a2a_sizes(expect: list[list[int]]) -> str:
    r = dc.get_rank()
    sends = [[1, 1, 2], [0, 2, 2], [3, 0, 1]][r]  # rank r sends sends[j] rows to rank j
    x = torch.ones(sum(sends), 2)
    with dc.debug(True):
        try:
            y = dc.all_to_all(x, input_split_sizes=sends, output_split_sizes=expect[r])
        except dc.CrossRankMismatchError as exc:
            return str(exc)
    return f"ok {tuple(y.shape)}"


def test_debug_mode_names_all_to_all_sizes_its_peers_do_not_send(world3) -> None:
    """all_to_all's split sizes differ between ranks by design, so the field comparison
    cannot check them: debug mode checks rank r's output size j against rank j's input
    size r (gloo said only "enforce fail ... inLengthPerRank"; a padded or in-process
    exchange could misplace rows)."""
    right = [[1, 0, 3], [1, 2, 0], [2, 2, 1]]
    assert world3.run(_a2a_sizes, right) == ["ok (4, 2)", "ok (3, 2)", "ok (5, 2)"]
    wrong = [[1, 0, 3], [1, 2, 0], [2, 1, 2]]  # rank 2 expects 1 from rank 1 (sent 2), 2 from itself (1)
    for msg in world3.run(_a2a_sizes, wrong):
        assert "inconsistent split sizes: rank 2 expects 1 from rank 1, which sends it 2" in msg, msg
        assert "rank 2 expects 2 from rank 2, which sends it 1" in msg, msg


def _a2a_other_dim(concat: list[int], split: list[int], expect: list[list[int]] | None) -> str:
    r = dc.get_rank()
    x = torch.ones(3 * split[r], concat[r])  # split along dim 0, concatenated along dim 1
    with dc.debug(True):
        try:
            y = dc.all_to_all(x, split_dim=0, concat_dim=1, output_split_sizes=expect and expect[r])
        except dc.CrossRankMismatchError as exc:
            return str(exc)
    return f"ok {tuple(y.shape)}"


def test_debug_mode_checks_all_to_all_across_two_dims_by_what_each_dim_carries(world3) -> None:
    """With ``split_dim != concat_dim`` the output sizes are the senders'
    ``x.shape[concat_dim]``, not their split sizes: debug mode compared the two and refused
    every correct even all_to_all across two dims (so did 183 tests of the suite under
    DIFFCOMM_DEBUG=1). It now checks each dim by what it carries."""
    assert world3.run(_a2a_other_dim, [2, 2, 2], [1, 1, 1], None) == ["ok (1, 6)"] * 3
    uneven = [[2, 1, 3]] * 3  # every rank's x.shape[1], listed: legal
    assert world3.run(_a2a_other_dim, [2, 1, 3], [1, 1, 1], uneven) == ["ok (1, 6)"] * 3
    wrong = [[2, 1, 3], [2, 1, 3], [1, 2, 3]]  # rank 2 swaps rank 0's and rank 1's
    for msg in world3.run(_a2a_other_dim, [2, 1, 3], [1, 1, 1], wrong):
        assert "rank 2 expects 1 along concat_dim from rank 0, whose x.shape[concat_dim] is 2" in msg, msg
    for msg in world3.run(_a2a_other_dim, [2, 2, 2], [1, 2, 1], None):  # rank 1 sends 2 rows
        assert "rank 0 would receive chunks of split_dim sizes [1, 2, 1] from ranks 0..2" in msg, msg


def test_debug_mode_accepts_legal_uneven(world3) -> None:
    def legal_uneven() -> tuple[str, str]:
        with dc.debug(True):
            try:
                dc.all_gather(torch.ones(1 + dc.get_rank(), 2))  # uneven along dim is legal
            except dc.CrossRankMismatchError as exc:
                return type(exc).__name__, str(exc)
        return "ok", ""

    assert world3.run(legal_uneven) == [("ok", "")] * 3


def test_debug_mode_names_the_gathers_other_dims_in_user_words(world2) -> None:
    def gathers_mismatched() -> str:
        with dc.debug(True):
            try:
                dc.all_gather(torch.ones(2, 3 + dc.get_rank()))
            except dc.CrossRankMismatchError as exc:
                return str(exc)
        return "no error"

    for msg in world2.run(gathers_mismatched):
        assert "x.shape without `dim`" in msg and "other_dims" not in msg, msg


# --------------------------------------------------------------------------------------
# without debug mode: a gather's size exchange carries every rank's other dims and
# dtype, so a mismatch is an error on every rank (never a gloo abort, never garbage)
# --------------------------------------------------------------------------------------

# (what rank `odd` passes instead of a (2, 3) float32 x, dim, the message's key words)
_GATHER_MISMATCHES = [
    ((2, 4), torch.float32, 0, ["x.shape[1] differs: 3 on rank(s) [0, 2]; 4 on rank(s) [1]"]),
    ((5, 3), torch.float32, 1, ["`dim`=1", "x.shape[0] differs: 2 on rank(s) [0, 2]; 5 on rank(s) [1]"]),
    ((2, 3), torch.float64, 0, ["dtype differs: torch.float32 on rank(s) [0, 2]; torch.float64 on"]),
    ((2, 3, 1), torch.float32, 0, ["number of dims differs: 2-d on rank(s) [0, 2]; 3-d on rank(s) [1]"]),
]


@pytest.mark.usefixtures("debug_off")
def test_a_gathers_shape_or_dtype_mismatch_is_an_error_on_every_rank_without_debug_mode(world3) -> None:
    from _shared import forget_gathered_sizes

    def gathers(first: bool, op: str) -> list[str]:
        if first:  # the size exchange path; else the sizes travel with the rows (one gather)
            forget_gathered_sizes()
        else:
            dc.all_gather(torch.ones(2, 3))
        out = []
        for shape, dtype, dim, _ in _GATHER_MISMATCHES:
            odd = dc.get_rank() == 1
            x = torch.ones(shape if odd else (2, 3), dtype=dtype if odd else torch.float32)
            try:
                dc.all_gather(x, dim=dim) if op == "all_gather" else dc.gather(x, dim=dim, dst=2)
                out.append("no error")
            except dc.CrossRankMismatchError as exc:
                assert isinstance(exc, ValueError)
                out.append(str(exc))
        # the group is still in step: the next gather works
        ok = dc.all_gather(torch.full((1 + dc.get_rank(), 2), float(dc.get_rank())))
        assert ok.tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0], [2.0, 2.0], [2.0, 2.0], [2.0, 2.0]]
        return out

    for first, op in ((True, "all_gather"), (False, "all_gather"), (True, "gather")):
        for msgs in world3.run(gathers, first, op):
            for msg, (*_, words) in zip(msgs, _GATHER_MISMATCHES, strict=True):
                assert msg.startswith(f"diffcomm.{op}(): the ranks' `x` must agree"), (first, op, msg)
                assert all(w in msg for w in words) and "other_dims" not in msg, (first, op, msg)


@pytest.mark.usefixtures("debug_off")
def test_a_gathers_dim_mismatch_is_an_error_on_every_rank_without_debug_mode(world3) -> None:
    """Rank 1 gathers a square ``x`` along dim 1, the others along dim 0: the records
    agreed in every other dim and the dtype and the same bytes moved, so every rank got a
    silently wrong value (rank 1's columns read as rows). The dim travels in the record."""
    from _shared import forget_gathered_sizes

    def gathers_along_other_dims(first: bool, op: str) -> list[str]:
        if first:  # the size exchange path; else the sizes travel with the rows (one gather)
            forget_gathered_sizes()
        else:
            dc.all_gather(torch.ones(2, 2))
        x = torch.arange(4.0).reshape(2, 2)
        dim = 1 if dc.get_rank() == 1 else -2  # (-2 is dim 0: the same on ranks 0 and 2)
        try:
            dc.all_gather(x, dim=dim) if op == "all_gather" else dc.gather(x, dim=dim, dst=2)
            return ["no error"]
        except dc.CrossRankMismatchError as exc:
            out = [str(exc)]
        ok = dc.all_gather(torch.full((1 + dc.get_rank(), 2), float(dc.get_rank())))  # still in step
        assert ok.tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0], [2.0, 2.0], [2.0, 2.0], [2.0, 2.0]]
        return out

    for first, op in ((True, "all_gather"), (False, "all_gather"), (True, "gather")):
        for (msg,) in world3.run(gathers_along_other_dims, first, op):
            assert msg.startswith(f"diffcomm.{op}(): the ranks must concatenate along the same `dim`"), msg
            assert "`dim` differs: 0 on rank(s) [0, 2]; 1 on rank(s) [1]" in msg, (first, op, msg)


# --------------------------------------------------------------------------------------
# a rank whose loss ignores a collective's output: an error naming the op, not a hang
# --------------------------------------------------------------------------------------


def test_rank_ignoring_an_output_times_out_with_a_message() -> None:
    def skip_backward() -> None:
        x = torch.ones(2, requires_grad=True)
        y = dc.all_gather(x)
        loss = y.sum() if dc.get_rank() == 0 else x.sum()  # rank 1 ignores y
        loss.backward()

    with dc.LocalWorld(2, collective_timeout=2.0, timeout=60) as world:
        with pytest.raises(dc.RankError) as info:
            world.run(skip_backward)
        text = str(info.value)
        assert "all_gather backward" in text
        assert "make every rank's loss touch every collective output" in text


# --------------------------------------------------------------------------------------
# backward is ONE call of the dual collective (no per-rank loops, no hidden extras)
# --------------------------------------------------------------------------------------

EXPECTED_CALLS = {
    # op: (call, forward raw ops, backward raw ops)
    "all_reduce": (lambda x, w: dc.all_reduce(x), {"all_reduce": 1}, {"all_reduce": 1}),
    "broadcast": (lambda x, w: dc.broadcast(x, src=w - 1), {"broadcast": 1}, {"reduce": 1}),
    "reduce": (lambda x, w: dc.reduce(x, dst=0), {"reduce": 1}, {"broadcast": 1}),
    "all_gather": (
        lambda x, w: dc.all_gather(x, split_sizes=[x.shape[0]] * w),
        {"all_gather": 1},
        {"reduce_scatter": 1},
    ),
    "reduce_scatter": (lambda x, w: dc.reduce_scatter(x), {"reduce_scatter": 1}, {"all_gather": 1}),
    "gather": (lambda x, w: dc.gather(x, split_sizes=[x.shape[0]] * w), {"gather": 1}, {"scatter": 1}),
    "scatter": (lambda x, w: dc.scatter(x, src=0), {"scatter": 1}, {"gather": 1}),
    "all_to_all": (lambda x, w: dc.all_to_all(x), {"all_to_all": 1}, {"all_to_all": 1}),
}


@pytest.mark.parametrize("op", list(EXPECTED_CALLS))
@pytest.mark.usefixtures("debug_off")
def test_backward_is_one_call_of_the_dual(world3, op: str) -> None:
    def counts(op: str) -> tuple[dict, dict]:
        w = dc.get_world_size()
        x = torch.randn(2 * w, 3, dtype=torch.float64, requires_grad=True)
        with B.log_comms() as fwd:
            y = EXPECTED_CALLS[op][0](x, w)
        with B.log_comms() as bwd:
            y.backward(torch.ones_like(y))
        return (
            {k: int(v["count"]) for k, v in fwd.by_op().items()},
            {k: int(v["count"]) for k, v in bwd.by_op().items()},
        )

    _, want_fwd, want_bwd = EXPECTED_CALLS[op]
    assert dc.dual(op) in want_bwd or op == "all_reduce"
    for fwd, bwd in world3.run(counts, op):
        assert fwd == want_fwd and bwd == want_bwd


@pytest.mark.usefixtures("debug_off")
def test_uneven_all_gather_learns_the_sizes_with_the_rows(world3) -> None:
    def size_exchange_counts() -> list[dict]:
        group = dist.new_group(list(range(dc.get_world_size())))  # a new group: nothing learned yet
        counts, values = [], []
        for grow in (0, 0, 1, 0):
            x = torch.full((1 + dc.get_rank() * (1 + grow), 2), float(dc.get_rank()), requires_grad=True)
            with B.log_comms() as log:
                y = dc.all_gather(x, group=group)
                y.sum().backward()
            counts.append({k: int(v["count"]) for k, v in log.by_op().items()})
            values.append((y.tolist(), x.grad.tolist()))
        return [counts, values]

    # sizes unknown, first time on a group for this trailing shape and dtype: one 8-byte
    # all_gather of sizes, then the data; backward knows them. Later: the sizes travel in
    # the data's own collective (one all_gather), unless a rank's rows outgrow what the
    # group has seen (every rank sees it in the gathered sizes: the data again, sized)
    one, two = {"all_gather": 1, "reduce_scatter": 1}, {"all_gather": 2, "reduce_scatter": 1}
    outs = world3.run(size_exchange_counts)
    for counts, values in outs:
        assert counts == [two, one, two, one]
        for grow, (y, grad) in zip((0, 0, 1, 0), values):
            sizes = [1 + r * (1 + grow) for r in range(3)]
            assert y == [[float(r)] * 2 for r in range(3) for _ in range(sizes[r])]
            assert grad == [[3.0, 3.0]] * len(grad)  # the sum of every rank's ones


@pytest.mark.usefixtures("debug_off")
def test_all_gather_of_unknown_sizes_is_exact_for_every_dtype_and_layout(world3) -> None:
    def block(r: int, rows: list[int], dtype: torch.dtype, dim: int) -> torch.Tensor:
        t = torch.arange(rows[r] * 3, dtype=torch.float64).reshape(rows[r], 3) + 1000 * r
        t = (t % 2 if dtype == torch.bool else t).to(dtype)
        return t if dim == 0 else t.T.contiguous()

    def gathers_with_learned_sizes() -> list[str]:
        from diffcomm.backend import sized_gather as _sized_gather

        group = dist.new_group(list(range(dc.get_world_size())))
        rank, world = dc.get_rank(), dc.get_world_size()
        bad = []
        big = _sized_gather.MAX_BYTES // 8 + 1  # float64 rows of one element: over the limit
        # (dtype, dim, rows per rank, repeated): zero rows somewhere, dim 1, every dtype
        for dtype in (torch.float32, torch.complex64, torch.bool, torch.bfloat16, torch.int64, torch.float64):
            for rows in ([1, 2, 0], [2, 2, 2], [0, 0, 3], [3, 1, 2], [1, 1, 1], [big, 1, 2]):
                if rows[0] == big and dtype != torch.float64:
                    continue
                for dim in (0, 1):
                    with B.log_comms() as log:
                        y = dc.all_gather(block(rank, rows, dtype, dim), dim=dim, group=group)
                    want = torch.cat([block(r, rows, dtype, dim) for r in range(world)], dim=dim)
                    if y.dtype != dtype or not torch.equal(y, want):
                        bad.append(f"{dtype} dim={dim} rows={rows}: {y} != {want}")
                    n = int(log.by_op()["all_gather"]["count"])
                    if n not in (1, 2) or (rows[0] == big and n != 2):
                        bad.append(f"{dtype} dim={dim} rows={rows}: {n} all_gathers")
        return bad

    # the sizes travel with the rows once the group has seen such rows: values are exact
    # for every dtype, zero rows, dim 1, and rows above the size limit (exchanged first)
    for bad in world3.run(gathers_with_learned_sizes):
        assert bad == []


def test_sizes_keyword_renamed_split_sizes_still_works_with_a_deprecation_warning(world2) -> None:
    def renamed_sizes_keyword() -> dict[str, object]:
        import warnings

        x = torch.arange(3.0) + dc.get_rank()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            old_ag = dc.all_gather(x, sizes=[3, 3])
            old_g = dc.gather(x, sizes=[3, 3])
        new_ag = dc.all_gather(x, split_sizes=[3, 3])
        new_g = dc.gather(x, split_sizes=[3, 3])
        kinds = [(w.category.__name__, "split_sizes" in str(w.message)) for w in caught]
        return {"equal": torch.equal(old_ag, new_ag) and torch.equal(old_g, new_g), "warnings": kinds}

    for res in world2.run(renamed_sizes_keyword):
        assert res["equal"]
        assert res["warnings"] == [("DeprecationWarning", True)] * 2
