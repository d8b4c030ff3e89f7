"""A job's edges under real launchers: every row of the fault matrix, a few repetitions.

The rank programs and the judgement are ``benchmarks/bench_lifecycle.py``'s (which runs
each cell 20+ times and fills the table in docs/debugging.md); here each row runs in the
normal suite on small worlds. Every run is real processes over gloo: ``torch.multiprocessing
.spawn``, ``torchrun`` and ``LocalWorld``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import diffcomm as dc
from diffcomm import _lifecycle, _torch
from diffcomm.diagnostics import responder

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_lifecycle.py"
_spec = importlib.util.spec_from_file_location("bench_lifecycle", _BENCH)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_lifecycle"] = bench
_spec.loader.exec_module(bench)
_job_spec = importlib.util.spec_from_file_location("lifecycle_job", bench.JOB)
assert _job_spec is not None and _job_spec.loader is not None
job = importlib.util.module_from_spec(_job_spec)  # the rank program (its thread count)
_job_spec.loader.exec_module(job)

needs_torchrun = pytest.mark.skipif(shutil.which("torchrun") is None, reason="no `torchrun` on PATH")


#: the collective timeout of the cells that wait for it to fire (``reinit``: the third
#: group's desync; the culprit sleeps it + 3 s): short, as the desync worlds of
#: tests/debug/test_flight.py; the benchmark runs them at ``bench.TIMEOUT`` (5 s)
WAITED_TIMEOUT = 2.0


def _holds(launcher: str, scenario: str, world: int, reps: int = 1, timeout: float = bench.TIMEOUT) -> None:
    for _ in range(reps):
        r = bench.run_once(launcher, scenario, world, limit=150, timeout=timeout)
        ok, why, _t = bench.judge(r)
        assert ok, f"{launcher}:{scenario}:{world}: {why}\nlauncher stderr:\n{r['launcher_stderr'][-3000:]}"


@pytest.mark.parametrize(("world", "reps"), [(2, 2), (4, 1)])
def test_orderly_exit_after_every_kind_of_op_under_spawn(world: int, reps: int) -> None:
    # blocking, async, coalesced, p2p and a 1F1B step; destroy_process_group; return:
    # every rank exits 0, no signal, nothing on stderr, no diffcomm thread after destroy
    _holds("spawn", "exit", world, reps)


@needs_torchrun
def test_orderly_exit_under_torchrun() -> None:
    _holds("torchrun", "exit", 2)


def test_orderly_exit_of_a_local_world() -> None:
    _holds("localworld", "exit", 2)


@pytest.mark.waits
def test_three_groups_in_a_row_get_the_full_diagnosis() -> None:
    # the desync in the third group names the culprit and the sequence number: the
    # recorder follows the current default group (store, counters, answering thread)
    _holds("spawn", "reinit", 2, timeout=WAITED_TIMEOUT)


@pytest.mark.waits
@needs_torchrun
def test_three_groups_in_a_row_under_torchrun() -> None:
    # dc.init() keys each group's rendezvous apart on torchrun's agent store
    _holds("torchrun", "reinit", 2, timeout=WAITED_TIMEOUT)


@pytest.mark.waits
def test_three_local_worlds_in_a_row_get_the_full_diagnosis() -> None:
    _holds("localworld", "reinit", 2, timeout=WAITED_TIMEOUT)


@pytest.mark.waits
def test_sigkill_of_one_rank_names_it_on_every_survivor() -> None:
    _holds("spawn", "kill", 3)


@pytest.mark.waits
def test_sigkill_of_a_local_world_rank_names_it() -> None:
    _holds("localworld", "kill", 2)


@needs_torchrun
def test_sigterm_to_every_rank_ends_each_within_5_s_quietly() -> None:
    _holds("torchrun", "sigterm", 2)


@needs_torchrun
def test_torchrun_restart_starts_clean() -> None:
    # the first attempt's diagnosis keys and recorder state never reach the second
    _holds("torchrun", "restart", 2)


@needs_torchrun
def test_a_rank_raising_in_user_code_is_named_by_the_others() -> None:
    _holds("torchrun", "raise", 2)


@pytest.mark.waits
def test_a_local_world_rank_raising_is_named() -> None:
    _holds("localworld", "raise", 2)


def test_exit_gives_native_threads_the_gil_and_counts_only_them() -> None:
    """The atexit step that lets a c10d worker drop its finished work (a tensor's last
    reference, which needs the GIL) before the interpreter finalizes: a Python thread,
    however busy, is not waited for; the wait is bounded; without a process group it is
    skipped. (The abort it prevents, SIGABRT "terminate called without an active
    exception" from ``ProcessGroupGloo::runLoop`` -> ``~AsyncWork`` -> ``decref`` ->
    ``take_gil`` -> ``pthread_exit``, came 1 in ~40 runs of ``test_desync_under_torchrun``'s
    job under load; 0 in 160 with it.)"""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    t = threading.Thread(target=spin)
    t.start()
    try:
        seen = [_lifecycle.runnable_native_threads() for _ in range(50)]
        assert t.native_id is not None and all(t.native_id not in tids for tids in seen)
    finally:
        stop.set()
        t.join()
    if not dist.is_initialized():
        had, _lifecycle._HAD_GROUP[0] = _lifecycle._HAD_GROUP[0], False  # as if none was made
        try:
            t0 = time.monotonic()
            _lifecycle._let_native_threads_settle(limit=5.0)
            assert time.monotonic() - t0 < 0.05  # no group: nothing to wait for
        finally:
            _lifecycle._HAD_GROUP[0] = had


def test_judge_catches_what_it_claims() -> None:
    # the judgement can fail: an abort, a stray stderr line, a late survivor, a thread
    base = {
        "launcher": "spawn",
        "world": 2,
        "rc": 0,
        "rank_codes": ["0", "0"],
        "leftover": [],
        "launcher_stderr": "",
        "wall_s": 1.0,
        "restart": [],
    }
    quiet = [{"facts": {"threads_after_destroy": "0"}, "stderr": ""}] * 2
    assert bench.judge({**base, "scenario": "exit", "ranks": quiet})[0]
    loud = [quiet[0], {"facts": {"threads_after_destroy": "0"}, "stderr": "[W] recvValue failed\n"}]
    assert not bench.judge({**base, "scenario": "exit", "ranks": loud})[0]
    threads = [{"facts": {"threads_after_destroy": "1"}, "stderr": ""}] * 2
    assert not bench.judge({**base, "scenario": "exit", "ranks": threads})[0]
    assert not bench.judge({**base, "scenario": "exit", "ranks": quiet, "rank_codes": ["0", "-6"]})[0]
    late = [
        {"facts": {"names_dead": "True", "raised_after": "9.5"}, "stderr": ""},
        {"facts": {}, "stderr": ""},
    ]
    assert not bench.judge({**base, "scenario": "kill", "ranks": late, "rank_codes": ["3", "-9"]})[0]


def test_no_diffcomm_thread_outlives_its_group_in_process() -> None:
    # one process, world 1, a real gloo group: every kind of background thread started,
    # then destroy_process_group() joins them all before it returns; twice in a row
    for _ in range(2):
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            x = torch.ones(3, requires_grad=True)
            (dc.all_gather(x, async_op=True) * 2).sum().backward()
            dc.shift(x, 1).sum().backward()
            assert _lifecycle.diffcomm_threads(), "the engine or the send queue should be running"
        finally:
            dist.destroy_process_group()
        assert _lifecycle.diffcomm_threads() == [], threading.enumerate()


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="names threads from /proc/self/task")
def test_destroy_process_group_frees_the_groups_diffcomm_used() -> None:
    # the group records kept the default group (and its gloo worker threads) alive past
    # destroy_process_group() until the interpreter finalized, where a worker needing the
    # GIL aborted the process (SIGABRT under torchrun, 1 CI run in ~10)
    import gc
    import weakref

    before = job.gloo_threads()
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        sub = dist.new_group([0])
        x = torch.ones(3, requires_grad=True)
        (dc.all_gather(x) + dc.all_reduce(x, group=sub) + dc.all_gather(x, async_op=True)).sum().backward()
        dc.all_to_all(torch.ones(2, 3), input_split_sizes=[2], output_split_sizes=[2])
        refs = [weakref.ref(dist.group.WORLD), weakref.ref(sub)]
        assert job.gloo_threads() > before
        dist.destroy_process_group(sub)
        del sub
        gc.collect()
        assert refs[1]() is None, gc.get_referrers(refs[1]())
    finally:
        dist.destroy_process_group()
    gc.collect()
    assert [r() for r in refs] == [None, None], gc.get_referrers(refs[0]())
    assert job.gloo_threads() == before


def _a_destroyed_subgroup_is_freed() -> bool:
    import gc
    import weakref

    rank, world = dist.get_rank(), dist.get_world_size()
    sub = dist.new_group(list(range(world)))
    x = torch.ones(3, requires_grad=True)
    dc.all_gather(x, group=sub).sum().backward()
    dc.send(x.detach(), (rank + 1) % world, group=sub)
    dc.recv(src=(rank - 1) % world, group=sub)
    dc.wait_sends()
    ref = weakref.ref(sub)
    dist.destroy_process_group(sub)
    del sub
    gc.collect()
    dc.all_reduce(torch.ones(2))  # the default group goes on
    return ref() is None


def test_a_destroyed_subgroup_is_freed_by_diffcomm(world2: dc.LocalWorld) -> None:
    # its group record and its p2p channel numbers held it (and its gloo threads)
    assert world2.run(_a_destroyed_subgroup_is_freed) == [True, True]


def _sockets() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return n


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts sockets in /proc/self/fd")
def test_the_answering_thread_opens_no_store_connection_of_its_own() -> None:
    # every rank opening two connections to rank 0's store at each group's start made a
    # burst of connects that stalled one rank's init 5 s (the third group's first op then
    # timed out on the others: issue 31's reinit at world 4): the thread uses the group's
    # own store connection, so starting it opens no socket
    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        r = responder._RESPONDER[0]
        assert r is not None and r.thread.is_alive()
        assert r.asker is _torch.default_store()
        r.stop(wait_peers=False)
        responder._RESPONDER[0] = None
        before = _sockets()
        responder.start_responder()
        again = responder._RESPONDER[0]
        assert again is not None and again is not r and again.thread.is_alive()
        assert _sockets() == before
    finally:
        dist.destroy_process_group()
    assert _lifecycle.diffcomm_threads() == [], threading.enumerate()


_SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_soak.py"
_soak_spec = importlib.util.spec_from_file_location("bench_soak", _SOAK)
assert _soak_spec is not None and _soak_spec.loader is not None
soak = importlib.util.module_from_spec(_soak_spec)
_soak_spec.loader.exec_module(soak)


def test_soak_keeps_threads_fds_and_the_recorder_flat(world4: dc.LocalWorld) -> None:
    # a short soak of mixed ops (the benchmark runs 10,000): after warm-up the thread and
    # file-descriptor counts do not move, the recorder stays within its ring
    n = 600
    rows = soak.summarize(world4.run(soak.soak, n, 50), n)
    for row in rows:
        assert len(row["threads"]) == 1, row
        assert len(row["fds"]) == 1, row
        assert row["recorder_max"] <= row["recorder_cap"], row
        assert row["rss_growth_after_warmup_mb"] < 50, row
