"""Error types raised by diffcomm.

Every error diffcomm raises on purpose is one of these (or a plain ``ValueError`` /
``TypeError`` subclass of them), so callers can catch them precisely.
"""

from __future__ import annotations

from typing import Any


class DiffcommError(RuntimeError):
    """Base class of the runtime errors diffcomm raises."""


class CollectiveTimeoutError(DiffcommError, TimeoutError):
    """A collective did not complete in time on this rank.

    The usual cause under autograd: one rank's loss does not depend on an output of a
    collective, so PyTorch skips that collective's backward on that rank while the other
    ranks wait for it.
    """


class DesyncError(CollectiveTimeoutError):
    """A communication could not complete because the ranks are out of step (a desync).

    Raised on a rank whose collective timed out (``DIFFCOMM_TIMEOUT``) or lost its peer.
    The message carries the cross-rank diagnosis from the flight recorder: the first
    sequence number where the ranks diverge, which ranks are inside which op from which
    call site, and which ranks are missing (with their last completed op, or that they
    returned or are busy in user code).

    Attributes:
        facts: ``{"group": [global ranks], "seq": first diverging sequence number,
            "culprits": [ranks], "op": the diffcomm op, "direction": forward/backward}``.
    """

    def __init__(self, message: str, facts: dict | None = None) -> None:
        super().__init__(message)
        self.facts: dict = dict(facts or {})

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.facts))


class WorldTooLargeError(DiffcommError, ValueError):
    """A :class:`~diffcomm.LocalWorld` asked for more ranks than this machine can hold.

    Refused before any process starts, with the numbers (ranks per core, estimated memory
    against what is available) and the override (``allow_oversubscribe=True`` or
    ``DIFFCOMM_ALLOW_OVERSUBSCRIBE=1``).
    """


class CrossRankMismatchError(DiffcommError, ValueError):
    """Debug mode found that ranks called a collective with inconsistent arguments."""


class RankError(DiffcommError):
    """One or more ranks of a :class:`~diffcomm.LocalWorld` raised or died.

    Attributes:
        failures: ``{rank: remote traceback text}`` for every rank that failed.
        exceptions: ``{rank: exception object}`` for every rank that raised one that
            could be sent back (pickled) to the caller.
    """

    def __init__(
        self,
        message: str,
        failures: dict[int, str] | None = None,
        exceptions: dict[int, BaseException] | None = None,
    ) -> None:
        super().__init__(message)
        self.failures: dict[int, str] = dict(failures or {})
        self.exceptions: dict[int, BaseException] = dict(exceptions or {})


class RankDiedError(RankError):
    """A rank's process exited while it was running a function."""

    def __init__(
        self,
        message: str,
        exitcodes: dict[int, int | None],
        failures: dict[int, str] | None = None,
        exceptions: dict[int, BaseException] | None = None,
    ) -> None:
        super().__init__(message, failures, exceptions)
        self.exitcodes = dict(exitcodes)


class WorldTimeoutError(RankError, TimeoutError):
    """A :meth:`~diffcomm.LocalWorld.run` call did not finish before its timeout."""

    def __init__(self, message: str, busy_ranks: list[int], failures: dict[int, str] | None = None):
        super().__init__(message, failures)
        self.busy_ranks = list(busy_ranks)


class RankDesyncError(RankError):
    """The ranks of a :class:`~diffcomm.LocalWorld` went out of step (a desync).

    Raised by :meth:`~diffcomm.LocalWorld.run` when a rank returned from the function
    while others wait for it in a collective (detected within about a second), or when a
    rank raised :class:`DesyncError`. The message leads with the diagnosis; ``facts``
    holds it as data (see :class:`DesyncError`).
    """

    def __init__(
        self,
        message: str,
        facts: dict | None = None,
        failures: dict[int, str] | None = None,
        exceptions: dict[int, BaseException] | None = None,
    ) -> None:
        super().__init__(message, failures, exceptions)
        self.facts: dict = dict(facts or {})

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.facts, self.failures, self.exceptions))
