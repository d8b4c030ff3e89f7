"""The raw backend ops on real gloo ranks (world sizes 1-4), the logger and the switches.

Every rank function builds its input from its rank (:func:`_data`), runs one raw op
through :func:`_checked` (which asserts that the input is untouched and the output
shares no memory with it) and returns the result; the expected values are computed
here, in the caller, from the same inputs.
"""

from __future__ import annotations

import ast
import io
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import diffcomm as dc
from diffcomm import CrossRankMismatchError, LocalWorld
from diffcomm.backend import OP_NAMES, comm_off, get_backend, is_off, log_comms
from diffcomm.backend.args import normalize_op, resolve_group

# The backend adapter's raw ops need no real transport: this module's shared worlds are in-process
# (the same values as gloo processes: tests/runtime/test_in_process.py). A test that needs a process
# per rank says why and stays on processes.
pytestmark = pytest.mark.diffcomm_in_process


REDUCE_OPS = ("sum", "avg", "max", "min", "product")
DTYPES = (
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float16,
    torch.int32,
    torch.int64,
    torch.complex64,
    torch.complex128,
)

# ------------------------------------------------------------------- shared helpers


def _data(rank: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Small exact values that differ per rank (so sums/products stay exact-ish)."""
    n = 1
    for s in shape:
        n *= s
    base = (torch.arange(n, dtype=torch.float64) % 5 + 1 + rank).reshape(shape)
    if dtype.is_complex:
        imag = (base * 2 - rank) % 3 - 1
        return torch.complex(base, imag).to(dtype)
    return base.to(dtype)


def _checked(op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Run ``op(x)`` on a rank; assert ``x`` is unchanged and the output does not alias it."""
    before = x.clone()
    out = op(x)
    assert torch.equal(x, before), "the raw op modified its input"
    if out.numel() and x.numel():
        assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr(), "output aliases input"
    return out


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    low = expected.dtype in (torch.bfloat16, torch.float16)
    torch.testing.assert_close(
        actual, expected, rtol=1e-2 if low else None, atol=1e-2 if low else None, equal_nan=False
    )


def _reference(op: str, xs: list[torch.Tensor]) -> torch.Tensor:
    """Reduce the ranks' tensors in high precision, cast back."""
    wide = torch.complex128 if xs[0].is_complex() else torch.float64
    stack = torch.stack([x.to(wide) for x in xs])
    out = {
        "sum": lambda: stack.sum(0),
        "avg": lambda: stack.mean(0),
        "max": lambda: stack.amax(0),
        "min": lambda: stack.amin(0),
        "product": lambda: stack.prod(0),
    }[op]()
    return out.to(xs[0].dtype)


def _error(fn: Callable[[], Any]) -> tuple[str, str] | None:
    """``(type name, message)`` of what ``fn()`` raises on a rank, None if it returns."""
    try:
        fn()
    except Exception as exc:  # reported to the caller, who checks the type
        return type(exc).__name__, str(exc)
    return None


@pytest.fixture(params=[1, 2, 3, 4], ids=lambda n: f"world{n}")
def world(request: pytest.FixtureRequest, local_worlds: Callable[..., LocalWorld]) -> LocalWorld:
    return local_worlds(request.param)


@pytest.fixture(params=[2, 3, 4], ids=lambda n: f"world{n}")
def multi_world(request: pytest.FixtureRequest, local_worlds: Callable[..., LocalWorld]) -> LocalWorld:
    return local_worlds(request.param)


# ------------------------------------------------------- helpers of the rank bodies


# a rank's output and the raw ops it ran, by name
Counted = tuple[torch.Tensor, dict[str, int]]


def _without(capability: str | None, fn: Callable[[], torch.Tensor]) -> Counted:
    """``fn()`` with ``capability`` switched off in the backend adapter (``None``: as
    probed), and the raw ops it ran."""
    be = get_backend()
    old = be.overrides
    be.overrides = {capability: False} if capability else {}
    try:
        with log_comms() as log:
            out = fn()
    finally:
        be.overrides = old
    return out, {op_name: int(row["count"]) for op_name, row in log.by_op().items()}


def _a2a_rows(src: int, dst: int, count: int) -> torch.Tensor:
    """The rows rank ``src`` sends to rank ``dst``: each row says where it came from."""
    k = torch.arange(count, dtype=torch.float64)
    return (100.0 * src + 10.0 * dst + k).reshape(count, 1).expand(count, 2).clone()


def _a2a_matrix(world: int) -> list[list[int]]:
    """``m[src][dst]`` rows go from ``src`` to ``dst`` (uneven, some zero)."""
    return [[(src + 2 * dst) % 3 for dst in range(world)] for src in range(world)]


# ------------------------------------------------------------------- the raw ops


def _valid(op: str, dtype: torch.dtype) -> bool:
    if op in ("max", "min") and dtype.is_complex:
        return False  # no order on C
    return not (op == "avg" and not (dtype.is_floating_point or dtype.is_complex))


# max/min of complex and avg of integers are rejected by diffcomm.backend.args before the backend
@pytest.mark.parametrize(
    ("op", "dtype"), [(op, dt) for op in REDUCE_OPS for dt in DTYPES if _valid(op, dt)], ids=str
)
def test_all_reduce(world: LocalWorld, op: str, dtype: torch.dtype) -> None:
    def rank_all_reduce(op: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        x = _data(dc.get_rank(), shape, dtype)
        return _checked(lambda t: get_backend().all_reduce(t, op, None), x)

    shape = (2, 3)
    out = world.run(rank_all_reduce, op, dtype, shape)
    expected = _reference(op, [_data(r, shape, dtype) for r in range(world.world_size)])
    for r, o in enumerate(out):
        assert o.dtype == dtype and o.shape == shape, f"rank {r}"
        _close(o, expected)


def test_all_reduce_of_noncontiguous_input(world: LocalWorld) -> None:
    def rank_all_reduce_noncontiguous() -> tuple[torch.Tensor, bool]:
        x = _data(dc.get_rank(), (3, 4)).t()
        out = _checked(lambda t: get_backend().all_reduce(t, "sum", None), x)
        return out, out.is_contiguous()

    expected = sum(_data(r, (3, 4)).t() for r in range(world.world_size))
    for out, contiguous in world.run(rank_all_reduce_noncontiguous):
        assert contiguous
        torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.complex64], ids=str)
def test_broadcast(world: LocalWorld, dtype: torch.dtype) -> None:
    def rank_broadcast(src: int, dtype: torch.dtype) -> torch.Tensor:
        x = _data(dc.get_rank(), (2, 3), dtype)
        return _checked(lambda t: get_backend().broadcast(t, src, None), x)

    for src in range(world.world_size):
        for o in world.run(rank_broadcast, src, dtype):
            assert torch.equal(o, _data(src, (2, 3), dtype))


@pytest.mark.parametrize("op", REDUCE_OPS)
def test_reduce_gives_result_on_dst_and_exact_zeros_elsewhere(world: LocalWorld, op: str) -> None:
    def rank_reduce(dst: int, op: str) -> torch.Tensor:
        x = _data(dc.get_rank(), (2, 3))
        return _checked(lambda t: get_backend().reduce(t, dst, op, None), x)

    n = world.world_size
    expected = _reference(op, [_data(r, (2, 3)) for r in range(n)])
    for dst in range(n):
        out = world.run(rank_reduce, dst, op)
        for r, o in enumerate(out):
            if r == dst:
                _close(o, expected)
            else:
                assert torch.equal(o, torch.zeros(2, 3)) and not torch.signbit(o).any()


def _layout(layout: str, n: int) -> tuple[list[int] | None, list[int]]:
    """The sizes argument of a ``layout`` over ``n`` ranks (None when even: the op's
    default) and the rows of each rank's chunk."""
    if layout == "even":
        return None, [2] * n
    uneven = [(2 * r + 1) % 3 for r in range(n)]  # [1, 0, 2, 1]: one rank has no rows
    return uneven, uneven


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex128], ids=str)
@pytest.mark.parametrize("layout", ["even", "uneven", "uneven-exchanged"])
def test_all_gather(world: LocalWorld, layout: str, dtype: torch.dtype) -> None:
    def rank_all_gather(sizes: list[int] | None, dtype: torch.dtype, exchange: bool) -> torch.Tensor:
        rank = dc.get_rank()
        rows = sizes[rank] if sizes is not None else 2
        x = _data(rank, (rows, 3), dtype)
        if exchange:
            sizes = get_backend().exchange_sizes(rows, None)
        return _checked(lambda t: get_backend().all_gather(t, None, sizes), x)

    n = world.world_size
    sizes, rows = _layout(layout, n)
    out = world.run(rank_all_gather, sizes, dtype, layout == "uneven-exchanged")
    expected = torch.cat([_data(r, (rows[r], 3), dtype) for r in range(n)])
    for o in out:
        assert torch.equal(o, expected)


@pytest.mark.parametrize("fallback", [False, True], ids=["native", "fallback"])
@pytest.mark.parametrize("layout", ["even", "uneven"])
@pytest.mark.parametrize("op", REDUCE_OPS)
# on processes: it switches capabilities off on the process's one backend adapter
@pytest.mark.diffcomm_in_process(False)
def test_reduce_scatter(world: LocalWorld, op: str, layout: str, fallback: bool) -> None:
    def rank_reduce_scatter(op: str, split_sizes: list[int] | None, fallback: bool) -> Counted:
        be = get_backend()
        n = dc.get_world_size()
        total = sum(split_sizes) if split_sizes is not None else 2 * n
        x = _data(dc.get_rank(), (total, 3))
        cap = "reduce_scatter" if fallback else None
        return _without(cap, lambda: _checked(lambda t: be.reduce_scatter(t, op, None, split_sizes), x))

    n = world.world_size
    split, sizes = _layout(layout, n)
    full = _reference(op, [_data(r, (sum(sizes), 3)) for r in range(n)])
    expected = full.split(sizes)
    out = world.run(rank_reduce_scatter, op, split, fallback)
    for r, (o, counts) in enumerate(out):
        _close(o, expected[r])
        # the gap filler (all_reduce, keep own chunk) runs when the capability is off and
        # for ops reduce_scatter cannot do natively; otherwise one reduce_scatter
        native = not fallback and op in ("sum", "avg")
        assert counts == ({"reduce_scatter": 1} if native else {"all_reduce": 1}), f"rank {r}"


@pytest.mark.parametrize("fallback", [False, True], ids=["native", "no-gather-scatter"])
@pytest.mark.parametrize("layout", ["even", "uneven"])
# on processes: it switches capabilities off on the process's one backend adapter
@pytest.mark.diffcomm_in_process(False)
def test_gather(world: LocalWorld, layout: str, fallback: bool) -> None:
    n = world.world_size
    sizes, rows = _layout(layout, n)
    expected = torch.cat([_data(r, (rows[r], 3)) for r in range(n)])

    def rank_gather(dst: int, sizes: list[int] | None, fallback: bool = False) -> Counted:
        rank = dc.get_rank()
        mine = sizes[rank] if sizes is not None else 2
        x = _data(rank, (mine, 3))
        cap = "gather_scatter" if fallback else None
        return _without(cap, lambda: _checked(lambda t: get_backend().gather(t, dst, None, sizes), x))

    for dst in range(n):
        for r, (o, counts) in enumerate(world.run(rank_gather, dst, sizes, fallback)):
            assert o.shape == expected.shape, "gather has the same shape on every rank"
            assert torch.equal(o, expected if r == dst else torch.zeros_like(expected))
            assert counts == ({"all_gather": 1} if fallback else {"gather": 1}), f"rank {r}"


@pytest.mark.parametrize("fallback", [False, True], ids=["native", "no-gather-scatter"])
@pytest.mark.parametrize("layout", ["even", "uneven"])
# on processes: it switches capabilities off on the process's one backend adapter
@pytest.mark.diffcomm_in_process(False)
def test_scatter(world: LocalWorld, layout: str, fallback: bool) -> None:
    def rank_scatter(src: int, split_sizes: list[int] | None, fallback: bool = False) -> Counted:
        n = dc.get_world_size()
        total = sum(split_sizes) if split_sizes is not None else 2 * n
        x = _data(dc.get_rank(), (total, 3))  # only src's values matter
        cap = "gather_scatter" if fallback else None
        return _without(cap, lambda: _checked(lambda t: get_backend().scatter(t, src, None, split_sizes), x))

    n = world.world_size
    split, sizes = _layout(layout, n)
    for src in range(n):
        chunks = _data(src, (sum(sizes), 3)).split(sizes)
        for r, (o, counts) in enumerate(world.run(rank_scatter, src, split, fallback)):
            assert torch.equal(o, chunks[r])
            assert counts == ({"broadcast": 1} if fallback else {"scatter": 1}), f"rank {r}"


def _a2a_mixed(world: int) -> list[list[int]]:
    """As :func:`_a2a_matrix`, but rank 0 sends and receives 2 rows per rank: its own
    split is even (the op passes it no sizes), its peers' are not."""
    m = _a2a_matrix(world)
    for r in range(world):
        m[0][r] = m[r][0] = 2
    return m


@pytest.mark.parametrize("fallback", [False, True], ids=["native", "no-uneven-a2a"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64], ids=str)
@pytest.mark.parametrize("mode", ["even", "given", "inferred", "mixed"])
# on processes: it switches capabilities off on the process's one backend adapter
@pytest.mark.diffcomm_in_process(False)
def test_all_to_all(world: LocalWorld, mode: str, dtype: torch.dtype, fallback: bool) -> None:
    # "mixed": rank 0's split is even, so it calls with no sizes (as the op does) while its
    # peers give theirs: without uneven support every rank must still take the padded path
    def rank_all_to_all(mode: str, dtype: torch.dtype, fallback: bool = False) -> Counted:
        rank, n = dc.get_rank(), dc.get_world_size()
        m = {"even": [[2] * n for _ in range(n)], "mixed": _a2a_mixed(n)}.get(mode) or _a2a_matrix(n)
        x = torch.cat([_a2a_rows(rank, dst, m[rank][dst]) for dst in range(n)]).to(dtype)
        plain = mode == "even" or (mode == "mixed" and rank == 0)
        ins = None if plain else m[rank]
        outs = [m[src][rank] for src in range(n)] if mode in ("given", "mixed") and not plain else None
        cap = "uneven_all_to_all" if fallback else None
        return _without(cap, lambda: _checked(lambda t: get_backend().all_to_all(t, None, ins, outs), x))

    n = world.world_size
    m = {"even": [[2] * n for _ in range(n)], "mixed": _a2a_mixed(n)}.get(mode) or _a2a_matrix(n)
    for dst, (o, counts) in enumerate(world.run(rank_all_to_all, mode, dtype, fallback)):
        expected = torch.cat([_a2a_rows(src, dst, m[src][dst]) for src in range(n)]).to(dtype)
        assert torch.equal(o, expected), f"rank {dst}"
        # without uneven support, a one-integer max all_reduce agrees on the padding, then
        # one even all_to_all (none when every chunk is empty), even where this rank's own
        # split is even (a peer's may not be); inferred output sizes cost one all_to_all more
        padded = fallback
        data = 0 if padded and max(map(max, m)) == 0 else 1
        expected_counts = {"all_to_all": data + (mode == "inferred")}
        if padded:
            expected_counts["all_reduce"] = 1
        assert counts == {k: v for k, v in expected_counts.items() if v}, dst


def test_batch_p2p_ring(multi_world: LocalWorld) -> None:
    def rank_ring() -> tuple[torch.Tensor, torch.Tensor]:
        rank, world = dc.get_rank(), dc.get_world_size()
        x = _data(rank, (4,))
        before = x.clone()
        got = torch.empty(4)
        ops = [("send", x, (rank + 1) % world, 0), ("recv", got, (rank - 1) % world, 0)]
        get_backend().batch_p2p(ops, None)
        return got, before

    n = multi_world.world_size
    for r, (got, sent) in enumerate(multi_world.run(rank_ring)):
        assert torch.equal(got, _data((r - 1) % n, (4,)))
        assert torch.equal(sent, _data(r, (4,)))


def test_exchange_sizes(world: LocalWorld) -> None:
    def rank_exchange_sizes() -> list[int]:
        return get_backend().exchange_sizes(10 * dc.get_rank() + 1, None)

    expected = [10 * r + 1 for r in range(world.world_size)]
    assert world.run(rank_exchange_sizes) == [expected] * world.world_size


def test_unknown_reduce_op_is_rejected(world1: LocalWorld) -> None:
    err = world1.run(_error, lambda: get_backend().all_reduce(torch.ones(2), "mean-ish", None))[0]
    assert err is not None and err[0] == "ValueError"
    assert "unknown reduce op 'mean-ish'; legal: ('sum', 'avg', 'max', 'min', 'product')" in err[1]
    with pytest.raises(ValueError, match=r"`op` must be one of \('sum', 'avg', 'max', 'min', 'product'\)"):
        normalize_op("mean-ish", "all_reduce")
    assert normalize_op("PROD", "all_reduce") == "product"
    assert normalize_op(dist.ReduceOp.MAX, "all_reduce") == "max"
    with pytest.raises(ValueError, match="`op` must be sum/avg/product for a complex tensor"):
        normalize_op("max", "all_reduce", torch.ones(1, dtype=torch.complex64))


# ------------------------------------------------------------------- comms logger


def test_comms_logger_records_count_bytes_time(world: LocalWorld) -> None:
    def rank_logged() -> dict[str, Any]:
        from rich.console import Console

        be = get_backend()
        x = torch.ones(4)  # 16 bytes
        with log_comms() as outer:
            with log_comms() as log:
                be.all_reduce(x, "sum", None)
                be.all_reduce(x, "max", None)
                be.all_gather(x, None)
            be.broadcast(x, 0, None)
        console = Console(record=True, width=120, file=io.StringIO())
        console.print(log.rich_table())
        return {
            "count": log.count(),
            "count_all_reduce": log.count("all_reduce"),
            "bytes_all_reduce": log.total_bytes("all_reduce"),
            "bytes_all_gather": log.total_bytes("all_gather"),
            "by_op": log.by_op(),
            "outer_count": outer.count(),
            "summary": str(log),
            "rich": console.export_text(),
            "labels": [r.label for r in log.records],
        }

    n = world.world_size
    for rec in world.run(rank_logged):
        assert rec["count"] == 3 and rec["count_all_reduce"] == 2 and rec["outer_count"] == 4
        assert rec["bytes_all_reduce"] == 32 and rec["bytes_all_gather"] == 16 * n
        row = rec["by_op"]["all_reduce"]
        assert row["count"] == 2 and row["bytes"] == 32 and row["skipped"] == 0
        assert row["seconds"] > 0 and row["algbw_GBps"] > 0
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * 2 * (n - 1) / n)
        assert set(rec["by_op"]) == {"all_reduce", "all_gather"}
        lines = rec["summary"].splitlines()
        assert lines[0].split() == ["op", "count", "bytes", "time", "ms", "algbw", "GB/s", "busbw", "GB/s"]
        assert lines[2].split()[:3] == ["all_gather", "1", str(16 * n)]
        assert lines[3].split()[:3] == ["all_reduce", "2", "32"]
        assert "diffcomm comms log" in rec["rich"] and "all_reduce" in rec["rich"]
        assert "busbw GB/s" in rec["rich"]
        assert rec["labels"] == [None, None, None]


# ------------------------------------------------------------------- comm-off switches


def test_comm_off_on_one_rank_does_not_communicate(multi_world: LocalWorld) -> None:
    def rank_comm_off_on_rank0_only() -> dict[str, Any]:
        be = get_backend()
        x = torch.full((3,), float(dc.get_rank() + 1))
        with log_comms() as log:
            if dc.get_rank() == 0:
                with comm_off("all_reduce"):
                    skipped = be.all_reduce(x, "sum", None)
            else:
                skipped = None
            # the group must still be in step: had rank 0 really communicated above, this
            # all_reduce would pair with it and the ranks would disagree or hang
            real = be.all_reduce(torch.ones(2), "sum", None)
        return {
            "skipped": skipped,
            "real": real,
            "by_op": log.by_op(),
            "flags": [r.skipped for r in log.records],
        }

    n = multi_world.world_size
    out = multi_world.run(rank_comm_off_on_rank0_only)
    assert torch.equal(out[0]["skipped"], torch.ones(3)), "a skipped all_reduce returns the local data"
    for r, rec in enumerate(out):
        assert torch.equal(rec["real"], torch.full((2,), float(n)))
        if r == 0:
            assert rec["flags"] == [True, False]
            assert rec["by_op"]["all_reduce"]["count"] == 2 and rec["by_op"]["all_reduce"]["skipped"] == 1
        else:
            assert rec["flags"] == [False]


def test_comm_off_every_op_keeps_shapes_and_skips(world: LocalWorld) -> None:
    def rank_every_op_off() -> dict[str, Any]:
        be = get_backend()
        rank, n = dc.get_rank(), dc.get_world_size()
        x = _data(rank, (2 * n, 3))
        row = _data(rank, (2, 3))
        with comm_off(*OP_NAMES), log_comms() as log:
            got = torch.empty(4)
            ops = [("send", torch.ones(4), (rank + 1) % n, 0), ("recv", got, (rank - 1) % n, 0)]
            if n > 1:
                be.batch_p2p(ops, None)
            shapes = {
                "all_reduce": be.all_reduce(x, "sum", None).shape,
                "broadcast": be.broadcast(x, 0, None).shape,
                "reduce": be.reduce(x, 0, "sum", None).shape,
                "all_gather": be.all_gather(row, None).shape,
                "all_gather uneven": be.all_gather(
                    row[: rank % 2 + 1], None, [r % 2 + 1 for r in range(n)]
                ).shape,
                "reduce_scatter": be.reduce_scatter(x, "sum", None).shape,
                "gather": be.gather(row, 0, None).shape,
                "scatter": be.scatter(x, 0, None).shape,
                "all_to_all": be.all_to_all(x, None).shape,
            }
            be.barrier(None)
        return {
            "shapes": {k: tuple(v) for k, v in shapes.items()},
            "all_skipped": all(r.skipped for r in log.records),
            "ops": sorted({r.op for r in log.records}),
            "recv_zeroed": n == 1 or bool((got == 0).all()),
            "off_after": [o for o in OP_NAMES if is_off(o)],
        }

    n = world.world_size
    uneven_total = sum(r % 2 + 1 for r in range(n))
    for rec in world.run(rank_every_op_off):
        assert rec["shapes"] == {
            "all_reduce": (2 * n, 3),
            "broadcast": (2 * n, 3),
            "reduce": (2 * n, 3),
            "all_gather": (2 * n, 3),
            "all_gather uneven": (uneven_total, 3),
            "reduce_scatter": (2, 3),
            "gather": (2 * n, 3),
            "scatter": (2, 3),
            "all_to_all": (2 * n, 3),
        }
        assert rec["all_skipped"] and rec["recv_zeroed"]
        expected_ops = {"all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter"}
        expected_ops |= {"gather", "scatter", "all_to_all", "barrier"} | ({"batch_p2p"} if n > 1 else set())
        assert set(rec["ops"]) == expected_ops
        assert rec["off_after"] == [], "the with block restores the switches"


def test_comm_off_as_call_then_restore() -> None:
    switch = comm_off("all_gather", "reduce_scatter")
    assert is_off("all_gather") and is_off("reduce_scatter") and not is_off("all_reduce")
    with comm_off("all_reduce"):
        assert is_off("all_reduce") and is_off("all_gather")
    assert not is_off("all_reduce") and is_off("all_gather")
    switch.restore()
    assert not any(is_off(o) for o in OP_NAMES)


def test_comm_off_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match=r"unknown op\(s\) \['allreduce'\]; legal: \('all_reduce',"):
        comm_off("all_reduce", "allreduce")
    assert not is_off("all_reduce"), "a rejected call switches nothing off"


def _dispatched_names() -> tuple[set[str], set[str]]:
    """The raw-op names the package's source passes to ``dispatch`` (first argument, a
    string), and the ops it runs coalesced (``coalesced("<op>", ...)``)."""
    single: set[str] = set()
    coalesced: set[str] = set()
    for path in Path(dc.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            first = node.args[0].value
            if name in ("dispatch", "_dispatch") and isinstance(first, str):
                single.add(first)
            elif name == "coalesced" and isinstance(first, str):
                coalesced.add(f"{first}_coalesced")
    return single, coalesced


def test_raw_op_table_is_what_the_backend_dispatches() -> None:
    """One row per raw op: every name passed to ``dispatch`` has a row, every row is
    dispatched, and the logger, the switches and the diagnosis read their facts from it."""
    from diffcomm.backend import RAW_OPS
    from diffcomm.diagnostics import diagnosis, recorder

    single, coalesced = _dispatched_names()
    assert single and coalesced
    assert set(RAW_OPS) == single | coalesced
    assert OP_NAMES == tuple(RAW_OPS)
    assert all(row.name == name and row.when_off for name, row in RAW_OPS.items())
    assert diagnosis.P2P_OPS == recorder.P2P_OPS == {"send", "recv", "batch_p2p"}
    for name, row in RAW_OPS.items():
        entry = {"op": "x", "raw_op": name, "shape": [2], "dtype": "float32"}
        assert (len(diagnosis.signature(entry)) == 2) == row.shape_free, name
    log = dc.backend.CommsLog([dc.backend.CommRecord(op, None, 100, 1.0, 4) for op in RAW_OPS])
    for name, got in log.by_op().items():
        assert got["busbw_GBps"] == pytest.approx(100 * RAW_OPS[name].bus(4) / 1e9)
    assert RAW_OPS["all_reduce"].bus(4) == 1.5 and RAW_OPS["all_gather_coalesced"].bus(4) == 0.75


# ------------------------------------------------------------------- debug-mode check


# shared: the rank body of both check_consistent tests (ranks agree / one field differs)
def _rank_check_consistent(case: str) -> tuple[str, str] | None:
    rank = dc.get_rank()
    fields: dict[str, Any] = {"shape": (2, 3), "dtype": torch.float32, "src": 0}
    if case == "shape" and rank == 1:
        fields["shape"] = (2, 3, 4)
    if case == "dtype" and rank == dc.get_world_size() - 1:
        fields["dtype"] = torch.float64
    if case == "src":
        fields["src"] = rank
    return _error(lambda: get_backend().check_consistent("all_gather", fields, None))


def test_check_consistent_passes_when_ranks_agree(world: LocalWorld) -> None:
    assert world.run(_rank_check_consistent, "same") == [None] * world.world_size


@pytest.mark.parametrize(
    ("case", "detail"),
    [
        ("shape", r"shape differs \(rank 0: \(2, 3\), rank 1: \(2, 3, 4\), rank 2: \(2, 3\)\)"),
        ("dtype", r"dtype differs \(rank 0: torch.float32, rank 1: torch.float32, rank 2: torch.float64\)"),
        ("src", r"src differs \(rank 0: 0, rank 1: 1, rank 2: 2\)"),
    ],
)
# on processes: a cross-rank diagnosis (debug mode, the p2p protocol) needs per-rank state
@pytest.mark.diffcomm_in_process(False)
def test_check_consistent_names_ranks_and_field(world3: LocalWorld, case: str, detail: str) -> None:
    for err in world3.run(_rank_check_consistent, case):
        assert err is not None and err[0] == CrossRankMismatchError.__name__
        assert "diffcomm.all_gather(): ranks called it with inconsistent arguments" in err[1]
        assert re.search(detail, err[1]), err[1]


def test_check_consistent_compares_fields_by_name() -> None:
    """A field one rank passes and another does not (``precision=`` on rank 0 only) is named
    as itself. Before, the fields were compared by position: "precision differs (rank 0:
    bf16>bf16, rank 1: (4, 8)); x.shape differs (rank 0: (4, 8), rank 1: torch.float32);
    x.dtype differs ...", every field after it lined up with the next one."""
    from diffcomm.backend.consistency import encode, mismatch

    plain = {"op": "sum", "shape": (4, 8), "dtype": torch.float32, "grad": False}
    quantized = {
        "op": "sum",
        "precision": "bf16>bf16",
        "shape": (4, 8),
        "dtype": torch.float32,
        "grad": False,
    }
    for names, mine in ((list(quantized), quantized), (list(plain), plain)):
        table = [encode(quantized), encode(plain)]
        width = max(map(len, table))
        message = mismatch("all_reduce", names, [row + [-7] * (width - len(row)) for row in table])
        assert message == (
            "diffcomm.all_reduce(): ranks called it with inconsistent arguments (group ranks [0, 1]): "
            "precision differs (rank 0: bf16>bf16, rank 1: not given)"
        ), (mine, message)
    # the same fields in another order agree
    assert mismatch("all_reduce", list(plain), [encode(plain), encode(dict(reversed(plain.items())))]) is None


# ------------------------------------------------------------------- groups


# per rank process: new_group must run once, in the same order. _GROUPS, _mesh and
# _subgroup stay at module level: the rank imports them (by reference), so the groups
# outlive a run; a nested copy shipped by value would start from an empty dict each run
_GROUPS: dict[Any, Any] = {}


def _mesh() -> Any:
    if "mesh" not in _GROUPS:
        from torch.distributed.device_mesh import init_device_mesh

        _GROUPS["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return _GROUPS["mesh"]


def _subgroup(ranks: tuple[int, ...]) -> Any:
    if ranks not in _GROUPS:
        _GROUPS[ranks] = dist.new_group(list(ranks))
    return _GROUPS[ranks]


# on processes: the test caches its groups in a module dict: one per process, not per rank
@pytest.mark.diffcomm_in_process(False)
def test_device_mesh_axis_resolves_to_its_group(world4: LocalWorld) -> None:
    def rank_mesh_groups() -> dict[str, Any]:
        be = get_backend()
        mesh = _mesh()
        x = torch.tensor([float(dc.get_rank() + 1)])
        out: dict[str, Any] = {}
        for axis in ("tp", 1, -1, "dp", 0):
            group = resolve_group((mesh, axis), "all_reduce")
            out[f"sum {axis}"] = be.all_reduce(x, "sum", group).item()
            out[f"rank {axis}"] = be.rank(group)
        tp = resolve_group((mesh, "tp"), "broadcast")
        out["broadcast tp src 1"] = be.broadcast(x, 1, tp).item()
        out["global of tp 1"] = be.global_rank(tp, 1)
        out["world_size tp"] = dc.get_world_size((mesh, "tp"))
        out["errors"] = [
            _error(lambda: resolve_group((mesh, "pp"), "all_reduce")),
            _error(lambda: resolve_group((mesh, 2), "all_reduce")),
            _error(lambda: resolve_group((mesh, 1.5), "all_reduce")),
            _error(lambda: resolve_group(("not a mesh", 0), "all_reduce")),
            _error(lambda: resolve_group(42, "all_reduce")),
        ]
        return out

    for r, out in enumerate(world4.run(rank_mesh_groups)):
        dp, tp = divmod(r, 2)  # mesh [[0, 1], [2, 3]]: rows are dp, columns tp
        tp_sum = float(2 * dp + 1 + 2 * dp + 2)
        dp_sum = float(tp + 1 + tp + 3)
        assert out["sum tp"] == out["sum 1"] == out["sum -1"] == tp_sum
        assert out["sum dp"] == out["sum 0"] == dp_sum
        assert out["rank tp"] == out["rank 1"] == tp and out["rank dp"] == dp
        assert out["broadcast tp src 1"] == float(2 * dp + 2), "src is group-local"
        assert out["global of tp 1"] == 2 * dp + 1 and out["world_size tp"] == 2
        errors = out["errors"]
        assert errors[0][0] == "ValueError" and "a mesh axis name in ('dp', 'tp'), got 'pp'" in errors[0][1]
        assert errors[1][0] == "ValueError" and "a mesh axis index in [0, 2), got 2" in errors[1][1]
        assert errors[2][0] == "TypeError" and "a mesh axis name or index, got float" in errors[2][1]
        assert errors[3][0] == "TypeError" and "a (DeviceMesh, axis) pair, got (str, ...)" in errors[3][1]
        assert (
            errors[4][0] == "TypeError"
            and "None, a ProcessGroup or a (DeviceMesh, axis) pair" in errors[4][1]
        )
        assert f"(rank {r})" in errors[0][1], "errors name the rank"


@pytest.mark.parametrize(("n", "members"), [(3, (0, 2)), (4, (1, 3)), (4, (0, 1, 3))])
# on processes: the test caches its groups in a module dict: one per process, not per rank
@pytest.mark.diffcomm_in_process(False)
def test_subgroup_from_new_group(
    local_worlds: Callable[..., LocalWorld], n: int, members: tuple[int, ...]
) -> None:
    def rank_subgroup(members: tuple[int, ...]) -> dict[str, Any] | None:
        group = _subgroup(members)
        if dc.get_rank() not in members:
            return None  # non-members take no part in the subgroup's collectives
        be = get_backend()
        x = _data(dc.get_rank(), (2 * len(members), 3))  # two rows per member: even splits
        return {
            "rank": be.rank(group),
            "world": be.world_size(group),
            "global of 1": be.global_rank(group, 1),
            "all_reduce": be.all_reduce(x, "sum", group),
            "broadcast": be.broadcast(x, 1, group),
            "reduce": be.reduce(x, 1, "max", group),
            "all_gather": be.all_gather(x, group),
            "reduce_scatter": be.reduce_scatter(x, "sum", group),
            "gather": be.gather(x, 1, group),
            "scatter": be.scatter(x, 1, group),
            "all_to_all": be.all_to_all(x, group),
        }

    out = local_worlds(n).run(rank_subgroup, members)
    k = len(members)
    xs = [_data(g, (2 * k, 3)) for g in members]  # by group-local rank
    for r, rec in enumerate(out):
        if r not in members:
            assert rec is None
            continue
        me = members.index(r)
        assert rec["rank"] == me and rec["world"] == k and rec["global of 1"] == members[1]
        assert torch.equal(rec["all_reduce"], sum(xs))
        assert torch.equal(rec["broadcast"], xs[1]), "src=1 is group-local"
        assert torch.equal(rec["reduce"], torch.stack(xs).amax(0) if me == 1 else torch.zeros(2 * k, 3))
        assert torch.equal(rec["all_gather"], torch.cat(xs))
        assert torch.equal(rec["reduce_scatter"], sum(xs).split(2)[me])
        assert torch.equal(rec["gather"], torch.cat(xs) if me == 1 else torch.zeros(2 * k * k, 3))
        assert torch.equal(rec["scatter"], xs[1].split(2)[me]), "src=1 is group-local"
        assert torch.equal(rec["all_to_all"], torch.cat([x.split(2)[me] for x in xs]))


def test_resolve_group_needs_an_initialised_process_group() -> None:
    if dist.is_initialized():
        pytest.skip("this test process itself is in a process group")
    with pytest.raises(RuntimeError, match=r"diffcomm.all_gather\(\): torch.distributed is not initialised"):
        resolve_group(None, "all_gather")


# ------------------------------------------- the group record asks the group its backend


@pytest.mark.parametrize("spec", [None, "cpu:gloo", "gloo"])
def test_group_record_asks_the_group_which_backend_moves_its_data(spec: str | None, tmp_path) -> None:
    """``init_process_group()`` without a backend reports ``"undefined"``, a device map
    reports itself (``"cpu:gloo"``): the record asks the group for the backend behind its
    data instead, so such a group gets gloo's native ops (not the conservative fallbacks
    an unknown name gets) and the size channel is the group itself."""
    from diffcomm.backend import Capabilities, group_info, static_capabilities

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group(spec, store=store, rank=0, world_size=1)
    try:
        reported = str(dist.get_backend()).lower()
        assert reported == {None: "undefined", "cpu:gloo": "cpu:gloo", "gloo": "gloo"}[spec]
        info = group_info(None)
        assert info.backend == "gloo" and get_backend().backend_name(None) == "gloo"
        assert isinstance(info.caps, Capabilities) and info.caps == static_capabilities("gloo")
        assert info.caps.reduce_scatter and info.caps.avg
        if spec != "gloo":  # the reported name alone would have meant no native reduce_scatter
            assert not static_capabilities(reported).reduce_scatter
        assert info.device == torch.device("cpu")
        from diffcomm.backend.groups import cpu_group

        assert cpu_group(info) is None  # the default group itself carries the sizes
        x = torch.arange(6.0).reshape(2, 3)
        with log_comms() as log:
            out = get_backend().reduce_scatter(x, "avg", None, None)
        assert torch.equal(out, x)
        assert set(log.by_op()) == {"reduce_scatter"}  # native: no all_reduce fallback
        # the same group through the public op, with its gradient (world 1: identity)
        xg = x.clone().requires_grad_()
        dc.reduce_scatter(xg, op="avg").sum().backward()
        assert torch.equal(xg.grad, torch.ones_like(x))
    finally:
        dist.destroy_process_group()


def _outside_the_group() -> list[str]:
    group = dist.new_group([0, 2])  # every rank calls new_group; rank 1 gets NON_GROUP_MEMBER
    x = torch.ones(2, dtype=torch.float64)
    if dc.get_rank() != 1:
        return [str(dc.all_reduce(x, group=group).tolist())]
    got = []
    for call in (lambda: dc.all_reduce(x, group=group), lambda: dc.compat.all_reduce(x, group=group)):
        try:
            call()
            got.append("no error")
        except TypeError as e:
            got.append(str(e))
    return got


def test_a_rank_outside_a_new_group_is_told_so(local_worlds: Callable[..., LocalWorld]) -> None:
    """``dist.new_group`` returns ``GroupMember.NON_GROUP_MEMBER`` (the int -100) on the ranks
    outside the group; an op given it said only "`group` must be None, a ProcessGroup or a
    (DeviceMesh, axis) pair, got int". Now it says this rank is no member, before any
    communication; the members' sum is unchanged."""
    got = local_worlds(3, in_process=True).run(_outside_the_group)
    assert got[0] == got[2] == ["[2.0, 2.0]"]
    for message in got[1]:
        want = "diffcomm.all_reduce(): `group` must be a group this rank belongs to"
        assert message.startswith(want), message
        assert "NON_GROUP_MEMBER" in message and "(rank 1)" in message, message
