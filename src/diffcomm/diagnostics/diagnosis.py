"""The desync diagnosis: explain a stuck or failed communication from every rank's
flight record.

Pure analysis on the states the ranks answered with (plain dicts, as
:func:`diffcomm.diagnostics.responder.request_states` returns them): :func:`diagnose` finds the first
sequence number where the ranks diverge (a different op, a different shape, a rank that
never got there) and says what every rank is doing. The recorder itself lives in
:mod:`diffcomm.diagnostics.recorder` (which re-exports :func:`diagnose`), the asking in
:mod:`diffcomm.diagnostics.responder`.
"""

from __future__ import annotations

from typing import Any

from .raw_ops import P2P_OPS as P2P_OPS
from .raw_ops import RAW_OPS

__all__ = ["diagnose", "signature", "P2P_OPS"]


def signature(e: dict[str, Any]) -> tuple[Any, ...]:
    row = RAW_OPS.get(e["raw_op"])
    if row is not None and row.shape_free:
        return (e["op"], e["raw_op"])
    return (e["op"], e["raw_op"], tuple(e["shape"] or ()), e["dtype"])


def _desc(e: dict[str, Any], with_shape: bool = True) -> str:
    shape = f", shape {tuple(e['shape'])} {e['dtype']}" if with_shape and e.get("shape") is not None else ""
    site = f" from {e['site']}" if e.get("site") else ""
    return f"`{e['op']}` #{e['seq']}{shape}{site}"


def _group_entries(state: dict[str, Any], gid: str, p2p: bool) -> dict[int, dict[str, Any]]:
    return {
        e["seq"]: e for e in state.get("recent", []) if e["gid"] == gid and (e["raw_op"] in P2P_OPS) == p2p
    }


def _is_twin(e: dict[str, Any], focus: dict[str, Any]) -> bool:
    """Whether entry ``e`` is on another group than ``focus``'s over the same ranks (a
    ``new_group`` of every rank beside the default group: their records read alike)."""
    return e.get("gid") != focus["gid"] and list(e["group"]) == list(focus["group"])


def _on_a_twin_group(
    states: dict[int, dict[str, Any] | None], ranks: list[int], focus: dict[str, Any]
) -> list[int]:
    """The ``ranks`` waiting in a communication on another group over ``focus``'s ranks."""
    return [
        r for r in ranks if (s := states.get(r)) and s.get("inflight") and _is_twin(s["inflight"][-1], focus)
    ]


def _gid_of(states: dict[int, dict[str, Any] | None], r: int) -> Any:
    s = states[r]
    assert s is not None
    return s["inflight"][-1].get("gid")


def diagnose(
    states: dict[int, dict[str, Any] | None], focus: dict[str, Any] | None = None
) -> tuple[str, dict[str, Any]]:
    """Explain a stuck or failed communication from every rank's recorded state.

    Args:
        states: ``{global rank: state or None}`` as :func:`request_states` returns.
        focus: the entry (dict) that failed on the diagnosing rank, if any; else the
            oldest in-flight entry found on any rank.

    Returns:
        ``(text, facts)``: the message, and a dict with ``group``, ``seq`` (the first
        diverging sequence number), ``culprits`` (ranks), ``op``, ``direction`` and
        ``idle`` (ranks in no communication: returned, busy in user code, silent).
    """
    if focus is None:
        inflight = [e for s in states.values() if s for e in s.get("inflight", [])]
        inflight.sort(key=lambda e: -e["duration_s"])
        focus = inflight[0] if inflight else None
    if focus is None:
        return "no rank is inside a diffcomm communication", {"culprits": [], "seq": None}
    group = list(focus["group"])
    p2p = focus["raw_op"] in P2P_OPS
    answered = {r: s for r in group if (s := states.get(r))}
    hist = {r: _group_entries(s, focus["gid"], p2p) for r, s in answered.items()}
    reached = {r: s.get("counts", {}).get(focus["gid"], 0) for r, s in answered.items()}
    # first sequence number where the ranks differ: a different op/shape or a rank missing
    lo = min((min(h) for h in hist.values() if h), default=focus["seq"])
    hi = max((max(h) for h in hist.values() if h), default=focus["seq"])
    diverge: int | None = None
    kinds: dict[tuple[Any, ...], list[int]] = {}
    missing: list[int] = []
    # point-to-point counters are per process, not aligned across ranks: no search
    for seq in range(lo, hi + 1) if not p2p else ():
        kinds, missing = {}, []
        for r in group:
            if not states.get(r):
                missing.append(r)
                continue
            e = hist[r].get(seq)
            if e is None:
                if reached.get(r, 0) <= seq:
                    missing.append(r)
                continue  # fell out of the ring buffer: no evidence either way
            kinds.setdefault(signature(e), []).append(r)
        if len(kinds) > 1 or (kinds and missing):
            diverge = seq
            break
    if diverge is None:
        diverge = focus["seq"]
        kinds = {}
        missing = []
    # the same op from different lines before that point: a skipped or added call
    moved = None
    for seq in range(lo, diverge) if not p2p else ():
        sites: dict[str, list[int]] = {}
        for r in group:
            e = hist.get(r, {}).get(seq)
            if e is not None and e.get("site"):
                sites.setdefault(e["site"], []).append(r)
        if len(sites) > 1:
            moved = (seq, sites)
            break
    lines: list[str] = []
    culprits: set[int] = set()
    what = focus["op"]
    backward = focus["direction"] == "backward"
    if len(kinds) > 1:
        classes = sorted(kinds.values(), key=len, reverse=True)
        parts = []
        for members in classes:
            e = hist[members[0]][diverge]
            parts.append(f"rank(s) {members} called {_desc(e)}")
        ops = {sig[:2] for sig in kinds}
        first = hist[classes[0][0]][diverge]["op"]
        how = f"`{first}` with different shapes" if len(ops) == 1 else "different communications"
        lead = f"ranks called {how} at sequence number #{diverge} on group {group}: " + "; ".join(parts)
        culprits.update(r for members in classes[1:] for r in members)
    elif missing:
        present = sorted(r for members in kinds.values() for r in members)
        e = hist[present[0]][diverge] if present else focus
        lead = (
            f"rank(s) {missing} never reached {_desc(e, False)} (sequence number #{diverge} on group "
            f"{group}), which rank(s) {present} called"
        )
        culprits.update(missing)
        what = e["op"]
        backward = e["direction"] == "backward"
        elsewhere = _on_a_twin_group(states, missing, focus)
        if elsewhere:  # (their record reads "on group [0, 1]" too: say which group they are on)
            lead += (
                f"; rank(s) {elsewhere} wait instead in a communication on another group over the same "
                f"ranks (group name {_gid_of(states, elsewhere[0])!r}, not {focus['gid']!r}): "
                "every rank must pass the same group (two groups over the same ranks count apart)"
            )
    elif p2p:
        lead = (
            f"the point-to-point `{focus['op']}` on group {group} did not complete (its peer never "
            f"ran the matching call)"
        )
    else:
        lead = (
            f"`{focus['op']}` #{focus['seq']} on group {group} did not complete, though every rank's "
            f"record agrees up to it"
        )
    lines.append(lead + ".")
    if moved is not None:
        seq, sites = moved
        ordered = sorted(sites.items(), key=lambda x: -len(x[1]))
        where = "; ".join(f"rank(s) {rs} from {site}" for site, rs in ordered)
        lines.append(
            f"Earlier, at #{seq}, the ranks ran it from different lines ({where}): a collective skipped "
            f"on some ranks (or added on others) shows up like this."
        )
    lines.append("What every rank is doing:")
    idle: list[int] = []  # in no communication: they will not raise by themselves
    for r in sorted(set(group) | set(k for k, v in states.items() if v is not None)):
        s = states.get(r)
        if s is None:
            lines.append(f"  rank {r}: did not answer (its process is gone, or stuck outside Python)")
            culprits.add(r) if r in group else None
            idle.append(r)
            continue
        if not s.get("inflight"):
            idle.append(r)
        if s.get("inflight"):
            e = s["inflight"][-1]
            twin = f" (group name {e['gid']!r})" if _is_twin(e, focus) else ""
            lines.append(
                f"  rank {r}: inside {_desc(e)} on group {e['group']}{twin}, for {e['duration_s']:.1f} s"
            )
            continue
        done = [e for e in s.get("recent", []) if e["state"] == "completed"]
        last_done = f"; last completed {_desc(done[-1], False)}" if done else "; no communication yet"
        status = {
            "returned": "returned from the function",
            "exited": "exited (its process finished)",
            "destroyed": "destroyed its process group (destroy_process_group)",
        }.get(s.get("status", ""), "busy in user code (in no diffcomm communication)")
        lines.append(f"  rank {r}: {status}{last_done}")
    if backward:
        lines.append(
            "The blocked op is a backward: under autograd the usual cause is that one rank's loss "
            "does not use an output of a collective, so PyTorch skips that collective's backward on "
            "that rank while the others wait for it. Fix: make every rank's loss touch every "
            "collective output (e.g. add `0 * out.sum()`). Another cause: a parameter frozen "
            "(requires_grad_(False)) on some ranks only (DIFFCOMM_DEBUG=1 checks the flags)."
        )
    else:
        lines.append(
            "Every rank must run the same sequence of collectives on a group, with the same shapes "
            "(DIFFCOMM_DEBUG=1 checks shapes before each op)."
        )
    facts = {
        "group": group,
        "seq": diverge,
        "culprits": sorted(culprits),
        "op": what,
        "direction": "backward" if backward else "forward",
        "idle": idle,
    }
    return "\n".join(lines), facts
