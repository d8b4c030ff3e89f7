"""Differentiable point-to-point communication: send/recv, sendrecv, ppermute, shift.

Gradient convention: as for the collectives, the objective is the **sum of the per-rank
objectives**. Every op here is a linear map on the concatenation of all ranks' tensors
(a permutation of blocks, with zeros where nothing arrives), so its backward is the
transpose — the same communication run in the opposite direction:

* ``send`` / ``recv``: ``x`` travels from the sender to ``dst`` (the sender gets a 0-dim
  token); backward: ``recv``'s backward sends the gradient to ``src``, where the token's
  backward receives it.
* ``sendrecv(x, dst, src)``: backward ``sendrecv(grad, dst=src, src=dst)``.
* ``ppermute(x, perm)``: rank ``r`` receives from ``s`` where ``(s, r)`` is in ``perm``
  (zeros if none); backward ``ppermute(grad, inverse pairs)``.
* ``shift(x, offset)``: rank ``r`` receives from ``r - offset`` (mod n); backward
  ``shift(grad, -offset)``.

The symmetric ops (``sendrecv``, ``ppermute``, ``shift``) run as **one** batched
isend/irecv (deadlock-free whatever the order of ranks), and their backward and forward-
mode rules call the public ops, so double backward, ``torch.func.grad/vjp/jvp/vmap``,
``jacrev`` and ``jacfwd`` all work.

``send``/``recv`` are the one-sided pair pipelines need. Three design points:

* **Sends are asynchronous.** c10d's blocking send is a rendezvous (it returns only once
  the peer has posted the matching receive), so two neighbours that both "send, then
  receive" — which is exactly what a 1F1B pipeline does in its steady state — deadlock.
  :func:`send` therefore posts an ``isend`` of a private copy of ``x`` and returns at once;
  a waiter thread completes posted sends in the background and releases their buffers.
  :func:`wait_sends` blocks until every posted send is done (and re-raises a failed one).
  Receives block. Together this makes every schedule whose data dependencies are acyclic
  deadlock-free.
* **Metadata travels with the data.** Every send first sends a small ``int64`` header
  (magic, dtype code, ndim, requires-grad flag, sequence number, shape); ``recv`` reads
  it, so it needs no
  ``shape`` (no pickle on the wire), and when ``shape``/``dtype``/``like`` *are* given a
  mismatch is a :class:`~diffcomm.CrossRankMismatchError` naming both ranks, never a
  silent wrong result. The receiver drains the data before raising, so the channel stays
  clean. Gradients going back need no header (both sides know the shape).
* **requires_grad travels too.** ``recv`` returns a tensor that requires grad exactly when
  the sent tensor did (and its dtype is floating or complex), so the sender's token and
  the receiver's output always agree on whether a gradient will flow back — a pipeline
  boundary never loses or invents ``requires_grad``.

Limits (documented in ``docs/p2p.md``): ``recv``'s backward is a side effect that no
local gradient needs, so run the receiver's backward with ``loss.backward()`` /
``torch.autograd.backward`` (``torch.autograd.grad(loss, inputs)`` and ``torch.func``
prune it and leave the sender waiting); double backward and forward mode through
``send``/``recv`` raise ``NotImplementedError`` — use ``sendrecv``/``ppermute``/``shift``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from . import _args as A
from . import _config, _flight
from . import backend as B
from ._errors import CollectiveTimeoutError, CrossRankMismatchError, DiffcommError
from ._registry import OpSpec, markdown, register

__all__ = [
    "send",
    "recv",
    "irecv",
    "RecvHandle",
    "post_grad_recv",
    "sendrecv",
    "ppermute",
    "shift",
    "wait_sends",
    "OPS",
    "DUALS",
    "MAX_TAG",
    "MAX_NDIM",
]

PG = Any  # resolved ProcessGroup (or None for the default group)

#: User tags are in ``[0, MAX_TAG)``. The batched ops use tag ``MAX_TAG``; the gradient of
#: the k-th message on a channel (group, peer, tag) travels on its own tag
#: ``2**30 + tag * 2**12 + k mod 2**12``, so gradients pair with their messages even when
#: the two ranks run their backward nodes in different orders.
MAX_TAG = 1 << 16
_BATCH_TAG = MAX_TAG
_GRAD_TAG_BASE = 1 << 30
_SEQ_WINDOW = 1 << 12

#: Most dims a tensor sent with a metadata header may have.
MAX_NDIM = 12
_MAGIC = 0x64635032  # "dcP2"
_HEADER_LEN = 5 + MAX_NDIM  # magic, dtype code, ndim, requires_grad, sequence number, shape...

_DTYPE_NAMES = (
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "complex64",
    "complex128",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "bool",
    "uint16",
    "uint32",
    "uint64",
    "complex32",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
)
# Codes are fixed by position in the name list (1-based), so they agree across processes
# even where one torch lacks a dtype.
_DTYPE_TO_CODE: dict[torch.dtype, int] = {
    getattr(torch, n): i + 1 for i, n in enumerate(_DTYPE_NAMES) if hasattr(torch, n)
}
_CODE_TO_DTYPE: dict[int, torch.dtype] = {c: d for d, c in _DTYPE_TO_CODE.items()}


def _b() -> B.Backend:
    return B.get_backend()


def _rank(pg: PG) -> int:
    return _b().rank(pg)


def _world(pg: PG) -> int:
    return _b().world_size(pg)


def _differentiable(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def _batched(x: Tensor, bdim: int | None) -> Tensor:
    return x if bdim is None or bdim == 0 else x.movedim(bdim, 0)


# ======================================================================================
# asynchronous sends
# ======================================================================================


class _SendQueue:
    """Posted sends (c10d ``Work`` + the buffers they read), completed by a waiter thread.

    Why a thread: gloo's send ``Work`` reports ``is_completed() == False`` until someone
    calls ``wait()`` on it, so there is no non-blocking way to reap finished sends from the
    main thread; waiting on them in order from a daemon thread frees each buffer as soon
    as its peer has received it, and never blocks the caller.
    """

    def __init__(self) -> None:
        self._q: queue.Queue[tuple[Any, Any, str, Any]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def post(self, work: Any, keep: Any, what: str) -> None:
        if work is None:  # comm-off switch: nothing was posted
            return
        rec = _flight.take_last("send")  # the flight record: queued until the peer has it
        _flight.queued(rec)
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="diffcomm-sends", daemon=True)
                self._thread.start()
        self._q.put((work, keep, what, rec))

    def _run(self) -> None:
        while True:
            work, keep, what, rec = self._q.get()
            try:
                work.wait()
                _flight.end(rec)
            except BaseException as err:  # noqa: BLE001 - re-raised on the caller's thread
                if self._error is None:
                    self._error = _send_error(what, err)
            finally:
                del work, keep, rec
                self._q.task_done()

    def check(self) -> None:
        """Re-raise (once) the first error of a background send."""
        err, self._error = self._error, None
        if err is not None:
            raise err

    def wait_all(self) -> None:
        self._q.join()
        self.check()

    def pending(self) -> int:
        return self._q.unfinished_tasks


def _send_error(what: str, err: BaseException) -> BaseException:
    text = str(err)
    if any(m in text.lower() for m in ("timed out", "timeout", "deadline")):
        return CollectiveTimeoutError(
            f"diffcomm: `{what}` was never received (timed out). The peer must run the "
            f"matching recv — for a gradient, the sender must run the token's backward "
            f"(`token.backward()` or add the token into its loss). Backend error: {text}"
        )
    return DiffcommError(f"diffcomm: `{what}` failed in the background: {text}")


_SENDS = _SendQueue()


def wait_sends() -> None:
    """Block until every send this process posted has been received; re-raise a failure.

    :func:`send` (and the gradient sends of :func:`recv`'s backward) return as soon as the
    data is handed to the backend. Call this before tearing down the process group or
    before timing a step; :class:`~diffcomm.pipeline.PipelineRunner` calls it at the end
    of every step.
    """
    _SENDS.wait_all()


def _isend(buf: Tensor, dst: int, pg: PG, tag: int, what: str) -> None:
    """Post a non-blocking send of the contiguous ``buf`` (kept alive until done).

    Goes through the backend's ``isend`` when it has one, else through the backend's one
    entry point (so the comms logger and comm-off switches see it).
    """
    be = _b()
    native = getattr(be, "isend", None)
    if buf.numel() == 0:  # nothing on the wire (the receiver skips it too)
        return
    if native is not None:
        work = native(buf, dst, pg, tag)
    else:
        wire = torch.view_as_real(buf) if buf.is_complex() else buf
        work = B.dispatch(
            "send",
            pg,
            buf.numel() * buf.element_size(),
            lambda: dist.isend(wire, group_dst=dst, group=pg, tag=tag),
            lambda: None,
            None,
        )
    _SENDS.post(work, buf, what)


def _recv_into(buf: Tensor, src: int, pg: PG, tag: int) -> Tensor:
    _SENDS.check()
    if buf.numel() == 0:  # the sender skipped it too
        return buf
    return _b().recv(buf, src, pg, tag)


class _Posted:
    """A receive into ``buf`` posted ahead (``irecv``); :meth:`wait` completes it.

    Posting is not logged; the wait goes through the backend's one entry point as a
    ``recv`` (so the comms log, comm-off switch, flight recorder and timeout diagnosis
    see it, with the seconds actually spent blocked).
    """

    def __init__(self, buf: Tensor, src: int, pg: PG, tag: int) -> None:
        _SENDS.check()
        self.buf, self.pg = buf, pg
        self.work = None
        if buf.numel() and not B.is_off("recv"):
            self.work = dist.irecv(B.wire(buf), group_src=src, group=pg, tag=tag)

    def wait(self) -> Tensor:
        buf, work = self.buf, self.work
        if buf.numel() == 0:
            return buf
        self.work = None
        B.dispatch(
            "recv", self.pg, buf.numel() * buf.element_size(),
            (lambda: work.wait()) if work is not None else (lambda: buf.zero_()),
            lambda: buf.zero_(), buf,
        )  # fmt: skip
        return buf


# ======================================================================================
# the metadata header
# ======================================================================================


def _encode_header(x: Tensor, requires_grad: bool, seq: int = 0) -> Tensor:
    h = torch.zeros(_HEADER_LEN, dtype=torch.int64)
    h[0], h[1], h[2], h[3], h[4] = _MAGIC, _DTYPE_TO_CODE[x.dtype], x.ndim, int(requires_grad), seq
    if x.ndim:
        h[5 : 5 + x.ndim] = torch.tensor(list(x.shape), dtype=torch.int64)
    return h


def _decode_header(h: Tensor) -> tuple[torch.Size, torch.dtype, bool, int] | None:
    """``(shape, dtype, requires_grad, seq)``, or ``None`` when ``h`` is not a send header."""
    v = h.tolist()
    if v[0] != _MAGIC or v[1] not in _CODE_TO_DTYPE or not 0 <= v[2] <= MAX_NDIM:
        return None
    return torch.Size(v[5 : 5 + v[2]]), _CODE_TO_DTYPE[v[1]], bool(v[3]), v[4]


# Per channel (group, peer, tag, direction): how many messages went through it. Both ends
# count, so the k-th send and the k-th recv agree on k without talking about it.
_SEQ: dict[tuple[Any, int, int, str], int] = {}


def _seq_key(pg: PG, peer: int, tag: int, direction: str) -> tuple[Any, int, int, str]:
    if pg is not None and pg is dist.GroupMember.WORLD:  # the default group, however named
        pg = None
    return (pg, peer, tag, direction)


def _next_seq(pg: PG, peer: int, tag: int, direction: str) -> int:
    key = _seq_key(pg, peer, tag, direction)
    seq = _SEQ.get(key, 0)
    _SEQ[key] = seq + 1
    return seq


def _grad_tag(tag: int, seq: int) -> int:
    return _GRAD_TAG_BASE + tag * _SEQ_WINDOW + seq % _SEQ_WINDOW


def _describe(shape: Sequence[int] | None, dtype: torch.dtype | None) -> str:
    s = "any shape" if shape is None else f"shape {tuple(shape)}"
    d = "any dtype" if dtype is None else str(dtype).replace("torch.", "")
    return f"{s}, {d}"


# ======================================================================================
# send / recv
# ======================================================================================


class _Send(torch.autograd.Function):
    """Forward: post ``x`` to ``dst``; output a 0-dim zero token tied to ``x``'s graph.
    Backward: receive ``x``'s gradient from ``dst`` (what ``recv``'s backward sent)."""

    @staticmethod
    def forward(x: Tensor, dst: int, pg: PG, tag: int, seq: int, requires_grad: bool) -> Tensor:
        _post_send(x, dst, pg, tag, requires_grad, seq)
        return torch.zeros((), dtype=x.dtype, device=x.device)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        x, ctx.dst, ctx.pg, ctx.tag, ctx.seq, _ = inputs
        ctx.shape, ctx.dtype, ctx.device = x.shape, x.dtype, x.device

    @staticmethod
    def backward(ctx: Any, g_token: Tensor) -> tuple[Tensor | None, ...]:
        # The token is a local zero: scaling it does not scale the gradient, which is
        # entirely what ``dst`` computed for the received copy of ``x``.
        posted = getattr(ctx, "posted", None)  # see post_grad_recv
        with B.label(f"send(dst={ctx.dst}, tag={ctx.tag}) backward"):
            if posted is not None:
                ctx.posted = None
                g = posted.wait()
            else:
                buf = torch.empty(ctx.shape, dtype=ctx.dtype, device=ctx.device)
                g = _recv_into(buf, ctx.dst, ctx.pg, _grad_tag(ctx.tag, ctx.seq))
        if torch.is_grad_enabled():  # create_graph=True: forbid differentiating through it
            g = _FirstOrderOnly.apply(g, torch.zeros((), requires_grad=True))
        return g, None, None, None, None, None

    @staticmethod
    def jvp(ctx: Any, *_: Any) -> Tensor:
        raise NotImplementedError(
            "diffcomm.send(): forward-mode AD (torch.func.jvp, forward_ad, jacfwd) through "
            "send/recv is not supported — the receiving rank has no tangent input to carry it. "
            "Use dc.sendrecv, dc.ppermute or dc.shift, which support forward mode on every rank."
        )

    @staticmethod
    def vmap(
        info: Any,
        in_dims: tuple[Any, ...],
        x: Tensor,
        dst: int,
        pg: PG,
        tag: int,
        seq: int,
        requires_grad: bool,
    ) -> tuple[Tensor, None]:
        # one message for the whole batch, batch dim first; the token is not batched
        return _Send.apply(_batched(x, in_dims[0]), dst, pg, tag, seq, requires_grad), None


class _FirstOrderOnly(torch.autograd.Function):
    """Marks a gradient that came through send/recv: using it in a second backward is an
    error (the peer's half of the second-order term cannot be reached), never a silent
    omission."""

    @staticmethod
    def forward(g: Tensor, anchor: Tensor) -> Tensor:
        return g.view_as(g)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, gg: Tensor) -> tuple[None, None]:
        raise NotImplementedError(
            "diffcomm.send/recv: double backward through send/recv is not supported (the "
            "second-order term lives on the peer, whose backward cannot be reached). Use "
            "dc.sendrecv, dc.ppermute or dc.shift, whose backward is itself differentiable."
        )


def _post_send(x: Tensor, dst: int, pg: PG, tag: int, requires_grad: bool, seq: int) -> None:
    _SENDS.check()
    # a private contiguous copy: the send is asynchronous and the caller may reuse ``x``
    buf = x.detach().clone(memory_format=torch.contiguous_format)
    with B.label(f"send(dst={dst}, tag={tag})"):
        header = _encode_header(x, requires_grad, seq).to(_b().comm_device(pg))
        _isend(header, dst, pg, tag, f"send(dst={dst}, tag={tag}) header")
        _isend(buf.reshape(-1).view(torch.uint8), dst, pg, tag, f"send(dst={dst}, tag={tag})")


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
        A 0-dim token of ``x.dtype`` with value 0; it requires grad iff ``x`` does.

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
    x = A.check_tensor(x, "send", "x")
    pg = A.resolve_group(group, "send")
    dst = _check_peer(dst, "send", "dst", pg)
    tag = _check_tag(tag, "send")
    if x.dtype not in _DTYPE_TO_CODE:
        raise A.arg_error("send", "x", f"a tensor of a dtype in {list(_DTYPE_TO_CODE)}", x.dtype, TypeError)
    if x.ndim > MAX_NDIM:
        raise A.arg_error("send", "x", f"a tensor of at most {MAX_NDIM} dims", f"{x.ndim} dims")
    seq = _next_seq(pg, dst, tag, "send")
    if _differentiable(x.dtype):
        # through the Function even without requires_grad: a forward-mode dual must reach
        # ``jvp`` (an error, not a silently dropped tangent)
        requires_grad = x.requires_grad and torch.is_grad_enabled()
        return _Send.apply(x, dst, pg, tag, seq, requires_grad)
    _post_send(x, dst, pg, tag, False, seq)
    return torch.zeros((), dtype=x.dtype, device=x.device)


class _Recv(torch.autograd.Function):
    """Forward: receive the data (header already read). Backward: send the gradient to
    ``src``. ``anchor`` is an empty tensor that requires grad, so the output has a
    ``grad_fn`` although nothing local flows into it."""

    @staticmethod
    def forward(
        anchor: Tensor,
        src: int,
        shape: torch.Size,
        dtype: torch.dtype,
        device: Any,
        pg: PG,
        tag: int,
        seq: int,
        data: Tensor | None = None,
    ) -> Tensor:
        # ``data``: already received by a posted receive (irecv)
        return _recv_data(src, shape, dtype, device, pg, tag) if data is None else data

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.src, ctx.pg, ctx.tag, ctx.seq = inputs[1], inputs[5], inputs[6], inputs[7]

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[None, ...]:
        # SPMD rule: autograd materialises a zero ``g`` if the output got no gradient, so
        # the sender's token backward always gets its message.
        _send_grad(g, ctx.src, ctx.pg, ctx.tag, ctx.seq)
        return (None,) * 9


def _send_grad(g: Tensor, src: int, pg: PG, tag: int, seq: int) -> None:
    with B.label(f"recv(src={src}, tag={tag}) backward"):
        buf = g.detach().clone(memory_format=torch.contiguous_format)
        _isend(buf, src, pg, _grad_tag(tag, seq), f"gradient of recv(src={src}, tag={tag}) #{seq}")


def _recv_data(src: int, shape: torch.Size, dtype: torch.dtype, device: Any, pg: PG, tag: int) -> Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    nbytes = out.numel() * out.element_size()
    raw = torch.empty(nbytes, dtype=torch.uint8, device=device)
    with B.label(f"recv(src={src}, tag={tag})"):
        _recv_into(raw, src, pg, tag)
    return raw.view(dtype).reshape(shape) if nbytes else out


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
    pg = A.resolve_group(group, "recv")
    src = _check_peer(src, "recv", "src", pg)
    tag = _check_tag(tag, "recv")
    want_shape, want_dtype = _expected(shape, dtype, like, "recv")
    if device is None:
        device = like.device if like is not None else _b().comm_device(pg)
    _check_channel(pg, src, tag, "recv")
    seq = _next_seq(pg, src, tag, "recv")
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=_b().comm_device(pg))
    with B.label(f"recv(src={src}, tag={tag}) header"):
        _recv_into(header, src, pg, tag)
    return _finish_recv(header, src, pg, tag, seq, want_shape, want_dtype, device)


def _finish_recv(
    header: Tensor,
    src: int,
    pg: PG,
    tag: int,
    seq: int,
    want_shape: torch.Size | None,
    want_dtype: torch.dtype | None,
    device: Any,
    posted: _Posted | None = None,
) -> Tensor:
    """The rest of :func:`recv` once the header is in: check it, receive the data (or
    wait for the ``posted`` data receive), build the autograd node."""
    me = _rank(pg)
    if B.is_off("recv"):  # ablation: nothing arrived; keep shapes if we know them
        if want_shape is None:
            raise ValueError("diffcomm.recv(): with comm_off('recv') pass `shape` or `like`")
        return torch.zeros(want_shape, dtype=want_dtype or torch.float32, device=device)
    meta = _decode_header(header.cpu())
    if meta is None:
        _SEQ[_seq_key(pg, src, tag, "recv")] = seq  # not a diffcomm message: it used no number
        raise CrossRankMismatchError(
            f"diffcomm.recv(): rank {me} received from rank {src} (tag {tag}) a message that is "
            f"not a diffcomm.send header ({header.tolist()[:4]}...): the send/recv pairing between "
            f"ranks {src} and {me} is mismatched (a raw torch.distributed send, a batched op, or "
            f"the two ranks running different sequences of p2p ops)"
        )
    got_shape, got_dtype, sent_rg, sent_seq = meta
    if sent_seq != seq:
        _drain(posted, src, got_shape, got_dtype, device, pg, tag)
        _SEQ[_seq_key(pg, src, tag, "recv")] = sent_seq + 1  # back in step for what follows
        raise CrossRankMismatchError(
            f"diffcomm.recv(): send/recv between ranks {src} -> {me} (tag {tag}) are out of step: "
            f"this is receive #{seq} on rank {me} but send #{sent_seq} on rank {src} (a rank "
            f"skipped or repeated a send/recv, e.g. after an error)"
        )
    bad = (want_shape is not None and tuple(want_shape) != tuple(got_shape)) or (
        want_dtype is not None and want_dtype != got_dtype
    )
    if bad:
        _drain(posted, src, got_shape, got_dtype, device, pg, tag)  # keep the channel clean
        raise CrossRankMismatchError(
            f"diffcomm.recv(): mismatched send/recv between ranks {src} -> {me} (tag {tag}): "
            f"rank {me} expected {_describe(want_shape, want_dtype)}, but rank {src} sent "
            f"{_describe(got_shape, got_dtype)}"
        )
    data = None
    if posted is not None:
        with B.label(f"recv(src={src}, tag={tag})"):
            raw = posted.wait()
        data = raw.view(got_dtype).reshape(got_shape)
    if sent_rg and torch.is_grad_enabled() and _differentiable(got_dtype):
        anchor = torch.empty(0, requires_grad=True)
        return _Recv.apply(anchor, src, got_shape, got_dtype, device, pg, tag, seq, data)
    if data is None:
        data = _recv_data(src, got_shape, got_dtype, device, pg, tag)
    if sent_rg:  # the sender's token waits for a gradient: none will flow here, send zeros
        _send_grad(torch.zeros_like(data), src, pg, tag, seq)
    return data


def _drain(
    posted: _Posted | None, src: int, shape: torch.Size, dtype: torch.dtype, device: Any, pg: PG, tag: int
) -> None:
    if posted is None:
        _recv_data(src, shape, dtype, device, pg, tag)
    elif posted.buf.numel() == shape.numel() * dtype.itemsize:
        posted.wait()


# Channels with a receive posted header-first (no shape given) whose data receive is not
# posted yet: any other receive on the channel now would be matched to that data.
_HEADER_FIRST: set[tuple[Any, int, int, str]] = set()


def _check_channel(pg: PG, src: int, tag: int, op: str) -> None:
    if _seq_key(pg, src, tag, "recv") in _HEADER_FIRST:
        raise A.arg_error(
            op,
            "src/tag",
            "a channel without a pending irecv posted with no shape (its data would be "
            "matched to this receive): wait for that handle first, or give irecv `shape` "
            "and `dtype` (or `like`)",
            f"src={src}, tag={tag}",
        )


class RecvHandle:
    """A receive posted by :func:`irecv`: :meth:`wait` returns what :func:`recv` would.

    The header (and, when the expected shape and dtype were given, the data) receives are
    already posted, so the transfer proceeds while this rank computes; ``wait`` blocks only
    for what has not arrived yet. Call ``wait`` exactly once.
    """

    def __init__(
        self,
        src: int,
        pg: PG,
        tag: int,
        seq: int,
        want_shape: torch.Size | None,
        want_dtype: torch.dtype | None,
        device: Any,
    ) -> None:
        self._args = (src, pg, tag, seq, want_shape, want_dtype, device)
        header = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=_b().comm_device(pg))
        self._header = _Posted(header, src, pg, tag)
        self._data = None
        if want_shape is not None and want_dtype is not None:
            nbytes = want_shape.numel() * want_dtype.itemsize
            self._data = _Posted(torch.empty(nbytes, dtype=torch.uint8, device=device), src, pg, tag)
        else:
            _HEADER_FIRST.add(_seq_key(pg, src, tag, "recv"))
        self._done = False

    def wait(self) -> Tensor:
        """Block until the tensor is in; return it (it requires grad as :func:`recv`'s does)."""
        if self._done:
            raise RuntimeError("diffcomm.p2p.RecvHandle.wait(): called twice (it returns the tensor once)")
        self._done = True
        src, pg, tag, seq, want_shape, want_dtype, device = self._args
        with B.label(f"recv(src={src}, tag={tag}) header"):
            header = self._header.wait()
        if self._data is None:  # the data receive comes next, blocking: the channel is free after
            _HEADER_FIRST.discard(_seq_key(pg, src, tag, "recv"))
        return _finish_recv(header, src, pg, tag, seq, want_shape, want_dtype, device, self._data)


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
    pg = A.resolve_group(group, "irecv")
    src = _check_peer(src, "irecv", "src", pg)
    tag = _check_tag(tag, "irecv")
    want_shape, want_dtype = _expected(shape, dtype, like, "irecv")
    _check_channel(pg, src, tag, "irecv")
    if device is None:
        device = like.device if like is not None else _b().comm_device(pg)
    seq = _next_seq(pg, src, tag, "recv")
    return RecvHandle(src, pg, tag, seq, want_shape, want_dtype, device)


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
    if getattr(ctx, "posted", None) is not None:
        return False
    buf = torch.empty(ctx.shape, dtype=ctx.dtype, device=ctx.device)
    ctx.posted = _Posted(buf, ctx.dst, ctx.pg, _grad_tag(ctx.tag, ctx.seq))
    return True


# ======================================================================================
# sendrecv / shift
# ======================================================================================


def _exchange(
    x: Tensor, dst: int | None, src: int | None, out_shape: torch.Size, pg: PG, opname: str
) -> Tensor:
    """Send ``x`` to ``dst`` and receive an ``out_shape`` tensor from ``src`` in one batch.

    ``None`` peers are skipped (ppermute ranks that only send or only receive); a peer equal
    to this rank is a local copy. In debug mode the headers are exchanged and checked
    first, and every rank learns (one small all_reduce) whether any rank found a mismatch.
    """
    local = dst == _rank(pg)  # then src is this rank too and out_shape == x.shape (validated)
    if _config.DEBUG.get():  # every rank joins: the check ends in a small all_reduce
        _check_headers(x, None if local else dst, None if local else src, out_shape, pg, opname)
    if local:
        return x.clone(memory_format=torch.contiguous_format)
    x = x.contiguous()
    make = torch.zeros if src is None else torch.empty
    out = make(out_shape, dtype=x.dtype, device=x.device)
    ops: list[tuple[str, Tensor, int, int]] = []
    if dst is not None and x.numel():  # empty tensors: nothing on the wire, on both sides
        ops.append(("send", x, dst, _BATCH_TAG))
    if src is not None and out.numel():
        ops.append(("recv", out, src, _BATCH_TAG))
    _SENDS.check()
    with B.label(opname):
        _b().batch_p2p(ops, pg)
    return out


def _check_headers(
    x: Tensor, dst: int | None, src: int | None, out_shape: torch.Size, pg: PG, opname: str
) -> None:
    dev = _b().comm_device(pg)
    ops: list[tuple[str, Tensor, int, int]] = []
    got = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=dev)
    if dst is not None:
        ops.append(("send", _encode_header(x, False).to(dev), dst, _BATCH_TAG))
    if src is not None:
        ops.append(("recv", got, src, _BATCH_TAG))
    with B.label(f"{opname} debug header"):
        _b().batch_p2p(ops, pg)
    problem = ""
    if src is not None:
        meta = _decode_header(got.cpu())
        if meta is None:
            problem = f"rank {_rank(pg)} got no diffcomm header from rank {src} (mismatched pairing)"
        elif tuple(meta[0]) != tuple(out_shape) or meta[1] != x.dtype:
            problem = (
                f"mismatched {opname} between ranks {src} -> {_rank(pg)}: rank {_rank(pg)} expected "
                f"{_describe(out_shape, x.dtype)}, but rank {src} sent {_describe(meta[0], meta[1])}"
            )
    flag = torch.tensor([1 if problem else 0], dtype=torch.int64, device=dev)
    with B.label(f"{opname} debug check"):
        any_bad = int(_b().all_reduce(flag, "max", pg).item())
    if problem:
        raise CrossRankMismatchError(f"diffcomm.{opname}(): {problem}")
    if any_bad:
        raise CrossRankMismatchError(
            f"diffcomm.{opname}(): another rank of the group found a shape/dtype mismatch "
            f"(its error names the ranks); rank {_rank(pg)} stops too"
        )


class _SendRecv(torch.autograd.Function):
    @staticmethod
    def forward(x: Tensor, dst: int, src: int, shape: torch.Size, pg: PG) -> Tensor:
        return _exchange(x, dst, src, shape, pg, f"sendrecv(dst={dst}, src={src})")

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        x, ctx.dst, ctx.src, ctx.out_shape, ctx.pg = inputs
        ctx.x_shape = x.shape

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None, None, None]:
        with B.label("sendrecv backward"):
            return _SendRecv.apply(g, ctx.src, ctx.dst, ctx.x_shape, ctx.pg), None, None, None, None

    @staticmethod
    def jvp(ctx: Any, t: Tensor, *_: Any) -> Tensor:
        return _SendRecv.apply(t, ctx.dst, ctx.src, ctx.out_shape, ctx.pg)

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[Any, ...], x: Tensor, dst: int, src: int, shape: torch.Size, pg: PG
    ) -> tuple[Tensor, int | None]:
        if in_dims[0] is None:
            return _SendRecv.apply(x, dst, src, shape, pg), None
        xb = _batched(x, in_dims[0])
        return _SendRecv.apply(xb, dst, src, torch.Size((xb.shape[0], *shape)), pg), 0


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
    world, me = _world(pg), _rank(pg)
    dst = A.check_rank(dst, "sendrecv", "dst", world)
    src = A.check_rank(src, "sendrecv", "src", world)
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
    return _SendRecv.apply(x, dst, src, torch.Size(out_shape), pg)


class _Shift(torch.autograd.Function):
    @staticmethod
    def forward(x: Tensor, offset: int, pg: PG) -> Tensor:
        me, n = _rank(pg), _world(pg)
        return _exchange(x, (me + offset) % n, (me - offset) % n, x.shape, pg, f"shift({offset})")

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.offset, ctx.pg = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        with B.label(f"shift({ctx.offset}) backward"):
            return _Shift.apply(g, -ctx.offset, ctx.pg), None, None

    @staticmethod
    def jvp(ctx: Any, t: Tensor, *_: Any) -> Tensor:
        return _Shift.apply(t, ctx.offset, ctx.pg)

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[Any, ...], x: Tensor, offset: int, pg: PG
    ) -> tuple[Tensor, int | None]:
        # rank-wise permutation: the batch dim is just another dim, one exchange
        return _Shift.apply(x, offset, pg), in_dims[0]


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
    if offset % _world(pg) == 0:
        return x.clone()
    if _config.DEBUG.get():
        _b().check_consistent("shift", {"offset": offset % _world(pg)}, pg)
    return _Shift.apply(x, offset, pg)


# ======================================================================================
# ppermute
# ======================================================================================


class _PPermute(torch.autograd.Function):
    @staticmethod
    def forward(x: Tensor, perm: tuple[tuple[int, int], ...], pg: PG) -> Tensor:
        me = _rank(pg)
        dst = next((d for s, d in perm if s == me), None)
        src = next((s for s, d in perm if d == me), None)
        return _exchange(x, dst, src, x.shape, pg, "ppermute")

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.perm, ctx.pg = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        with B.label("ppermute backward"):
            return _PPermute.apply(g, _inverse(ctx.perm), ctx.pg), None, None

    @staticmethod
    def jvp(ctx: Any, t: Tensor, *_: Any) -> Tensor:
        return _PPermute.apply(t, ctx.perm, ctx.pg)

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[Any, ...], x: Tensor, perm: tuple[tuple[int, int], ...], pg: PG
    ) -> tuple[Tensor, int | None]:
        return _PPermute.apply(x, perm, pg), in_dims[0]


def _inverse(perm: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    return tuple((d, s) for s, d in perm)


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
    pairs = _check_perm(perm, _world(pg))
    if _config.DEBUG.get():
        _b().check_consistent(
            "ppermute", {"perm": [v for p in sorted(pairs) for v in p], "n": len(pairs)}, pg
        )
    return _PPermute.apply(x, pairs, pg)


# ======================================================================================
# validation
# ======================================================================================


def _check_peer(peer: Any, op: str, arg: str, pg: PG) -> int:
    world, me = _world(pg), _rank(pg)
    peer = A.check_rank(peer, op, arg, world)
    if peer == me:
        raise A.arg_error(op, arg, f"a group-local rank other than this rank ({me})", peer)
    return peer


def _check_tag(tag: Any, op: str) -> int:
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


# ======================================================================================
# the op -> adjoint table
# ======================================================================================


def _ref_shift(xs: list[Tensor], kws: list[dict[str, Any]]) -> list[Tensor]:
    w, k = len(xs), kws[0].get("offset", 1)
    return [xs[(r - k) % w] for r in range(w)]


def _ref_ppermute(xs: list[Tensor], kws: list[dict[str, Any]]) -> list[Tensor]:
    outs = [torch.zeros_like(x) for x in xs]
    for src, dst in kws[0]["perm"]:
        outs[dst] = xs[src]
    return outs


OPS: dict[str, OpSpec] = register(
    "p2p",
    OpSpec("send", send, "recv", "x travels to dst; a 0-dim token", "token receives the gradient from dst"),
    OpSpec("recv", recv, "send", "the tensor src sent", "the gradient is sent to src"),
    OpSpec(
        "sendrecv",
        sendrecv,
        "sendrecv",
        "x to dst, src's x arrives",
        "sendrecv(grad, dst=src, src=dst)",
    ),
    OpSpec(
        "ppermute",
        ppermute,
        "ppermute",
        "x of s for each (s, r) in perm; zeros if none",
        "ppermute with the inverse pairs",
        lambda kw, w: ({"perm": [(d, s) for s, d in kw["perm"]]}, 1.0),
        _ref_ppermute,
    ),
    OpSpec(
        "shift",
        shift,
        "shift",
        "x of rank r - offset (mod n)",
        "shift(grad, -offset)",
        lambda kw, w: ({"offset": -kw.get("offset", 1)}, 1.0),
        _ref_shift,
    ),
)

#: p2p op name -> name of its adjoint.
DUALS: dict[str, str] = {name: spec.dual for name, spec in OPS.items()}


def p2p_markdown() -> str:
    """The p2p op -> adjoint table as Markdown (the docs include this)."""
    return markdown("p2p")
