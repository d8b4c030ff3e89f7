"""The flight recorder and the desync diagnosis.

**Recorder.** Every raw communication that goes through the backend's one entry point
(:func:`diffcomm.backend.dispatch.dispatch`) is recorded in a per-rank ring buffer (the last
``DIFFCOMM_FLIGHT_SIZE`` entries, 1024 by default): the raw op, the diffcomm op it serves
(its label, e.g. ``"all_gather backward -> reduce_scatter(sum)"``), the group's global
ranks, a **per-group sequence number**, shape and dtype, forward or backward, the state
(``started`` -> ``completed``/``failed``; a send posted asynchronously is ``queued``
until its peer received it), the duration, and the user's call site (``file:line``, the
first frame outside diffcomm and torch). ``diffcomm.flight_recorder()`` returns a snapshot;
``.dump(path)`` writes JSON. ``DIFFCOMM_FLIGHT=0`` switches recording off.

**Diagnosis.** When a communication fails (a ``DIFFCOMM_TIMEOUT`` timeout, or a peer
that vanished), the failing rank asks every rank for its recent entries through the
**rendezvous store** — a TCP key-value store that still works while the process group is
stuck. Each rank answers from a small daemon thread (so a rank blocked in a collective,
or busy in user code, answers too; a rank that exited leaves its last entries behind at
exit). From the answers, :func:`diagnose` (in :mod:`diffcomm.diagnostics.diagnosis`, re-exported
here) finds the first sequence number where the ranks diverge (a different op, a
different shape, a rank that never got there) and says what every rank is doing. The
failing rank raises :class:`~diffcomm.DesyncError` with that text.
:class:`~diffcomm.LocalWorld` uses the same answers to notice at once (not after the
timeout) that a rank returned from the function while others wait for it.

The hot path (:func:`begin` / :func:`end`) costs about a microsecond per op; see
``benchmarks/bench_flight.py`` and ``docs/debugging.md``.

This module is the recorder (the ring buffer and the public snapshot); the asking and
answering through the store, and the failure path of a raw op, are
:mod:`diffcomm.diagnostics.responder`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import _config, _torch
from .diagnosis import P2P_OPS, diagnose

__all__ = ["FlightRecorder", "Entry", "flight_recorder", "diagnose"]


# --------------------------------------------------------------------------------------
# entries and the ring buffer
# --------------------------------------------------------------------------------------


# One recorded communication is a plain list (the cheapest object to build on the hot
# path), indexed by these constants; :func:`_as_dict` turns it into the public dict.
OP, LABEL, GROUP, SEQ, SHAPE, DTYPE, NBYTES, SITE, STATE, T0, T1, PEERS = range(12)
Entry = list  # [op, label, group record, seq, shape, dtype, nbytes, site, state, t0, t1, peers]

#: A point-to-point op's messages as the backend passes them to :func:`begin`:
#: ``(("send" | "recv", peer's rank in the group, tag), ...)``.
Messages = tuple[tuple[str, int, int], ...]


def _direction(label: str | None) -> str:
    return "backward" if label is not None and "backward" in label else "forward"


def _as_dict(e: Entry, now: float | None = None) -> dict[str, Any]:
    now = time.perf_counter() if now is None else now
    end = e[T1] if e[T1] else now
    shape, dtype = e[SHAPE], e[DTYPE]
    d = {
        "op": e[LABEL] or e[OP],
        "raw_op": e[OP],
        "seq": e[SEQ],
        "group": list(e[GROUP].ranks),
        "gid": e[GROUP].name,
        "shape": None if shape is None else list(shape),
        "dtype": None if dtype is None else str(dtype).replace("torch.", ""),
        "nbytes": e[NBYTES],
        "direction": _direction(e[LABEL]),
        "state": e[STATE],
        "duration_s": round(end - e[T0], 6),
        "site": fmt_site(e[SITE]),
    }
    if e[PEERS] is not None:  # point to point: [kind, peer's global rank, tag, message number]
        d["peers"] = [list(m) for m in e[PEERS]]
    return d


_LINES: dict[tuple[Any, int], int | None] = {}


def _line(code: Any, lasti: int) -> int | None:
    """The source line of instruction offset ``lasti`` in ``code`` (cached)."""
    key = (code, lasti)
    if key not in _LINES:
        line = None
        for start, stop, ln in code.co_lines():
            if start <= lasti < stop:
                line = ln
                break
        _LINES[key] = line if line is not None else code.co_firstlineno
    return _LINES[key]


def fmt_site(site: tuple[Any, int] | None) -> str | None:
    if site is None:
        return None
    where, at = site
    line: int | None
    if isinstance(where, str):  # (path, line), e.g. parsed from a faulthandler dump
        path, line = where, at
    else:
        path, line = where.co_filename, _line(where, at)
    try:
        rel = os.path.relpath(path)
        path = rel if not rel.startswith("..") else path
    except ValueError:
        pass
    return f"{path}:{line}"


class _Group:
    """One sequence counter: a process group's (or its point-to-point messages').

    ``name`` is the same on every rank and tells apart two groups over the same ranks
    (torch's group name; the default group used as ``None`` and passed by name is one
    group, one counter). A point-to-point record also counts its messages per
    ``(kind, peer's global rank, tag)`` in ``messages``: the ``k``-th receive from a peer
    is matched by that peer's ``k``-th send to this rank with the same tag (the backend
    pairs them in that order), so a returned peer that sent fewer can never complete it
    (:func:`diffcomm.runtime.reports.stuck`)."""

    __slots__ = ("ranks", "next", "timeout", "own", "name", "messages")

    def __init__(self, ranks: tuple[int, ...], name: str) -> None:
        self.ranks = ranks
        self.next = 0
        self.timeout: float | None = None  # the setting last applied (None: the group's own)
        self.own: float | None = None  # the group's own timeout, read before the first change
        self.name = name
        self.messages: dict[tuple[str, int, int], int] = {}


_TIMEOUT, _FLIGHT = _config.TIMEOUT, _config.FLIGHT  # fixed objects (their values change)
_perf = time.perf_counter
_RING: deque[Entry] = deque(maxlen=1024)
_GROUPS: dict[Any, _Group] = {}
_LAST: list[Entry | None] = [None]
#: Called when a group is first recorded (:mod:`.responder` starts the answering thread of
#: a default group made before diffcomm was imported).
ON_NEW_GROUP: list[Callable[[], None]] = []
_WORLD_PG: list[Any] = [None]
_C10D = _torch.C10D  # torch's one record of the process groups
_INTERNAL: dict[str, bool] = {}
_DEPTH: dict[Any, tuple[int, Any]] = {}  # label -> (depth of the user's frame, its code)
_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # src/diffcomm/
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_STATUS = ["running"]  # running | returned | exited | destroyed (what the process does outside diffcomm)


def configure() -> None:
    """Resize the ring buffer to ``DIFFCOMM_FLIGHT_SIZE`` (keeping the newest entries)."""
    global _RING
    size = int(_config.FLIGHT_SIZE.get())
    if _RING.maxlen != size:
        _RING = deque(_RING, maxlen=size)


def is_internal(path: str) -> bool:
    hit = _INTERNAL.get(path)
    if hit is None:
        hit = _INTERNAL[path] = (
            (path.startswith(_PKG) and not path.startswith(_PKG + "testing" + os.sep))
            or path.startswith(_TORCH)
            or path.startswith("<frozen")
            or path.endswith(("contextlib.py", "threading.py"))
        )
    return hit


_getframe = sys._getframe


def _is_boot(f: Any) -> bool:
    """Whether ``f`` is the top level of a ``python -c`` program: a rank's own boot
    (diffcomm's fork server and spawned ranks start so, and every rank function runs above
    it). Such a frame is the site of an op called with no user frame above it (from
    diffcomm's own code), but it is never remembered as the user's depth: a later call from
    a user's function at the same stack depth would find the boot frame there and skip the
    user's frame below it (a notebook cell's all_reduce was named ``<string>:1``)."""
    return f.f_back is None and f.f_code.co_filename == "<string>"


def _site(key: Any) -> tuple[Any, int] | None:
    """The user's call site, the first frame outside diffcomm and torch, as ``(code object,
    instruction offset)``: the line number is computed only when the entry is read (asking
    a frame for ``f_lineno`` decodes its line table, about 0.4 us).

    Walking the stack frame by frame makes Python build a frame object per level (about
    1 us for a collective's depth), so the depth found is remembered per ``key`` (the op's
    label: the same label comes through the same layers) and the next call jumps straight
    there, checking that the frame is outside and the one below it inside (or, cheaper,
    that it runs the same code object as the user's frame found last time).
    """
    hit = _DEPTH.get(key)
    if hit is not None:
        k, last = hit
        try:
            f: Any = sys._getframe(k)
            code = f.f_code
            if code is last:  # the same user function as last time: no need to check again
                return (code, f.f_lasti)
            if (
                not is_internal(code.co_filename)
                and not _is_boot(f)
                and is_internal(sys._getframe(k - 1).f_code.co_filename)
            ):
                _DEPTH[key] = (k, code)
                return (code, f.f_lasti)
        except ValueError:  # a shallower stack this time
            pass
    # _site() <- begin() <- _dispatch.dispatch(): start above the first two, and walk up
    # past every diffcomm / torch frame
    depth = 2
    try:
        f = sys._getframe(depth)
    except ValueError:
        depth = 1
        f = sys._getframe(depth)
    while f is not None:
        code = f.f_code
        if not is_internal(code.co_filename):
            if not _is_boot(f):  # (a boot frame is never remembered: see _is_boot)
                _DEPTH[key] = (depth, code)
            return (code, f.f_lasti)
        f = f.f_back
        depth += 1
    return None


def _group(group: Any) -> _Group:
    key = group
    world = _torch.default_pg()
    if group is None and world is not _WORLD_PG[0]:  # a new default group: forget the old one's counters
        _WORLD_PG[0] = world
        _GROUPS.pop(None, None)
    g = _GROUPS.get(key)
    if g is None:
        if dist.is_initialized():
            pg = world if group is None else group
            g = None
            if pg is world and (group is None or _WORLD_PG[0] is world):
                # the default group as None and named explicitly: one counter
                g = _GROUPS.get(world if group is None else None)
            if g is None:
                ranks = tuple(dist.get_process_group_ranks(pg))
                g = _Group(ranks, str(getattr(pg, "group_name", None) or ",".join(map(str, ranks))))
        else:
            g = _Group((0,), "0")
        _GROUPS[key] = g
        configure()
        for hook in ON_NEW_GROUP:
            hook()
    return g


def begin(
    op: str,
    group: Any,
    nbytes: int,
    sample: torch.Tensor | None,
    label: str | None,
    messages: Messages | None = None,
) -> Entry | None:
    """Record the start of a raw op (and apply ``DIFFCOMM_TIMEOUT`` to its group);
    ``messages``: a point-to-point op's messages, counted per peer and tag whether or not
    the recorder is on (a count that skipped some would name a desync that is not one)."""
    g = _GROUPS.get(group)
    if g is None or (group is None and _C10D._default_pg is not _WORLD_PG[0]):
        g = _group(group)
    setting = _TIMEOUT
    timeout = setting.value if setting.loaded else setting.get()
    if timeout != g.timeout:
        _apply_timeout(group, g, timeout)
    flight = _FLIGHT
    on = flight.value if flight.loaded else flight.get()
    numbered = None
    if op in P2P_OPS:
        if not on and messages is None:
            return None
        g = _p2p_group(group, g)
        if messages is not None:
            numbered = _number(g, messages)
    if not on:
        return None
    seq = g.next
    g.next = seq + 1
    # _site()'s cache hit, inline (a call frame fewer on every op): the frame at the depth
    # remembered for this label (counted from _site's frame, one below this one) runs the
    # same user code as last time
    key = label or op
    hit = _DEPTH.get(key)
    try:
        f = _getframe(hit[0] - 1) if hit is not None else None
    except ValueError:  # a shallower stack this time
        f = None
    site = (f.f_code, f.f_lasti) if f is not None and f.f_code is hit[1] else _site(key)  # type: ignore[index]
    e = [
        op,
        label,
        g,
        seq,
        None if sample is None else sample.shape,
        None if sample is None else sample.dtype,
        nbytes,
        site,
        "started",
        _perf(),
        0.0,
        numbered,
    ]
    _RING.append(e)
    _LAST[0] = e
    return e


def _p2p_group(group: Any, g: _Group) -> _Group:
    # point-to-point messages have their own counter: they pair up two ranks, not a group
    key = ("p2p", g)
    p = _GROUPS.get(key)
    if p is None:
        p = _GROUPS[key] = _Group(g.ranks, g.name + "/p2p")
    return p


def _number(g: _Group, messages: Messages) -> tuple[tuple[str, int, int, int], ...]:
    """Count ``messages`` on ``g``: each as ``(kind, peer's global rank, tag, k)``, the
    ``k``-th of its kind between this rank and that peer with that tag."""
    counts, ranks, out = g.messages, g.ranks, []
    for kind, peer, tag in messages:
        key = (kind, ranks[peer], tag)
        k = counts.get(key, 0) + 1
        counts[key] = k
        out.append((*key, k))
    return tuple(out)


def end(e: Entry | None) -> None:
    if e is not None:
        e[T1] = time.perf_counter()
        e[STATE] = "completed"


def queued(e: Entry | None) -> None:
    """Mark a posted asynchronous send: not completed until its peer received it."""
    if e is not None:
        e[STATE] = "queued"
        e[T1] = 0.0


def take_last(op: str) -> Entry | None:
    """The entry :func:`begin` made last if it is an ``op`` (for the send queue to track)."""
    e, _LAST[0] = _LAST[0], None
    return e if e is not None and e[OP] == op else None


def _apply_timeout(group: Any, g: _Group, timeout: float | None) -> None:
    """``DIFFCOMM_TIMEOUT`` / ``dc.timeout`` bounds every group diffcomm talks on, also the
    user's own; back to ``None`` (a ``with dc.timeout(1)`` block ended), the group's own
    timeout again (the one it had before the first change), not the last one set."""
    before, g.timeout = g.timeout, timeout
    if not dist.is_initialized():
        return
    if before is None:
        g.own = _torch.pg_timeout(group)
    seconds = g.own if timeout is None else timeout
    if seconds is None:
        return
    try:
        _torch.set_pg_timeout(seconds, group)
    except Exception:  # a backend without settable timeouts keeps its own
        pass


def set_status(status: str) -> None:
    """What this process does outside diffcomm: ``running`` (user code) or ``returned``."""
    _STATUS[0] = status


def history() -> tuple[list[Entry], _Group | None, _Group | None]:
    """The default group's history: every entry, and its sequence and message counters
    (an in-process world's ranks join a new default group at each run, standing for the
    same world: :func:`resume` gives the next run's group this history, as a rank process
    keeps its group from run to run)."""
    g = _GROUPS.get(None) if _WORLD_PG[0] is _torch.default_pg() else None
    return list(_RING), g, (_GROUPS.get(("p2p", g)) if g is not None else None)


def resume(kept: tuple[list[Entry], _Group | None, _Group | None]) -> None:
    """Continue :func:`history` ``kept`` on the default group just made (before its first op)."""
    entries, g, p2p = kept
    _RING.extend(entries)
    if g is not None:
        _WORLD_PG[0] = _torch.default_pg()
        _GROUPS[None] = g
        if p2p is not None:
            _GROUPS[("p2p", g)] = p2p
        configure()  # as a group first recorded (:func:`_group`)
        for hook in ON_NEW_GROUP:
            hook()


def reset() -> None:
    """Forget every entry and counter (a fresh process group)."""
    _RING.clear()
    _GROUPS.clear()
    _WORLD_PG[0] = None


# --------------------------------------------------------------------------------------
# the public snapshot
# --------------------------------------------------------------------------------------


class FlightRecorder:
    """A snapshot of this rank's most recent diffcomm communications, oldest first.

    Each entry is a dict: ``op`` (the diffcomm op, e.g. ``"all_reduce(sum)"`` or
    ``"all_gather backward -> reduce_scatter(sum)"``), ``raw_op``, ``seq`` (per-group
    sequence number, the same on every rank for the same call), ``group`` (global ranks),
    ``shape``, ``dtype``, ``nbytes``, ``direction`` (``forward``/``backward``), ``state``
    (``started``/``queued``/``completed``/``failed``), ``duration_s`` and ``site`` (the
    user's ``file:line``); a point-to-point entry also ``peers``: ``[kind, peer's global
    rank, tag, k]`` per message, the ``k``-th of its kind between the two with that tag.
    """

    def __init__(self, entries: list[dict[str, Any]], rank: int, enabled: bool) -> None:
        self.entries = entries
        self.rank = rank
        self.enabled = enabled

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.entries)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.entries[i]

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "enabled": self.enabled, "entries": self.entries}

    def dump(self, path: str | os.PathLike[str]) -> Path:
        """Write the snapshot as JSON to ``path`` (``{rank}`` in the name is filled in)."""
        p = Path(str(path).replace("{rank}", str(self.rank)))
        p.write_text(json.dumps(self.as_dict(), indent=1))
        return p

    def __str__(self) -> str:
        lines = [f"diffcomm flight recorder, rank {self.rank}: {len(self.entries)} entries"]
        for e in self.entries:
            lines.append(
                f"  #{e['seq']:<5} {e['op']:<40} {e['state']:<9} {str(e['shape']):<14} "
                f"{e['dtype'] or '':<9} {e['duration_s'] * 1e3:8.3f} ms  {e['site'] or ''}"
            )
        return "\n".join(lines)

    __repr__ = __str__


def flight_recorder() -> FlightRecorder:
    """This rank's most recent diffcomm communications (``DIFFCOMM_FLIGHT_SIZE`` of them).

    Returns:
        A :class:`FlightRecorder` snapshot: iterate it for one dict per communication,
        ``.dump(path)`` for JSON, ``print()`` for a table.

    Example::

        y = dc.all_reduce(x)
        rec = dc.flight_recorder()
        rec[-1]["op"], rec[-1]["seq"], rec[-1]["site"]   # 'all_reduce(sum)', 0, 'train.py:12'
        rec.dump("flight_{rank}.json")
    """
    configure()
    now = time.perf_counter()
    entries = [_as_dict(e, now) for e in list(_RING)]
    return FlightRecorder(entries, _global_rank(), bool(_config.FLIGHT.get()))


def _global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
