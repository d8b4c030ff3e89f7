"""Process helpers shared by the tests that check no rank process is left behind."""

from __future__ import annotations

import time

import psutil


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting to be reaped counts as gone)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def still_alive(pids: list[int], within: float) -> list[int]:
    """The pids among ``pids`` still alive after waiting up to ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        live = [p for p in pids if alive(p)]
        if not live or time.monotonic() > deadline:
            return live
        time.sleep(0.05)
