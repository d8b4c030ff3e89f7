"""LocalWorld / launch: results, functions that travel, and every failure path.

Everything here runs real rank processes joined in a real gloo group. Destructive tests
(a rank that dies, hangs or times out in a collective) use small dedicated worlds; the
rest share the session's worlds from the ``local_worlds`` fixture. Process clean-up is
checked with psutil against the pids the ranks really had.
"""

from __future__ import annotations

import datetime
import gc
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from _procs import alive, still_alive

import diffcomm as dc
from diffcomm import (
    CollectiveTimeoutError,
    LocalWorld,
    RankDiedError,
    RankError,
    WorldTimeoutError,
)
from diffcomm.backend import get_backend, label
from diffcomm.diagnostics.responder import _TIMEOUT_MARKERS

# ------------------------------------------------------------------------------ helpers


def _still_alive(pids: list[int], within: float = 5.0) -> list[int]:
    return still_alive(pids, within)


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # ignore TIME_WAIT, not LISTEN
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


# Rank functions shared by several tests, at module level: they travel by reference (the
# ranks import this module from the tests folder, which the caller's sys.path carries).
# A rank function of one test is nested in it and travels by value.


# shared: the run, launch and unpicklable-argument tests
def _rank_info(base: int, *, scale: int = 1) -> tuple[int, int, int, int]:
    return dc.get_rank(), dc.get_world_size(), (base + dc.get_rank()) * scale, os.getpid()


class _Boom(ValueError):
    """An exception type of this module, with an attribute, sent back from the ranks."""

    def __init__(self, rank: int) -> None:
        super().__init__(rank)  # args must rebuild it: exceptions pickle as cls(*args)
        self.rank = rank

    def __str__(self) -> str:
        return f"boom on rank {self.rank}"


# shared: six tests start, idle or hang a world with it
def _sleep_on(rank: int, seconds: float) -> int:
    if dc.get_rank() == rank:
        time.sleep(seconds)
    return dc.get_rank()


# shared: the fast-failure and Ctrl-C tests
def _raise_while_others_reduce(rank: int) -> torch.Tensor:
    if dc.get_rank() == rank:
        raise ValueError(f"rank {rank} gives up before the all_reduce")
    return get_backend().all_reduce(torch.ones(3), "sum", None)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def fragile() -> Iterator[LocalWorld]:
    """A dedicated 2-rank world for tests that kill, hang or break it.

    A run longer than 3 s is a hang; a collective gives up after 2 s.
    """
    world = LocalWorld(2, timeout=3, collective_timeout=2)
    yield world
    world.close()


# ------------------------------------------------------------------- results, functions


def test_run_returns_results_by_rank(world3: LocalWorld) -> None:
    results = world3.run(_rank_info, 10, scale=2)
    assert [r[:3] for r in results] == [(0, 3, 20), (1, 3, 22), (2, 3, 24)]
    assert [r[3] for r in results] == world3.pids


def test_closures_lambdas_and_local_functions_travel(world2: LocalWorld) -> None:
    offset = torch.tensor([10.0, 20.0])

    def local(scale: float) -> torch.Tensor:  # a closure over `offset`
        return offset * scale + dc.get_rank()

    assert world2.run(lambda: dc.get_rank() * 7) == [0, 7]
    out = world2.run(local, 2.0)
    torch.testing.assert_close(out[0], torch.tensor([20.0, 40.0]))
    torch.testing.assert_close(out[1], torch.tensor([21.0, 41.0]))
    # a tensor argument arrives as a copy on every rank, the result comes back
    out = world2.run(lambda t: t.add(dc.get_rank()), torch.zeros(2))
    assert [o.tolist() for o in out] == [[0.0, 0.0], [1.0, 1.0]]


def _gc_state() -> tuple[bool, int, int]:
    """(collector on, objects frozen, objects a collection finds in a dropped cycle)."""
    gc.collect()
    cycle: list[object] = []
    cycle.append(cycle)
    del cycle
    return gc.isenabled(), gc.get_freeze_count(), gc.collect()


def test_ranks_collect_garbage_after_a_start_up_without_it(world2: LocalWorld) -> None:
    """A rank imports with the garbage collector off (its start-up's full collections
    walked torch's objects for nothing) and turns it back on before its first run, with
    what it imported frozen out of the collector (so full collections skip torch)."""
    for enabled, frozen, collected in world2.run(_gc_state):
        assert enabled, "a rank runs user code with garbage collection off"
        assert frozen > 100_000, f"only {frozen} objects frozen: the imports were not frozen"
        assert collected >= 1, "a cycle made during a run was not collected"


def test_a_rank_boot_imports_without_a_full_garbage_collection() -> None:
    """The rank's boot line turns the collector off before the package imports (the
    imports ran three full collections, ~0.2-0.3 s of CPU per rank, for no garbage)."""
    from diffcomm.runtime.forkserver import _WORKER_BOOT

    boot = _WORKER_BOOT.replace("run_name='__main__'", "run_name='imports_only'")
    assert boot != _WORKER_BOOT
    code = boot + "; import gc; print(gc.get_stats()[2]['collections'], gc.isenabled())"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["0", "True"], p.stdout


def test_launch_returns_per_rank_results_and_leaves_no_process() -> None:
    results = dc.launch(_rank_info, 2, 5, scale=3)
    assert [r[:3] for r in results] == [(0, 2, 15), (1, 2, 18)]
    assert _still_alive([r[3] for r in results]) == []


def test_launch_takes_localworlds_settings_by_name_and_fn_kwargs_for_colliding_names() -> None:
    def settings_seen(timeout: float = 0.0, steps: int = 0) -> tuple[float, int, str | None]:
        return timeout, steps, os.environ.get("DIFFCOMM_TIMEOUT")

    # collective_timeout reaches the ranks (their DIFFCOMM_TIMEOUT); timeout bounds the run;
    # steps is fn's own; fn's own `timeout` goes through fn_kwargs
    out = dc.launch(
        settings_seen, 2, timeout=120, collective_timeout=7, progress=False, steps=3, fn_kwargs={"timeout": 5}
    )
    assert out == [(5, 3, "7.0")] * 2
    with pytest.raises(TypeError, match=r"keyword\(s\) \['steps'\] given both directly and in `fn_kwargs`"):
        dc.launch(settings_seen, 2, steps=1, fn_kwargs={"steps": 2})
    with pytest.raises(ValueError, match="`timeout` must be > 0"):
        dc.launch(settings_seen, 2, timeout=0)


# ---------------------------------------------------------------- start-up progress


_PROGRESS_SCRIPT = """
import os
import sys
import diffcomm as dc
import diffcomm.runtime.world as W
from diffcomm import _config
W._PROGRESS_AFTER = 0.0  # print from the first tick
for arg in sys.argv[1:]:
    if arg.startswith("DIFFCOMM_PROGRESS="):  # as if the program had started with it
        os.environ["DIFFCOMM_PROGRESS"] = arg.split("=")[1]
        _config.PROGRESS.reload()
    print(f"== {arg}", file=sys.stderr, flush=True)
    with dc.LocalWorld(1, progress={"on": True, "off": False}.get(arg)):
        pass
"""


def _progress_lines(
    tmp_path: Path, piped_cases: tuple[str, ...], tty_cases: tuple[str, ...]
) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Run ``_PROGRESS_SCRIPT`` twice, side by side (each mostly waits for its rank to
    start): once with stderr a pipe, once with stderr a terminal (a pty); the diffcomm
    lines each printed per case."""
    import pty

    script = tmp_path / "progress.py"
    script.write_text(_PROGRESS_SCRIPT)
    full_env = dict(os.environ)
    full_env.pop("DIFFCOMM_PROGRESS", None)
    piped = subprocess.Popen(
        [sys.executable, str(script), *piped_cases],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
        env=full_env,
    )
    try:
        main, sub = pty.openpty()
        proc = subprocess.Popen(
            [sys.executable, str(script), *tty_cases], stderr=sub, stdin=subprocess.DEVNULL, env=full_env
        )
        os.close(sub)
        chunks = []
        while True:
            try:
                data = os.read(main, 4096)
            except OSError:  # the pty closes when the process exits
                break
            if not data:
                break
            chunks.append(data)
        os.close(main)
        assert proc.wait(timeout=300) == 0
        tty_err = b"".join(chunks).decode().replace("\r\n", "\n")
        _, piped_err = piped.communicate(timeout=300)
        assert piped.returncode == 0, piped_err
    finally:
        if piped.poll() is None:
            piped.kill()
            piped.communicate()

    def lines(err: str) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for block in err.split("== ")[1:]:
            name, _, rest = block.partition("\n")
            out[name] = [ln for ln in rest.splitlines() if ln.startswith("diffcomm: LocalWorld(1)")]
        return out

    return lines(piped_err), lines(tty_err)


def test_start_up_progress_only_on_a_terminal_or_when_asked(tmp_path: Path) -> None:
    piped, on_terminal = _progress_lines(
        tmp_path, ("default", "on", "DIFFCOMM_PROGRESS=1"), ("default", "off", "DIFFCOMM_PROGRESS=0")
    )
    assert piped["default"] == []  # stderr is a pipe: nothing mixed into the user's output
    for asked in ("on", "DIFFCOMM_PROGRESS=1"):
        assert piped[asked] and piped[asked][-1].startswith("diffcomm: LocalWorld(1) ready after")
    assert on_terminal["default"] and "starting: 0/1 ranks ready after" in on_terminal["default"][0]
    assert on_terminal["off"] == []
    assert on_terminal["DIFFCOMM_PROGRESS=0"] == []  # the one switch (or progress=False)


# ---------------------------------------------------------------- a rank that raises


def test_rank_exception_names_rank_and_traceback_and_world_stays(world2: LocalWorld) -> None:
    def raise_on(rank: int, message: str) -> int:
        if dc.get_rank() == rank:
            raise ValueError(message)
        return dc.get_rank()

    pids, restarts = world2.pids, world2.restarts
    with pytest.raises(RankError, match=r"rank\(s\) \[1\] raised: ValueError: no luck on 1") as info:
        world2.run(raise_on, 1, "no luck on 1")
    err = info.value
    assert type(err) is RankError
    assert list(err.failures) == [1]
    assert "--- rank 1 traceback ---" in str(err)
    # the remote traceback points into this module's function
    assert 'test_world.py", line' in err.failures[1] and "in raise_on" in err.failures[1]
    # every rank reported back: the same processes serve the next run
    assert world2.run(raise_on, 5, "unused") == [0, 1]
    assert world2.pids == pids and world2.restarts == restarts and world2.alive


def test_rank_error_carries_remote_exception_objects(world2: LocalWorld) -> None:
    def boom_on(ranks: tuple[int, ...]) -> int:
        if dc.get_rank() in ranks:
            raise _Boom(dc.get_rank())
        return dc.get_rank()

    with pytest.raises(RankError, match=r"rank\(s\) \[0, 1\] raised") as info:
        world2.run(boom_on, (0, 1))
    exceptions = info.value.exceptions
    assert sorted(exceptions) == [0, 1]
    for r in (0, 1):
        assert isinstance(exceptions[r], _Boom)
        assert exceptions[r].rank == r and str(exceptions[r]) == f"boom on rank {r}"
    assert world2.run(boom_on, ()) == [0, 1]


def test_unpicklable_argument_or_result_is_a_clear_error(world2: LocalWorld) -> None:
    with pytest.raises(TypeError, match="cannot pickle the function or its arguments"):
        world2.run(_rank_info, threading.Lock())
    with pytest.raises(RankError, match=r"rank\(s\) \[0, 1\] raised: TypeError: cannot pickle"):
        world2.run(threading.Lock)
    assert world2.run(lambda: 1) == [1, 1]


# ------------------------------------------------------------- death, hang, time-outs


def test_rank_death_is_reported_fast_and_world_restarts(fragile: LocalWorld) -> None:
    def exit_on(rank: int, code: int) -> int:
        if dc.get_rank() == rank:
            os._exit(code)
        return dc.get_rank()

    fragile.run(_sleep_on, 0, 0)  # make sure the world is up, so the timing is the run's
    pids, restarts = fragile.pids, fragile.restarts
    start = time.monotonic()
    with pytest.raises(RankDiedError, match=r"rank 1 \(exit code 3\) died during `exit_on`") as info:
        fragile.run(exit_on, 1, 3)
    assert time.monotonic() - start < 3.0
    assert info.value.exitcodes == {1: 3}
    # torn down: no process left, not even the healthy rank
    assert _still_alive(pids, within=2.0) == []
    assert fragile.pids == [] and not fragile.alive
    # the next run starts fresh processes
    assert fragile.run(_sleep_on, 0, 0) == [0, 1]
    assert fragile.restarts == restarts + 1
    assert not set(fragile.pids) & set(pids)


@pytest.mark.waits
def test_hanging_rank_is_a_timeout_naming_busy_ranks(fragile: LocalWorld) -> None:
    fragile.run(_sleep_on, 0, 0)
    pids, restarts = fragile.pids, fragile.restarts
    start = time.monotonic()
    with pytest.raises(WorldTimeoutError, match=r"within 3 s; rank\(s\) \[0\] still busy") as info:
        fragile.run(_sleep_on, 0, 60)
    elapsed = time.monotonic() - start
    assert 2.9 < elapsed < 8.0
    assert info.value.busy_ranks == [0]
    assert _still_alive(pids, within=2.0) == []
    assert fragile.run(_sleep_on, 1, 0) == [0, 1] and fragile.restarts == restarts + 1


def test_raise_while_others_wait_in_collective_is_fast(fragile: LocalWorld) -> None:
    fragile.run(_sleep_on, 0, 0)
    pids = fragile.pids
    start = time.monotonic()
    with pytest.raises(RankError, match=r"rank\(s\) \[0\] raised .* rank\(s\) \[1\] were still busy") as info:
        fragile.run(_raise_while_others_reduce, 0)
    # not a WorldTimeoutError after 3 s, and rank 1 was not released by its own
    # collective timeout (2 s), which would report it as a failed rank, not a busy one
    assert time.monotonic() - start < 3.0
    assert type(info.value) is RankError and list(info.value.failures) == [0]
    assert isinstance(info.value.exceptions[0], ValueError)
    assert "gives up before the all_reduce" in info.value.failures[0]
    assert _still_alive(pids, within=2.0) == []
    assert fragile.run(_sleep_on, 0, 0) == [0, 1]


@pytest.mark.waits
def test_collective_timeout_names_raw_op_and_fix(fragile: LocalWorld) -> None:
    def skip_all_reduce_on(rank: int) -> torch.Tensor | None:
        if dc.get_rank() == rank:
            # busy in user code past the peer's timeout (a rank that *returns* is noticed at
            # once instead: tests/debug/test_flight.py), then skips the all_reduce
            time.sleep(2.5)
            return None  # the peer waits for this rank's all_reduce until its timeout
        with label("all_reduce backward"):
            return get_backend().all_reduce(torch.ones(3), "sum", None)

    world = fragile
    world.run(_sleep_on, 0, 0)
    pids, restarts = world.pids, world.restarts
    start = time.monotonic()
    with pytest.raises(
        RankError,
        match=r"`all_reduce backward` \(raw all_reduce, sequence number #0 on group \[0, 1\]\) timed out",
    ) as info:
        world.run(skip_all_reduce_on, 0)
    assert 1.9 < time.monotonic() - start < 3.0
    err = info.value
    assert sorted(err.failures) == [1]
    remote = err.exceptions[1]
    assert isinstance(remote, CollectiveTimeoutError)
    text = str(remote)
    assert "make every rank's loss touch every collective output" in text
    # what gloo itself printed is in the message, and it is what the markers recognise
    gloo_text = text.split("Backend error: ", 1)[1].lower()
    assert any(marker in gloo_text for marker in _TIMEOUT_MARKERS), gloo_text
    # a timed-out group is unusable: the world is torn down and restarts
    assert "torn down" in str(err)
    assert _still_alive(pids, within=2.0) == []
    assert world.run(_sleep_on, 0, 0) == [0, 1] and world.restarts == restarts + 1


def test_ctrl_c_reaching_idle_ranks_is_ignored(fragile: LocalWorld) -> None:
    """A Ctrl-C typed in a terminal reaches the ranks too; idle ranks must survive it."""
    fragile.run(_sleep_on, 0, 0)
    pids, restarts = fragile.pids, fragile.restarts
    for pid in pids:
        os.kill(pid, signal.SIGINT)
    time.sleep(0.2)
    assert fragile.run(_raise_while_others_reduce, -1)[0].tolist() == [2.0, 2.0, 2.0]
    assert fragile.pids == pids and fragile.restarts == restarts


# ----------------------------------------------------------------- lifecycle, arguments


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 0}, "`world_size` must be an int >= 1, got 0"),
        ({"world_size": -2}, "`world_size` must be an int >= 1"),
        ({"world_size": 2.0}, "`world_size` must be an int >= 1, got 2.0"),
        ({"world_size": True}, "`world_size` must be an int >= 1, got True"),
        ({"world_size": 2, "backend": "carrier-pigeon"}, "`backend` 'carrier-pigeon' is not available"),
        ({"world_size": 2, "timeout": 0}, "`timeout` must be > 0 seconds, got 0"),
        ({"world_size": 2, "timeout": float("nan")}, "`timeout` must be > 0 seconds"),
        ({"world_size": 2, "collective_timeout": -1}, "`collective_timeout` must be > 0 seconds"),
    ],
)
def test_bad_arguments_are_value_errors(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LocalWorld(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("in_process", [False, True])
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"allow_oversubscribe": "no"},
            TypeError,
            "`allow_oversubscribe` must be a bool or None, got str 'no'",
        ),
        ({"allow_oversubscribe": 0}, TypeError, "`allow_oversubscribe` must be a bool or None, got int 0"),
        ({"progress": "no"}, TypeError, "`progress` must be a bool or None, got str 'no'"),
        ({"collective_timeout": True}, TypeError, "`collective_timeout` must be a number of seconds or None"),
        ({"collective_timeout": "5"}, TypeError, "`collective_timeout` must be a number of seconds or None"),
        ({"collective_timeout": -1}, ValueError, "`collective_timeout` must be > 0 seconds"),
        ({"collective_timeout": float("inf")}, ValueError, "`collective_timeout` must be a finite number"),
        ({"timeout": True}, TypeError, "`timeout` must be a number of seconds, got bool True"),
        ({"timeout": "5"}, TypeError, "`timeout` must be a number of seconds, got str '5'"),
        ({"timeout": float("inf")}, ValueError, "`timeout` must be a finite number of seconds, got inf"),
        ({"timeout": datetime.timedelta(0)}, ValueError, "`timeout` must be > 0 seconds, got datetime"),
        (
            {"collective_timeout": datetime.timedelta(seconds=-5)},
            ValueError,
            "`collective_timeout` must be > 0 seconds or None, got datetime",
        ),
    ],
)
def test_settings_of_a_wrong_type_are_refused_on_both_kinds_of_world(
    kwargs: dict[str, object], error: type[Exception], match: str, in_process: bool
) -> None:
    # a "no" (truthy) allowed oversubscription, a True timeout was 1 s, an in-process
    # world took any collective_timeout: now each is an error naming the setting
    with pytest.raises(error, match=match):
        LocalWorld(1, in_process=in_process, **kwargs)  # type: ignore[arg-type]


def test_timeouts_may_be_timedeltas() -> None:
    """``init_process_group`` takes a ``datetime.timedelta``; LocalWorld refused one."""
    seconds = datetime.timedelta
    with LocalWorld(1, timeout=seconds(minutes=2), collective_timeout=seconds(seconds=7.5)) as world:
        assert (world.timeout, world.collective_timeout) == (120.0, 7.5)
        assert world.run(dc.timeout) == [7.5]  # the ranks' DIFFCOMM_TIMEOUT


def test_run_rejects_a_non_callable(world1: LocalWorld) -> None:
    with pytest.raises(TypeError, match="`fn` must be callable, got int"):
        world1.run(3)  # type: ignore[arg-type]


def test_close_stops_ranks_releases_port_and_refuses_runs() -> None:
    world = LocalWorld(1)
    pids, port = world.pids, world._state.store.port
    assert not _port_is_free(port)
    world.close()
    assert _still_alive(pids, within=2.0) == []
    assert _port_is_free(port)
    world.close()  # idempotent
    with pytest.raises(RuntimeError, match="this world is closed"):
        world.run(_sleep_on, 0, 0)


def test_garbage_collected_world_kills_its_ranks() -> None:
    world = LocalWorld(1)
    pids = world.pids
    del world
    gc.collect()
    assert _still_alive(pids, within=5.0) == []


# ------------------------------------------------- Ctrl-C, SIGKILL and exit of the caller

_CALLER = textwrap.dedent(
    """
    import sys, time
    import psutil
    import diffcomm as dc

    world = dc.LocalWorld(2 if sys.argv[1] == "sigint" else 1)
    world.run(time.sleep, 0)
    # the ranks and, when ranks are forked, the fork server: every process this caller made
    print("PIDS", *[p.pid for p in psutil.Process().children(recursive=True)], flush=True)
    if sys.argv[1] == "exit":
        sys.exit(0)             # no close(): interpreter exit must clean up
    if sys.argv[1] == "sigkill":
        time.sleep(60)          # killed while idle: the ranks notice their parent died
    world.run(time.sleep, 60)   # interrupted while a run is in progress
    """
)


def _start_caller(tmp_path: Path, mode: str, start: str) -> tuple[subprocess.Popen[str], list[int]]:
    script = tmp_path / "caller.py"
    script.write_text(_CALLER)
    proc = subprocess.Popen(
        [sys.executable, str(script), mode],
        env={**os.environ, "DIFFCOMM_RANK_START": start},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,  # its own process group, like a shell job
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("PIDS"):
        proc.kill()
        _, err = proc.communicate(timeout=10)
        pytest.fail(f"caller script did not start its world: {line!r}\n{err}")
    pids = [int(p) for p in line.split()[1:]]
    # in "exit" mode the caller exits right after this line and may have ended its ranks
    # already (what the test checks): that they ran is world.run's answer, above
    assert pids and (mode == "exit" or all(alive(p) for p in pids))
    return proc, pids


_STARTS = pytest.mark.parametrize("start", ["fork", "spawn"])  # ranks forked, or fresh interpreters


@_STARTS
def test_ctrl_c_in_caller_during_run_kills_ranks(tmp_path: Path, start: str) -> None:
    """Ctrl-C in a terminal: SIGINT to the caller's whole process group, ranks included."""
    proc, pids = _start_caller(tmp_path, "sigint", start)
    time.sleep(0.5)  # let the run reach the ranks
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode != 0
    assert "KeyboardInterrupt" in err
    assert _still_alive(pids) == []


@_STARTS
def test_sigkill_of_caller_kills_ranks(tmp_path: Path, start: str) -> None:
    proc, pids = _start_caller(tmp_path, "sigkill", start)
    proc.kill()
    proc.communicate(timeout=10)
    assert _still_alive(pids, within=5.0) == []


@_STARTS
def test_interpreter_exit_without_close_kills_ranks(tmp_path: Path, start: str) -> None:
    proc, pids = _start_caller(tmp_path, "exit", start)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert _still_alive(pids) == []


# ----------------------------------------------------------- contract of the fixtures


def test_local_worlds_fixture_shares_one_world_per_size(
    local_worlds: Callable[..., LocalWorld], world2: LocalWorld
) -> None:
    assert local_worlds(2) is world2
    assert world2.world_size == 2 and world2.backend == "gloo"


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"progress": True}, "`progress=True` does not apply to an in-process world and is ignored"),
        ({"progress": False}, "`progress=False` does not apply"),
        ({"allow_oversubscribe": True}, "`allow_oversubscribe=True` does not apply"),
        ({"allow_oversubscribe": False}, "`allow_oversubscribe=False` does not apply"),
        ({"timeout": 10}, "`timeout=10` does not apply"),
        ({"collective_timeout": 5}, "`collective_timeout=5` does not apply"),
        (
            {"timeout": 10, "progress": True},
            "`timeout=10`, `progress=True` do not apply to an in-process world and are",
        ),
    ],
)
def test_settings_that_do_not_apply_in_process_are_warned_of(kwargs: dict[str, object], named: str) -> None:
    """``LocalWorld(n, in_process=True, progress=True)`` (or ``allow_oversubscribe``,
    ``timeout``, ``collective_timeout``): before, silently ignored; now a warning naming
    each, pointing at the caller's line. The defaults warn of nothing."""
    with pytest.warns(UserWarning, match=re.escape(named)) as seen:
        LocalWorld(2, in_process=True, **kwargs).close()  # type: ignore[arg-type]
    assert [w.filename for w in seen] == [__file__]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LocalWorld(2, in_process=True).close()
        LocalWorld(2, in_process=True, backend="gloo", timeout=300.0, collective_timeout=None).close()


def _args_and_kwargs(*args: object, **kwargs: object) -> tuple[tuple[object, ...], dict[str, object]]:
    return args, kwargs


_LAUNCH_SETTINGS = (
    "backend",
    "timeout",
    "collective_timeout",
    "allow_oversubscribe",
    "progress",
    "in_process",
)


@pytest.mark.parametrize("in_process", [False, True], ids=["processes", "in_process"])
def test_launch_settings_never_reach_fn_and_fn_kwargs_of_their_names_do(in_process: bool) -> None:
    """Every setting of ``launch`` by name configures the world and never lands in ``fn``'s
    kwargs, on both kinds of world; a kwarg of ``fn`` named like one goes through
    ``fn_kwargs``. Before, ``launch(fn, 2, in_process=True)`` called ``fn(in_process=True)``
    on rank processes (and there was no in-process launch)."""
    settings = {"backend": "gloo", "timeout": 120, "collective_timeout": 9, "allow_oversubscribe": True}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # in-process: the settings that do not apply are warned of
        out = dc.launch(
            _args_and_kwargs, 2, 1, "a", **settings, progress=False, in_process=in_process, steps=3
        )
    assert out == [((1, "a"), {"steps": 3})] * 2
    own = {name: f"fn's {name}" for name in (*_LAUNCH_SETTINGS, "fn", "world_size", "fn_kwargs")}
    out = dc.launch(_args_and_kwargs, 2, in_process=in_process, fn_kwargs=own)
    assert out == [((), own)] * 2
    ranks = dc.launch(_rank_kind, 2, in_process=in_process)
    assert ranks == [(r, "inproc" if in_process else "gloo") for r in range(2)]


def _takes_steps(steps: int = 0) -> int:
    return steps


@pytest.mark.parametrize(
    ("fn", "kwargs", "match"),
    [
        (
            _takes_steps,
            {"colective_timeout": 3},
            r"unknown setting `colective_timeout`; did you mean `collective_timeout`",
        ),
        (_args_and_kwargs, {"colective_timeout": 3}, r"did you mean `collective_timeout`"),
        (_args_and_kwargs, {"in_proces": True}, r"did you mean `in_process`"),
        (_args_and_kwargs, {"timout": 5}, r"did you mean `timeout`"),
        (_args_and_kwargs, {"fn_kwarg": {"a": 1}}, r"did you mean `fn_kwargs`"),
        (_args_and_kwargs, {"Timeout": 5}, r"unknown setting `Timeout`; did you mean `timeout`"),
        (_takes_steps, {"stepz": 2}, r"fn _takes_steps\(steps.*cannot be called .*stepz"),
        (_takes_steps, {"fn_kwargs": {"timeout": 5}}, r"cannot be called .*timeout"),
    ],
    ids=[
        "misspelt-fn-without-it",
        "misspelt-fn-kwargs",
        "in_proces",
        "timout",
        "fn_kwarg",
        "Timeout",
        "fn-lacks-it",
        "fn_kwargs",
    ],
)
def test_launch_refuses_a_misspelt_setting_before_any_process_starts(
    monkeypatch: pytest.MonkeyPatch, fn: Callable[..., object], kwargs: dict[str, object], match: str
) -> None:
    """A keyword spelt almost like one of launch's settings, or one ``fn`` cannot take, is a
    ``TypeError`` before any process starts. Before: ``launch(fn, 2, colective_timeout=3)``
    started the world and every rank raised ``fn() got an unexpected keyword argument``;
    with an ``fn(**kwargs)`` the ranks ran with ``kwargs={'colective_timeout': 3}`` while the
    collective timeout silently stayed 30 s."""
    import diffcomm.runtime.world as W

    def no_world(*a: object, **k: object) -> None:
        raise AssertionError("a world was started")

    monkeypatch.setattr(W, "LocalWorld", no_world)
    with pytest.raises(TypeError, match=match):
        dc.launch(fn, 2, **kwargs)
    with pytest.raises(TypeError, match="`fn` must be callable"):
        dc.launch(3, 2)  # type: ignore[arg-type]


def test_launch_passes_a_keyword_spelt_like_a_setting_through_fn_kwargs() -> None:
    """The way out the refusal names: ``fn_kwargs`` takes any name of ``fn``'s own; a name
    far enough from every setting goes to ``fn`` directly."""
    out = dc.launch(_args_and_kwargs, 2, in_process=True, timeout_s=3, fn_kwargs={"timout": 5})
    assert out == [((), {"timeout_s": 3, "timout": 5})] * 2


def _rank_kind() -> tuple[int, str]:
    import torch.distributed as dist

    return dc.get_rank(), str(dist.get_backend())
