"""The point-to-point wire protocol under :mod:`diffcomm.ops.p2p`: tags, headers, sequence
numbers, the send queue and posted receives. No autograd here: :mod:`diffcomm.ops.p2p` builds
its differentiable ops on these raw functions. A message is this module's from header to
data: the receive side is :func:`receive_header` (or a :class:`PostedMessage`), then
:func:`read` (the header checked, the data taken from a fused or posted receive), then
:func:`recv_data` for data not yet in; the ops only validate, number and differentiate.

* **Tags.** User tags are in ``[0, MAX_TAG)``. The batched exchanges (sendrecv, ppermute,
  shift) use tag :data:`BATCH_TAG`; the gradient of the k-th message on a channel
  ``(group, peer, tag)`` travels on its own tag ``2**30 + tag * 2**12 + k mod 2**12``
  (:func:`grad_tag`), so gradients pair with their messages even when the two ranks run
  their backward nodes in different orders.
* **Sequence numbers.** Both ends of a channel count its messages (:func:`next_seq`), so
  the k-th send and the k-th recv agree on k without talking about it; a receive that
  finds another number in the header is an out-of-step error, not a wrong result.
* **Headers.** Every :func:`post_send` first sends a small ``int64`` header (magic, dtype
  code, ndim, requires-grad flag, sequence number, shape): the receiver needs no shape
  (no pickle on the wire) and a mismatch with what it expected is a
  :class:`~diffcomm.CrossRankMismatchError` naming both ranks (:func:`check_header`). The
  receiver drains the data before raising, so the channel stays clean. Gradients going
  back need no header (both sides know the shape): a gradient message is the data and
  one byte after it, ``0`` a gradient, ``1`` none (:func:`send_no_grad`: the pipeline
  runner's received input got no gradient; the data zeros), which the backward of the
  runner's own sends reads (:func:`no_grad`); a plain send's backward takes the data.
* **Fused messages.** Where both ends know, by construction, that the receiver expects
  the shape and dtype of the message (the pipeline runner: every activation after the
  first on its channel in a step, see ``p2p.send_owned``), the header and the data
  travel as one message (``mode="fused"``): the header, padded to
  :data:`FUSED_OFFSET` bytes, then the data. The receiver posts one receive of that size
  (:class:`Posted` of a ``RecvHandle(fused=True)``); the header's own magic number says
  that the data came with it. A receiver that posted a fused receive also takes a plain
  two-message send of any shape (its header fits in the buffer and says so; the data is
  received after it), so a sender whose tensor is not of the agreed shape sends it
  plainly; gloo would abort on a message larger than the posted buffer, which is why a
  sender fuses only a message of the size it is sure of.
* **Sends are asynchronous.** c10d's blocking send is a rendezvous (it returns once the
  peer has posted the matching receive), so two neighbours that both "send, then receive"
  — a 1F1B pipeline's steady state — would deadlock. :func:`isend` posts a non-blocking
  send of a private buffer and hands it to the send queue (:mod:`diffcomm.ops.send_queue`): a
  waiter thread completes posted sends in the background, a batch of them at a time, and
  releases their buffers; :func:`wait_sends` blocks until all are done (and re-raises a
  failed one). Receives block, or are posted ahead (:class:`Posted`).
* **Receive waits are clocked.** :func:`recv_wait_seconds` is the host time this process
  spent blocked in p2p receives (``time.perf_counter`` around each blocking call, no
  device synchronisation): the pipeline runner's per-step ``wait``.
"""

from __future__ import annotations

import contextlib
import contextvars
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _config, _lifecycle
from .. import backend as B
from .._errors import CrossRankMismatchError
from ..backend import args as A
from ..backend.args import PG
from ..backend.in_process import per_rank
from ..diagnostics import recorder as _flight
from .send_queue import SENDS as SENDS
from .send_queue import wait_sends as wait_sends  # re-exported: p2p.wait_sends

# Size: ~660 lines, over the ~600 guideline: the wire protocol of a message (tags, numbers,
# header, fused form, posted receives, the gradient and its "none" byte) in one place.

#: User tags are in ``[0, MAX_TAG)`` (see the module docstring for the others).
MAX_TAG = 1 << 16
BATCH_TAG = MAX_TAG
_GRAD_TAG_BASE = 1 << 30
_SEQ_WINDOW = 1 << 12

#: Most dims a tensor sent with a metadata header may have.
MAX_NDIM = 12
_MAGIC = 0x64635032  # "dcP2"
_MAGIC_FUSED = 0x64635046  # "dcPF": the header of a fused message (the data follows it)
HEADER_LEN = 5 + MAX_NDIM  # magic, dtype code, ndim, requires_grad, sequence number, shape...
#: Bytes in front of the data in a fused message: the header, padded so that the data
#: is aligned for every dtype (and for vector loads).
FUSED_OFFSET = 256

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
DTYPE_TO_CODE: dict[torch.dtype, int] = {
    getattr(torch, n): i + 1 for i, n in enumerate(_DTYPE_NAMES) if hasattr(torch, n)
}
_CODE_TO_DTYPE: dict[int, torch.dtype] = {c: d for d, c in DTYPE_TO_CODE.items()}


def differentiable(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


# ======================================================================================
# asynchronous sends
# ======================================================================================


def isend(buf: Tensor, dst: int, pg: PG, tag: int, what: str) -> None:
    """Post a non-blocking send of the contiguous ``buf``, a buffer private to it (kept
    alive until done), through the backend's one entry point (so the comms logger and
    comm-off switches see it)."""
    parts: list[tuple[Any, Any, str]] = []
    _post(parts, buf, dst, pg, tag, what)
    SENDS.post(parts, buf, buf.numel() * buf.element_size())


def _post(parts: list[tuple[Any, Any, str]], buf: Tensor, dst: int, pg: PG, tag: int, what: str) -> None:
    """Post the send of ``buf`` and add ``(work, flight record, what)`` to ``parts``
    (nothing when ``buf`` is empty — the receiver skips it too — or sends are off)."""
    if buf.numel() == 0:
        return
    wire = B.wire(buf)
    work = B.dispatch(
        "send",
        pg,
        buf.numel() * buf.element_size(),
        lambda: dist.isend(wire, group_dst=dst, group=pg, tag=tag),
        lambda: None,
        None,
        messages=(("send", dst, tag),),
    )
    if work is not None:
        rec = _flight.take_last("send")  # the flight record: queued until the peer has it
        _flight.queued(rec)
        parts.append((work, rec, what))


# ======================================================================================
# receives, and the clock of their waits
# ======================================================================================

_WAITED = [0.0]  # host seconds blocked in p2p receives, this process (all threads)
_WAITED_LOCK = threading.Lock()


def _waited(t0: float) -> None:
    with _WAITED_LOCK:
        _WAITED[0] += time.perf_counter() - t0


def recv_wait_seconds() -> float:
    """Host seconds this process has spent blocked in p2p receives so far (a running
    total: take differences). Measured with ``time.perf_counter`` around each blocking
    receive; the device is never synchronised for it."""
    return _WAITED[0]


def recv_into(buf: Tensor, src: int, pg: PG, tag: int) -> Tensor:
    """Receive into ``buf`` (blocking) and return it."""
    SENDS.check()
    if buf.numel() == 0:  # the sender skipped it too
        return buf
    t0 = time.perf_counter()
    try:
        return B.get_backend().recv(buf, src, pg, tag)
    finally:
        _waited(t0)


class Posted:
    """A receive into ``buf`` posted ahead (``irecv``); :meth:`wait` completes it.

    Posting is not logged; the wait goes through the backend's one entry point as a
    ``recv`` (so the comms log, comm-off switch, flight recorder and timeout diagnosis
    see it, with the seconds actually spent blocked).
    """

    def __init__(self, buf: Tensor, src: int, pg: PG, tag: int) -> None:
        SENDS.check()
        self.buf, self.pg, self.src, self.tag = buf, pg, src, tag
        self.work = None
        self.done = False
        if buf.numel() and not B.is_off("recv"):
            self.work = dist.irecv(B.wire(buf), group_src=src, group=pg, tag=tag)

    def wait(self) -> Tensor:
        """The received ``buf`` (blocking until it is in; again at once when waited)."""
        buf, work = self.buf, self.work
        if buf.numel() == 0 or self.done:
            return buf
        self.work, self.done = None, True
        t0 = time.perf_counter()
        try:
            B.dispatch(
                "recv", self.pg, buf.numel() * buf.element_size(),
                (lambda: work.wait()) if work is not None else (lambda: buf.zero_()),
                lambda: buf.zero_(), buf,
                messages=None if work is None else (("recv", self.src, self.tag),),
            )  # fmt: skip
        finally:
            _waited(t0)
        return buf


# ======================================================================================
# the metadata header and the sequence numbers
# ======================================================================================


def encode_header(
    x: Tensor, requires_grad: bool, seq: int = 0, device: Any = None, fused: bool = False
) -> Tensor:
    """The header of a send of ``x`` on ``device`` (default CPU), built in one call (a
    Python list to one tensor: ~5 µs, against ~30 µs for filling a zero tensor entry by
    entry); ``fused``: the header of a fused message."""
    values = _header_values(x, requires_grad, seq, fused)
    if device is None or torch.device(device).type == "cpu":  # packed bytes: ~2 us, no list
        return torch.frombuffer(bytearray(_HEADER.pack(*values)), dtype=torch.int64)
    return torch.tensor(values, dtype=torch.int64, device=device)


def _header_values(x: Tensor, requires_grad: bool, seq: int, fused: bool) -> tuple[int, ...]:
    n = x.ndim
    return (
        _MAGIC_FUSED if fused else _MAGIC,
        DTYPE_TO_CODE[x.dtype],
        n,
        int(requires_grad),
        seq,
        *x.shape,
        *_PAD[n:],
    )


_PAD = (0,) * MAX_NDIM
#: The header's bytes: ``HEADER_LEN`` native-endian int64 (as ``torch.int64`` lays them out).
_HEADER = struct.Struct(f"={HEADER_LEN}q")


def decode_header(h: Tensor) -> tuple[torch.Size, torch.dtype, bool, int, bool] | None:
    """``(shape, dtype, requires_grad, seq, fused)``, or ``None`` when ``h`` is not a send
    header."""
    v = h.tolist()
    if v[0] not in (_MAGIC, _MAGIC_FUSED) or v[1] not in _CODE_TO_DTYPE or not 0 <= v[2] <= MAX_NDIM:
        return None
    return torch.Size(v[5 : 5 + v[2]]), _CODE_TO_DTYPE[v[1]], bool(v[3]), v[4], v[0] == _MAGIC_FUSED


# Per channel (group, peer, tag, direction): how many messages went through it.
SEQ: dict[tuple[Any, int, int, str], int] = {}


def seq_key(pg: PG, peer: int, tag: int, direction: str) -> tuple[Any, int, int, str]:
    if pg is not None and pg is dist.GroupMember.WORLD:  # the default group, however named
        pg = None
    return (pg, peer, tag, direction)


def next_seq(pg: PG, peer: int, tag: int, direction: str) -> int:
    key = seq_key(pg, peer, tag, direction)
    seq = SEQ.get(key, 0)
    SEQ[key] = seq + 1
    return seq


def grad_tag(tag: int, seq: int) -> int:
    return _GRAD_TAG_BASE + tag * _SEQ_WINDOW + seq % _SEQ_WINDOW


def describe(shape: Sequence[int] | None, dtype: torch.dtype | None) -> str:
    s = "any shape" if shape is None else f"shape {tuple(shape)}"
    d = "any dtype" if dtype is None else str(dtype).replace("torch.", "")
    return f"{s}, {d}"


# ======================================================================================
# one message: send, receive, gradients
# ======================================================================================


def post_send(
    x: Tensor, dst: int, pg: PG, tag: int, requires_grad: bool, seq: int, mode: str = "copy"
) -> None:
    """Post the header and the data of ``x`` to ``dst`` (asynchronous).

    ``mode``: ``"copy"`` (:func:`~diffcomm.send`): a private contiguous copy of ``x`` is
    sent, so the caller may reuse ``x`` at once. ``"owned"`` (``p2p.send_owned``: the
    pipeline runner, which owns the activation it sends and never writes to it): ``x``
    itself is sent when it is contiguous, so its storage must stay unmodified until the
    peer has received it (:func:`wait_sends`). ``"fused"``: header and data in one message
    (one buffer, so a copy; the receiver must have posted a fused receive of at least
    this size, see the module docstring)."""
    SENDS.check()
    x = x.detach()
    dev = B.group_info(pg).device
    parts: list[tuple[Any, Any, str]] = []
    what = f"send(dst={dst}, tag={tag})"
    if mode == "fused":
        nbytes = x.numel() * x.element_size()
        buf = torch.empty(FUSED_OFFSET + nbytes, dtype=torch.uint8, device=dev)
        if buf.device.type == "cpu":  # the header packed straight into the buffer
            _HEADER.pack_into(buf.numpy().data, 0, *_header_values(x, requires_grad, seq, True))
        else:
            buf[: HEADER_LEN * 8].view(torch.int64).copy_(
                encode_header(x, requires_grad, seq, None, fused=True)
            )
        if nbytes:
            buf[FUSED_OFFSET:].view(x.dtype).view(x.shape).copy_(x)
        _post(parts, buf, dst, pg, tag, what)
        SENDS.post(parts, buf, buf.numel())
        return
    buf = x.clone(memory_format=torch.contiguous_format) if mode == "copy" else x.contiguous()
    header = encode_header(x, requires_grad, seq, dev)
    _post(parts, header, dst, pg, tag, f"{what} header")
    _post(parts, buf.view(-1).view(torch.uint8), dst, pg, tag, what)
    SENDS.post(parts, (header, buf), 0 if buf is x else buf.numel() * buf.element_size())


def send_grad(g: Tensor, src: int, pg: PG, tag: int, seq: int) -> None:
    """Send the gradient of the ``seq``-th message received from ``src`` back to it (its
    bytes, then the byte ``0``: a gradient; see the module docstring)."""
    n = g.numel() * g.element_size()
    buf = torch.empty(n + 1, dtype=torch.uint8, device=g.device)
    buf[:n].view(g.dtype).view(g.shape).copy_(g.detach())
    buf[n:].zero_()
    isend(buf, src, pg, grad_tag(tag, seq), f"gradient of recv(src={src}, tag={tag}) #{seq}")


def send_no_grad(
    src: int, shape: torch.Size, dtype: torch.dtype, device: Any, pg: PG, tag: int, seq: int
) -> None:
    """Tell ``src`` that the ``seq``-th message received from it got no gradient: zeros of
    its size, then the byte ``1`` (:func:`no_grad`)."""
    n = shape.numel() * dtype.itemsize
    buf = torch.zeros(n + 1, dtype=torch.uint8, device=device)
    buf[n:].fill_(1)
    isend(buf, src, pg, grad_tag(tag, seq), f"no gradient of recv(src={src}, tag={tag}) #{seq}")


def grad_data(buf: Tensor, shape: torch.Size, dtype: torch.dtype) -> Tensor:
    """The gradient in a gradient message (all but its last byte)."""
    return buf[:-1].view(dtype).view(shape)


def no_grad(buf: Tensor) -> bool:
    """Whether the gradient message ``buf`` says "no gradient" (:func:`send_no_grad`); its
    last byte, read on the host (a device synchronisation where it is on an accelerator)."""
    return int(buf[-1]) != 0


def recv_data(src: int, shape: torch.Size, dtype: torch.dtype, device: Any, pg: PG, tag: int) -> Tensor:
    """Receive the data of a message whose header said ``shape`` and ``dtype``."""
    nbytes = shape.numel() * dtype.itemsize
    if not nbytes:
        return torch.empty(shape, dtype=dtype, device=device)
    raw = recv_into(torch.empty(nbytes, dtype=torch.uint8, device=device), src, pg, tag)
    return raw.view(dtype).reshape(shape)


# Posted receives of gradients (``p2p.post_grad_recv``), by channel and message number;
# the send's backward takes its own out.
_GRADS: dict[tuple[tuple[Any, int, int, str], int], Posted] = {}


def post_grad(
    shape: torch.Size, dtype: torch.dtype, device: Any, dst: int, pg: PG, tag: int, seq: int
) -> bool:
    """Post the receive of the gradient of message ``seq`` sent to ``dst``; ``False`` if
    it is already posted."""
    key = (seq_key(pg, dst, tag, "send"), seq)
    if key in _GRADS:
        return False
    buf = torch.empty(shape.numel() * dtype.itemsize + 1, dtype=torch.uint8, device=device)
    _GRADS[key] = Posted(buf, dst, pg, grad_tag(tag, seq))
    return True


def recv_grad(
    shape: torch.Size, dtype: torch.dtype, device: Any, dst: int, pg: PG, tag: int, seq: int
) -> Tensor:
    """The gradient message of message ``seq`` sent to ``dst`` (what the receiver's backward
    sent; :func:`grad_data` and :func:`no_grad` read it): from its posted receive if there
    is one, else received now."""
    posted = _GRADS.pop((seq_key(pg, dst, tag, "send"), seq), None)
    if posted is not None:
        return posted.wait()
    buf = torch.empty(shape.numel() * dtype.itemsize + 1, dtype=torch.uint8, device=device)
    return recv_into(buf, dst, pg, grad_tag(tag, seq))


class Receive(NamedTuple):
    """One receive of a :func:`post_send` message: from ``src`` on ``(pg, tag)``, number
    ``seq`` on that channel; what the receiver expects (``None``: whatever comes) and the
    device of the result."""

    src: int
    pg: PG
    tag: int
    seq: int
    want_shape: torch.Size | None
    want_dtype: torch.dtype | None
    device: Any


def check_header(
    header: Tensor, r: Receive, posted: Posted | None = None, fused_receive: bool = False
) -> tuple[torch.Size, torch.dtype, bool, bool]:
    """``(shape, dtype, requires_grad, fused)`` of the message whose ``header`` arrived,
    checked against what the receiver expects; a mismatch drains the data (or waits for
    the ``posted`` data receive; nothing for a fused message, whose data came with its
    header) and raises :class:`~diffcomm.CrossRankMismatchError`. A ``fused_receive``
    expects its shape and dtype of a fused message only: a plain one may have any."""
    src, pg, tag, seq, want_shape, want_dtype, device = r
    meta = decode_header(header.cpu())
    if meta is None:
        me = B.group_info(pg).rank
        SEQ[seq_key(pg, src, tag, "recv")] = seq  # not a diffcomm message: it used no number
        raise CrossRankMismatchError(
            f"diffcomm.recv(): rank {me} received from rank {src} (tag {tag}) a message that is "
            f"not a diffcomm.send header ({header.tolist()[:4]}...): the send/recv pairing between "
            f"ranks {src} and {me} is mismatched (a raw torch.distributed send, a batched op, or "
            f"the two ranks running different sequences of p2p ops)"
        )
    got_shape, got_dtype, sent_rg, sent_seq, fused = meta
    if sent_seq != seq:
        if not fused:
            _drain(posted, src, got_shape, got_dtype, device, pg, tag)
        SEQ[seq_key(pg, src, tag, "recv")] = sent_seq + 1  # back in step for what follows
        me = B.group_info(pg).rank
        raise CrossRankMismatchError(
            f"diffcomm.recv(): send/recv between ranks {src} -> {me} (tag {tag}) are out of step: "
            f"this is receive #{seq} on rank {me} but send #{sent_seq} on rank {src} (a rank "
            f"skipped or repeated a send/recv, e.g. after an error)"
        )
    if fused_receive and not fused:
        want_shape = want_dtype = None
    bad = (want_shape is not None and tuple(want_shape) != tuple(got_shape)) or (
        want_dtype is not None and want_dtype != got_dtype
    )
    if bad:
        if not fused:
            _drain(posted, src, got_shape, got_dtype, device, pg, tag)  # keep the channel clean
        me = B.group_info(pg).rank
        raise CrossRankMismatchError(
            f"diffcomm.recv(): mismatched send/recv between ranks {src} -> {me} (tag {tag}): "
            f"rank {me} expected {describe(want_shape, want_dtype)}, but rank {src} sent "
            f"{describe(got_shape, got_dtype)}"
        )
    return got_shape, got_dtype, sent_rg, fused


def _drain(
    posted: Posted | None, src: int, shape: torch.Size, dtype: torch.dtype, device: Any, pg: PG, tag: int
) -> None:
    if posted is None:
        recv_data(src, shape, dtype, device, pg, tag)
    elif posted.buf.numel() == shape.numel() * dtype.itemsize:
        posted.wait()


def receive_header(r: Receive) -> Tensor:
    """Receive the header of message ``r`` (blocking)."""
    header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=B.group_info(r.pg).device)
    with B.label(f"recv(src={r.src}, tag={r.tag}) header"):
        return recv_into(header, r.src, r.pg, r.tag)


class PostedMessage:
    """The receives of message ``r`` posted ahead (``irecv``): its header; its data too
    when the expected shape and dtype are known; or, ``fused``, one receive for both
    (``send_owned(..., fused=True)``). :meth:`wait` returns the header and what holds the
    data for :func:`read`."""

    def __init__(self, r: Receive, fused: bool = False) -> None:
        self.r = r
        self.data: Posted | None = None
        self.fused = fused
        if fused:  # one receive for header and data
            assert r.want_shape is not None and r.want_dtype is not None
            nbytes = FUSED_OFFSET + r.want_shape.numel() * r.want_dtype.itemsize
            self.header = Posted(torch.empty(nbytes, dtype=torch.uint8, device=r.device), r.src, r.pg, r.tag)
            return
        header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=B.group_info(r.pg).device)
        self.header = Posted(header, r.src, r.pg, r.tag)
        if r.want_shape is not None and r.want_dtype is not None:
            nbytes = r.want_shape.numel() * r.want_dtype.itemsize
            self.data = Posted(torch.empty(nbytes, dtype=torch.uint8, device=r.device), r.src, r.pg, r.tag)
        else:
            HEADER_FIRST.add(seq_key(r.pg, r.src, r.tag, "recv"))

    def wait(self) -> tuple[Tensor, Posted | None, Tensor | None]:
        """``(header, posted data receive, fused message)``, the header in (blocking)."""
        r = self.r
        with B.label(f"recv(src={r.src}, tag={r.tag}) header"):
            got = self.header.wait()
        if self.fused:  # the header, then (if it says so) the data
            return got[: HEADER_LEN * 8].view(torch.int64), None, got
        if self.data is None:  # the data receive comes next, blocking: the channel is free after
            HEADER_FIRST.discard(seq_key(r.pg, r.src, r.tag, "recv"))
        return got, self.data, None


def read(
    header: Tensor, r: Receive, posted: Posted | None = None, fused: Tensor | None = None
) -> tuple[torch.Size, torch.dtype, bool, Tensor | None]:
    """``(shape, dtype, requires_grad, data)`` of message ``r`` whose ``header`` arrived:
    the header checked (:func:`check_header`), the data taken from the ``fused`` message
    or waited for on the ``posted`` receive; ``None``: the caller receives it next
    (:func:`recv_data`, in the op's forward)."""
    shape, dtype, sent_rg, sent_fused = check_header(header, r, posted, fused is not None)
    data = None
    if sent_fused and fused is not None:
        nbytes = shape.numel() * dtype.itemsize
        data = fused[FUSED_OFFSET : FUSED_OFFSET + nbytes].view(dtype).reshape(shape)
    elif posted is not None:
        with B.label(f"recv(src={r.src}, tag={r.tag})"):
            data = posted.wait().view(dtype).reshape(shape)
    return shape, dtype, sent_rg, data


# Channels with a receive posted header-first (no shape given) whose data receive is not
# posted yet: any other receive on the channel now would be matched to that data.
HEADER_FIRST: set[tuple[Any, int, int, str]] = set()
per_rank(SEQ, _GRADS, HEADER_FIRST)  # a rank's own in an in-process world


def _forget_channels(group: PG, exiting: bool) -> None:
    """A destroyed group (``None``: every group) takes its channels' numbers, marks and
    posted receives along: kept, they kept it (and its gloo threads) alive to the exit."""
    for key in [k for k in SEQ if group is None or k[0] is group]:
        del SEQ[key]
    HEADER_FIRST.difference_update([k for k in HEADER_FIRST if group is None or k[0] is group])
    for gkey in [k for k in _GRADS if group is None or k[0][0] is group]:
        del _GRADS[gkey]


_lifecycle.on_destroy("p2p channels", _forget_channels)


def check_channel(pg: PG, src: int, tag: int, op: str) -> None:
    if seq_key(pg, src, tag, "recv") in HEADER_FIRST:
        raise A.arg_error(
            op,
            "src/tag",
            "a channel without a pending irecv posted with no shape (its data would be "
            "matched to this receive): wait for that handle first, or give irecv `shape` "
            "and `dtype` (or `like`)",
            f"src={src}, tag={tag}",
        )


# ======================================================================================
# the batched exchange (sendrecv, ppermute, shift)
# ======================================================================================


def exchange(x: Tensor, dst: int | None, src: int | None, out_shape: torch.Size, pg: PG, me: int) -> Tensor:
    """Send ``x`` to ``dst`` and receive an ``out_shape`` tensor from ``src`` in one batch.

    ``None`` peers are skipped (ppermute ranks that only send or only receive); a peer equal
    to this rank (``me``) is a local copy. In debug mode the headers are exchanged and checked
    first, and every rank learns (one small all_reduce) whether any rank found a mismatch;
    the error names the op by its label (``sendrecv(dst=1, src=1)``).
    """
    local = dst == me  # then src is this rank too
    if _config.DEBUG.get() and not _CHECKED_AT_CALL.get():  # every rank joins: the check ends
        # in a small all_reduce (not again in the forward of a call check_grads checked)
        opname = (B.LABEL.get() or "exchange").rsplit(" -> ", 1)[-1]
        _check_headers(x, None if local else dst, None if local else src, out_shape, pg, opname)
    if local:
        return x.clone(memory_format=torch.contiguous_format)
    x = x.contiguous()
    out = (torch.zeros if src is None else torch.empty)(out_shape, dtype=x.dtype, device=x.device)
    ops: list[tuple[str, Tensor, int, int]] = []
    if dst is not None and x.numel():  # empty tensors: nothing on the wire, on both sides
        ops.append(("send", x, dst, BATCH_TAG))
    if src is not None and out.numel():
        ops.append(("recv", out, src, BATCH_TAG))
    SENDS.check()
    B.get_backend().batch_p2p(ops, pg)
    return out


#: inside the forward of a ring exchange whose call :func:`check_grads` checked: the
#: forward's :func:`exchange` does not check the same headers again
_CHECKED_AT_CALL: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "diffcomm_checked_at_call", default=False
)


@contextlib.contextmanager
def checked_at_call() -> Iterator[None]:
    """The forward of a call :func:`check_grads` has just checked (debug mode)."""
    token = _CHECKED_AT_CALL.set(True)
    try:
        yield
    finally:
        _CHECKED_AT_CALL.reset(token)


def check_grads(
    x: Tensor, dst: int | None, src: int | None, out_shape: torch.Size, pg: PG, opname: str
) -> None:
    """Debug mode, at a ring exchange's call (before its op is applied, where grad mode is
    the caller's): the headers :func:`exchange` checks, with whether each rank's ``x``
    records the op for backward, which sender and receiver must agree on. A rank whose ``x``
    needs no gradient runs no backward, and its peer's backward exchange met that rank's next
    exchange: ``sendrecv`` gave a rank its peer's next *value* as its gradient, in debug mode
    too (the collectives' checks compare this flag already)."""
    local = dst == B.group_info(pg).rank  # (a local copy has no peer, but joins the all_reduce)
    grad = x.requires_grad and torch.is_grad_enabled()
    _check_headers(x, None if local else dst, None if local else src, out_shape, pg, opname, grad)


def _check_headers(
    x: Tensor,
    dst: int | None,
    src: int | None,
    out_shape: torch.Size,
    pg: PG,
    opname: str,
    grad: bool | None = None,
) -> None:
    info = B.group_info(pg)
    be, dev, me = B.get_backend(), info.device, info.rank
    ops: list[tuple[str, Tensor, int, int]] = []
    got = torch.zeros(HEADER_LEN, dtype=torch.int64, device=dev)
    if dst is not None:
        ops.append(("send", encode_header(x, bool(grad), 0, dev), dst, BATCH_TAG))
    if src is not None:
        ops.append(("recv", got, src, BATCH_TAG))
    with B.label("debug header"):
        be.batch_p2p(ops, pg)
    problem = ""
    if src is not None:
        meta = decode_header(got.cpu())
        if meta is None:
            problem = f"rank {me} got no diffcomm header from rank {src} (mismatched pairing)"
        elif tuple(meta[0]) != tuple(out_shape) or meta[1] != x.dtype:
            problem = (
                f"mismatched {opname} between ranks {src} -> {me}: rank {me} expected "
                f"{describe(out_shape, x.dtype)}, but rank {src} sent {describe(meta[0], meta[1])}"
            )
        elif grad is not None and meta[2] != grad:
            problem = (
                f"mismatched {opname} between ranks {src} -> {me}: rank {src}'s x records the op "
                f"for backward (torch.is_grad_enabled() and x.requires_grad) {meta[2]}, rank "
                f"{me}'s {grad}: a rank without it runs no backward, and its peer's backward "
                "would pair with its next exchange (freeze or require grad on every rank alike)"
            )
    flag = torch.tensor([1 if problem else 0], dtype=torch.int64, device=dev)
    with B.label("debug check"):
        any_bad = int(be.all_reduce(flag, "max", pg).item())
    if problem:
        raise CrossRankMismatchError(f"diffcomm.{opname}(): {problem}")
    if any_bad:
        raise CrossRankMismatchError(
            f"diffcomm.{opname}(): another rank of the group found a shape/dtype/grad mismatch "
            f"(its error names the ranks); rank {me} stops too"
        )
