"""The raw-op table: every op name the backend dispatches, with what the debug layer
needs to know about it, stated once.

One row per raw op (the names :func:`diffcomm.backend.dispatch` is called with): its
bus-bandwidth factor (read by the comms logger and the benchmark), whether it is point
to point (sequence numbers per pair, for the flight recorder and the diagnosis), whether its ranks may
legitimately pass different shapes (read by the desync diagnosis, which then compares
only the op), and what it returns while switched off by
:func:`~diffcomm.backend.comm_off` (the switches accept exactly these names; the
switched-off result itself is computed by the backend next to the op). A test checks
that every name the backend dispatches has a row here and every row is dispatched.

Layer: the bottom of :mod:`diffcomm.diagnostics` (imports nothing of diffcomm), so the logger,
the switches and the diagnosis read it, and the backend above re-exports it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["RawOp", "RAW_OPS", "OP_NAMES", "P2P_OPS", "bus_factor"]


def _all_reduce_bus(n: int) -> float:
    return 2 * (n - 1) / n


def _one_pass_bus(n: int) -> float:
    return (n - 1) / n


def _unit_bus(n: int) -> float:
    return 1.0


@dataclass(frozen=True)
class RawOp:
    """One raw op the backend dispatches.

    Attributes:
        name: the name passed to ``dispatch`` (and to ``comm_off``, ``log_comms`` rows,
            flight records).
        bus: bus-bandwidth factor for ``n`` ranks (the nccl-tests convention: bytes on
            the busiest link per payload byte); 1 where the convention has none.
        pairwise: a point-to-point op: its sequence numbers count per sender/receiver
            pair, not per group (the flight recorder and the diagnosis).
        shape_free: its ranks may pass different shapes (uneven split sizes, point to
            point), so a shape difference between ranks is no desync.
        when_off: what the op returns while switched off (what a one-rank world would
            compute from local data; shapes kept, values wrong on purpose).
    """

    name: str
    bus: Callable[[int], float]
    pairwise: bool
    shape_free: bool
    when_off: str


def _coalesced(op: RawOp) -> RawOp:
    off = f"each part as {op.name}: {op.when_off}"
    return RawOp(f"{op.name}_coalesced", op.bus, op.pairwise, op.shape_free, off)


_SINGLE = (  # name, bus factor, pairwise, shape-free, result when switched off
    RawOp("all_reduce", _all_reduce_bus, False, False, "the input unchanged (reduced with itself)"),
    RawOp("broadcast", _unit_bus, False, False, "this rank's own tensor"),
    RawOp("reduce", _unit_bus, False, False, "the input unchanged on dst, zeros elsewhere"),
    RawOp("all_gather", _one_pass_bus, False, False, "this rank's own part repeated for every rank"),
    RawOp("reduce_scatter", _one_pass_bus, False, False, "this rank's chunk of its own input, unreduced"),
    RawOp("gather", _one_pass_bus, False, False, "this rank's own part repeated for every rank"),
    RawOp("scatter", _one_pass_bus, False, False, "this rank's chunk of its own input"),
    RawOp("all_to_all", _one_pass_bus, False, True, "its own chunk, zeros for the others' chunks"),
    RawOp("send", _unit_bus, True, True, "nothing sent"),
    RawOp("recv", _unit_bus, True, True, "zeros"),
    RawOp("batch_p2p", _unit_bus, True, True, "nothing sent, zeros received"),
    RawOp("barrier", _unit_bus, False, True, "no wait"),
)

#: Every raw op by name: the single ops, then the coalesced ones (``<op>_coalesced``,
#: logged once per coalesced call; see :func:`diffcomm.backend.run_coalesced`).
RAW_OPS: dict[str, RawOp] = {op.name: op for op in _SINGLE}
RAW_OPS.update(
    (f"{name}_coalesced", _coalesced(RAW_OPS[name]))
    for name in ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter")
)

#: Every op name the backend dispatches (the names :func:`~diffcomm.backend.comm_off` accepts).
OP_NAMES: tuple[str, ...] = tuple(RAW_OPS)

#: The point-to-point raw ops (sequence numbers per sender/receiver pair).
P2P_OPS: frozenset[str] = frozenset(name for name, op in RAW_OPS.items() if op.pairwise)


def bus_factor(op: str, n: int) -> float:
    """The bus-bandwidth factor of raw op ``op`` over ``n`` ranks (1 for a name not in the
    table, such as a diffcomm op the benchmark times that no raw op matches)."""
    row = RAW_OPS.get(op)
    return row.bus(max(n, 1)) if row is not None else 1.0
