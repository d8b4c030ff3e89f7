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
exit). From the answers, :func:`diagnose` (in :mod:`diffcomm.debug.diagnosis`, re-exported
here) finds the first sequence number where the ranks diverge (a different op, a
different shape, a rank that never got there) and says what every rank is doing. The
failing rank raises :class:`~diffcomm.DesyncError` with that text.
:class:`~diffcomm.LocalWorld` uses the same answers to notice at once (not after the
timeout) that a rank returned from the function while others wait for it.

The hot path (:func:`begin` / :func:`end`) costs about a microsecond per op; see
``benchmarks/bench_flight.py`` and ``docs/debugging.md``.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import _config, _lifecycle, _torch
from .._errors import DesyncError
from .diagnosis import P2P_OPS, diagnose

__all__ = ["FlightRecorder", "Entry", "flight_recorder", "diagnose"]

_PREFIX = "diffcomm/flight/"
#: seconds a diagnosing rank waits for the other ranks' answers
ANSWER_WAIT = 1.5


# --------------------------------------------------------------------------------------
# entries and the ring buffer
# --------------------------------------------------------------------------------------


# One recorded communication is a plain list (the cheapest object to build on the hot
# path), indexed by these constants; :func:`_as_dict` turns it into the public dict.
OP, LABEL, GROUP, SEQ, SHAPE, DTYPE, NBYTES, SITE, STATE, T0, T1 = range(11)
Entry = list  # [op, label, group ranks, seq, shape, dtype, nbytes, site, state, t0, t1]


def _direction(label: str | None) -> str:
    return "backward" if label is not None and "backward" in label else "forward"


def _as_dict(e: Entry, now: float | None = None) -> dict[str, Any]:
    now = time.perf_counter() if now is None else now
    end = e[T1] if e[T1] else now
    shape, dtype = e[SHAPE], e[DTYPE]
    return {
        "op": e[LABEL] or e[OP],
        "raw_op": e[OP],
        "seq": e[SEQ],
        "group": list(e[GROUP]),
        "shape": None if shape is None else list(shape),
        "dtype": None if dtype is None else str(dtype).replace("torch.", ""),
        "nbytes": e[NBYTES],
        "direction": _direction(e[LABEL]),
        "state": e[STATE],
        "duration_s": round(end - e[T0], 6),
        "site": fmt_site(e[SITE]),
    }


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
    __slots__ = ("ranks", "next", "timeout")

    def __init__(self, ranks: tuple[int, ...]) -> None:
        self.ranks = ranks
        self.next = 0
        self.timeout: float | None = None


_TIMEOUT, _FLIGHT = _config.TIMEOUT, _config.FLIGHT  # fixed objects (their values change)
_perf = time.perf_counter
_RING: deque[Entry] = deque(maxlen=1024)
_GROUPS: dict[Any, _Group] = {}
_LAST: list[Entry | None] = [None]
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
            if not is_internal(code.co_filename) and is_internal(sys._getframe(k - 1).f_code.co_filename):
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
            _DEPTH[key] = (depth, code)
            return (code, f.f_lasti)
        f = f.f_back
        depth += 1
    return None


def _group(group: Any) -> _Group:
    key = group
    if group is None:
        pg = _torch.default_pg()
        if pg is not _WORLD_PG[0]:  # a new default group: forget the old one's counters
            _WORLD_PG[0] = pg
            _GROUPS.pop(None, None)
    g = _GROUPS.get(key)
    if g is None:
        if dist.is_initialized():
            ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
        else:
            ranks = (0,)
        g = _GROUPS[key] = _Group(ranks)
        configure()
        _ensure_responder()
    return g


def begin(op: str, group: Any, nbytes: int, sample: torch.Tensor | None, label: str | None) -> Entry | None:
    """Record the start of a raw op (and apply ``DIFFCOMM_TIMEOUT`` to its group)."""
    g = _GROUPS.get(group)
    if g is None or (group is None and _C10D._default_pg is not _WORLD_PG[0]):
        g = _group(group)
    setting = _TIMEOUT
    timeout = setting.value if setting.loaded else setting.get()
    if timeout != g.timeout:
        _apply_timeout(group, g, timeout)
    setting = _FLIGHT
    if not (setting.value if setting.loaded else setting.get()):
        return None
    if op in P2P_OPS:
        g = _p2p_group(group, g)
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
        g.ranks,
        seq,
        None if sample is None else sample.shape,
        None if sample is None else sample.dtype,
        nbytes,
        site,
        "started",
        _perf(),
        0.0,
    ]
    _RING.append(e)
    _LAST[0] = e
    return e


def _p2p_group(group: Any, g: _Group) -> _Group:
    # point-to-point messages have their own counter: they pair up two ranks, not a group
    key = ("p2p", group)
    p = _GROUPS.get(key)
    if p is None:
        p = _GROUPS[key] = _Group(g.ranks)
    return p


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
    """``DIFFCOMM_TIMEOUT`` bounds every group diffcomm talks on, also the user's own."""
    g.timeout = timeout
    if timeout is None or not dist.is_initialized():
        return
    try:
        _torch.set_pg_timeout(timeout, group)
    except Exception:  # noqa: BLE001 - a backend without settable timeouts keeps its own
        pass


def set_status(status: str) -> None:
    """What this process does outside diffcomm: ``running`` (user code) or ``returned``."""
    _STATUS[0] = status


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
    user's ``file:line``).
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


# --------------------------------------------------------------------------------------
# answering through the store
# --------------------------------------------------------------------------------------


def _state(recent: int = 64) -> dict[str, Any]:
    now = time.perf_counter()
    entries = list(_RING)
    busy = [e for e in entries if e[STATE] == "started"]
    if not busy and entries and entries[-1][STATE] == "failed":
        busy = [entries[-1]]  # it just gave up on this one (its own timeout)
    counts = {
        ",".join(map(str, g.ranks)) + ("/p2p" if isinstance(k, tuple) else ""): g.next
        for k, g in list(_GROUPS.items())
    }
    return {
        "rank": _global_rank(),
        "pid": os.getpid(),
        "status": _STATUS[0],
        "inflight": [_as_dict(e, now) for e in busy],
        "recent": [_as_dict(e, now) for e in entries[-recent:]],
        "counts": counts,
    }


def _base_store(store: Any) -> Any:
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store


def _connection(store: Any) -> Any:
    """A private client connection to the TCP store behind ``store``, keeping the key
    prefixes on the way (torchrun's per-attempt prefix, the default group's): None if the
    store is not a TCP store (no cross-rank diagnosis, own view only)."""
    if not isinstance(_base_store(store), dist.TCPStore):
        return None
    if hasattr(store, "clone"):
        return store.clone()
    base = _base_store(store)  # torch without Store.clone: the bare store, prefixes lost
    return dist.TCPStore(
        base.host, base.port, None, False, timeout=datetime.timedelta(seconds=30), wait_for_workers=False
    )


#: seconds a stopping rank 0 waits for the other ranks' answering threads to stop (its
#: process may host the store server: closing it under their waits makes torch print
#: "recvValueWithTimeout failed" on every other rank)
STOP_WAIT = 5.0
#: seconds a stop waits for its thread to leave the store
JOIN_WAIT = 2.0
_FAILED = [False]  # a communication failed here: peers may be dead, rank 0's stop waits less for them
_SERIAL = [0]


class _Responder:
    """The thread that answers diagnosis requests, for one store namespace.

    One per process group lifetime (``pinned=False``: the current default group, started
    at ``init_process_group`` and stopped at ``destroy_process_group`` or exit), or one per
    :class:`~diffcomm.LocalWorld` rank (``pinned=True``: the world's own store, for the
    rank's life). Requests and answers use per-rank keys under ``ns`` (``req/<gen>/<rank>``,
    ``state/<gen>/<rank>``), so the owner wakes its own thread with a token of its own
    and joins it: the thread never waits in the store past its owner's stop.
    """

    def __init__(self, store: Any, rank: int, world: int, pinned: bool, pg: Any = None) -> None:
        self.waiter = _connection(store)
        self.asker = _connection(store) if self.waiter is not None else None
        self.rank, self.world, self.pinned, self.pg = rank, world, pinned, pg
        self.ns = _PREFIX
        self.stopped = self.waiter is None
        if self.stopped:
            return
        if not pinned:
            # every rank starts one per default group: the arrivals counter gives the group's
            # epoch, the same on every rank, so a store that outlives a group (a user's own,
            # torchrun's agent store within an attempt) never mixes two groups' keys
            arrived = int(self.asker.add(f"{_PREFIX}arrivals", 1))
            self.ns = f"{_PREFIX}{(arrived - 1) // max(world, 1)}/"
        self.gen = int(self.asker.add(f"{self.ns}gen", 0)) + 1
        _SERIAL[0] += 1
        self.token = f"stop:{os.getpid()}:{_SERIAL[0]}"
        self.thread = threading.Thread(target=self._loop, name="diffcomm-flight", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        store, me, ns = self.waiter, self.rank, self.ns
        while not self.stopped:
            key = f"{ns}req/{self.gen}/{me}"
            try:
                store.wait([key], datetime.timedelta(days=7))  # woken by a request or by stop()
                if store.get(key).decode() == self.token:
                    return
                store.set(f"{ns}state/{self.gen}/{me}", json.dumps(_state()))
            except Exception:  # noqa: BLE001 - the store is gone: the world is over
                return
            self.gen += 1

    def stop(self, wait_peers: bool) -> None:
        """Publish this rank's last state, wake and join the thread, close the connections;
        rank 0 first waits (bounded) until every other rank's thread has stopped."""
        if self.stopped:
            return
        self.stopped = True
        asker, ns, me = self.asker, self.ns, self.rank
        try:
            asker.set(f"{ns}final/{me}", json.dumps(_state()))
            gen = self.gen
            for g in (gen, gen + 1):
                asker.set(f"{ns}req/{g}/{me}", self.token)
        except Exception:  # noqa: BLE001 - the store is gone, and with it the thread's wait
            pass
        self.thread.join(JOIN_WAIT)
        try:
            asker.set(f"{ns}stopped/{me}", "1")
            if wait_peers and not self.pinned and me == 0 and self.world > 1:
                # after a failure the peers still diagnose through this store: stay for
                # their questions, but not for a dead rank's marker
                keys = [f"{ns}stopped/{r}" for r in range(1, self.world)]
                deadline = time.monotonic() + (ANSWER_WAIT + 1.5 if _FAILED[0] else STOP_WAIT)
                while not asker.check(keys) and time.monotonic() < deadline:
                    time.sleep(0.005)
        except Exception:  # noqa: BLE001
            pass
        self.waiter = self.asker = None


_RESPONDER: list[_Responder | None] = [None]


def start_responder(store: Any = None, rank: int | None = None, world: int | None = None) -> None:
    """Start the thread that answers diagnosis requests: pinned to ``store`` (a
    :class:`~diffcomm.LocalWorld` rank's world store, for the process's life) or, with no
    store, for the current default group (replacing the previous group's)."""
    cur = _RESPONDER[0]
    if store is not None:
        if cur is not None:
            cur.stop(wait_peers=False)
        if world is None:
            world = dist.get_world_size() if dist.is_initialized() else 1
        _RESPONDER[0] = _Responder(store, _global_rank() if rank is None else rank, world, pinned=True)
        return
    if not dist.is_initialized():
        return
    pg = _torch.default_pg()
    if cur is not None and (cur.pinned or cur.pg is pg):
        return
    if cur is not None:
        cur.stop(wait_peers=False)  # a group destroyed behind diffcomm's back: its store is gone
    try:
        base = _torch.default_store()
        _RESPONDER[0] = _Responder(base, dist.get_rank(), dist.get_world_size(), pinned=False, pg=pg)
    except Exception:  # noqa: BLE001 - no store, no cross-rank diagnosis (own view only)
        _RESPONDER[0] = None


def _ensure_responder() -> None:
    if dist.is_initialized():
        start_responder()


def _stop(group: Any, exiting: bool) -> None:
    """The recorder's part of :func:`diffcomm._lifecycle.stop_all`: a destroyed default
    group (or the exit) stops its answering thread and ends its history (the next group's
    sequence numbers start at 0, and a diagnosis never sees the old group's entries)."""
    if group is not None:  # a subgroup: its counters go with it
        _GROUPS.pop(group, None)
        _GROUPS.pop(("p2p", group), None)
        return
    cur = _RESPONDER[0]
    if cur is not None and (exiting or not cur.pinned):
        _STATUS[0] = "exited" if exiting else "destroyed"
        cur.stop(wait_peers=True)
        _RESPONDER[0] = None
    if not exiting:
        reset()  # the next default group starts its counters (and this history) afresh


_lifecycle.on_destroy("flight recorder", _stop)
_lifecycle.on_init("flight recorder", _ensure_responder)


def request_states(
    store: Any, ranks: list[int], wait: float = ANSWER_WAIT, ns: str = _PREFIX
) -> dict[int, dict[str, Any] | None]:
    """Ask every rank in ``ranks`` for its state through ``store`` (keys under ``ns``);
    None for the silent."""
    gen = int(store.add(f"{ns}gen", 1))
    req = [f"{ns}req/{gen}/{r}" for r in ranks]
    if hasattr(store, "multi_set"):
        store.multi_set(req, ["1"] * len(req))
    else:
        for k in req:
            store.set(k, "1")
    keys = {r: f"{ns}state/{gen}/{r}" for r in ranks}
    deadline = time.monotonic() + wait
    out: dict[int, dict[str, Any] | None] = {}
    pending = dict(keys)
    while pending and time.monotonic() < deadline:
        for r, k in list(pending.items()):
            final = f"{ns}final/{r}"  # what a rank left behind when its process exited
            if store.check([k]):
                out[r] = json.loads(store.get(k))
                del pending[r]
            elif store.check([final]):
                out[r] = json.loads(store.get(final))
                del pending[r]
        if pending:
            time.sleep(0.02)
    for r in pending:
        out[r] = None
    return out


# --------------------------------------------------------------------------------------
# the failure path of a raw op
# --------------------------------------------------------------------------------------

_TIMEOUT_MARKERS = ("timed out", "timeout", "time out", "deadline")
_PEER_MARKERS = ("connection reset", "connection closed", "read error", "broken pipe", "doesn't match")


def failed(
    e: Entry | None, op: str, group: Any, err: BaseException, label: str | None
) -> BaseException | None:
    """The error to raise for a failed raw op (None: re-raise ``err`` unchanged).

    A timeout, or a peer that vanished mid-op, becomes :class:`~diffcomm.DesyncError`
    carrying the cross-rank diagnosis (when the store answers) — on every rank.
    """
    text = str(err).lower()
    timeout = any(m in text for m in _TIMEOUT_MARKERS)
    if not timeout and not any(m in text for m in _PEER_MARKERS):
        return None
    if e is not None:
        e[STATE] = "failed"
        e[T1] = time.perf_counter()
    rank = _global_rank()
    what = label or op
    focus = _as_dict(e) if e is not None else None
    if focus is not None:
        focus["state"] = "started"
    diagnosis, facts = "", {"culprits": [], "seq": None}
    _FAILED[0] = True
    resp = _RESPONDER[0]
    if resp is not None and not resp.stopped and focus is not None:
        try:
            states = request_states(resp.asker, list(range(dist.get_world_size())), ns=resp.ns)
            states[rank] = {**(states.get(rank) or _state()), "inflight": [focus]}
            diagnosis, facts = diagnose(states, focus)
        except Exception as exc:  # noqa: BLE001 - the plain message still goes out
            diagnosis = f"(the cross-rank diagnosis failed: {exc})"
    backward = (label or "").find("backward") >= 0
    how = "timed out" if timeout else "failed (a peer left mid-op)"
    head = f"diffcomm: `{what}` (raw {op}"
    head += f", sequence number #{e[SEQ]} on group {list(e[GROUP])}" if e is not None else ""
    head += f") {how} on global rank {rank}"
    if diagnosis:
        msg = f"{head}: {diagnosis}\nBackend error: {err}"
    elif backward:
        msg = (
            f"{head} waiting for the other ranks of its group. The op is a backward: under autograd "
            f"the usual cause is that one rank's loss does not use an output of a collective, so "
            f"PyTorch skips that collective's backward on that rank while the others wait for it. "
            f"Fix: make every rank's loss touch every collective output (e.g. add `0 * out.sum()`), "
            f"and make every rank run the same sequence of collectives. Backend error: {err}"
        )
    else:
        msg = (
            f"{head} waiting for the other ranks of its group: a rank did not call it, called "
            f"another op, or called it with another shape. Make every rank run the same sequence "
            f"of collectives (DIFFCOMM_DEBUG=1 checks shapes). Backend error: {err}"
        )
    return DesyncError(msg, facts)
