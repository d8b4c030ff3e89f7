"""The one entry point every raw op funnels through: :func:`dispatch`.

For every raw op, in one place so none can forget: the comm-off switches
(:mod:`diffcomm.diagnostics.switches`), the comms logger (:mod:`diffcomm.diagnostics.logger`), the flight
recorder and the translation of a backend timeout into
:class:`~diffcomm.CollectiveTimeoutError` / :class:`~diffcomm.DesyncError` naming the op
(:mod:`diffcomm.diagnostics.recorder`, :mod:`diffcomm.diagnostics.responder`). Also here: the
process-wide span recorder the timeline reads (:func:`record_spans`), the program-order
hook of the asynchronous engine (:func:`set_order_hook`), the coalesced-op record
(:func:`run_coalesced`) and the hand-over of a thread's logs and switches to the engine
thread (:func:`comm_state`, :func:`adopt_comm_state`).

The hot path (nothing logged, nothing switched off, no asynchronous job pending, no
spans recorded) is one thread-local dict read and a call into the flight recorder.

Everything public here is re-exported by :mod:`diffcomm.backend`, its public home.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .._torch import dispatch_modes as _dispatch_modes
from .._torch import outside_checkpoint_caching as _outside_checkpoint_caching
from ..diagnostics import recorder as _flight
from ..diagnostics import responder as _responder
from ..diagnostics.logger import LABEL as _LABEL
from ..diagnostics.logger import STATE as _local
from ..diagnostics.logger import CommRecord, CommsLog
from ..diagnostics.logger import logs as _logs
from ..diagnostics.recorder import Messages
from ..diagnostics.switches import off as _off
from .groups import ProcessGroup
from .groups import world as _world
from .in_process import per_rank_attr

_get_label = _LABEL.get
_begin = _flight.begin
_perf = time.perf_counter
_T1, _STATE = _flight.T1, _flight.STATE


Sample = torch.Tensor | None  # the tensor a raw op's record takes its shape and dtype from
Fn = Callable[..., Any]  # a raw op's function (run) or what it does when switched off (skip)
Args = tuple[Any, ...]  # their arguments: run(*args), skip(*args)


def _sync_if_needed(t: torch.Tensor | None) -> None:
    if t is not None and t.device.type not in ("cpu", "meta"):
        torch.accelerator.synchronize(t.device) if hasattr(torch, "accelerator") else None


def dispatch(
    op: str,
    group: ProcessGroup,
    nbytes: int,
    run: Callable[..., Any],
    skip: Callable[..., Any],
    sample: torch.Tensor | None = None,
    args: tuple[Any, ...] = (),
    here: bool = False,
    messages: Messages | None = None,
) -> Any:
    """Run one raw op: comm-off switch, logging, flight recorder, timeout diagnosis — for
    every op (a timeout becomes :class:`~diffcomm.DesyncError` with the cross-rank story).

    The op is ``run(*args)``; switched off, ``skip(*args)`` fills the output instead. The
    hot ops pass module-level functions and their arguments rather than closures: making
    two closures per call costs about 3k machine instructions, as much as this entry point.

    Inside :func:`run_coalesced` the call is one *part* of a coalesced op: it is not
    logged on its own (the coalesced op is logged once, with the parts' total bytes) and
    is skipped when either its own name or the coalesced op's is off.

    A point-to-point op passes its ``messages`` (``((kind, peer, tag), ...)``, peers as
    group ranks): the flight recorder counts them per peer, which lets a world tell a
    receive that can never complete from a slow one.

    The hot path (nothing logged, switched off, queued or spanned) runs the op right here,
    in this frame (a call frame fewer on every raw op); ``here=True`` (:func:`_run`)
    skips the routing, for the other paths once they have decided to run the op.
    """
    if not here:
        state = _local.__dict__  # this thread's logs / switches / coalescing record
        if state and (state.get("logs") or state.get("off") or state.get("coalescing") is not None):
            return _dispatch_routed(op, group, nbytes, run, skip, sample, args, state, messages)
        hook = _ORDER_HOOK
        if (hook is not None and hook[2].pending and hook[0]()) or _SPANS is not None:
            return _run(op, group, run, nbytes, sample, args, messages)
    label = _get_label()
    rec = _begin(op, group, nbytes, sample, label, messages)
    try:  # (under a dispatch mode: selective checkpointing's must not cache the op)
        out = run(*args) if not _dispatch_modes() else _outside_checkpoint_caching(run, args)
    except (RuntimeError, dist.DistError) as err:  # DistBackendError is a RuntimeError
        mapped = _responder.failed(rec, op, group, err, label)
        if mapped is not None:
            raise mapped from err
        raise
    if rec is not None:  # _flight.end, inline (every raw op passes here)
        rec[_T1] = _perf()
        rec[_STATE] = "completed"
    return out


def _dispatch_routed(
    op: str,
    group: ProcessGroup,
    nbytes: int,
    run: Fn,
    skip: Fn,
    sample: Sample,
    args: Args,
    state: dict[str, Any],
    messages: Messages | None = None,
) -> Any:
    """:func:`dispatch` while this thread logs, has ops switched off or coalesces."""
    part_of = state.get("coalescing")
    if part_of is not None:
        part_of.parts += 1
        part_of.nbytes += nbytes
        if op in _off() or part_of.op in _off():
            part_of.skipped = True
            return skip(*args)
        return _run(op, group, run, nbytes, sample, args, messages)
    logs = _logs()
    if op in _off():
        out = skip(*args)
        dtype = str(sample.dtype) if sample is not None else None
        for log in logs:
            log.records.append(CommRecord(op, _LABEL.get(), nbytes, 0.0, _world(group), True, dtype=dtype))
        return out
    start = time.perf_counter() if logs else 0.0
    out = _run(op, group, run, nbytes, sample, args, messages)
    if logs:
        _sync_if_needed(sample)
        elapsed = time.perf_counter() - start
        dtype = str(sample.dtype) if sample is not None else None
        for log in logs:
            log.records.append(CommRecord(op, _LABEL.get(), nbytes, elapsed, _world(group), dtype=dtype))
    return out


#: Set by :func:`set_order_hook` (:mod:`diffcomm.ops.engine`): ``(must_queue, call, engine)``.
#: While asynchronous jobs are pending (``engine.pending``), a raw op issued by another
#: thread runs on the communication engine behind them (``call``), so this process
#: issues communication in program order.
_ORDER_HOOK: tuple[Callable[[], bool], Callable[[Callable[[], Any], str], Any], Any] | None = None

#: Spans of raw communication ``(op, label, thread name, t0, t1)`` (``time.perf_counter``)
#: while a :func:`record_spans` block is active (the timeline reads them).
_SPANS: list[tuple[str, str | None, str, float, float]] | None = None
# a rank's own in an in-process world, as a rank process's (rank 0's block recorded the
# other ranks' ops, and the ranks' restores interleaved)
per_rank_attr(sys.modules[__name__], "_SPANS", lambda: None)


@contextlib.contextmanager
def record_spans() -> Iterator[list[tuple[str, str | None, str, float, float]]]:
    """Record every raw communication of this process (any thread) with its start and
    end time: ``(op, label, thread name, t0, t1)``, ``time.perf_counter`` seconds.

    The timeline (``python -m diffcomm bench --timeline``) draws these next to the
    compute spans; unlike :func:`log_comms` it is process-wide, so the communication
    engine's thread is recorded too.
    """
    global _SPANS
    old, spans = _SPANS, list[tuple[str, str | None, str, float, float]]()
    _SPANS = spans
    try:
        yield spans
    finally:
        _SPANS = old


def _run(
    op: str,
    group: ProcessGroup,
    run: Fn,
    nbytes: int = 0,
    sample: Sample = None,
    args: Args = (),
    messages: Messages | None = None,
) -> Any:
    """``run(*args)`` recorded by the flight recorder; a timeout (or a peer gone mid-op) becomes
    :class:`~diffcomm.DesyncError` carrying the cross-rank diagnosis."""
    hook = _ORDER_HOOK
    if hook is not None and hook[0]():
        return hook[1](lambda: _run(op, group, run, nbytes, sample, args, messages), op)
    spans = _SPANS
    if spans is not None:
        t0 = time.perf_counter()
        try:
            return dispatch(op, group, nbytes, run, run, sample, args, True, messages)
        finally:
            _sync_if_needed(sample)
            spans.append((op, _LABEL.get(), threading.current_thread().name, t0, time.perf_counter()))
    # the flight record and the error mapping, no routing (``skip`` is unused with here=True)
    return dispatch(op, group, nbytes, run, run, sample, args, True, messages)


@dataclass
class _Coalescing:
    """The record of a coalesced op being run (see :func:`run_coalesced`)."""

    op: str
    parts: int = 0
    nbytes: int = 0
    skipped: bool = False


def tensor_nbytes(t: torch.Tensor) -> int:
    """The payload size of ``t`` in bytes (what the logger and the flight recorder count)."""
    return t.numel() * t.element_size()


def set_order_hook(
    must_queue: Callable[[], bool], call: Callable[[Callable[[], Any], str], Any], engine: Any
) -> None:
    """Install the asynchronous engine's program-order hook (:mod:`diffcomm.ops.engine` does, once).

    Before every raw op the entry point asks ``must_queue()`` (only while
    ``engine.pending``, a count read without a call, is non-zero); when it says yes (jobs
    are pending and this is not the engine thread), the op runs as ``call(run, op)``: on
    the engine, behind the pending jobs, so this process issues communication in program
    order.
    """
    global _ORDER_HOOK
    _ORDER_HOOK = (must_queue, call, engine)


def current_spans() -> list[tuple[str, str | None, str, float, float]] | None:
    """The span list of the active :func:`record_spans` block, or ``None`` outside one."""
    return _SPANS


def run_coalesced(
    op: str, group: ProcessGroup, xs: Sequence[torch.Tensor], fn: Callable[[torch.Tensor], Any]
) -> list[torch.Tensor]:
    """Run ``fn`` (a raw single op) on each buffer; log them as one ``<op>_coalesced``
    (total bytes, ``parts`` = the raw calls; skipped when either name is switched off)."""
    if getattr(_local, "coalescing", None) is not None:  # nested: parts of the outer op
        return [fn(x) for x in xs]
    record = _Coalescing(f"{op}_coalesced")
    logs = _logs()
    start = time.perf_counter() if logs else 0.0
    _local.coalescing = record
    try:
        outs = [fn(x) for x in xs]
    finally:
        _local.coalescing = None
    if logs:
        _sync_if_needed(outs[-1] if outs else None)
        elapsed = time.perf_counter() - start
        for log in logs:
            log.records.append(
                CommRecord(
                    record.op,
                    _LABEL.get(),
                    record.nbytes,
                    elapsed,
                    _world(group),
                    record.skipped,
                    record.parts,
                )
            )
    return outs


#: A thread's comms logs and comm-off switches, as :func:`comm_state` copies them.
CommState = tuple[list[CommsLog], set[str]]


def comm_state() -> CommState:
    """A copy of this thread's open comms logs and comm-off switches, for another thread
    (the asynchronous engine) to run a job under with :func:`adopt_comm_state`."""
    return list(_logs()), set(_off())


def adopt_comm_state(state: CommState | None) -> None:
    """Make ``state`` (from :func:`comm_state`) this thread's logs and switches;
    ``None``: no log open, nothing switched off."""
    if state is None:
        _local.logs, _local.off = [], set()
    else:
        _local.logs, _local.off = state
