"""The adapter the collectives call: raw, non-differentiable ops over ``torch.distributed``.

Everything here is out-of-place (returns new tensors, never writes into its inputs) and
works along **dim 0 of a contiguous tensor**; the collectives move dims and make
contiguous before calling in. Ranks are **group-local**. Backend gaps are filled here and
only here (an uneven all_gather on gloo, a reduce_scatter a backend lacks, ``avg`` on a
backend without it...), so the autograd layer never branches on "nccl" or "gloo".

Also here, because every raw op funnels through one entry point (:func:`_dispatch`):

* the **comms logger** — :func:`log_comms` records op, count, bytes, time and
  algorithmic/bus bandwidth, and prints a summary table;
* the **comm-off switches** — :func:`comm_off` skips named collectives while still
  returning correctly shaped results (for ablation timing, never for correctness);
* the translation of a backend timeout into :class:`~diffcomm.CollectiveTimeoutError`
  naming the op and how to fix it.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from . import _flight
from ._errors import CrossRankMismatchError
from .accelerator import comm_device

ProcessGroup = Any  # dist.ProcessGroup | None (None = the default group)

_TORCH_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}

#: Every op name the backend dispatches (the names :func:`comm_off` accepts).
OP_NAMES = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "reduce_scatter",
    "gather",
    "scatter",
    "all_to_all",
    "send",
    "recv",
    "batch_p2p",
    "barrier",
    "all_reduce_coalesced",
    "broadcast_coalesced",
    "reduce_coalesced",
    "all_gather_coalesced",
    "reduce_scatter_coalesced",
)

# Bus-bandwidth factor per op for n ranks (the nccl-tests convention).
_BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "gather": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
}
for _name in ("all_reduce", "all_gather", "reduce_scatter"):
    _BUS_FACTOR[f"{_name}_coalesced"] = _BUS_FACTOR[_name]


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
    if torch.compiler.is_compiling():
        return _NO_LABEL
    return _Label(text)


class _Label:
    """Sets the label for a block; nested labels read ``outer -> inner``. (A class, not a
    generator-based context manager: it is on every op's hot path.)"""

    __slots__ = ("text", "token")

    def __init__(self, text: str) -> None:
        self.text = text
        self.token: contextvars.Token[str | None] | None = None

    def __enter__(self) -> None:
        outer = _LABEL.get()
        self.token = _LABEL.set(f"{outer} -> {self.text}" if outer else self.text)

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
            row["busbytes"] += r.nbytes * _BUS_FACTOR.get(r.op, lambda n: 1.0)(max(r.world, 1))
            row["skipped"] += int(r.skipped)
        for row in out.values():
            s = row["seconds"]
            row["algbw_GBps"] = row["bytes"] / s / 1e9 if s > 0 else 0.0
            row["busbw_GBps"] = row.pop("busbytes") / s / 1e9 if s > 0 else 0.0
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


_local = threading.local()


def _logs() -> list[CommsLog]:
    if not hasattr(_local, "logs"):
        _local.logs = []
    return _local.logs


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
    _logs().append(log)
    try:
        yield log
    finally:
        _logs().remove(log)


# --------------------------------------------------------------------------------------
# comm-off switches
# --------------------------------------------------------------------------------------


def _off() -> set[str]:
    if not hasattr(_local, "off"):
        _local.off = set()
    return _local.off


class comm_off:  # noqa: N801 - used like a function
    """Skip the named raw collectives (ablation timing); results keep their shapes.

    A skipped op returns what a one-rank world would compute from local data (its own
    input reduced with itself, its own chunk repeated ...). The values are wrong on
    purpose; use it only to measure what communication costs. Usable as a call (stays on
    until :meth:`restore`) or as a ``with`` block (restored on exit)::

        with diffcomm.backend.comm_off("all_gather", "reduce_scatter"):
            bench(step)
    """

    def __init__(self, *ops: str) -> None:
        bad = [o for o in ops if o not in OP_NAMES]
        if bad:
            raise ValueError(f"diffcomm.backend.comm_off(): unknown op(s) {bad}; legal: {OP_NAMES}")
        self._old = set(_off())
        _off().update(ops)

    def restore(self) -> None:
        _local.off = set(self._old)

    def __enter__(self) -> comm_off:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


def is_off(op: str) -> bool:
    """Whether ``op`` is currently switched off by :class:`comm_off`."""
    return op in _off()


# --------------------------------------------------------------------------------------
# the one entry point
# --------------------------------------------------------------------------------------

_TIMEOUT_MARKERS = _flight._TIMEOUT_MARKERS  # what the backends' timeout errors say


def _sync_if_needed(t: torch.Tensor | None) -> None:
    if t is not None and t.device.type not in ("cpu", "meta"):
        torch.accelerator.synchronize(t.device) if hasattr(torch, "accelerator") else None


def _dispatch(
    op: str,
    group: ProcessGroup,
    nbytes: int,
    run: Callable[[], Any],
    skip: Callable[[], Any],
    sample: torch.Tensor | None = None,
) -> Any:
    """Run one raw op: comm-off switch, logging, flight recorder, timeout diagnosis — for
    every op (a timeout becomes :class:`~diffcomm.DesyncError` with the cross-rank story).

    Inside :meth:`TorchDistributedBackend.coalesced` the call is one *part* of a coalesced
    op: it is not logged on its own (the coalesced op is logged once, with the parts'
    total bytes) and is skipped when either its own name or the coalesced op's is off.
    """
    state = _local.__dict__  # this thread's logs / switches / coalescing record
    if not (state and (state.get("logs") or state.get("off") or state.get("coalescing") is not None)):
        # the hot path: nothing logged, nothing switched off
        hook = _ORDER_HOOK
        if (hook is None or not hook[0]()) and _SPANS is None:
            return _run_here(op, group, run, nbytes, sample)
        return _run(op, group, run, nbytes, sample)
    part_of = state.get("coalescing")
    if part_of is not None:
        part_of.parts += 1
        part_of.nbytes += nbytes
        if op in _off() or part_of.op in _off():
            part_of.skipped = True
            return skip()
        return _run(op, group, run, nbytes, sample)
    logs = _logs()
    if op in _off():
        out = skip()
        for log in logs:
            log.records.append(CommRecord(op, _LABEL.get(), nbytes, 0.0, _world(group), True))
        return out
    start = time.perf_counter() if logs else 0.0
    out = _run(op, group, run, nbytes, sample)
    if logs:
        _sync_if_needed(sample)
        elapsed = time.perf_counter() - start
        for log in logs:
            log.records.append(CommRecord(op, _LABEL.get(), nbytes, elapsed, _world(group)))
    return out


#: Set by :mod:`diffcomm._async`: ``(must_queue, call)``. While asynchronous jobs are
#: pending, a raw op issued by another thread runs on the communication engine behind
#: them (``call``), so this process issues communication in program order.
_ORDER_HOOK: tuple[Callable[[], bool], Callable[[Callable[[], Any], str], Any]] | None = None

#: Spans of raw communication ``(op, label, thread name, t0, t1)`` (``time.perf_counter``)
#: while a :func:`record_spans` block is active (the timeline reads them).
_SPANS: list[tuple[str, str | None, str, float, float]] | None = None


@contextlib.contextmanager
def record_spans() -> Iterator[list[tuple[str, str | None, str, float, float]]]:
    """Record every raw communication of this process (any thread) with its start and
    end time: ``(op, label, thread name, t0, t1)``, ``time.perf_counter`` seconds.

    The timeline (``python -m diffcomm bench --timeline``) draws these next to the
    compute spans; unlike :func:`log_comms` it is process-wide, so the communication
    engine's thread is recorded too.
    """
    global _SPANS
    old, spans = _SPANS, []
    _SPANS = spans
    try:
        yield spans
    finally:
        _SPANS = old


def _run(
    op: str, group: ProcessGroup, run: Callable[[], Any], nbytes: int = 0, sample: torch.Tensor | None = None
) -> Any:
    """``run()`` recorded by the flight recorder; a timeout (or a peer gone mid-op) becomes
    :class:`~diffcomm.DesyncError` carrying the cross-rank diagnosis."""
    hook = _ORDER_HOOK
    if hook is not None and hook[0]():
        return hook[1](lambda: _run(op, group, run, nbytes, sample), op)
    spans = _SPANS
    if spans is not None:
        t0 = time.perf_counter()
        try:
            return _run_here(op, group, run, nbytes, sample)
        finally:
            _sync_if_needed(sample)
            spans.append((op, _LABEL.get(), threading.current_thread().name, t0, time.perf_counter()))
    return _run_here(op, group, run, nbytes, sample)


def _run_here(
    op: str, group: ProcessGroup, run: Callable[[], Any], nbytes: int = 0, sample: torch.Tensor | None = None
) -> Any:
    label = _LABEL.get()
    rec = _flight.begin(op, group, nbytes, sample, label)
    try:
        out = run()
    except (RuntimeError, dist.DistError) as err:  # DistBackendError is a RuntimeError
        mapped = _flight.failed(rec, op, group, err, label)
        if mapped is not None:
            raise mapped from err
        raise
    _flight.end(rec)
    return out


@dataclass
class _Coalescing:
    """The record of a coalesced op being run (see :meth:`TorchDistributedBackend.coalesced`)."""

    op: str
    parts: int = 0
    nbytes: int = 0
    skipped: bool = False


#: The one entry point, under its public name (p2p's asynchronous sends and posted
#: receives go through it too).
dispatch = _dispatch


def _world(group: ProcessGroup) -> int:
    return group_info(group).size if dist.is_initialized() else 1


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --------------------------------------------------------------------------------------
# the group record: facts about a group, resolved once per group
# --------------------------------------------------------------------------------------


@dataclass(eq=False)
class GroupInfo:
    """What diffcomm needs to know about a process group, probed once per group.

    ``pg`` is the group as the ops pass it (``None`` for the default group); ``rank`` and
    ``size`` are group-local; ``backend`` is the c10d backend's name; ``caps`` its
    :class:`Capabilities`; ``device`` the device small metadata tensors live on for it.
    ``cpu_pg`` is the group host-side integers (sizes) travel on: the group itself when
    its device is the CPU, else a gloo group of the same ranks, made on first use.
    """

    pg: ProcessGroup
    rank: int
    size: int
    backend: str
    caps: Capabilities
    device: torch.device
    cpu_pg: Any = None
    has_cpu_pg: bool = False


_INFOS: dict[Any, GroupInfo] = {}
_INFO_WORLD: list[Any] = [None]  # the default group the cached records belong to


def group_info(group: ProcessGroup) -> GroupInfo:
    """The cached :class:`GroupInfo` of ``group`` (a resolved group or ``None``)."""
    default = dist.distributed_c10d._world.default_pg
    if default is not _INFO_WORLD[0]:  # a new world: every old record is stale
        _INFOS.clear()
        _INFO_WORLD[0] = default
    info = _INFOS.get(group)
    if info is None:
        info = _INFOS[group] = _probe(group)
    return info


def _probe(group: ProcessGroup) -> GroupInfo:
    if not dist.is_initialized():
        return GroupInfo(group, 0, 1, "none", _static_capabilities("none"), torch.device("cpu"))
    name = str(dist.get_backend(group)).lower()
    return GroupInfo(
        group,
        dist.get_rank(group),
        dist.get_world_size(group),
        name,
        _static_capabilities(name),
        comm_device(name),
    )


def cpu_group(info: GroupInfo) -> ProcessGroup:
    """The group host-side integers travel on for ``info`` (see :class:`GroupInfo`).

    Every member of the group calls this at the same point of the program (the first
    size exchange on it), so the members-only group creation lines up.
    """
    if not info.has_cpu_pg:
        if info.device.type == "cpu":
            info.cpu_pg = info.pg
        else:
            ranks = dist.get_process_group_ranks(info.pg if info.pg is not None else dist.group.WORLD)
            info.cpu_pg = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        info.has_cpu_pg = True
    return info.cpu_pg


# --------------------------------------------------------------------------------------
# the protocol and the torch.distributed implementation
# --------------------------------------------------------------------------------------


class Backend(Protocol):
    """The raw ops the collectives need. All out-of-place, dim 0, group-local ranks."""

    def rank(self, group: ProcessGroup) -> int: ...
    def world_size(self, group: ProcessGroup) -> int: ...
    def global_rank(self, group: ProcessGroup, rank: int) -> int: ...
    def backend_name(self, group: ProcessGroup) -> str: ...
    def capabilities(self, group: ProcessGroup = None) -> Capabilities: ...
    def comm_device(self, group: ProcessGroup) -> torch.device: ...
    def check_consistent(self, op: str, fields: dict[str, Any], group: ProcessGroup) -> None: ...
    def all_reduce(self, x: torch.Tensor, op: str, group: ProcessGroup) -> torch.Tensor: ...
    def broadcast(self, x: torch.Tensor, src: int, group: ProcessGroup) -> torch.Tensor: ...
    def reduce(self, x: torch.Tensor, dst: int, op: str, group: ProcessGroup) -> torch.Tensor: ...
    def all_gather(
        self, x: torch.Tensor, group: ProcessGroup, sizes: Sequence[int] | None = None
    ) -> torch.Tensor: ...
    def reduce_scatter(
        self, x: torch.Tensor, op: str, group: ProcessGroup, split_sizes: Sequence[int] | None = None
    ) -> torch.Tensor: ...
    def gather(
        self, x: torch.Tensor, dst: int, group: ProcessGroup, sizes: Sequence[int] | None = None
    ) -> torch.Tensor: ...
    def scatter(
        self, x: torch.Tensor, src: int, group: ProcessGroup, split_sizes: Sequence[int] | None = None
    ) -> torch.Tensor: ...
    def all_to_all(
        self,
        x: torch.Tensor,
        group: ProcessGroup,
        input_split_sizes: Sequence[int] | None = None,
        output_split_sizes: Sequence[int] | None = None,
    ) -> torch.Tensor: ...
    def recv(self, out: torch.Tensor, src: int, group: ProcessGroup, tag: int = 0) -> torch.Tensor: ...
    def batch_p2p(self, ops: Sequence[tuple[str, torch.Tensor, int, int]], group: ProcessGroup) -> None: ...
    def barrier(self, group: ProcessGroup) -> None: ...
    def exchange_sizes(self, n: int, group: ProcessGroup) -> list[int]: ...
    def all_reduce_coalesced(
        self, xs: Sequence[torch.Tensor], op: str, group: ProcessGroup, owned: bool = False
    ) -> list[torch.Tensor]: ...
    def broadcast_coalesced(
        self, xs: Sequence[torch.Tensor], src: int, group: ProcessGroup, owned: bool = False
    ) -> list[torch.Tensor]: ...
    def reduce_coalesced(
        self, xs: Sequence[torch.Tensor], dst: int, op: str, group: ProcessGroup
    ) -> list[torch.Tensor]: ...
    def all_gather_coalesced(self, xs: Sequence[torch.Tensor], group: ProcessGroup) -> list[torch.Tensor]: ...
    def reduce_scatter_coalesced(
        self, xs: Sequence[torch.Tensor], op: str, group: ProcessGroup
    ) -> list[torch.Tensor]: ...


@dataclass
class Capabilities:
    """What the group's c10d backend can do natively (probed once per backend name)."""

    backend: str
    avg: bool
    reduce_scatter: bool
    all_gather_into_tensor: bool
    uneven_all_gather: bool
    uneven_all_to_all: bool
    complex_reduce: bool
    gather_scatter: bool

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _static_capabilities(name: str) -> Capabilities:
    """Known capabilities of c10d backends in the torch versions diffcomm supports.

    ``gloo`` in torch < 2.6 lacks ``reduce_scatter_tensor`` and ``ReduceOp.AVG``;
    ``nccl`` lacks gather/scatter before 2.x builds that emulate them (torch does).
    Uneven all_gather/gather never work with a single tensor output: diffcomm pads.
    """
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if name == "gloo":
        new = version >= (2, 6)
        return Capabilities(name, new, new, True, False, True, True, True)
    if name == "nccl":
        return Capabilities(name, True, True, True, False, True, True, True)
    return Capabilities(name, False, False, False, False, True, False, True)


class _CoalescedOps:
    """The coalesced raw ops: a list of flat buffers (one per dtype, packed by the caller),
    one raw call each, logged as **one** op (``<op>_coalesced``, total bytes, ``parts`` =
    the raw calls). Each buffer follows the single op's rules (dim 0, out-of-place)."""

    if TYPE_CHECKING:  # the single ops the subclasses provide

        def all_reduce(self, x: torch.Tensor, op: str, group: ProcessGroup) -> torch.Tensor: ...
        def _all_reduce_into(self, x: torch.Tensor, op: str, group: ProcessGroup) -> torch.Tensor: ...
        def broadcast(self, x: torch.Tensor, src: int, group: ProcessGroup) -> torch.Tensor: ...
        def _broadcast_into(self, x: torch.Tensor, src: int, group: ProcessGroup) -> torch.Tensor: ...
        def reduce(self, x: torch.Tensor, dst: int, op: str, group: ProcessGroup) -> torch.Tensor: ...
        def all_gather(self, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor: ...
        def reduce_scatter(self, x: torch.Tensor, op: str, group: ProcessGroup) -> torch.Tensor: ...

    def coalesced(
        self, op: str, group: ProcessGroup, xs: Sequence[torch.Tensor], fn: Callable[[torch.Tensor], Any]
    ) -> list[torch.Tensor]:
        return [fn(x) for x in xs]

    def all_reduce_coalesced(
        self, xs: Sequence[torch.Tensor], op: str, group: ProcessGroup, owned: bool = False
    ) -> list[torch.Tensor]:
        """``owned``: the buffers are the caller's fresh contiguous packing, free to be
        reduced in place (saves a copy of the payload)."""
        fn = self._all_reduce_into if owned else self.all_reduce
        return self.coalesced("all_reduce", group, xs, lambda x: fn(x, op, group))

    def broadcast_coalesced(
        self, xs: Sequence[torch.Tensor], src: int, group: ProcessGroup, owned: bool = False
    ) -> list[torch.Tensor]:
        fn = self._broadcast_into if owned else self.broadcast
        return self.coalesced("broadcast", group, xs, lambda x: fn(x, src, group))

    def reduce_coalesced(
        self, xs: Sequence[torch.Tensor], dst: int, op: str, group: ProcessGroup
    ) -> list[torch.Tensor]:
        return self.coalesced("reduce", group, xs, lambda x: self.reduce(x, dst, op, group))

    def all_gather_coalesced(self, xs: Sequence[torch.Tensor], group: ProcessGroup) -> list[torch.Tensor]:
        """Even all_gather along dim 0 of each buffer."""
        return self.coalesced("all_gather", group, xs, lambda x: self.all_gather(x, group))

    def reduce_scatter_coalesced(
        self, xs: Sequence[torch.Tensor], op: str, group: ProcessGroup
    ) -> list[torch.Tensor]:
        """Even reduce_scatter along dim 0 of each buffer."""
        return self.coalesced("reduce_scatter", group, xs, lambda x: self.reduce_scatter(x, op, group))


class TorchDistributedBackend(_CoalescedOps):
    """The default :class:`Backend`: ``torch.distributed`` (gloo, nccl, mpi, ucc, xccl)."""

    def __init__(self) -> None:
        self.overrides: dict[str, bool] = {}  # force a capability off/on (tests of fallbacks)

    # ---- group helpers (from the cached group record) --------------------------------
    def rank(self, group: ProcessGroup) -> int:
        return group_info(group).rank

    def world_size(self, group: ProcessGroup) -> int:
        return group_info(group).size

    def comm_device(self, group: ProcessGroup) -> torch.device:
        return group_info(group).device

    def global_rank(self, group: ProcessGroup, rank: int) -> int:
        if group is None:
            return rank
        return dist.get_global_rank(group, rank)

    def backend_name(self, group: ProcessGroup) -> str:
        return group_info(group).backend

    def capabilities(self, group: ProcessGroup = None) -> Capabilities:
        caps = group_info(group).caps
        if self.overrides:
            caps = Capabilities(**{**caps.as_dict(), **self.overrides})
        return caps

    def coalesced(
        self, op: str, group: ProcessGroup, xs: Sequence[torch.Tensor], fn: Callable[[torch.Tensor], Any]
    ) -> list[torch.Tensor]:
        """Run ``fn`` (a raw single op) on each buffer; log them as one ``<op>_coalesced``."""
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

    # ---- reductions ----------------------------------------------------------------
    def _reduce_op(self, op: str, x: torch.Tensor, group: ProcessGroup) -> tuple[Any, bool]:
        """torch ReduceOp to use, and whether to divide by the world size afterwards."""
        if op not in _TORCH_OPS:
            raise ValueError(
                f"diffcomm.backend: unknown reduce op {op!r}; legal: {tuple(_TORCH_OPS)} "
                "(normalise user input with diffcomm._args.normalize_op first)"
            )
        if op == "avg" and not (self.capabilities(group).avg and x.is_floating_point()):
            return dist.ReduceOp.SUM, True
        return _TORCH_OPS[op], False

    def _as_wire(self, x: torch.Tensor, op: str, group: ProcessGroup) -> torch.Tensor:
        # complex sum/avg travel as real pairs where the backend has no complex reduction
        if x.is_complex() and op in ("sum", "avg") and not self.capabilities(group).complex_reduce:
            return torch.view_as_real(x)
        return x

    def all_reduce(self, x: torch.Tensor, op: str, group: ProcessGroup) -> torch.Tensor:
        return self._all_reduce_into(x.clone(memory_format=torch.contiguous_format), op, group)

    def _all_reduce_into(self, out: torch.Tensor, op: str, group: ProcessGroup) -> torch.Tensor:
        """all_reduce of ``out`` (contiguous, owned by the caller) in place; returns it."""
        x = out
        if x.is_complex() and op == "product":
            return self._complex_product(out, group)
        torch_op, divide = self._reduce_op(op, x, group)
        wire = self._as_wire(out, op, group)
        _dispatch(
            "all_reduce",
            group,
            _nbytes(x),
            lambda: dist.all_reduce(wire, torch_op, group=group),
            lambda: None,
            out,
        )
        if divide:
            out.div_(self.world_size(group))
        return out

    def _complex_product(self, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        parts = self.all_gather(x.reshape(1, *x.shape), group)
        return torch.prod(parts, dim=0)

    def reduce(self, x: torch.Tensor, dst: int, op: str, group: ProcessGroup) -> torch.Tensor:
        out = x.clone(memory_format=torch.contiguous_format)
        torch_op, divide = self._reduce_op(op, x, group)
        wire = self._as_wire(out, op, group)
        _dispatch(
            "reduce",
            group,
            _nbytes(x),
            lambda: dist.reduce(wire, group_dst=dst, op=torch_op, group=group),
            lambda: None,
            out,
        )
        if self.rank(group) != dst:
            out.zero_()
        elif divide:
            out.div_(self.world_size(group))
        return out

    def broadcast(self, x: torch.Tensor, src: int, group: ProcessGroup) -> torch.Tensor:
        return self._broadcast_into(x.clone(memory_format=torch.contiguous_format), src, group)

    def _broadcast_into(self, out: torch.Tensor, src: int, group: ProcessGroup) -> torch.Tensor:
        """broadcast into ``out`` (contiguous, owned by the caller) in place; returns it."""
        x = out
        wire = torch.view_as_real(out) if out.is_complex() else out
        _dispatch(
            "broadcast",
            group,
            _nbytes(x),
            lambda: dist.broadcast(wire, group_src=src, group=group),
            lambda: None,
            out,
        )
        return out

    # ---- gather family (dim 0) -----------------------------------------------------
    def exchange_sizes(self, n: int, group: ProcessGroup) -> list[int]:
        """Every rank's ``n`` (a small all_gather); used for uneven sizes."""
        info = group_info(group)
        world = info.size
        if world == 1:
            return [n]
        side = cpu_group(info)  # host integers: never a device round trip
        mine = torch.tensor([n], dtype=torch.int64)
        out = torch.empty(world, dtype=torch.int64)
        _dispatch(
            "all_gather",
            side,
            8,
            lambda: _all_gather_single(out, mine, group=side),
            lambda: out.fill_(n),
            None,
        )
        return [int(v) for v in out.tolist()]

    def all_gather(
        self, x: torch.Tensor, group: ProcessGroup, sizes: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Concatenate every rank's ``x`` along dim 0. ``sizes``: every rank's ``x.shape[0]``."""
        world = self.world_size(group)
        x = x.contiguous()
        rest = tuple(x.shape[1:])
        if sizes is None:
            sizes = [x.shape[0]] * world
        total = sum(sizes)
        even = all(s == sizes[0] for s in sizes)
        if even and self.capabilities(group).all_gather_into_tensor:
            out = torch.empty((total, *rest), dtype=x.dtype, device=x.device)
            _dispatch(
                "all_gather",
                group,
                _nbytes(out),
                lambda: _all_gather_single(_wire(out), _wire(x), group=group),
                lambda: out.copy_(x.repeat(world, *([1] * len(rest)))),
                out,
            )
            return out
        # uneven (or no into-tensor op): pad every rank to the largest size, gather, unpad
        m = max(sizes) if sizes else 0
        padded = _pad_rows(x, m)
        buf = torch.empty((world * m, *rest), dtype=x.dtype, device=x.device)
        chunks = list(buf.split(m)) if m > 0 else [buf[:0]] * world

        def run() -> None:
            if self.capabilities(group).all_gather_into_tensor:
                _all_gather_single(_wire(buf), _wire(padded), group=group)
            else:
                dist.all_gather([_wire(c) for c in chunks], _wire(padded), group=group)

        _dispatch(
            "all_gather",
            group,
            _nbytes(buf),
            run,
            lambda: buf.copy_(padded.repeat(world, *([1] * len(rest)))),
            buf,
        )
        if even:
            return buf
        return _unpad_rows(chunks, sizes)

    def reduce_scatter(
        self, x: torch.Tensor, op: str, group: ProcessGroup, split_sizes: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Chunk ``rank`` (along dim 0) of the reduction over ranks of ``x``."""
        world, rank = self.world_size(group), self.rank(group)
        x = x.contiguous()
        rest = tuple(x.shape[1:])
        sizes = list(split_sizes) if split_sizes is not None else [x.shape[0] // world] * world
        even = all(s == sizes[0] for s in sizes)
        caps = self.capabilities(group)
        if not caps.reduce_scatter or op not in ("sum", "avg"):
            # gap filled: reduce everything, keep own chunk (2x traffic, documented)
            full = self.all_reduce(x, op, group)
            start = sum(sizes[:rank])
            return full[start : start + sizes[rank]].clone()
        torch_op, divide = self._reduce_op(op, x, group)
        if even:
            inp = x
        else:  # pad each chunk to the largest, so one reduce_scatter_tensor does it
            m = max(sizes)
            inp = torch.cat([_pad_rows(c, m) for c in x.split(sizes)])
        chunk = inp.shape[0] // world if world else 0
        out = torch.empty((chunk, *rest), dtype=x.dtype, device=x.device)
        wire_in, wire_out = self._as_wire(inp, op, group), self._as_wire(out, op, group)
        _dispatch(
            "reduce_scatter",
            group,
            _nbytes(inp),
            lambda: _reduce_scatter_single(wire_out, wire_in, op=torch_op, group=group),
            lambda: out.copy_(inp[rank * chunk : (rank + 1) * chunk]),
            out,
        )
        if divide:
            out.div_(world)
        return out if even else out[: sizes[rank]].clone()

    def gather(
        self, x: torch.Tensor, dst: int, group: ProcessGroup, sizes: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Concatenation along dim 0 on ``dst``; zeros of the same shape elsewhere."""
        world, rank = self.world_size(group), self.rank(group)
        x = x.contiguous()
        rest = tuple(x.shape[1:])
        if sizes is None:
            sizes = [x.shape[0]] * world
        m = max(sizes)
        padded = _pad_rows(x, m)
        buf = torch.zeros((world * m, *rest), dtype=x.dtype, device=x.device)
        chunks = list(buf.split(m)) if m > 0 else [buf[:0]] * world
        _dispatch(
            "gather",
            group,
            _nbytes(buf),
            lambda: dist.gather(
                _wire(padded),
                [_wire(c) for c in chunks] if rank == dst else None,
                group_dst=dst,
                group=group,
            ),
            lambda: buf.copy_(padded.repeat(world, *([1] * len(rest)))),
            buf,
        )
        if all(s == m for s in sizes):
            return buf
        return _unpad_rows(chunks, sizes)

    def scatter(
        self, x: torch.Tensor, src: int, group: ProcessGroup, split_sizes: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Chunk ``rank`` (along dim 0) of ``src``'s ``x``."""
        world, rank = self.world_size(group), self.rank(group)
        x = x.contiguous()
        rest = tuple(x.shape[1:])
        sizes = list(split_sizes) if split_sizes is not None else [x.shape[0] // world] * world
        m = max(sizes)
        out = torch.empty((m, *rest), dtype=x.dtype, device=x.device)
        if rank == src:
            parts = [_pad_rows(c, m) for c, s in zip(x.split(sizes), sizes)]
            parts = [_wire(p.contiguous()) for p in parts]
        else:
            parts = None
        start = sum(sizes[:rank])
        _dispatch(
            "scatter",
            group,
            _nbytes(x),
            lambda: dist.scatter(_wire(out), parts, group_src=src, group=group),
            lambda: out[: sizes[rank]].copy_(x[start : start + sizes[rank]]),
            out,
        )
        return out if sizes[rank] == m else out[: sizes[rank]].clone()

    def all_to_all(
        self,
        x: torch.Tensor,
        group: ProcessGroup,
        input_split_sizes: Sequence[int] | None = None,
        output_split_sizes: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Send chunk ``j`` of ``x`` (dim 0) to rank ``j``; concatenate what arrives."""
        world, rank = self.world_size(group), self.rank(group)
        x = x.contiguous()
        rest = tuple(x.shape[1:])
        ins = list(input_split_sizes) if input_split_sizes is not None else None
        outs = list(output_split_sizes) if output_split_sizes is not None else None
        if outs is None:
            outs = [x.shape[0] // world] * world if ins is None else None
        if outs is None:  # infer: what rank j sends me is its ins[me]; exchange the matrix
            outs = self.all_to_all(
                torch.tensor(ins, dtype=torch.int64, device=group_info(group).device), group
            ).tolist()
        out = torch.empty((sum(outs), *rest), dtype=x.dtype, device=x.device)

        def skip() -> None:
            me_in = ins if ins is not None else [x.shape[0] // world] * world
            own = x[sum(me_in[:rank]) : sum(me_in[: rank + 1])]
            n = min(own.shape[0], out.shape[0])
            out.zero_()
            out[:n].copy_(own[:n])

        _dispatch(
            "all_to_all",
            group,
            max(_nbytes(x), _nbytes(out)),
            lambda: dist.all_to_all_single(_wire(out), _wire(x), outs, ins, group=group),
            skip,
            out,
        )
        return out

    # ---- point to point ------------------------------------------------------------
    def recv(self, out: torch.Tensor, src: int, group: ProcessGroup, tag: int = 0) -> torch.Tensor:
        """Receive into ``out`` (a fresh buffer the caller owns) and return it."""
        _dispatch(
            "recv",
            group,
            _nbytes(out),
            lambda: dist.recv(_wire(out), group_src=src, group=group, tag=tag),
            lambda: out.zero_(),
            out,
        )
        return out

    def batch_p2p(self, ops: Sequence[tuple[str, torch.Tensor, int, int]], group: ProcessGroup) -> None:
        """Run ``[("send"|"recv", tensor, peer, tag), ...]`` together (deadlock-free)."""
        if not ops:
            return
        p2p = [
            dist.P2POp(
                dist.isend if kind == "send" else dist.irecv,
                _wire(t),
                group=group,
                tag=tag,
                group_peer=peer,
            )
            for kind, t, peer, tag in ops
        ]

        def run() -> None:
            for work in dist.batch_isend_irecv(p2p):
                work.wait()

        def skip() -> None:
            for kind, t, _, _ in ops:
                if kind == "recv":
                    t.zero_()

        nbytes = sum(_nbytes(t) for _, t, _, _ in ops)
        _dispatch("batch_p2p", group, nbytes, run, skip, ops[0][1])

    def barrier(self, group: ProcessGroup) -> None:
        _dispatch("barrier", group, 0, lambda: dist.barrier(group=group), lambda: None)

    # ---- debug-mode consistency check ----------------------------------------------
    def check_consistent(self, op: str, fields: dict[str, Any], group: ProcessGroup) -> None:
        """Compare ``fields`` across the ranks of ``group``; raise naming who differs.

        The fields are encoded as a fixed-length int64 vector (so it is one small
        all_gather whatever they hold); ranks whose vector differs from the majority are
        named with their values.
        """
        world = self.world_size(group)
        if world == 1:
            return
        names = list(fields)
        encoded = [_encode_field(fields[k]) for k in names]
        width = 1 + sum(len(e) for e in encoded)
        width_t = torch.tensor([width], dtype=torch.int64, device=group_info(group).device)
        widths = self.all_gather(width_t, group).tolist()
        m = max(widths)
        vec = torch.full((m,), -7, dtype=torch.int64, device=width_t.device)
        flat = [len(names)] + [v for e in encoded for v in e]
        vec[: len(flat)] = torch.tensor(flat, dtype=torch.int64)
        table = self.all_gather(vec.reshape(1, m), group).cpu().tolist()
        if all(row == table[0] for row in table):
            return
        decoded = [_decode_fields(names, row) for row in table]
        diffs = []
        for k in names:
            values = [d.get(k) for d in decoded]
            if any(v != values[0] for v in values):
                per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
                diffs.append(f"{k} differs ({per_rank})")
        if not diffs:
            diffs.append("argument layout differs between ranks")
        raise CrossRankMismatchError(
            f"diffcomm.{op}(): ranks called it with inconsistent arguments (group ranks "
            f"{list(range(world))}): " + "; ".join(diffs)
        )


def _encode_field(value: Any) -> list[int]:
    """Field value -> ints: ``[kind, len, payload...]`` (kinds: int, tuple of ints, str)."""
    if isinstance(value, bool) or isinstance(value, int):
        return [0, 1, int(value)]
    if isinstance(value, torch.dtype):
        value = str(value)
    if isinstance(value, torch.Size | tuple | list):
        vals = [int(v) for v in value]
        return [1, len(vals), *vals]
    text = str(value).encode()[:64]
    return [2, len(text), *text]


def _decode_fields(names: list[str], row: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    i = 1
    for k in names:
        if i + 1 >= len(row):
            break
        kind, n = row[i], row[i + 1]
        payload = row[i + 2 : i + 2 + n]
        i += 2 + n
        if kind == 0:
            out[k] = payload[0] if payload else None
        elif kind == 1:
            out[k] = tuple(payload)
        else:
            out[k] = bytes(v % 256 for v in payload).decode(errors="replace")
    return out


def _pad_rows(x: torch.Tensor, m: int) -> torch.Tensor:
    """``x`` with zero rows appended along dim 0 up to ``m`` rows (uneven sizes travel padded)."""
    if x.shape[0] == m:
        return x
    return torch.cat([x, x.new_zeros((m - x.shape[0], *x.shape[1:]))])


def _unpad_rows(chunks: Sequence[torch.Tensor], sizes: Sequence[int]) -> torch.Tensor:
    """Concatenate the first ``sizes[r]`` rows of each padded per-rank chunk."""
    return torch.cat([c[:s] for c, s in zip(chunks, sizes)])


def _wire(t: torch.Tensor) -> torch.Tensor:
    """Complex tensors travel as real views for ops c10d cannot take complex in."""
    return torch.view_as_real(t) if t.is_complex() else t


wire = _wire




# torch >= 2.12 renamed the single-tensor forms; use whichever this torch has (version gap
# hidden here, so no deprecation warning reaches users).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# --------------------------------------------------------------------------------------
# the traceable path (torch.compile)
# --------------------------------------------------------------------------------------


class TraceableBackend(_CoalescedOps):
    """The raw ops as PyTorch's functional collectives, for code ``torch.compile`` traces.

    Dynamo cannot trace c10d's in-place ``broadcast``/``reduce``/``gather``/``scatter``
    nor the logger and switches of :func:`_dispatch` (context variables, thread locals,
    timers), so :func:`get_backend` returns this adapter while
    ``torch.compiler.is_compiling()``. It also works eagerly (``set_backend``), which is
    how its semantics are tested against :class:`TorchDistributedBackend`: dim 0,
    out-of-place, group-local ranks, zeros off the root, uneven sizes padded. Differences:

    * nothing is exchanged at trace time: :meth:`exchange_sizes` raises (pass ``split_sizes=``
      to ``all_gather``/``gather``, ``output_split_sizes=`` to an uneven ``all_to_all``);
    * ``reduce`` is an all_reduce kept on ``dst`` only; ``gather`` and ``scatter`` are one
      ``all_to_all_single`` with rank-dependent splits (no functional gather/scatter);
      ``avg`` is a sum divided by the group size;
    * :func:`log_comms`, :func:`comm_off`, the timeout message and the debug-mode
      cross-rank check (:meth:`check_consistent`) do not apply inside compiled code.
    """

    # ---- group helpers -------------------------------------------------------------
    def rank(self, group: ProcessGroup) -> int:
        return dist.get_rank(group)

    def world_size(self, group: ProcessGroup) -> int:
        return dist.get_world_size(group)

    def global_rank(self, group: ProcessGroup, rank: int) -> int:
        return rank if group is None else dist.get_global_rank(group, rank)

    def backend_name(self, group: ProcessGroup) -> str:
        return str(dist.get_backend(group)).lower()

    def capabilities(self, group: ProcessGroup = None) -> Capabilities:
        return _static_capabilities(self.backend_name(group))

    def comm_device(self, group: ProcessGroup) -> torch.device:
        return comm_device(self.backend_name(group))

    @staticmethod
    def _pg(group: ProcessGroup) -> Any:
        return group if group is not None else dist.group.WORLD

    @staticmethod
    def _done(t: torch.Tensor) -> torch.Tensor:
        # eager functional collectives return an AsyncCollectiveTensor; traced ones are waited
        return t.wait() if isinstance(t, _funcol().AsyncCollectiveTensor) else t

    # ---- reductions ----------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor, op: str, group: ProcessGroup) -> torch.Tensor:
        x = x.contiguous()
        if x.is_complex() and op == "product":
            return torch.prod(self.all_gather(x.unsqueeze(0), group), dim=0)
        wire_op = "sum" if op == "avg" else op
        out = self._done(_funcol().all_reduce(_wire(x), wire_op, self._pg(group)))
        out = torch.view_as_complex(out) if x.is_complex() else out
        return out / self.world_size(group) if op == "avg" else out

    def _all_reduce_into(self, x: torch.Tensor, op: str, group: ProcessGroup) -> torch.Tensor:
        return self.all_reduce(x, op, group)  # functional collectives are out of place

    def _broadcast_into(self, x: torch.Tensor, src: int, group: ProcessGroup) -> torch.Tensor:
        return self.broadcast(x, src, group)

    def reduce(self, x: torch.Tensor, dst: int, op: str, group: ProcessGroup) -> torch.Tensor:
        out = self.all_reduce(x, op, group)  # every rank takes part; only dst keeps it
        return out if self.rank(group) == dst else torch.zeros_like(out)

    def broadcast(self, x: torch.Tensor, src: int, group: ProcessGroup) -> torch.Tensor:
        x = x.contiguous()
        out = self._done(_funcol().broadcast(_wire(x), src, self._pg(group)))
        return torch.view_as_complex(out) if x.is_complex() else out

    # ---- gather family (dim 0) -----------------------------------------------------
    def exchange_sizes(self, n: int, group: ProcessGroup) -> list[int]:
        """Every rank's ``n``; raises ``ValueError`` while compiling (pass ``split_sizes=``)."""
        if not torch.compiler.is_compiling():  # eager use (tests): a host read is fine
            mine = torch.tensor([n], dtype=torch.int64, device=group_info(group).device)
            return [int(v) for v in self.all_gather(mine, group).tolist()]
        raise ValueError(
            "diffcomm: under torch.compile the per-rank sizes of an all_gather/gather cannot "
            "be exchanged (that needs a host read, `.tolist()`, which dynamo cannot trace); "
            "pass `split_sizes=` (every rank's size along `dim`, e.g. `split_sizes=[n] * world` when even)"
        )

    def all_gather(
        self, x: torch.Tensor, group: ProcessGroup, sizes: Sequence[int] | None = None
    ) -> torch.Tensor:
        world = self.world_size(group)
        x = x.contiguous()
        sizes = list(sizes) if sizes is not None else [x.shape[0]] * world
        m = max(sizes)
        padded = _pad_rows(x, m)
        buf = self._done(_funcol_all_gather(_wire(padded), 0, self._pg(group)))
        buf = torch.view_as_complex(buf) if x.is_complex() else buf
        if all(s == m for s in sizes):
            return buf
        return _unpad_rows(list(buf.split(m)), sizes)

    def reduce_scatter(
        self, x: torch.Tensor, op: str, group: ProcessGroup, split_sizes: Sequence[int] | None = None
    ) -> torch.Tensor:
        world, rank = self.world_size(group), self.rank(group)
        x = x.contiguous()
        sizes = list(split_sizes) if split_sizes is not None else [x.shape[0] // world] * world
        if op not in ("sum", "avg"):
            start = sum(sizes[:rank])
            return self.all_reduce(x, op, group)[start : start + sizes[rank]]
        m = max(sizes)
        if all(s == m for s in sizes):
            inp = x
        else:  # pad each chunk to the largest, so one reduce_scatter does it
            pad = [_pad_rows(c, m) for c, s in zip(x.split(sizes), sizes)]
            inp = torch.cat(pad)
        out = self._done(_funcol_reduce_scatter(_wire(inp), "sum", 0, self._pg(group)))
        out = torch.view_as_complex(out) if x.is_complex() else out
        out = out if sizes[rank] == m else out[: sizes[rank]]
        return out / world if op == "avg" else out

    def gather(
        self, x: torch.Tensor, dst: int, group: ProcessGroup, sizes: Sequence[int] | None = None
    ) -> torch.Tensor:
        world, rank = self.world_size(group), self.rank(group)
        x = x.contiguous()
        sizes = list(sizes) if sizes is not None else [x.shape[0]] * world
        ins = [x.shape[0] if j == dst else 0 for j in range(world)]
        outs = list(sizes) if rank == dst else [0] * world
        out = self.all_to_all(x, group, ins, outs)
        return out if rank == dst else x.new_zeros((sum(sizes), *x.shape[1:]))

    def scatter(
        self, x: torch.Tensor, src: int, group: ProcessGroup, split_sizes: Sequence[int] | None = None
    ) -> torch.Tensor:
        world, rank = self.world_size(group), self.rank(group)
        x = x.contiguous()
        sizes = list(split_sizes) if split_sizes is not None else [x.shape[0] // world] * world
        ins = list(sizes) if rank == src else [0] * world
        outs = [sizes[rank] if j == src else 0 for j in range(world)]
        return self.all_to_all(x if rank == src else x[:0], group, ins, outs)

    def all_to_all(
        self,
        x: torch.Tensor,
        group: ProcessGroup,
        input_split_sizes: Sequence[int] | None = None,
        output_split_sizes: Sequence[int] | None = None,
    ) -> torch.Tensor:
        world = self.world_size(group)
        x = x.contiguous()
        ins = list(input_split_sizes) if input_split_sizes is not None else [x.shape[0] // world] * world
        if output_split_sizes is None:
            if input_split_sizes is not None:
                raise ValueError(
                    "diffcomm.all_to_all(): under torch.compile the received split sizes cannot be "
                    "exchanged (a host read dynamo cannot trace); pass `output_split_sizes=`"
                )
            output_split_sizes = ins
        out = self._done(
            _funcol().all_to_all_single(_wire(x), list(output_split_sizes), ins, self._pg(group))
        )
        return torch.view_as_complex(out) if x.is_complex() else out

    def barrier(self, group: ProcessGroup) -> None:
        raise RuntimeError("diffcomm: barrier() cannot run inside torch.compile'd code")

    def check_consistent(self, op: str, fields: dict[str, Any], group: ProcessGroup) -> None:
        """Skipped inside compiled code: the cross-rank check needs a host read."""


def _funcol() -> Any:
    import torch.distributed._functional_collectives as funcol

    return funcol


def _funcol_all_gather(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    f = _funcol()
    return (getattr(f, "all_gather_single", None) or f.all_gather_tensor)(x, dim, group)


def _funcol_reduce_scatter(x: torch.Tensor, op: str, dim: int, group: Any) -> torch.Tensor:
    f = _funcol()
    return (getattr(f, "reduce_scatter_single", None) or f.reduce_scatter_tensor)(x, op, dim, group)


_BACKEND: Backend = TorchDistributedBackend()
_TRACEABLE = TraceableBackend()


def get_backend() -> Backend:
    """The backend adapter every collective calls (:class:`TraceableBackend` while
    ``torch.compile`` traces, whatever :func:`set_backend` installed)."""
    if torch.compiler.is_compiling():
        return _TRACEABLE  # type: ignore[return-value]
    return _BACKEND


def set_backend(backend: Backend) -> Any:
    """Swap the adapter (e.g. a wrapper that records calls); a ``with`` block restores."""
    global _BACKEND
    old = _BACKEND
    _BACKEND = backend

    class _Restore:
        def __enter__(self) -> Backend:
            return backend

        def __exit__(self, *exc: object) -> None:
            global _BACKEND
            _BACKEND = old

    return _Restore()

