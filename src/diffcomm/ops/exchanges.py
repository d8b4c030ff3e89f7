"""``sendrecv``, ``shift`` and ``ppermute``: the symmetric point-to-point ops, one batched
isend/irecv each, self-dual (re-exported by :mod:`diffcomm.ops.p2p`, their public home).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from .. import _config
from .. import backend as B
from .._replication import PARTIAL, SHARES, P, R, Rule, V
from ..backend import args as A
from ..backend.args import PG
from . import wire
from .base import CommOp, call
from .base import apply as _apply
from .registry import SELF, Kwargs
from .send_recv import _eager, _expected, refuse_peers, simulated

# ======================================================================================
# sendrecv / shift / ppermute: one batched exchange each
# ======================================================================================


class _SendRecv(CommOp):
    name = "sendrecv"
    family = "p2p"
    order = 20
    dual = SELF
    shapes = (2, 3)  # the received shape and x's
    forward_text = "x to dst, src's x arrives"
    backward_text = "sendrecv(grad, dst=src, src=dst)"
    spmd = Rule({R: V, V: V}, in_grad=PARTIAL, refuse={P: SHARES})

    @staticmethod
    def run(x: Tensor, dst: int, src: int, out_shape: torch.Size, in_shape: torch.Size, pg: PG) -> Tensor:
        return wire.exchange(x, dst, src, out_shape, pg, B.group_info(pg).rank)

    @staticmethod
    def label(dst: int, src: int, *_: Any) -> str:
        return f"sendrecv(dst={dst}, src={src})"

    @staticmethod
    def transpose(
        g: Tensor, dst: int, src: int, out_shape: torch.Size, in_shape: torch.Size, pg: PG
    ) -> Tensor:
        return call(_SendRecv, g, src, dst, in_shape, out_shape, pg)

    @staticmethod
    def cases(world: int) -> Iterator[Kwargs]:
        # sendrecv(x, dst=r+k, src=r-k): checked as the ring shift by k it is
        if world > 1:
            yield {"shape": (2, 2), "kwargs": {"offset": 1}}


@_eager
def sendrecv(
    x: Tensor,
    dst: int,
    src: int,
    group: A.GroupLike = None,
    *,
    shape: Sequence[int] | None = None,
    like: Tensor | None = None,
) -> Tensor:
    """Send ``x`` to ``dst`` and receive a tensor from ``src``, at once (deadlock-free).

    Both directions are posted together (batched isend/irecv), so any pattern of
    sendrecv calls that pairs up — rings, exchanges, shifts — completes whatever the
    order of ranks. ``dst == src`` is allowed (an exchange with one peer); a rank may
    only name itself as both (a local copy).

    Args:
        x: tensor to send (any dtype; same dtype as what arrives).
        dst: group-local rank to send to.
        src: group-local rank to receive from.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        shape: shape of the received tensor; default ``x.shape``.
        like: a tensor whose shape is that of the received tensor (instead of ``shape``).

    Returns:
        A new tensor of ``shape`` (default ``x.shape``) and ``x.dtype``: ``src``'s ``x``.

    Gradient:
        ``sendrecv(grad, dst=src, src=dst, shape=x.shape)`` — the gradient goes back the
        way the data came. Forward mode: the tangent takes the same route.

    Example::

        def ring():
            r, n = dc.get_rank(), dc.get_world_size()
            return dc.sendrecv(torch.tensor([float(r)]), dst=(r + 1) % n, src=(r - 1) % n)

        with dc.LocalWorld(2) as world:
            world.run(ring)    # [tensor([1.]), tensor([0.])]
    """
    x = A.check_tensor(x, "sendrecv", "x")
    A.check_grad_dtype(x, "sendrecv", "x")
    pg = A.resolve_group(group, "sendrecv")
    refuse_peers("sendrecv")
    info = B.group_info(pg)
    me = info.rank
    dst = A.check_rank(dst, "sendrecv", "dst", info.size)
    src = A.check_rank(src, "sendrecv", "src", info.size)
    if (dst == me) != (src == me):
        raise A.arg_error(
            "sendrecv",
            "dst/src",
            f"both this rank ({me}) (a local copy) or both other ranks",
            f"dst={dst}, src={src}",
        )
    if like is not None and shape is not None:
        raise A.arg_error("sendrecv", "shape/like", "at most one of them", "both")
    out_shape = x.shape if shape is None and like is None else _expected(shape, None, like, "sendrecv")[0]
    assert out_shape is not None
    if dst == me and tuple(out_shape) != tuple(x.shape):
        raise A.arg_error("sendrecv", "shape", f"x.shape {tuple(x.shape)} for a local copy", tuple(out_shape))
    if _config.DEBUG.get():
        wire.check_grads(x, dst, src, torch.Size(out_shape), pg, _SendRecv.label(dst, src))
        with wire.checked_at_call():
            return _apply(_SendRecv, x, dst, src, torch.Size(out_shape), x.shape, pg)
    return _apply(_SendRecv, x, dst, src, torch.Size(out_shape), x.shape, pg)


class _Shift(CommOp):
    name = "shift"
    family = "p2p"
    order = 30
    dual = SELF
    elementwise = True  # a rank-wise permutation: the batch dim is just another dim
    forward_text = "x of rank r - offset (mod n)"
    backward_text = "shift(grad, -offset)"
    spmd = Rule({R: V, V: V}, in_grad=PARTIAL, refuse={P: SHARES})

    @staticmethod
    def run(x: Tensor, offset: int, pg: PG) -> Tensor:
        info = B.group_info(pg)
        me, n = info.rank, info.size
        if (every := simulated()) is not None:  # every rank in this program: the pairs
            return every.ppermute(x, [(r, (r + offset) % n) for r in range(n)], pg)
        return wire.exchange(x, (me + offset) % n, (me - offset) % n, x.shape, pg, me)

    @staticmethod
    def label(offset: int, pg: PG) -> str:
        return f"shift({offset})"

    @staticmethod
    def transpose(g: Tensor, offset: int, pg: PG) -> Tensor:
        return call(_Shift, g, -offset, pg)

    @staticmethod
    def reference(xs: list[Tensor], kws: list[Kwargs]) -> list[Tensor]:
        w, k = len(xs), kws[0].get("offset", 1)
        return [xs[(r - k) % w] for r in range(w)]

    @staticmethod
    def dual_args(kw: Kwargs, world: int) -> tuple[Kwargs, float]:
        return {"offset": -kw.get("offset", 1)}, 1.0

    @staticmethod
    def cases(world: int) -> Iterator[Kwargs]:
        if world > 1:
            yield {"shape": (2, 3), "kwargs": {"offset": 1}}
            yield {"shape": (4,), "dtype": "float32", "kwargs": {"offset": -1}}


@_eager
def shift(x: Tensor, offset: int = 1, group: A.GroupLike = None) -> Tensor:
    """Ring shift: rank ``r`` receives ``x`` of rank ``(r - offset) mod n``.

    Args:
        x: tensor of the same shape and dtype on every rank.
        offset: any int (negative shifts the other way; multiples of the group size are
            a local copy).
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.

    Returns:
        A new tensor of ``x.shape``: the ``x`` of rank ``(r - offset) mod n``.

    Gradient:
        ``shift(grad, -offset)``. Forward mode: ``shift(tangent, offset)``.

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: dc.shift(torch.tensor([float(dc.get_rank())])))
            # [tensor([1.]), tensor([0.])]
    """
    x = A.check_tensor(x, "shift", "x")
    A.check_grad_dtype(x, "shift", "x")
    offset = A.check_int(offset, "shift", "offset")
    pg = A.resolve_group(group, "shift")
    n = B.group_info(pg).size
    if offset % n == 0:
        return x.clone()
    if _config.DEBUG.get():
        B.get_backend().check_consistent("shift", {"offset": offset % n}, pg)
        if simulated() is None:  # (every rank in one program: no peers to ask)
            me = B.group_info(pg).rank
            wire.check_grads(x, (me + offset) % n, (me - offset) % n, x.shape, pg, _Shift.label(offset, pg))
            with wire.checked_at_call():
                return _apply(_Shift, x, offset, pg)
    return _apply(_Shift, x, offset, pg)


class _PPermute(CommOp):
    name = "ppermute"
    family = "p2p"
    order = 40
    dual = SELF
    elementwise = True
    forward_text = "x of s for each (s, r) in perm; zeros if none"
    backward_text = "ppermute with the inverse pairs"
    spmd = Rule({R: V, V: V}, in_grad=PARTIAL, refuse={P: SHARES})

    @staticmethod
    def run(x: Tensor, perm: tuple[tuple[int, int], ...], pg: PG) -> Tensor:
        if (every := simulated()) is not None:  # every rank in this program: the pairs
            return every.ppermute(x, perm, pg)
        me = B.group_info(pg).rank
        dst = next((d for s, d in perm if s == me), None)
        src = next((s for s, d in perm if d == me), None)
        return wire.exchange(x, dst, src, x.shape, pg, me)

    @staticmethod
    def transpose(g: Tensor, perm: tuple[tuple[int, int], ...], pg: PG) -> Tensor:
        return call(_PPermute, g, tuple((d, s) for s, d in perm), pg)

    @staticmethod
    def reference(xs: list[Tensor], kws: list[Kwargs]) -> list[Tensor]:
        outs = [torch.zeros_like(x) for x in xs]
        for src, dst in kws[0]["perm"]:
            outs[dst] = xs[src]
        return outs

    @staticmethod
    def dual_args(kw: Kwargs, world: int) -> tuple[Kwargs, float]:
        return {"perm": [(d, s) for s, d in kw["perm"]]}, 1.0

    @staticmethod
    def cases(world: int) -> Iterator[Kwargs]:
        if world > 1:
            yield {"shape": (3,), "kwargs": {"perm": tuple((r, (r + 1) % world) for r in range(world - 1))}}


@_eager
def ppermute(x: Tensor, perm: Sequence[tuple[int, int]], group: A.GroupLike = None) -> Tensor:
    """Collective permutation: rank ``d`` receives rank ``s``'s ``x`` for each ``(s, d)``.

    Every rank passes the same ``perm``. Each rank appears at most once as a source and at
    most once as a destination; a rank that receives nothing gets zeros. One batched
    isend/irecv per call.

    Args:
        x: tensor of the same shape and dtype on every rank.
        perm: list of ``(src, dst)`` pairs of group-local ranks.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.

    Returns:
        A new tensor of ``x.shape``: ``x`` of the rank mapped onto this one, else zeros.

    Gradient:
        ``ppermute(grad, [(d, s) for s, d in perm])`` — the inverse permutation; ranks that
        sent nothing get exact zeros. Forward mode: the tangent is permuted the same way.

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: dc.ppermute(torch.tensor([dc.get_rank() + 1.0]), [(0, 1)]))
            # [tensor([0.]), tensor([1.])]
    """
    x = A.check_tensor(x, "ppermute", "x")
    A.check_grad_dtype(x, "ppermute", "x")
    pg = A.resolve_group(group, "ppermute")
    pairs = _check_perm(perm, B.group_info(pg).size)
    if _config.DEBUG.get():
        B.get_backend().check_consistent(
            "ppermute", {"perm": [v for p in sorted(pairs) for v in p], "n": len(pairs)}, pg
        )
        if simulated() is None:  # (every rank in one program: no peers to ask)
            me = B.group_info(pg).rank
            dst = next((d for s, d in pairs if s == me), None)
            src = next((s for s, d in pairs if d == me), None)
            wire.check_grads(x, dst, src, x.shape, pg, "ppermute")
            with wire.checked_at_call():
                return _apply(_PPermute, x, pairs, pg)
    return _apply(_PPermute, x, pairs, pg)


def _check_perm(perm: Any, world: int) -> tuple[tuple[int, int], ...]:
    if isinstance(perm, dict):
        perm = list(perm.items())
    if not isinstance(perm, Sequence) or isinstance(perm, str):
        raise A.arg_error("ppermute", "perm", "a list of (src, dst) pairs", type(perm).__name__, TypeError)
    pairs: list[tuple[int, int]] = []
    for p in perm:
        if not isinstance(p, Sequence) or isinstance(p, str) or len(p) != 2:
            raise A.arg_error("ppermute", "perm", "a list of (src, dst) pairs", f"entry {p!r}", TypeError)
        s = A.check_rank(p[0], "ppermute", "perm", world)
        d = A.check_rank(p[1], "ppermute", "perm", world)
        pairs.append((s, d))
    srcs, dsts = [s for s, _ in pairs], [d for _, d in pairs]
    for name, seq in (("source", srcs), ("destination", dsts)):
        dup = sorted({r for r in seq if seq.count(r) > 1})
        if dup:
            raise A.arg_error(
                "ppermute", "perm", f"pairs with each {name} at most once", f"{name}s {dup} repeated"
            )
    return tuple(pairs)
