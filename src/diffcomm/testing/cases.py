"""Single-process references of every collective and a checker that runs on each rank.

A :class:`Case` describes one call of one collective (op, world size, shapes, dtype,
arguments, seed). :func:`run_case` runs it inside every rank of a world and checks, on
that rank:

* **forward** — the output equals :func:`reference_outputs`, a plain-torch computation of
  the *whole SPMD program* from every rank's input (each rank regenerates all ranks'
  inputs from the seed, so no data needs gathering);
* **gradient** — the gradient of ``sum_r <out_r, cot_r>`` equals the reference gradient
  (autograd through the reference);
* **adjoint** — the dot-product test ``sum_r <A x_r, y_r> == sum_r <x_r, A^T y_r>`` with
  ``A^T`` the *dual op from the table*, called directly (linear ops);
* **double backward** — gradients of ``<grad_x, w>`` w.r.t. input and cotangent equal
  the reference's;
* the input is unchanged and the output does not alias it.

Used by the test-suite and by ``python -m diffcomm check``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import torch
from torch import Tensor

import diffcomm as dc
import diffcomm.ops.coalesced
import diffcomm.ops.p2p
import diffcomm.parallel
from diffcomm import backend as B
from diffcomm.ops import registry

from .checks import GradientWatch
from .checks import strided as _strided

LINEAR = ("sum", "avg")


@dataclass(frozen=True)
class Case:
    """One collective call to check.

    Attributes:
        op: collective name (a key of ``diffcomm.DUALS``, or ``"shift"``/``"ppermute"``).
        world: world size the case is for.
        shape: the input shape (per rank; see ``sizes``/``a2a`` for uneven cases).
        dtype: dtype name, e.g. ``"float64"``.
        kwargs: extra arguments (``dim``, ``src``, ``dst``, ``op``, ``split_sizes``,
            ``split_dim``, ``concat_dim``).
        sizes: every rank's input size along ``dim`` (an uneven all_gather / gather: rank
            ``r``'s input has ``sizes[r]`` rows; passed as ``split_sizes``).
        a2a: a world x world matrix, rank ``r`` sending ``a2a[r][j]`` rows to rank ``j``
            (an uneven all_to_all: passed as ``input_split_sizes`` and, unless
            ``kwargs["infer_outputs"]``, ``output_split_sizes``).
        seed: data seed.
        ints: draw small integer values (exact arithmetic, ties and zeros likely).
    """

    op: str
    world: int
    shape: tuple[int, ...]
    dtype: str = "float64"
    kwargs: dict[str, Any] = field(default_factory=dict)
    sizes: tuple[int, ...] | None = None
    a2a: tuple[tuple[int, ...], ...] | None = None
    seed: int = 0
    ints: bool = False

    def label(self) -> str:
        bits = [f"{k}={v}" for k, v in self.kwargs.items()]
        if self.sizes:
            bits.append(f"sizes={list(self.sizes)}")
        if self.a2a:
            bits.append(f"splits={[list(r) for r in self.a2a]}")
        return f"{self.dtype} {list(self.shape)} " + " ".join(bits)


@dataclass
class CaseResult:
    """What :func:`run_case` measured on one rank (errors are max abs / scale)."""

    forward_err: float = 0.0
    grad_err: float = 0.0
    adjoint_err: float | None = None
    double_err: float | None = None
    input_unchanged: bool = True
    no_alias: bool = True
    grad_unchanged: bool = True
    seconds: float = 0.0
    tol: float = 0.0

    @property
    def ok(self) -> bool:
        errs = [self.forward_err, self.grad_err, self.adjoint_err or 0.0, self.double_err or 0.0]
        return (
            self.input_unchanged
            and self.no_alias
            and self.grad_unchanged
            and all(e <= self.tol for e in errs)
        )

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def tolerance(dtype: str) -> float:
    """Relative tolerance for comparing a dtype's result against a float64 reference."""
    return {
        "float64": 1e-10,
        "complex128": 1e-10,
        "float32": 2e-5,
        "complex64": 2e-5,
        "float16": 4e-3,
        "bfloat16": 3e-2,
    }.get(dtype, 0.0)


# --------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------


def input_shape(case: Case, rank: int) -> tuple[int, ...]:
    """Rank ``rank``'s input shape (differs from ``case.shape`` for uneven cases)."""
    shape = list(case.shape)
    if case.sizes is not None:  # every rank's own size along dim (an uneven gather)
        shape[case.kwargs.get("dim", 0)] = case.sizes[rank]
    if case.a2a is not None:  # rank r sends a2a[r][j] rows to rank j
        shape[case.kwargs.get("split_dim", 0)] = sum(case.a2a[rank])
    return tuple(shape)


def _values(case: Case, shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype) -> Tensor:
    if case.ints:
        v = torch.randint(-2, 4, shape, generator=gen, dtype=torch.int64).to(torch.float64)
    else:
        v = torch.randn(shape, generator=gen, dtype=torch.float64)
    if dtype.is_complex:
        im = (
            torch.randint(-2, 3, shape, generator=gen).double()
            if case.ints
            else torch.randn(shape, generator=gen, dtype=torch.float64)
        )
        return torch.complex(v, im).to(dtype)
    return v.to(dtype)


def make_inputs(case: Case, role: str, dtype: torch.dtype | None = None) -> list[Tensor]:
    """Every rank's tensor for ``role`` (``"x"`` inputs, ``"cot"`` cotangents, ``"w"``)."""
    dtype = dtype or _dtype(case.dtype)
    salt = {"x": 0, "cot": 1, "w": 2}[role]
    out = []
    for r in range(case.world):
        gen = torch.Generator().manual_seed(case.seed * 1000 + r * 10 + salt)
        if role == "x":
            shape = input_shape(case, r)
        else:
            shape = _out_shape_of(case, r)
        out.append(_values(case, shape, gen, dtype))
    return out


def _out_shape_of(case: Case, rank: int) -> tuple[int, ...]:
    xs = [torch.zeros(input_shape(case, r), dtype=torch.float64) for r in range(case.world)]
    return tuple(reference_outputs(case, xs)[rank].shape)


# --------------------------------------------------------------------------------------
# the single-process reference of the whole SPMD program
# --------------------------------------------------------------------------------------


#: point-to-point programs checked as a ring shift by ``offset`` (their whole-program
#: reference and adjoint are shift's): ``sendrecv(x, dst=r+k, src=r-k)``, and
#: ``send(x, dst=r+k)`` then ``recv(src=r-k)`` with the send's token added to the output
#: (so the loss reaches it and its backward receives the gradient from ``dst``)
AS_SHIFT = ("sendrecv", "send/recv")


def _registry() -> dict[str, Any]:
    """Every op with a serial reference: the collectives and the symmetric p2p ops, and any
    a user's module has defined since (name -> op class)."""
    return registry.with_reference()


def _spec(op: str) -> Any:
    """The class of ``op`` (a case's op), or a ``ValueError`` naming the fact it lacks."""
    spec = _registry().get("shift" if op in AS_SHIFT else op)
    if spec is None:
        cls = registry.REGISTRY.get(op)
        why = "unknown op" if cls is None else "no serial reference (state `reference` on its class)"
        raise ValueError(f"{op!r}: {why}")
    return spec


def op_kwargs(case: Case, rank: int) -> dict[str, Any]:
    """The keyword arguments of ``case.op`` on ``rank``, split sizes spelled out (what the
    registry's ``dual_args`` and ``reference`` read)."""
    kw = {k: v for k, v in case.kwargs.items() if k != "infer_outputs"}
    if case.sizes is not None:
        kw["split_sizes"] = list(case.sizes)
    if case.a2a is not None:
        kw["input_split_sizes"] = list(case.a2a[rank])
        kw["output_split_sizes"] = [case.a2a[j][rank] for j in range(case.world)]
    return kw


def reference_outputs(case: Case, xs: list[Tensor]) -> list[Tensor]:
    """Every rank's output of ``case.op`` computed in one process with plain torch ops
    (the registry entry's serial reference)."""
    return _spec(case.op).reference(xs, [op_kwargs(case, r) for r in range(case.world)])


def call(case: Case, x: Tensor) -> Tensor:
    """Call the diffcomm op of ``case`` on this rank's ``x``."""
    kw = dict(case.kwargs)
    if case.a2a is not None:
        rank = dc.get_rank()
        kw["input_split_sizes"] = list(case.a2a[rank])
        if kw.pop("infer_outputs", False) is False:
            kw["output_split_sizes"] = [case.a2a[j][rank] for j in range(case.world)]
    kw.pop("infer_outputs", None)
    if case.op in AS_SHIFT:
        r, n, k = dc.get_rank(), dc.get_world_size(), kw["offset"]
        if case.op == "sendrecv":
            return dc.sendrecv(x, dst=(r + k) % n, src=(r - k) % n)
        token = dc.send(x, dst=(r + k) % n)
        return dc.recv(src=(r - k) % n) + token
    return registry.public_fn(_spec(case.op))(x, **kw)


def call_dual(case: Case, y: Tensor) -> Tensor | None:
    """Apply the adjoint named by the registry to ``y`` directly (linear cases of an op that
    states ``dual_args``; else ``None``: the gradient is checked against the reference's)."""
    spec = _spec(case.op)
    if case.kwargs.get("op", "sum") not in LINEAR or spec.dual_args is None:
        return None
    dual_kwargs, scale = spec.dual_args(op_kwargs(case, dc.get_rank()), case.world)
    out = registry.public_fn(spec.dual)(y, **dual_kwargs)
    return out * scale if scale != 1.0 else out


# --------------------------------------------------------------------------------------
# the checker (runs on every rank)
# --------------------------------------------------------------------------------------


def _inner(a: Tensor, b: Tensor) -> Tensor:
    a, b = a.to(torch.complex128 if a.is_complex() or b.is_complex() else torch.float64), b
    b = b.to(a.dtype)
    return (a * b.conj()).real.sum()


def _rel(a: Tensor | None, b: Tensor | None) -> float:
    if a is None and b is None:
        return 0.0
    if a is None:
        a = torch.zeros_like(b)  # type: ignore[arg-type]
    if b is None:
        b = torch.zeros_like(a)
    a64 = a.detach().cpu().to(torch.complex128 if a.is_complex() else torch.float64)
    b64 = b.detach().cpu().to(a64.dtype)
    if a64.shape != b64.shape:
        return float("inf")
    if a64.numel() == 0:
        return 0.0
    scale = max(1.0, float(b64.abs().max()))
    return float((a64 - b64).abs().max()) / scale


def case_device() -> torch.device:
    """The device a case's rank tensors live on: the default group's communication device
    (the CPU for gloo, this rank's GPU for nccl). References are computed on the CPU."""
    return B.get_backend().comm_device(None)


def _sum_over_ranks(*vs: float) -> Any:
    """The sums over ranks of ``vs`` (one all_reduce): a float for one value, else a list."""
    t = torch.tensor(vs, dtype=torch.float64, device=case_device())
    out = B.get_backend().all_reduce(t, "sum", None).tolist()
    return out[0] if len(vs) == 1 else out


def _differentiable(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def run_case(case: Case, double: bool = True) -> CaseResult:
    """Check ``case`` on this rank (call on every rank of a ``case.world``-rank world)."""
    start = time.perf_counter()
    rank, w = dc.get_rank(), dc.get_world_size()
    if w != case.world:
        raise ValueError(f"run_case: case is for world {case.world}, this world has {w} ranks")
    dtype = _dtype(case.dtype)
    res = CaseResult(tol=tolerance(case.dtype))
    xs = make_inputs(case, "x")
    grad_ok = _differentiable(dtype)
    dev = case_device()
    x = xs[rank].to(dev, copy=True).requires_grad_(grad_ok)
    x_before = x.detach().clone()
    out = call(case, x)
    # reference in float64/complex128 (exact for the small-int cases)
    hi = torch.complex128 if dtype.is_complex else torch.float64
    xs_ref = [t.detach().to(hi).requires_grad_(True) for t in xs] if grad_ok else [t.to(hi) for t in xs]
    ref = reference_outputs(case, xs_ref)
    res.forward_err = _rel(out, ref[rank].to(out.dtype) if not grad_ok else ref[rank])
    res.input_unchanged = bool(torch.equal(x.detach(), x_before))
    res.no_alias = out.numel() == 0 or out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    if not grad_ok:
        res.seconds = time.perf_counter() - start
        return res
    cots = make_inputs(case, "cot")
    cot = cots[rank].to(dev, copy=True).requires_grad_(True)
    loss = _inner(out, cot)
    if case.op == "send/recv":
        # the recv's backward (which sends the gradient back to src) is not on the path
        # from the loss to this rank's x, so autograd.grad(loss, x) would prune it and the
        # peer's token would wait forever: a whole backward, as a training step runs it
        # (first order only: double=False)
        double = False
        loss.backward()
        gx = x.grad
    else:
        (gx,) = torch.autograd.grad(loss, x, create_graph=double)
    assert gx is not None  # x requires grad and every case's loss reaches it
    ref_loss = cast(Tensor, sum(_inner(o, c.to(hi)) for o, c in zip(ref, cots)))
    ref_g = torch.autograd.grad(ref_loss, xs_ref, create_graph=double, allow_unused=True)
    ref_gx = ref_g[rank] if ref_g[rank] is not None else torch.zeros_like(xs_ref[rank])
    res.grad_err = _rel(gx, ref_gx)
    res.input_unchanged = res.input_unchanged and bool(torch.equal(x.detach(), x_before))  # after backward
    if case.op != "send/recv":
        # again with a non-contiguous input and cotangent (the same values): a backward that
        # is wrong only for a strided gradient is a classic silent bug, and every tensor
        # above is contiguous
        # (and a backward must leave the gradient it receives unchanged: autograd may hand
        # the same tensor to another backward)
        x_nc = _strided(xs[rank].to(dev)).requires_grad_(True)
        out_nc = call(case, x_nc)
        watch = GradientWatch([out_nc])
        (gx_nc,) = torch.autograd.grad(out_nc, x_nc, grad_outputs=_strided(cots[rank].to(dev)))
        res.grad_err = max(res.grad_err, _rel(gx_nc, ref_gx))
        res.grad_unchanged = not bool(watch.changed())
    # dot-product test with the dual op from the table (linear ops)
    with torch.no_grad():
        y = cots[rank].to(dev)
        aty = call_dual(case, y)
    if aty is not None:
        # relative to the sums of |terms| (the rounding bound of a dot product), not to
        # |lhs|: with cancellation between ranks' terms (low precision, avg's 1/world)
        # |lhs| can be far smaller than the rounding the terms carry
        o, xd = out.detach(), x.detach()
        lhs, rhs, lhs_abs, rhs_abs = _sum_over_ranks(
            float(_inner(o, y)),
            float(_inner(xd, aty)),
            float(_inner(o.abs(), y.abs())),
            float(_inner(xd.abs(), aty.abs())),
        )
        res.adjoint_err = abs(lhs - rhs) / max(1.0, lhs_abs, rhs_abs)
    if double:
        ws = make_inputs(case, "x")  # w lives in input space
        wv = ws[(rank + 1) % w].to(dev, dtype)
        if wv.shape != gx.shape:
            wv = torch.ones_like(gx)
        second = _inner(gx, wv)
        h = torch.autograd.grad(second, [x, cot], allow_unused=True)
        wref = []
        for r in range(w):
            cand = ws[(r + 1) % w].to(hi)
            wref.append(cand if cand.shape == xs_ref[r].shape else torch.ones_like(xs_ref[r]))
        ref_second = sum(_inner(g, wr) for g, wr in zip(ref_g, wref) if g is not None)
        ref_hx: Tensor | None = None
        if isinstance(ref_second, Tensor) and ref_second.requires_grad:
            ref_hx = torch.autograd.grad(ref_second, xs_ref, allow_unused=True)[rank]
        # d/dcot of the second-order term is A w (the VJP is linear in the cotangent)
        ref_hc = _cot_grad_reference(case, wref, [c.to(hi) for c in cots])
        res.double_err = max(_rel(h[0], ref_hx), _rel(h[1], ref_hc[rank]))
    res.seconds = time.perf_counter() - start
    return res


def _cot_grad_reference(case: Case, wref: list[Tensor], cots: list[Tensor]) -> list[Tensor]:
    """d/dcot_r of sum_r <g_r(cot), w_r> where g is the reference VJP (linear in cot)."""
    xs = [t.detach().to(wref[0].dtype) for t in make_inputs(case, "x")]
    xs = [t.requires_grad_(True) for t in xs]
    cs = [c.detach().clone().requires_grad_(True) for c in cots]
    ref = reference_outputs(case, xs)
    loss = cast(Tensor, sum(_inner(o, c) for o, c in zip(ref, cs)))
    gs = torch.autograd.grad(loss, xs, create_graph=True, allow_unused=True)
    second = sum(_inner(g, wr) for g, wr in zip(gs, wref) if g is not None)
    if not (isinstance(second, Tensor) and second.requires_grad):
        return [torch.zeros_like(c) for c in cs]
    out = torch.autograd.grad(second, cs, allow_unused=True)
    return [o if o is not None else torch.zeros_like(c) for o, c in zip(out, cs)]


# --------------------------------------------------------------------------------------
# the standard case list (python -m diffcomm check)
# --------------------------------------------------------------------------------------


def registry_cases(world: int, family: str, modules: Sequence[str] = ()) -> Iterator[Case]:
    """The standard cases every op of ``family`` states (its class's ``cases``), in the
    registry's order, for ``world`` ranks: diffcomm's own ops and those of ``modules``
    (the names of the user's modules that define ops)."""
    for name, cls in registry.family(family, modules).items():
        if cls.cases is not None:
            for fields in cls.cases(world):
                yield Case(**{"op": name, "world": world, **fields})


def standard_cases(world: int, modules: Sequence[str] = ()) -> Iterator[Case]:
    """Every collective's standard cases (every reduce op, several dtypes, uneven splits),
    for ``world`` ranks: the ``cases`` their classes state (also those of ``modules``)."""
    return registry_cases(world, "collective", modules)


def standard_p2p_cases(world: int, modules: Sequence[str] = ()) -> Iterator[Case]:
    """The point-to-point ops' standard cases, ring programs (``send/recv``, ``sendrecv``,
    ``shift``, ``ppermute``), for ``world`` ranks; none in a world of one (no peer)."""
    return registry_cases(world, "p2p", modules)
