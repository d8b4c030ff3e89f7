"""The comm-off switches: skip named raw collectives for ablation timing.

A switched-off op still returns a correctly shaped result (what a one-rank world would
compute from local data), so a training step runs on and its time without that
communication can be measured. Never for correctness. The switches are per thread
(:data:`diffcomm.diagnostics.logger.STATE`); the asynchronous engine adopts the launching
thread's switches for each job.

Everything here is re-exported by :mod:`diffcomm.backend`, its public home.
"""

from __future__ import annotations

from .logger import STATE
from .raw_ops import OP_NAMES


def off() -> set[str]:
    """This thread's switched-off op names (the live set)."""
    if not hasattr(STATE, "off"):
        STATE.off = set()
    return STATE.off


class comm_off:  # used like a function
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
        self._old = set(off())
        off().update(ops)

    def restore(self) -> None:
        STATE.off = set(self._old)

    def __enter__(self) -> comm_off:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


def is_off(op: str) -> bool:
    """Whether ``op`` is currently switched off by :class:`comm_off`."""
    return op in off()
