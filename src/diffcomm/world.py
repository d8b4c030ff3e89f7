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
* Ctrl-C in the caller, garbage collection and interpreter exit -> children killed.

A torn-down world starts fresh processes at its next ``run`` (``world.restarts`` counts
them), so one failing property test does not poison the rest of a session; after
:meth:`LocalWorld.close` it refuses to run.
"""

from __future__ import annotations

import atexit
import datetime
import multiprocessing.connection as mpc
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

import cloudpickle
import psutil
import torch
import torch.distributed as dist

from . import _config
from ._errors import CollectiveTimeoutError, RankDiedError, RankError, WorldTimeoutError

__all__ = ["LocalWorld", "launch", "init", "get_rank", "get_world_size", "is_initialized"]

DEFAULT_COLLECTIVE_TIMEOUT = 30.0  # seconds; LocalWorld's default for DIFFCOMM_TIMEOUT
DEFAULT_RUN_TIMEOUT = 300.0
_STARTUP_TIMEOUT = 120.0  # seconds for every rank to start (import torch) and rendezvous
_GRACE = 1.0  # seconds to wait for the other ranks' reports once one rank failed


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (group-local), 0 when not distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    from ._args import resolve_group

    return dist.get_rank(resolve_group(group, "get_rank"))


def get_world_size(group: Any = None) -> int:
    """Number of ranks in ``group``, 1 when not distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    from ._args import resolve_group

    return dist.get_world_size(resolve_group(group, "get_world_size"))


def is_initialized() -> bool:
    """Whether a default process group exists in this process."""
    return dist.is_available() and dist.is_initialized()


# --------------------------------------------------------------------------------------
# init (torchrun / multi-node)
# --------------------------------------------------------------------------------------


def init(backend: str | None = None, timeout: float | None = None, set_device: bool = True) -> None:
    """Join the process group described by the environment (torchrun, SLURM via torchrun).

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``.
    ``backend=None`` picks the accelerator's default (gloo on CPU, nccl on CUDA, ...), and
    the local device is set from ``LOCAL_RANK``. ``timeout`` (seconds) defaults to
    ``DIFFCOMM_TIMEOUT`` or torch's default. Calling it again is a no-op.

    Example::

        # torchrun --standalone --nproc-per-node=2 train.py
        import diffcomm as dc
        dc.init()
        y = dc.all_reduce(torch.ones(3))
    """
    if dist.is_initialized():
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"diffcomm.init(): environment variables {missing} are not set; run the script under "
            "`torchrun --nproc-per-node=N script.py`, or use diffcomm.launch / LocalWorld locally"
        )
    from .accelerator import get_accelerator

    acc = get_accelerator()
    name = backend or acc.communication_backend_name()
    seconds = timeout if timeout is not None else _config.TIMEOUT.get()
    kwargs: dict[str, Any] = {}
    if seconds is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=seconds)
    if set_device and acc.name != "cpu":
        acc.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(name, **kwargs)


# --------------------------------------------------------------------------------------
# the worker process
# --------------------------------------------------------------------------------------


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid or not psutil.pid_exists(parent_pid):
            os._exit(17)


def _worker_main(
    rank: int,
    world_size: int,
    backend: str,
    store_port: int,
    conn_fd: int,
    collective_timeout: float,
    parent_pid: int,
) -> None:
    conn = mpc.Connection(conn_fd)
    # The caller owns the ranks' lifetime: a Ctrl-C typed in the caller's terminal reaches
    # the whole process group, and must not kill idle ranks (the caller tears them down).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["DIFFCOMM_TIMEOUT"] = str(collective_timeout)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    torch.set_num_threads(1)
    try:
        timeout = datetime.timedelta(seconds=collective_timeout)
        # Ranks reach this point seconds apart on a loaded machine (importing torch), so
        # the rendezvous must not run under a short collective timeout: first wait, under
        # a start-up timeout, until every rank has arrived; then join the group.
        startup = datetime.timedelta(seconds=max(collective_timeout, _STARTUP_TIMEOUT))
        store = dist.TCPStore("127.0.0.1", store_port, world_size + 1, False, timeout=startup)
        store.set(f"diffcomm/arrived/{rank}", "1")
        store.wait([f"diffcomm/arrived/{r}" for r in range(world_size)], startup)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        if backend == "nccl" and torch.cuda.is_available():
            torch.cuda.set_device(rank % torch.cuda.device_count())
        conn.send_bytes(pickle.dumps(("ready", None)))
    except BaseException:
        conn.send_bytes(pickle.dumps(("err", (traceback.format_exc(), None, True))))
        return
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            break
        kind, payload = pickle.loads(data)
        if kind == "stop":
            break
        try:
            fn, args, kwargs, paths = cloudpickle.loads(payload)
            for p in paths:
                if p not in sys.path:
                    sys.path.append(p)
            result = fn(*args, **kwargs)
            reply = pickle.dumps(("ok", cloudpickle.dumps(result)))
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            fatal = isinstance(exc, CollectiveTimeoutError | dist.DistBackendError)
            try:
                exc_bytes = cloudpickle.dumps(exc)
            except Exception:  # noqa: BLE001
                exc_bytes = None
            reply = pickle.dumps(("err", (traceback.format_exc(), exc_bytes, fatal)))
        try:
            conn.send_bytes(reply)
        except (EOFError, OSError, BrokenPipeError):
            break
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    os._exit(0)


# --------------------------------------------------------------------------------------
# LocalWorld
# --------------------------------------------------------------------------------------


def _kill_tree(pids: list[int]) -> None:
    procs: list[psutil.Process] = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs.extend(p.children(recursive=True))
            procs.append(p)
        except psutil.Error:
            pass
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=5)


class _Procs:
    """The live processes of one incarnation of a world (finalizer-safe state)."""

    def __init__(self) -> None:
        self.procs: list[Any] = []
        self.conns: list[mpc.Connection] = []
        self.store: Any = None

    def shutdown(self, graceful: bool) -> None:
        if graceful:
            for c in self.conns:
                try:
                    c.send_bytes(pickle.dumps(("stop", None)))
                except Exception:  # noqa: BLE001
                    pass
            deadline = time.monotonic() + 3
            for p in self.procs:
                try:
                    p.wait(max(0.01, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        _kill_tree([p.pid for p in self.procs if p.poll() is None])
        for p in self.procs:
            try:
                p.wait(2)
            except Exception:  # noqa: BLE001
                pass
        for c in self.conns:
            try:
                c.close()
            except Exception:  # noqa: BLE001
                pass
        self.procs, self.conns = [], []
        self.store = None


_LIVE: weakref.WeakSet[LocalWorld] = weakref.WeakSet()


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
            the world is torn down.
        collective_timeout: seconds a single collective may wait for its peers before it
            raises :class:`~diffcomm.CollectiveTimeoutError` on that rank (the ranks'
            ``DIFFCOMM_TIMEOUT``); default ``DIFFCOMM_TIMEOUT`` if set, else 30.

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: dc.all_reduce(torch.ones(2)))   # [tensor([2., 2.])] * 2
    """

    def __init__(
        self,
        world_size: int,
        backend: str = "gloo",
        timeout: float = DEFAULT_RUN_TIMEOUT,
        collective_timeout: float | None = None,
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"LocalWorld(): `world_size` must be an int >= 1, got {world_size!r}")
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

    # ---- lifecycle -----------------------------------------------------------------
    @property
    def pids(self) -> list[int]:
        """Process ids of the ranks (empty while torn down)."""
        return [p.pid for p in self._state.procs]

    @property
    def alive(self) -> bool:
        return self._started and all(p.poll() is None for p in self._state.procs)

    def _start(self) -> None:
        st = self._state
        st.store = dist.TCPStore(
            "127.0.0.1",
            0,
            None,
            True,
            timeout=datetime.timedelta(seconds=self.collective_timeout),
            wait_for_workers=False,
        )
        port = st.store.port
        # Plain subprocesses (not multiprocessing): the caller's __main__ is never
        # re-imported, so scripts without a `__main__` guard and notebooks just work.
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env.setdefault("OMP_NUM_THREADS", "1")
        for rank in range(self.world_size):
            parent_sock, child_sock = socket.socketpair()
            fd = child_sock.fileno()
            cmd = [
                sys.executable,
                "-m",
                "diffcomm._worker",
                str(rank),
                str(self.world_size),
                self.backend,
                str(port),
                str(fd),
                repr(self.collective_timeout),
                str(os.getpid()),
            ]
            p = subprocess.Popen(cmd, pass_fds=(fd,), env=env, stdin=subprocess.DEVNULL)
            child_sock.close()
            st.procs.append(p)
            st.conns.append(mpc.Connection(parent_sock.detach()))
        self._started = True
        try:
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
        return f"LocalWorld(world_size={self.world_size}, backend={self.backend!r}, {state})"

    # ---- running -------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank at once; return the results by rank.

        Raises:
            RankError: a rank raised (``.failures`` has the remote tracebacks,
                ``.exceptions`` the exception objects where they could be pickled).
            RankDiedError: a rank's process died (``.exitcodes``).
            WorldTimeoutError: not done after ``timeout`` seconds (``.busy_ranks``).
        """
        if self._closed:
            raise RuntimeError("LocalWorld.run(): this world is closed")
        if not callable(fn):
            raise TypeError(f"LocalWorld.run(): `fn` must be callable, got {type(fn).__name__}")
        if not self._started:
            self.restarts += 1
            self._state = _Procs()
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _Procs.shutdown, self._state, False)
            self._start()
        try:
            payload = cloudpickle.dumps((fn, args, kwargs, list(sys.path)))
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
                results[r] = cloudpickle.loads(value)
            else:
                failures[r] = value[0]
                fatal = fatal or value[2]
        if failures:
            if fatal:
                self._teardown()
            raise RankError(_failure_message(failures, fatal), failures, _exceptions(replies))
        return results

    def _collect(self, pending: set[int], timeout: float, what: str) -> dict[int, tuple[str, Any]]:
        """Wait for one reply per pending rank, watching for deaths, errors and time.

        A rank's death shows up as end-of-file on its socket (only it holds the other end).
        """
        st = self._state
        replies: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        grace_deadline: float | None = None
        by_conn = {st.conns[r]: r for r in pending}
        died: dict[int, int | None] = {}
        while pending:
            now = time.monotonic()
            limit = deadline if grace_deadline is None else min(deadline, grace_deadline)
            if now >= limit:
                break
            ready = mpc.wait([st.conns[r] for r in pending], timeout=limit - now)
            for obj in ready:
                r = by_conn[obj]  # type: ignore[index]
                try:
                    replies[r] = pickle.loads(obj.recv_bytes())  # type: ignore[union-attr]
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
                if replies[r][0] == "err" and grace_deadline is None:
                    grace_deadline = time.monotonic() + _GRACE
        failures = {r: v[1][0] for r, v in replies.items() if v[0] == "err"}
        exceptions = _exceptions(replies)
        if died:
            self._teardown()
            codes = ", ".join(f"rank {r} (exit code {c})" for r, c in sorted(died.items()))
            raise RankDiedError(
                f"LocalWorld: {codes} died during `{what}`; the world was torn down "
                f"(it restarts at the next run)." + _tracebacks(failures),
                died,
                failures,
                exceptions,
            )
        if pending:
            busy = sorted(pending)
            self._teardown()
            if failures:
                raise RankError(
                    f"LocalWorld: rank(s) {sorted(failures)} raised during `{what}` while rank(s) "
                    f"{busy} were still busy (most likely waiting in a collective for the failed "
                    f"rank); the world was torn down (it restarts at the next run)." + _tracebacks(failures),
                    failures,
                    exceptions,
                )
            raise WorldTimeoutError(
                f"LocalWorld: `{what}` did not finish within {timeout:g} s; rank(s) {busy} still "
                f"busy; the world was torn down (it restarts at the next run).",
                busy,
            )
        return replies


def _exceptions(replies: dict[int, tuple[str, Any]]) -> dict[int, BaseException]:
    """The exception objects the failed ranks sent back (those that unpickle here)."""
    out: dict[int, BaseException] = {}
    for r, (kind, value) in replies.items():
        if kind == "err" and value[1] is not None:
            try:
                out[r] = cloudpickle.loads(value[1])
            except Exception:  # noqa: BLE001 - the traceback text is still reported
                pass
    return out


def _tracebacks(failures: dict[int, str]) -> str:
    return "".join(f"\n\n--- rank {r} traceback ---\n{tb}" for r, tb in sorted(failures.items()))


def _failure_message(failures: dict[int, str], fatal: bool) -> str:
    ranks = sorted(failures)
    last = failures[ranks[0]].strip().splitlines()[-1] if failures[ranks[0]].strip() else ""
    note = " The process group is unusable after this error; the world was torn down." if fatal else ""
    return f"rank(s) {ranks} raised: {last}.{note}" + _tracebacks(failures)


def launch(
    fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo", **kwargs: Any
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh local ranks; return their results.

    Starts a :class:`LocalWorld`, runs once and closes it. For many calls, keep a
    ``LocalWorld`` instead (start-up costs about a second per rank).

    Example::

        dc.launch(lambda: dc.get_rank(), 3)   # [0, 1, 2]
    """
    with LocalWorld(world_size, backend=backend) as world:
        return world.run(fn, *args, **kwargs)
