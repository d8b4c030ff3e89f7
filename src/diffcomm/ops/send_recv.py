"""``send`` / ``recv``: the one-sided differentiable pair pipelines need (re-exported by
:mod:`diffcomm.ops.p2p`, their public home, which explains the protocol and its limits),
with the pipeline runner's private entries (``send_owned``, ``irecv_fused``), posted
receives (``irecv``, ``post_grad_recv``) and the validation the point-to-point ops share.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, cast

import torch
from torch import Tensor

from .. import _torch
from .. import backend as B
from .._replication import PARTIAL, SHARES, P, R, Rule, V, spmd_types_checking, spmd_types_paused
from ..backend import args as A
from ..backend.args import PG
from ..backend.local_tensor import PEER_WHY, LocalTensorBackend, refuse
from . import wire
from .base import CommOp, IdentityFunction, batch_first, call
from .base import apply as _apply
from .registry import Kwargs
from .wire import MAX_NDIM, MAX_TAG

_F = TypeVar("_F", bound=Callable[..., Any])
_FUNCTION_ATTRS = torch.autograd.Function.__dict__  # (see _replication.spmd_types_checking)


def _eager(fn: _F) -> _F:
    """Run ``fn`` eagerly inside a ``torch.compile``'d function (a graph break around it).

    Point-to-point messages cannot be traced: PyTorch's functional collectives (what the
    collectives compile to) have no send/recv, and a send's sequence number, header and
    posted buffers are host-side state that dynamo must not replay. Disabled for dynamo,
    the op runs as in eager mode between the compiled graphs — values and gradients as in
    eager; ``fullgraph=True`` reports the break. Costs ~0.1 µs per call in eager mode
    (~1 µs once dynamo is loaded: see :func:`diffcomm._torch.compiler_disable`).
    """
    return cast(_F, _torch.compiler_disable(fn, reason=_COMPILE_BREAK))  # same signature


_COMPILE_BREAK = (
    "diffcomm point-to-point ops (send, recv, irecv, sendrecv, shift, ppermute) run eagerly "
    "inside torch.compile (a graph break: see docs/p2p.md); compile without fullgraph=True, "
    "or compile the code between them"
)


_NO_FORWARD_MODE = (
    "diffcomm.send(): forward-mode AD (torch.func.jvp, forward_ad, jacfwd) through "
    "send/recv is not supported — the receiving rank has no tangent input to carry it. "
    "Use dc.sendrecv, dc.ppermute or dc.shift, which support forward mode on every rank."
)


# ======================================================================================
# send / recv
# ======================================================================================


class _Send(CommOp):
    """Run: post ``x`` to ``dst``; output a 0-dim zero token tied to ``x``'s graph.
    Transpose: receive ``x``'s gradient from ``dst`` (what ``recv``'s transpose sent).
    ``shape``/``dtype``/``device`` are ``x``'s (the gradient's buffer); ``mode``: how
    ``x`` goes on the wire (``_transport.post_send``: ``"copy"`` for :func:`send`,
    ``"owned"`` or ``"fused"`` for :func:`send_owned`)."""

    name = "send"
    family = "p2p"
    order = 10
    wire_transpose = True  # receives what the peer's recv transpose sends
    forward_text = "x travels to dst; a 0-dim token"
    backward_text = "token receives the gradient from dst"
    spmd = Rule({R: R, V: R}, in_grad=PARTIAL, refuse={P: SHARES})

    @staticmethod
    def run(
        x: Tensor,
        dst: int,
        pg: PG,
        tag: int,
        seq: int,
        requires_grad: bool,
        shape: Any,
        dtype: Any,
        device: Any,
        mode: str,
    ) -> Tensor:
        wire.post_send(x, dst, pg, tag, requires_grad, seq, mode)
        # real for a complex x: token.backward() (and a real loss plus the token) needs a
        # real scalar; a complex token raised torch's "grad can be implicitly created only
        # for real scalar outputs" (a complex activation between pipeline stages too)
        return torch.zeros((), dtype=x.real.dtype if x.is_complex() else x.dtype, device=x.device)

    @staticmethod
    def label(dst: int, pg: PG, tag: int, *_: Any) -> str:
        return f"send(dst={dst}, tag={tag})"

    @staticmethod
    def transpose(g: Tensor, *args: Any) -> Tensor:
        dst, pg, tag, seq, _, shape, dtype, device, mode = args  # as for ``run``
        # The token is a local zero: scaling it does not scale the gradient, which is
        # entirely what ``dst`` computed for the received copy of ``x``.
        buf = wire.recv_grad(shape, dtype, device, dst, pg, tag, seq)
        if mode != "copy" and wire.no_grad(buf):  # (the runner's sends: see NoGradient)
            raise NoGradient(f"send(dst={dst}, tag={tag}) #{seq}: the peer's copy got no gradient")
        gx = wire.grad_data(buf, shape, dtype)
        if torch.is_grad_enabled():  # create_graph=True: forbid differentiating through it
            gx = _FirstOrderOnly.apply(gx, torch.zeros((), requires_grad=True))
        return gx

    @staticmethod
    def jvp(ctx: Any, *_: Any) -> Tensor:
        raise NotImplementedError(_NO_FORWARD_MODE)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], x: Tensor, *args: Any) -> tuple[Tensor, None]:
        # one message for the whole batch, batch dim first; the token is not batched. The
        # header's requires_grad is the batch's: the batched tensor's own read False (vmap
        # hides the autograd level outside it), so the receiver's output took no gradient
        # while the token waited for one
        xb = batch_first(x, in_dims[0])
        requires_grad = xb.requires_grad and torch.is_grad_enabled()
        return call(_Send, xb, *args[:4], requires_grad, xb.shape, *args[6:]), None

    @staticmethod
    def cases(world: int) -> Iterator[Kwargs]:
        # checked as a program with recv: send(x, dst=r+1) then recv(src=r-1), the send's
        # token added to the output (the kit checks it as a ring shift)
        if world > 1:
            yield {"op": "send/recv", "shape": (3,), "kwargs": {"offset": 1}}


class _FirstOrderOnly(IdentityFunction):
    """Marks a gradient ``g`` (applied as ``(g, anchor)``) that came through send/recv:
    using it in a second backward is an error (the peer's half of the second-order term
    cannot be reached), never a silent omission. (Not a communication op, so not a
    ``CommOp``: an identity whose backward raises.)"""

    @staticmethod
    def backward(ctx: Any, gg: Tensor) -> tuple[None, None]:
        raise NotImplementedError(
            "diffcomm.send/recv: double backward through send/recv is not supported (the "
            "second-order term lives on the peer, whose backward cannot be reached). Use "
            "dc.sendrecv, dc.ppermute or dc.shift, whose backward is itself differentiable."
        )


@_eager
def send(x: Tensor, dst: int, group: A.GroupLike = None, tag: int = 0) -> Tensor:
    """Send ``x`` to rank ``dst``; return a differentiable token that pulls its gradient back.

    The send is asynchronous: it returns once the data is handed to the backend (a private
    copy is sent, so ``x`` may be modified afterwards). A small header with ``x``'s shape,
    dtype and ``requires_grad`` goes first, so the receiver needs no ``shape``.

    Args:
        x: tensor of any dtype and at most :data:`MAX_NDIM` dims.
        dst: group-local rank to send to (not this rank).
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        tag: int in ``[0, MAX_TAG)`` matching the receiver's ``tag``.

    Returns:
        A 0-dim token of ``x.dtype`` (its real dtype for a complex ``x``) with value 0;
        it requires grad iff ``x`` does.

    Gradient:
        The adjoint of sending is receiving: the token's backward receives ``dst``'s
        gradient of its copy of ``x`` (sent by :func:`recv`'s backward) and continues into
        ``x``'s graph. Call ``token.backward()`` or add the token into the loss; its value
        is 0 and scaling it does not scale the gradient.

    Example::

        def step():
            if dc.get_rank() == 0:
                x = torch.ones(3, requires_grad=True)
                dc.send(x * 2, dst=1).backward()       # x.grad == 2 * rank 1's grad
                return x.grad
            y = dc.recv(src=0)                          # tensor([2., 2., 2.])
            (y * y).sum().backward()                    # sends 2 * y back to rank 0
            return y

        with dc.LocalWorld(2) as world:
            world.run(step)       # [tensor([8., 8., 8.]), tensor([2., 2., 2.], ...)]
    """
    return _send(x, dst, group, tag, "copy")


@_eager
def send_owned(x: Tensor, dst: int, group: A.GroupLike = None, tag: int = 0, fused: bool = False) -> Tensor:
    """:func:`send` without the private copy: ``x`` itself goes on the wire.

    For a caller that owns ``x`` and writes to it (or to any tensor sharing its storage)
    only after :func:`wait_sends` — the pipeline runner, which sends each activation a
    chunk's forward has just made and waits for its sends at the end of every step.
    Saves a copy of ``x`` per message (a 256 KiB activation: ~0.01-0.2 ms, more when the
    copy's fresh pages fault in). Everything else (header, token, gradient) is
    :func:`send`'s; a non-contiguous ``x`` is still copied (into contiguous memory).
    Not exported: the public ``send`` keeps its "reuse ``x`` at once" guarantee.

    ``fused=True``: the header and the data go as one message (one buffer: a copy of
    ``x`` after all, but one message instead of two). Only for a peer that receives it
    with :func:`irecv_fused` expecting exactly ``x``'s shape and dtype: a larger message
    than the peer's posted buffer aborts the process (gloo).
    """
    return _send(x, dst, group, tag, "fused" if fused else "owned")


def _send(x: Tensor, dst: int, group: A.GroupLike, tag: int, mode: str) -> Tensor:
    x = A.check_tensor(x, "send", "x")
    pg = A.resolve_group(group, "send")
    dst = _check_peer(dst, "send", "dst", B.group_info(pg))
    tag = check_tag(tag, "send")
    if x.dtype not in wire.DTYPE_TO_CODE:
        raise A.arg_error(
            "send", "x", f"a tensor of a dtype in {list(wire.DTYPE_TO_CODE)}", x.dtype, TypeError
        )
    if x.ndim > MAX_NDIM:
        raise A.arg_error("send", "x", f"a tensor of at most {MAX_NDIM} dims", f"{x.ndim} dims")
    seq = wire.next_seq(pg, dst, tag, "send")
    if wire.differentiable(x.dtype):
        # through the Function even without requires_grad: a forward-mode dual must reach
        # ``jvp`` (an error, not a silently dropped tangent)
        requires_grad = x.requires_grad and torch.is_grad_enabled()
        return _apply(_Send, x, dst, pg, tag, seq, requires_grad, x.shape, x.dtype, x.device, mode)
    return _Send.forward(x, dst, pg, tag, seq, False, x.shape, x.dtype, x.device, mode)  # no graph


class _Recv(CommOp):
    """Run: receive the data (the header is already read; ``data`` when a posted receive
    already holds it). Transpose: send the gradient to ``src``. ``anchor`` is an empty
    tensor that requires grad, so the output has a ``grad_fn`` although nothing local
    flows into it (its gradient is ``None``)."""

    name = "recv"
    family = "p2p"
    order = 11
    dual = _Send
    wire_transpose = True  # sends to the peer's send transpose
    forward_text = "the tensor src sent"
    backward_text = "the gradient is sent to src"
    spmd = Rule({R: V, V: V})

    @staticmethod
    def run(
        anchor: Tensor | None,
        src: int,
        shape: torch.Size,
        dtype: torch.dtype,
        device: Any,
        pg: PG,
        tag: int,
        seq: int,
        data: Tensor | None,
    ) -> Tensor:
        return wire.recv_data(src, shape, dtype, device, pg, tag) if data is None else data

    @staticmethod
    def label(src: int, shape: Any, dtype: Any, device: Any, pg: PG, tag: int, *_: Any) -> str:
        return f"recv(src={src}, tag={tag})"

    @staticmethod
    def transpose(
        g: Tensor, src: int, shape: Any, dtype: Any, device: Any, pg: PG, tag: int, seq: int, data: Any
    ) -> None:
        # SPMD rule: autograd materialises a zero ``g`` if the output got no gradient, so
        # the sender's token backward always gets its message.
        wire.send_grad(g, src, pg, tag, seq)

    @staticmethod
    def jvp(ctx: Any, *_: Any) -> Tensor:
        raise NotImplementedError(_NO_FORWARD_MODE)


@_eager
def recv(
    src: int,
    shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    like: Tensor | None = None,
    group: A.GroupLike = None,
    tag: int = 0,
    device: torch.device | str | None = None,
) -> Tensor:
    """Receive a tensor sent by :func:`send` on rank ``src``.

    Shape, dtype and ``requires_grad`` travel in a small header, so no argument but
    ``src`` is needed; ``shape``/``dtype``/``like`` given are *checked* against it.

    Args:
        src: group-local rank that sends (not this rank).
        shape: expected shape (checked), or ``None``.
        dtype: expected dtype (checked), or ``None``.
        like: a tensor whose shape and dtype are expected (instead of ``shape``/``dtype``);
            its device is used for the result.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        tag: int in ``[0, MAX_TAG)`` matching the sender's ``tag``.
        device: where the result lives (default: ``like``'s device, else the device the
            group's backend communicates on — CPU for gloo).

    Returns:
        A new tensor of the sender's shape and dtype. It requires grad when the sender's
        tensor did, grad mode is on and the dtype is floating or complex.

    Raises:
        CrossRankMismatchError: the sender's shape/dtype differ from ``shape``/``dtype``/
            ``like`` (the message names both ranks), or the message is not a diffcomm
            send header (a mismatched pairing).

    Gradient:
        The adjoint of receiving is sending: backward sends the output's gradient to
        ``src`` (zeros if the output got none), where the sender's token receives it.
        Run the receiver's backward with ``loss.backward()``: ``torch.autograd.grad(loss,
        inputs)`` prunes this side-effect-only node and leaves ``src`` waiting.

    Example::

        def step():
            if dc.get_rank() == 0:
                return dc.send(torch.arange(6.0).reshape(2, 3), dst=1)
            return dc.recv(src=0, shape=(2, 3))      # shape is optional, and checked

        with dc.LocalWorld(2) as world:
            world.run(step)      # [tensor(0.), tensor([[0., 1., 2.], [3., 4., 5.]])]
    """
    r = _receive(src, shape, dtype, like, group, tag, device, "recv")
    if spmd_types_checking(_FUNCTION_ATTRS):  # metadata, not typed data
        with spmd_types_paused():
            header = wire.receive_header(r)
    else:
        header = wire.receive_header(r)
    return _finish_recv(header, r)


def _receive(
    src: Any, shape: Any, dtype: Any, like: Any, group: A.GroupLike, tag: Any, device: Any, op: str
) -> wire.Receive:
    """Validate :func:`recv` / :func:`irecv`'s arguments (before any communication) and
    number the receive on its channel."""
    pg = A.resolve_group(group, op)
    info = B.group_info(pg)
    src = _check_peer(src, op, "src", info)
    tag = check_tag(tag, op)
    want_shape, want_dtype = _expected(shape, dtype, like, op)
    wire.check_channel(pg, src, tag, op)
    if device is None:
        device = like.device if like is not None else info.device
    return wire.Receive(src, pg, tag, wire.next_seq(pg, src, tag, "recv"), want_shape, want_dtype, device)


def _finish_recv(
    header: Tensor, r: wire.Receive, posted: wire.Posted | None = None, fused: Tensor | None = None
) -> Tensor:
    """The rest of :func:`recv` once the header is in: check it, receive the data (or
    wait for the ``posted`` data receive, or take it from the ``fused`` message whose
    header this is), build the autograd node."""
    if B.is_off("recv"):  # ablation: nothing arrived; keep shapes if we know them
        if r.want_shape is None:
            raise ValueError("diffcomm.recv(): with comm_off('recv') pass `shape` or `like`")
        return torch.zeros(r.want_shape, dtype=r.want_dtype or torch.float32, device=r.device)
    shape, dtype, sent_rg, data = wire.read(header, r, posted, fused)
    args = (r.src, shape, dtype, r.device, r.pg, r.tag, r.seq, data)
    if sent_rg and torch.is_grad_enabled() and wire.differentiable(dtype):
        return _apply(_Recv, torch.empty(0, requires_grad=True), *args)
    data = _Recv.forward(None, *args)  # no graph
    if sent_rg:  # the sender's token waits for a gradient: none will flow here, send zeros
        with B.label(f"recv(src={r.src}, tag={r.tag}) backward"):
            wire.send_grad(torch.zeros_like(data), r.src, r.pg, r.tag, r.seq)
    return data


class RecvHandle:
    """A receive posted by :func:`irecv`: :meth:`wait` returns what :func:`recv` would.

    The header (and, when the expected shape and dtype were given, the data) receives are
    already posted, so the transfer proceeds while this rank computes; ``wait`` blocks only
    for what has not arrived yet. Call ``wait`` exactly once.
    """

    def __init__(self, r: wire.Receive, fused: bool = False) -> None:
        self._message = wire.PostedMessage(r, fused)
        self._done = False

    @_eager
    def wait(self) -> Tensor:
        """Block until the tensor is in; return it (it requires grad as :func:`recv`'s does)."""
        if self._done:
            raise RuntimeError(
                "diffcomm.ops.p2p.RecvHandle.wait(): called twice (it returns the tensor once)"
            )
        self._done = True
        header, posted, fused = self._message.wait()
        return _finish_recv(header, self._message.r, posted, fused)


@_eager
def irecv(
    src: int,
    shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    like: Tensor | None = None,
    group: A.GroupLike = None,
    tag: int = 0,
    device: torch.device | str | None = None,
) -> RecvHandle:
    """Post a :func:`recv` now and finish it later: ``irecv(...).wait() == recv(...)``.

    The receive is posted at once, so the data can travel while this rank computes
    (pipelines post the next micro-batch's receive before computing the current one).
    With ``shape`` and ``dtype`` (or ``like``) the data receive is posted too; otherwise
    only the header is, and ``wait`` receives the data once the header says its size.
    Receives on one channel (group, peer, tag) complete in the order they were posted,
    like the sends they pair with. While a handle posted without a shape is pending, its
    channel takes no other receive (a ``ValueError``: its data would be matched there).

    Args:
        src, shape, dtype, like, group, tag, device: as for :func:`recv`.

    Returns:
        A :class:`RecvHandle`; its ``wait()`` returns the received tensor.

    Gradient:
        As for :func:`recv`: backward sends the output's gradient to ``src``.

    Example::

        def step():
            if dc.get_rank() == 0:
                return dc.send(torch.ones(2), dst=1)
            handle = dc.p2p.irecv(src=0, shape=(2,), dtype=torch.float32)
            # ... compute while the data arrives ...
            return handle.wait()                         # tensor([1., 1.])

        with dc.LocalWorld(2) as world:
            world.run(step)
    """
    return RecvHandle(_receive(src, shape, dtype, like, group, tag, device, "irecv"))


@_eager
def irecv_fused(src: int, like: Tensor, group: A.GroupLike = None, tag: int = 0) -> RecvHandle:
    """:func:`irecv` of a message sent with ``send_owned(..., fused=True)``: one receive,
    posted now, for the header and the data of a tensor of ``like``'s shape and dtype.

    Not exported: the sender may fuse only a message of exactly ``like``'s size (a fused
    message larger than the posted buffer aborts the process; gloo). A plain :func:`send`
    of any shape and dtype is taken too (its data is received after its header), so a
    sender whose tensor does not have the agreed shape sends it plainly.
    """
    return RecvHandle(_receive(src, None, None, like, group, tag, None, "irecv"), fused=True)


@_eager
def post_grad_recv(token: Tensor) -> bool:
    """Post now the receive that ``token``'s backward will wait for (its gradient).

    The gradient of a :func:`send` arrives when its peer runs the matching backward; with
    the receive posted early it can land while this rank computes something else, and
    ``token.backward()`` then only waits for what has not arrived. Nothing else changes.

    Args:
        token: the token a :func:`send` returned.

    Returns:
        ``True`` if a receive was posted; ``False`` when no gradient will come (the token
        does not require grad) or one is already posted.
    """
    if not isinstance(token, Tensor):
        raise A.arg_error("post_grad_recv", "token", "a dc.send token", type(token).__name__, TypeError)
    ctx = token.grad_fn
    if ctx is None:
        return False
    if not isinstance(ctx, getattr(_Send, "_backward_cls")):  # noqa: B009 - torch sets it per Function
        raise A.arg_error("post_grad_recv", "token", "a dc.send token", type(ctx).__name__, TypeError)
    dst, pg, tag, seq, _, shape, dtype, device, _ = ctx.args
    return wire.post_grad(shape, dtype, device, dst, pg, tag, seq)


class NoGradient(Exception):
    """Raised by the backward of a :func:`send_owned` token (the pipeline runner's) whose
    peer answered with :func:`send_no_grad`: before anything else of the backward ran
    (the send's node is the first), so the runner catches it, runs nothing for that
    micro-batch and the parameters before keep ``.grad`` as it was (``None`` stays
    ``None``, as serially). Not exported."""


@_eager
def send_no_grad(node: Any) -> None:
    """Answer the receive whose autograd node is ``node`` (a received tensor's
    ``grad_fn``, taken before anything modified it in place) with "no gradient": its
    output fed nothing that needed one. The sender's token backward raises
    :class:`NoGradient` for a :func:`send_owned` token (a :func:`send` token takes the
    zeros that come with it). The pipeline runner's private entry; not exported."""
    if not isinstance(node, getattr(_Recv, "_backward_cls")):  # noqa: B009
        raise A.arg_error(
            "send_no_grad", "node", "a dc.recv output's grad_fn", type(node).__name__, TypeError
        )
    src, shape, dtype, device, pg, tag, seq, _ = node.args
    with B.label(f"recv(src={src}, tag={tag}) backward"):
        wire.send_no_grad(src, shape, dtype, device, pg, tag, seq)


def is_send_node(node: Any) -> bool:
    """Whether the autograd ``node`` is the backward of a :func:`send` (its token's)."""
    return isinstance(node, getattr(_Send, "_backward_cls"))  # noqa: B009


# ======================================================================================
# validation
# ======================================================================================


def simulated() -> LocalTensorBackend | None:
    """The backend, when it runs every rank in this one program (torch's
    ``LocalTensorMode``, where a peer computed from this rank is rank 0's); else ``None``."""
    be = B.get_backend()
    return be if isinstance(be, LocalTensorBackend) else None


def refuse_peers(op: str) -> None:
    """Under torch's ``LocalTensorMode``: refuse ``op``, whose peers are per-rank ints."""
    if simulated() is not None:
        raise refuse(op, PEER_WHY)


def _check_peer(peer: Any, op: str, arg: str, info: B.GroupInfo) -> int:
    refuse_peers(op)
    peer = A.check_rank(peer, op, arg, info.size)
    if peer == info.rank:
        raise A.arg_error(op, arg, f"a group-local rank other than this rank ({info.rank})", peer)
    return peer


def check_tag(tag: Any, op: str) -> int:
    """``tag`` validated for ``op`` (a p2p op, or the pipeline runner): an int in
    ``[0, MAX_TAG)``; raises ``TypeError`` / ``ValueError`` naming ``op``."""
    tag = A.check_int(tag, op, "tag")
    if not 0 <= tag < MAX_TAG:
        raise A.arg_error(op, "tag", f"an int in [0, {MAX_TAG})", tag)
    return tag


def _expected(shape: Any, dtype: Any, like: Any, op: str) -> tuple[torch.Size | None, torch.dtype | None]:
    if like is not None:
        like = A.check_tensor(like, op, "like")
        if shape is not None or dtype is not None:
            raise A.arg_error(op, "like", "given alone (not with `shape`/`dtype`)", "both")
        return like.shape, like.dtype
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise A.arg_error(op, "dtype", "a torch.dtype or None", type(dtype).__name__, TypeError)
    if shape is None:
        return None, dtype
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    if not isinstance(shape, Sequence) or isinstance(shape, str):
        raise A.arg_error(op, "shape", "a sequence of ints", type(shape).__name__, TypeError)
    dims = [A.check_int(s, op, "shape") for s in shape]
    if any(d < 0 for d in dims):
        raise A.arg_error(op, "shape", "non-negative sizes", tuple(dims))
    if len(dims) > MAX_NDIM:
        raise A.arg_error(op, "shape", f"at most {MAX_NDIM} dims", len(dims))
    return torch.Size(dims), dtype
