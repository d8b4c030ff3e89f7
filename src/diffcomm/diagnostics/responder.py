"""The answering side of the flight recorder, and the failure path of a raw op.

When a communication fails (a ``DIFFCOMM_TIMEOUT`` timeout, or a peer that vanished),
the failing rank asks every rank for its recent entries (:mod:`diffcomm.diagnostics.recorder`'s
ring) through the **rendezvous store** — a TCP key-value store that still works while the
process group is stuck. Each rank answers from a small daemon thread (:class:`_Responder`,
started with the default group or a :class:`~diffcomm.LocalWorld` rank, stopped and joined
when the group is destroyed or the process exits; a rank that exited leaves its last
entries behind). :func:`failed` turns the answers, through
:func:`~diffcomm.diagnostics.diagnosis.diagnose`, into :class:`~diffcomm.DesyncError`;
:func:`request_states` is also how :class:`~diffcomm.LocalWorld` notices at once that a
rank returned while others wait for it.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import torch.distributed as dist

from .. import _lifecycle, _torch
from .._errors import DesyncError
from . import recorder as _recorder
from .diagnosis import diagnose
from .recorder import (
    _GROUPS,
    _STATUS,
    GROUP,
    ON_NEW_GROUP,
    SEQ,
    STATE,
    T1,
    Entry,
    _as_dict,
    _global_rank,
    reset,
)

__all__ = ["start_responder", "request_states", "failed"]

_PREFIX = "diffcomm/flight/"
#: seconds a diagnosing rank waits for the other ranks' answers
ANSWER_WAIT = 1.5


# --------------------------------------------------------------------------------------
# answering through the store
# --------------------------------------------------------------------------------------


def _state(recent: int = 64) -> dict[str, Any]:
    now = time.perf_counter()
    entries = list(_recorder._RING)  # (read now: resizing to DIFFCOMM_FLIGHT_SIZE rebinds it)
    busy = [e for e in entries if e[STATE] == "started"]
    if not busy and entries and entries[-1][STATE] == "failed":
        busy = [entries[-1]]  # it just gave up on this one (its own timeout)
    groups = list(_GROUPS.values())
    counts = {g.name: g.next for g in groups}
    # point-to-point messages begun per group, "kind|peer|tag" -> count (a newer group of
    # the same name, inserted later, wins as in ``counts``)
    messages = {
        g.name: {f"{k}|{q}|{t}": n for (k, q, t), n in g.messages.items()} for g in groups if g.messages
    }
    return {
        "rank": _global_rank(),
        "pid": os.getpid(),
        "status": _STATUS[0],
        "inflight": [_as_dict(e, now) for e in busy],
        "recent": [_as_dict(e, now) for e in entries[-recent:]],
        "counts": counts,
        "messages": messages,
    }


def _base_store(store: Any) -> Any:
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store


#: seconds a stopping rank 0 waits for the other ranks' answering threads to stop (its
#: process may host the store server: closing it under their requests makes torch print
#: "recvValue failed" on every other rank)
STOP_WAIT = 5.0
#: seconds a stop waits for its thread to leave the store
JOIN_WAIT = 2.0
#: seconds between two looks of the answering thread for a request (answers come within
#: this; a diagnosing rank waits ANSWER_WAIT for them)
POLL = 0.1
_FAILED = [False]  # a communication failed here: peers may be dead, rank 0's stop waits less for them


class _Responder:
    """The thread that answers diagnosis requests, for one store namespace.

    One per process group lifetime (``pinned=False``: the current default group, started
    at ``init_process_group`` and stopped at ``destroy_process_group`` or exit), or one per
    :class:`~diffcomm.LocalWorld` rank (``pinned=True``: the world's own store, for the
    rank's life). Requests and answers use per-rank keys under ``ns`` (``req/<gen>/<rank>``,
    ``state/<gen>/<rank>``).

    The thread talks through the group's **own** store connection and *polls* it (a short
    ``check`` every :data:`POLL` seconds) rather than waiting in it: it opens no connection
    of its own, so a group's start makes no burst of new connections to rank 0's store
    (every rank opening two at the same instant stalled the connects for 5 s and with them
    the third group's first op, docs/debugging.md), and it is never inside the C++ store
    for longer than one round trip, so its stop joins it at once and it never outlives
    the store.
    """

    def __init__(self, store: Any, rank: int, world: int, pinned: bool, pg: Any = None) -> None:
        tcp = isinstance(_base_store(store), dist.TCPStore)
        self.asker: Any = store if tcp else None  # None: no cross-rank diagnosis, own view only
        self.rank, self.world, self.pinned, self.pg = rank, world, pinned, pg
        self.ns = _PREFIX
        self.stopped = not tcp
        if self.stopped:
            return
        if not pinned:
            # every rank starts one per default group: the arrivals counter gives the group's
            # epoch, the same on every rank, so a store that outlives a group (a user's own,
            # torchrun's agent store within an attempt) never mixes two groups' keys
            arrived = int(store.add(f"{_PREFIX}arrivals", 1))
            self.ns = f"{_PREFIX}{(arrived - 1) // max(world, 1)}/"
        self.gen = int(store.add(f"{self.ns}gen", 0)) + 1
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="diffcomm-flight", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        store, me, ns, halt = self.asker, self.rank, self.ns, self.halt
        while not halt.wait(POLL):
            key = f"{ns}req/{self.gen}/{me}"
            try:
                if not store.check([key]):
                    continue
                store.set(f"{ns}state/{self.gen}/{me}", json.dumps(_state()))
            except Exception:  # the store is gone: the world is over
                return
            self.gen += 1

    def stop(self, wait_peers: bool) -> None:
        """Stop and join the thread, publish this rank's last state; rank 0 then waits
        (bounded) until every other rank's thread has stopped."""
        if self.stopped:
            return
        self.stopped = True
        self.halt.set()
        self.thread.join(JOIN_WAIT)
        asker, ns, me = self.asker, self.ns, self.rank
        try:
            asker.set(f"{ns}final/{me}", json.dumps(_state()))
            asker.set(f"{ns}stopped/{me}", "1")
            if wait_peers and not self.pinned and me == 0 and self.world > 1:
                # after a failure the peers still diagnose through this store: stay for
                # their questions, but not for a dead rank's marker
                keys = [f"{ns}stopped/{r}" for r in range(1, self.world)]
                deadline = time.monotonic() + (ANSWER_WAIT + 1.5 if _FAILED[0] else STOP_WAIT)
                while not asker.check(keys) and time.monotonic() < deadline:
                    time.sleep(0.005)
        except Exception:  # the store is gone
            pass
        self.asker = None


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
    except Exception:  # no store, no cross-rank diagnosis (own view only)
        _RESPONDER[0] = None


def _ensure_responder() -> None:
    if dist.is_initialized():
        start_responder()


def _stop(group: Any, exiting: bool) -> None:
    """The recorder's part of :func:`diffcomm._lifecycle.stop_all`: a destroyed default
    group (or the exit) stops its answering thread and ends its history (the next group's
    sequence numbers start at 0, and a diagnosis never sees the old group's entries)."""
    if group is not None:  # a subgroup: its counters go with it
        g = _GROUPS.pop(group, None)
        _GROUPS.pop(("p2p", g), None)
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
ON_NEW_GROUP.append(_ensure_responder)


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
    diagnosis, facts = "", dict[str, Any](culprits=[], seq=None)
    _FAILED[0] = True
    resp = _RESPONDER[0]
    if resp is not None and not resp.stopped and focus is not None:
        try:
            states = request_states(resp.asker, list(range(dist.get_world_size())), ns=resp.ns)
            states[rank] = {**(states.get(rank) or _state()), "inflight": [focus]}
            diagnosis, facts = diagnose(states, focus)
        except Exception as exc:  # the plain message still goes out
            diagnosis = f"(the cross-rank diagnosis failed: {exc})"
    backward = (label or "").find("backward") >= 0
    how = "timed out" if timeout else "failed (a peer closed its connection mid-op)"
    head = f"diffcomm: `{what}` (raw {op}"
    head += f", sequence number #{e[SEQ]} on group {list(e[GROUP].ranks)}" if e is not None else ""
    head += f") {how} on global rank {rank}"
    if diagnosis:
        msg = f"{head}: {diagnosis}\nBackend error: {err}"
    elif backward:
        msg = (
            f"{head} waiting for the other ranks of its group. The op is a backward: under autograd "
            f"the usual cause is that one rank's loss does not use an output of a collective, so "
            f"PyTorch skips that collective's backward on that rank while the others wait for it. "
            f"Fix: make every rank's loss touch every collective output (e.g. add `0 * out.sum()`), "
            f"and make every rank run the same sequence of collectives. Another cause: a parameter "
            f"frozen (requires_grad_(False)) on some ranks only (DIFFCOMM_DEBUG=1 checks the "
            f"flags). Backend error: {err}"
        )
    else:
        msg = (
            f"{head} waiting for the other ranks of its group: a rank did not call it, called "
            f"another op, or called it with another shape. Make every rank run the same sequence "
            f"of collectives (DIFFCOMM_DEBUG=1 checks shapes). Backend error: {err}"
        )
    return DesyncError(msg, facts)
