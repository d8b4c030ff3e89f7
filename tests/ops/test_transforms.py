"""The collectives under ``torch.func``: forward mode, vmap, Jacobians, grad / vjp /
functional_call — property tests on real gloo ranks (world sizes 1-4).

Every example is one SPMD program (one collective call, ``Prog``) checked on every rank
against a single-process reference of the *whole* program: each rank regenerates every
rank's input, tangent and cotangent from the seed and evaluates
:func:`diffcomm.testing.cases.reference_outputs` with plain torch ops, then compares its
own part. What "the derivative" of an SPMD program means on rank ``r`` (global Jacobian
``J`` with blocks ``J[r][s] = d out_r / d x_s``):

* ``jvp`` on every rank at once, rank ``s`` with tangent ``t_s``: ``sum_s J[r][s] t_s``,
  the linearisation of the global program (checked against ``torch.func.jvp`` of the
  reference and against central finite differences run in lockstep);
* ``vjp`` / ``grad`` (objective = sum of the per-rank objectives): ``sum_s J[s][r]^T c_s``;
* ``jacfwd`` with the same basis on every rank: ``sum_s J[r][s]``; ``jacrev``:
  ``sum_s J[s][r]``. With per-rank *block* bases (batch ``N`` = every rank's numel, rank
  ``s`` owning rows ``s``) a vmap over jvp yields rank ``r``'s block row of the dense
  ``J`` and a vmap over vjp its block column; assembled, both equal the reference ``J``.

vmap issues exactly as many raw collectives as one un-batched call
(``diffcomm.backend.log_comms``), and equals a Python loop of single calls; nested vmap and
``in_dims=1, out_dims=1`` too.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from _shared import forget_gathered_sizes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.func import functional_call, grad, jacfwd, jacrev, jvp, vjp, vmap

import diffcomm as dc
from diffcomm.backend import log_comms
from diffcomm.ops import registry as R
from diffcomm.testing.cases import Case, input_shape, reference_outputs
from diffcomm.testing.cases import call as call_case
from diffcomm.testing.strategies import uneven_split_sizes

WORLDS = [1, 2, 3, 4]
PROP = settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
F64 = torch.float64
EPS = 1e-6  # central finite differences in float64: error ~ EPS^2 * |f'''|
TOL = 1e-9
FD_TOL = 1e-6


# --------------------------------------------------------------------------------------
# the program: one collective call, its inputs and its reference
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prog:
    """One collective call on every rank.

    ``case`` is a :class:`diffcomm.testing.cases.Case`; ``concat_sizes`` (all_to_all with
    ``split_dim != concat_dim`` only) makes the concat dim uneven: rank ``r``'s input has
    ``concat_sizes[r]`` there and the call passes ``output_split_sizes=concat_sizes``.
    """

    case: Case
    concat_sizes: tuple[int, ...] | None = None

    @property
    def world(self) -> int:
        return self.case.world

    def in_shape(self, r: int) -> tuple[int, ...]:
        shape = list(input_shape(self.case, r))
        if self.concat_sizes is not None:
            shape[self.case.kwargs["concat_dim"]] = self.concat_sizes[r]
        return tuple(shape)

    def out_shape(self, r: int) -> tuple[int, ...]:
        zeros = [torch.zeros(self.in_shape(s), dtype=F64) for s in range(self.world)]
        return tuple(self.ref(zeros)[r].shape)

    def ref(self, xs: list[Tensor]) -> list[Tensor]:
        """Every rank's output, from every rank's input, with plain torch ops."""
        return reference_outputs(self.case, xs)

    def __call__(self, x: Tensor) -> Tensor:
        if self.concat_sizes is not None:
            kw = self.case.kwargs
            return dc.all_to_all(
                x, kw["split_dim"], kw["concat_dim"], output_split_sizes=list(self.concat_sizes)
            )
        return call_case(self.case, x)

    def draw(self, salt: int, out: bool = False, batch: tuple[int, ...] = ()) -> list[Tensor]:
        """Every rank's tensor for ``salt`` (inputs, tangents, cotangents...), seeded."""
        res = []
        for r in range(self.world):
            g = torch.Generator().manual_seed(self.case.seed * 1000 + r * 37 + salt)
            shape = batch + (self.out_shape(r) if out else self.in_shape(r))
            if self.case.ints:  # small integers: ties and zeros likely
                res.append(torch.randint(-2, 3, shape, generator=g).to(F64))
            else:
                res.append(torch.randn(shape, generator=g, dtype=F64))
        return res

    def label(self) -> str:
        extra = f" concat_sizes={list(self.concat_sizes)}" if self.concat_sizes else ""
        return f"{self.case.op} world={self.world} {self.case.label()}{extra}"


def _global_jacobian(prog: Prog, xs: list[Tensor]) -> Tensor:
    """Dense Jacobian (sum of output numels x sum of input numels) of the reference."""
    n = [x.numel() for x in xs]

    def flat(v: Tensor) -> Tensor:
        parts = [p.reshape(s) for p, s in zip(v.split(n), (x.shape for x in xs))]
        return torch.cat([y.reshape(-1) for y in prog.ref(parts)])

    return torch.func.jacrev(flat)(torch.cat([x.reshape(-1) for x in xs]))


def _offsets(sizes: list[int]) -> list[int]:
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


def _err(a: Tensor, b: Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))


class _Failures:
    """Collect failed checks; assert once at the end, after every collective ran
    (asserting mid-way on one rank would leave the others waiting in a collective)."""

    def __init__(self, prog: Prog) -> None:
        self.prog, self.items = prog, []

    def close(self, what: str, a: Tensor, b: Tensor, tol: float = TOL) -> None:
        e = _err(a.detach(), b.detach())
        if not e <= tol:
            self.items.append(f"{what}: err {e:.3g} (shapes {tuple(a.shape)} vs {tuple(b.shape)})")

    def equal(self, what: str, a: object, b: object) -> None:
        if a != b:
            self.items.append(f"{what}: {a!r} != {b!r}")

    def report(self) -> list[str]:
        r = dc.get_rank()
        return [f"rank {r}: {self.prog.label()}: {m}" for m in self.items]


# --------------------------------------------------------------------------------------
# the checks (run on every rank)
# --------------------------------------------------------------------------------------


def _forward_mode(prog: Prog, fails: _Failures) -> None:
    r = dc.get_rank()
    xs, ts = prog.draw(1), prog.draw(2)
    x, t = xs[r], ts[r]
    y, ty = jvp(prog, (x,), (t,))
    ry, rty = jvp(lambda *a: tuple(prog.ref(list(a))), tuple(xs), tuple(ts))
    fails.close("jvp primal == reference", y, ry[r])
    fails.close("jvp tangent == linearised reference", ty, rty[r])
    if not prog.case.ints:  # no ties: every op is smooth at the point
        fd = (prog(x + EPS * t) - prog(x - EPS * t)) / (2 * EPS)
        fails.close("jvp tangent == finite differences", ty, fd, FD_TOL)
    with fwAD.dual_level():
        out = fwAD.unpack_dual(prog(fwAD.make_dual(x, t)))
        fails.close("forward_ad primal", out.primal, ry[r])
        fails.close("forward_ad tangent", out.tangent, rty[r])


def _jacobians(prog: Prog, fails: _Failures) -> dict[str, Tensor]:
    """Block rows (vmap over jvp) and block columns (vmap over vjp) of the dense Jacobian,
    plus the ``jacfwd`` / ``jacrev`` APIs where every rank's batch has the same size."""
    r, w = dc.get_rank(), prog.world
    xs = prog.draw(1)
    x = xs[r]
    jg = _global_jacobian(prog, xs)
    n = [v.numel() for v in xs]
    m = [int(torch.Size(prog.out_shape(s)).numel()) for s in range(w)]
    no, mo = _offsets(n), _offsets(m)
    # forward: rank s's tangent for batch element i is e_i restricted to its own block
    basis_in = torch.eye(sum(n), dtype=F64)[:, no[r] : no[r + 1]].reshape(sum(n), *x.shape)
    _, cols = vmap(lambda t: jvp(prog, (x,), (t,)))(basis_in)
    rows_fwd = cols.reshape(sum(n), m[r]).T  # (m_r, N): block row r
    fails.close("vmap(jvp) block row == dense reference", rows_fwd, jg[mo[r] : mo[r + 1]])
    # reverse: rank s's cotangent for batch element i is e_i restricted to its own block
    y, pull = vjp(prog, x)
    basis_out = torch.eye(sum(m), dtype=F64)[:, mo[r] : mo[r + 1]].reshape(sum(m), *y.shape)
    (gs,) = vmap(pull)(basis_out)
    cols_rev = gs.reshape(sum(m), n[r])  # (M, n_r): block column r
    fails.close("vmap(vjp) block column == dense reference", cols_rev, jg[:, no[r] : no[r + 1]])
    # the APIs: the same basis on every rank sums the blocks (see the module docstring)
    if len(set(n)) == 1:
        jf = jacfwd(prog)(x).reshape(m[r], n[r])
        want = sum(jg[mo[r] : mo[r + 1], no[s] : no[s + 1]] for s in range(w))
        fails.close("jacfwd == sum_s J[r][s]", jf, want)
    if len(set(m)) == 1:
        jr = jacrev(prog)(x).reshape(m[r], n[r])
        want = sum(jg[mo[s] : mo[s + 1], no[r] : no[r + 1]] for s in range(w))
        fails.close("jacrev == sum_s J[s][r]", jr, want)
    return {"rows": rows_fwd.detach(), "cols": cols_rev.detach(), "dense": jg}


def _reverse(prog: Prog, fails: _Failures) -> None:
    r = dc.get_rank()
    xs, cs = prog.draw(1), prog.draw(3, out=True)
    x, c = xs[r], cs[r]
    leaves = [v.clone().requires_grad_(True) for v in xs]
    ref_loss = sum((o * ci).sum() for o, ci in zip(prog.ref(leaves), cs))
    ref_g = torch.autograd.grad(ref_loss, leaves, allow_unused=True)[r]
    ref_g = torch.zeros_like(x) if ref_g is None else ref_g
    fails.close("func.grad == reference", grad(lambda v: (prog(v) * c).sum())(x), ref_g)
    _, pull = vjp(prog, x)
    fails.close("func.vjp == reference", pull(c)[0], ref_g)
    leaf = x.clone().requires_grad_(True)
    (prog(leaf) * c).sum().backward()
    fails.close("autograd backward == reference", leaf.grad, ref_g)
    # forward-over-reverse (Hessian-vector product): jvp of the grad, against the reference's
    ts = prog.draw(2)
    hvp = jvp(grad(lambda v: (prog(v) * c).sum()), (x,), (ts[r],))[1]

    def ref_grads(*a: Tensor) -> tuple[Tensor, ...]:
        objective = lambda *b: sum((o * ci).sum() for o, ci in zip(prog.ref(list(b)), cs))
        return grad(objective, argnums=tuple(range(len(a))))(*a)

    fails.close(
        "jvp(grad) == reference Hessian-vector product", hvp, jvp(ref_grads, tuple(xs), tuple(ts))[1][r]
    )


def _count(fn: object, *args: Tensor) -> tuple[object, dict[str, int]]:
    with log_comms() as log:
        out = fn(*args)  # type: ignore[operator]
    return out, {op: int(row["count"]) for op, row in log.by_op().items()}


def _vmap(prog: Prog, fails: _Failures) -> None:
    r, b = dc.get_rank(), 3
    xb = prog.draw(4, batch=(b,))[r]
    loop = torch.stack([prog(xb[i]) for i in range(b)])
    # one call that knows what the batched call knows: under vmap an all_gather without
    # split_sizes exchanges them first (the sizes cannot travel with batched rows)
    forget_gathered_sizes()
    _, one = _count(prog, xb[0])
    yb, batched = _count(vmap(prog), xb)
    fails.equal("raw collectives: vmap over B=3 vs one call", batched, one)
    fails.close("vmap == loop", yb, loop)
    y1, batched1 = _count(vmap(prog, in_dims=1, out_dims=1), xb.movedim(0, 1).contiguous())
    fails.equal("raw collectives: vmap(in_dims=1) vs one call", batched1, one)
    fails.close("vmap(in_dims=1, out_dims=1) == loop", y1, loop.movedim(0, 1))
    xbb = prog.draw(5, batch=(2, b))[r]
    loop2 = torch.stack([torch.stack([prog(xbb[i, j]) for j in range(b)]) for i in range(2)])
    y2, nested = _count(vmap(vmap(prog)), xbb)
    fails.equal("raw collectives: nested vmap vs one call", nested, one)
    fails.close("vmap(vmap) == loop", y2, loop2)
    # the backward under vmap (jacrev's pattern) is one collective per batch as well
    x = prog.draw(1)[r]
    _, pull = vjp(prog, x)
    cb = prog.draw(6, out=True, batch=(b,))[r]
    _, back_one = _count(pull, cb[0])
    (gb,), back_batched = _count(vmap(pull), cb)
    fails.equal("raw collectives: vmap over the vjp vs one vjp", back_batched, back_one)
    fails.close("vmap(vjp) == loop", gb, torch.stack([pull(cb[i])[0] for i in range(b)]))


# the shared rank body of every test here (through _run and _check_many): the checks `parts` of `prog`
def _check(prog: Prog, parts: tuple[str, ...]) -> tuple[list[str], dict[str, Tensor]]:
    fails = _Failures(prog)
    jac: dict[str, Tensor] = {}
    if "forward" in parts:
        _forward_mode(prog, fails)
    if "vmap" in parts:
        _vmap(prog, fails)
    if "jacobians" in parts:
        jac = _jacobians(prog, fails)
    if "reverse" in parts:
        _reverse(prog, fails)
    return fails.report(), jac


def _run(world: dc.LocalWorld, prog: Prog, parts: tuple[str, ...]) -> None:
    res = world.run(_check, prog, parts)
    problems = [m for fails, _ in res for m in fails]
    assert not problems, "\n".join(problems[:12])
    if "jacobians" in parts:  # assemble the global J from both directions (parent side)
        rows = torch.cat([jac["rows"] for _, jac in res], dim=0)
        cols = torch.cat([jac["cols"] for _, jac in res], dim=1)
        dense = res[0][1]["dense"]
        assert torch.allclose(rows, cols, atol=TOL, rtol=0), "jacfwd-assembled J != jacrev-assembled J"
        assert torch.allclose(rows, dense, atol=TOL, rtol=0), "assembled J != dense reference J"


# --------------------------------------------------------------------------------------
# strategies: one SPMD program per op, float64, sizes small enough for dense Jacobians
# --------------------------------------------------------------------------------------

REDUCE_OPS = ("sum", "avg", "max", "min", "product")


def _shape(draw: st.DrawFn, max_dims: int = 3) -> list[int]:
    return draw(st.lists(st.integers(1, 3), min_size=1, max_size=max_dims))


@st.composite
def progs(draw: st.DrawFn, op: str, world: int) -> Prog:
    seed = draw(st.integers(0, 10_000))

    def case(shape: list[int], kwargs: dict, **extra: object) -> Case:
        return Case(op, world, tuple(shape), "float64", kwargs, seed=seed, **extra)  # type: ignore[arg-type]

    if op in ("all_reduce", "reduce"):
        kw: dict = {"op": draw(st.sampled_from(REDUCE_OPS))}
        if op == "reduce":
            kw["dst"] = draw(st.integers(0, world - 1))
        return Prog(case(_shape(draw), kw))
    if op == "broadcast":
        return Prog(case(_shape(draw), {"src": draw(st.integers(0, world - 1))}))
    if op in ("all_gather", "gather"):
        shape = _shape(draw)
        kw = {"dim": draw(st.integers(0, len(shape) - 1))}
        if op == "gather":
            kw["dst"] = draw(st.integers(0, world - 1))
        uneven = draw(st.booleans())
        sizes = tuple(draw(st.lists(st.integers(0, 3), min_size=world, max_size=world))) if uneven else None
        return Prog(case(shape, kw, sizes=sizes))
    if op in ("reduce_scatter", "scatter"):
        shape = _shape(draw)
        dim = draw(st.integers(0, len(shape) - 1))
        kw = {"dim": dim}
        if draw(st.booleans()):  # uneven split sizes
            shape[dim] = draw(st.integers(0, 2 * world))
            kw["split_sizes"] = draw(uneven_split_sizes(shape[dim], world))
        else:
            shape[dim] = world * draw(st.integers(1, 2))
        if op == "reduce_scatter":
            kw["op"] = draw(st.sampled_from(REDUCE_OPS))
        else:
            kw["src"] = draw(st.integers(0, world - 1))
        return Prog(case(shape, kw))
    if op == "all_to_all":
        shape = _shape(draw)
        sd = draw(st.integers(0, len(shape) - 1))
        cd = draw(st.integers(0, len(shape) - 1))
        kw = {"split_dim": sd, "concat_dim": cd}
        uneven = draw(st.booleans())
        if sd == cd and uneven:  # every rank its own split sizes; outputs given or exchanged
            a2a = tuple(
                tuple(draw(st.lists(st.integers(0, 2), min_size=world, max_size=world))) for _ in range(world)
            )
            kw["infer_outputs"] = draw(st.booleans())
            shape[sd] = 0
            return Prog(case(shape, kw, a2a=a2a))
        shape[sd] = world * draw(st.integers(1, 2))
        if sd != cd and uneven:  # every rank its own concat-dim size
            sizes = tuple(draw(st.lists(st.integers(0, 3), min_size=world, max_size=world)))
            return Prog(case(shape, kw), concat_sizes=sizes)
        return Prog(case(shape, kw))
    raise ValueError(op)


def _given_world(local_worlds, op: str, parts: tuple[str, ...]) -> None:
    @PROP
    @given(data=st.data(), world_size=st.sampled_from(WORLDS))
    def check(data: st.DataObject, world_size: int) -> None:
        prog = data.draw(progs(op, world_size), label="prog")
        _run(local_worlds(world_size), prog, parts)

    check()


OPS = list(R.family("collective", ()))  # diffcomm's own collectives


@pytest.mark.parametrize("op", OPS)
def test_forward_mode_matches_reference_and_finite_differences(local_worlds, op: str) -> None:
    """jvp / forward_ad equal the linearised reference and central differences."""
    _given_world(local_worlds, op, ("forward",))


@pytest.mark.parametrize("op", OPS)
def test_vmap_is_one_collective_and_equals_a_loop(local_worlds, op: str) -> None:
    """vmap (in_dims 0 and 1, nested, and over the vjp) == loop, one collective per call."""
    _given_world(local_worlds, op, ("vmap",))


@pytest.mark.parametrize("op", OPS)
def test_jacfwd_jacrev_and_dense_jacobian(local_worlds, op: str) -> None:
    """Block rows (jvp) and columns (vjp) assemble the same dense J as the reference."""
    _given_world(local_worlds, op, ("jacobians",))


@pytest.mark.parametrize("op", OPS)
def test_grad_and_vjp_match_reference(local_worlds, op: str) -> None:
    """torch.func.grad / vjp and autograd agree with the reference gradient; so does
    forward-over-reverse (jvp of grad)."""
    _given_world(local_worlds, op, ("reverse",))


# --------------------------------------------------------------------------------------
# pinned cases: every op variant the issue names, ties and zeros, a module
# --------------------------------------------------------------------------------------


def _pinned(world: int) -> list[Prog]:
    w = world
    uneven = tuple(r % 3 + 1 for r in range(w))
    ring = tuple(tuple((r + j) % 3 for j in range(w)) for r in range(w))
    out = [Prog(Case("all_reduce", w, (2, 3), kwargs={"op": o}, seed=3)) for o in REDUCE_OPS]
    out += [Prog(Case("reduce", w, (3,), kwargs={"op": o, "dst": w - 1}, seed=4)) for o in REDUCE_OPS]
    out += [
        Prog(Case("broadcast", w, (2, 2), kwargs={"src": w // 2}, seed=5)),
        Prog(Case("all_gather", w, (2, 3), kwargs={"dim": 1}, seed=6)),
        Prog(Case("all_gather", w, (2, 3), kwargs={"dim": 0}, sizes=uneven, seed=7)),
        Prog(Case("reduce_scatter", w, (2 * w, 2), kwargs={"dim": 0}, seed=8)),
        Prog(
            Case(
                "reduce_scatter", w, (2, sum(uneven)), kwargs={"dim": 1, "split_sizes": list(uneven)}, seed=9
            )
        ),
        Prog(Case("gather", w, (2, 2), kwargs={"dst": w - 1, "dim": 1}, seed=10)),
        Prog(Case("gather", w, (3, 2), kwargs={"dst": 0, "dim": 0}, sizes=uneven, seed=11)),
        Prog(Case("scatter", w, (w, 2), kwargs={"src": w - 1, "dim": 0}, seed=12)),
        Prog(
            Case(
                "scatter",
                w,
                (2, sum(uneven)),
                kwargs={"src": 0, "dim": 1, "split_sizes": list(uneven)},
                seed=13,
            )
        ),
        Prog(Case("all_to_all", w, (2 * w, 2), kwargs={"split_dim": 0, "concat_dim": 0}, seed=14)),
        Prog(Case("all_to_all", w, (0, 2), kwargs={"split_dim": 0, "concat_dim": 0}, a2a=ring, seed=15)),
        Prog(
            Case(
                "all_to_all",
                w,
                (0, 2),
                kwargs={"split_dim": 0, "concat_dim": 0, "infer_outputs": True},
                a2a=ring,
                seed=16,
            )
        ),
        Prog(Case("all_to_all", w, (2, 2 * w), kwargs={"split_dim": 1, "concat_dim": 0}, seed=17)),
        Prog(
            Case("all_to_all", w, (2, w), kwargs={"split_dim": 1, "concat_dim": 0}, seed=18),
            concat_sizes=uneven,
        ),
    ]
    return out


# shared rank body: the pinned programs' test and the ties test run it
def _check_many(progs_: list[Prog], parts: tuple[str, ...]) -> list[str]:
    return [m for p in progs_ for m in _check(p, parts)[0]]


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_op_variant_under_every_transform(local_worlds, world_size: int) -> None:
    """The fixed list (all reduce ops, even/uneven, both all_to_all layouts) x all checks."""
    res = local_worlds(world_size).run(
        _check_many, _pinned(world_size), ("forward", "vmap", "jacobians", "reverse")
    )
    problems = [m for rr in res for m in rr]
    assert not problems, "\n".join(problems[:12])


def test_ties_and_zeros_follow_the_reference_linearisation(world3) -> None:
    def ties() -> list[Prog]:
        # small integers: max/min ties (the tangent is averaged over the tied ranks, as for
        # torch.amax) and zeros in products (zero-safe product of the others)
        w = dc.get_world_size()
        out = []
        for seed in range(4):
            for o in ("max", "min", "product"):
                out.append(Prog(Case("all_reduce", w, (24,), kwargs={"op": o}, seed=seed, ints=True)))
            out.append(Prog(Case("reduce", w, (12,), kwargs={"op": "max", "dst": 1}, seed=seed, ints=True)))
            out.append(Prog(Case("reduce_scatter", w, (4 * w,), kwargs={"op": "min"}, seed=seed, ints=True)))
        return out

    def check_ties() -> list[str]:
        return _check_many(ties(), ("forward", "vmap", "jacobians", "reverse"))

    problems = [m for rr in world3.run(check_ties) for m in rr]
    assert not problems, "\n".join(problems[:12])


@pytest.mark.usefixtures("debug_off")
def test_vmap_uneven_all_gather_exchanges_sizes_once(world3) -> None:
    """Without ``split_sizes=`` the size exchange (a tiny all_gather) is part of the call count:
    2 raw all_gathers for one call and for the whole batch. (A later unbatched call on the
    same group gathers the sizes with the rows: 1.)"""

    def count_sizes_exchange() -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        r = dc.get_rank()
        xb = torch.randn(4, r + 1, 2, dtype=F64)
        forget_gathered_sizes()
        _, one = _count(lambda x: dc.all_gather(x, 0), xb[0])
        _, batched = _count(vmap(lambda x: dc.all_gather(x, 0)), xb)
        _, again = _count(lambda x: dc.all_gather(x, 0), xb[1])
        return one, batched, again

    for one, batched, again in world3.run(count_sizes_exchange):
        assert one == batched == {"all_gather": 2}
        assert again == {"all_gather": 1}


# --------------------------------------------------------------------------------------
# torch.func.functional_call on a module whose forward calls diffcomm ops
# --------------------------------------------------------------------------------------


class _SeqParallelMLP(nn.Module):
    """Sequence-parallel MLP: all_gather tokens, a per-token layer, reduce_scatter back;
    plus an all_reduce'd scalar gate (every collective pair in one module)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same parameters on every rank
        self.up = nn.Linear(3, 4, dtype=F64)
        self.down = nn.Linear(4, 3, dtype=F64)

    def forward(self, x_shard: Tensor) -> Tensor:
        x_full = dc.all_gather(x_shard, 0, split_sizes=[x_shard.shape[0]] * dc.get_world_size())
        h = self.down(torch.tanh(self.up(x_full)))
        gate = dc.all_reduce(h.mean().reshape(1), "max")
        return dc.reduce_scatter(h * torch.sigmoid(gate), 0)


def _module_reference(params: list[dict[str, Tensor]], xs: list[Tensor]) -> list[Tensor]:
    """The module's SPMD program in one process with plain torch ops; rank s uses its own
    parameter leaves (so rank r's gradient is d(sum of objectives)/d(rank r's copy))."""
    x_full = torch.cat(xs)
    hs = []
    for p in params:
        hidden = torch.tanh(x_full @ p["up.weight"].T + p["up.bias"])
        hs.append(hidden @ p["down.weight"].T + p["down.bias"])
    gate = torch.stack([h.mean() for h in hs]).amax().reshape(1)
    total = sum(h * torch.sigmoid(gate) for h in hs)
    return list(total.split([xs[0].shape[0]] * len(xs)))


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_functional_call_grad_vjp_and_per_example_grads(local_worlds, world_size: int) -> None:
    def functional_call_check() -> list[str]:
        r, w = dc.get_rank(), dc.get_world_size()
        model = _SeqParallelMLP()
        params = {k: v.detach() for k, v in model.named_parameters()}
        xs = [torch.randn(2, 3, generator=torch.Generator().manual_seed(50 + s), dtype=F64) for s in range(w)]
        cs = [torch.randn(2, 3, generator=torch.Generator().manual_seed(90 + s), dtype=F64) for s in range(w)]
        problems: list[str] = []

        def close(what: str, a: Tensor, b: Tensor) -> None:
            e = _err(a.detach(), b.detach())
            if not e <= TOL:
                problems.append(f"rank {r}: {what}: err {e:.3g}")

        def loss(p: dict[str, Tensor], x: Tensor, c: Tensor) -> Tensor:
            return (functional_call(model, p, (x,)) * c).sum()

        # reference: per-rank parameter leaves, objective = sum of per-rank objectives
        leaves = [{k: v.clone().requires_grad_(True) for k, v in params.items()} for _ in range(w)]
        ref_out = _module_reference(leaves, xs)
        ref_loss = sum((o * c).sum() for o, c in zip(ref_out, cs))
        ref_g = torch.autograd.grad(ref_loss, list(leaves[r].values()))
        ref_grads = dict(zip(leaves[r], ref_g))

        close("functional_call forward", functional_call(model, params, (xs[r],)), ref_out[r])
        g = grad(loss)(params, xs[r], cs[r])
        for k in params:
            close(f"grad(functional_call) {k}", g[k], ref_grads[k])
        _, pull = vjp(lambda p: functional_call(model, p, (xs[r],)), params)
        (gv,) = pull(cs[r])
        for k in params:
            close(f"vjp(functional_call) {k}", gv[k], ref_grads[k])
        model.zero_grad()
        (model(xs[r]) * cs[r]).sum().backward()
        for k, p in model.named_parameters():
            close(f"module backward {k}", p.grad, ref_grads[k])
        # per-example gradients: vmap over a batch of examples, one collective per batch
        xb = torch.stack([xs[r] * (1 + i) for i in range(3)])
        cb = torch.stack([cs[r] - i for i in range(3)])
        _, one = _count(lambda: grad(loss)(params, xb[0], cb[0]))
        gb, batched = _count(vmap(grad(loss), in_dims=(None, 0, 0)), params, xb, cb)
        if batched != one:
            problems.append(f"rank {r}: per-example grads: {batched} raw calls vs {one} for one example")
        for i in range(3):
            gi = grad(loss)(params, xb[i], cb[i])
            for k in params:
                close(f"vmap(grad) example {i} {k}", gb[k][i], gi[k])
        return problems

    problems = [m for rr in local_worlds(world_size).run(functional_call_check) for m in rr]
    assert not problems, "\n".join(problems[:12])
