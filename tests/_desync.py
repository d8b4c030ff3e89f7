"""The desync scenarios of the flight-recorder issue: programs in which one rank (the
*victim*) goes wrong in a known way. ``tests/debug/test_flight.py`` checks the error each one
ends in; ``benchmarks/bench_desync.py`` measures its time to error.

Each scenario is ``fn(victim, stamp=None)``: when ``stamp`` is a path, the victim writes
its ``time.monotonic()`` (a system-wide clock on Linux) there at the moment it goes wrong.
They live outside the package on purpose: the flight recorder names the user's call site,
and frames inside ``diffcomm`` are stepped over.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

import diffcomm as dc


def _stamp(path: str | None) -> None:
    if path is not None:
        Path(path).write_text(repr(time.monotonic()))


def skips_a_collective(victim: int, stamp: str | None = None) -> None:
    x = torch.ones(4)
    dc.all_reduce(x)
    if dc.get_rank() != victim:
        dc.all_reduce(x)  # the victim skips this one ...
    dc.all_reduce(x)
    if dc.get_rank() == victim:
        _stamp(stamp)  # ... and returns: one call short


def calls_another_op(victim: int, stamp: str | None = None) -> None:
    x = torch.ones(4)
    if dc.get_rank() == victim:
        _stamp(stamp)
        dc.broadcast(x, src=0)
    else:
        dc.all_reduce(x)


def calls_another_shape(victim: int, stamp: str | None = None) -> None:
    if dc.get_rank() == victim:
        _stamp(stamp)
    dc.all_reduce(torch.ones(8 if dc.get_rank() == victim else 4))


def returns_early(victim: int, stamp: str | None = None) -> None:
    x = torch.ones(4)
    dc.all_reduce(x)
    if dc.get_rank() == victim:
        _stamp(stamp)
        return
    dc.all_gather(x)


def hangs_in_user_code(victim: int, stamp: str | None = None) -> None:
    x = torch.ones(4)
    dc.all_reduce(x)
    if dc.get_rank() == victim:
        _stamp(stamp)
        time.sleep(60)
    dc.all_reduce(x)


def skips_a_backward(victim: int, stamp: str | None = None) -> None:
    x = torch.ones(4, requires_grad=True)
    y = dc.all_gather(x)
    loss = x.sum() if dc.get_rank() == victim else y.sum()  # the victim's loss ignores y
    loss.backward()
    if dc.get_rank() == victim:
        _stamp(stamp)


#: scenario -> (function, reacts at once: the culprit returned while the others wait)
SCENARIOS = {
    "skips a collective": (skips_a_collective, True),
    "calls another op": (calls_another_op, False),
    "calls another shape": (calls_another_shape, False),
    "returns early": (returns_early, True),
    "hangs in user code": (hangs_in_user_code, False),
    "skips a backward": (skips_a_backward, True),
}


def victim(world_size: int) -> int:
    """The rank that goes wrong: the last of 2, else rank 2 (neither first nor last)."""
    return world_size - 1 if world_size == 2 else 2


#: a script for ``torchrun --standalone --nproc-per-node=2 job.py {skip,different_op}``:
#: rank 1 skips the last collective (and finishes its script), or broadcasts while rank 0
#: all_reduces. Each rank reports its pid, then ``DONE`` or its DesyncError's facts (the
#: seconds from before its first collective) and text: printed, and written to its own
#: ``rank<r>.log`` beside the script (two ranks printing long lines at once into one pipe
#: can interleave them; the test reads the files).
TORCHRUN_JOB = """
import builtins, os, sys, time
import torch
import diffcomm as dc

dc.init()
rank, scenario = dc.get_rank(), sys.argv[1]
_log = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"rank{rank}.log"), "w")

def print(line, flush=True):
    builtins.print(line, flush=flush)
    _log.write(line + chr(10))
    _log.flush()

print(f"RANK {rank} PID {os.getpid()}", flush=True)
x = torch.ones(4)
t0 = time.monotonic()
try:
    dc.all_reduce(x)
    if scenario == "skip":  # rank 1 skips the last collective and finishes its script
        if rank != 1:
            dc.all_reduce(x)
    else:  # "different_op": rank 1 broadcasts while rank 0 all_reduces
        dc.broadcast(x, src=0) if rank == 1 else dc.all_reduce(x)
    print(f"RANK {rank} DONE", flush=True)
except dc.DesyncError as exc:
    f = exc.facts
    took = time.monotonic() - t0
    print(f"RANK {rank} DESYNC {took:.2f} seq={f['seq']} culprits={f['culprits']}", flush=True)
    print(f"RANK {rank} TEXT " + str(exc).replace(chr(10), " | "), flush=True)
    sys.exit(1)
"""
