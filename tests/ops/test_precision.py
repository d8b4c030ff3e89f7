"""Low-precision collectives (``precision=dc.Precision(...)``) on real gloo ranks.

* property tests (hypothesis; worlds 2-4, shapes, dims, fp8 block sizes, separate
  backward settings): every op x {bf16, fp16, fp8 e4m3, fp8 e5m2}, forward values and
  backward gradients within the stated bound of an fp64 oracle, and the dot-product test
  ``sum_r <A_q x, g> == sum_r <x, B_q g>`` within the bound those two imply
  (``docs/precision.md`` derives them: unit roundoff ``u`` of the wire dtype, half the
  subnormal spacing times the block scale for fp8, fp32 accumulation);
* exactly-once rounding: Megatron's accumulation vector (bf16 1000 + 1 + 1 + 1 gives 1004,
  not the 1000 a bf16 running sum gives; fp16 2048 + 1 + 1 + 1 gives 2052, not 2048),
  Megatron's random test (bf16 ``rand`` shards: the result equals the fp32 sum rounded
  to bf16 bit for bit), and a hypothesis version against an fp64 oracle: one rounding;
* bytes per call counted by the comms logger, per dtype, equal the theory;
* torch.func (jvp, vmap) and double backward; bad input before any communication;
* without ``precision=`` the ops are bit for bit what they were.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _shared import check_in_batches, refusals
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import diffcomm as dc
from diffcomm import backend as B
from diffcomm.ops.precision import FP8_MAX, Precision, encode, quantize, unit_roundoff

# The low-precision ops' values and gradients need no real transport: this module's shared worlds are
# in-process (the same values as gloo processes: tests/runtime/test_in_process.py). A test that needs
# a process per rank says why and stays on processes.
pytestmark = pytest.mark.diffcomm_in_process


F64 = torch.float64
WIRES = ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2"]
OPS = ["all_reduce", "reduce_scatter", "all_gather", "all_to_all"]
U32 = 2.0**-24


# --------------------------------------------------------------------------------------
# the error model (docs/precision.md, "Error bounds")
# --------------------------------------------------------------------------------------


def qerr(v: torch.Tensor, p: Precision) -> torch.Tensor:
    """Per-element bound on ``|quantize(v) - v|`` for ``v`` (fp64 values of fp32 data; blocks
    along the last dim): ``(u + 2^-22)|v| + eta * s`` with ``eta`` half the subnormal spacing
    of the wire dtype and ``s`` the block scale (1 for bf16/fp16 casts)."""
    if p.wire is None:
        return torch.zeros_like(v)
    wire = p.wire
    fi = torch.finfo(wire)
    u = unit_roundoff(wire)
    eta = float(fi.smallest_normal) * float(fi.eps) / 2
    if wire not in FP8_MAX:
        return u * v.abs() + eta
    if v.ndim == 0:
        return qerr(v.reshape(1), p).reshape(())
    n = v.shape[-1]
    b = p.block_size or n
    a = v.abs().reshape(*v.shape[:-1], n // b, b).amax(-1, keepdim=True) if n else v.abs()
    s = (a / FP8_MAX[wire]).expand(*v.shape[:-1], n // b, b).reshape(v.shape) if n else a
    return (u + 2.0**-22) * v.abs() + eta * s * (1 + 2.0**-20)


def backward_settings(p: Precision) -> Precision:
    """The settings the backward must use, read off the options (not the library's
    ``transposed``): ``backward``, or the forward's own when it is None."""
    b = p.backward or p
    return Precision(b.wire, b.accumulate, b.block_size)


def chunk(t: torch.Tensor, dim: int, world: int, r: int) -> torch.Tensor:
    return t.chunk(world, dim)[r] if t.shape[dim] else t


def expect(op: str, kw: dict[str, Any], xs: list[torch.Tensor], p: Precision, r: int) -> tuple[Any, Any]:
    """(fp64 oracle, per-element error bound) of ``op`` with forward settings ``p`` on rank
    ``r``, every rank's input in ``xs`` (fp64 copies of the fp32 data)."""
    w = len(xs)
    if op == "all_gather":
        d = kw["dim"]
        return torch.cat(xs, d), torch.cat([qerr(x, p) for x in xs], d)
    if op == "all_to_all":
        s, c = kw["split_dim"], kw["concat_dim"]
        return (
            torch.cat([chunk(x, s, w, r) for x in xs], c),
            torch.cat([chunk(qerr(x, p), s, w, r) for x in xs], c),
        )
    scale = 1.0 / w if kw.get("op", "sum") == "avg" else 1.0
    total = sum(xs) * scale
    err = sum(qerr(x, p) for x in xs) * scale + 2 * w * U32 * sum(x.abs() for x in xs) * scale
    if kw.get("op", "sum") == "avg":
        err = err + U32 * total.abs()
    if op == "reduce_scatter":
        d, sizes = kw["dim"], kw.get("split_sizes")
        if sizes is not None:  # uneven
            return total.split(sizes, d)[r], err.split(sizes, d)[r]
        return chunk(total, d, w, r), chunk(err, d, w, r)
    # all_reduce: the sum is rounded once more, to the wire dtype, for its all_gather phase
    return total, err + qerr(total.abs() + err, p)


def dual(op: str, kw: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    if op == "all_gather":
        return "reduce_scatter", {"dim": kw["dim"], "split_sizes": kw.get("split_sizes")}
    if op == "reduce_scatter":
        return "all_gather", {"dim": kw["dim"], "split_sizes": kw.get("split_sizes")}
    if op == "all_to_all":
        return "all_to_all", {"split_dim": kw["concat_dim"], "concat_dim": kw["split_dim"]}
    return "all_reduce", dict(kw)


def data(seed: int, shape: tuple[int, ...], spread: int) -> torch.Tensor:
    """fp32 normal values times ``2**k``, ``|k| <= spread`` per element (exercises block
    scales and fp8 subnormals)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float32)
    k = torch.randint(-spread, spread + 1, shape, generator=g).to(torch.float32)
    return x * torch.exp2(k)


# --------------------------------------------------------------------------------------
# values, gradients and the dot-product test vs the fp64 oracle
# --------------------------------------------------------------------------------------


def _shape_of(case: dict[str, Any], j: int, side: str, out: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Rank ``j``'s input (``side="in"``) or output-gradient shape; uneven cases differ
    along ``dim`` (all_gather: the inputs; reduce_scatter: the outputs)."""
    sizes, op = case.get("sizes"), case["op"]
    base = list(case["shape"]) if side == "in" else list(out or ())
    if sizes is None:
        return tuple(base)
    d = case["kw"]["dim"]
    if (op == "all_gather" and side == "in") or (op == "reduce_scatter" and side == "out"):
        base[d] = sizes[j]
    return tuple(base)


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """On every rank: forward, backward, and their excess over the bounds (<= 0 passes)."""
    r, w = dc.get_rank(), dc.get_world_size()
    op, kw, p = case["op"], case["kw"], case["precision"]
    xs = [data(case["seed"] + j, _shape_of(case, j, "in"), case["spread"]) for j in range(w)]
    x = xs[r].clone().requires_grad_(True)
    y = getattr(dc, op)(x, **kw, precision=p)
    gs = [
        data(case["seed"] + 100 + j, _shape_of(case, j, "out", tuple(y.shape)), case["spread"])
        for j in range(w)
    ]
    if case.get("sizes") is not None and op == "all_gather":  # the dual reduce_scatter's sizes
        kw = {**kw, "split_sizes": list(case["sizes"])}
    (gx,) = torch.autograd.grad(y, x, gs[r])
    xs64 = [t.to(F64) for t in xs]
    y_ref, y_bound = expect(op, kw, xs64, Precision(p.wire, p.accumulate, p.block_size), r)
    dop, dkw = dual(op, kw)
    g_ref, g_bound = expect(dop, dkw, [t.to(F64) for t in gs], backward_settings(p), r)
    if op == "reduce_scatter" and kw["op"] == "avg":  # the adjoint of avg: all_gather / world
        g_ref, g_bound = g_ref / w, g_bound / w + U32 * g_ref.abs() / w
    y64, gx64, g64, x64 = y.detach().to(F64), gx.to(F64), gs[r].to(F64), xs64[r]
    return {
        "fwd_excess": float((y64 - y_ref).abs().sub(y_bound).max()) if y.numel() else -1.0,
        "bwd_excess": float((gx64 - g_ref).abs().sub(g_bound).max()) if gx.numel() else -1.0,
        "fwd_err": float((y64 - y_ref).abs().max()) if y.numel() else 0.0,
        # dot-product test, this rank's terms: <A_q x, g>, <x, B_q g> and the bound
        # |<A_q x - A x, g>| + |<x, B_q g - A^T g>| <= <y_bound, |g|> + <|x|, g_bound>
        "lhs": float((y64 * g64).sum()),
        "rhs": float((x64 * gx64).sum()),
        "dot_bound": float((y_bound * g64.abs()).sum() + (x64.abs() * g_bound).sum()),
        "scale": float((y64.abs() * g64.abs()).sum() + (x64.abs() * gx64.abs()).sum()),
    }


@st.composite
def cases(draw: st.DrawFn, world: int, op: str) -> dict[str, Any]:
    wire = draw(st.sampled_from(WIRES))
    fp8 = wire.startswith("fp8")
    ndim = draw(st.integers(1, 3))
    block = draw(st.sampled_from([None, 1, 2, 4])) if fp8 else None
    unit = block or 1
    shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
    shape[-1] = unit * draw(st.integers(1, 3))
    kw: dict[str, Any] = {}
    if op in ("reduce_scatter", "all_gather"):
        d = draw(st.integers(0, ndim - 1))
        kw["dim"] = d
    sizes = None
    if op in ("reduce_scatter", "all_gather") and draw(st.booleans()):  # uneven per-rank sizes
        unit_d = unit if (fp8 and d == ndim - 1) else 1
        sizes = [unit_d * draw(st.integers(0, 2)) for _ in range(world)]
    if op == "reduce_scatter":
        kw["op"] = draw(st.sampled_from(["sum", "avg"]))
        shape[d] = sum(sizes) if sizes is not None else shape[d] * world
        if sizes is not None:
            kw["split_sizes"] = sizes
    if op == "all_gather" and sizes is not None:
        shape[d] = sizes[0]  # (rank j's input has sizes[j] along dim)
    if op == "all_reduce":
        kw["op"] = draw(st.sampled_from(["sum", "avg"]))
    if op == "all_to_all":
        kw["split_dim"] = draw(st.integers(0, ndim - 1))
        kw["concat_dim"] = draw(st.integers(0, ndim - 1))
        shape[kw["split_dim"]] *= world
    # a dim split into chunks along the last dim: chunks of whole blocks (None: whole rows)
    split_last = (op == "reduce_scatter" and kw["dim"] == ndim - 1) or (
        op == "all_to_all" and ndim - 1 in (kw["split_dim"], kw["concat_dim"])
    )
    if op == "all_gather" and kw["dim"] == ndim - 1:
        split_last = True
    if fp8 and split_last and block is None:
        block = 1
    backward = draw(st.sampled_from([None, "exact", *WIRES]))
    if backward is None:
        bp = None
    elif backward == "exact":
        bp = Precision(None)
    else:
        bblock = 1 if backward.startswith("fp8") and draw(st.booleans()) else None
        if backward.startswith("fp8") and split_last:
            bblock = 1
        bp = Precision(backward, block_size=bblock)
    p = Precision(wire, block_size=block, backward=bp)
    spread = draw(st.sampled_from([0, 4, 12]))
    return {
        "op": op,
        "kw": kw,
        "shape": tuple(shape),
        "precision": p,
        "seed": draw(st.integers(0, 10**6)),
        "spread": spread,
        "sizes": sizes,
    }


def _assert_cases(world: dc.LocalWorld, batch: list[dict[str, Any]]) -> None:
    def run_all(batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [run_case(c) for c in batch]

    per_rank = world.run(run_all, batch)
    for i, case in enumerate(batch):
        rows = [per_rank[r][i] for r in range(len(per_rank))]
        for r, row in enumerate(rows):
            assert row["fwd_excess"] <= 0, (case, r, row)
            assert row["bwd_excess"] <= 0, (case, r, row)
        lhs, rhs = sum(x["lhs"] for x in rows), sum(x["rhs"] for x in rows)
        bound = sum(x["dot_bound"] for x in rows) + 1e-12 * sum(x["scale"] for x in rows)
        assert abs(lhs - rhs) <= bound, (case, lhs, rhs, bound)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("op", OPS)
def test_values_gradients_and_adjoint_within_bounds(local_worlds, op: str, world_size: int) -> None:
    check_in_batches(local_worlds(world_size), cases(world_size, op), _assert_cases, max_examples=10)


def _every_wire(op: str, world: int) -> list[dict[str, Any]]:
    """Each wire dtype in both directions (forward in one, backward in another), fixed."""
    out = []
    for i, wire in enumerate(WIRES):
        back = WIRES[(i + 1) % len(WIRES)]
        blk = 2 if wire.startswith("fp8") else None
        bblk = 2 if back.startswith("fp8") else None
        p = Precision(wire, block_size=blk, backward=Precision(back, block_size=bblk))
        kw = {"all_reduce": {"op": "sum"}, "reduce_scatter": {"dim": 1, "op": "sum"}}.get(op, {})
        kw = {"all_gather": {"dim": 1}, "all_to_all": {"split_dim": 1, "concat_dim": 0}}.get(op, kw)
        shape = (3, 4 * world) if op in ("reduce_scatter", "all_to_all") else (3, 4)
        out.append({"op": op, "kw": kw, "shape": shape, "precision": p, "seed": 7 * i, "spread": 6})
    return out


@pytest.mark.parametrize("op", OPS)
def test_every_wire_dtype_forward_and_backward(world3, op: str) -> None:
    """Every op x every wire dtype, forward and backward (deterministic cases, world 3),
    and the bound is not vacuous: the observed error is nonzero and within 100x of it."""
    batch = _every_wire(op, 3)
    _assert_cases(world3, batch)
    per_rank = world3.run(lambda b: [run_case(c)["fwd_err"] for c in b], batch)
    assert all(e > 0 for row in per_rank for e in row)


# --------------------------------------------------------------------------------------
# exactly-once rounding (Megatron's reduce_scatter_with_fp32_accumulation)
# --------------------------------------------------------------------------------------


def _megatron_vector(dtype: torch.dtype, big: float) -> list[list[float]]:
    r = dc.get_rank()
    x = torch.full((4,), big if r == 0 else 1.0, dtype=dtype)
    p = Precision(dtype)
    rs = dc.reduce_scatter(x, precision=p)
    ar = dc.all_reduce(x, precision=p)
    running = torch.tensor(big, dtype=dtype)
    for _ in range(dc.get_world_size() - 1):
        running = running + torch.tensor(1.0, dtype=dtype)  # a bf16 ring: rounds every hop
    return [rs.tolist(), ar.tolist(), [running.item()]]


def test_megatron_accumulation_vector(world4) -> None:
    """bf16 shards 1000, 1, 1, 1: exact sum 1003, rounded once: 1004 (a bf16 running sum
    stays at 1000). fp16: 2048 + 1 + 1 + 1 = 2051 -> 2052 (running fp16: 2048)."""
    for dtype, big, want, running in (
        (torch.bfloat16, 1000.0, 1004.0, 1000.0),
        (torch.float16, 2048.0, 2052.0, 2048.0),
    ):
        for rs, ar, run in world4.run(_megatron_vector, dtype, big):
            assert rs == [want] and ar == [want] * 4 and run == [running]


def _summed_in(acc: torch.dtype, big: float) -> list[list[float]]:
    """Megatron's vector (``big, 1, 1, 1``, float32) on an ``acc`` wire summed in ``acc``:
    forward (reduce_scatter, all_reduce) and a backward in those settings (all_gather's
    gradient, a reduce_scatter)."""
    r, w = dc.get_rank(), dc.get_world_size()
    v = torch.full((w,), big if r == 0 else 1.0)
    p = Precision(acc, accumulate=acc)
    rs = dc.reduce_scatter(v, precision=p)
    ar = dc.all_reduce(v, precision=p)
    x = torch.zeros(1, requires_grad=True)
    y = dc.all_gather(x, precision=Precision("fp16", backward=p))
    (gx,) = torch.autograd.grad(y, x, v)
    return [rs.tolist(), ar.tolist(), gx.tolist()]


def test_a_half_precision_accumulation_dtype_is_what_sums(world4) -> None:
    """``accumulate=bf16`` / ``fp16``: the contributions add in that dtype, rank by rank (a
    bf16 running sum: 1000 + 1 + 1 + 1 stays 1000; fp16: 2048 stays 2048), forward and
    in the backward's own settings. torch's ``sum`` adds bf16 / fp16 in float32, so they
    were summed in float32 and rounded once (1004, 2052): the dtype asked for was not the
    one that summed."""
    for acc, big in ((torch.bfloat16, 1000.0), (torch.float16, 2048.0)):
        for rs, ar, gx in world4.run(_summed_in, acc, big):
            assert rs == [big] and ar == [big] * 4 and gx == [big], (acc, rs, ar, gx)


def _megatron_random(n: int) -> tuple[bool, bool, bool]:
    r, w = dc.get_rank(), dc.get_world_size()
    xs = [
        torch.rand(n, generator=torch.Generator().manual_seed(j), dtype=torch.float32).bfloat16()
        for j in range(w)
    ]
    y = dc.reduce_scatter(xs[r], precision=Precision("bf16"))
    fp32_then_once = torch.stack(xs).float().sum(0).bfloat16().chunk(w)[r]
    running = xs[0]
    for t in xs[1:]:
        running = running + t  # the bf16 reduction Megatron's test says must differ
    return torch.equal(y, fp32_then_once), torch.equal(y, running.chunk(w)[r]), y.dtype == torch.bfloat16


def test_megatron_random_shards_equal_fp32_sum_rounded_once(world4) -> None:
    """Megatron's test: bf16 ``rand`` shards; the fp32-accumulating reduce_scatter equals
    the fp32 reduction cast to bf16 bit for bit, and differs from a bf16 reduction."""
    for exact, same_as_bf16, dtype_ok in world4.run(_megatron_random, 4096):
        assert exact and not same_as_bf16 and dtype_ok


def _once(xs: list[list[float]], dtype: torch.dtype) -> list[bool]:
    r, w = dc.get_rank(), dc.get_world_size()
    ts = [torch.tensor(v, dtype=F64).to(dtype) for v in xs]
    exact = torch.stack([t.to(F64) for t in ts]).sum(0)
    rs = dc.reduce_scatter(ts[r], precision=Precision(dtype))
    ar = dc.all_reduce(ts[r], precision=Precision(dtype))
    once = exact.to(dtype)  # the fp64 sum (exact here) rounded once
    u = unit_roundoff(dtype)
    within = bool(((rs.to(F64) - exact.chunk(w)[r]).abs() <= u * exact.chunk(w)[r].abs()).all())
    return [torch.equal(rs, once.chunk(w)[r]), torch.equal(ar, once), within]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_one_final_rounding_vs_fp64_oracle(local_worlds, world_size: int) -> None:
    """bf16/fp16 shards whose fp32 sum is exact (8/11-bit integers times 2^k, |k| <= 4):
    the result is the fp64 sum rounded once to the payload dtype, bit for bit, and within
    ``u |sum|`` of it."""
    world = local_worlds(world_size)

    @settings(max_examples=8, deadline=None)
    @given(
        st.sampled_from([torch.bfloat16, torch.float16]),
        st.integers(1, 4).flatmap(
            lambda n: st.lists(
                st.lists(
                    st.builds(lambda k, e: float(k) * 2.0**e, st.integers(-255, 255), st.integers(-4, 4)),
                    min_size=n * world_size,
                    max_size=n * world_size,
                ),
                min_size=world_size,
                max_size=world_size,
            )
        ),
    )
    def check(dtype: torch.dtype, xs: list[list[float]]) -> None:
        if dtype == torch.float16:
            xs = [[v * 8 for v in row] for row in xs]  # 11-bit integers
        # the bound is for sums the dtype can hold (fp16 overflows past 65504: inf either way)
        assume(max(abs(sum(col)) for col in zip(*xs)) <= torch.finfo(dtype).max / 2)
        for row in world.run(_once, xs, dtype):
            assert all(row), (dtype, xs, row)

    check()


# --------------------------------------------------------------------------------------
# bytes on the wire
# --------------------------------------------------------------------------------------

_SIZE = {"bf16": 2, "fp16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}
_DT = {
    "bf16": "torch.bfloat16",
    "fp16": "torch.float16",
    "fp8_e4m3": "torch.float8_e4m3fn",
    "fp8_e5m2": "torch.float8_e5m2",
}


def _bytes(wire: str, block: int | None) -> dict[str, dict[str, int]]:
    w = dc.get_world_size()
    p = Precision(wire, block_size=block)
    x = torch.randn(4 * w, 8)
    out = {}
    calls = {
        "all_gather": lambda: dc.all_gather(x, split_sizes=[4 * w] * w, precision=p),
        "reduce_scatter": lambda: dc.reduce_scatter(x, precision=p),
        "all_reduce": lambda: dc.all_reduce(x, precision=p),
        "all_to_all": lambda: dc.all_to_all(x, precision=p),
        "fp32 all_reduce": lambda: dc.all_reduce(x),
    }
    for name, call in calls.items():
        with B.log_comms() as log:
            call()
        out[name] = log.by_dtype()
        out[name + " sent"] = {k: int(v) for k, v in log.sent_by_dtype().items()}
    return out


@pytest.mark.parametrize(
    "wire,block", [("bf16", None), ("fp16", None), ("fp8_e4m3", None), ("fp8_e4m3", 2), ("fp8_e5m2", 4)]
)
@pytest.mark.usefixtures("debug_off")
def test_bytes_per_call_equal_theory(world2, wire: str, block: int | None) -> None:
    """The comms logger's bytes per dtype: payload ``numel * itemsize(wire)`` plus, for fp8,
    ``4 * numel / block`` bytes of float32 scales (block None: one scale per row of 8);
    all_gather logs the gathered buffer (world x), the all_to_all-based ops their input
    (all_reduce: the reduce-scatter all_to_all plus the all_gather of the reduced rows)."""
    w, n = 2, 4 * 2 * 8
    per_scale = 8 // (block or 8)
    want_payload = {"all_gather": w * n, "reduce_scatter": n, "all_reduce": 2 * n, "all_to_all": n}
    for row in world2.run(_bytes, wire, block):
        assert row["fp32 all_reduce"] == {"torch.float32": 4 * n}
        for op, k in want_payload.items():
            want = {_DT[wire]: k * _SIZE[wire]}
            if wire.startswith("fp8"):
                want["torch.float32"] = 4 * (k // 8) * per_scale
            assert row[op] == want, (op, row[op], want)
        # bytes each rank sends (bus factors): fp32 all_reduce 2 (w-1)/w of 4n; the
        # quantized one an all_to_all and an all_gather, (w-1)/w of each
        assert row["fp32 all_reduce sent"] == {"torch.float32": 4 * n}
        assert row["all_reduce sent"] == {k: v // 2 for k, v in row["all_reduce"].items()}
        if not wire.startswith("fp8"):
            assert sum(row["all_reduce sent"].values()) * 2 == 4 * n  # 2x fewer than fp32


def _fp8_raw() -> list[float]:
    x = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float32).add(dc.get_rank()).to(torch.float8_e4m3fn)
    y = dc.all_gather(x)
    z = dc.all_to_all(torch.cat([x, x]))
    return y.float().tolist() + z.float().tolist()


def test_fp8_travels_as_bytes_on_gloo(world2) -> None:
    """gloo has no fp8 type; the backend moves fp8 as bytes (exact)."""
    a, b = world2.run(_fp8_raw)
    assert a[:6] == b[:6] == [1.0, -2.0, 0.5, 2.0, -1.0, 1.5]
    assert a[6:] == [1.0, -2.0, 0.5, 2.0, -1.0, 1.5]


# --------------------------------------------------------------------------------------
# transforms, double backward, plain path unchanged, bad input
# --------------------------------------------------------------------------------------


def _transforms() -> list[bool]:
    r = dc.get_rank()
    p = Precision("fp8_e4m3", block_size=2, backward=Precision("bf16"))
    x = data(r, (3, 4), 3)
    t = data(10 + r, (3, 4), 3)
    ok = []
    # jvp: the tangent goes through the same quantized op (forward settings)
    _, tan = torch.func.jvp(lambda v: dc.all_gather(v, dim=1, precision=p), (x,), (t,))
    ok.append(torch.equal(tan, dc.all_gather(t, dim=1, precision=p)))
    # vmap: one collective for the batch, equal to the ops one by one
    xb = torch.stack([x, t])
    with dc.debug(False), B.log_comms() as log:  # (counted without debug mode's own gathers)
        yb = torch.func.vmap(lambda v: dc.all_reduce(v, precision=p))(xb)
    ok.append(log.count() == 4)  # a2a + a2a(scales) + ag + ag(scales): once for the batch
    ok.append(torch.equal(yb, torch.func.vmap(lambda v: dc.all_reduce(v, precision=p))(xb)))
    ok.append(torch.equal(yb, torch.stack([dc.all_reduce(v, precision=p) for v in (x, t)])))
    # double backward: grad of the backward (bf16 reduce_scatter) is the fp8 all_gather again
    xg = x.clone().requires_grad_(True)
    y = dc.all_gather(xg, dim=1, precision=p)
    g = data(20 + r, tuple(y.shape), 3).requires_grad_(True)
    (gx,) = torch.autograd.grad(y, xg, g, create_graph=True)
    ok.append(torch.equal(gx.detach(), dc.reduce_scatter(g.detach(), dim=1, precision=Precision("bf16"))))
    v = data(30 + r, (3, 4), 3)
    (gg,) = torch.autograd.grad(gx, g, v)
    ok.append(torch.equal(gg, dc.all_gather(v, dim=1, precision=p.forward_only())))
    return ok


# on processes: forward-mode AD: one stack of dual levels per process (docs/in_process.md, Limits)
@pytest.mark.diffcomm_in_process(False)
def test_jvp_vmap_and_double_backward(world2) -> None:
    for row in world2.run(_transforms):
        assert len(row) == 6 and all(row), row


def _plain_unchanged() -> bool:
    r = dc.get_rank()
    x = data(r, (4, 6), 2)
    same = []
    for f in (
        lambda v, **k: dc.all_reduce(v, **k),
        lambda v, **k: dc.reduce_scatter(v, **k),
        lambda v, **k: dc.all_gather(v, dim=1, **k),
        lambda v, **k: dc.all_to_all(v, 0, 1, **k),
    ):
        a = f(x)
        b = f(x, precision=None)
        same.append(torch.equal(a, b))
        # an exact Precision (wire None) runs the plain op too
        same.append(torch.equal(a, f(x, precision=Precision(None))))
    return all(same)


def test_without_precision_bit_for_bit(world2) -> None:
    assert all(world2.run(_plain_unchanged))


def test_quantize_model_is_what_travels() -> None:
    """encode/decode: bf16/fp16 are casts; fp8 block scales map each block's amax to the
    dtype's max exactly; an all-zero block stays zero."""
    x = torch.tensor([[3.0, -1.0, 0.0, 0.0], [448.0, 1e-3, 2.0, 0.25]])
    p = Precision("fp8_e4m3", block_size=2)
    q, s = encode(x, p)
    assert s is not None and s.flatten().tolist() == pytest.approx([3 / 448, 1.0, 1.0, 2 / 448])
    y = quantize(x, p)
    assert y[0, 0] == 3.0 and y[1, 0] == 448.0 and y[0, 2:].eq(0).all()
    assert torch.equal(quantize(x, Precision("bf16")), x.bfloat16().float())


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("wire", ["fp8_e4m3", "fp8_e5m2"])
def test_a_non_finite_value_makes_its_whole_fp8_block_nan(wire: str) -> None:
    """docs/precision.md: "A non-finite value makes its whole fp8 block NaN" -- never a
    finite number. (A NaN once made the block's scale 1, so its other values were clamped
    to 448 and an inf became 448; an inf alone made the scale inf, so the block's finite
    values came out 0.) The other blocks keep their own scales and values; a float64
    block whose scale overflows float32 is not finite either."""
    p = Precision(wire, block_size=2)
    x = torch.tensor(
        [[1e3, NAN, 1.0, 2.0], [INF, 5.0, 3.0, -1.0], [-INF, 7.0, 0.0, 0.0], [1e3, -2e3, INF, -INF]]
    )
    y = quantize(x, p)
    for row, col in ((0, 0), (1, 0), (2, 0), (3, 2)):  # the blocks with a non-finite value
        assert y[row, col : col + 2].isnan().all(), (row, col, y)
    finite = torch.stack([y[0, 2:], y[1, 2:], y[2, 2:], y[3, :2]])
    alone = torch.tensor([[1.0, 2.0], [3.0, -1.0], [0.0, 0.0], [1e3, -2e3]])
    assert torch.equal(finite, quantize(alone, p))  # each finite block as if alone
    big = torch.tensor([[1e300, 1.0]], dtype=F64)  # amax / fp8_max beyond float32
    assert quantize(big, p).isnan().all()
    tiny = torch.tensor([[1e-300, 0.0]], dtype=F64)  # a scale below float32: rounds to 0, not NaN
    assert torch.equal(quantize(tiny, p), torch.zeros_like(tiny))


def _non_finite(wire: str) -> list[torch.Tensor]:
    r = dc.get_rank()
    x = torch.tensor([[1.0 + r, 2.0, 4.0, 8.0, 16.0, 32.0]])
    if r == 0:
        x[0, 2:4] = torch.tensor([NAN, 1e3])  # rank 0's second block is not finite
    else:
        x[0, 1] = INF  # rank 1's first block is not finite
    p = Precision(wire, block_size=2)
    return [dc.all_reduce(x, precision=p), dc.all_gather(x, dim=0, precision=p)]


@pytest.mark.parametrize("wire", ["fp8_e4m3", "fp8_e5m2"])
def test_an_infinite_contribution_is_nan_in_its_block_on_every_rank(world2, wire: str) -> None:
    """The sum's blocks with a non-finite contribution are NaN on every rank (rank 0's
    1000 beside its NaN is not clamped to 448); the finite block is exact."""
    for total, gathered in world2.run(_non_finite, wire):
        assert total[0, :4].isnan().all() and torch.equal(total[0, 4:], torch.tensor([32.0, 64.0])), total
        assert gathered[0, 2:4].isnan().all() and gathered[1, :2].isnan().all(), gathered
        assert torch.equal(gathered[:, 4:], torch.tensor([[16.0, 32.0], [16.0, 32.0]])), gathered
        assert torch.equal(gathered[[0, 1], [0, 2]], torch.tensor([1.0, 4.0])), gathered


def _bad(kind: str) -> str:
    x = torch.ones(4, 6)
    z = torch.ones(4, 6, dtype=torch.complex64, requires_grad=True)
    calls = {
        "int": lambda: dc.all_reduce(torch.ones(4, dtype=torch.int64), precision=Precision("bf16")),
        "block": lambda: dc.all_gather(x, precision=Precision("fp8_e4m3", block_size=4)),
        "chunk": lambda: dc.reduce_scatter(x, dim=1, precision=Precision("fp8_e4m3")),
        "op": lambda: dc.all_reduce(x, op="max", precision=Precision("bf16")),
        "type": lambda: dc.all_to_all(x, precision="bf16"),
        "coalesced_int": lambda: dc.all_reduce_coalesced(
            [x, torch.ones(2, dtype=torch.int64)], precision=Precision("bf16")
        ),
        # a coalesced list whose tensors[1] only its own op's checks refuse: each was once
        # checked in its turn, after tensors[0] had moved (comms=1 or 2 at the error)
        "coalesced_chunk": lambda: dc.reduce_scatter_coalesced(  # 12 splits into 6 + 6: no 4-blocks
            [torch.ones(4, 8), torch.ones(4, 12)], dim=1, precision=Precision("fp8_e4m3", block_size=4)
        ),
        "coalesced_rows": lambda: dc.reduce_scatter_coalesced(
            [x, torch.ones(3, 6)], precision=Precision("bf16")
        ),
        "coalesced_dim": lambda: dc.all_gather_coalesced(
            [x, torch.ones(6)], dim=1, precision=Precision("bf16")
        ),
        "coalesced_sizes": lambda: dc.all_gather_coalesced(
            [x, torch.ones(3, 6)], split_sizes=[[4, 4], [2, 2]], precision=Precision("bf16")
        ),
        "coalesced_op": lambda: dc.all_reduce_coalesced(
            [x, torch.ones(2, dtype=torch.int64)], op="avg", precision=Precision(None)
        ),
        "back_block": lambda: dc.all_gather(
            x, precision=Precision("bf16", backward=Precision("fp8_e5m2", block_size=4))
        ),
        # an exact forward, a bf16 backward: the complex gradient would lose its imaginary part
        "complex_back": lambda: dc.all_reduce(z, precision=Precision(None, backward=Precision("bf16"))),
        "complex_back_mapping": lambda: dc.parallel.copy_to_region(
            z, precision=Precision(None, backward=Precision("fp8_e4m3"))
        ),
        # an fp8 payload summed: torch's "Promotion for Float8 Types is not supported"
        # (a RuntimeError) before, where the plain op names it with a TypeError
        "fp8_sum": lambda: dc.all_reduce(x.to(torch.float8_e4m3fn), precision=Precision("bf16")),
        "fp8_sum_scatter": lambda: dc.reduce_scatter(
            x.to(torch.float8_e5m2), precision=Precision("fp8_e4m3")
        ),
        "fp8_sum_mapping": lambda: dc.parallel.reduce_from_region(
            x.to(torch.float8_e4m3fn), precision=Precision("bf16")
        ),
        "fp8_sum_coalesced": lambda: dc.all_reduce_coalesced(
            [x, x.to(torch.float8_e4m3fn)], precision=Precision("bf16")
        ),
    }
    with B.log_comms() as log:
        try:
            calls[kind]()
        except (TypeError, ValueError) as err:
            return f"{type(err).__name__}: {err} | comms={log.count()}"
    return "no error"


@pytest.mark.parametrize(
    "kind,error,names",
    [
        ("int", "TypeError", "floating-point x"),
        ("block", "ValueError", "block_size=4"),
        ("chunk", "ValueError", "block_size=None"),
        ("op", "ValueError", "op='max'"),
        ("type", "TypeError", "precision must be"),
        ("back_block", "ValueError", "block_size=4"),
        ("complex_back", "TypeError", "backward=bf16) sends the gradient in a real float dtype"),
        ("complex_back_mapping", "TypeError", "parallel.copy_to_region(): precision=Precision(wire=exact"),
        (
            "coalesced_int",
            "TypeError",
            "floating-point tensors[1] (a float wire dtype cannot carry torch.int64",
        ),
        ("coalesced_chunk", "ValueError", "chunk [6, 6] the op splits the last dim of tensors[1] into"),
        (
            "coalesced_rows",
            "ValueError",
            "reduce_scatter_coalesced(): `tensors[1]` must be of a size along dim 0",
        ),
        ("coalesced_dim", "ValueError", "all_gather_coalesced(): `dim` must be a dimension in [-1, 1)"),
        ("coalesced_sizes", "ValueError", "`split_sizes[1]` must be to list tensors[1].shape[0]=3"),
        ("coalesced_op", "ValueError", "(for tensors[1], dtype torch.int64)"),
        ("fp8_sum", "TypeError", "all_reduce(): a float8_e4m3fn x cannot be reduced"),
        ("fp8_sum_scatter", "TypeError", "reduce_scatter(): a float8_e5m2 x cannot be reduced"),
        ("fp8_sum_mapping", "TypeError", "parallel.reduce_from_region(): a float8_e4m3fn x cannot"),
        ("fp8_sum_coalesced", "TypeError", "a float8_e4m3fn tensors[1] cannot be reduced"),
    ],
)
def test_bad_input_before_any_communication(world2, kind: str, error: str, names: str) -> None:
    for msg in world2.run(_bad, kind):
        assert msg.startswith(error) and names in msg and msg.endswith("comms=0"), msg


def _one_rank_cannot_encode(block: int | None) -> str:
    """Rank 1's last dim (6), which ``all_to_all`` splits, is no whole number of fp8 blocks
    of 4; rank 0's (8) is. One scale per row (``None``): rank 1 splits its row, rank 0
    sends its whole row to rank 1 and receives a single piece."""
    r = dc.get_rank()
    if block is None:
        ins = [0, 8] if r == 0 else [3, 3]
    else:
        ins = [4, 4] if r == 0 else [4, 2]
    x = torch.randn(2, sum(ins), dtype=torch.float64, requires_grad=True)
    p = Precision("fp8_e4m3", block_size=block)
    try:
        dc.all_to_all(x, split_dim=1, concat_dim=1, input_split_sizes=ins, precision=p)
    except ValueError as err:
        return f"ValueError: {err}"
    except Exception as err:  # a desync (the other rank went on into the exchange)
        return f"{type(err).__name__}: {err}"
    return "no error"


@pytest.mark.parametrize("block", [4, None])
def test_a_refusal_that_differs_between_ranks_is_every_ranks(world2, block: int | None) -> None:
    """What fp8 blocks encode along a last dim that ``all_to_all`` splits differs between
    ranks: rank 1 refused, rank 0 went on into the size exchange and waited for it (a
    DesyncError in-process, a timeout on processes). Now the ranks agree first."""
    mine, other = world2.run(_one_rank_cannot_encode, block)[::-1]
    assert mine.startswith("ValueError: diffcomm.all_to_all(): precision (forward)"), mine
    assert other.startswith("ValueError: diffcomm.all_to_all(): group rank(s) [1] cannot encode"), other


def _one_rank_cannot_gather(split_sizes: bool) -> str:
    """fp8 blocks of 4 along the gathered last dim: rank 0's row (6) is no whole number of
    blocks, rank 1's (8) is."""
    r = dc.get_rank()
    x = torch.randn(2, 6 if r == 0 else 8, dtype=torch.float64, requires_grad=True)
    try:
        dc.all_gather(
            x,
            dim=1,
            split_sizes=[6, 8] if split_sizes else None,
            precision=Precision("fp8_e4m3", block_size=4),
        )
    except ValueError as err:
        return f"ValueError: {err}"
    except Exception as err:  # a desync (the other rank went on into the exchange)
        return f"{type(err).__name__}: {err}"
    return "no error"


@pytest.mark.parametrize("split_sizes", [False, True], ids=["exchanged", "given"])
def test_an_all_gather_refusal_of_one_ranks_row_is_every_ranks(world2, split_sizes: bool) -> None:
    """The same for ``all_gather`` along the last dim: rank 0 refused its own row before
    the size exchange, rank 1 went on into it and waited (a DesyncError in-process, a
    timeout on processes). Now every rank refuses."""
    mine, other = world2.run(_one_rank_cannot_gather, split_sizes)
    assert mine.startswith("ValueError: diffcomm.all_gather(): precision (forward) block_size=4"), mine
    assert other.startswith("ValueError: diffcomm.all_gather(): "), other


def test_precision_options_validated() -> None:
    with pytest.raises(ValueError, match="wire='int8'"):
        Precision("int8")
    with pytest.raises(ValueError, match="block_size=4 applies to fp8"):
        Precision("bf16", block_size=4)
    with pytest.raises(ValueError, match="block_size=0"):
        Precision("fp8_e4m3", block_size=0)
    with pytest.raises(ValueError, match="accumulate"):
        Precision("bf16", accumulate="int32")
    with pytest.raises(TypeError, match="backward"):
        Precision("bf16", backward="fp16")  # type: ignore[arg-type]
    p = Precision("fp8_e5m2", block_size=8, backward=Precision("bf16"))
    assert p.transposed() == Precision("bf16", backward=Precision("fp8_e5m2", block_size=8))
    assert p.transposed().transposed().forward_only() == p.forward_only()
    assert Precision("fp16").accumulate_for(torch.float16) == torch.float32
    assert Precision("fp16").accumulate_for(torch.float64) == torch.float64


def test_an_accumulate_that_would_be_ignored_is_refused() -> None:
    """``Precision(None, accumulate=float64)`` ran the plain op, which sums in the payload's
    dtype: an all_reduce of 1, 2^-24, 2^-24 (float32, 3 ranks) came back 1.0, not the
    1 + 2^-23 a float64 sum gives, silently. Refused at ``Precision(...)``."""
    with pytest.raises(ValueError, match="accumulate=torch.float64 applies to a quantized wire only"):
        Precision(None, accumulate=torch.float64)
    assert Precision("bf16", accumulate=torch.float64).accumulate == torch.float64


def test_a_backwards_own_backward_that_would_be_ignored_is_refused() -> None:
    """A backward's own ``backward`` was ignored: double backward used the forward settings
    (bf16 here, not the fp8 asked for), silently. Refused; the forward's own settings as
    that inner backward (what ``transposed`` makes) say nothing new and are accepted."""
    with pytest.raises(ValueError, match=r"backward=Precision\(fp16, backward=Precision\(e4m3\)\)"):
        Precision("bf16", backward=Precision("fp16", backward=Precision("fp8_e4m3")))
    p = Precision("bf16", backward=Precision("fp16", backward=Precision("bf16")))
    assert p.transposed().transposed() == Precision("bf16", backward=Precision("fp16"))
    assert Precision("fp16", backward=Precision("bf16")).transposed().backward == Precision("fp16")


# --------------------------------------------------------------------------------------
# the mappings, the coalesced forms and MoE dispatch/combine: the core quantized ops
# (bound-tested above) on their communicating side, bit for bit
# --------------------------------------------------------------------------------------


def _settings(p: Precision, backward: bool) -> Precision:
    return backward_settings(p) if backward else Precision(p.wire, p.accumulate, p.block_size)


def _mappings(wire: str, back: str) -> list[str]:
    from diffcomm import parallel as P

    r, w = dc.get_rank(), dc.get_world_size()
    blk = 2 if wire.startswith("fp8") else None
    bblk = 2 if back.startswith("fp8") else None
    p = Precision(wire, block_size=blk, backward=Precision(back, block_size=bblk))
    pf, pb = _settings(p, False), _settings(p, True)
    x0 = data(r, (2 * w, 4), 4)  # varying per rank
    rep = data(99, (2 * w, 4), 4)  # replicated
    bad = []

    def grad(y: torch.Tensor, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return torch.autograd.grad(y, x, g)[0]

    def same(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        if not torch.equal(a, b):
            bad.append(f"{name}: max diff {float((a - b).abs().max())}")

    # forward communicates (quantized with pf); backward local (exact) or quantized (pb)
    x = x0.clone().requires_grad_(True)
    y = P.reduce_from_region(x, precision=p)
    same("reduce_from_region fwd", y, dc.all_reduce(x0, precision=pf))
    g = data(50, tuple(y.shape), 4)  # replicated gradient (the identity backward's premise)
    same("reduce_from_region bwd", grad(y, x, g), g)
    xr = rep.clone().requires_grad_(True)
    y = P.copy_to_region(xr, precision=p)
    same("copy_to_region fwd", y, rep)
    g = data(60 + r, tuple(y.shape), 4)
    same("copy_to_region bwd", grad(y, xr, g), dc.all_reduce(g, precision=pb))
    for dim in (0, -1):
        xr = rep.clone().requires_grad_(True)
        y = P.scatter_to_region(xr, dim=dim, precision=p)
        same(f"scatter_to_region({dim}) fwd", y, rep.chunk(w, dim)[r])
        g = data(70 + r, tuple(y.shape), 4)
        same(f"scatter_to_region({dim}) bwd", grad(y, xr, g), dc.all_gather(g, dim=dim, precision=pb))
        x = x0.clone().requires_grad_(True)
        y = P.gather_from_region(x, dim=dim, precision=p)
        same(f"gather_from_region({dim}) fwd", y, dc.all_gather(x0, dim=dim, precision=pf))
        g = data(80, tuple(y.shape), 4)
        same(f"gather_from_region({dim}) bwd", grad(y, x, g), g.chunk(w, dim)[r])
    x = x0.clone().requires_grad_(True)
    y = P.reduce_scatter_to_sequence(x, precision=p)
    same("reduce_scatter_to_sequence fwd", y, dc.reduce_scatter(x0, precision=pf))
    g = data(90 + r, tuple(y.shape), 4)
    same("reduce_scatter_to_sequence bwd", grad(y, x, g), dc.all_gather(g, precision=pb))
    x = x0.clone().requires_grad_(True)
    y = P.all_gather_from_sequence(x, precision=p)
    same("all_gather_from_sequence fwd", y, dc.all_gather(x0, precision=pf))
    g = data(100 + r, tuple(y.shape), 4)
    same("all_gather_from_sequence bwd", grad(y, x, g), dc.reduce_scatter(g, precision=pb))
    x = rep.clone().requires_grad_(True)  # a copy forward: its input replicated
    y = P.scatter_to_sequence(x, precision=p)
    g = data(110 + r, tuple(y.shape), 4)
    same("scatter_to_sequence bwd", grad(y, x, g), dc.all_gather(g, precision=pb))
    x = x0.clone().requires_grad_(True)
    y = P.gather_from_sequence(x, precision=p)
    same("gather_from_sequence fwd", y, dc.all_gather(x0, precision=pf))
    x = x0.clone().requires_grad_(True)
    y = P.all_to_all_region(x, 0, 1, precision=p)
    same("all_to_all_region fwd", y, dc.all_to_all(x0, 0, 1, precision=pf))
    g = data(120 + r, tuple(y.shape), 4)
    same("all_to_all_region bwd", grad(y, x, g), dc.all_to_all(g, 1, 0, precision=pb))
    return bad


@pytest.mark.parametrize("wire,back", [("bf16", "fp8_e4m3"), ("fp8_e5m2", "fp16"), ("fp16", "bf16")])
def test_mappings_with_precision(world2, wire: str, back: str) -> None:
    for bad in world2.run(_mappings, wire, back):
        assert not bad, bad


def _wrong_mapping_in_debug_mode(kind: str, precision: Precision | None) -> str:
    """A mapping whose premise is broken (a varying input copied into the region; an
    output consumed differently on each rank, so the gradient reaching an identity
    backward is partial), in debug mode."""
    from diffcomm import parallel as P

    r = dc.get_rank()
    x = (torch.arange(4.0) + r).reshape(2, 2).requires_grad_(True)  # varying
    calls = {
        "copy_to_region": lambda: P.copy_to_region(x, precision=precision),
        "scatter_to_region": lambda: P.scatter_to_region(x, dim=0, precision=precision),
        "scatter_to_sequence": lambda: P.scatter_to_sequence(x, precision=precision),
        "reduce_from_region": lambda: P.reduce_from_region(x, precision=precision),
        "gather_from_region": lambda: P.gather_from_region(x, dim=0, precision=precision),
        "gather_from_sequence": lambda: P.gather_from_sequence(x, precision=precision),
    }
    with dc.debug(True):
        try:
            y = calls[kind]()
            (y * (r + 1)).sum().backward()  # each rank consumes it differently
        except dc.CrossRankMismatchError as err:
            return f"CrossRankMismatchError: {err}"
    return f"no error; x.grad={x.grad.flatten().tolist() if x.grad is not None else None}"


@pytest.mark.parametrize(
    "kind,where",
    [
        ("copy_to_region", "parallel.copy_to_region"),
        ("scatter_to_region", "parallel.scatter_to_region"),
        ("scatter_to_sequence", "parallel.scatter_to_sequence"),
        ("reduce_from_region", "parallel.reduce_from_region backward"),
        ("gather_from_region", "parallel.gather_from_region backward"),
        ("gather_from_sequence", "parallel.gather_from_sequence backward"),
    ],
)
@pytest.mark.parametrize("precision", [None, Precision("bf16")], ids=["plain", "bf16"])
def test_debug_mode_checks_a_quantized_mapping_as_the_plain_one(
    world2, kind: str, where: str, precision: Precision | None
) -> None:
    """Debug mode checks each mapping's premise (CONTRACT: a wrong choice of mapping is an
    error, not a silent 2x). With ``precision=`` the checks did not run: a
    reduce_from_region whose output each rank consumed differently (loss weights 1, 2)
    gave x.grad 1 on rank 0 and 2 on rank 1, where the sum-of-objectives gradient is 3,
    silently. Now the quantized mapping checks what the plain one does."""
    for msg in world2.run(_wrong_mapping_in_debug_mode, kind, precision):
        assert msg.startswith("CrossRankMismatchError") and where in msg, msg


def _mismatched_in_debug_mode(kind: str, what: str) -> str:
    """Rank 1 calls the op with another shape (same elements), another Precision, or the
    same forward settings with another backward."""
    from diffcomm import parallel as P

    r = dc.get_rank()
    x = torch.ones(4, 6) if r == 0 or what != "shape" else torch.ones(2, 2, 6)
    p: Precision | None = Precision("bf16")
    if r == 1 and what == "plain":  # rank 1 calls the plain op
        p = None
    elif r == 1 and what != "shape":
        p = Precision("fp16") if what == "precision" else Precision("bf16", backward=Precision("fp16"))
    calls = {
        "all_reduce": lambda: dc.all_reduce(x, precision=p),
        "reduce_scatter": lambda: dc.reduce_scatter(x, precision=p),
        "all_gather": lambda: dc.all_gather(x, precision=p),
        "all_to_all": lambda: dc.all_to_all(x, precision=p),
        "all_reduce_coalesced": lambda: dc.all_reduce_coalesced([x], precision=p),
        "reduce_scatter_coalesced": lambda: dc.reduce_scatter_coalesced([x], precision=p),
        "all_gather_coalesced": lambda: dc.all_gather_coalesced([x], precision=p),
        "parallel.copy_to_region": lambda: P.copy_to_region(x, precision=p),
        "parallel.reduce_from_region": lambda: P.reduce_from_region(x, precision=p),
        "parallel.all_gather_from_sequence": lambda: P.all_gather_from_sequence(x, precision=p),
        "parallel.scatter_to_region": lambda: P.scatter_to_region(x, precision=p),
        "parallel.scatter_to_sequence": lambda: P.scatter_to_sequence(x, precision=p),
        "parallel.all_to_all_region": lambda: P.all_to_all_region(x, 0, 1, precision=p),
    }
    with dc.debug(True):
        try:
            calls[kind]()
        except dc.CrossRankMismatchError as err:
            return f"CrossRankMismatchError: {err}"
        except Exception as err:  # what the op raised instead
            return f"{type(err).__name__}: {err}"
    return "no error"


#: quantized ops and mappings whose arguments debug mode compares across ranks (and three
#: more mappings, for a precision= given on one rank only)
_CHECKED_KINDS = [
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "all_to_all",
    "all_reduce_coalesced",
    "reduce_scatter_coalesced",
    "all_gather_coalesced",
    "parallel.copy_to_region",
    "parallel.reduce_from_region",
    "parallel.all_gather_from_sequence",
]
_MORE_MAPPINGS = ["parallel.scatter_to_region", "parallel.scatter_to_sequence", "parallel.all_to_all_region"]


@pytest.mark.parametrize("kind", _CHECKED_KINDS)
@pytest.mark.parametrize("what", ["shape", "precision", "backward"])
def test_debug_mode_checks_a_quantized_op_across_ranks_as_the_plain_one(world2, kind: str, what: str) -> None:
    """CONTRACT: debug mode turns a cross-rank mismatch into an error naming the ranks. The
    quantized ops skipped the plain ops' check: all_reduce of shapes (4, 6) and (2, 2, 6)
    with precision=bf16 passed silently (the others raised torch's errors naming no rank),
    and a Precision differing between ranks (bf16 / fp16: one rank's bf16 bytes read as
    fp16) was compared nowhere, by the quantized mappings neither. Now both are
    CrossRankMismatchError naming the op."""
    for msg in world2.run(_mismatched_in_debug_mode, kind, what):
        assert msg.startswith(f"CrossRankMismatchError: diffcomm.{kind}"), msg


@pytest.mark.parametrize("kind", _CHECKED_KINDS + _MORE_MAPPINGS)
# on processes: where no check met the quantized one, gloo's transport aborted the rank
@pytest.mark.diffcomm_in_process(False)
def test_debug_mode_names_precision_given_on_one_rank_only(world2, kind: str) -> None:
    """Rank 0 passes ``precision=``, rank 1 calls the plain op: debug mode names the
    precision, and only it. Before, the fields were compared by position ("precision
    differs (rank 0: bf16>bf16, rank 1: (4, 6)); x.shape differs (rank 0: (4, 6), rank 1:
    torch.float32)..."), and copy_to_region / scatter_to_region / scatter_to_sequence met
    no check at all: the transport aborted the rank ("aborted by the backend")."""
    for msg in world2.run(_mismatched_in_debug_mode, kind, "plain"):
        assert msg.startswith(f"CrossRankMismatchError: diffcomm.{kind}(): ranks called it"), msg
        assert msg.endswith(": precision differs (rank 0: bf16>bf16, rank 1: not given)"), msg


def _coalesced(wire: str) -> list[str]:
    r = dc.get_rank()
    w = dc.get_world_size()
    p = Precision(wire, block_size=2 if wire.startswith("fp8") else None, backward=Precision("bf16"))
    xs0 = [data(r, (2 * w, 4), 3), data(10 + r, (w, 6), 3).double()]
    bad = []
    for name, single, kw in (
        ("all_reduce", dc.all_reduce, {}),
        ("all_gather", dc.all_gather, {"dim": 0}),
        ("reduce_scatter", dc.reduce_scatter, {"dim": 0}),
    ):
        xs = [x.clone().requires_grad_(True) for x in xs0]
        ys = getattr(dc, f"{name}_coalesced")(xs, **kw, precision=p)
        gs = [data(40 + i + r, tuple(y.shape), 3).to(y.dtype) for i, y in enumerate(ys)]
        grads = torch.autograd.grad(ys, xs, gs)
        for i, x0 in enumerate(xs0):
            xi = x0.clone().requires_grad_(True)
            yi = single(xi, **kw, precision=p)
            (gi,) = torch.autograd.grad(yi, xi, gs[i])
            if not (torch.equal(ys[i], yi) and torch.equal(grads[i], gi)):
                bad.append(f"{name}[{i}]")
    return bad


@pytest.mark.parametrize("wire", WIRES)
def test_coalesced_equal_single_quantized_ops(world2, wire: str) -> None:
    for bad in world2.run(_coalesced, wire):
        assert not bad, bad


def _moe(wire: str, back: str) -> list[str]:
    from diffcomm import parallel as P

    r = dc.get_rank()
    p = Precision(wire, block_size=4 if wire.startswith("fp8") else None)
    p = Precision(
        p.wire,
        block_size=p.block_size,
        backward=Precision(back, block_size=4 if back.startswith("fp8") else None),
    )
    pf, pb = _settings(p, False), _settings(p, True)
    gen = torch.Generator().manual_seed(r)
    x0 = torch.randn(5 + r, 8, generator=gen)
    gate, idx, _ = P.route(torch.randn(5 + r, 4, generator=gen), k=2)
    bad = []
    # dispatch: rows move whole, so quantized dispatch == plain dispatch of quantize(x)
    x = x0.clone().requires_grad_(True)
    h, plan = P.dispatch(x, idx, num_experts=4, precision=p)
    h_ref, _ = P.dispatch(quantize(x0, pf), idx, num_experts=4, plan=plan)
    if not torch.equal(h, h_ref):
        bad.append("dispatch fwd")
    g = torch.randn(h.shape, generator=gen)
    (gx,) = torch.autograd.grad(h, x, g)
    xr = x0.clone().requires_grad_(True)
    hr, _ = P.dispatch(xr, idx, num_experts=4, plan=plan)
    (gx_ref,) = torch.autograd.grad(hr, xr, quantize(g, pb))  # the gradient rows travel in pb
    if not torch.equal(gx, gx_ref):
        bad.append("dispatch bwd")
    # combine: quantized combine == plain combine of quantize(expert rows)
    e = torch.randn(h.shape, generator=gen).requires_grad_(True)
    y = P.combine(e, gate, plan, precision=p)
    y_ref = P.combine(quantize(e.detach(), pf), gate, plan)
    if not torch.allclose(y, y_ref, rtol=0, atol=0):
        bad.append("combine fwd")
    gy = torch.randn(y.shape, generator=gen)
    (ge,) = torch.autograd.grad(y, e, gy)
    er = e.detach().clone().requires_grad_(True)
    (ge_plain,) = torch.autograd.grad(P.combine(er, gate, plan), er, gy)
    if not torch.equal(ge, quantize(ge_plain, pb)):
        bad.append("combine bwd")
    return bad


@pytest.mark.parametrize("wire,back", [("bf16", "fp8_e4m3"), ("fp8_e4m3", "bf16"), ("fp8_e5m2", "fp16")])
def test_moe_dispatch_combine_with_precision(world2, wire: str, back: str) -> None:
    for bad in world2.run(_moe, wire, back):
        assert not bad, bad


def _moe_async_with_precision() -> dict[str, str]:
    from diffcomm import parallel as P

    x = torch.randn(6, 8)
    gate, idx, _ = P.route(torch.randn(6, 4), k=2)
    h, plan = P.dispatch(x, idx, num_experts=4)
    p = Precision("bf16")
    calls = {
        "dispatch": lambda: P.dispatch(x, idx, num_experts=4, precision=p, async_op=True),
        "combine": lambda: P.combine(h, gate, plan, precision=p, async_op=True),
    }
    return refusals(calls)


def test_moe_async_with_precision_is_refused_naming_the_op_before_communicating(world2) -> None:
    """``dispatch(async_op=True, precision=)`` exchanged the counts and then failed in the
    inner all_to_all, naming ``all_to_all``; ``combine`` named it too. Now both name their
    own op and ``async_op``, with no communication (docs/precision.md: refused before any)."""
    for out in world2.run(_moe_async_with_precision):
        for name in ("dispatch", "combine"):
            assert f"parallel.{name}(): `async_op` must be False with precision=" in out[name], out
            assert out[name].endswith("[0 comms]"), out


# --------------------------------------------------------------------------------------
# examples/precision_tp_training.py: bf16 wire / fp32 accumulation next to fp32
# --------------------------------------------------------------------------------------


def _example_train(steps: int, precision: Precision | None) -> list[float]:
    import sys
    from pathlib import Path

    examples = str(Path(__file__).resolve().parents[2] / "examples")
    if examples not in sys.path:  # (in the rank process)
        sys.path.insert(0, examples)
    from precision_tp_training import train

    return train(steps, precision)


def test_tp_training_example_bf16_wire_tracks_fp32(world2) -> None:
    """The example's TP MLP trains with a bf16 wire: the loss falls as with fp32, the two
    curves stay within 1e-2 relative of each other, and they are not identical (the
    bf16 wire did change the numbers)."""
    exact = world2.run(_example_train, 25, None)[0]
    low = world2.run(_example_train, 25, Precision("bf16"))[0]
    assert exact[-1] < 0.8 * exact[0] and low[-1] < 0.8 * low[0]
    assert max(abs(u - v) / v for u, v in zip(low, exact)) < 1e-2
    assert low != exact


def _example_fp32_vs_serial(steps: int, hidden: int) -> float | str:
    """The example's fp32 run against the serial MLP trained alike (its weights, data and
    SGD steps, one process): the largest loss difference, or the refusal's message."""
    import sys
    from pathlib import Path

    examples = str(Path(__file__).resolve().parents[2] / "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    from precision_tp_training import train

    try:
        losses = train(steps, None, hidden=hidden)
    except ValueError as exc:
        return str(exc)
    d = 32
    gen = torch.Generator().manual_seed(0)  # the example's draws, in its order
    w1 = (torch.randn(d, hidden, generator=gen) / d**0.5).requires_grad_()
    w2 = (torch.randn(hidden, d, generator=gen) / hidden**0.5).requires_grad_()
    teacher = torch.randn(d, d, generator=gen) / d**0.5
    opt = torch.optim.SGD([w1, w2], lr=0.05)
    serial = []
    for _ in range(steps):
        x = torch.randn(64, d, generator=gen)
        loss = torch.nn.functional.mse_loss(torch.nn.functional.gelu(x @ w1) @ w2, torch.tanh(x @ teacher))
        opt.zero_grad()
        loss.backward()
        opt.step()
        serial.append(loss.item())
    return max(abs(u - v) for u, v in zip(losses, serial, strict=True))


@pytest.mark.parametrize("world_size", [2, 3])
def test_tp_training_example_fp32_equals_the_serial_mlp(local_worlds, world_size: int) -> None:
    """The example's fp32 curve is the serial MLP's (float32 rounding). A hidden size the
    ranks do not divide is refused: before, each rank kept ``hidden // world`` units, so at
    ``--world 3`` the model silently lost hidden unit 63 (losses 0.0198 off the serial ones)."""
    world = local_worlds(world_size, in_process=True)
    assert max(world.run(_example_fp32_vs_serial, 4, 48)) < 1e-5
    if world_size == 3:
        for msg in world.run(_example_fp32_vs_serial, 1, 64):
            assert msg == "train(): `hidden` must be divisible by the number of ranks 3, got 64", msg


def _spmd_typed() -> list[str]:
    from diffcomm import parallel as P

    x = torch.randn(4, 4, requires_grad=True)
    p = Precision("bf16")
    out = []
    for name, call in (
        ("all_reduce", lambda v: dc.all_reduce(v, precision=p)),
        ("reduce_from_region", lambda v: P.reduce_from_region(v, precision=p)),
    ):
        try:
            with dc.spmd_check():
                call(dc.spmd.replicated(x))  # a replicated value summed over ranks: 2x
            out.append(f"{name}: no error")
        except dc.SPMDTypeError:
            out.append(f"{name}: SPMDTypeError")
    return out


def test_spmd_check_types_the_quantized_ops(world2) -> None:
    """``dc.spmd_check`` types a quantized op by the plain op's rule (all_reduce of a
    replicated value is refused with or without ``precision=``)."""
    for row in world2.run(_spmd_typed):
        assert row == ["all_reduce: SPMDTypeError", "reduce_from_region: SPMDTypeError"], row


def _spmd_outcomes_of_every_mapping() -> dict[str, tuple[str, str]]:
    """Each mapping under ``dc.spmd_check`` on a replicated and on a varying input (its
    backward run too): the outcome without and with ``precision=``."""
    from diffcomm import parallel as P

    calls = {
        "copy_to_region": lambda v, p: P.copy_to_region(v, precision=p),
        "reduce_from_region": lambda v, p: P.reduce_from_region(v, precision=p),
        "scatter_to_region": lambda v, p: P.scatter_to_region(v, precision=p),
        "gather_from_region": lambda v, p: P.gather_from_region(v, precision=p),
        "scatter_to_sequence": lambda v, p: P.scatter_to_sequence(v, 0, precision=p),
        "gather_from_sequence": lambda v, p: P.gather_from_sequence(v, 0, precision=p),
        "reduce_scatter_to_sequence": lambda v, p: P.reduce_scatter_to_sequence(v, 0, precision=p),
        "all_gather_from_sequence": lambda v, p: P.all_gather_from_sequence(v, 0, precision=p),
        "all_to_all_region": lambda v, p: P.all_to_all_region(v, 0, 1, precision=p),
    }
    out = {}
    for name, call in calls.items():
        for kind in ("replicated", "varying"):
            seen = []
            for p in (None, Precision("bf16")):
                # the same values on every rank (the types differ, not the data: debug
                # mode's replicated checks pass either way)
                x = torch.randn(4, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)
                try:
                    with dc.spmd_check():
                        y = call(getattr(dc.spmd, kind)(x), p)
                        y.float().square().sum().backward()
                    seen.append("ok")
                except dc.SPMDTypeError:
                    seen.append("SPMDTypeError")
            out[f"{name} {kind}"] = tuple(seen)
    return out


def test_spmd_check_types_every_quantized_mapping_as_the_plain_one(world2) -> None:
    """Every mapping is typed the same with ``precision=`` as without, on a replicated and a
    varying input. ``all_to_all_region(precision=)`` ran the core quantized all_to_all,
    typed by the core op's rule: a replicated input, refused without ``precision=``,
    passed with it."""
    for out in world2.run(_spmd_outcomes_of_every_mapping):
        differ = {k: v for k, v in out.items() if v[0] != v[1]}
        assert not differ, differ
        assert out["all_to_all_region replicated"] == ("SPMDTypeError", "SPMDTypeError")


@pytest.mark.usefixtures("debug_off")
def test_benchmark_reports_2x_and_about_4x_fewer_bytes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``benchmarks/bench_precision.py`` (a fresh 2-rank world, run in this process): bf16/fp16
    send 2x fewer bytes than fp32 in every op, fp8 with float32 scales ``4 / (1 + 4 / block)``x."""
    from _shared import benchmark_json_here

    args = ("--rows", "8", "--cols", "256", "--calls", "2")
    out = benchmark_json_here("bench_precision.py", *args, monkeypatch=monkeypatch, capsys=capsys)
    by = {r["format"]: r for r in out["results"]}
    want = {"bf16": 2.0, "fp16": 2.0, "e4m3 row": 4 / (1 + 4 / 256), "e4m3/128": 4 / (1 + 4 / 128)}
    want |= {"e4m3/32": 4 / (1 + 4 / 32), "e5m2/128": 4 / (1 + 4 / 128)}
    for fmt, ratio in want.items():
        for op in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all"):
            assert by[fmt][f"{op}_ratio"] == pytest.approx(ratio), (fmt, op)
        assert by[fmt]["quant_dequant_s"] > 0


def _empty_and_0dim() -> list[str]:
    bad = []
    for wire in WIRES:
        p = Precision(wire)
        for name, fn, shape in (
            ("all_reduce 0-dim", lambda v, p=p: dc.all_reduce(v, precision=p), ()),
            ("all_reduce (0, 3)", lambda v, p=p: dc.all_reduce(v, precision=p), (0, 3)),
            ("all_reduce (2, 0)", lambda v, p=p: dc.all_reduce(v, precision=p), (2, 0)),
            ("all_gather (0, 3)", lambda v, p=p: dc.all_gather(v, precision=p), (0, 3)),
            ("reduce_scatter (0, 3)", lambda v, p=p: dc.reduce_scatter(v, precision=p), (0, 3)),
            ("all_to_all (0, 3)", lambda v, p=p: dc.all_to_all(v, precision=p), (0, 3)),
        ):
            x = torch.full(shape, 1.5).requires_grad_(True)
            y = fn(x)
            (gx,) = torch.autograd.grad(y, x, torch.ones_like(y))
            want = 1.5 * dc.get_world_size() if name.startswith("all_reduce") else None
            if gx.shape != x.shape or (want is not None and y.numel() and not torch.all(y == want)):
                bad.append(f"{wire} {name}: {tuple(y.shape)} {tuple(gx.shape)}")
    # vmap of a dim-taking op: one collective per batch, equal to the ops one by one
    p = Precision("fp8_e5m2", block_size=2)
    xb = data(dc.get_rank(), (3, 2, 4), 2)
    yb = torch.func.vmap(lambda v: dc.all_gather(v, dim=1, precision=p))(xb)
    if not torch.equal(yb, torch.stack([dc.all_gather(v, dim=1, precision=p) for v in xb])):
        bad.append("vmap all_gather")
    return bad


def test_empty_0dim_and_vmap(world2) -> None:
    for bad in world2.run(_empty_and_0dim):
        assert not bad, bad


def _vmap_keeps_each_example_its_own_fp8_scale() -> list[str]:
    """vmap of a quantized op equals the op on each example alone, also where the batch dim
    would otherwise be the last dim (the one fp8 blocks run along): each example keeps its
    own scales, and an example 1e-6 times another's size is not flushed to zero."""
    r = dc.get_rank()
    mag = torch.tensor([1.0, 1e-3, 1e3, -7.0, 1e-6])  # one magnitude per example
    bad = []
    for p in (Precision("fp8_e4m3"), Precision("fp8_e4m3", block_size=2), Precision("fp8_e5m2")):
        # 0-dim examples: the batch was one row, one fp8 scale for all (0.006 came back as 0)
        x = mag * (r + 1)
        for name, fn in (
            ("all_reduce", lambda v, p=p: dc.all_reduce(v, precision=p)),
            ("reduce_from_region", lambda v, p=p: dc.parallel.reduce_from_region(v, precision=p)),
        ):
            if not torch.equal(torch.func.vmap(fn)(x), torch.stack([fn(v) for v in x])):
                bad.append(f"{p.tag} vmap {name} of 0-dim examples")
        xg = mag.clone().requires_grad_(True)  # (replicated) copy_to_region: its backward all_reduces
        y = torch.func.vmap(lambda v, p=p: dc.parallel.copy_to_region(v, precision=p))(xg)
        (g,) = torch.autograd.grad(y, xg, mag)
        want = torch.stack([dc.all_reduce(m, precision=p) for m in mag])
        if not torch.equal(g, want):
            bad.append(f"{p.tag} vmap copy_to_region backward of 0-dim examples: {g.tolist()}")
        # the batch dim last: copy_to_region (elementwise as a plain mapping) kept it there,
        # and its backward all_reduced one fp8 row across the examples (gradient 0, not 3 * g)
        xs = torch.ones(4, 5, requires_grad=True)
        gs = torch.arange(1.0, 21.0).reshape(4, 5) * mag
        y = torch.func.vmap(lambda v, p=p: dc.parallel.copy_to_region(v, precision=p), 1, 1)(xs)
        (g,) = torch.autograd.grad(y, xs, gs)
        want = torch.stack([dc.all_reduce(gs[:, i], precision=p) for i in range(5)], 1)
        if not torch.equal(g, want):
            bad.append(f"{p.tag} vmap copy_to_region backward, batch dim last")
    return bad


def _under_autocast() -> list[str]:
    """Each quantized op under CPU ``torch.autocast`` equals the op outside it (values and
    gradients): autocast is for the user's math, not the wire payload."""
    r = dc.get_rank()
    x0 = data(r, (6, 6), 3)
    ops = {
        "all_gather uneven": lambda v, p: dc.all_gather(v[: r + 1], 0, precision=p),
        "all_to_all 0 -> 1": lambda v, p: dc.all_to_all(v, 0, 1, precision=p),
        "all_to_all_region": lambda v, p: dc.parallel.all_to_all_region(v, 0, 1, precision=p),
        "all_reduce": lambda v, p: dc.all_reduce(v[:1, :1].reshape(()), precision=p),
        "reduce_scatter": lambda v, p: dc.reduce_scatter(v, 1, split_sizes=[2, 4, 0], precision=p),
    }
    bad = []
    for p in (Precision("fp8_e4m3", block_size=2, backward=Precision("fp16")), Precision("fp16")):
        for dtype in (torch.float32, torch.float16):
            for name, fn in ops.items():
                got = []
                for on in (False, True):
                    x = x0.to(dtype).requires_grad_(True)
                    try:
                        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=on):
                            y = fn(x, p)
                            (g,) = torch.autograd.grad(y, x, torch.ones_like(y))
                    except RuntimeError as err:
                        bad.append(f"{p.key} {dtype} {name}: {err}")
                        return bad  # (a rank that raised before its exchange: the others would wait)
                    got.append((y, g))
                (y0, g0), (y1, g1) = got
                if not (torch.equal(y0, y1) and torch.equal(g0, g1) and y0.dtype == y1.dtype):
                    bad.append(f"{p.key} {dtype} {name}: not equal")
    return bad


def test_a_quantized_op_under_autocast_equals_outside(world3) -> None:
    """Before: under CPU ``torch.autocast`` an fp8 (or float16) wire payload reached torch's
    ``cat`` (an uneven all_gather's padding, an all_to_all across dims, a float16 all_reduce's
    padding), which autocast refuses: RuntimeError "Unexpected floating ScalarType in
    at::autocast::prioritize"."""
    for bad in world3.run(_under_autocast):
        assert not bad, bad


def test_vmap_keeps_each_example_its_own_fp8_scale(world3) -> None:
    """Before: vmap of a quantized ``all_reduce`` / ``reduce_from_region`` over 0-dim
    examples (and ``copy_to_region``'s gradient) shared one fp8 scale across the batch,
    and ``copy_to_region`` batched along its last dim did too: ranks' 1e-3 (sum 0.006)
    came back as 0.0, -42 as -43.53; the examples one by one were exact."""
    for bad in world3.run(_vmap_keeps_each_example_its_own_fp8_scale):
        assert not bad, bad


def _fp8_row_scales_empty_and_uneven() -> list[str]:
    bad = []
    r = dc.get_rank()
    for wire in ("fp8_e4m3", "fp8_e5m2"):
        p = Precision(wire)  # block_size=None: one scale per row
        # an empty last dim: values and gradients empty, shaped as without precision=
        for name, fn in (
            ("all_reduce", lambda v, p: dc.all_reduce(v, precision=p)),
            ("reduce_scatter", lambda v, p: dc.reduce_scatter(v, dim=-1, precision=p)),
            ("all_gather", lambda v, p: dc.all_gather(v, dim=-1, precision=p)),
            ("all_to_all", lambda v, p: dc.all_to_all(v, -1, -1, precision=p)),
        ):
            for shape in ((0,), (2, 0)):
                try:
                    x = torch.zeros(shape, requires_grad=True)
                    y, y_exact = fn(x, p), fn(x, None)
                    (gx,) = torch.autograd.grad(y, x, torch.ones_like(y))
                    (gx_exact,) = torch.autograd.grad(y_exact, x, torch.ones_like(y_exact))
                    if y.shape != y_exact.shape or gx.shape != gx_exact.shape or y.numel() or gx.numel():
                        bad.append(f"{wire} {name} {shape}: {tuple(y.shape)} {tuple(gx.shape)}")
                except Exception as err:
                    bad.append(f"{wire} {name} {shape}: {type(err).__name__}: {err}")
        # one rank's row empty (or of another length): each nonzero piece is one sender's
        # whole row, with its one scale
        x = data(r, (2, 3 * r), 3)
        try:
            y = dc.all_gather(x, dim=-1, precision=p)
            want = torch.cat([quantize(data(j, (2, 3 * j), 3), p) for j in range(dc.get_world_size())], -1)
            if not torch.equal(y, want):
                bad.append(f"{wire} all_gather of a row empty on rank 0")
        except Exception as err:
            bad.append(f"{wire} all_gather of a row empty on rank 0: {type(err).__name__}: {err}")
        x = data(r, (2, 2 + 2 * r), 3)  # rank 0 sends its row of 2 to rank 1, rank 1 its row of 4 to rank 0
        try:
            want = quantize(data(1 - r, (2, 4 - 2 * r), 3), p)
            y = dc.all_to_all(x, -1, -1, input_split_sizes=[0, 2] if r == 0 else [4, 0], precision=p)
            if not torch.equal(y, want):
                bad.append(f"{wire} all_to_all of rows of different lengths")
        except Exception as err:
            bad.append(f"{wire} all_to_all of rows of different lengths: {type(err).__name__}: {err}")
        # rows of different lengths *joined* along the last dim: each piece decoded with
        # its own sender's scale (decoded as equal blocks before: 73.76 came back as 60.14)
        bad += _joined_rows_of_different_lengths(dc.Precision(wire, backward=dc.Precision("bf16")))
    return bad


def _joined_rows_of_different_lengths(p: dc.Precision) -> list[str]:
    """Rank j's rows have 2 + 2j values (one scale each); all_gather and all_to_all (split
    dim 0, concat the last) join them along the last dim (an fp8 backward would split
    that dim unevenly: refused, so the backward is bf16 here)."""
    r, world = dc.get_rank(), dc.get_world_size()
    rows = [data(j, (2 * world, 2 + 2 * j), 3) for j in range(world)]
    joined = {
        "all_gather": (
            lambda: dc.all_gather(rows[r], dim=-1, precision=p),
            torch.cat([quantize(x, p) for x in rows], -1),
        ),
        "all_to_all 0 -> -1": (
            lambda: dc.all_to_all(
                rows[r], 0, -1, output_split_sizes=[2 + 2 * j for j in range(world)], precision=p
            ),
            torch.cat([quantize(x, p).chunk(world, 0)[r] for x in rows], -1),
        ),
    }
    bad = []
    for name, (call, want) in joined.items():
        try:
            if not torch.equal(call(), want):
                bad.append(f"{p.wire} {name} of rows of different lengths, joined")
        except Exception as err:
            bad.append(f"{p.wire} {name} of rows of different lengths, joined: {type(err).__name__}: {err}")
    return bad


def test_fp8_row_scales_of_an_empty_or_uneven_last_dim(world2) -> None:
    """fp8 with ``block_size=None`` (one scale per row) on a last dim that is empty, or
    whose pieces differ between the ranks: an empty tensor works like any other shape
    (values and gradients empty, as without ``precision=``), and each received piece
    carries its sender's one scale (before: ZeroDivisionError for the empty last dim, and
    a mismatched scale exchange for rows of different lengths)."""
    for bad in world2.run(_fp8_row_scales_empty_and_uneven):
        assert not bad, bad


def _precision_ops_outside_debug_mode() -> float:
    p = Precision("bf16")
    x = torch.ones(4, 8)
    ys = [dc.all_reduce(x, precision=p), dc.reduce_scatter(x, 0, precision=p)]
    ys += dc.all_reduce_coalesced([x, x], precision=p)
    ys += dc.reduce_scatter_coalesced([x, x], 0, precision=p)
    ys += dc.all_gather_coalesced([x, x], 0, precision=p)
    return float(sum(y.sum() for y in ys))


@pytest.mark.usefixtures("debug_off")
def test_precision_key_is_built_in_debug_mode_only(local_worlds, monkeypatch) -> None:
    """``Precision.key`` (what debug mode compares across ranks, ~1 us to build) is not
    built outside debug mode: the quantized ops' debug checks built it as an argument on
    every call, debug mode off as well."""

    def read(self: Precision) -> str:
        raise AssertionError("Precision.key built outside debug mode")

    monkeypatch.setattr(Precision, "key", property(read))
    assert local_worlds(2, in_process=True).run(_precision_ops_outside_debug_mode) == [416.0, 416.0]
