"""Rank processes forked from a process that has already imported torch.

Starting a rank as a fresh interpreter costs about a second of CPU, nearly all of it
importing torch; a world of 4 ranks on 2 cores waits two of those seconds, and every
world pays them again. Here one *fork server* per caller process imports torch, diffcomm's
rank side and their dependencies once, then forks each rank on request: the rank starts
with everything imported (copy-on-write pages), joins its world as a spawned rank does,
and is a real process with its own gloo (or NCCL) transport — only its start is cheaper.

The fork server is a plain subprocess of the caller (never a fork of the caller: the
caller's threads, its ``__main__`` and its CUDA state stay out of the ranks) and the ranks
are its children. It reports each rank's exit status to the caller, so the caller holds a
:class:`ForkedRank` with :class:`subprocess.Popen`'s ``pid`` / ``poll`` / ``wait`` /
``returncode``: every lifecycle rule of :class:`~diffcomm.LocalWorld` (a graceful stop,
then the process tree killed; a death seen as end-of-file and its exit code) holds as is.

* The environment a rank imports under is the fork server's: a server serves only
  callers whose environment, ``sys.path`` and working directory equal those it started
  with; after a change a new server starts and the old one ends once its last rank has.
  Two entries are no reason for a new server, only their presence is: each rank gets the
  caller's value after the fork, and nothing reads them at import —
  ``DIFFCOMM_FAULT_DIR`` (set per world) and ``PYTEST_CURRENT_TEST`` (pytest sets it per
  test phase: keyed on its value, a suite started a server, a second of CPU, for nearly
  every world).
* The server watches the caller: when the caller goes away (its socket closes), the
  server waits a moment for its ranks to end on their own (they see their own sockets
  close), kills the rest, and exits. Each rank watches the server, as a spawned rank
  watches its caller.
* Linux and gloo ranks only; elsewhere, for another backend (nccl: a GPU runtime must
  never be initialised in a process that forks ranks), or with
  ``DIFFCOMM_RANK_START=spawn`` (the ``rank_start`` setting), ranks are started as fresh
  interpreters (:func:`start_rank`).
"""

from __future__ import annotations

import multiprocessing.connection as mpc
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from .. import _config

#: seconds the server gives its ranks to end on their own once the caller has gone
_ORPHAN_GRACE = 3.0
#: the environment entries whose value changes per world or per test and that nothing
#: reads at import: their presence keys a server, their value does not (the fork applies it)
_PER_WORLD_ENV = ("DIFFCOMM_FAULT_DIR", "PYTEST_CURRENT_TEST")
_MAX_MESSAGE = 1 << 20


def enabled() -> bool:
    """Whether ranks are forked from a fork server: the ``rank_start`` setting
    (``DIFFCOMM_RANK_START``, default ``fork``) where the OS forks safely (Linux)."""
    return _config.RANK_START.get() == "fork" and sys.platform == "linux"


# --------------------------------------------------------------------------------------
# The caller's side
# --------------------------------------------------------------------------------------

# A spawned rank: ignore SIGINT first (a Ctrl-C in the caller's terminal prints no
# traceback per rank); import with the GC off (rank_process turns it on): -0.2 s CPU a
# rank (docs/performance.md).
_WORKER_BOOT = (
    "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); import gc; gc.disable(); "
    "import runpy; runpy.run_module('diffcomm.runtime.rank_process', run_name='__main__', alter_sys=True)"
)


def start_rank(args: tuple[Any, ...], env: dict[str, str], timeout: float) -> tuple[Any, mpc.Connection]:
    """Start one rank running ``rank_process._worker_main`` with ``args`` (rank, world
    size, backend, store port, collective timeout) in ``env``: forked by the fork server
    (:func:`enabled`; gloo ranks) or spawned as a fresh interpreter (another backend).
    Returns the process (a :class:`subprocess.Popen` or a :class:`ForkedRank`) and the
    caller's end of the rank's socket."""
    parent_sock, child_sock = socket.socketpair()
    fd = child_sock.fileno()
    try:
        # gloo ranks only: an accelerator's ranks (nccl) are spawned, so no rank ever
        # inherits a process in which a GPU runtime might have been initialised
        if enabled() and args[2] == "gloo":
            proc: Any = server_for(env).fork(args, fd, env, timeout)
        else:
            rank, world_size, backend, port, collective_timeout = args
            cmd = [sys.executable, "-c", _WORKER_BOOT, str(rank), str(world_size), backend, str(port)]
            cmd += [str(fd), repr(collective_timeout), str(os.getpid())]
            proc = subprocess.Popen(_no_sigint(cmd), pass_fds=(fd,), env=env, stdin=subprocess.DEVNULL)
    except BaseException:
        parent_sock.close()
        raise
    finally:
        child_sock.close()
    return proc, mpc.Connection(parent_sock.detach())


def _no_sigint(cmd: list[str]) -> list[str]:
    """``cmd`` ignoring SIGINT from exec on: even Python's own start-up."""
    return ["/bin/sh", "-c", 'trap "" INT; exec "$0" "$@"', *cmd] if os.name == "posix" else cmd


class ForkedRank:
    """A rank forked by the fork server: :class:`subprocess.Popen`'s ``pid``, ``poll``,
    ``wait`` and ``returncode`` (the exit status reaches the caller through the server)."""

    def __init__(self, server: _Server, pid: int) -> None:
        self._server = server
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, 0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            code = self._server.exit_code(self.pid, timeout)
            if code is None:
                raise subprocess.TimeoutExpired(f"rank process {self.pid}", timeout or 0.0)
            self.returncode = code
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _key(env: dict[str, str]) -> tuple[Any, ...]:
    env = {k: "" if k in _PER_WORLD_ENV else v for k, v in env.items()}
    return (sys.executable, tuple(sorted(env.items())), os.getcwd())


class _Server:
    """The caller's handle on one fork server (its process, its socket, the exit codes
    it reported)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.key = _key(env)
        self._lock = threading.Lock()
        self._exits: dict[int, int] = {}
        self._ours: set[int] = set()
        self._gone = False
        self.retired = False
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fd = theirs.fileno()
        cmd = _no_sigint([sys.executable, "-c", _SERVER_BOOT, str(fd), str(os.getpid())])  # ranks inherit it
        self.proc = subprocess.Popen(cmd, pass_fds=(fd,), env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        self._sock = mine

    @property
    def alive(self) -> bool:
        return not self._gone and self.proc.poll() is None

    def fork(self, args: tuple[Any, ...], conn_fd: int, env: dict[str, str], timeout: float) -> ForkedRank:
        """Ask the server for one rank running ``rank_process._worker_main(*args)`` on the
        socket ``conn_fd`` (passed to it), in ``env``; return it once forked."""
        msg = pickle.dumps(("fork", args, env))
        with self._lock:
            socket.send_fds(self._sock, [msg], [conn_fd])
            deadline = time.monotonic() + timeout
            while True:
                reply = self._read(deadline)
                if reply is None:
                    raise RuntimeError(
                        "LocalWorld: the rank fork server "
                        + ("ended" if self._gone else f"did not answer within {timeout:g} s")
                        + " (DIFFCOMM_RANK_START=spawn starts ranks as fresh interpreters)"
                    )
                if reply[0] == "forked":
                    self._ours.add(reply[1])
                    return ForkedRank(self, reply[1])
                if reply[0] == "error":
                    raise RuntimeError(f"LocalWorld: the rank fork server could not fork a rank: {reply[1]}")

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        """``pid``'s exit code once the server reported it, waiting up to ``timeout``
        seconds (``None``: without limit); ``None`` if it is still running then."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while pid not in self._exits:
                if self._gone:
                    # the server ended before it could report: its ranks end with it
                    # (each watches it), and a rank killed that way reads as SIGKILL
                    return self._exits.setdefault(pid, -signal.SIGKILL)
                if self._read(deadline) is None and not self._gone:
                    return None
            return self._exits[pid]

    def _read(self, deadline: float | None) -> tuple[Any, ...] | None:
        """The server's next message (an exit report is also recorded), or ``None`` at
        the deadline or once the server is gone. Called with the lock held."""
        while not self._gone:
            wait = 1.0 if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._sock], [], [], min(wait, 1.0))
            if not ready:
                if self.proc.poll() is not None:
                    self._gone = True
                elif deadline is not None and time.monotonic() >= deadline:
                    return None
                continue
            try:
                data = self._sock.recv(_MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                self._gone = True
                break
            msg = pickle.loads(data)
            if msg[0] == "exited":
                self._exits[msg[1]] = msg[2]
            return msg
        return None

    def retire(self) -> None:
        """No more forks: the server ends once its last rank has ended (it keeps
        reporting their exits until then)."""
        with self._lock:
            self.retired = True
            try:
                self._sock.send(pickle.dumps(("retire",)))
            except OSError:
                pass


_SERVERS: list[_Server] = []
_SERVERS_LOCK = threading.Lock()


def server_for(env: dict[str, str]) -> _Server:
    """The caller's fork server for ``env`` (started on first use, or after the
    environment, ``sys.path`` or the working directory changed)."""
    with _SERVERS_LOCK:
        key = _key(env)
        _SERVERS[:] = [s for s in _SERVERS if s.alive]
        for s in _SERVERS:
            if s.key == key and not s.retired:
                return s
        for s in _SERVERS:  # a changed environment: the old server ends with its last rank
            if not s.retired:
                s.retire()
        server = _Server(env)
        _SERVERS.append(server)
        return server


# --------------------------------------------------------------------------------------
# The server's side
# --------------------------------------------------------------------------------------

# Ignore SIGINT and import with the GC off (rank_process freezes what it imported, then
# turns it on), as a spawned rank does; then serve.
_SERVER_BOOT = (
    "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); import gc; gc.disable(); "
    "import sys; from diffcomm.runtime import forkserver; "
    "forkserver.serve(int(sys.argv[1]), int(sys.argv[2]))"
)


def serve(fd: int, caller_pid: int) -> None:
    """The fork server's loop: fork a rank per request, report each rank's exit."""
    from diffcomm.runtime import rank_process  # torch and everything a rank imports

    sock = socket.socket(fileno=fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    children: set[int] = set()
    caller_gone_at: float | None = None
    retired = False

    def send(msg: tuple[Any, ...]) -> None:
        if caller_gone_at is None:
            try:
                sock.send(pickle.dumps(msg))
            except OSError:
                pass

    def reap() -> None:
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                return
            if pid == 0:
                return
            children.discard(pid)
            send(("exited", pid, os.waitstatus_to_exitcode(status)))  # -N: signal N

    while True:
        reap()
        if retired and not children:
            break
        if caller_gone_at is not None:
            if not children:
                break
            if time.monotonic() - caller_gone_at > _ORPHAN_GRACE:
                for pid in children:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        watch: list[Any] = [wake_r] if caller_gone_at is not None else [sock, wake_r]
        ready, _, _ = select.select(watch, [], [], 0.5)
        if wake_r in ready:
            try:
                while os.read(wake_r, 512):
                    pass
            except BlockingIOError:
                pass
        if caller_gone_at is None and not _alive(caller_pid):
            caller_gone_at = time.monotonic()
        if sock not in ready or caller_gone_at is not None:
            continue
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MESSAGE, 1)
        except OSError:
            data, fds = b"", []
        if not data:  # the caller closed its end (it exited, or retired this server)
            caller_gone_at = time.monotonic()
            continue
        msg = pickle.loads(data)
        if msg[0] == "retire":
            retired = True
            continue
        _kind, args, env = msg
        forked = _fork_rank(rank_process, args, fds[0], env, (sock, wake_r, wake_w))
        os.close(fds[0])
        if isinstance(forked, str):
            send(("error", forked))
        else:
            children.add(forked)
            send(("forked", forked))
    os._exit(0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fork_rank(
    rank_process: Any, args: tuple[Any, ...], conn_fd: int, env: dict[str, str], close: tuple[Any, ...]
) -> int | str:
    try:
        pid = os.fork()
    except OSError as exc:
        return f"fork failed: {exc}"
    if pid:
        return pid
    # the rank: none of the server's machinery, the caller's environment, then the rank's life
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sock, wake_r, wake_w = close
        sock.close()
        os.close(wake_r)
        os.close(wake_w)
        os.environ.clear()
        os.environ.update(env)
        # a fresh interpreter seeds torch's default generator from the OS's entropy: so
        # does a forked rank (else every rank, and every world, would draw the same
        # numbers: the server's state). Python's `random` reseeds itself after a fork.
        rank_process.torch.seed()
        legacy_numpy = sys.modules.get("numpy.random")  # not imported by a rank's boot today
        if legacy_numpy is not None:
            legacy_numpy.seed()
        rank, world_size, backend, port, timeout = args
        # the rank watches its parent, this server (which watches the caller)
        rank_process._worker_main(rank, world_size, backend, port, conn_fd, timeout, os.getppid())
        code = 0
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)
