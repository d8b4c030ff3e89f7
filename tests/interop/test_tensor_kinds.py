"""Unusual kinds of tensors given to diffcomm's ops. A tensor whose memory is not its values
(sparse, mkldnn, nested, quantized, fake) is a ``TypeError`` naming the op, the
argument and the kind, before any communication and on every rank alike; a tensor subclass
whose values are its values (a user's ``__torch_dispatch__`` wrapper, torch's
``AsyncCollectiveTensor``) is read as those values on every transport; dtypes torch
cannot reduce in some way are refused before communicating, the others equal the serial
program. (DTensors: tests/interop/test_dtensor.py.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._pytree import tree_map

import diffcomm as dc
from diffcomm import parallel as P

F64 = torch.float64


def _x(r: int, *shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 + r)
    return (torch.randint(-8, 9, shape, generator=g) / 4).to(F64)


def _fake(r: int) -> torch.Tensor:
    from torch._subclasses import FakeTensorMode

    with FakeTensorMode():
        return torch.ones(4, 4, dtype=F64)


# kind -> (this rank's tensor, words its error must contain)
_KINDS: dict[str, tuple[Callable[[int], torch.Tensor], str]] = {
    "sparse_csr": (lambda r: _x(r, 4, 4).to_sparse_csr(), "layout sparse_csr"),
    "sparse_csc": (lambda r: _x(r, 4, 4).to_sparse_csc(), "layout sparse_csc"),
    "sparse_bsr": (lambda r: _x(r, 4, 4).to_sparse_bsr((2, 2)), "layout sparse_bsr"),
    "mkldnn": (lambda r: _x(r, 4, 4).float().to_mkldnn(), "layout _mkldnn"),
    "nested_jagged": (
        lambda r: torch.nested.nested_tensor([_x(r, 2, 4), _x(r, 3, 4)], layout=torch.jagged),
        "a nested (jagged) tensor",
    ),
    "nested_strided": (lambda r: torch.nested.nested_tensor([_x(r, 2, 4), _x(r, 3, 4)]), "a nested tensor"),
    "quantized": (
        lambda r: torch.quantize_per_tensor(_x(r, 4, 4).float(), 0.25, 0, torch.qint8),
        "a quantized tensor",
    ),
    "fake": (_fake, "a FakeTensor"),
}

# op -> (the call, the name its error starts with, the argument)
_OPS: dict[str, tuple[Callable[[torch.Tensor], Any], str, str]] = {
    "all_reduce": (lambda x: dc.all_reduce(x), "all_reduce", "x"),
    "broadcast": (lambda x: dc.broadcast(x, src=1), "broadcast", "x"),
    "scatter": (lambda x: dc.scatter(x, src=1), "scatter", "x"),
    "shift": (lambda x: dc.shift(x), "shift", "x"),
    "all_reduce_coalesced": (lambda x: dc.all_reduce_coalesced([x]), "all_reduce_coalesced", "tensors[0]"),
    "copy_to_region": (lambda x: P.copy_to_region(x), "parallel.copy_to_region", "x"),
}


def _last_comm() -> Any:
    rec = list(dc.flight_recorder())
    return (rec[-1]["op"], rec[-1]["seq"]) if rec else None


def _refusal(kind: str, op: str) -> tuple[str, str, bool]:
    x = _KINDS[kind][0](dc.get_rank())
    before = _last_comm()
    try:
        _OPS[op][0](x)
        got = ("no error", "", True)
    except Exception as e:  # the kind of error is what is checked
        got = (type(e).__name__, str(e), _last_comm() == before)
    return got


@pytest.mark.parametrize("op", list(_OPS))
@pytest.mark.parametrize("kind", list(_KINDS))
def test_tensor_without_plain_values_is_a_type_error_naming_op_and_kind(
    kind: str, op: str, inproc_world2: dc.LocalWorld
) -> None:
    """Before: CSR/CSC/BSR, mkldnn, nested and quantized tensors raised torch's errors
    from inside the op (``unsupported memory format option Contiguous``, ``NestedTensorImpl
    doesn't support sizes``, an INTERNAL ASSERT of the quantizer), some after communicating;
    a quantized ``broadcast``/``copy_to_region`` returned without error (its values never
    moved); a FakeTensor met torch's "Mixing fake modes"
    AssertionError in the reduction. Only COO was refused."""
    _, op_name, arg = _OPS[op]
    words = _KINDS[kind][1]
    for cls, message, quiet in inproc_world2.run(_refusal, kind, op):
        assert cls == "TypeError", (cls, message)
        assert message.startswith(f"diffcomm.{op_name}(): `{arg}` must be a dense tensor with data"), message
        assert words in message, message
        assert quiet, f"{op} communicated before refusing"


class _Wrapper(torch.Tensor):
    """A user's ``__torch_dispatch__`` wrapper subclass: no storage of its own, every op
    unwraps, runs on the inner tensor and wraps again (and logs)."""

    calls: list[str] = []

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> _Wrapper:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, inner.shape, dtype=inner.dtype, device=inner.device, strides=inner.stride()
        )

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        cls.calls.append(str(func))

        def unwrap(t: Any) -> Any:
            return t.inner if isinstance(t, _Wrapper) else t

        def wrap(t: Any) -> Any:
            return _Wrapper(t) if isinstance(t, torch.Tensor) and not isinstance(t, _Wrapper) else t

        return tree_map(wrap, func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {})))


def _scatter_wrapped(kind: str) -> list[float]:
    r = dc.get_rank()
    if kind == "wrapper":
        x: torch.Tensor = _Wrapper(_x(r, 4, 2))
    else:  # torch's AsyncCollectiveTensor, not yet waited
        import torch.distributed as dist
        import torch.distributed._functional_collectives as fc

        x = fc.all_reduce(_x(r, 4, 2), "sum", dist.group.WORLD)
    y = dc.scatter(x, src=1)
    return [float(v) for v in (y.inner if isinstance(y, _Wrapper) else y).reshape(-1)]


@pytest.mark.parametrize("kind", ["wrapper", "async_collective_tensor"])
def test_scatter_of_a_wrapper_subclass_reads_its_values(kind: str, world2: dc.LocalWorld) -> None:
    """On gloo, ``scatter`` handed c10d the source's chunks as the subclass itself, which
    c10d reads without dispatching: a wrapper has no storage, and gloo crashed ("writev:
    Bad address"), tearing the world down. Now its values go (the serial program's)."""
    xs = [_x(r, 4, 2) for r in range(2)]
    src = (xs[0] + xs[1]) if kind != "wrapper" else xs[1]
    for r, got in enumerate(world2.run(_scatter_wrapped, kind)):
        assert got == src[2 * r : 2 * r + 2].reshape(-1).tolist()


_UNSIGNED = ["uint16", "uint32", "uint64"]


def _reduce_unsigned(dtype: str, op: str) -> list[int]:
    r = dc.get_rank()
    x = torch.tensor([3 + r, 7 - 2 * r, 1 + r], dtype=getattr(torch, dtype))
    return dc.reduce(x, dst=1, op=op).to(torch.int64).tolist()


@pytest.mark.parametrize("op", ["max", "min", "product"])
@pytest.mark.parametrize("dtype", _UNSIGNED)
@pytest.mark.parametrize("world_kind", ["inproc", "gloo"])
def test_reduce_of_unsigned_ints_by_max_min_product_matches_serial(
    world_kind: str, dtype: str, op: str, request: pytest.FixtureRequest
) -> None:
    """``reduce(op=max/min/product)`` of a uint16/32/64 tensor raised torch's
    NotImplementedError ("masked_fill" not implemented for 'UInt16') after the
    all_reduce, on every rank; sum and all_reduce were right."""
    world = request.getfixturevalue("inproc_world2" if world_kind == "inproc" else "world2")
    xs = [torch.tensor([3 + r, 7 - 2 * r, 1 + r]) for r in range(2)]
    stacked = torch.stack(xs)
    full = {"max": stacked.amax(0), "min": stacked.amin(0), "product": stacked.prod(0)}[op].tolist()
    assert world.run(_reduce_unsigned, dtype, op) == [[0, 0, 0], full]


def _complex32(op: str, call: str) -> tuple[str, str]:
    x = torch.full((4,), 1 + 1j, dtype=torch.complex64).to(torch.complex32)
    fn = {
        "all_reduce": lambda: dc.all_reduce(x, op=op),
        "reduce": lambda: dc.reduce(x, dst=1, op=op),
        "reduce_scatter": lambda: dc.reduce_scatter(x, op=op),
        "all_reduce_coalesced": lambda: dc.all_reduce_coalesced([x], op=op),
    }[call]
    try:
        fn()
    except Exception as e:  # the kind of error is what is checked
        return type(e).__name__, str(e)
    return "no error", ""


@pytest.mark.parametrize("call", ["all_reduce", "reduce", "reduce_scatter", "all_reduce_coalesced"])
@pytest.mark.parametrize("op", ["avg", "product"])
def test_complex32_avg_and_product_refused_on_every_rank(
    op: str, call: str, inproc_world2: dc.LocalWorld
) -> None:
    """torch has no complex32 division or product: ``avg``/``product`` of a chalf tensor
    raised torch's NotImplementedError ("div_cpu" / "prod_out_cpu" not implemented for
    'ComplexHalf') after communicating, and ``reduce(op="avg")`` only on ``dst`` (the
    other rank returned). Now a ValueError naming the op before any communication."""
    for cls, message in inproc_world2.run(_complex32, op, call):
        assert cls == "ValueError", (cls, message)
        assert message.startswith(f"diffcomm.{call}(): `op` must be 'sum' for a complex32 tensor"), message


def _meta_shapes() -> dict[str, tuple[int, ...]]:
    r = dc.get_rank()
    x = torch.empty(4, 3, device="meta")
    calls: dict[str, Callable[[], torch.Tensor]] = {
        "all_reduce": lambda: dc.all_reduce(x),
        "all_gather": lambda: dc.all_gather(x),
        "all_gather uneven": lambda: dc.all_gather(torch.empty(r + 1, 3, device="meta")),
        "reduce_scatter": lambda: dc.reduce_scatter(x),
        "all_to_all": lambda: dc.all_to_all(x),
        "broadcast": lambda: dc.broadcast(x, src=0),
        "ParallelMLP": lambda: P.ParallelMLP(3, 4, seed=0, device="meta")(torch.empty(2, 3, device="meta")),
    }
    out = {}
    for name, call in calls.items():
        y = call()
        assert y.is_meta, name
        out[name] = tuple(y.shape)
    return out


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
@pytest.mark.diffcomm_in_process(False)  # gloo's own ranks: the transport is the point
def test_meta_tensors_give_meta_results_of_the_serial_shapes(world2: dc.LocalWorld, debug: bool) -> None:
    """A meta tensor has no values to be wrong: every op gives the meta result of the
    right shape (an uneven all_gather's sizes are exchanged as on real tensors), so shape
    inference through a parallel model works (torch.distributed.pipelining runs a stage's
    forward on meta tensors to learn its shapes). In debug mode too: the replicated check
    of ParallelMLP's copy forward summed the meta input ("Cannot copy out of meta tensor;
    no data!"); it compares the shape."""
    want = {
        "all_reduce": (4, 3),
        "all_gather": (8, 3),
        "all_gather uneven": (3, 3),
        "reduce_scatter": (2, 3),
        "all_to_all": (4, 3),
        "broadcast": (4, 3),
        "ParallelMLP": (2, 3),
    }
    with dc.debug(debug):
        assert world2.run(_meta_shapes) == [want, want]
