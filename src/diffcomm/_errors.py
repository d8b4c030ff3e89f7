"""Error types raised by diffcomm.

Every error diffcomm raises on purpose is one of these (or a plain ``ValueError`` /
``TypeError`` subclass of them), so callers can catch them precisely.
"""

from __future__ import annotations


class DiffcommError(RuntimeError):
    """Base class of the runtime errors diffcomm raises."""


class CollectiveTimeoutError(DiffcommError, TimeoutError):
    """A collective did not complete in time on this rank.

    The usual cause under autograd: one rank's loss does not depend on an output of a
    collective, so PyTorch skips that collective's backward on that rank while the other
    ranks wait for it.
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
