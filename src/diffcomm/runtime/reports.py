"""What went wrong in a :class:`~diffcomm.LocalWorld` run, in words.

:mod:`diffcomm.runtime.world` watches the ranks and decides *when* a run failed (a rank raised,
died, returned while others wait, or the run timed out); this module says *what*: the
exception objects and tracebacks the ranks sent back, the message of each error, and the
two early diagnoses built from the ranks' flight records (asked through the rendezvous
store): a rank the backend aborted mid-collective, and a rank that returned from the
function while the others wait for it in a communication it never reached.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import cloudpickle

from .._errors import DesyncError, RankDesyncError
from ..diagnostics import recorder as _flight
from ..diagnostics import responder as _responder
from ..diagnostics.diagnosis import P2P_OPS, diagnose, signature


def exceptions(replies: dict[int, tuple[str, Any]]) -> dict[int, BaseException]:
    """The exception objects the failed ranks sent back (those that unpickle here)."""
    out: dict[int, BaseException] = {}
    for r, (kind, value) in replies.items():
        if kind == "err" and value[1] is not None:
            try:
                out[r] = cloudpickle.loads(value[1])
            except Exception:  # the traceback text is still reported
                pass
    return out


def tracebacks(failures: dict[int, str]) -> str:
    return "".join(f"\n\n--- rank {r} traceback ---\n{tb}" for r, tb in sorted(failures.items()))


def failure_message(failures: dict[int, str], fatal: bool) -> str:
    ranks = sorted(failures)
    last = failures[ranks[0]].strip().splitlines()[-1] if failures[ranks[0]].strip() else ""
    note = " The process group is unusable after this error; the world was torn down." if fatal else ""
    stop = "" if last.endswith((".", "!", "?")) else "."  # never "..": the message's own period
    return f"rank(s) {ranks} raised: {last}{stop}{note}" + tracebacks(failures)


def aborted_in(fault_text: str) -> tuple[str | None, str | None]:
    """(raw backend op, user call site) of the main thread in a faulthandler dump."""
    blocks = fault_text.split("\n\n")
    for block in blocks:
        frames = [ln.strip() for ln in block.splitlines() if ln.strip().startswith("File ")]
        raw = site = None
        for ln in frames:  # most recent call first
            try:
                path = ln.split('"')[1]
                lineno, func = ln.rsplit(" line ", 1)[1].split(" in ", 1)
            except (IndexError, ValueError):
                continue
            if raw is None and path.endswith(os.path.join("diffcomm", "backend", "torch_distributed.py")):
                if func[:1] not in ("_", "<"):  # the backend's public op, not its plumbing
                    raw = func
            elif raw is not None and site is None and not _flight.is_internal(path) and path[:1] != "<":
                site = _flight.fmt_site((path, int(lineno)))
        if raw is not None:
            return raw, site
    return None, None


def idle_ranks(reply: tuple[str, Any]) -> set[int]:
    """Ranks a rank's :class:`DesyncError` found in no communication (busy in user code,
    returned, silent): they will send no report, so the caller need not wait for one."""
    exc = exceptions({0: reply}).get(0)
    return set(exc.facts.get("idle", ())) if isinstance(exc, DesyncError) else set()


def desync_story(exceptions: dict[int, BaseException]) -> tuple[str, dict[str, Any]] | None:
    """The first rank's :class:`DesyncError` text and facts, if any rank raised one."""
    for r in sorted(exceptions):
        exc = exceptions[r]
        if isinstance(exc, DesyncError):
            return f"rank {r}: {exc}", dict(exc.facts)
    return None


def abort_story(
    died: dict[int, int | None], fault_text: Callable[[int], str], store: Any, world_size: int
) -> str:
    """Why a rank was aborted (SIGABRT) mid-collective, from its faulthandler stacks and
    the survivors' flight records; leads the :class:`RankDiedError` message."""
    lines = []
    for r in sorted(died):
        if died[r] != -signal.SIGABRT:
            continue
        raw, site = aborted_in(fault_text(r))
        if raw is None:
            continue
        lines.append(
            f"rank {r} was aborted by the backend inside raw `{raw}`"
            + (f" called from {site}" if site else "")
        )
    if not lines:
        return ""
    others: list[str] = []
    alive = [r for r in range(world_size) if r not in died]
    try:
        states = _responder.request_states(store, alive, wait=0.3) if store is not None and alive else {}
    except Exception:
        states = {}
    for r in alive:
        for e in (states.get(r) or {}).get("inflight", []):
            shape = f", shape {tuple(e['shape'])} {e['dtype']}" if e.get("shape") is not None else ""
            site = f", from {e['site']}" if e.get("site") else ""
            others.append(f"rank {r} was in `{e['op']}` #{e['seq']} on group {e['group']}{shape}{site}")
    return (
        "; ".join(lines + others) + ". gloo aborts a rank whose collective receives more bytes than "
        "it expects: the ranks called this collective with different shapes (or different ops). "
        "DIFFCOMM_DEBUG=1 compares shapes before any data moves and names the ranks.\n"
    )


def desync_check(
    store: Any, world_size: int, returned: list[int], busy: list[int], what: str
) -> RankDesyncError | None:
    """A :class:`RankDesyncError` if a busy rank waits in a communication that a rank
    which already returned never reached; else None (the busy ranks are just slower)."""
    if store is None:
        return None
    try:
        states = _responder.request_states(store, list(range(world_size)), wait=0.5)
    except Exception:  # no answers, no early diagnosis (the timeout still applies)
        return None
    return stuck(states, returned, busy, what)


def stuck(
    states: dict[int, dict[str, Any] | None], returned: list[int], busy: list[int], what: str
) -> RankDesyncError | None:
    """:func:`desync_check` on the ranks' recorded states (``{rank: state}``): a busy rank
    waits in a collective that a returned rank never reached, or finished as another op."""
    for p in busy:
        s = states.get(p)
        for e in (s or {}).get("inflight", []):
            if e["raw_op"] in P2P_OPS:
                found = _unsent(states, returned, p, e, what)
                if found is not None:
                    return found
                continue  # p2p sequence numbers are per process, not aligned across ranks
            gone = [
                q
                for q in returned
                if q in e["group"] and (st := states.get(q)) and st["counts"].get(e["gid"], 0) <= e["seq"]
            ]
            sig = signature(e)
            # a returned rank that did complete this sequence number, but as another
            # op or with another shape (gloo may let it through with wrong values)
            other = [
                q
                for q in returned
                if q in e["group"]
                and q not in gone
                and any(
                    x["gid"] == e["gid"] and x["seq"] == e["seq"] and signature(x) != sig
                    for x in (states.get(q) or {}).get("recent", [])
                )
            ]
            if not gone and not other:
                continue
            text, facts = diagnose(states, e)
            facts["returned"] = gone or other
            if not gone:
                return RankDesyncError(
                    f"LocalWorld: rank(s) {other} finished `{e['op']}` #{e['seq']} (group "
                    f"{e['group']}) as another op or with another shape and returned from `{what}`, "
                    f"while rank {p} waits in it — a desync; the world was torn down (it restarts "
                    f"at the next run).\n{text}",
                    facts,
                )
            waiting = [
                r
                for r in busy
                if any(x["seq"] == e["seq"] for x in (states.get(r) or {}).get("inflight", []))
            ]
            return RankDesyncError(
                f"LocalWorld: rank(s) {gone} returned from `{what}` while rank(s) {waiting or [p]} "
                f"wait for them in `{e['op']}` (sequence number #{e['seq']} on group {e['group']}"
                f"{', from ' + e['site'] if e.get('site') else ''}) — a desync; the world was torn "
                f"down (it restarts at the next run).\n{text}",
                facts,
            )
    return None


#: seconds a receive waits before a returned peer's missing send is called a desync (the
#: counts already prove it; this only keeps a raw ``torch.distributed`` send, which the
#: recorder does not count, from being overtaken by the check while still in flight)
_P2P_SETTLE = 0.1


def _unsent(
    states: dict[int, dict[str, Any] | None], returned: list[int], p: int, e: dict[str, Any], what: str
) -> RankDesyncError | None:
    """A receive of busy rank ``p`` that a returned peer never sent: the ``k``-th receive
    from a peer (tag, group) waits for that peer's ``k``-th send to ``p``, and a peer that
    returned after ``n < k`` of them sends no more. (The count of receives begun is never
    above the message's place in the backend's order, so a count can only miss a desync,
    never invent one.)"""
    if e.get("state") != "started" or e.get("duration_s", 0.0) < _P2P_SETTLE:
        return None
    for kind, q, tag, k in e.get("peers") or ():
        if kind != "recv" or q not in returned or not (st := states.get(q)):
            continue
        sent = (st.get("messages") or {}).get(e["gid"], {}).get(f"send|{p}|{tag}", 0)
        if sent >= k:
            continue
        site = f" (from {e['site']})" if e.get("site") else ""
        group = list(e["group"])
        facts = {
            "group": group,
            "seq": None,
            "culprits": [q],
            "op": e["op"],
            "direction": e.get("direction"),
            "idle": [q],
            "returned": [q],
        }
        return RankDesyncError(
            f"LocalWorld: rank {q} returned from `{what}` and sends rank {p} nothing more (tag "
            f"{tag} on group {group}: {sent} message(s) sent, all received), while rank {p} "
            f"waits in `{e['op']}`{site} for one more from it — a desync (a send missing on rank "
            f"{q}, or a receive too many on rank {p}); the world was torn down (it restarts at "
            f"the next run).",
            facts,
        )
    return None


#: seconds a receive must have waited before it counts in :func:`deadlock` (a raw
#: ``torch.distributed`` send, which the recorder does not count, has long arrived by then)
_DEADLOCK_SETTLE = 0.5
#: seconds between the two looks :func:`deadlock_check` compares
_DEADLOCK_RELOOK = 0.2


def deadlock_check(store: Any, world_size: int, what: str) -> RankDesyncError | None:
    """A :class:`RankDesyncError` if ranks wait in receives that no rank can serve any more
    (:func:`deadlock`), seen alike in two looks at the ranks' flight records; else None."""
    if store is None:
        return None
    ranks = list(range(world_size))
    try:
        first = _responder.request_states(store, ranks, wait=0.5)
        if deadlock(first, ranks) is None:
            return None
        time.sleep(_DEADLOCK_RELOOK)
        second = _responder.request_states(store, ranks, wait=0.5)
    except Exception:  # no answers, no early diagnosis (the timeout still applies)
        return None
    found = deadlock(second, ranks)
    if found is None or found[0] != deadlock(first, ranks)[0]:  # type: ignore[index]
        return None  # a rank moved between the looks: no verdict
    return _deadlock_error(found[1], what)


def deadlock(
    states: dict[int, dict[str, Any] | None], ranks: list[int]
) -> tuple[tuple[Any, ...], dict[int, tuple[dict[str, Any], list[tuple[int, int, int, int]]]]] | None:
    """The ranks stuck in receives that can never complete, or None.

    A rank counts when its one communication in flight is a receive (started at least
    ``_DEADLOCK_SETTLE`` s ago: the thread is blocked in it) of the ``k``-th message from a
    peer that has begun fewer than ``k`` sends to it (sends queued or in flight count: the
    counter moves when a send begins). Ranks whose awaited peers are all such ranks can
    never be served: nobody among them can send again. A rank that does anything else
    (runs user code, waits in a collective or a send) might still send, and so might
    free the ranks waiting on it: they are not counted (no deadlock is ever invented).

    Returns ``(key, {rank: (entry, [(peer, tag, k, sent), ...])})``: ``key`` identifies
    the situation (each stuck rank's receive and the counts), to compare two looks.
    """
    waits: dict[int, tuple[dict[str, Any], list[tuple[int, int, int, int]]]] = {}
    for p in ranks:
        s = states.get(p)
        if s is None:
            return None  # a rank that did not answer: no verdict
        inflight = s.get("inflight") or []
        if len(inflight) != 1:
            continue
        e = inflight[0]
        peers = e.get("peers") or []
        if (
            e.get("raw_op") != "recv"
            or e.get("state") != "started"
            or e.get("duration_s", 0.0) < _DEADLOCK_SETTLE
            or not peers
            or any(m[0] != "recv" for m in peers)
        ):
            continue
        missing = []
        for _kind, q, tag, k in peers:
            sent = ((states.get(q) or {}).get("messages") or {}).get(e["gid"], {}).get(f"send|{p}|{tag}", 0)
            missing.append((q, tag, k, sent))
        if all(sent < k for _q, _tag, k, sent in missing):
            waits[p] = (e, missing)
    stuck = set(waits)
    changed = True
    while changed:  # keep the ranks whose every awaited peer is stuck too
        changed = False
        for p in sorted(stuck):
            if any(q not in stuck for q, *_ in waits[p][1]):
                stuck.discard(p)
                changed = True
    if not stuck:
        return None
    found = {p: waits[p] for p in sorted(stuck)}
    key = tuple((p, e["gid"], e.get("seq"), tuple(map(tuple, m))) for p, (e, m) in found.items())
    return key, found


def _deadlock_error(
    found: dict[int, tuple[dict[str, Any], list[tuple[int, int, int, int]]]], what: str
) -> RankDesyncError:
    lines = []
    for p, (e, missing) in found.items():
        site = f" from {e['site']}" if e.get("site") else ""
        waits_for = "; ".join(
            f"message #{k} from rank {q} on tag {tag}, which has sent it {sent}"
            for q, tag, k, sent in missing
        )
        lines.append(f"  rank {p}: waits in `{e['op']}`{site} for {waits_for}")
    ranks = sorted(found)
    first = found[ranks[0]][0]
    facts = {
        "group": list(first["group"]),
        "seq": None,
        "culprits": ranks,
        "op": first["op"],
        "direction": first.get("direction"),
        "idle": [],
        "returned": [],
        "deadlock": ranks,
    }
    return RankDesyncError(
        f"LocalWorld: rank(s) {ranks} all wait in a receive during `{what}` and none of them "
        "can send any more: a point-to-point deadlock (every rank receives first, nobody "
        "sends); the world was torn down (it restarts at the next run).\n"
        + "\n".join(lines)
        + "\n(Messages count per peer and tag, a tensor's header and data apart.) Post the send "
        "before the receive on one side, or use dc.sendrecv (send and "
        "receive at once, deadlock-free).",
        facts,
    )
