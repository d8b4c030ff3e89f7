"""Tests for diffcomm.ops.p2p: send/recv with metadata, sendrecv, ppermute, shift.

Every test runs on real gloo ranks of the session-scoped worlds; assertions run inside
the rank functions (a failing rank surfaces as one RankError naming it).
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import diffcomm as dc
from diffcomm import backend as B
from diffcomm._errors import CrossRankMismatchError
from diffcomm.ops import p2p, wire

# The point-to-point ops' values and gradients need no real transport: this module's shared worlds are
# in-process (the same values as gloo processes: tests/runtime/test_in_process.py). A test that needs
# a process per rank says why and stays on processes.
pytestmark = pytest.mark.diffcomm_in_process


DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.uint8,
]
SHAPES = [(), (3,), (2, 3), (2, 1, 3), (1, 2, 3, 2), (0, 3)]


def _rank() -> int:
    return dist.get_rank()


def _n() -> int:
    return dist.get_world_size()


def _sum_over_ranks(v: float) -> float:
    t = torch.tensor([v], dtype=torch.float64)
    return float(B.get_backend().all_reduce(t, "sum", None).item())


def _sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 10
    if dtype == torch.bool:
        return x > 0
    if dtype.is_complex:
        return torch.complex(x, -x).to(dtype)
    if not dtype.is_floating_point:
        return x.round().to(dtype) if dtype != torch.uint8 else x.abs().round().to(dtype)
    return x.to(dtype)


# ======================================================================================
# send / recv
# ======================================================================================


def test_recv_with_metadata_every_dtype_and_0_to_4_dims(world2: dc.LocalWorld) -> None:
    def roundtrip_every_dtype_and_ndim() -> None:
        for i, (dtype, shape) in enumerate(itertools.product(DTYPES, SHAPES)):
            x = _sample(dtype, shape, i)
            if _rank() == 0:
                token = p2p.send(x, dst=1, tag=i % 7)
                # (real for a complex x: token.backward() needs a real scalar)
                real = x.real.dtype if dtype.is_complex else dtype
                assert token.shape == () and token.dtype == real and not token.requires_grad
            else:
                got = p2p.recv(src=0, tag=i % 7)  # no metadata given: it travels in the header
                assert got.dtype == dtype and got.shape == x.shape, (dtype, shape, got.dtype, got.shape)
                assert torch.equal(got, x), (dtype, shape)
                assert not got.requires_grad
        # shape/dtype/like given are checked and accepted when they agree
        for i, dtype in enumerate(DTYPES):
            x = _sample(dtype, (2, 2), 100 + i)
            if _rank() == 0:
                p2p.send(x, 1)
                p2p.send(x, 1)
            else:
                assert torch.equal(p2p.recv(0, shape=(2, 2), dtype=dtype), x)
                assert torch.equal(p2p.recv(0, like=torch.empty(2, 2, dtype=dtype)), x)
        p2p.wait_sends()

    world2.run(roundtrip_every_dtype_and_ndim)


def test_send_token_pulls_gradient_from_dst(world2: dc.LocalWorld) -> None:
    def send_recv_gradient() -> list[Any]:
        if _rank() == 0:
            x = torch.arange(1.0, 4.0, dtype=torch.float64, requires_grad=True)
            token = p2p.send(x * 2, dst=1)
            assert token.requires_grad and token.item() == 0.0 and token.dtype == torch.float64
            (token + (x * x).sum()).backward()  # the token added into the local loss
            # rank 1's loss is sum(y^3) with y = 2x: d/dx = 3 * y^2 * 2; plus the local 2x
            torch.testing.assert_close(x.grad, 6 * (2 * x.detach()) ** 2 + 2 * x.detach(), rtol=0, atol=0)
            return [x.grad]
        y = p2p.recv(src=0)
        assert y.requires_grad and y.grad_fn is not None
        (y**3).sum().backward()
        return [y.detach()]

    out = world2.run(send_recv_gradient)
    torch.testing.assert_close(out[1][0], torch.tensor([2.0, 4.0, 6.0], dtype=torch.float64))


def test_requires_grad_is_never_lost_or_invented_across_a_boundary(world2: dc.LocalWorld) -> None:
    def requires_grad_travels() -> None:
        if _rank() == 0:
            p2p.send(torch.ones(2), 1)  # no grad
            w = torch.ones(2, requires_grad=True)
            t = p2p.send(w * 3, 1)  # grad
            with torch.no_grad():
                p2p.send(w * 3, 1)  # grad mode off: no grad
            p2p.send(torch.ones(2, dtype=torch.int64), 1)
            t2 = p2p.send(w * 5, 1)  # the receiver is in no_grad: it answers with zeros
            t.backward()
            t2.backward()
            torch.testing.assert_close(w.grad, torch.full((2,), 3.0 * 4.0))
        else:
            assert not p2p.recv(0).requires_grad
            y = p2p.recv(0)
            assert y.requires_grad
            assert not p2p.recv(0).requires_grad
            assert not p2p.recv(0).requires_grad
            with torch.no_grad():
                z = p2p.recv(0)
            assert not z.requires_grad
            (y * 4).sum().backward()
        p2p.wait_sends()

    world2.run(requires_grad_travels)


def test_gradients_pair_with_their_messages_whatever_the_backward_order(world2: dc.LocalWorld) -> None:
    def backward_order_differs() -> None:
        # gradients pair with their messages, not with the order backward nodes happen to run
        if _rank() == 0:
            a = torch.ones(2, requires_grad=True)
            b = torch.ones(2, requires_grad=True)
            ta, tb = p2p.send(a * 1, 1), p2p.send(b * 1, 1)
            ta.backward()
            tb.backward()
            assert a.grad.tolist() == [2.0, 2.0] and b.grad.tolist() == [3.0, 3.0]
        else:
            ya, yb = p2p.recv(0), p2p.recv(0)
            (3 * yb).sum().backward()  # b's gradient is sent first
            (2 * ya).sum().backward()
        p2p.wait_sends()

    world2.run(backward_order_differs)


# on processes: a cross-rank diagnosis (debug mode, the p2p protocol) needs per-rank state
@pytest.mark.diffcomm_in_process(False)
@pytest.mark.parametrize("in_dims", [0, 1])
def test_a_send_inside_vmap_gets_its_gradient_back(world2: dc.LocalWorld, in_dims: int) -> None:
    def vmapped_send(in_dims: int) -> list[list[float]] | bool:
        """The header said requires_grad=False for a batch sent inside ``vmap`` (the batched
        tensor reads False there): the receiver's output took no gradient while the
        sender's token waited for one, until the timeout."""
        xs = (torch.arange(6.0) + 1).reshape(3, 2).movedim(0, in_dims).requires_grad_()
        if _rank() == 0:
            tok = torch.func.vmap(lambda v: dc.send(2 * v, dst=1), in_dims=in_dims)(xs)
            tok.sum().backward()
            assert xs.grad is not None
            return xs.grad.movedim(in_dims, 0).tolist()
        y = dc.recv(src=0)  # the whole batch, batch dim first
        (y * y).sum().backward()
        return y.requires_grad

    grad, received_requires_grad = world2.run(vmapped_send, in_dims)
    assert received_requires_grad is True
    assert grad == [[8.0, 16.0], [24.0, 32.0], [40.0, 48.0]]  # 2 * (2 * y), y = 2 * x


def test_send_recv_out_of_step_is_an_error(world2: dc.LocalWorld) -> None:
    def out_of_step() -> None:
        # simulate a rank that skipped messages: first the receiver, then the sender is ahead
        if _rank() == 0:
            p2p.send(torch.ones(1), 1, tag=11)
            p2p.send(torch.ones(2), 1, tag=11)
            wire.SEQ[(None, 1, 12, "send")] = wire.SEQ.get((None, 1, 12, "send"), 0) + 3
            p2p.send(torch.ones(3), 1, tag=12)
            p2p.send(torch.ones(4), 1, tag=12)
        else:
            wire.SEQ[(None, 0, 11, "recv")] = wire.SEQ.get((None, 0, 11, "recv"), 0) + 5
            with pytest.raises(CrossRankMismatchError, match=r"out of step: this is receive #\d+ on rank 1"):
                p2p.recv(0, tag=11)
            assert p2p.recv(0, tag=11).shape == (2,)  # back in step
            with pytest.raises(CrossRankMismatchError, match="out of step"):
                p2p.recv(0, tag=12)
            assert p2p.recv(0, tag=12).shape == (4,)
        p2p.wait_sends()

    world2.run(out_of_step)


def test_tags_select_messages(world2: dc.LocalWorld) -> None:
    def tags_match_out_of_order() -> None:
        if _rank() == 0:
            p2p.send(torch.tensor([1.0]), 1, tag=1)
            p2p.send(torch.tensor([2.0]), 1, tag=2)
        else:
            assert p2p.recv(0, tag=2).item() == 2.0
            assert p2p.recv(0, tag=1).item() == 1.0
        p2p.wait_sends()

    world2.run(tags_match_out_of_order)


def test_sends_are_asynchronous_so_neighbours_do_not_deadlock(world2: dc.LocalWorld) -> None:
    def both_send_then_receive(n: int) -> float:
        # the 1F1B steady-state pattern: a blocking c10d send would deadlock here
        other = 1 - _rank()
        x = torch.full((n,), float(_rank()))
        p2p.send(x, other)
        p2p.send(x + 10, other)
        a, b = p2p.recv(other), p2p.recv(other)
        p2p.wait_sends()
        assert wire.SENDS.pending() == 0
        return float(a[0] + b[-1])

    assert world2.run(both_send_then_receive, 1 << 18) == [1.0 + 11.0, 0.0 + 10.0]


def test_the_caller_may_reuse_x_as_soon_as_send_returns(world2: dc.LocalWorld) -> None:
    def reuse_after_send() -> list[float]:
        # gloo reads a send's buffer only once the receiver has posted its receive (checked:
        # without send's private copy the receiver here gets the -1s), so the receiver waits
        # until the sender has overwritten x
        if _rank() == 0:
            x = torch.ones(1 << 16)
            p2p.send(x, 1)
            x.fill_(-1.0)  # at once: the send has not been received yet
            x2 = torch.arange(8.0).reshape(2, 4)
            p2p.send(x2.t(), 1)  # a non-contiguous view
            x2.zero_()
            B.get_backend().barrier(None)
            p2p.wait_sends()
            return []
        B.get_backend().barrier(None)  # the sender has overwritten both by now
        a, b = p2p.recv(0), p2p.recv(0)
        torch.testing.assert_close(b, torch.arange(8.0).reshape(2, 4).t().contiguous(), rtol=0, atol=0)
        return [float(a.min()), float(a.max())]

    assert world2.run(reuse_after_send)[1] == [1.0, 1.0]


# on processes: it patches a module attribute in its rank function (one module per process)
@pytest.mark.diffcomm_in_process(False)
def test_send_owned_sends_the_callers_tensor_with_sends_header_and_gradient(world2: dc.LocalWorld) -> None:
    def send_owned_sends_x_itself() -> list[Any]:
        sent: list[int] = []  # storages of the data buffers posted

        def post(parts: Any, buf: torch.Tensor, *args: Any) -> None:
            sent.append(buf.untyped_storage().data_ptr())
            post0(parts, buf, *args)

        post0, wire._post = wire._post, post
        try:
            if _rank() == 0:
                x = torch.arange(12.0, dtype=torch.float64).reshape(3, 4).requires_grad_()
                y = x * 2
                t1 = p2p.send_owned(y, dst=1)  # contiguous: its own storage on the wire
                assert sent[-1] == y.untyped_storage().data_ptr()
                t2 = p2p.send_owned(y.t(), dst=1)  # non-contiguous: a contiguous copy
                assert sent[-1] != y.untyped_storage().data_ptr()
                t3 = p2p.send(y, dst=1)  # the public send: always a private copy
                assert sent[-1] != y.untyped_storage().data_ptr()
                assert t1.requires_grad and p2p.post_grad_recv(t1)
                (t1 + t2 + t3).backward()
                return [x.grad]
            a, b, c = p2p.recv(0), p2p.recv(0), p2p.recv(0)
            assert a.requires_grad and b.requires_grad and c.requires_grad
            ((a * a).sum() + (3 * b).sum() + c.sum()).backward()
            return [torch.stack([a.detach(), b.detach().t(), c.detach()])]
        finally:
            wire._post = post0
            p2p.wait_sends()

    (g,), (ys,) = world2.run(send_owned_sends_x_itself)
    x = torch.arange(12.0, dtype=torch.float64).reshape(3, 4)
    torch.testing.assert_close(ys, torch.stack([2 * x, 2 * x, 2 * x]), rtol=0, atol=0)
    # d/dx [sum((2x)^2) + sum(3 (2x)^T) + sum(2x)] = 8x + 6 + 2
    torch.testing.assert_close(g, 8 * x + 8, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["shape", "dtype", "like"])
# on processes: a cross-rank diagnosis (debug mode, the p2p protocol) needs per-rank state
@pytest.mark.diffcomm_in_process(False)
def test_mismatched_send_recv_is_an_error_naming_the_ranks(world2: dc.LocalWorld, kind: str) -> None:
    def mismatch_clean(kind: str) -> None:
        x = torch.zeros(3, 4)
        kwargs: dict[str, Any] = {
            "shape": {"shape": (4, 3)},
            "dtype": {"dtype": torch.float64},
            "like": {"like": torch.zeros(3, 4, dtype=torch.int32)},
        }[kind]
        got = {
            "shape": r"rank 1 expected shape \(4, 3\), any dtype, but rank 0 sent shape \(3, 4\), float32",
            "dtype": r"rank 1 expected any shape, float64, but rank 0 sent shape \(3, 4\), float32",
            "like": r"rank 1 expected shape \(3, 4\), int32, but rank 0 sent shape \(3, 4\), float32",
        }[kind]
        if _rank() == 0:
            p2p.send(x, 1, tag=3)
            p2p.send(torch.tensor([7.0]), 1, tag=3)
            p2p.wait_sends()
            return
        with pytest.raises(
            CrossRankMismatchError, match=r"mismatched send/recv between ranks 0 -> 1 \(tag 3\): " + got
        ):
            p2p.recv(0, tag=3, **kwargs)
        # the mismatched data was drained: the next message arrives intact
        assert p2p.recv(0, tag=3).tolist() == [7.0]

    world2.run(mismatch_clean, kind)


# on processes: a cross-rank diagnosis (debug mode, the p2p protocol) needs per-rank state
@pytest.mark.diffcomm_in_process(False)
def test_a_message_that_is_not_a_send_header_is_an_error(world2: dc.LocalWorld) -> None:
    def mismatched_pairing_is_detected() -> None:
        # rank 0 sends raw data where rank 1 expects a diffcomm header
        if _rank() == 0:
            dist.send(torch.zeros(wire.HEADER_LEN, dtype=torch.int64), 1, tag=9)
        else:
            with pytest.raises(CrossRankMismatchError, match="not a diffcomm.send header.*ranks 0 and 1"):
                p2p.recv(0, tag=9)

    world2.run(mismatched_pairing_is_detected)


# on processes: forward-mode AD (one stack of dual levels per process)
@pytest.mark.diffcomm_in_process(False)
def test_send_recv_higher_order_and_forward_mode_are_errors_not_silent(world2: dc.LocalWorld) -> None:
    def send_recv_higher_order() -> None:
        if _rank() == 0:
            x = torch.tensor([1.0, 2.0], requires_grad=True)
            token = p2p.send(x, 1)
            (gx,) = torch.autograd.grad(token, x, create_graph=True)
            with pytest.raises(NotImplementedError, match="double backward through send/recv"):
                (gx**2).sum().backward()
            with torch.autograd.forward_ad.dual_level():
                dual = torch.autograd.forward_ad.make_dual(x.detach(), torch.ones(2))
                with pytest.raises(NotImplementedError, match="forward-mode AD .* through send/recv"):
                    p2p.send(dual, 1)
        else:
            y = p2p.recv(0)
            (y**2).sum().backward(create_graph=True)
            p2p.recv(0)  # the forward-mode attempt still delivered its data
        p2p.wait_sends()

    world2.run(send_recv_higher_order)


# ======================================================================================
# bad arguments: errors before any communication, on every rank, nobody left hanging
# ======================================================================================

BAD_CALLS: list[tuple[str, type[Exception], str]] = [
    ("p2p.send(x, dst=me)", ValueError, r"send\(\): `dst` must be a group-local rank other than this rank"),
    ("p2p.send(x, dst=n)", ValueError, r"send\(\): `dst` must be a group-local rank in \[0, 2\)"),
    ("p2p.send(x, dst=-1)", ValueError, r"`dst` must be a group-local rank in \[0, 2\), got -1"),
    ("p2p.send(x, dst=1.0)", TypeError, r"send\(\): `dst` must be an int, got float"),
    ("p2p.send(x, dst=other, tag=-1)", ValueError, r"`tag` must be an int in \[0, 65536\)"),
    ("p2p.send(x, dst=other, tag=1 << 16)", ValueError, r"`tag` must be an int in \[0, 65536\)"),
    ("p2p.send([1.0], dst=other)", TypeError, r"send\(\): `x` must be a torch.Tensor, got list"),
    ("p2p.send(torch.zeros([1] * 13), dst=other)", ValueError, r"`x` must be a tensor of at most 12 dims"),
    ("p2p.recv(src=me)", ValueError, r"recv\(\): `src` must be a group-local rank other than this rank"),
    ("p2p.recv(src='0')", TypeError, r"recv\(\): `src` must be an int, got str"),
    ("p2p.recv(src=other, shape=(-1, 2))", ValueError, r"`shape` must be non-negative sizes"),
    ("p2p.recv(src=other, shape='ab')", TypeError, r"`shape` must be a sequence of ints"),
    ("p2p.recv(src=other, dtype='float')", TypeError, r"`dtype` must be a torch.dtype"),
    ("p2p.recv(src=other, like=x, shape=(2,))", ValueError, r"`like` must be given alone"),
    ("p2p.recv(src=other, group=3)", TypeError, r"recv\(\): `group` must be None, a ProcessGroup"),
    ("p2p.sendrecv(x, dst=me, src=other)", ValueError, r"`dst/src` must be both this rank"),
    ("p2p.sendrecv(x, dst=other, src=5)", ValueError, r"sendrecv\(\): `src` must be a group-local rank"),
    ("p2p.sendrecv(x, other, other, shape=(2,), like=x)", ValueError, r"`shape/like` must be at most one"),
    ("p2p.sendrecv(x, me, me, shape=(5,))", ValueError, r"`shape` must be x.shape \(3,\) for a local copy"),
    (
        "p2p.ppermute(x, [(0, 1), (0, 0)])",
        ValueError,
        r"each source at most once, got sources \[0\] repeated",
    ),
    ("p2p.ppermute(x, [(0, 1), (1, 1)])", ValueError, r"each destination at most once"),
    ("p2p.ppermute(x, [(0, 2)])", ValueError, r"ppermute\(\): `perm` must be a group-local rank in \[0, 2\)"),
    ("p2p.ppermute(x, [(0, 1, 2)])", TypeError, r"`perm` must be a list of \(src, dst\) pairs"),
    ("p2p.ppermute(x, 'ab')", TypeError, r"`perm` must be a list of \(src, dst\) pairs, got str"),
    ("p2p.shift(x, offset=1.5)", TypeError, r"shift\(\): `offset` must be an int"),
    ("p2p.shift('x')", TypeError, r"shift\(\): `x` must be a torch.Tensor, got str"),
]


def test_bad_arguments_raise_before_any_communication(world2: dc.LocalWorld) -> None:
    def bad_calls() -> int:
        me, n, other = _rank(), _n(), 1 - _rank()
        x = torch.ones(3)
        env = {"p2p": p2p, "torch": torch, "x": x, "me": me, "n": n, "other": other}
        for code, exc, match in BAD_CALLS:
            with pytest.raises(exc, match=match):
                eval(code, env)
        # nobody was left waiting on a half-started exchange: a real one completes at once
        return int(p2p.shift(torch.tensor([me])).item())

    assert world2.run(bad_calls) == [1, 0]


# ======================================================================================
# sendrecv / ppermute / shift: values, adjoint, transforms
# ======================================================================================


def _apply(op: str, x: torch.Tensor) -> torch.Tensor:
    me, n = _rank(), _n()
    if op == "shift":
        return p2p.shift(x, 1)
    if op == "shift-2":
        return p2p.shift(x, -2)
    if op == "sendrecv":  # a ring the other way
        return p2p.sendrecv(x, dst=(me - 1) % n, src=(me + 1) % n)
    if op == "ppermute":  # a full permutation
        return p2p.ppermute(x, [(r, (2 * r + 1) % n) for r in range(n)] if n % 2 else _full_perm(n))
    if op == "ppermute-partial":  # ranks 1.. receive nothing / send nothing
        return p2p.ppermute(x, [(0, n - 1)] if n == 2 else [(0, n - 1), (n - 1, 1)])
    raise AssertionError(op)


def _full_perm(n: int) -> list[tuple[int, int]]:
    return [(r, (r + 1) % n) for r in range(n)][::-1]


def test_values_of_shift_sendrecv_ppermute(world3: dc.LocalWorld) -> None:
    def values() -> list[torch.Tensor]:
        me = _rank()
        x = torch.tensor([float(me)])
        return [_apply(op, x) for op in ("shift", "shift-2", "sendrecv", "ppermute-partial")]

    out = [[float(t) for t in r] for r in world3.run(values)]
    # rank r: shift(1) from r-1, shift(-2) from r+2, ring from r+1, partial: 2<-0, 1<-2
    assert out == [[2.0, 2.0, 1.0, 0.0], [0.0, 0.0, 2.0, 2.0], [1.0, 1.0, 0.0, 0.0]]


# on processes: what is pinned down is what the transport reads from the tensor's memory
@pytest.mark.diffcomm_in_process(False)
def test_a_conjugate_view_travels_as_its_value_and_gradient(world3: dc.LocalWorld) -> None:
    # ``z.conj()`` keeps its lazy bit through contiguous(): the exchange raised
    # view_as_real's error instead of sending it, forward and (for a loss that reads
    # ``y.conj()``) backward.
    def conjugate_views() -> list[str]:
        me = _rank()
        g = torch.Generator().manual_seed(me)
        bad = []
        for op in ("shift", "shift-2", "sendrecv", "ppermute", "ppermute-partial"):
            z = torch.randn(2, 3, generator=g, dtype=torch.complex128)
            if not torch.equal(_apply(op, z.conj()), _apply(op, z.conj().resolve_conj())):
                bad.append(f"{op}: value")
            x1, x2 = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
            c = torch.randn(2, 3, generator=g, dtype=torch.complex128)
            (_apply(op, x1).conj() * c).real.sum().backward()
            (_apply(op, x2) * c.conj()).real.sum().backward()
            if not torch.allclose(x1.grad, x2.grad):
                bad.append(f"{op}: gradient")
        return bad

    assert world3.run(conjugate_views) == [[], [], []]


# shared rank body of the two dot-product adjoint tests below (real: every op and world; complex)
def _adjoint_rank_body(op: str, dtype: torch.dtype) -> tuple[float, float]:
    me = _rank()
    g = torch.Generator().manual_seed(1000 + me)
    x = torch.randn(2, 3, generator=g, dtype=dtype).requires_grad_()
    y = torch.randn(2, 3, generator=g, dtype=dtype)
    out = _apply(op, x)
    (out * y.conj()).real.sum().backward() if dtype.is_complex else (out * y).sum().backward()
    lhs = torch.vdot(y.flatten(), out.detach().flatten())
    rhs = torch.vdot(x.grad.flatten(), x.detach().flatten())
    return _sum_over_ranks(float(lhs.real)), _sum_over_ranks(float(rhs.real))


@pytest.mark.parametrize("op", ["shift", "shift-2", "sendrecv", "ppermute", "ppermute-partial"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_dot_product_adjoint(local_worlds: Callable[[int], dc.LocalWorld], op: str, n: int) -> None:
    for lhs, rhs in local_worlds(n).run(_adjoint_rank_body, op, torch.float64):
        assert lhs == pytest.approx(rhs, rel=1e-12, abs=1e-12)


def test_dot_product_adjoint_complex(world3: dc.LocalWorld) -> None:
    for lhs, rhs in world3.run(_adjoint_rank_body, "ppermute", torch.complex128):
        assert lhs == pytest.approx(rhs, rel=1e-12)


def test_dot_product_adjoint_send_recv(world2: dc.LocalWorld) -> None:
    def adjoint_send_recv() -> tuple[float, float]:
        g = torch.Generator().manual_seed(7 + _rank())
        x = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True)
        y = torch.randn(4, generator=g, dtype=torch.float64)
        if _rank() == 0:  # op: x_0 -> out_1 (out_0 = 0)
            p2p.send(x, 1).backward()
            lhs, rhs = 0.0, float(x.grad @ x.detach())
        else:
            out = p2p.recv(0)
            (out * y).sum().backward()
            lhs, rhs = float(out.detach() @ y), 0.0
        return _sum_over_ranks(lhs), _sum_over_ranks(rhs)

    for lhs, rhs in world2.run(adjoint_send_recv):
        assert lhs == pytest.approx(rhs, rel=1e-12)


def test_a_complex_send_token_backward_pulls_the_gradient(world2: dc.LocalWorld) -> None:
    # the token was complex for a complex x, and ``token.backward()`` (the contract's
    # recipe) raised torch's "grad can be implicitly created only for real scalar outputs"
    def complex_send() -> tuple[float, float]:
        g = torch.Generator().manual_seed(7 + _rank())
        x = torch.randn(4, generator=g, dtype=torch.complex128, requires_grad=True)
        y = torch.randn(4, generator=g, dtype=torch.complex128)
        if _rank() == 0:
            token = p2p.send(x, 1)
            assert token.dtype == torch.float64 and token.requires_grad
            token.backward()
            lhs, rhs = 0.0, float(torch.vdot(x.grad, x.detach()).real)
        else:
            out = p2p.recv(0)
            (out * y.conj()).real.sum().backward()
            lhs, rhs = float(torch.vdot(y, out.detach()).real), 0.0
        return _sum_over_ranks(lhs), _sum_over_ranks(rhs)

    for lhs, rhs in world2.run(complex_send):
        assert lhs == pytest.approx(rhs, rel=1e-12)


def test_sendrecv_with_a_different_received_shape(world2: dc.LocalWorld) -> None:
    def sendrecv_other_shape() -> list[float]:
        me = _rank()
        mine = torch.arange(6.0 if me == 0 else 4.0, dtype=torch.float64).requires_grad_()
        theirs = (4,) if me == 0 else (6,)
        got = p2p.sendrecv(mine * (me + 1), dst=1 - me, src=1 - me, shape=theirs)
        assert got.shape == theirs
        (got * got).sum().backward()
        # d/dmine of the other rank's sum((mine*(me+1))^2) = 2 (me+1)^2 mine
        torch.testing.assert_close(mine.grad, 2 * (me + 1) ** 2 * mine.detach())
        # vmap: the batch size goes in front of the received shape (one exchange), and the
        # backward sends back a batch of x's shape
        batch = torch.stack([mine.detach() * (k + 1) for k in range(3)])
        with B.log_comms() as log:
            got_b, pull = torch.func.vjp(
                torch.func.vmap(lambda v: p2p.sendrecv(v, 1 - me, 1 - me, shape=theirs)), batch
            )
        # one exchange (debug mode adds its own header exchange before it)
        assert sum("debug" not in (r.label or "") for r in log.records if r.op == "batch_p2p") == 1
        torch.testing.assert_close(got_b, torch.stack([got.detach() / (2 - me) * (k + 1) for k in range(3)]))
        (g,) = pull(got_b)
        torch.testing.assert_close(g, batch)  # the exchange there and back is the identity
        return got.tolist()

    a, b = world2.run(sendrecv_other_shape)
    assert a == [0.0, 2.0, 4.0, 6.0] and b == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


@pytest.mark.parametrize("op", ["shift", "sendrecv", "ppermute", "ppermute-partial"])
# on processes: forward-mode AD: one stack of dual levels per process (docs/in_process.md, Limits)
@pytest.mark.diffcomm_in_process(False)
@pytest.mark.usefixtures("debug_off")
def test_torch_func_grad_vjp_jvp_vmap(world3: dc.LocalWorld, op: str) -> None:
    def torch_func(op: str) -> int:
        me = _rank()
        g = torch.Generator().manual_seed(50 + me)
        x = torch.randn(3, 2, generator=g, dtype=torch.float64)
        c = torch.randn(3, 2, generator=g, dtype=torch.float64)
        t = torch.randn(3, 2, generator=g, dtype=torch.float64)

        def f(v: torch.Tensor) -> torch.Tensor:
            return _apply(op, v)

        # reference: eager autograd
        xr = x.clone().requires_grad_()
        (f(xr) * c).sum().backward()
        ref_grad = xr.grad
        # grad / vjp
        torch.testing.assert_close(torch.func.grad(lambda v: (f(v) * c).sum())(x), ref_grad)
        out, vjp_fn = torch.func.vjp(f, x)
        torch.testing.assert_close(vjp_fn(c)[0], ref_grad)
        torch.testing.assert_close(out, f(x))
        # jvp (forward mode): a linear op maps the tangent like the primal
        p, tan = torch.func.jvp(f, (x,), (t,))
        torch.testing.assert_close(p, f(x))
        torch.testing.assert_close(tan, f(t))
        with torch.autograd.forward_ad.dual_level():
            d = torch.autograd.forward_ad.make_dual(x, t)
            torch.testing.assert_close(torch.autograd.forward_ad.unpack_dual(f(d)).tangent, f(t))
        # vmap: equals a loop, and one exchange for the whole batch (in_dims 0 and 1)
        xs = torch.randn(4, 3, 2, generator=g, dtype=torch.float64)
        loop = torch.stack([f(xs[i]) for i in range(4)])
        with B.log_comms() as log:
            batched = torch.func.vmap(f)(xs)
        torch.testing.assert_close(batched, loop)
        calls = log.count("batch_p2p")
        torch.testing.assert_close(
            torch.func.vmap(f, in_dims=1, out_dims=1)(xs.movedim(0, 1)), loop.movedim(0, 1)
        )
        # nested vmap
        xss = torch.randn(2, 4, 3, 2, generator=g, dtype=torch.float64)
        nested = torch.func.vmap(torch.func.vmap(f))(xss)
        torch.testing.assert_close(nested, torch.stack([torch.stack([f(v) for v in row]) for row in xss]))
        # vmap of grad (per-example gradients)
        pe = torch.func.vmap(torch.func.grad(lambda v: (f(v) * c).sum()))(xs)
        torch.testing.assert_close(pe, ref_grad.expand(4, 3, 2))
        return calls

    calls = world3.run(torch_func, op)
    # one exchange for the whole batch (a rank with only a self pair exchanges nothing)
    assert max(calls) == 1, calls


@pytest.mark.parametrize("op", ["shift", "sendrecv", "ppermute"])
# on processes: forward-mode AD: one stack of dual levels per process (docs/in_process.md, Limits)
@pytest.mark.diffcomm_in_process(False)
def test_jacrev_equals_jacfwd(world3: dc.LocalWorld, op: str) -> None:
    def jacobians(op: str) -> None:
        x = torch.randn(4, dtype=torch.float64)

        def f(v: torch.Tensor) -> torch.Tensor:
            return _apply(op, v)

        jr = torch.func.jacrev(f)(x)
        jf = torch.func.jacfwd(f)(x)
        # every rank sends and receives: the per-rank Jacobian of a permutation is I
        torch.testing.assert_close(jr, torch.eye(4, dtype=torch.float64))
        torch.testing.assert_close(jf, jr)

    world3.run(jacobians, op)


@pytest.mark.parametrize("op", ["shift", "ppermute"])
def test_double_backward(world3: dc.LocalWorld, op: str) -> None:
    def double_backward(op: str) -> None:
        me, n = _rank(), _n()

        def rand(seed: int) -> torch.Tensor:
            return torch.randn(3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)

        x = rand(10 + me).requires_grad_()
        w = [rand(20 + r) for r in range(n)]
        v = rand(30 + me)
        offset = {"shift": 1, "ppermute": 1}[op]
        y = p2p.shift(x, offset) if op == "shift" else p2p.ppermute(x, [(r, (r + 1) % n) for r in range(n)])
        # F = sum_r <y_r^2, w_r>, y_r = x_{r-1}:  dF/dx_r = 2 x_r w_{r+1}
        (gx,) = torch.autograd.grad((y * y * w[me]).sum(), x, create_graph=True)
        torch.testing.assert_close(gx, 2 * x.detach() * w[(me + 1) % n])
        # H = sum_r <dF/dx_r, v_r>:  dH/dx_r = 2 w_{r+1} v_r (through the backward's shift)
        (gx * v).sum().backward()
        torch.testing.assert_close(x.grad, 2 * w[(me + 1) % n] * v)

    world3.run(double_backward, op)


def test_backward_runs_with_zero_gradient_on_one_rank(world2: dc.LocalWorld) -> None:
    def zero_gradient_still_runs_backward() -> float:
        # rank 1 ignores the value (multiplies by 0): autograd still runs its backward
        x = torch.ones(2, requires_grad=True)
        y = p2p.shift(x)
        (y.sum() * (0.0 if _rank() == 1 else 1.0)).backward()
        return float(x.grad.sum())

    assert world2.run(zero_gradient_still_runs_backward) == [0.0, 2.0]


# on processes: a cross-rank diagnosis (debug mode, the p2p protocol) needs per-rank state
@pytest.mark.diffcomm_in_process(False)
def test_debug_mode_turns_cross_rank_mismatches_into_errors(world2: dc.LocalWorld) -> None:
    def debug_mismatch() -> None:
        me = _rank()
        x = torch.zeros(2, 3) if me == 0 else torch.zeros(3, 2)
        with dc.debug(True):
            if me == 1:
                match = (
                    r"mismatched sendrecv\(dst=0, src=0\) between ranks 0 -> 1: "
                    r"rank 1 expected shape \(3, 2\)"
                )
            else:
                match = r"mismatched .* between ranks 1 -> 0: rank 0 expected shape \(2, 3\)"
            with pytest.raises(CrossRankMismatchError, match=match):
                p2p.sendrecv(x, 1 - me, 1 - me)
            with pytest.raises(CrossRankMismatchError, match="ppermute"):
                p2p.ppermute(torch.zeros(2), [(0, 1)] if me == 0 else [(1, 0)])
            assert p2p.shift(torch.tensor([float(me)])).item() == 1 - me  # still usable
            # a rank with only a self pair still joins the check (no hang), values are right
            assert p2p.ppermute(torch.tensor([me + 1.0]), [(0, 1), (1, 0)]).item() == 2 - me

    world2.run(debug_mismatch)


# on processes: a cross-rank diagnosis (debug mode, the p2p protocol) needs per-rank state
@pytest.mark.diffcomm_in_process(False)
def test_debug_mode_refuses_a_ring_exchange_that_records_backward_on_some_ranks(
    world2: dc.LocalWorld,
) -> None:
    """Rank 0's x requires grad, rank 1's not: rank 1 runs no backward, so rank 0's backward
    exchange met rank 1's next exchange, a metric: rank 0's gradient was that metric (42),
    in debug mode too (sendrecv; shift and ppermute timed out after 30 s, blaming a skipped
    backward). Debug mode compares the flag at the call, as for the collectives."""

    def frozen_on_one_rank() -> list[str]:
        me = _rank()
        x = torch.full((3,), 1.0 + me, requires_grad=me == 0)
        calls = {
            "sendrecv": lambda t: p2p.sendrecv(t, 1 - me, 1 - me),
            "shift": lambda t: p2p.shift(t),
            "ppermute": lambda t: p2p.ppermute(t, [(0, 1), (1, 0)]),
        }
        got = []
        with dc.debug(True):
            for name, call in calls.items():
                try:
                    y = call(x)
                    if me == 0:
                        y.sum().backward()
                    else:
                        call(torch.full((3,), 42.0))
                    got.append(f"{name}: no error, x.grad {x.grad}")
                except CrossRankMismatchError as err:
                    got.append(str(err))
            with torch.no_grad():  # no rank records a backward: nothing to refuse
                got.append(str(p2p.shift(x).tolist()))
        return got

    for me, got in enumerate(world2.run(frozen_on_one_rank)):
        for name, text in zip(("sendrecv", "shift", "ppermute"), got):
            assert text.startswith(f"diffcomm.{name}") and "records the op for backward" in text, (me, text)
        assert got[3] == str([2.0 - me] * 3)


# on processes: a cross-rank diagnosis (debug mode, the p2p protocol) needs per-rank state
@pytest.mark.diffcomm_in_process(False)
def test_debug_mode_with_a_self_pair(world3: dc.LocalWorld) -> None:
    def debug_self_pair() -> list[float]:
        me = _rank()
        with dc.debug(True):
            out = p2p.ppermute(torch.tensor([me + 1.0]), [(0, 1), (1, 0), (2, 2)])
        return out.tolist()

    assert world3.run(debug_self_pair) == [[2.0], [1.0], [3.0]]


def test_group_local_ranks(world4: dc.LocalWorld) -> None:
    def subgroup() -> list[float]:
        group = dist.new_group([1, 2, 3])
        if _rank() == 0:
            return []
        local = dist.get_rank(group)
        x = torch.tensor([float(_rank())], requires_grad=True)
        y = p2p.shift(x, 1, group=group)  # group-local: rank 1 receives from group rank 0
        y.sum().backward()
        if local == 0:
            p2p.send(torch.tensor([5.0]), dst=2, group=group)
        if local == 2:
            assert p2p.recv(src=0, group=group).item() == 5.0
        p2p.wait_sends()
        return [float(y), float(x.grad)]

    assert world4.run(subgroup) == [[], [3.0, 1.0], [1.0, 1.0], [2.0, 1.0]]


def test_identity_shift_integer_dtypes_and_empty_tensors(world2: dc.LocalWorld) -> None:
    def identity_shift_and_integers() -> None:
        x = torch.arange(3)
        assert torch.equal(p2p.shift(x, _n()), x)  # a multiple of n: a local copy
        assert torch.equal(p2p.shift(x * (_rank() + 1), 1), x * (1 - _rank() + 1))  # integer dtype
        assert p2p.shift(torch.zeros(0, 2), 1).shape == (0, 2)

    world2.run(identity_shift_and_integers)


def test_dual_table() -> None:
    from diffcomm.ops import registry as R

    assert set(R.family("p2p", ())) == {"send", "recv", "sendrecv", "ppermute", "shift"}
    for op, adj in p2p.DUALS.items():
        assert p2p.DUALS[adj] == op
        assert callable(p2p.OPS[op].fn)


# ======================================================================================
# posted receives: irecv and post_grad_recv
# ======================================================================================


def test_irecv_wait_equals_recv_and_post_grad_recv_feeds_the_token(world2: dc.LocalWorld) -> None:
    def irecv_equals_recv() -> list[Any]:
        if _rank() == 0:
            x = torch.arange(6.0, dtype=torch.float64).reshape(2, 3).requires_grad_()
            tokens = [dc.send(x * (k + 1), dst=1, tag=3) for k in range(3)]
            tokens.append(dc.send(torch.tensor([7, 8]), dst=1, tag=3))  # integers: no gradient
            assert p2p.post_grad_recv(tokens[0]) and p2p.post_grad_recv(tokens[2])
            assert not p2p.post_grad_recv(tokens[0])  # already posted
            assert not p2p.post_grad_recv(tokens[3])  # no gradient will come
            sum(tokens[:3]).backward()
            return [x.grad]
        h0 = p2p.irecv(0, tag=3)  # header only: the shape is not known yet
        # its data would be matched to any other receive on the channel: refused, not garbled
        for post in (
            lambda: p2p.irecv(0, shape=(2, 3), dtype=torch.float64, tag=3),
            lambda: dc.recv(0, tag=3),
        ):
            with pytest.raises(ValueError, match=r"`src/tag` must be a channel without a pending irecv"):
                post()
        y0 = h0.wait()
        h1 = p2p.irecv(0, shape=(2, 3), dtype=torch.float64, tag=3)  # header and data
        h2 = p2p.irecv(0, like=y0, tag=3)
        h3 = p2p.irecv(0, tag=3)
        ys = [y0, h1.wait(), h2.wait()]
        ints = h3.wait()
        with pytest.raises(RuntimeError, match="called twice"):
            h1.wait()
        assert all(y.requires_grad for y in ys) and not ints.requires_grad
        (ys[0].sum() + (ys[1] * ys[1]).sum() + 0 * ys[2].sum()).backward()
        return [torch.stack([y.detach() for y in ys]), ints]

    (g,), (ys, ints) = world2.run(irecv_equals_recv)
    x = torch.arange(6.0, dtype=torch.float64).reshape(2, 3)
    torch.testing.assert_close(ys, torch.stack([x, 2 * x, 3 * x]))
    assert ints.tolist() == [7, 8]
    # d/dx [sum(x) + sum((2x)^2) + 0] = 1 + 2 * (2x) * 2
    torch.testing.assert_close(g, 1 + 8 * x)


# on processes: a cross-rank diagnosis (debug mode, the p2p protocol) needs per-rank state
@pytest.mark.diffcomm_in_process(False)
def test_irecv_checks_the_expected_shape_and_keeps_the_channel_clean(world2: dc.LocalWorld) -> None:
    def irecv_mismatch() -> float:
        if _rank() == 0:
            dc.send(torch.ones(2, 3), dst=1)
            dc.send(torch.full((4,), 2.0), dst=1)
            p2p.wait_sends()
            return 0.0
        expected = r"rank 1 expected shape \(3, 2\), float32, but rank 0 sent shape \(2, 3\)"
        with pytest.raises(CrossRankMismatchError, match=expected):
            p2p.irecv(0, shape=(3, 2), dtype=torch.float32).wait()
        return float(p2p.irecv(0).wait().sum())  # the channel is clean: the next message arrives

    assert world2.run(irecv_mismatch) == [0.0, 8.0]


def test_post_grad_recv_rejects_what_is_not_a_token(world2: dc.LocalWorld) -> None:
    def post_grad_recv_bad_token() -> None:
        with pytest.raises(TypeError, match=r"post_grad_recv\(\): `token` must be a dc.send token, got list"):
            p2p.post_grad_recv([])  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"`token` must be a dc.send token, got MulBackward0"):
            p2p.post_grad_recv(torch.ones(1, requires_grad=True) * 2)

    world2.run(post_grad_recv_bad_token)


# ======================================================================================
# fused messages: header and data in one message (the pipeline runner's activations)
# ======================================================================================


def test_fused_messages_carry_every_dtype_and_shape_and_their_gradient(world2: dc.LocalWorld) -> None:
    def fused_roundtrip() -> None:
        cases = [
            (dt, sh) for dt in (torch.float64, torch.complex128, torch.bool, torch.int8) for sh in SHAPES
        ]
        if _rank() == 0:
            for k, (dtype, shape) in enumerate(cases):
                x = _sample(dtype, shape, k)
                p2p.send_owned(x, 1, tag=5, fused=True)
            x = torch.arange(6.0, dtype=torch.float64).reshape(2, 3).requires_grad_()
            token = p2p.send_owned(x * 2, 1, tag=5, fused=True)
            assert p2p.post_grad_recv(token)
            token.backward()
            torch.testing.assert_close(x.grad, torch.full((2, 3), 3.0, dtype=torch.float64), rtol=0, atol=0)
            p2p.wait_sends()
            return
        for k, (dtype, shape) in enumerate(cases):
            like = torch.empty(shape, dtype=dtype)
            y = p2p.irecv_fused(0, like, tag=5).wait()
            assert y.shape == shape and y.dtype == dtype and not y.requires_grad
            torch.testing.assert_close(y, _sample(dtype, shape, k), rtol=0, atol=0)
        y = p2p.irecv_fused(0, torch.empty(2, 3, dtype=torch.float64), tag=5).wait()
        assert y.requires_grad
        torch.testing.assert_close(y.detach(), 2 * torch.arange(6.0, dtype=torch.float64).reshape(2, 3))
        (y * 1.5).sum().backward()  # back as for recv: d/dx sum(1.5 * 2x) = 3

    world2.run(fused_roundtrip)


# on processes: a cross-rank diagnosis (debug mode, the p2p protocol) needs per-rank state
@pytest.mark.diffcomm_in_process(False)
def test_a_fused_receive_takes_a_plain_send_of_any_shape(world2: dc.LocalWorld) -> None:
    def fused_receive_takes_a_plain_send() -> list[Any]:
        if _rank() == 0:
            p2p.send(torch.full((2, 3), 1.0), 1)  # the agreed shape, sent plainly
            p2p.send(torch.full((5, 4), 2.0), 1)  # larger than the fused buffer: plainly
            p2p.send(torch.full((1,), 3.0, dtype=torch.float64), 1)  # another dtype
            p2p.send_owned(torch.full((1, 3), 4.0), 1, fused=True)  # fused, smaller than expected
            p2p.send_owned(torch.full((2, 3), 5.0), 1, fused=True)
            p2p.wait_sends()
            return []
        like = torch.empty(2, 3)
        got = [p2p.irecv_fused(0, like).wait() for _ in range(3)]
        assert [tuple(g.shape) for g in got] == [(2, 3), (5, 4), (1,)] and got[2].dtype == torch.float64
        # a fused message must have the agreed shape: an error naming both ranks, channel clean
        with pytest.raises(
            CrossRankMismatchError, match=r"rank 1 expected shape \(2, 3\), float32, but rank 0"
        ):
            p2p.irecv_fused(0, like).wait()
        got.append(p2p.irecv_fused(0, like).wait())
        return [float(g.sum()) for g in got]

    assert world2.run(fused_receive_takes_a_plain_send)[1] == [6.0, 40.0, 3.0, 30.0]


# --------------------------------------------------------------------------------------
# the testing kit's reference checker (what `python -m diffcomm check` runs) on every
# point-to-point op, as ring programs, and on every mapping under the replicated objective
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_reference_checker_passes_p2p_and_mapping_cases(local_worlds, world_size: int) -> None:
    from diffcomm.testing.cases import run_case, standard_p2p_cases
    from diffcomm.testing.mappings import run_mapping_case, standard_mapping_cases

    def check_all() -> list[str]:
        n = dc.get_world_size()
        bad = []
        for case in standard_p2p_cases(n):
            res = run_case(case)
            if not res.ok or res.adjoint_err is None:
                bad.append(f"{case.op} {case.label()}: {res.as_dict()}")
        for case in standard_mapping_cases(n):
            res = run_mapping_case(case)
            if not res.ok or res.double_err is None:
                bad.append(f"{case.op} {case.label()}: {res.as_dict()}")
        return bad

    per_rank = local_worlds(world_size).run(check_all)
    assert per_rank == [[]] * world_size, per_rank


# on processes: it patches a module attribute in its rank function (one module per process)
@pytest.mark.diffcomm_in_process(False)
def test_the_mapping_checker_catches_a_wrong_backward(world2: dc.LocalWorld) -> None:
    # the checker is not vacuous: a copy_to_region whose backward forgot the all_reduce
    # (the classic halved-gradient bug) fails its gradient check
    from diffcomm.ops import registry as _registry
    from diffcomm.testing.cases import Case
    from diffcomm.testing.mappings import run_mapping_case

    def check_broken() -> dict[str, Any]:
        module = sys.modules[_registry.REGISTRY["copy_to_region"].__module__]
        real = module.copy_to_region
        module.copy_to_region = lambda x, **kw: x.clone()  # identity backward: wrong
        try:
            return run_mapping_case(Case("copy_to_region", 2, (3,))).as_dict()
        finally:
            module.copy_to_region = real

    for res in world2.run(check_broken):
        assert not res["ok"] and res["grad_err"] > 1e-3  # its gradient is not the dual's


def _extra_send_on_rank_0() -> str:
    if dc.get_rank() == 0:
        dc.send(torch.full((3,), 100.0), dst=1)  # rank 1 never receives it
    return "returned"


def _one_message_from_rank_0() -> object:
    if dc.get_rank() == 0:
        dc.send(torch.full((3,), 1.0), dst=1)
        return "sent"
    return dc.recv(src=0).tolist()


@pytest.mark.waits
def test_a_send_never_received_fails_its_own_run_not_the_next() -> None:
    """Rank 0 sends a message rank 1 never receives and returns: the run returned
    ``["returned", "returned"]`` and rank 1's first receive of the *next* run took the
    stale message (100 where rank 0 sent 1), with no error. A rank now waits for its
    posted sends before it reports: the send fails at the collective timeout, naming it,
    in the run that made it; the next run gets its own message."""
    with dc.LocalWorld(2, collective_timeout=2.0, timeout=60) as world:
        with pytest.raises(dc.RankError) as info:
            world.run(_extra_send_on_rank_0)
        text = str(info.value)
        assert "rank(s) [0] raised" in text and "`send(dst=1, tag=0) header` was never received" in text, text
        assert world.run(_one_message_from_rank_0) == ["sent", [1.0, 1.0, 1.0]]
