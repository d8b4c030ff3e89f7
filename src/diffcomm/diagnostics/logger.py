"""The comms logger and the labels it records: which diffcomm op each raw call serves.

Every raw op funnels through :func:`diffcomm.backend.dispatch`; while a
:func:`log_comms` block is open on this thread, it appends a :class:`CommRecord` (op,
label, bytes, seconds, group size) to every open :class:`CommsLog`. A log prints as a
table of count, bytes, time and algorithmic/bus bandwidth per op.

:data:`STATE` is this thread's communication state, shared with the comm-off switches
(:mod:`diffcomm.diagnostics.switches`) and the dispatch entry point (:mod:`diffcomm.backend.dispatch`):
attributes ``logs`` (the open logs), ``off`` (the switched-off op names) and
``coalescing`` (the coalesced op being run), each made on first use. The dispatch hot
path reads ``STATE.__dict__`` once: empty means nothing logged, nothing switched off.

Everything here is re-exported by :mod:`diffcomm.backend`, its public home.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .._torch import compiling
from .raw_ops import bus_factor

#: This thread's logs / comm-off switches / coalescing record (see the module docstring).
STATE = threading.local()


# --------------------------------------------------------------------------------------
# labels: which diffcomm op (and which direction) the raw call serves, for messages/logs
# --------------------------------------------------------------------------------------

_LABEL: contextvars.ContextVar[str | None] = contextvars.ContextVar("diffcomm_label", default=None)
#: The context variable holding the current label (the op layer sets it inline).
LABEL = _LABEL


def label(text: str) -> contextlib.AbstractContextManager[None]:
    """Name the diffcomm op being run (e.g. ``"all_gather backward"``) for errors and logs.

    A no-op while ``torch.compile`` traces (dynamo cannot trace ``ContextVar.set``; the
    compiled graph has no Python-side logging anyway).
    """
    if compiling():
        return _NO_LABEL
    return _Label(text)


def nest(outer: str | None, text: str) -> str:
    """The label of ``text`` run inside label ``outer``: ``"outer -> text"`` (an op's
    backward, the dual it calls), except that a part of the op in force that names itself
    in full (``"all_gather (size exchange)"`` or ``"all_gather"`` itself inside
    ``"all_gather"``) keeps its own name. The one place labels nest."""
    if not outer or text == outer or text.startswith(outer + " ("):
        return text
    return f"{outer} -> {text}"


class _Label:
    """Sets the label for a block; nested labels read ``outer -> inner``. (A class, not a
    generator-based context manager: it is on every op's hot path.)"""

    __slots__ = ("text", "token")

    def __init__(self, text: str) -> None:
        self.text = text
        self.token: contextvars.Token[str | None] | None = None

    def __enter__(self) -> None:
        outer = _LABEL.get()
        self.token = _LABEL.set(nest(outer, self.text))

    def __exit__(self, *exc: object) -> None:
        if self.token is not None:
            _LABEL.reset(self.token)


_NO_LABEL = contextlib.nullcontext()


# --------------------------------------------------------------------------------------
# comms logger
# --------------------------------------------------------------------------------------


@dataclass
class CommRecord:
    """One raw communication call."""

    op: str
    label: str | None
    nbytes: int
    seconds: float
    world: int
    skipped: bool = False
    parts: int = 1  # raw c10d calls it was made of (a coalesced op: one per dtype)
    dtype: str | None = None  # the payload's dtype (``"torch.bfloat16"``); None if unknown


@dataclass(eq=False)  # identity: nested logs with equal records must stay distinct
class CommsLog:
    """Records of every raw op run inside :func:`log_comms`; ``print(log)`` shows a table."""

    records: list[CommRecord] = field(default_factory=list)

    def by_op(self) -> dict[str, dict[str, float]]:
        """Per op name: count, bytes, seconds, algbw and busbw (GB/s, 1e9 bytes)."""
        out: dict[str, dict[str, float]] = {}
        for r in self.records:
            row = out.setdefault(
                r.op, {"count": 0, "bytes": 0, "seconds": 0.0, "busbytes": 0.0, "skipped": 0}
            )
            row["count"] += 1
            row["bytes"] += r.nbytes
            row["seconds"] += r.seconds
            row["busbytes"] += r.nbytes * bus_factor(r.op, r.world)
            row["skipped"] += int(r.skipped)
        for row in out.values():
            s = row["seconds"]
            row["algbw_GBps"] = row["bytes"] / s / 1e9 if s > 0 else 0.0
            row["busbw_GBps"] = row.pop("busbytes") / s / 1e9 if s > 0 else 0.0
        return out

    def by_dtype(self, op: str | None = None) -> dict[str, int]:
        """Bytes per payload dtype (``{"torch.float8_e4m3fn": ..., "torch.float32": ...}``),
        of ``op`` if given: what low-precision collectives save (fp8 counted as fp8, though
        it may travel as bytes where the backend has no fp8 type)."""
        out: dict[str, int] = {}
        for r in self.records:
            if op is None or r.op == op:
                key = r.dtype or "unknown"
                out[key] = out.get(key, 0) + r.nbytes
        return out

    def sent_by_dtype(self, op: str | None = None) -> dict[str, float]:
        """:meth:`by_dtype` times each op's bus factor (``raw_ops``): the bytes each rank
        sends (ring / pairwise algorithms), so ops of different kinds compare (an
        all_reduce sends ``2 (n - 1) / n`` of its payload, an all_gather or all_to_all
        ``(n - 1) / n``)."""
        out: dict[str, float] = {}
        for r in self.records:
            if op is None or r.op == op:
                key = r.dtype or "unknown"
                out[key] = out.get(key, 0.0) + r.nbytes * bus_factor(r.op, r.world)
        return out

    def count(self, op: str | None = None) -> int:
        """Number of raw calls (of ``op`` if given)."""
        return sum(1 for r in self.records if op is None or r.op == op)

    def total_bytes(self, op: str | None = None) -> int:
        return sum(r.nbytes for r in self.records if op is None or r.op == op)

    def summary(self) -> str:
        """A plain-text table: op, count, bytes, time, algbw, busbw."""
        rows = self.by_op()
        head = f"{'op':<16}{'count':>7}{'bytes':>14}{'time ms':>11}{'algbw GB/s':>12}{'busbw GB/s':>12}"
        lines = [head, "-" * len(head)]
        for op, r in sorted(rows.items()):
            lines.append(
                f"{op:<16}{int(r['count']):>7}{int(r['bytes']):>14}{r['seconds'] * 1e3:>11.3f}"
                f"{r['algbw_GBps']:>12.3f}{r['busbw_GBps']:>12.3f}"
            )
        return "\n".join(lines)

    def rich_table(self) -> Any:
        """The summary as a ``rich.table.Table``."""
        from rich.table import Table

        table = Table(title="diffcomm comms log")
        for col in ("op", "count", "bytes", "time ms", "algbw GB/s", "busbw GB/s"):
            table.add_column(col, justify="left" if col == "op" else "right")
        for op, r in sorted(self.by_op().items()):
            table.add_row(
                op,
                str(int(r["count"])),
                f"{int(r['bytes']):,}",
                f"{r['seconds'] * 1e3:.3f}",
                f"{r['algbw_GBps']:.3f}",
                f"{r['busbw_GBps']:.3f}",
            )
        return table

    def __str__(self) -> str:
        return self.summary()


def logs() -> list[CommsLog]:
    """This thread's open logs (innermost last)."""
    if not hasattr(STATE, "logs"):
        STATE.logs = []
    return STATE.logs


@contextlib.contextmanager
def log_comms() -> Iterator[CommsLog]:
    """Record every raw communication inside the block.

    Example::

        with diffcomm.backend.log_comms() as log:
            y = dc.all_gather(x)
            y.sum().backward()
        print(log)           # table: all_gather 1 ..., reduce_scatter 1 ...
    """
    log = CommsLog()
    logs().append(log)
    try:
        yield log
    finally:
        logs().remove(log)
