"""The send queue under :mod:`diffcomm.ops.wire`: posted sends, completed in the background.

c10d's blocking send is a rendezvous (it returns once the peer has posted the matching
receive), so two neighbours that both "send, then receive" — a 1F1B pipeline's steady
state — would deadlock. The transport posts every send non-blocking and hands it here:
a waiter thread (:class:`SendQueue`) waits on posted sends in order, marks each flight
record ``completed`` and releases the buffers they read; :func:`wait_sends` blocks until
all are done and re-raises a failed one. The caller never blocks on a send anywhere else.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

from .. import _config, _lifecycle
from .._errors import CollectiveTimeoutError, DiffcommError
from ..backend.in_process import current_hub
from ..diagnostics import recorder as _flight

#: Posted sends of one message: ``[(work, flight record, what), ...]``.
Parts = list[tuple[Any, Any, str]]


class SendQueue:
    """Posted sends (c10d ``Work`` + the buffers they read), completed by a waiter thread.

    Why a thread: gloo's send ``Work`` reports ``is_completed() == False`` until someone
    calls ``wait()`` on it, even long after the peer received it (checked on torch 2.13;
    its ``get_future()`` is not implemented, and a ``wait(timeout)`` that times out
    aborts the whole gloo context), so there is no non-blocking way to reap finished
    sends from the caller's thread; waiting on them in order from a daemon thread frees
    each buffer once its peer has received it, and never blocks the caller.

    Why batches: waking the thread costs more than a small send — the wake-up itself, and
    then the GIL changing hands between the two threads around the caller's next torch
    calls. So the caller holds its posted sends and hands them over in one batch once
    ``batch`` messages, or ``batch_bytes`` bytes of buffers private to the sends, are
    held, and at :meth:`wait_all`. A held send is on the wire like any other (posted:
    the peer receives it whenever it wants); only its completion — the flight record's
    ``completed``, its private buffer released — waits for the hand-over.
    """

    def __init__(self, batch: int = 8, batch_bytes: int = 1 << 20) -> None:
        self.batch, self.batch_bytes = batch, batch_bytes
        self._q: queue.SimpleQueue[list[tuple[Parts, Any, int]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._held: list[tuple[Parts, Any, int]] = []
        self._held_bytes = 0
        self._unfinished = 0  # messages handed over, not done yet (under _done)
        self._done = threading.Condition(threading.Lock())

    def post(self, parts: Parts, keep: Any, private: int = 0) -> None:
        """Hold the posted sends of one message (a header and its data travel as one
        item), keeping ``keep`` alive until all are done; ``private``: the bytes of
        ``keep`` that only these sends use (a copy), which count towards a hand-over."""
        if not parts:  # comm-off switch, or nothing on the wire
            return
        if current_hub() is not None:  # in-process: a posted send is done (nothing to reap)
            for work, rec, _what in parts:
                work.wait()
                _flight.end(rec)
            return
        with self._lock:
            held = self._held
            held.append((parts, keep, private))
            self._held_bytes += private
            if len(held) < self.batch and self._held_bytes < self.batch_bytes:
                return
            self._held, self._held_bytes = [], 0
        self._hand_over(held)

    def flush(self) -> None:
        """Hand the held sends to the waiter thread now."""
        with self._lock:
            held, self._held, self._held_bytes = self._held, [], 0
        if held:
            self._hand_over(held)

    def _hand_over(self, items: list[tuple[Parts, Any, int]]) -> None:
        with self._done:
            self._unfinished += len(items)
        thread = self._thread
        if thread is None or not thread.is_alive():
            with self._lock:
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(target=self._run, name="diffcomm-sends", daemon=True)
                    self._thread.start()
        self._q.put(items)

    def _run(self) -> None:
        while True:
            items = self._q.get()
            if items is None:  # stop(): every send handed over before it is done
                return
            try:
                for parts, _keep, _private in items:
                    for work, rec, what in parts:
                        try:
                            work.wait()
                            _flight.end(rec)
                        except BaseException as err:  # re-raised on the caller's thread
                            if self._error is None:
                                self._error = _send_error(what, err)
            finally:
                n = len(items)
                del items
                with self._done:
                    self._unfinished -= n
                    if not self._unfinished:
                        self._done.notify_all()

    def check(self) -> None:
        """Re-raise (once) the first error of a background send."""
        err, self._error = self._error, None
        if err is not None:
            raise err

    def wait_all(self) -> None:
        """Hand over the held sends, block until every posted send is done, re-raise the
        first failure."""
        self.flush()
        with self._done:
            while self._unfinished:
                self._done.wait()
        self.check()

    def stop(self, timeout: float) -> None:
        """Hand over the held sends, let the thread finish them, end it and join it (a
        later hand-over starts a new one). ``timeout`` bounds the join: a send that is
        never received fails within its group's timeout. A failure stays for :meth:`check`."""
        self.flush()
        with self._lock:
            thread = self._thread
            if thread is None or not thread.is_alive():
                return
            self._q.put(None)
        thread.join(timeout)

    def pending(self) -> int:
        """Messages posted and not known to be received yet (held or handed over)."""
        return self._unfinished + len(self._held)


def _send_error(what: str, err: BaseException) -> BaseException:
    text = str(err)
    if any(m in text.lower() for m in ("timed out", "timeout", "deadline")):
        return CollectiveTimeoutError(
            f"diffcomm: `{what}` was never received (timed out). The peer must run the "
            f"matching recv — for a gradient, the sender must run the token's backward "
            f"(`token.backward()` or add the token into its loss). Backend error: {text}"
        )
    return DiffcommError(f"diffcomm: `{what}` failed in the background: {text}")


SENDS = SendQueue()


def _stop(group: Any, exiting: bool) -> None:
    SENDS.stop((_config.TIMEOUT.get() or 30.0) + 2.0)


_lifecycle.on_destroy("send queue", _stop)
# A LocalWorld rank's function that returned with a send its peer never received: the
# rank waits for it before reporting (the send fails at the group's timeout, naming
# it). Before, the run returned normally and the peer's first receive of the next run
# took the stale message: a wrong value with no error.
_lifecycle.on_program_end("send queue", SENDS.wait_all)


def wait_sends() -> None:
    """Block until every send this process posted has been received; re-raise a failure.

    :func:`~diffcomm.send` (and the gradient sends of :func:`~diffcomm.recv`'s backward)
    return as soon as the data is handed to the backend. Call this before tearing down the
    process group or before timing a step; :class:`~diffcomm.pipeline.PipelineRunner`
    calls it at the end of every step.
    """
    SENDS.wait_all()
