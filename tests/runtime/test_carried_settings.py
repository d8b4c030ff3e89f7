"""What a ``LocalWorld`` run carries from its caller to every rank (runtime/shipping.py).

The caller's code sets ``dc.debug`` (tests/runtime/test_in_process.py), ``dc.timeout`` and
``set_accelerator`` around ``world.run``; a rank is a process of its own (or, in-process,
has its own settings), so without the run carrying them they silently did not hold on the
ranks. What cannot take effect on a rank process is refused before the run, never dropped.
The other settings are the environment's (``flight``, ``flight_size``, ``accelerator``:
a rank gets the caller's environment when its world starts) or the caller's own
(``allow_oversubscribe``, ``progress``, ``rank_start``: how a world starts).
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import diffcomm as dc
from diffcomm import LocalWorld, RankError, _config
from diffcomm._errors import DiffcommError
from diffcomm.accelerator import (
    CPUAccelerator,
    available_accelerators,
    get_accelerator,
    selected,
    set_accelerator,
)
from diffcomm.backend import get_backend

IN_PROCESS = pytest.mark.parametrize("in_process", [True, False], ids=["in_process", "processes"])


class _OwnCPU(CPUAccelerator):
    """An accelerator object of the caller's own (a subclass, as docs/accelerator.md shows)."""


# ----------------------------------------------------------------------------- timeout


@IN_PROCESS
def test_the_callers_timeout_reaches_every_rank(local_worlds, in_process: bool) -> None:
    """``with dc.timeout(4.5): world.run(fn)``: every rank's ``dc.timeout()`` is 4.5 for the
    run, then its own again (on processes, the world's ``collective_timeout``). Before,
    the ranks kept the world's: a hang lasted the old timeout."""
    world = local_worlds(2, in_process=in_process)
    own = _config.TIMEOUT.from_environment() if in_process else world.collective_timeout
    assert own != 4.5
    with dc.timeout(4.5):
        assert world.run(dc.timeout) == [4.5, 4.5]
    assert world.run(dc.timeout) == [own, own]


def test_a_timeout_set_in_code_reaches_the_ranks_also_where_it_equals_the_environment(
    world2: LocalWorld, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``with dc.timeout(s): world.run(fn)`` where the caller's ``DIFFCOMM_TIMEOUT`` is
    ``s`` too: the ranks' is the world's ``collective_timeout``, so ``s`` must travel.
    Before, a value equal to the environment's counted as not set in code: the ranks
    silently kept the world's."""
    own = world2.collective_timeout
    monkeypatch.setenv("DIFFCOMM_TIMEOUT", str(own + 17))
    _config.TIMEOUT.reload()
    try:
        with dc.timeout(own + 17):
            assert world2.run(dc.timeout) == [own + 17] * 2
        assert world2.run(dc.timeout) == [own] * 2
    finally:
        monkeypatch.undo()
        _config.TIMEOUT.reload()


@pytest.mark.waits
def test_a_timeout_set_around_run_bounds_the_ranks_collectives() -> None:
    """The carried timeout takes effect: on a world whose collectives wait up to 60 s,
    rank 1 waits in an all_reduce rank 0 never joins (it is busy for 3 s), and the error
    naming rank 1's timed-out op comes after ~1 s, the timeout around the run. (Before:
    rank 1 waited on; at 3 s rank 0 returned and the world named it as a desync.)"""

    def skip_all_reduce_on_rank_0() -> torch.Tensor | None:
        if dc.get_rank() == 0:
            time.sleep(3.0)  # busy in user code (a rank that returns is noticed at once)
            return None
        return get_backend().all_reduce(torch.ones(3), "sum", None)

    with LocalWorld(2, timeout=10, collective_timeout=60) as world:
        start = time.monotonic()
        with dc.timeout(1), pytest.raises(RankError, match=r"timed out on global rank 1") as info:
            world.run(skip_all_reduce_on_rank_0)
        elapsed = time.monotonic() - start
        assert 0.9 < elapsed < 2.8, elapsed  # (before: ~3.2 s, rank 0 named as returned)
        assert list(info.value.failures) == [1]
        assert world.run(dc.timeout) == [60.0, 60.0]  # the world's own again (restarted)


def test_no_timeout_is_refused_before_a_run_on_processes(world2: LocalWorld) -> None:
    """``dc.timeout(None)`` (no timeout) where the environment sets one: a rank process's
    collectives always wait at most the world's ``collective_timeout``, so the run is refused
    with the way to set one, before anything runs (the world is untouched). In-process,
    where no timeout applies, the ranks read None."""
    pids = world2.pids
    with pytest.MonkeyPatch.context() as env, dc.timeout(None):
        env.setenv("DIFFCOMM_TIMEOUT", "5")
        with pytest.raises(ValueError, match=r"dc.timeout\(\) is None here .* collective_timeout"):
            world2.run(dc.timeout)
        assert dc.LocalWorld(2, in_process=True).run(dc.timeout) == [None, None]
    assert world2.pids == pids and world2.run(dc.get_rank) == [0, 1]


# ------------------------------------------------------------------------- accelerator


def _accelerator_under(name: str) -> str:
    """``get_accelerator()`` on a rank whose environment asks for ``name``, an accelerator
    this machine lacks: the caller's ``set_accelerator`` wins over it, else it is refused."""
    os.environ["DIFFCOMM_ACCELERATOR"] = name
    _config.ACCELERATOR.reload()
    try:
        return get_accelerator().name
    except DiffcommError as err:
        return f"DiffcommError: {err}"
    finally:
        del os.environ["DIFFCOMM_ACCELERATOR"]
        _config.ACCELERATOR.reload()


@IN_PROCESS
def test_the_callers_accelerator_reaches_every_rank(local_worlds, in_process: bool) -> None:
    """``with set_accelerator("cpu"): world.run(fn)``: every rank's ``get_accelerator()`` is
    the CPU, over the rank's environment. (Before, rank processes ignored the caller's
    choice: their environment or detection decided.)"""
    lacking = next(n for n in ("xpu", "mps", "cuda") if n not in available_accelerators())
    world = local_worlds(2, in_process=in_process)
    with set_accelerator("cpu"):
        assert world.run(_accelerator_under, lacking) == ["cpu", "cpu"]
    for seen in world.run(_accelerator_under, lacking):
        assert seen.startswith(f"DiffcommError: DIFFCOMM_ACCELERATOR='{lacking}' was requested"), seen


def _cpu_around_a_collective() -> str | None:
    with set_accelerator("cpu"):
        dc.all_reduce(torch.ones(1))  # in-process, the ranks take turns here
    return selected()


def _plain_cpu_on_rank_0() -> str | None:
    if dc.get_rank() == 0:
        set_accelerator("cpu")  # a plain call: it stays on, in this rank's process
    dc.all_reduce(torch.ones(1))
    return selected()


def test_in_process_ranks_each_have_their_own_accelerator_choice() -> None:
    """An in-process rank's ``set_accelerator`` is its own, as a rank process's is. It was
    one process global: ranks taking turns in a ``with set_accelerator("cpu")`` block
    restored each other's ``old`` (the last restore put back another rank's "cpu"), and the
    choice stayed on in the caller for the rest of the process; a plain call on one rank
    selected it for every rank and for the caller."""
    world = dc.LocalWorld(2, in_process=True)
    assert world.run(_cpu_around_a_collective) == [None, None]
    assert selected() is None
    assert world.run(_plain_cpu_on_rank_0) == ["cpu", None]
    assert selected() is None
    assert world.run(selected) == ["cpu", None]  # kept from run to run, as a process keeps it


def _accelerator_type() -> str:
    return type(get_accelerator()).__name__


def test_an_accelerator_object_of_the_callers_own_is_refused_on_processes(world2: LocalWorld) -> None:
    """An Accelerator object of the caller's own cannot be pickled to a rank process: the
    run is refused with the ways out, before anything runs (before: the ranks silently
    used their own). In-process ranks share it."""
    pids = world2.pids
    with set_accelerator(_OwnCPU()):
        with pytest.raises(TypeError, match=r"accelerator object of its own \(_OwnCPU\).*in_process=True"):
            world2.run(_accelerator_type)
        assert dc.LocalWorld(2, in_process=True).run(_accelerator_type) == ["_OwnCPU", "_OwnCPU"]
    assert world2.pids == pids and world2.run(_accelerator_type) == ["CPUAccelerator"] * 2


# ------------------------------------------------------------------ ablation switches


def _all_reduce_of_rank() -> float:
    """Rank r's all_reduce of r + 1: 3.0 on both ranks, or its own r + 1 when switched off."""
    return float(dc.all_reduce(torch.full((2,), dc.get_rank() + 1.0))[0])


@IN_PROCESS
def test_comm_off_around_a_run_holds_on_every_rank(local_worlds, in_process: bool) -> None:
    """``with comm_off("all_reduce"): world.run(step)`` (an ablation timed around the run):
    the ranks skip the op. Before, they ran it: the "without communication" time silently
    included it."""
    world = local_worlds(2, in_process=in_process)
    with dc.backend.comm_off("all_reduce"):
        assert world.run(_all_reduce_of_rank) == [1.0, 2.0]
    assert world.run(_all_reduce_of_rank) == [3.0, 3.0]


def test_log_comms_around_a_run_is_warned_of(world2: LocalWorld) -> None:
    """``log_comms`` records its own thread only: open around ``world.run`` it would stay
    empty while the ranks communicate, so the run warns (at the caller's line)."""
    with dc.backend.log_comms() as log, pytest.warns(UserWarning, match=r"log_comms\(\) is open") as seen:
        world2.run(_all_reduce_of_rank)
    assert seen[0].filename == __file__ and len(log.records) == 0


def _switch_broadcast_off() -> None:
    dc.backend.comm_off("broadcast")  # a plain call: on until restored, in this rank's process


def _broadcast_of_rank() -> float:
    """Rank r's broadcast of r + 1 from rank 0: 1.0 on both ranks, its own r + 1 when off."""
    return float(dc.broadcast(torch.full((1,), dc.get_rank() + 1.0))[0])


@IN_PROCESS
def test_a_ranks_own_comm_off_stays_on_from_run_to_run(in_process: bool) -> None:
    """``comm_off("broadcast")`` called plainly inside a run stays on in that rank for the
    next runs, as a rank process keeps it (a world of its own: the switch stays on there).
    In-process, the switches are per thread and each run's ranks are new threads: before,
    the next run communicated again (an ablation silently measured the communication)."""
    with dc.LocalWorld(2, in_process=in_process) as world:
        assert world.run(_broadcast_of_rank) == [1.0, 1.0]
        world.run(_switch_broadcast_off)
        assert world.run(_broadcast_of_rank) == [1.0, 2.0]
        assert world.run(_all_reduce_of_rank) == [3.0, 3.0]  # only what was switched off
    assert not dc.backend.is_off("broadcast")  # the ranks' switch, not the caller's
