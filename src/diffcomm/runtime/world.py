"""Running ranks: ``init`` (inside torchrun), ``launch`` and ``LocalWorld`` (local processes).

``LocalWorld(n)`` starts ``n`` processes once, joins them into a real process group
(gloo by default, on 127.0.0.1, with a TCPStore the caller hosts) and keeps them alive
across many :meth:`LocalWorld.run` calls — what property tests and notebooks need.
Functions travel with ``cloudpickle``, so closures, lambdas and functions defined in a
notebook or a test module work.

Failure semantics (each is tested):

* a rank raises -> one :class:`~diffcomm.RankError` naming the rank(s) with their remote
  tracebacks; if every rank reported back, the world stays up for the next ``run``;
* a rank dies (``os._exit(3)``, a signal) -> :class:`~diffcomm.RankDiedError` naming the
  rank and its exit code within about a second; the world is torn down;
* a run exceeds ``timeout`` -> :class:`~diffcomm.WorldTimeoutError` naming the ranks still
  busy; the world is torn down;
* a rank returns while others wait for it in a collective (a desync) ->
  :class:`~diffcomm.RankDesyncError` within about a second, leading with the flight
  recorder's diagnosis (which op, which sequence number, who returned); torn down;
* a rank raises :class:`~diffcomm.DesyncError` (its collective timed out) ->
  :class:`~diffcomm.RankDesyncError` leading with that rank's diagnosis; torn down;
* Ctrl-C in the caller, garbage collection and interpreter exit -> children killed
  (the ranks ignore SIGINT from their first instruction, so a Ctrl-C prints nothing
  per rank);
* a world the machine cannot hold (too many ranks per core, or more estimated memory
  than is available) -> :class:`~diffcomm.WorldTooLargeError` before any process starts.

A torn-down world starts fresh processes at its next ``run`` (``world.restarts`` counts
them), so one failing property test does not poison the rest of a session; after
:meth:`LocalWorld.close` it refuses to run.
"""

from __future__ import annotations

import atexit
import datetime
import difflib
import inspect
import multiprocessing.connection as mpc
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import psutil
import torch.distributed as dist

from .. import _config
from .._errors import (
    RankDesyncError,
    RankDiedError,
    RankError,
    WorldTimeoutError,
    WorldTooLargeError,
)
from ..backend.args import check_flag, check_seconds
from . import forkserver as _forkserver
from . import reports as _report
from . import shipping as _ship
from .joining import _STARTUP_TIMEOUT, get_rank, get_world_size, init, is_initialized
from .processes import _ctrl_c_deferred, _Procs

if TYPE_CHECKING:
    pass

__all__ = ["LocalWorld", "launch", "init", "get_rank", "get_world_size", "is_initialized"]

# The caller side of LocalWorld (start, run, the watch loop that tells death, error,
# desync and timeout apart, teardown) and launch; joining a group (init) is
# ``diffcomm.runtime.joining``, the processes' state ``diffcomm.runtime.processes``, the
# rank process ``diffcomm.runtime.rank_process``, the failure messages and early
# diagnoses ``diffcomm.runtime.reports``.
# Size: ~710 lines, over the ~600 guideline: LocalWorld's two kinds share one front door
# (the settings checked and warned of once for both) and the watch loop is one piece;
# launch checks its settings and fn's arguments before any process starts.

DEFAULT_COLLECTIVE_TIMEOUT = 30.0  # seconds; LocalWorld's default for DIFFCOMM_TIMEOUT
DEFAULT_RUN_TIMEOUT = 300.0
_GRACE = 1.0  # seconds to wait for the other ranks' reports once one rank failed
_MAX_RANKS_PER_CORE = 8  # above this, start-up alone takes minutes (each rank imports torch)
_RANK_MEMORY = 350 * 2**20  # bytes one idle gloo rank holds (torch imported), measured ~300 MB
_FIRST_CHECK = 0.15  # seconds after a rank returned before asking the busy ranks what they do
_RECHECK = 0.3
_PROGRESS_AFTER = 2.0  # seconds of start-up before progress is printed
_STALL_FIRST = 1.0  # seconds into a run, no rank returned, before asking for a p2p deadlock
_STALL_MAX = 8.0  # the asking slows down to once per this many seconds


# --------------------------------------------------------------------------------------
# LocalWorld
# --------------------------------------------------------------------------------------


_LIVE: weakref.WeakSet[LocalWorld] = weakref.WeakSet()


def _stderr_is_a_terminal() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


@atexit.register
def _close_all() -> None:
    for w in list(_LIVE):
        w.close()


class LocalWorld:
    """``world_size`` local processes in one real process group, alive across runs.

    Args:
        world_size: number of ranks (>= 1).
        backend: c10d backend (``"gloo"`` on CPU; ``"nccl"`` with one GPU per rank).
        timeout: seconds one :meth:`run` may take before the busy ranks are named and
            the world is torn down. It and ``collective_timeout`` may each be a
            ``datetime.timedelta`` too, as ``init_process_group`` takes.
        collective_timeout: seconds a single collective may wait for its peers before it
            raises :class:`~diffcomm.CollectiveTimeoutError` on that rank (the ranks'
            ``DIFFCOMM_TIMEOUT``); default ``DIFFCOMM_TIMEOUT`` if set, else 30. As
            ``DIFFCOMM_TIMEOUT`` in any program, a ``dc.timeout(seconds)`` set in the
            caller's code (a ``with`` block around :meth:`run`) overrides it for a run:
            the run carries it, with ``dc.debug`` and ``set_accelerator``, to every rank.
        allow_oversubscribe: start even if the machine cannot hold the world (more than
            8 ranks per core, or more estimated memory than available); default
            ``DIFFCOMM_ALLOW_OVERSUBSCRIBE``. Otherwise such a world is refused with
            :class:`~diffcomm.WorldTooLargeError` before any process starts.
        progress: print start-up progress on stderr ("starting: 0/2 ranks ready after
            2 s", then "ready after 2.8 s") once a start-up takes over 2 s. ``None``
            (default): ``DIFFCOMM_PROGRESS`` (``auto``, ``1`` or ``0``), whose ``auto``
            prints only when stderr is a terminal; ``False`` (or ``DIFFCOMM_PROGRESS=0``)
            silences it.
        in_process: run every rank as a thread of this process instead of a process
            (:mod:`diffcomm.runtime.in_process`; docs/in_process.md): the same
            :meth:`run`, the same results (each rank its own RNG stream and groups), no
            start-up, and a desync reported at once. Its limits: no real transport (the
            ``"inproc"`` backend only; ``backend`` must stay ``"gloo"``), no timeouts, one
            rank running at a time, no torchrun. ``timeout``, ``collective_timeout``,
            ``allow_oversubscribe`` and ``progress`` do not apply: given (other than their
            defaults), each is named in a ``UserWarning``. Default ``False``: real processes.

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: dc.all_reduce(torch.ones(2)))   # [tensor([2., 2.])] * 2
    """

    def __init__(
        self,
        world_size: int,
        backend: str = "gloo",
        timeout: float | datetime.timedelta = DEFAULT_RUN_TIMEOUT,
        collective_timeout: float | datetime.timedelta | None = None,
        allow_oversubscribe: bool | None = None,
        progress: bool | None = None,
        in_process: bool = False,
    ) -> None:
        if not isinstance(in_process, bool):
            raise TypeError(f"LocalWorld(): `in_process` must be a bool, got {in_process!r}")
        # every setting validated on both kinds of world (a wrong one is never ignored)
        # (a datetime.timedelta, as init_process_group takes, becomes seconds here)
        asked = (timeout, collective_timeout)  # (as given: the in-process warning names them)
        timeout = check_seconds("LocalWorld()", "timeout", timeout, optional=False)
        collective_timeout = check_seconds(
            "LocalWorld()", "collective_timeout", collective_timeout, optional=True
        )
        check_flag("LocalWorld()", "allow_oversubscribe", allow_oversubscribe)
        check_flag("LocalWorld()", "progress", progress)
        # every DIFFCOMM_* variable: a malformed value refused, an unknown name warned of
        _config.check_environment()
        self.in_process = in_process
        if in_process:
            self._init_in_process(world_size, backend, timeout, collective_timeout)
            _warn_not_in_process(
                asked[0] if timeout != DEFAULT_RUN_TIMEOUT else None, asked[1], allow_oversubscribe, progress
            )
            return
        if progress is None:
            progress = _config.PROGRESS.get()
        self.progress = progress if progress is not None else _stderr_is_a_terminal()
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"LocalWorld(): `world_size` must be an int >= 1, got {world_size!r}")
        allow = _config.ALLOW_OVERSUBSCRIBE.get() if allow_oversubscribe is None else allow_oversubscribe
        if not allow:
            check_world_fits(world_size)
        if not isinstance(backend, str) or not dist.is_backend_available(backend):
            raise ValueError(f"LocalWorld(): `backend` {backend!r} is not available in this torch build")
        if not timeout > 0:
            raise ValueError(f"LocalWorld(): `timeout` must be > 0 seconds, got {timeout!r}")
        self.world_size = world_size
        self.backend = backend
        self.timeout = float(timeout)
        if collective_timeout is not None and not collective_timeout > 0:
            raise ValueError(
                f"LocalWorld(): `collective_timeout` must be > 0 seconds or None, got {collective_timeout!r}"
            )
        ct = collective_timeout if collective_timeout is not None else _config.TIMEOUT.get()
        self.collective_timeout = float(ct if ct is not None else DEFAULT_COLLECTIVE_TIMEOUT)
        self.restarts = 0
        self._state = _Procs()
        self._closed = False
        self._started = False
        self._finalizer = weakref.finalize(self, _Procs.shutdown, self._state, False)
        _LIVE.add(self)
        self._start()

    def _init_in_process(
        self, world_size: int, backend: str, timeout: float, collective_timeout: float | None
    ) -> None:
        """The in-process world: validated like a real one; nothing to start."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"LocalWorld(): `world_size` must be an int >= 1, got {world_size!r}")
        if backend != "gloo":
            raise ValueError(
                f"LocalWorld(in_process=True): `backend` {backend!r} needs real processes; an "
                "in-process world moves its data in memory (leave `backend` at its default)"
            )
        if not timeout > 0:
            raise ValueError(f"LocalWorld(): `timeout` must be > 0 seconds, got {timeout!r}")
        self.world_size = world_size
        self.backend = backend
        self.timeout = float(timeout)
        ct = collective_timeout if collective_timeout is not None else _config.TIMEOUT.get()
        self.collective_timeout = float(ct if ct is not None else DEFAULT_COLLECTIVE_TIMEOUT)
        self.progress = False
        self.restarts = 0
        self._state = _Procs()
        self._ranks: Any = None  # the ranks' RankStates, made at the first run
        self._closed = False
        self._started = True
        self._finalizer = weakref.finalize(self, _Procs.shutdown, self._state, False)

    # ---- lifecycle -----------------------------------------------------------------
    @property
    def pids(self) -> list[int]:
        """Process ids of the ranks (empty while torn down)."""
        return [p.pid for p in self._state.procs]

    @property
    def alive(self) -> bool:
        if self.in_process:
            return not self._closed
        return self._started and all(p.poll() is None for p in self._state.procs)

    def _start(self) -> None:
        st = self._state
        st.fault_dir = tempfile.TemporaryDirectory(prefix="diffcomm-faults-")
        st.store = dist.TCPStore(
            "127.0.0.1",
            0,
            None,
            True,
            timeout=datetime.timedelta(seconds=self.collective_timeout),
            wait_for_workers=False,
        )
        port = st.store.port
        # Ranks are forked by a fork server or spawned (never a fork of the caller, nor
        # multiprocessing): the caller's __main__ is never re-imported, so scripts
        # without a `__main__` guard and notebooks just work.
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env.setdefault("OMP_NUM_THREADS", "1")
        env["DIFFCOMM_FAULT_DIR"] = st.fault_dir.name
        try:
            # A Ctrl-C while spawning is held until every started rank is recorded in
            # ``st.procs`` (else one landing between Popen's return and the append would
            # leave an orphan rank behind), then raised here and torn down below.
            with _ctrl_c_deferred():
                for rank in range(self.world_size):
                    self._spawn(rank, port, env)
            self._started = True
            limit = max(_STARTUP_TIMEOUT, self.timeout)
            replies = self._collect(set(range(self.world_size)), limit, "start-up")
        except BaseException:
            self._teardown()
            raise
        bad = {r: v for r, v in replies.items() if v[0] != "ready"}
        if bad:
            self._teardown()
            raise RankError(
                "LocalWorld: ranks failed to start:\n"
                + "\n".join(f"[rank {r}]\n{v[1][0]}" for r, v in bad.items()),
                {r: v[1][0] for r, v in bad.items()},
            )

    def _spawn(self, rank: int, port: int, env: dict[str, str]) -> None:
        args = (rank, self.world_size, self.backend, port, self.collective_timeout)
        proc, conn = _forkserver.start_rank(args, env, max(_STARTUP_TIMEOUT, self.timeout))
        self._state.procs.append(proc)
        self._state.conns.append(conn)

    def _teardown(self) -> None:
        self._state.shutdown(graceful=False)
        self._started = False

    def close(self) -> None:
        """Stop every rank (gracefully, then by force) and release the port."""
        if self._closed:
            return
        self._closed = True
        self._state.shutdown(graceful=self._started)
        self._started = False
        self._finalizer.detach()
        _LIVE.discard(self)

    def __enter__(self) -> LocalWorld:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("running" if self._started else "torn down")
        if self.in_process:
            return f"LocalWorld(world_size={self.world_size}, in_process=True, {state})"
        return f"LocalWorld(world_size={self.world_size}, backend={self.backend!r}, {state})"

    # ---- running -------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank at once; return the results by rank.

        ``fn`` is positional-only, so every keyword reaches ``fn``: also one named ``fn``.

        Raises:
            RankError: a rank raised (``.failures`` has the remote tracebacks,
                ``.exceptions`` the exception objects where they could be pickled).
            RankDiedError: a rank's process died (``.exitcodes``).
            WorldTimeoutError: not done after ``timeout`` seconds (``.busy_ranks``).
            ValueError, TypeError: a setting of the caller's that cannot reach rank processes
                (``dc.timeout(None)``, an accelerator object of its own), before anything runs.
        """
        if self._closed:
            raise RuntimeError("LocalWorld.run(): this world is closed")
        if not callable(fn):
            raise TypeError(f"LocalWorld.run(): `fn` must be callable, got {type(fn).__name__}")
        # the caller's dc.debug(True), dc.timeout(2), set_accelerator: every rank's too
        carried = _ship.carried(None if self.in_process else self.collective_timeout)
        if self.in_process:
            from .in_process import RankStates, run_ranks

            if self._ranks is None:  # each rank's state, kept from run to run as a process's
                self._ranks = RankStates(self.world_size)
            return run_ranks(self.world_size, fn, args, kwargs, carried, self._ranks)
        if not self._started:
            self.restarts += 1
            self._state = _Procs()
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _Procs.shutdown, self._state, False)
            self._start()
        try:
            payload = _ship.dumps((fn, args, kwargs, list(sys.path), carried))
        except Exception as exc:
            raise TypeError(f"LocalWorld.run(): cannot pickle the function or its arguments: {exc}") from exc
        msg = pickle.dumps(("run", payload))
        for c in self._state.conns:
            c.send_bytes(msg)
        try:
            replies = self._collect(set(range(self.world_size)), self.timeout, getattr(fn, "__name__", "fn"))
        except BaseException:
            self._teardown()
            raise
        failures: dict[int, str] = {}
        fatal = False
        results: list[Any] = [None] * self.world_size
        for r in range(self.world_size):
            kind, value = replies[r]
            if kind == "ok":
                results[r] = _ship.loads(value)
            else:
                failures[r] = value[0]
                fatal = fatal or value[2]
        if failures:
            if fatal:
                self._teardown()
            exceptions = _report.exceptions(replies)
            desync = _report.desync_story(exceptions)
            if desync is not None:
                raise RankDesyncError(
                    f"LocalWorld: the ranks went out of step during `{getattr(fn, '__name__', 'fn')}` "
                    f"(the world was torn down; it restarts at the next run).\n{desync[0]}"
                    + _report.tracebacks(failures),
                    desync[1],
                    failures,
                    exceptions,
                )
            raise RankError(_report.failure_message(failures, fatal), failures, exceptions)
        return results

    def _collect(self, pending: set[int], timeout: float, what: str) -> dict[int, tuple[str, Any]]:
        """Wait for one reply per pending rank, watching for deaths, errors, desyncs and time.

        A rank's death shows up as end-of-file on its socket (only it holds the other end).
        Once a rank returned while others are still busy, the busy ranks are asked (through
        the store, by their flight-recorder threads) what they are doing; one blocked in a
        collective that a returned rank never reached is a desync, reported at once.
        """
        st = self._state
        replies: dict[int, tuple[str, Any]] = {}
        start = time.monotonic()
        deadline = start + timeout
        grace_deadline: float | None = None
        check_at: float | None = None
        progress_at = start + _PROGRESS_AFTER if what == "start-up" and self.progress else None
        # every rank busy: are some all blocked in receives nobody can serve? (a deadlock,
        # else found only by the collective timeout)
        stall_every = _STALL_FIRST
        stall_at = start + stall_every if what != "start-up" else None
        printed = False
        by_conn = {st.conns[r]: r for r in pending}
        died: dict[int, int | None] = {}
        fn_done: set[int] = set()  # ranks whose function returned, not reported yet
        while pending:
            now = time.monotonic()
            limit = deadline if grace_deadline is None else min(deadline, grace_deadline)
            if now >= limit:
                break
            wake = min(t for t in (limit, check_at, progress_at, stall_at) if t is not None)
            ready = mpc.wait([st.conns[r] for r in pending], timeout=max(0.0, wake - now))
            for obj in ready:
                r = by_conn[obj]  # type: ignore[index]
                try:
                    reply = pickle.loads(obj.recv_bytes())  # type: ignore[union-attr]
                    if reply[0] == "returned":  # its function returned; its pending sends and
                        fn_done.add(r)  # async ops complete before it reports: returned, as a
                        continue  # peer's desync check counts it (still in `pending`)
                    replies[r] = reply
                except (EOFError, OSError):
                    try:
                        died[r] = st.procs[r].wait(2)
                    except subprocess.TimeoutExpired:
                        died[r] = None
                    if grace_deadline is None:
                        grace_deadline = time.monotonic() + _GRACE / 2
                    pending.discard(r)
                    continue
                pending.discard(r)
                if replies[r][0] == "err":
                    if grace_deadline is None:
                        grace_deadline = time.monotonic() + _GRACE
                    if pending and pending <= _report.idle_ranks(replies[r]):
                        grace_deadline = time.monotonic()  # the rest are in no op: no report coming
            now = time.monotonic()
            if progress_at is not None and now >= progress_at and pending:
                done = self.world_size - len(pending)
                print(
                    f"diffcomm: LocalWorld({self.world_size}) starting: {done}/{self.world_size} ranks "
                    f"ready after {now - start:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
                printed = True
                progress_at = now + _PROGRESS_AFTER
            if what == "start-up" or grace_deadline is not None or not pending:
                continue
            returned = sorted({r for r, v in replies.items() if v[0] == "ok"} | fn_done)
            if not returned:
                if stall_at is not None and now >= stall_at:
                    stuck = _report.deadlock_check(self._state.store, self.world_size, what)
                    if stuck is not None:
                        self._teardown()
                        raise stuck
                    stall_every = min(2 * stall_every, _STALL_MAX)
                    stall_at = time.monotonic() + stall_every
                continue
            if check_at is None:
                check_at = now + _FIRST_CHECK
            elif now >= check_at:
                stuck = _report.desync_check(
                    self._state.store, self.world_size, returned, sorted(pending), what
                )
                if stuck is not None:
                    self._teardown()
                    raise stuck
                check_at = time.monotonic() + _RECHECK
        if printed and not pending:
            print(
                f"diffcomm: LocalWorld({self.world_size}) ready after {time.monotonic() - start:.1f} s",
                file=sys.stderr,
                flush=True,
            )
        failures = {r: v[1][0] for r, v in replies.items() if v[0] == "err"}
        exceptions = _report.exceptions(replies)
        desync = _report.desync_story(exceptions)
        if died:
            codes = ", ".join(f"rank {r} (exit code {c})" for r, c in sorted(died.items()))
            faults = "".join(
                f"\n\n--- rank {r}: the backend aborted it; its Python stacks ---\n{text.strip()}"
                for r in sorted(died)
                if (text := st.fault_text(r)).strip()
            )
            lead = (
                _report.abort_story(died, st.fault_text, st.store, self.world_size)
                if any(c == -signal.SIGABRT for c in died.values())
                else ""
            )
            self._teardown()
            raise RankDiedError(
                lead + f"LocalWorld: {codes} died during `{what}`; the world was torn down "
                f"(it restarts at the next run)."
                + (f"\n{desync[0]}" if desync else "")
                + faults
                + _report.tracebacks(failures),
                died,
                failures,
                exceptions,
            )
        if pending:
            busy = sorted(pending)
            self._teardown()
            if desync:
                raise RankDesyncError(
                    f"LocalWorld: the ranks went out of step during `{what}` (rank(s) {busy} still "
                    f"busy were torn down; the world restarts at the next run).\n{desync[0]}"
                    + _report.tracebacks(failures),
                    desync[1],
                    failures,
                    exceptions,
                )
            if failures:
                raise RankError(
                    f"LocalWorld: rank(s) {sorted(failures)} raised during `{what}` while rank(s) "
                    f"{busy} were still busy (most likely waiting in a collective for the failed "
                    f"rank); the world was torn down (it restarts at the next run)."
                    + _report.tracebacks(failures),
                    failures,
                    exceptions,
                )
            raise WorldTimeoutError(
                f"LocalWorld: `{what}` did not finish within {timeout:g} s; rank(s) {busy} still "
                f"busy; the world was torn down (it restarts at the next run).",
                busy,
            )
        return replies


def _warn_not_in_process(
    timeout: object, collective_timeout: object, allow_oversubscribe: bool | None, progress: bool | None
) -> None:
    """Name the settings given to an in-process world that cannot apply there (they were
    silently ignored): how rank processes start, and the timeouts of a real world (as the
    caller gave them; ``timeout`` ``None`` where it is the default)."""
    given = {
        "timeout": timeout,
        "collective_timeout": collective_timeout,
        "allow_oversubscribe": allow_oversubscribe,
        "progress": progress,
    }
    named = [f"`{k}={v!r}`" for k, v in given.items() if v is not None]
    if not named:
        return
    verb = (
        "does not apply to an in-process world and is"
        if len(named) == 1
        else "do not apply to an in-process world and are"
    )
    # the user's frame: above LocalWorld.__init__ (and launch, where it made the world)
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_globals.get("__name__") == __name__:
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    warnings.warn(
        f"LocalWorld(in_process=True): {', '.join(named)} {verb} ignored: "
        "`allow_oversubscribe` and `progress` concern starting rank processes (an in-process "
        "world starts none); `timeout` and `collective_timeout` bound the waits of "
        "real processes (in-process, a rank stuck in a collective is found at once, and a run "
        "is not bounded in time). Leave them out with in_process=True (docs/in_process.md)",
        UserWarning,
        stacklevel=level,
    )


def check_world_fits(world_size: int, override: str | None = None) -> None:
    """Raise :class:`~diffcomm.WorldTooLargeError` if this machine cannot hold the world.

    ``override``: how the caller's user overrides the refusal (a command line names its
    flag, ``--allow-oversubscribe``); default ``LocalWorld``'s argument and the variable.

    Bounds: at most 8 ranks per CPU core (each rank imports torch and runs its own
    threads), and the per-rank memory estimate (about 350 MB for an idle gloo rank) times
    ``world_size`` within 90% of the memory available now.
    """
    cores = psutil.cpu_count(logical=True) or os.cpu_count() or 1
    avail = psutil.virtual_memory().available
    need = world_size * _RANK_MEMORY
    problems = []
    if world_size > _MAX_RANKS_PER_CORE * cores:
        problems.append(
            f"{world_size} ranks on {cores} CPU core(s) is {world_size / cores:.1f} ranks per core "
            f"(bound: {_MAX_RANKS_PER_CORE})"
        )
    if need > 0.9 * avail:
        problems.append(
            f"{world_size} ranks x ~{_RANK_MEMORY / 2**20:.0f} MB = {need / 2**30:.1f} GB estimated, "
            f"{avail / 2**30:.1f} GB available"
        )
    if problems:
        raise WorldTooLargeError(
            f"LocalWorld({world_size}): this machine cannot hold the world: " + "; ".join(problems) + ". "
            "Use fewer ranks, or override with "
            + (override or "LocalWorld(..., allow_oversubscribe=True) or DIFFCOMM_ALLOW_OVERSUBSCRIBE=1")
            + "."
        )


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float | datetime.timedelta = DEFAULT_RUN_TIMEOUT,
    collective_timeout: float | datetime.timedelta | None = None,
    allow_oversubscribe: bool | None = None,
    progress: bool | None = None,
    in_process: bool = False,
    fn_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh local ranks; return their results.

    Starts a :class:`LocalWorld`, runs once and closes it. For many calls, keep a
    ``LocalWorld`` instead (a start costs a rendezvous, tens of ms, once the program's
    fork server is up; its first start, or each start with ranks spawned, about a second
    per rank).

    Args:
        fn: the function every rank runs.
        world_size: number of ranks.
        *args: ``fn``'s positional arguments.
        backend, timeout, collective_timeout, allow_oversubscribe, progress, in_process:
            :class:`LocalWorld`'s settings, by name (``in_process=True``: every rank a
            thread of this process, docs/in_process.md); never passed to ``fn``.
        fn_kwargs: keyword arguments for ``fn`` whose names are one of the settings above
            (``fn_kwargs={"timeout": 5}`` calls ``fn(timeout=5)``).
        **kwargs: every other keyword goes to ``fn``.

    Returns:
        Each rank's return value, by rank.

    Raises:
        TypeError: before any process starts, for a keyword spelt almost like a setting
            (``colective_timeout=5``: it would reach ``fn`` while the setting kept its
            default), and for arguments ``fn``'s signature cannot take.

    Example::

        dc.launch(lambda: dc.get_rank(), 3)                 # [0, 1, 2]
        dc.launch(train, 2, steps=10, collective_timeout=5)  # train(steps=10), 5 s per collective
        dc.launch(train, 2, fn_kwargs={"timeout": 5})       # train(timeout=5)
    """
    if not callable(fn):
        raise TypeError(f"launch(): `fn` must be callable, got {type(fn).__name__}")
    _refuse_misspelt_settings(kwargs)
    if fn_kwargs is not None:
        if not isinstance(fn_kwargs, dict):
            raise TypeError(f"launch(): `fn_kwargs` must be a dict, got {type(fn_kwargs).__name__}")
        both = sorted(set(fn_kwargs) & set(kwargs))
        if both:
            raise TypeError(f"launch(): keyword(s) {both} given both directly and in `fn_kwargs`")
        kwargs = {**kwargs, **fn_kwargs}
    _check_fn_takes(fn, args, kwargs)
    with LocalWorld(
        world_size,
        backend=backend,
        timeout=timeout,
        collective_timeout=collective_timeout,
        allow_oversubscribe=allow_oversubscribe,
        progress=progress,
        in_process=in_process,
    ) as world:
        return world.run(fn, *args, **kwargs)


#: ``launch``'s settings by name (every other keyword goes to ``fn``): its signature's own
_LAUNCH_SETTINGS = tuple(
    n for n, prm in inspect.signature(launch).parameters.items() if prm.kind is prm.KEYWORD_ONLY
)


def _refuse_misspelt_settings(kwargs: dict[str, Any]) -> None:
    """A keyword of ``launch`` spelt almost like one of its settings (``colective_timeout``,
    ``Timeout``; ``timeout_s`` is far enough) is a ``TypeError`` naming the setting, before
    any process starts: it would go to ``fn``, which raised on every rank after the world
    had started, or (an ``fn(**kwargs)``) took it while the setting silently kept its
    default. A keyword of ``fn``'s own spelt so goes through ``fn_kwargs``."""
    for name in kwargs:
        close = difflib.get_close_matches(name.lower(), _LAUNCH_SETTINGS, n=1, cutoff=0.9)
        if close:
            raise TypeError(
                f"launch(): unknown setting `{name}`; did you mean `{close[0]}`? (Keywords other "
                f"than launch's settings {list(_LAUNCH_SETTINGS)} go to fn: pass a keyword of "
                f"fn's own spelt like a setting through fn_kwargs={{{name!r}: ...}}.)"
            )


def _check_fn_takes(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """``fn``'s signature takes ``(*args, **kwargs)``, else a ``TypeError`` naming both,
    before any process starts (each rank raised torch's ``unexpected keyword argument``
    after the world had started). A callable without a signature is not checked; a wrapper
    is checked by its own signature (``follow_wrapped=False``: the one the ranks call)."""
    try:
        sig = inspect.signature(fn, follow_wrapped=False)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as exc:
        name = getattr(fn, "__qualname__", None) or type(fn).__name__
        raise TypeError(
            f"launch(): fn {name}{sig} cannot be called with the arguments given ({exc}); "
            f"launch's own settings are {list(_LAUNCH_SETTINGS)}, every other argument goes to fn"
        ) from None
