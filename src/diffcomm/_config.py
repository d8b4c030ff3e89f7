"""Settings, read once from the environment, each also usable as a ``with`` block.

=========================  =====================  ==========================================
setting                    environment variable   meaning
=========================  =====================  ==========================================
``debug``                  ``DIFFCOMM_DEBUG``     cross-rank argument checks before each op
``timeout``                ``DIFFCOMM_TIMEOUT``   seconds a collective may wait (float > 0)
``accelerator``            ``DIFFCOMM_ACCELERATOR``  ``cpu``/``cuda``/``mps``/``xpu`` or unset
``flight``                 ``DIFFCOMM_FLIGHT``    flight recorder on (default) or off
``flight_size``            ``DIFFCOMM_FLIGHT_SIZE``  entries the flight recorder keeps (1024)
``allow_oversubscribe``    ``DIFFCOMM_ALLOW_OVERSUBSCRIBE``  start a LocalWorld the machine cannot hold
``progress``               ``DIFFCOMM_PROGRESS``  LocalWorld start-up progress on stderr: ``auto``
                                                 (default: when stderr is a terminal), 1 or 0
``rank_start``             ``DIFFCOMM_RANK_START``  how a LocalWorld rank starts: ``fork`` (default
                                                 on Linux: forked by a fork server that imported
                                                 torch once) or ``spawn`` (a fresh interpreter)
=========================  =====================  ==========================================

Usage::

    diffcomm.debug(True)            # switch on for the rest of the program
    with diffcomm.debug(True):      # or only inside the block; the old value comes back
        ...
"""

from __future__ import annotations

import contextlib
import datetime
import difflib
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean; use one of 1/0, true/false, yes/no, on/off")


def _parse_progress(name: str, raw: str) -> bool | None:
    """``auto`` (or empty) -> ``None``: decided by whether stderr is a terminal."""
    if raw.strip().lower() in ("", "auto"):
        return None
    try:
        return _parse_bool(name, raw)
    except ValueError:
        raise ValueError(
            f"{name}={raw!r} is not auto or a boolean; use auto, 1/0, true/false, yes/no, on/off"
        ) from None


def _parse_timeout(name: str, raw: str) -> float | None:
    value = raw.strip().lower()
    if value in ("", "none"):
        return None
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds (e.g. 30 or 2.5)") from None
    if not seconds > 0:
        raise ValueError(f"{name}={raw!r} must be a positive number of seconds")
    if seconds == float("inf"):  # (torch's timedelta overflows; no timeout is spelled none)
        raise ValueError(f"{name}={raw!r} must be a finite number of seconds (none: no timeout)")
    return seconds


_ACCELERATORS = ("cpu", "cuda", "mps", "xpu")


def _parse_accelerator(name: str, raw: str) -> str | None:
    value = raw.strip().lower()
    if value == "":
        return None
    if value not in _ACCELERATORS:
        raise ValueError(f"{name}={raw!r} is not a known accelerator; legal values: {_ACCELERATORS}")
    return value


def _parse_rank_start(name: str, raw: str) -> str:
    how = raw.strip().lower()
    if how not in ("fork", "spawn"):
        raise ValueError(f"{name}={raw!r} is not a way to start a rank; use 'fork' or 'spawn'")
    return how


def _parse_size(name: str, raw: str) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer (e.g. 1024)") from None
    if value < 1:
        raise ValueError(f"{name}={raw!r} must be >= 1")
    return value


#: Per parser, the types a value set in code (not parsed from a string) must have, and
#: how the error names them (:meth:`Setting.validate`).
_TYPES: dict[Callable[..., Any], tuple[tuple[type, ...], str]] = {
    _parse_bool: ((bool,), "a bool"),
    _parse_progress: ((bool, type(None)), "a bool or None (auto)"),
    _parse_rank_start: ((str,), "the str 'fork' or 'spawn'"),
}


class _Restore:
    """Returned by a setting's setter: already applied; as a ``with`` block, restores."""

    def __init__(self, setting: Setting[Any], old: Any) -> None:
        self._setting = setting
        self._old = old
        self._old_in_code = setting.in_code

    def __enter__(self) -> _Restore:
        return self

    def __exit__(self, *exc: object) -> None:
        self._setting.value = self._old
        self._setting.in_code = self._old_in_code

    def __repr__(self) -> str:
        return f"<{self._setting.name}={self._setting.get()!r}>"


class Setting(Generic[T]):
    """One named setting: read once from the environment, validated, overridable.

    :meth:`get` reads it (from the environment the first time). The hot paths read it
    without a call, in one expression::

        DEBUG.value if DEBUG.loaded else DEBUG.get()

    ``loaded`` is ``True`` once the environment has been read (or a value set), and
    ``value`` is then the current value; both are public for that read only (set a
    setting with :meth:`set`).
    """

    def __init__(self, name: str, env: str, parse: Callable[[str, str], T], default: T) -> None:
        self.name = name
        self.env = env
        self._parse = parse
        self._default = default
        #: Whether the environment has been read (``value`` is then current).
        self.loaded = False
        #: The current value once ``loaded`` (the default before).
        self.value: T = default
        #: Whether the program's code set the value (:meth:`set`; a ``with`` block restores
        #: it): a value set in code is carried to a ``LocalWorld``'s ranks even where it
        #: equals the environment's, which a rank's world may override (:func:`carried`).
        self.in_code = False

    def get(self) -> T:
        """The current value (the environment is read the first time)."""
        if not self.loaded:
            raw = os.environ.get(self.env)
            self.value = self._default if raw is None else self._parse(self.env, raw)
            self.loaded = True
        return self.value

    def set(self, value: T) -> _Restore:
        old = self.get()
        if isinstance(value, str):
            value = self._parse(self.name, value)
        self.value = self.validate(value)
        restore = _Restore(self, old)
        self.in_code = True
        return restore

    def validate(self, value: Any) -> T:
        wanted = _TYPES.get(self._parse)
        if wanted is not None and not isinstance(value, wanted[0]):
            raise TypeError(f"{self.name} must be {wanted[1]}, got {type(value).__name__}")
        if self._parse is _parse_timeout:
            given = value
            if isinstance(value, datetime.timedelta):  # (what init_process_group takes)
                value = value.total_seconds()
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                    raise ValueError(
                        f"{self.name} must be a positive number of seconds or None, got {given!r}"
                        " (a datetime.timedelta is taken too)"
                    )
                if value == float("inf"):  # (torch's timedelta overflows: None is no timeout)
                    raise ValueError(f"{self.name} must be a finite number of seconds or None, got {given!r}")
                value = float(value)
        elif self._parse is _parse_size:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{self.name} must be an int >= 1, got {value!r}")
        elif self._parse is _parse_accelerator:
            if value is not None:
                value = _parse_accelerator(self.name, str(value))
        return value

    def from_environment(self) -> T:
        """What a fresh process reads: the environment's value, or the default."""
        raw = os.environ.get(self.env)
        return self._default if raw is None else self._parse(self.env, raw)

    def reload(self) -> None:
        """Forget the cached value; the next :meth:`get` reads the environment again."""
        self.loaded = False
        self.in_code = False


DEBUG: Setting[bool] = Setting("debug", "DIFFCOMM_DEBUG", _parse_bool, False)
TIMEOUT: Setting[float | None] = Setting("timeout", "DIFFCOMM_TIMEOUT", _parse_timeout, None)
ACCELERATOR: Setting[str | None] = Setting("accelerator", "DIFFCOMM_ACCELERATOR", _parse_accelerator, None)
FLIGHT: Setting[bool] = Setting("flight", "DIFFCOMM_FLIGHT", _parse_bool, True)
FLIGHT_SIZE: Setting[int] = Setting("flight_size", "DIFFCOMM_FLIGHT_SIZE", _parse_size, 1024)
ALLOW_OVERSUBSCRIBE: Setting[bool] = Setting(
    "allow_oversubscribe", "DIFFCOMM_ALLOW_OVERSUBSCRIBE", _parse_bool, False
)
PROGRESS: Setting[bool | None] = Setting("progress", "DIFFCOMM_PROGRESS", _parse_progress, None)
RANK_START: Setting[str] = Setting("rank_start", "DIFFCOMM_RANK_START", _parse_rank_start, "fork")

#: Every setting, in the order of the table above.
EVERY = (DEBUG, TIMEOUT, ACCELERATOR, FLIGHT, FLIGHT_SIZE, ALLOW_OVERSUBSCRIBE, PROGRESS, RANK_START)
#: ``DIFFCOMM_*`` names that are no setting and still no mistake: diffcomm's own
#: (``DIFFCOMM_FAULT_DIR``, set on each ``LocalWorld`` rank) and its docs' tooling.
_NOT_SETTINGS = ("DIFFCOMM_FAULT_DIR", "DIFFCOMM_REGENERATE_DOCS")
_WARNED: set[str] = set()  # the unknown names already warned of (once per process)


def check_environment(stacklevel: int = 2) -> None:
    """Check every ``DIFFCOMM_*`` variable when a world starts (``LocalWorld``, ``launch``,
    ``init``): nothing else would, as each is read only when first needed.

    A malformed value of a setting (``DIFFCOMM_FLIGHT_SIZE=abc``) is a ``ValueError``
    naming the variable, now, in the caller: else the first rank op to read it raised,
    or, where nothing read it (``DIFFCOMM_ACCELERATOR=tpu`` on gloo ranks), it was
    silently ignored. A ``DIFFCOMM_*`` name that is no setting (``DIFFCOMM_TIMOUT=5``, a
    misspelling that would otherwise silently change nothing) is warned of, once per
    process, naming the closest setting's variable.
    """
    for s in EVERY:
        s.from_environment()
    known = {s.env for s in EVERY}
    for name in sorted(os.environ):
        if not name.startswith("DIFFCOMM_") or name in known or name in _NOT_SETTINGS or name in _WARNED:
            continue
        _WARNED.add(name)
        # (compared without the prefix, which every name shares)
        close = difflib.get_close_matches(name[9:], sorted(k[9:] for k in known), n=1, cutoff=0.7)
        warnings.warn(
            f"diffcomm: the environment variable {name} is no diffcomm setting and is ignored"
            + (f"; did you mean DIFFCOMM_{close[0]}?" if close else "")
            + f" (the settings: {', '.join(s.env for s in EVERY)})",
            UserWarning,
            stacklevel=stacklevel + 1,
        )


def debug(enabled: bool | None = None) -> Any:
    """Read (no argument) or set cross-rank debug checks; a ``with`` block restores.

    In debug mode every collective first exchanges a small fingerprint (op, shape, dtype,
    root, ...) between the ranks and raises :class:`~diffcomm.CrossRankMismatchError`
    naming the ranks that differ, instead of hanging or returning garbage; every
    ``diffcomm.parallel`` mapping checks the assumption it rests on.
    """
    if enabled is None:
        return DEBUG.get()
    return DEBUG.set(enabled)


#: The settings a ``LocalWorld`` run carries from its caller to every rank. A rank is a
#: process of its own (or, in-process, has its own settings, as a fresh process does): it
#: reads the environment, so a ``dc.debug(True)`` or ``dc.timeout(2)`` in a notebook, or
#: a ``with`` block around ``world.run``, would not reach the ranks it runs: the checks
#: the user switched on would silently not run there, and a collective would wait the
#: world's timeout, not the one asked for. (``timeout`` takes effect on a running rank:
#: the flight recorder sets it on a group before each raw op, :mod:`diffcomm.diagnostics.recorder`.)
#: The others are not carried: ``accelerator``, ``flight`` and ``flight_size`` are set
#: by the environment only (a rank gets the caller's environment when its world starts;
#: ``set_accelerator``, the accelerator chosen in code, travels with the run:
#: :mod:`diffcomm.runtime.shipping`), and ``allow_oversubscribe``, ``progress`` and
#: ``rank_start`` are the caller's own (how a world starts).
_CARRIED = (DEBUG, TIMEOUT)


def carried() -> dict[str, Any]:
    """The carried settings the caller's code set (with :meth:`Setting.set`, or it holds
    them otherwise than its environment says), by name: what :func:`applied` sets on each
    rank for a run, over the rank's own environment. A value set in code travels also
    where it equals the caller's environment: a ``LocalWorld`` rank's ``DIFFCOMM_TIMEOUT``
    is the world's ``collective_timeout``, so ``with dc.timeout(60)`` under
    ``DIFFCOMM_TIMEOUT=60`` must reach it (it silently did not)."""
    return {s.name: v for s in _CARRIED if (v := s.get()) != s.from_environment() or s.in_code}


@contextlib.contextmanager
def applied(values: Mapping[str, Any]) -> Iterator[None]:
    """The settings ``values`` (from :func:`carried`) in force for the block."""
    by_name = {s.name: s for s in _CARRIED}
    with contextlib.ExitStack() as stack:
        for name, value in values.items():
            stack.enter_context(by_name[name].set(value))
        yield


def timeout(seconds: float | datetime.timedelta | None | str = "__get__") -> Any:
    """Read (no argument) or set the collective timeout in seconds; a ``with`` block restores.

    ``seconds`` may be a ``datetime.timedelta``, as ``init_process_group`` takes; it reads
    back as a float of seconds.

    It bounds every collective diffcomm runs from then on, on any group (the flight
    recorder sets it on the group before each op). Around :meth:`~diffcomm.LocalWorld.run`
    it holds on every rank of that run, over the world's ``collective_timeout``.
    """
    if seconds == "__get__":
        return TIMEOUT.get()
    return TIMEOUT.set(seconds)  # type: ignore[arg-type]


def settings() -> dict[str, Any]:
    """All current settings as a dict (for ``python -m diffcomm info``)."""
    return {s.name: s.get() for s in EVERY}
