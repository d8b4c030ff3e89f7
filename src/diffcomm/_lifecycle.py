"""Every background thread diffcomm starts has an owner and an end.

diffcomm runs three kinds of background work in a user's process: the flight recorder's
answering thread (it waits in the rendezvous store for diagnosis requests), the
asynchronous engine (``async_op=True`` jobs) and the send queue (it completes posted
point-to-point sends). Each is started lazily by the module that owns it, and each owner
registers here how to **stop and join** it. This module runs those stops:

* **when a process group is destroyed**: ``torch.distributed.destroy_process_group`` is
  wrapped (once, at import) so that diffcomm's work on the group is drained and its
  threads are joined *before* torch shuts the group and its store down. After the call
  returns no diffcomm thread is alive (``tests/lifecycle``). A subgroup's destruction
  drains and joins the engine and the send queue too (they restart on the next op);
* **when a new default group is created**: ``init_process_group`` is wrapped so that the
  recorder's answering thread of the new group starts at once on every rank (symmetric,
  so every rank agrees on the new group's store namespace);
* **before the interpreter finalizes** (``atexit``), for a program that exits without
  destroying its group.

Why wrap torch's two functions rather than ask users to call a diffcomm shutdown: the
abort this prevents happened in programs that do everything right by torch's book (init,
ops, ``destroy_process_group``, return). A thread blocked inside the C++ store when the
interpreter finalizes (or when rank 0's store server goes away) is unwound into a
finalizing interpreter and the process dies of ``SIGABRT`` ("terminate called without an
active exception"). Nothing in torch tells a library that a group is going away, so the
wrappers are the one place to hear it. They keep torch's signature and docstring
(``functools.wraps``) and call the original unchanged. A program that bound the originals
before importing diffcomm (``from torch.distributed import destroy_process_group`` first)
still gets the ``atexit`` stop, and a new default group still replaces the old one's
thread on diffcomm's first op on it.

This module imports nothing from the package: it sits below every owner.
"""

from __future__ import annotations

import atexit
import functools
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

__all__ = [
    "on_destroy",
    "on_init",
    "on_program_start",
    "program_start",
    "stop_all",
    "diffcomm_threads",
    "install",
    "exiting",
]

# (name, stop(group, exiting)), called in reverse registration order: the owners that
# depend on others (the engine runs ops that the recorder records) stop first
_STOPS: list[tuple[str, Callable[[Any, bool], None]]] = []
_INITS: list[tuple[str, Callable[[], None]]] = []
_PROGRAM_STARTS: list[tuple[str, Callable[[], None]]] = []
_PROGRAM_ENDS: list[tuple[str, Callable[[], None]]] = []
_EXITING = [False]
#: a default process group was made in this process (a subgroup the user still holds keeps
#: its gloo threads after ``destroy_process_group()``)
_HAD_GROUP = [False]
_LOCK = threading.RLock()

#: names of the threads diffcomm starts (each owner names its thread with this prefix)
THREAD_PREFIX = "diffcomm-"


def on_destroy(name: str, stop: Callable[[Any, bool], None]) -> None:
    """Register ``stop(group, exiting)``: stop and join the owner's threads for ``group``
    (``None``: the default group, so every group) before torch destroys it, or at exit
    (``exiting=True``). It must not raise and must return in bounded time."""
    _STOPS.append((name, stop))


def on_init(name: str, start: Callable[[], None]) -> None:
    """Register ``start()``, called right after a new default process group exists."""
    _INITS.append((name, start))


def on_program_start(name: str, reset: Callable[[], None]) -> None:
    """Register ``reset()``: forget what the owner remembers of the program this process
    ran before (called by a ``LocalWorld`` rank, on a process or in-process, before each
    ``run``). It must not raise."""
    _PROGRAM_STARTS.append((name, reset))


def program_start() -> None:
    """Run every registered program-start reset (a long-lived rank is about to run a new
    program: a ``LocalWorld.run``)."""
    for _name, reset in _PROGRAM_STARTS:
        try:
            reset()
        except Exception:  # a reset never keeps the program from running
            pass


def on_program_end(name: str, finish: Callable[[], None]) -> None:
    """Register ``finish()``: let the owner's pending work of the program that just
    returned complete (called by a ``LocalWorld`` rank on a process after each ``run``'s
    function returned, before the rank reports its result). What it raises (a send never
    received) is the run's error on that rank."""
    _PROGRAM_ENDS.append((name, finish))


def program_end() -> None:
    """Run every registered program-end finish (see :func:`on_program_end`)."""
    for _name, finish in _PROGRAM_ENDS:
        finish()


def exiting() -> bool:
    """Whether the interpreter is past diffcomm's ``atexit`` stop."""
    return _EXITING[0]


def stop_all(group: Any = None, exiting: bool = False) -> None:
    """Run every registered stop for ``group`` (``None`` or ``group.WORLD``: everything)."""
    if group is not None and dist.is_available() and group is dist.GroupMember.WORLD:
        group = None
    with _LOCK:
        for _name, stop in reversed(_STOPS):
            try:
                stop(group, exiting)
            except Exception:  # a stop never keeps the group (or exit) from going on
                pass


def diffcomm_threads() -> list[threading.Thread]:
    """The live threads diffcomm started in this process."""
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]


def runnable_native_threads() -> list[int]:
    """The ids of the runnable threads Python did not start (c10d / gloo workers, OpenMP
    threads), from ``/proc`` (Linux; elsewhere none)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return []
    mine = {t.native_id for t in threading.enumerate()}
    out = []
    for tid in tids:
        if int(tid) in mine:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state == b"R":
            out.append(int(tid))
    return out


def _let_native_threads_settle(limit: float = 0.25) -> None:
    """Before the interpreter finalizes: give torch's own threads the GIL for a moment.

    A process group's worker thread drops its finished work (and with it the last
    reference to a tensor the op no longer needs) just *after* the work is marked done;
    if that drop needs the GIL once the interpreter is finalizing, the thread is unwound
    through C++ and the process dies of ``SIGABRT`` ("terminate called without an active
    exception": 1 in ~40 runs of a rank that finished its script while its peer still
    waited, under load). Sleeping releases the GIL, so such a thread finishes now; we wait
    while one is still runnable, at most ``limit`` seconds."""
    if not (dist.is_available() and (dist.is_initialized() or _HAD_GROUP[0])):
        return  # no process group, no worker threads (OpenMP's may spin: not worth a wait)
    deadline = time.monotonic() + limit
    while True:
        time.sleep(0.002)
        if not runnable_native_threads() or time.monotonic() > deadline:
            return


def _at_exit() -> None:
    _EXITING[0] = True
    stop_all(None, exiting=True)
    _let_native_threads_settle()


def install() -> None:
    """Wrap ``torch.distributed``'s ``destroy_process_group`` / ``init_process_group``
    (idempotent) and register the ``atexit`` stop."""
    if not dist.is_available():
        return
    c10d = dist.distributed_c10d
    destroy = c10d.destroy_process_group
    if not getattr(destroy, "_diffcomm", False):

        @functools.wraps(destroy)
        def destroy_process_group(group: Any = None) -> None:
            stop_all(group)
            return destroy(group)

        destroy_process_group._diffcomm = True  # type: ignore[attr-defined]
        c10d.destroy_process_group = destroy_process_group
        dist.destroy_process_group = destroy_process_group

    init = c10d.init_process_group
    if not getattr(init, "_diffcomm", False):

        @functools.wraps(init)
        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            out = init(*args, **kwargs)
            _HAD_GROUP[0] = True
            for _name, start in _INITS:
                try:
                    start()
                except Exception:  # no answering thread: the diagnosis degrades to own view
                    pass
            return out

        init_process_group._diffcomm = True  # type: ignore[attr-defined]
        c10d.init_process_group = init_process_group
        dist.init_process_group = init_process_group


atexit.register(_at_exit)
install()
