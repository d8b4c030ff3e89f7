"""Ranks forked by the fork server (``diffcomm.runtime.forkserver``): one server per
caller and environment, ranks its children, exit codes reported, and the spawned path
(``DIFFCOMM_RANK_START=spawn``) kept. What a rank does once started is the same either
way; the lifecycle tests (test_world.py, test_lifecycle.py) run on the default, forked."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import psutil
import pytest
import torch

import diffcomm as dc
from diffcomm import _config
from diffcomm.runtime import forkserver


def _where() -> tuple[int, int, str | None, float]:
    return (
        os.getpid(),
        os.getppid(),
        os.environ.get("FORKSERVER_TEST_MARK"),
        dc.all_reduce(torch.ones(1)).item(),
    )


@pytest.fixture
def forked() -> Iterator[None]:
    """Ranks forked (the default on Linux) whatever this run's environment says."""
    with _config.RANK_START.set("fork"):
        yield


def _server_of(pids: list[int]) -> int:
    parents = {psutil.Process(p).ppid() for p in pids}
    assert len(parents) == 1, parents
    return parents.pop()


def test_ranks_are_forked_by_one_server_that_serves_every_world(forked: None) -> None:
    with dc.LocalWorld(2) as a, dc.LocalWorld(3) as b:
        out_a, out_b = a.run(_where), b.run(_where)
        server = _server_of(a.pids)
        assert _server_of(b.pids) == server  # one server, both worlds
        assert psutil.Process(server).ppid() == os.getpid()  # the caller's own child
        assert [o[1] for o in out_a + out_b] == [server] * 5
        assert [o[3] for o in out_a] == [2.0, 2.0] and [o[3] for o in out_b] == [3.0] * 3
    # a later world: the same server again, new ranks
    with dc.LocalWorld(2) as c:
        assert _server_of(c.pids) == server and not set(c.pids) & {o[0] for o in out_a}


def test_a_changed_environment_gets_its_own_server_and_the_old_one_ends(monkeypatch, forked: None) -> None:
    """A rank imports under the server's environment, so a caller whose environment
    changed gets a new server (its ranks see the change); the old server stops forking
    and ends once its last rank has."""
    monkeypatch.setenv("FORKSERVER_TEST_MARK", "one")
    with dc.LocalWorld(2) as first:
        assert [o[2] for o in first.run(_where)] == ["one", "one"]
        old = psutil.Process(_server_of(first.pids))
        monkeypatch.setenv("FORKSERVER_TEST_MARK", "two")
        with dc.LocalWorld(2) as second:
            assert [o[2] for o in second.run(_where)] == ["two", "two"]
            assert _server_of(second.pids) != old.pid
            assert old.is_running() and first.alive  # retired, not ended: its ranks run on
            assert first.run(_where)[0][2] == "one"
    old.wait(10)  # its last rank ended: so did it


def _current_test() -> str | None:
    return os.environ.get("PYTEST_CURRENT_TEST")


def test_the_test_pytest_is_running_is_no_reason_for_a_new_server(monkeypatch, forked: None) -> None:
    """pytest sets ``PYTEST_CURRENT_TEST`` per test phase; keyed on its value, nearly every
    world of a suite started a fork server of its own (82 in one run of ours, a second of
    CPU each). Its value reaches the ranks after the fork; only its presence keys."""
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "a.py::one (call)")
    with dc.LocalWorld(2) as first:
        assert first.run(_current_test) == ["a.py::one (call)"] * 2
        server = _server_of(first.pids)
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "a.py::two (setup)")
    with dc.LocalWorld(2) as second:
        assert second.run(_current_test) == ["a.py::two (setup)"] * 2
        assert _server_of(second.pids) == server
    monkeypatch.delenv("PYTEST_CURRENT_TEST")  # its presence does key a server
    with dc.LocalWorld(2) as third:
        assert third.run(_current_test) == [None, None]
        assert _server_of(third.pids) != server


def test_a_rank_killed_reports_its_signal_through_the_server(forked: None) -> None:
    with dc.LocalWorld(2) as world:
        victim = world.pids[1]
        os.kill(victim, 9)
        proc = world._state.procs[1]
        assert isinstance(proc, forkserver.ForkedRank)
        assert proc.wait(10) == -9
        assert not world.alive


def test_spawn_starts_fresh_interpreters_as_the_callers_children() -> None:
    with _config.RANK_START.set("spawn"), dc.LocalWorld(2) as world:
        out = world.run(_where)
        assert [o[1] for o in out] == [os.getpid()] * 2
        assert [o[3] for o in out] == [2.0, 2.0]


def test_an_unknown_way_to_start_ranks_is_refused_before_any_rank_starts(monkeypatch) -> None:
    monkeypatch.setenv("DIFFCOMM_RANK_START", "thread")
    _config.RANK_START.reload()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    try:
        with pytest.raises(ValueError, match=r"DIFFCOMM_RANK_START='thread' is not a way to start a rank"):
            dc.LocalWorld(2)
    finally:
        monkeypatch.undo()
        _config.RANK_START.reload()
    time.sleep(0.2)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


def _draws() -> tuple[int, float, float]:
    import random

    return torch.initial_seed(), torch.rand(1).item(), random.random()


def test_each_forked_rank_draws_its_own_random_numbers_as_a_fresh_interpreter_does(forked: None) -> None:
    """A fresh interpreter seeds torch's default generator (and Python's `random`) from
    the OS's entropy; a forked rank must too, or every rank and every world would draw the
    server's numbers (unseeded dropout masks, `torch.randn` inputs alike on every rank)."""
    with dc.LocalWorld(2) as a, dc.LocalWorld(2) as b:
        draws = a.run(_draws) + b.run(_draws)
    for column in zip(*draws):
        assert len(set(column)) == 4, draws
