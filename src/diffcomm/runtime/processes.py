"""The processes of one local world: starting nothing, only holding and ending them.

:class:`_Procs` is the finalizer-safe state of one incarnation of a
:class:`~diffcomm.LocalWorld` (its rank processes, their pipes, the store, the
faulthandler files) and ends it (a polite stop, then the whole process tree killed);
:func:`_ctrl_c_deferred` holds a Ctrl-C while a world starts or stops.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection as mpc
import os
import pickle
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import psutil


@contextlib.contextmanager
def _ctrl_c_deferred() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) that arrives inside the block; raise it when the block ends.

    Only where Python's own handler is installed and only on the main thread (the only
    thread that may set handlers); elsewhere the block runs as is.
    """
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        raise KeyboardInterrupt


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
        self.fault_dir: tempfile.TemporaryDirectory[str] | None = None

    def shutdown(self, graceful: bool) -> None:
        if graceful:
            for c in self.conns:
                try:
                    c.send_bytes(pickle.dumps(("stop", None)))
                except Exception:
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
            except Exception:
                pass
        for c in self.conns:
            try:
                c.close()
            except Exception:
                pass
        self.procs, self.conns = [], []
        self.store = None
        if self.fault_dir is not None:
            self.fault_dir.cleanup()
            self.fault_dir = None

    def fault_text(self, rank: int) -> str:
        """What faulthandler wrote for ``rank`` (its stacks if the backend aborted it)."""
        if self.fault_dir is None:
            return ""
        try:
            with open(os.path.join(self.fault_dir.name, f"rank{rank}.txt")) as f:
                return f.read()
        except OSError:
            return ""
